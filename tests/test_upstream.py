"""The upstream llama.cpp MoE cache model, both versions (b12191's ClassLRU with its CPU share,
b11480's LRU): their rules pinned on tiny hand-made traces."""

import numpy as np
import pytest

from moecache.core.banks import equal_bytes
from moecache.formats.traces import DECODE, PREFILL, RouteTrace
from moecache.offline.replay import MIB, PerLayerReplay, UpstreamReplay, fastest, simulate, tuned_upstream
from moecache.offline.upstream import (CRF_HALF_LIFE, MAX_BATCH, TUNER_SHARES, ClassLru, SlotLru, UpstreamCache,
                                       size_groups)

POOLS = [ClassLru, SlotLru]


def lru(n_slots, n_layers=2, n_expert=8):
    return SlotLru(n_slots, n_layers, n_expert)


def resident(cache, layer):
    return {int(e): int(s) for e, s in enumerate(cache.slot_of[layer]) if s >= 0}


def ubatch(cache, layer, experts, n_tokens):
    """(hits, uploads, misses read on the host) of one step."""
    before = dict(cache.counters)
    cache.step((layer, list(experts), n_tokens))
    delta = {name: cache.counters[name] - before[name] for name in before}
    return delta["hits"], delta["uploads"], delta["misses"] - delta["uploads"]


# --- both versions: the lookup and the placement ---------------------------------------------

@pytest.mark.parametrize("pool", POOLS)
def test_misses_take_empty_slots_in_ascending_expert_order(pool):
    cache = pool(4, 2, 8)
    hits, fills, cpu = cache.plan(0, [5, 2, 7])
    assert hits == 0 and cpu == []
    assert fills == [(2, 0), (5, 1), (7, 2)]  # sorted ids, slots from the lowest: 0, 1, 2


@pytest.mark.parametrize("pool", POOLS)
def test_empty_slots_go_before_victims(pool):
    cache = pool(3, 2, 8)
    cache.plan(0, [1])
    cache.plan(0, [2])       # slots 0, 1 used, slot 2 still empty
    _, fills, _ = cache.plan(0, [3])
    assert fills == [(3, 2)]  # the empty slot, not expert 1's (the least recently used)
    assert resident(cache, 0) == {1: 0, 2: 1, 3: 2}


@pytest.mark.parametrize("pool", POOLS)
def test_more_distinct_experts_than_slots_is_refused(pool):
    with pytest.raises(ValueError, match="exceed 2 slots"):
        pool(2, 2, 8).plan(0, [1, 2, 3])


@pytest.mark.parametrize("pool", POOLS)
def test_hits_and_misses_count_distinct_experts_per_ubatch_and_layer(pool):
    cache = UpstreamCache([100, 100], n_expert=8, n_expert_used=2, budget_bytes=100 * 2 * 8, pool=pool)
    # two tokens selecting 3 and 4, then 3 and 5: three distinct experts, one lookup each
    assert ubatch(cache, 0, [3, 4, 3, 5], n_tokens=2) == (0, 3, 0)
    assert ubatch(cache, 0, [5, 3, 5, 3], n_tokens=2) == (2, 0, 0)


@pytest.mark.parametrize("pool", POOLS)
def test_large_ubatches_bypass_without_touching_the_cache(pool):
    cache = UpstreamCache([100], n_expert=64, n_expert_used=1, budget_bytes=100 * 64, pool=pool)
    shared = cache.pool(0)
    assert ubatch(cache, 0, [1, 2], n_tokens=2) == (0, 2, 0)
    state = repr(vars(shared))
    ids = np.arange(MAX_BATCH + 1) % 5
    assert ubatch(cache, 0, ids, n_tokens=MAX_BATCH + 1) == (0, 0, 5)  # all read on the host
    assert repr(vars(shared)) == state  # order, clocks and counts alike
    assert ubatch(cache, 0, ids[:MAX_BATCH], n_tokens=MAX_BATCH) == (2, 3, 0)  # 32 still cached


@pytest.mark.parametrize("pool", POOLS)
def test_ubatches_whose_selections_could_exceed_the_slots_bypass(pool):
    # 7 slots, top-2: 4 tokens could select min(4 * 2, 16) = 8 > 7 distinct experts
    cache = UpstreamCache([100], n_expert=16, n_expert_used=2, budget_bytes=900, pool=pool)
    assert cache.pool(0).n_slots == 7
    assert ubatch(cache, 0, [1, 2, 1, 2, 1, 2, 1, 2], n_tokens=4) == (0, 0, 2)
    assert resident(cache.pool(0), 0) == {}
    assert ubatch(cache, 0, [1, 2, 3, 1, 2, 3], n_tokens=3) == (0, 3, 0)  # 6 <= 7: cached


# --- b11480: one LRU -----------------------------------------------------------------------

def test_lru_refreshes_hits_before_misses_are_placed():
    cache = lru(3)
    cache.plan(0, [1, 2, 3])  # slots 0, 1, 2; expert 1 is the least recently used
    hits, fills, _ = cache.plan(0, [4, 1])
    assert hits == 1
    # expert 1 moved to the tail first, so the miss evicts expert 2, the oldest after it
    assert fills == [(4, 1)]
    assert resident(cache, 0) == {1: 0, 3: 2, 4: 1}


def test_lru_never_evicts_the_calls_own_experts():
    cache = lru(3, n_expert=16)
    cache.plan(0, [1, 2, 3])
    hits, fills, _ = cache.plan(0, [3, 2, 6])  # two hits and a miss: the victim must be 1
    assert hits == 2 and fills == [(6, 0)]
    hits, fills, _ = cache.plan(0, [6, 7, 8])  # one hit: misses take 2's and 3's slots, never 6's
    assert hits == 1
    assert fills == [(7, 2), (8, 1)]  # 3's slot is the head now, then 2's
    assert resident(cache, 0) == {6: 0, 7: 2, 8: 1}


def test_lru_evicts_another_layers_expert():
    cache = lru(2)
    cache.plan(0, [1, 2])
    _, fills, _ = cache.plan(1, [5])  # layer 1 shares the group's LRU: layer 0's expert 1 goes
    assert fills == [(5, 0)]
    assert resident(cache, 0) == {2: 1}
    assert resident(cache, 1) == {5: 0}
    assert cache.key_of == [1 * 8 + 5, 0 * 8 + 2]


def test_b11480_has_no_cpu_share():
    with pytest.raises(ValueError, match="SlotLru takes a CPU share in \\[0, 1\\): 0 only"):
        SlotLru(4, 1, 8, cpu_share=0.5)


# --- b12191: ClassLRU, worked by hand --------------------------------------------------------

def decay(tokens):
    return 2.0 ** (-tokens / CRF_HALF_LIFE)


def classes(cache):
    """{class: [slots, least recently used first]} of the non-empty lists."""
    return {c: list(members) for c, members in enumerate(cache.lists) if members}


def test_the_crf_counts_uses_decayed_on_the_layers_clock_and_sets_the_class():
    cache = ClassLru(4, 2, 8)
    cache.plan(0, [1])                                  # layer 0's clock 1: CRF 1, class 0
    assert cache.clock == [1, 0] and cache.crf[1] == 1.0 and classes(cache) == {0: [0]}
    cache.plan(0, [1], n_tokens=3)                      # a 3-token call: the clock moves by 3
    assert cache.clock == [4, 0] and cache.crf[1] == pytest.approx(1 + decay(3))   # 1.98: class 0
    cache.plan(0, [1])
    assert cache.crf[1] == pytest.approx(1 + decay(1) * (1 + decay(3)))             # 2.98: class 1
    assert classes(cache) == {1: [0]} and cache.last_use[1] == 5
    cache.plan(1, [1])                                  # layer 1 has its own clock and counts
    assert cache.clock == [5, 1] and cache.crf[8 + 1] == 1.0 and classes(cache) == {0: [1], 1: [0]}


def test_a_class_is_at_most_seven():
    assert ClassLru.class_of(1.0) == 0 and ClassLru.class_of(1.99) == 0 and ClassLru.class_of(2.0) == 1
    assert ClassLru.class_of(127.9) == 6 and ClassLru.class_of(1e6) == 7
    # the most a CRF reaches, one use every token for ever, is class 7: eight classes
    assert ClassLru.class_of(1 / (1 - decay(1))) == 7


def test_the_victim_has_the_largest_age_over_two_to_its_class():
    cache = ClassLru(2, 1, 8)
    for _ in range(5):
        cache.plan(0, [1])        # clocks 1..5: CRF 4.92, class 2, last use 5
    cache.plan(0, [2])            # clock 6: class 0, last use 6
    assert classes(cache) == {0: [1], 2: [0]}
    # clock 7: expert 1's age 2 / 2^2 = 0.5, expert 2's age 1 / 2^0 = 1: the more recent one goes
    _, fills, _ = cache.plan(0, [3])
    assert fills == [(3, 1)] and resident(cache, 0) == {1: 0, 3: 1}
    for _ in range(8):
        cache.plan(0, [3])        # clocks 8..15: expert 3 used 9 times, class 3, last use 15
    # clock 16: expert 1's age 11 / 4 = 2.75 beats expert 3's 1 / 8: the frequent one's class
    # protected it only for a while
    _, fills, _ = cache.plan(0, [4])
    assert fills == [(4, 0)] and resident(cache, 0) == {3: 1, 4: 0}


def test_the_age_is_counted_on_the_victims_own_layer_clock():
    cache = ClassLru(3, 2, 8)
    cache.plan(0, [1])            # layer 0's clock 1: slot 0, class 0
    for _ in range(3):
        cache.plan(1, [2])        # layer 1's clocks 1..3: slot 1, class 1
    cache.plan(1, [3], n_tokens=30)  # layer 1's clock 33: slot 2, class 0 (behind slot 0 in its list)
    assert classes(cache) == {0: [0, 2], 1: [1]}
    # layer 0's clock 2: its expert 1 has age 1 (score 1); layer 1's expert 2 has age 30 on layer
    # 1's clock (score 15), though on layer 0's it would be -1
    _, fills, _ = cache.plan(0, [4])
    assert fills == [(4, 1)] and resident(cache, 1) == {3: 2}


def test_ties_go_to_the_lower_class_and_within_a_list_to_the_least_recently_used():
    cache = ClassLru(3, 1, 8)
    cache.plan(0, [1])            # clock 1
    cache.plan(0, [1])            # clock 2: CRF 1.99, class 0, last use 2
    cache.plan(0, [2])            # clock 3: class 0, last use 3
    cache.plan(0, [3], n_tokens=2)  # clock 5: class 0, last use 5
    assert classes(cache) == {0: [0, 1, 2]}
    _, fills, _ = cache.plan(0, [4])   # clock 6: the list's least recently used, expert 1
    assert fills == [(4, 0)]
    # a class-1 slot with age 2 ties a class-0 slot with age 1: the class-0 one goes
    cache = ClassLru(2, 1, 8)
    for _ in range(3):
        cache.plan(0, [1])        # clocks 1..3: CRF 2.98, class 1, last use 3
    cache.plan(0, [2], n_tokens=1)  # clock 4: class 0, last use 4
    _, fills, _ = cache.plan(0, [3])   # clock 5: 2 / 2 = 1 / 1
    assert fills == [(3, 1)] and resident(cache, 0) == {1: 0, 3: 1}


def test_the_crf_is_kept_across_evictions():
    cache = ClassLru(1, 1, 8)
    for _ in range(4):
        cache.plan(0, [1])        # clocks 1..4: CRF 3.97
    crf = cache.crf[1]
    cache.plan(0, [2])            # clock 5: expert 1 evicted
    assert resident(cache, 0) == {2: 0} and cache.crf[1] == crf
    _, fills, _ = cache.plan(0, [1])  # clock 6: back, its CRF decayed by 2 tokens and one more use
    assert fills == [(1, 0)] and cache.crf[1] == pytest.approx(crf * decay(2) + 1)
    assert classes(cache) == {2: [0]}  # 4.94: class 2 at once, where a new expert starts in class 0


def test_the_call_never_evicts_its_own_experts():
    cache = ClassLru(3, 1, 16)
    cache.plan(0, [1, 2, 3])      # clock 1, class 0: slots 0, 1, 2 in that order in its list
    cache.plan(0, [2, 3])         # clock 2: expert 1's slot is the least recently used
    # clock 3: expert 1 is this call's hit, so its slot (refreshed, but also the call's) is never
    # taken; of the others, 2 and 3 (same age) go in list order
    hits, fills, _ = cache.plan(0, [1, 8, 9])
    assert hits == 1 and fills == [(8, 1), (9, 2)] and resident(cache, 0) == {1: 0, 8: 1, 9: 2}


# --- b12191: the CPU share -------------------------------------------------------------------

def test_the_cpu_share_starts_once_the_cache_is_full_and_is_deterministic():
    cache = ClassLru(2, 1, 16, cpu_share=0.5)
    assert cache.plan(0, [1, 2])[1:] == ([(1, 0), (2, 1)], [])  # empty slots: every miss uploaded
    # full: of the misses that need a victim, every second one is computed on the CPU (credit
    # 0.5: 3 uploaded over expert 1; credit 1: 4 on the CPU)
    hits, fills, cpu = cache.plan(0, [4, 3])
    assert hits == 0 and fills == [(3, 0)] and cpu == [4] and cache.evictions == 1
    hits, fills, cpu = cache.plan(0, [5, 6])  # credit 0.5, then 1 again
    assert fills == [(5, 1)] and cpu == [6] and cache.evictions == 2


def test_a_cpu_share_miss_takes_no_victim_but_counts_a_use():
    cache = ClassLru(1, 1, 8, cpu_share=0.98)
    cache.plan(0, [1])
    _, fills, cpu = cache.plan(0, [2])   # credit 0.98: uploaded
    assert fills == [(2, 0)] and cpu == []
    _, fills, cpu = cache.plan(0, [1])   # credit 1.96: on the CPU, expert 2 stays
    assert fills == [] and cpu == [1] and resident(cache, 0) == {2: 0}
    assert cache.crf[1] == pytest.approx(1 + decay(2)) and cache.last_use[1] == 3


def test_the_share_over_a_run_is_f_to_within_one_miss():
    for share in TUNER_SHARES:
        cache = ClassLru(4, 1, 64, cpu_share=share)
        hits = cpu = 0
        for e in range(1000):
            n_hit, _, on_cpu = cache.plan(0, [e % 64])
            hits, cpu = hits + n_hit, cpu + len(on_cpu)
        needed_a_victim = cpu + cache.evictions  # every miss after the first 4
        assert needed_a_victim == 1000 - 4 - hits and abs(cpu - share * needed_a_victim) <= 1, share


def test_the_cpu_share_is_read_on_the_host_in_the_replay():
    cache = UpstreamCache([100], n_expert=16, n_expert_used=1, budget_bytes=300, alignment=1, cpu_share=0.5)
    assert cache.pool(0).n_slots == 2
    assert ubatch(cache, 0, [1], 1) == (0, 1, 0) and ubatch(cache, 0, [2], 1) == (0, 1, 0)
    assert ubatch(cache, 0, [3], 1) == (0, 1, 0)   # full: credit 0.5, uploaded
    assert ubatch(cache, 0, [4], 1) == (0, 0, 1)   # credit 1: read on the host
    assert cache.counters["upload_bytes"] == 300 and cache.counters["miss_bytes"] == 400


def test_budget_is_bytes_with_one_spare_slot_per_group():
    # one group: the largest n with (n + 1) slots of 100 bytes, padded to 128, in the budget
    (group,) = size_groups([100, 100], n_expert=8, n_expert_used=2, budget_bytes=1000)
    assert group.layers == (0, 1) and group.n_slots == 7  # 8 slots: PAD(800) = 896; 9: 1024
    (group,) = size_groups([100, 100], 8, 2, 1000, alignment=1)
    assert group.n_slots == 9                              # 10 slots = 1000 bytes, one spare
    (group,) = size_groups([100, 100], 8, 2, 10**9, alignment=1)
    assert group.n_slots == 16                             # never more than layers x experts


def test_groups_split_the_budget_by_host_expert_bytes():
    # layers 0, 2 have 100-byte experts, layer 1 has 300-byte ones: two groups, each given
    # the share of the budget its host experts have (6400 : 9600 of 16000 bytes)
    groups = size_groups([100, 300, 100], n_expert=32, n_expert_used=1, budget_bytes=5000, alignment=1)
    assert [(g.layers, g.expert_bytes) for g in groups] == [((0, 2), 100), ((1,), 300)]
    assert [g.n_slots for g in groups] == [2000 // 100 - 1, 3000 // 300 - 1]


def test_a_group_with_fewer_slots_than_experts_used_is_not_cached():
    # shares 400 and 3600 bytes: 3 slots for the 100-byte layer (< top-4), 11 for the others
    cache = UpstreamCache([100, 300, 300, 300], n_expert=8, n_expert_used=4, budget_bytes=4000,
                          alignment=1)
    assert [g.n_slots for g in cache.groups] == [0, 11]
    assert cache.pool(0) is None and cache.pool(1) is not None
    assert ubatch(cache, 0, [1, 2, 3, 4], n_tokens=1) == (0, 0, 4)


def trace(ids, phases, expert_bytes, n_expert=8):
    ids = np.asarray(ids, dtype=np.int32)
    n_steps, n_layers, k = ids.shape
    zeros = np.zeros(n_steps, dtype=np.int64)
    return RouteTrace(path="hand-made", model="m", arch="a", n_layer=n_layers, n_expert=n_expert,
                      n_expert_used=k, layers=np.arange(n_layers),
                      expert_bytes=np.asarray(expert_bytes, dtype=np.int64),
                      dense_bytes=np.zeros(n_layers, dtype=np.int64), turn=zeros,
                      step=np.arange(n_steps), phase=np.asarray(phases, dtype=np.int8), ids=ids,
                      weights=np.zeros(ids.shape, np.float32), residency=np.zeros(ids.shape, np.int8),
                      dropped=np.zeros(ids.shape, bool))


def test_replay_feeds_short_prompts_and_counts_decode_alone():
    # one layer, top-1, 6 slots (7 x 128 bytes with the spare); prompt [1, 2], then decode
    # 1, 3, 1, 2
    t = trace([[[1]], [[2]], [[1]], [[3]], [[1]], [[2]]],
              [PREFILL, PREFILL, DECODE, DECODE, DECODE, DECODE], [128])
    r = simulate(t, UpstreamReplay("upstream", 7 * 128 / MIB))
    assert (r.totals_all["hits"] - r.totals["hits"], r.totals_all["misses"] - r.totals["misses"]) == (0, 2)
    assert (r.totals["hits"], r.totals["misses"]) == (3, 1)  # 3 is the only decode miss
    assert r.totals["upload_bytes"] == r.totals["miss_bytes"] == 128
    assert r.totals["lookup_bytes"] == 4 * 128 and r.decode_steps == 4 and r.hit_rate == 0.75


def test_replay_splits_prompts_into_ubatches_and_bypasses_long_ones():
    from moecache.offline.steps import ubatches
    # 33 prompt tokens of expert 1 in one ubatch bypass the cache: nothing cached before decode
    long = trace([[[1]]] * (MAX_BATCH + 1) + [[[1]]], [PREFILL] * (MAX_BATCH + 1) + [DECODE], [128])
    r = simulate(long, UpstreamReplay("upstream", 10 * 128 / MIB))  # 9 slots >= 8 experts
    assert (r.totals["hits"], r.totals["uploads"]) == (0, 1)
    assert r.totals_all["misses"] - r.totals["misses"] == 1  # the bypassed prompt: one lookup
    # in ubatches of at most max_batch tokens the prompt goes through the cache
    steps = [step for _, items in ubatches(long, n_ubatch=MAX_BATCH) for step in items]
    assert [n for _, _, n in steps] == [MAX_BATCH, 1, 1]
    cache = UpstreamCache([128], 8, 1, 10 * 128)
    for step in steps:
        cache.step(step)
    assert cache.counters["hits"] == 2 and cache.counters["uploads"] == 1


def test_equal_bytes_counts_one_zero_slot_per_bank():
    # two layers of 100-byte experts share a bank: 2 x 16 slots + 1 zero slot
    assert equal_bytes([100, 300, 100], 16) == 100 * 33 + 300 * 17


# --- in the replay driver and its command line ---------------------------------------------

from conftest import TRACES  # noqa: E402

from moecache.formats.traces import read_trace  # noqa: E402
from moecache.offline.cli import main  # noqa: E402
from moecache.core.hardware import HARDWARE  # noqa: E402

QWEN, GPTOSS = TRACES / "qwen3-30b-a3b.route.csv", TRACES / "gpt-oss-120b.route.csv"


@pytest.mark.parametrize("path, figures", [
    # K=16 and the device bytes of K=16: (heat boundary, heat eager, lru eager, the live default:
    # heat eager with the prompt warming the cache, upstream b12191's ClassLRU and b11480's LRU)
    # decode hit% and MiB uploaded per decode token, as docs/notes/upstream-comparison.md states them
    (QWEN, [(57.8, 108.6), (61.5, 111.9), (59.1, 206.6), (62.4, 107.0), (64.2, 284.4), (58.8, 327.4)]),
    (GPTOSS, [(61.2, 326.6), (64.0, 326.8), (62.7, 338.8), (65.6, 289.2), (63.2, 334.3), (61.7, 347.5)]),
])
def test_documented_comparison_at_k16(path, figures):
    trace = read_trace(str(path))
    same_bytes = equal_bytes(trace.expert_bytes, 16) / MIB
    runs = [simulate(trace, PerLayerReplay("heat", 16, prefill="off")),
            simulate(trace, PerLayerReplay("heat", 16, admission="eager", prefill="off")),
            simulate(trace, PerLayerReplay("lru", 16, admission="eager", prefill="off")),
            simulate(trace, PerLayerReplay("heat", 16, admission="eager", prefill="warm")),
            simulate(trace, UpstreamReplay("upstream", same_bytes)),
            simulate(trace, UpstreamReplay("upstream-b11480", same_bytes))]
    assert [(round(100 * r.hit_rate, 1), round(r.upload_bytes_per_token / MIB, 1)) for r in runs] == figures


def test_the_tuner_runs_each_share_and_the_fastest_wins_on_each_class():
    trace = read_trace(str(GPTOSS))
    runs = tuned_upstream(trace, equal_bytes(trace.expert_bytes, 16) / MIB)
    assert [r.cpu_share for r in runs] == list(TUNER_SHARES) and runs[0].cpu_share == 0.0
    # the CPU share trades hits for link time: fewer uploads, fewer hits
    uploads = [r.upload_bytes_per_token for r in runs]
    assert uploads == sorted(uploads, reverse=True) and runs[-1].hit_rate < runs[0].hit_rate
    egpu, gen5 = HARDWARE["pcie3-x4-egpu"], HARDWARE["pcie5-x16"]
    assert fastest(runs, egpu).cpu_share == 0.98 and fastest(runs, gen5).cpu_share == 0.5
    assert fastest(runs, egpu).modelled_ms(egpu) == min(r.modelled_ms(egpu) for r in runs)
    # with a share the graph has the CPU node: its join is paid even where nothing runs there
    assert runs[1].work.layout.host_node and not runs[0].work.layout.host_node


def test_only_b12191_takes_a_cpu_share():
    trace = read_trace(str(GPTOSS))
    with pytest.raises(ValueError, match="0 only"):
        simulate(trace, UpstreamReplay("upstream-b11480", 7274, cpu_share=0.5))


def rows_of(out, *policies):
    """The printed table rows of these policies."""
    return [line for line in out.splitlines() if line.split()[:1] and line.split()[0] in policies
            and "cache" not in line]


def test_cli_runs_both_timings_and_upstream_at_equal_bytes_with_modelled_cost(capsys, tmp_path):
    out_csv = tmp_path / "r.csv"
    assert main([str(GPTOSS), "--slots", "16", "--policies", "default,upstream,upstream-b11480",
                 "--admission", "boundary,eager", "--prefill", "off", "--link-gbps", "50", "--csv", str(out_csv)]) == 0
    out = capsys.readouterr().out
    assert "MODELLED" in out and "pcie4-x16 with link_gbps=50: host 59.7 GB/s (CPU)" in out
    assert "upstream = tag b12191 (ClassLRU" in out and "upstream-b11480 = tag b11480 (one LRU)" in out
    # stock --cpu-moe on the trace's routing, the same figure the replay's result models
    stock = simulate(read_trace(str(GPTOSS)), UpstreamReplay("upstream", 7274)).stock_ms(
        HARDWARE["pcie4-x16"].override(link_gbps=50))
    assert f"stock --cpu-moe {stock:.2f}\n" in out
    assert [line.split()[:6] for line in rows_of(out, "default(heat)", "upstream", "upstream-b11480")] == [
        ["default(heat)", "boundary", "16", "7274", "61.2", "61.2"],
        ["default(heat)", "eager", "16", "7274", "64.0", "64.0"],
        ["upstream", "16", "7274", "0", "63.2", "45.7"],
        ["upstream-b11480", "16", "7274", "0", "61.7", "44.6"]]
    rows = out_csv.read_text().splitlines()
    assert rows[0].split(",")[5] == "admission" and "modelled_ms_per_token" in rows[0]
    assert rows[0].endswith(",cpu_share") and rows[3].endswith(",0.0") and len(rows) == 5


def test_cli_runs_b12191_at_each_cpu_share(capsys):
    assert main([str(GPTOSS), "--slots", "8", "--policies", "upstream,upstream-b11480", "--cpu-share", "tuned"]) == 0
    rows = [line.split()[:4] for line in rows_of(capsys.readouterr().out, "upstream", "upstream-b11480")]
    assert rows == [["upstream", "8", "3643", f"{share:g}"] for share in TUNER_SHARES] + \
        [["upstream-b11480", "8", "3643", "0"]]
    assert main([str(GPTOSS), "--slots", "8", "--policies", "upstream", "--cpu-share", "0.5,0.9"]) == 0
    assert [line.split()[3] for line in rows_of(capsys.readouterr().out, "upstream")] == ["0.5", "0.9"]
    for bad in ("1", "-0.1", "x"):
        with pytest.raises(SystemExit):
            main([str(GPTOSS), "--slots", "8", "--policies", "upstream", "--cpu-share", bad])
    assert main([str(GPTOSS), "--slots", "8", "--policies", "lru", "--cpu-share", "0.5"]) == 2
    assert "--cpu-share is b12191's" in capsys.readouterr().err


def test_upstream_runs_at_a_budget_too(capsys):
    assert main([str(GPTOSS), "--budget-mib", "7715", "--policies", "upstream,upstream-b11480,lru"]) == 0
    out = capsys.readouterr().out
    assert "global cache" in out and "upstream llama.cpp cache" in out
    assert [line.split()[:5] for line in rows_of(out, "upstream", "upstream-b11480")] == [
        ["upstream", "-", "7715", "0", "64.1"], ["upstream-b11480", "-", "7715", "0", "63.3"]]
