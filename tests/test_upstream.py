"""The upstream llama.cpp MoE cache model: its rules pinned on tiny hand-made traces."""

import numpy as np
import pytest

from moecache.core.banks import equal_bytes
from moecache.core.traces import DECODE, PREFILL, RouteTrace
from moecache.offline.replay import MIB, simulate
from moecache.offline.upstream import MAX_BATCH, SlotLru, UpstreamCache, size_groups


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


def test_misses_take_empty_slots_in_ascending_expert_order():
    cache = lru(4)
    hits, fills = cache.plan(0, [5, 2, 7])
    assert hits == 0
    assert fills == [(2, 0), (5, 1), (7, 2)]  # sorted ids, slots from the head: 0, 1, 2


def test_empty_slots_go_before_lru_victims():
    cache = lru(3)
    cache.plan(0, [1])
    cache.plan(0, [2])       # slots 0, 1 used, slot 2 still empty
    _, fills = cache.plan(0, [3])
    assert fills == [(3, 2)]  # the empty slot, not expert 1's (the least recently used)
    assert resident(cache, 0) == {1: 0, 2: 1, 3: 2}


def test_hits_are_refreshed_before_misses_are_placed():
    cache = lru(3)
    cache.plan(0, [1, 2, 3])  # slots 0, 1, 2; expert 1 is the least recently used
    hits, fills = cache.plan(0, [4, 1])
    assert hits == 1
    # expert 1 moved to the tail first, so the miss evicts expert 2, the oldest after it
    assert fills == [(4, 1)]
    assert resident(cache, 0) == {1: 0, 3: 2, 4: 1}


def test_a_call_never_evicts_its_own_experts():
    cache = lru(3, n_expert=16)
    cache.plan(0, [1, 2, 3])
    hits, fills = cache.plan(0, [3, 2, 6])  # two hits and a miss: the victim must be 1
    assert hits == 2 and fills == [(6, 0)]
    hits, fills = cache.plan(0, [6, 7, 8])  # one hit: misses take 2's and 3's slots, never 6's
    assert hits == 1
    assert fills == [(7, 2), (8, 1)]  # 3's slot is the head now, then 2's
    assert resident(cache, 0) == {6: 0, 7: 2, 8: 1}


def test_another_layers_expert_is_evictable():
    cache = lru(2)
    cache.plan(0, [1, 2])
    _, fills = cache.plan(1, [5])  # layer 1 shares the group's LRU: layer 0's expert 1 goes
    assert fills == [(5, 0)]
    assert resident(cache, 0) == {2: 1}
    assert resident(cache, 1) == {5: 0}
    assert cache.key_of == [1 * 8 + 5, 0 * 8 + 2]


def test_more_distinct_experts_than_slots_is_refused():
    with pytest.raises(ValueError, match="exceed 2 slots"):
        lru(2).plan(0, [1, 2, 3])


def test_hits_and_misses_count_distinct_experts_per_ubatch_and_layer():
    cache = UpstreamCache([100, 100], n_expert=8, n_expert_used=2, budget_bytes=100 * 2 * 8)
    # two tokens selecting 3 and 4, then 3 and 5: three distinct experts, one lookup each
    assert ubatch(cache, 0, [3, 4, 3, 5], n_tokens=2) == (0, 3, 0)
    assert ubatch(cache, 0, [5, 3, 5, 3], n_tokens=2) == (2, 0, 0)


def test_large_ubatches_bypass_without_touching_the_lru():
    cache = UpstreamCache([100], n_expert=64, n_expert_used=1, budget_bytes=100 * 64)
    lru_of_layer = cache.lru(0)
    assert ubatch(cache, 0, [1, 2], n_tokens=2) == (0, 2, 0)
    order = list(lru_of_layer.order)
    ids = np.arange(MAX_BATCH + 1) % 5
    assert ubatch(cache, 0, ids, n_tokens=MAX_BATCH + 1) == (0, 0, 5)  # all read on the host
    assert list(lru_of_layer.order) == order and resident(lru_of_layer, 0) == {1: 0, 2: 1}
    assert ubatch(cache, 0, ids[:MAX_BATCH], n_tokens=MAX_BATCH) == (2, 3, 0)  # 32 still cached


def test_ubatches_whose_selections_could_exceed_the_slots_bypass():
    # 7 slots, top-2: 4 tokens could select min(4 * 2, 16) = 8 > 7 distinct experts
    cache = UpstreamCache([100], n_expert=16, n_expert_used=2, budget_bytes=900)
    assert cache.lru(0).n_slots == 7
    assert ubatch(cache, 0, [1, 2, 1, 2, 1, 2, 1, 2], n_tokens=4) == (0, 0, 2)
    assert resident(cache.lru(0), 0) == {}
    assert ubatch(cache, 0, [1, 2, 3, 1, 2, 3], n_tokens=3) == (0, 3, 0)  # 6 <= 7: cached


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
    assert cache.lru(0) is None and cache.lru(1) is not None
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
    r = simulate(t, "upstream", "upstream", 7 * 128 / MIB)
    assert (r.totals_all["hits"] - r.totals["hits"], r.totals_all["misses"] - r.totals["misses"]) == (0, 2)
    assert (r.totals["hits"], r.totals["misses"]) == (3, 1)  # 3 is the only decode miss
    assert r.totals["upload_bytes"] == r.totals["miss_bytes"] == 128
    assert r.totals["lookup_bytes"] == 4 * 128 and r.decode_steps == 4 and r.hit_rate == 0.75


def test_replay_splits_prompts_into_ubatches_and_bypasses_long_ones():
    from moecache.offline.steps import ubatches
    # 33 prompt tokens of expert 1 in one ubatch bypass the cache: nothing cached before decode
    long = trace([[[1]]] * (MAX_BATCH + 1) + [[[1]]], [PREFILL] * (MAX_BATCH + 1) + [DECODE], [128])
    r = simulate(long, "upstream", "upstream", 10 * 128 / MIB)  # 9 slots >= 8 experts
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

from moecache.core.traces import read_trace  # noqa: E402
from moecache.offline.cli import main  # noqa: E402
from moecache.offline.cost import HARDWARE  # noqa: E402

QWEN, GPTOSS = TRACES / "qwen3-30b-a3b.route.csv", TRACES / "gpt-oss-120b.route.csv"


@pytest.mark.parametrize("path, figures", [
    # K=16 and the device bytes of K=16: (heat boundary, heat eager, lru eager, the live default:
    # heat eager with the prompt warming the cache, upstream) decode hit% and MiB uploaded per
    # decode token, as docs/policies.md states them
    (QWEN, [(57.8, 108.6), (61.5, 111.9), (59.1, 206.6), (62.4, 107.0), (58.8, 327.4)]),
    (GPTOSS, [(61.2, 326.6), (64.0, 326.8), (62.7, 338.8), (65.6, 289.2), (61.7, 347.5)]),
])
def test_documented_comparison_at_k16(path, figures):
    trace = read_trace(str(path))
    runs = [simulate(trace, "per-layer", "heat", 16, prefill="off"),
            simulate(trace, "per-layer", "heat", 16, admission="eager", prefill="off"),
            simulate(trace, "per-layer", "lru", 16, admission="eager", prefill="off"),
            simulate(trace, "per-layer", "heat", 16, admission="eager", prefill="warm"),
            simulate(trace, "upstream", "upstream", equal_bytes(trace.expert_bytes, 16) / MIB)]
    assert [(round(100 * r.hit_rate, 1), round(r.upload_bytes_per_token / MIB, 1)) for r in runs] == figures


def rows_of(out, *policies):
    """The printed table rows of these policies."""
    return [line for line in out.splitlines() if line.split()[:1] and line.split()[0] in policies
            and "cache" not in line]


def test_cli_runs_both_timings_and_upstream_at_equal_bytes_with_modelled_cost(capsys, tmp_path):
    out_csv = tmp_path / "r.csv"
    assert main([str(GPTOSS), "--slots", "16", "--policies", "default,upstream",
                 "--admission", "boundary,eager", "--prefill", "off", "--link-gbps", "50", "--csv", str(out_csv)]) == 0
    out = capsys.readouterr().out
    assert "MODELLED" in out and "pcie4-x16 with link_gbps=50: host 59.7 GB/s (CPU)" in out
    # stock --cpu-moe on the trace's routing, the same figure the replay's result models
    stock = simulate(read_trace(str(GPTOSS)), "upstream", "upstream", 7274).stock_ms(
        HARDWARE["pcie4-x16"].override(link_gbps=50))
    assert f"stock --cpu-moe {stock:.2f}\n" in out
    assert [line.split()[:5] for line in rows_of(out, "default(heat)", "upstream")] == [
        ["default(heat)", "boundary", "16", "7274", "61.2"],
        ["default(heat)", "eager", "16", "7274", "64.0"],
        ["upstream", "16", "7274", "61.7", "44.6"]]
    rows = out_csv.read_text().splitlines()
    assert rows[0].split(",")[5] == "admission" and "modelled_ms_per_token" in rows[0]
    assert len(rows) == 4


def test_upstream_runs_at_a_budget_too(capsys):
    assert main([str(GPTOSS), "--budget-mib", "7715", "--policies", "upstream,lru"]) == 0
    out = capsys.readouterr().out
    assert "global cache" in out and "upstream llama.cpp cache" in out
    assert [line.split()[:4] for line in rows_of(out, "upstream")] == [
        ["upstream", "-", "7715", "63.3"]]
