"""The offline model of a model larger than RAM (python -m moecache.replay --ram-mib): the RAM tier
replayed through the engine must count what the live tier counted, stock mmap's page cache must
read the pages a hand count says, and the flags' bad values are one line."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import N_THREADS, PROMPT, TRACES, greedy, load, own_copy, replay_cli

from moecache.core.banks import ram_slots
from moecache.formats.traces import PREFILL, RouteTrace, read_trace
from moecache.offline.cli import main
from moecache.core.missplan import OUR_LAYOUT
from moecache.offline.calibration import (MEASURED, MODES, ONE_TERM, fit, host_gbps, model, nonnegative_least_squares,
                                          recorded_read_ahead)
from moecache.offline.cost import Disk, WorkTally
from moecache.offline.readahead import ROUTER_RECALL
from moecache.offline.pagecache import PAGE, ExpertLayout, LruPageCache, TwoListPageCache
from moecache.offline.replay import MIB, PageCacheReplay, PerLayerReplay, ram_tier_slots, simulate
from moecache.offline.spares import Spares

SYNTH = TRACES / "synth-qwen3-30b-a3b-L8.ram-tier.route.csv"
PROG = "python -m moecache.replay"




def ram_tier_replay(trace, ram_mib, policy="default"):
    """The RAM tier as --ram-mib replays it: RAM_MIB's K, eager admission, INSERTS = K, prompts
    looked up, its spares."""
    k = ram_tier_slots(trace, ram_mib)
    return simulate(trace, PerLayerReplay(policy, k, inserts=k, admission="eager", prefill="lookup", spares=True))


LIVE_COUNTS = ("hits", "misses", "uploads", "evictions")


def test_the_shipped_tier_trace_replays_to_the_live_tiers_counts():
    """traces/synth-qwen3-30b-a3b-L8.ram-tier.route.csv was recorded by the live tier
    (LLAMA_MOE_CACHE_RAM_MIB=932, WAIT=1, the default policy) on the 8-layer synthetic
    qwen3-30b-a3b, whose stats printed these totals (the build with a prompt's admissions from its
    last token's experts first: the routing recorded is the same)."""
    trace = read_trace(str(SYNTH))
    assert trace.phase[0] == PREFILL and int((trace.phase == PREFILL).sum()) == 73  # the prompt, one ubatch
    run = ram_tier_replay(trace, 932)
    assert run.slots == 46
    assert {name: run.totals_all[name] for name in LIVE_COUNTS} == \
        {"hits": 799, "misses": 4257, "uploads": 491, "evictions": 130}


def test_a_live_tier_trace_replays_to_the_same_counts(smol_path, tmp_path):
    """Record the live tier's routing on smol-moe, replay it: every counter the same."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from moecache.live.activate import attach
    from moecache.live.decode import greedy
    from moecache.live.placement import experts_from_file

    with experts_from_file():
        llm = llama_cpp.Llama(smol_path, n_gpu_layers=0, n_ctx=512, n_threads=N_THREADS,
                              n_threads_batch=N_THREADS, verbose=False)
    path = tmp_path / "tier.csv"
    cache = attach(llm, ram_mib=100, trace=str(path), wait=1)
    greedy(llm, PROMPT, 32)
    live = cache.stats()
    llm.close()
    assert 0 < live["totals"]["hits"] < live["totals"]["misses"] + live["totals"]["hits"]
    trace = read_trace(str(path))
    assert trace.phase[0] == PREFILL  # the prompt's ubatch, looked up by the tier, recorded as a prompt
    run = ram_tier_replay(trace, 100)
    assert run.slots == cache.slots < trace.n_expert
    assert {name: run.totals_all[name] for name in LIVE_COUNTS} == \
        {name: live["totals"][name] for name in LIVE_COUNTS}


def test_the_live_tiers_decode_reads_what_its_replay_reads(tmp_path):
    """The live tier on a model file of its own (4 layers of 64 experts, 24 kept a layer), and the
    replay of the routing it recorded: decode reads within 25% of what the model reads (21.9 against
    19.5 MB; 28.8 with the build before 8d1838e, whose prompts left no spare behind but their last
    layer's reads)."""
    pytest.importorskip("llama_cpp")
    from moecache.live.activate import attach
    from moecache.models import synth

    source = synth.synth_moe("qwen3-30b-a3b", n_layer=4, n_expert=64, n_expert_used=4, n_embd=512, n_ff_exp=512,
                             n_head=2, n_head_kv=1)
    path = own_copy(source, tmp_path / "reads.gguf")
    llm = load(path, n_gpu_layers=0, from_file=True)
    per_k = sum(layer.expert_bytes for layer in attach(llm, ram_mib=1 << 20).layers)
    llm.close()
    llm = load(path, n_gpu_layers=0, from_file=True)
    ram_mib = 24 * per_k // MIB + 1
    # (read-ahead off: a prompt reads its layers whole, as the replay without a read-ahead model has it)
    cache = attach(llm, ram_mib=ram_mib, wait=1, read_ahead=0, trace=str(tmp_path / "reads.route.csv"))
    tokens, _ = greedy(llm, PROMPT, 48)
    llm.eval(tokens[-1:])  # (the stats count a step's reads at the next step)
    live = cache.stats()["reads"]["decode"]["read_bytes"]
    llm.close()
    run = ram_tier_replay(read_trace(str(tmp_path / "reads.route.csv")), ram_mib)
    assert run.slots == cache.slots == 24
    modelled = run.disk_reads()[0]
    assert 0.8 * modelled <= live <= 1.25 * modelled, (live / 1e6, modelled / 1e6)


def test_ram_slots_is_the_live_tiers_rule():
    assert ram_slots([2654208] * 8, 128, 932 * MIB) == 46   # the plan the live tier printed: 931.5 MiB
    assert ram_slots([2654208] * 8, 128, 931 * MIB) == 45
    assert ram_slots([2654208] * 8, 128, 8 * 2654208 - 1) == 0
    assert ram_slots([10, 20], 4, 10**9) == 4              # never more than a layer has


# --- stock mmap's page cache, counted by hand ------------------------------------------------
# One MoE layer of 4 experts whose parts (gate, up, down) are 2 pages each: the file's pages are
# gate 0-7 (expert e: 2e, 2e+1), up 8-15, down 16-23.

def layout():
    return ExpertLayout([3 * 2 * PAGE], 4)


def cached(cache):
    return set(cache.cached_pages().tolist())


def test_layout_puts_each_experts_slice_where_its_tensor_has_it():
    lay = layout()
    assert lay.file_bytes == 24 * PAGE
    assert [lay.pages(0, part, 1) for part in range(3)] == [(2, 4), (10, 12), (18, 20)]


def test_page_cache_without_readahead_faults_every_page_and_lru_thrashes():
    cache = LruPageCache(layout(), 4 * PAGE, 0)
    cache.step([[0]])  # pages 0, 1, 8, 9, 16, 17 fault one by one; 16 and 17 push out 0 and 1
    assert cache.totals() == {"hits": 0, "misses": 1, "uploads": 6, "upload_bytes": 6 * PAGE, "faults": 6,
                              "lookup_bytes": 6 * PAGE, "evictions": 2}
    assert cached(cache) == {8, 9, 16, 17}
    cache.step([[0]])  # each page read pushes out the one needed next: all six fault again
    assert cache.counters["faults"] == 12 and cache.counters["misses"] == 2
    assert cached(cache) == {8, 9, 16, 17}
    roomy = LruPageCache(layout(), 6 * PAGE, 0)
    roomy.step([[0]])
    roomy.step([[0]])
    assert roomy.counters["faults"] == 6 and roomy.counters["hits"] == 1


def test_page_cache_readahead_reads_around_the_fault_and_streams_on_its_mark():
    """read_ahead_kb 8 is doubled to 16 KiB: 4 pages. A fault on page p reads [p-2, p+2) and marks
    p+1; touching the mark reads the 4 pages from the first one missing after it, marking that."""
    cache = LruPageCache(layout(), 100 * PAGE, 8)
    assert cache.ra_pages == 4
    cache.step([[1]])
    # gate 2: fault, [0, 4) read, 3 marked; 3: mark, [4, 8) read, 4 marked; up 10: fault, [8, 12),
    # 11 marked; 11: [12, 16), 12 marked; down 18: fault, [16, 20); 19: [20, 24), 20 marked
    assert cache.counters["faults"] == 3 and cache.counters["uploads"] == 24 and cache.counters["misses"] == 1
    assert cache.marked_pages().tolist() == [4, 12, 20]
    cache.step([[0]])  # all cached, no mark touched
    assert cache.counters["uploads"] == 24 and cache.counters["hits"] == 1
    cache.step([[2]])  # touches the marks 4, 12, 20: nothing after them is missing, nothing read
    assert cache.counters["uploads"] == 24 and cache.counters["hits"] == 2 and not cache.marked_pages().size


def test_a_readahead_window_larger_than_the_budget_is_cut_to_half_of_it():
    """read_ahead_kb 600000 with a 500 MiB budget made every page fault and read the whole
    window again (its own read dropped the pages the CPU read next): hours for a trace that
    replays in a second at 400000. The window is cut to half the budget, as the memory cuts it."""
    lay = ExpertLayout([3 * 64 * PAGE], 8)  # each expert's gate, up and down slices: 64 pages
    runs = {}
    for read_ahead_kb in (64, 512, 1 << 20):  # windows of 32 (the cut), 256 and 524288 pages
        cache = LruPageCache(lay, 64 * PAGE, read_ahead_kb)
        for ids in ([[0, 1]], [[2, 3]], [[0, 1]], [[4, 5]]):
            cache.step(ids)
        runs[read_ahead_kb] = (cache.ra_pages, cache.totals())
    assert runs[64][0] == runs[512][0] == runs[1 << 20][0] == 32
    assert runs[64][1] == runs[512][1] == runs[1 << 20][1]
    # uncut, the 256- and 524288-page windows faulted on each of the 1536 pages the CPU read and
    # read 295680 and 2261056 pages
    assert runs[64][1]["faults"] == 60 and runs[64][1]["uploads"] == 3786


def test_two_lists_drop_an_unused_page_before_a_used_one():
    """The kernel's two lists: a page the CPU read gets a second pass of the inactive list; a
    readahead page nobody read goes first (pure LRU drops the oldest, read or not)."""
    lay = ExpertLayout([3 * PAGE], 4)  # parts of one page: gate e at page e, up at 4 + e, down at 8 + e
    # read_ahead_kb 4, doubled: a fault on p reads [p - 1, p + 1). Expert 0 faults on 0 (reads 0, 1),
    # 4 (reads 3, 4), 8 (reads 7, 8): 6 pages in a cache of 4, 2 dropped
    for cls, kept in ((LruPageCache, {3, 4, 7, 8}), (TwoListPageCache, {0, 4, 7, 8})):
        cache = cls(lay, 4 * PAGE, 4)
        cache.step([[0]])
        assert cache.counters["faults"] == 3 and cache.counters["uploads"] == 6
        assert cache.counters["evictions"] == 2 and cached(cache) == kept, cls.name


def test_two_lists_activate_a_page_used_at_two_scans():
    lay = ExpertLayout([3 * PAGE], 4)
    cache = TwoListPageCache(lay, 3 * PAGE, 0)
    cache.step([[0]])  # pages 0, 4, 8: the cache is full
    # page 1: the scan passes 0, 4, 8 and 1 (each read once: rotated, referenced), then drops 0;
    # page 5 drops 4, page 9 drops 8
    cache.step([[1]])
    assert cached(cache) == {1, 5, 9} and cache.referenced_pages().tolist() == [1]
    cache.step([[1]])
    # page 2: page 1, read at this scan and the one before, is activated; 5, 9 and 2 rotate, 5 is
    # dropped; page 6 drops 9, page 10 drops 2
    cache.step([[2]])
    assert cache.active_pages().tolist() == [1] and cached(cache) == {1, 6, 10}
    assert cache.counters["evictions"] == 6


# --- the time model and the command line ---------------------------------------------------------

def test_disk_time_is_compute_waits_and_bytes():
    disk = Disk(gbps=1.0, read_us=50)
    # mmap: 2e6 bytes at 2 GB/s: 1 ms; 4 waits of 50 us: 0.2 ms; 3e6 bytes at 1 GB/s: 3 ms; over 2 tokens
    assert disk.token_ms(2.0, 2e6, 3e6, 4, 2) == pytest.approx((1 + 0.2 + 3) / 2)
    # the tier: 1 MB experts at 2 GB/s, 1 MB of dense weights. A pass with 3 kept and 1 miss: 0.5
    # ms dense, then max(1.5 ms kept, 0.05 + 1 ms read), then 0.5 ms for the miss; 2 kept and 2
    # misses: 0.5 + max(1, 0.05 + 2) + 1; no miss: no read, no wait; a boundary upload: 1 ms
    work = WorkTally(OUR_LAYOUT, [10**6], [10**6])
    work.add(0, 3, 0, 1)
    work.add(0, 2, 0, 2)
    work.add(0, 4, 0, 0)
    work.add_boundary_uploads(np.array([1]))
    assert disk.tier_token_ms(2.0, work, 2) == pytest.approx((2.5 + 3.55 + 2.5 + 1) / 2)
    # the reads' CPU: 4 experts read (3 misses, 1 upload), 4 MB at 0.5 ms per MB and 12 requests
    # (3 tensors an expert) at 0.1 ms each
    charged = Disk(gbps=1.0, read_us=50, read_cpu_ms_per_mb=0.5, read_cpu_ms_per_request=0.1)
    assert charged.tier_token_ms(2.0, work, 2) == pytest.approx((2.5 + 3.55 + 2.5 + 1 + 2 + 1.2) / 2)
    # every byte costs the CPU per MB, whatever page it is read in (a part of whole huge pages too)
    assert charged.read_cpu_ms(24e6, 1) == pytest.approx(24 * 0.5 + 3 * 0.1)
    run = ram_tier_replay(read_trace(str(SYNTH)), 932)
    read, waits = run.disk_reads()
    # eager, no prefetch: every read is a miss not found among the spares
    assert read == run.totals["misses"] * 2654208 - run.totals["spare_miss_bytes"] > 0
    assert run.disk_ms(5.26, Disk(0.95, 40)) == Disk(0.95, 40).tier_token_ms(5.26, run.work, run.decode_tokens)
    # never slower than reading, then computing
    assert run.disk_ms(5.26, Disk(0.95, 40)) < (
        (run.totals["lookup_bytes"] / 5.26e6 + waits * 0.04 + read / 0.95e6) / run.decode_tokens)



def test_spares_keep_what_a_step_read_and_kept_in_no_slot_oldest_dropped_first_the_first_layers_last():
    """Hand-worked: 2 layers of 8 experts, top-2, 1-byte experts, a ubatch of 2 tokens: the room is
    min(8, 2 x 2) = 4 experts, of which a decode token's reads hold one top-k (2): 2 spares."""
    spares = Spares([1, 1], n_expert=8, n_used=2, n_ubatch=2)
    assert (spares.room, spares.capacity()) == (4, 2)
    none = np.zeros((0, 3), dtype=np.int32)
    slotted = np.zeros((2, 8), dtype=bool)
    ids, hits = np.array([[1, 2], [3, 4]]), np.array([[False, True], [False, False]])
    assert not spares.found(ids, hits).any()  # nothing spare yet
    # misses 1 (layer 0), 3 and 4 (layer 1); 4 took a slot, whose victim was 5: 1, 3, 5 in that
    # order, the oldest beyond 2 dropped, the first layer's last: 3
    spares.retire(ids, hits, np.array([[1, 4, 0]]), np.array([[1, 5, 0]]), slotted)
    assert list(spares.held) == [(0, 1), (1, 5)] and spares.bytes == 2
    # layer 1 selects 5 again: found (its layer uses it: off the list), read nothing; layer 0's 2 is read
    found = spares.found(np.array([[2, 0], [5, 6]]), np.zeros((2, 2), dtype=bool))
    assert found.tolist() == [[False, False], [True, False]] and list(spares.held) == [(0, 1)]
    # a boundary upload of a spare reads nothing either
    assert spares.found_uploads(np.array([[0, 1, 1]])).tolist() == [1, 0] and not spares.held
    # a prompt (at least E ids a layer) read layer 1 whole ahead: its experts not in slots are spares,
    # and the first layer's misses, which stay (the last two)
    slotted[1, :6] = True
    spares.retire(np.tile(np.arange(8), (2, 1)), np.zeros((2, 8), dtype=bool), none, none, slotted)
    assert list(spares.held) == [(0, 6), (0, 7)]


def test_the_ram_tier_replay_reads_less_with_its_spares_and_the_same_hits():
    trace = read_trace(str(SYNTH))
    k = ram_tier_slots(trace, 932)
    plain = simulate(trace, PerLayerReplay("default", k, inserts=k, admission="eager", prefill="lookup"))
    tier = simulate(trace, PerLayerReplay("default", k, inserts=k, admission="eager", prefill="lookup", spares=True))
    assert tier.totals["hits"] == plain.totals["hits"] and tier.totals["misses"] == plain.totals["misses"]
    read, plain_read = tier.disk_reads()[0], plain.disk_reads()[0]
    assert 0 < tier.totals["spare_miss_bytes"] and read == plain_read - tier.totals["spare_miss_bytes"]
    assert read < 0.8 * plain_read
    assert tier.disk_ms(5.26, Disk(0.95, 40)) < plain.disk_ms(5.26, Disk(0.95, 40))


@pytest.mark.parametrize("costs", [{"read_cpu_ms_per_request": -0.1}, {"read_cpu_ms_per_request": float("nan")},
                                   {"read_cpu_ms_per_mb": float("inf")}])
def test_a_disk_refuses_a_negative_or_unbounded_cpu_cost(costs):
    with pytest.raises(ValueError, match="a disk needs .* CPU costs >= 0"):
        Disk(1.0, 40, **costs)


def test_page_cache_runs_through_the_one_driver():
    trace = RouteTrace.from_routing(np.array([[[0, 1]], [[0, 1]], [[2, 3]]]), 4, expert_bytes=[3 * PAGE])
    run = simulate(trace, PageCacheReplay("lru", 1.0, read_ahead_kb=0))
    assert (run.totals["hits"], run.totals["misses"], run.totals["faults"]) == (2, 4, 12)
    assert run.disk_reads() == (12 * PAGE, 12)
    with pytest.raises(ValueError, match="unknown policy 'clock' for the page-cache model; valid: lru, two-list"):
        simulate(trace, PageCacheReplay("clock", 1.0, read_ahead_kb=0))


def test_cli_prints_the_tier_beside_stock_mmap(capsys):
    assert main([str(SYNTH), "--ram-mib", "932", "--disk-gbps", "0.95", "--read-ahead-kb", "8192",
                 "--host-gbps", "5.26", "--policies", "default"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith(("RAM tier", "mmap"))]
    assert [row[:2] for row in rows] == [["RAM", "tier"], ["mmap", "lru"], ["mmap", "two-list"]]
    assert rows[0][-6:] == ["46", "83.2", "12.9", "3.7", "35.38", "28.26"]
    assert "per-layer cache" not in out  # --ram-mib alone runs no device model


def test_cli_charges_the_reads_cpu_per_request_and_per_mb(capsys):
    """--read-cpu-ms-per-request and --read-cpu-ms-per-mb time the tier as Disk.tier_token_ms does
    with both, and the table's legend names them; 0.428 ms a request is 1.284 ms an expert read."""
    assert main([str(SYNTH), "--ram-mib", "932", "--disk-gbps", "0.95", "--host-gbps", "5.26", "--policies",
                 "default", "--read-cpu-ms-per-request", "0.428", "--read-cpu-ms-per-mb", "0.106"]) == 0
    out = capsys.readouterr().out
    row = next(line.split() for line in out.splitlines() if line.startswith("RAM tier"))
    run = ram_tier_replay(read_trace(str(SYNTH)), 932)
    charged, bare = Disk(0.95, 40, 0.106, 0.428), Disk(0.95, 40)
    assert float(row[-2]) == pytest.approx(run.disk_ms(5.26, charged), abs=0.005)
    per_token = (run.disk_ms(5.26, charged) - run.disk_ms(5.26, bare)) * run.decode_tokens
    read = run.disk_reads()[0]
    assert per_token == pytest.approx(read / 2654208 * 3 * 0.428 + read / 1e6 * 0.106)
    assert "the tier's reads cost the CPU 0.106 ms per MB + 0.428 ms per request (3 an expert)" in out


@pytest.mark.parametrize("args, message", [
    (["--ram-mib", "0", "--disk-gbps", "1"], "argument --ram-mib: '0': budgets must be finite numbers > 0"),
    (["--ram-mib", "-5", "--disk-gbps", "1"], "argument --ram-mib: '-5': budgets must be finite numbers > 0"),
    (["--ram-mib", "900", "--disk-gbps", "-1"], "argument --disk-gbps: '-1' is not a decimal number of GB/s"),
    (["--ram-mib", "900", "--disk-gbps", "0"], "argument --disk-gbps: '0' must be in [0.001, 100000] GB/s"),
    (["--ram-mib", "900", "--disk-gbps", "1", "--disk-read-us", "-1"], "argument --disk-read-us: '-1': a latency"),
    (["--ram-mib", "900", "--disk-gbps", "1", "--read-ahead-kb", "-8"], "argument --read-ahead-kb: -8 must be >= 0"),
    (["--ram-mib", "900", "--disk-gbps", "1", "--read-cpu-ms-per-request", "-1"],
     "argument --read-cpu-ms-per-request: '-1': a CPU cost must be a finite number of ms per request >= 0"),
    (["--ram-mib", "900", "--disk-gbps", "1", "--read-cpu-ms-per-request", "nan"],
     "argument --read-cpu-ms-per-request: 'nan': a CPU cost must be a finite number"),
    (["--read-cpu-ms-per-request", "0.4"], "--read-cpu-ms-per-request time the --ram-mib models: give --ram-mib too"),
    (["--ram-mib", "900"], "--ram-mib needs --disk-gbps"),
    (["--disk-gbps", "1"], "--disk-gbps time the --ram-mib models: give --ram-mib too"),
    (["--ram-mib", "20", "--disk-gbps", "1"], "--ram-mib 20 keeps fewer than one expert per layer, which takes 20.2 MiB"),
    (["--ram-mib", "900", "--disk-gbps", "1", "--plot", "p.png"], "--plot draws the cache models' hit rates by size"),
])
def test_cli_bad_ram_flags_are_one_line(capsys, args, message):
    assert replay_cli(SYNTH, *args) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"{PROG}: error: {message}"), err
    assert err.count("\n") == 1


# --- the model against the benchmark's measurements ---------------------------------------------
# docs/notes/ram-read-ahead.md, "The model refitted to the build that ships", states the fitted CPU
# costs and each configuration's residual (modelled / measured - 1, %), at the best disk rate each
# run measured, with both terms and with the per-MB one alone; a change to the timeline, the
# spares' model, the traces or the inputs moves them.
QWEN3, GPT_OSS = "Qwen3-30B-A3B shape, 1600 MB", "gpt-oss-20b shape, 2100 MB"
STATED_READ_CPU = {"read_cpu_ms_per_request": 0.1527, "read_cpu_ms_per_mb": 0.1425}
STATED_RESIDUAL_PCT = {(QWEN3, "on"): 4.8, (QWEN3, "off"): -6.6, (GPT_OSS, "on"): -3.7, (GPT_OSS, "off"): 3.1}
STATED_ONE_TERM_READ_CPU_MS_PER_MB = 0.2181
STATED_ONE_TERM_RESIDUAL_PCT = {(QWEN3, "on"): -0.1, (QWEN3, "off"): -10.2, (GPT_OSS, "on"): -1.0,
                                (GPT_OSS, "off"): 6.2}
# the spares' model reads 14.0 / 11.9 MB a token on the default model where the live tier read 15.2 /
# 14.8 (read-ahead on / off; a prompt's spares live are its reads within the room less its growth,
# left out), 56.0 / 54.1 on the gpt-oss shape against 56.9 / 55.0
READ_MB_RESIDUAL = 0.20


def residuals_pct(rows):
    return {(r.measured.shape, r.mode): round(100 * r.residual, 1) for r in rows}


def squares(rows):
    return sum(r.residual ** 2 for r in rows)


def test_the_calibrated_tier_model_reproduces_the_measurements_within_its_stated_residual():
    read_cpu, rows = fit()
    assert read_cpu == pytest.approx(STATED_READ_CPU, abs=5e-4)
    assert residuals_pct(rows) == STATED_RESIDUAL_PCT
    for r in rows:  # the bytes each configuration reads are the live tier's (its stats), within 5%
        assert r.read_mb == pytest.approx(r.measured.read_mb[r.mode], rel=READ_MB_RESIDUAL), (r.measured.shape, r.mode)
    one_term, one_term_rows = fit(terms=ONE_TERM)  # the model before: one constant, per MB
    assert one_term == pytest.approx({"read_cpu_ms_per_mb": STATED_ONE_TERM_READ_CPU_MS_PER_MB}, abs=5e-4)
    assert residuals_pct(one_term_rows) == STATED_ONE_TERM_RESIDUAL_PCT
    uncharged = fit(terms=())[1]  # no CPU on a read: 9 to 19% under
    assert squares(rows) < squares(one_term_rows) < squares(uncharged) / 4


def test_the_fit_is_the_least_squares_pair_of_constants():
    """No other pair of CPU costs (a step of 0.01 ms either way in either, or both) brings the
    modelled decode closer to the measured, in squared relative residuals."""
    read_cpu, rows = fit()
    inputs = [(m, trace, host_gbps(trace, m)) for m in MEASURED for trace in [read_trace(str(TRACES / m.trace))]]

    def loss(per_request, per_mb):
        costs = {"read_cpu_ms_per_request": per_request, "read_cpu_ms_per_mb": per_mb}
        return sum(model(trace, m, host, mode, costs).residual ** 2 for m, trace, host in inputs for mode in MODES)
    best = loss(read_cpu["read_cpu_ms_per_request"], read_cpu["read_cpu_ms_per_mb"])
    assert best == pytest.approx(squares(rows))
    neighbours = [loss(read_cpu["read_cpu_ms_per_request"] + d_request, read_cpu["read_cpu_ms_per_mb"] + d_mb)
                  for d_request in (-0.01, 0, 0.01) for d_mb in (-0.01, 0, 0.01) if d_request or d_mb]
    assert best < min(neighbours)


def test_nonnegative_least_squares_keeps_every_value_at_or_above_zero():
    """Unconstrained, |x - (-1, 2)| is least at x = (-1, 2); at x >= 0 it is least at (0, 2); a
    problem whose unconstrained answer is nonnegative gets that answer."""
    identity = np.eye(2)
    assert nonnegative_least_squares(identity, np.array([-1.0, 2.0])).tolist() == [0.0, 2.0]
    assert nonnegative_least_squares(identity, np.array([-1.0, -2.0])).tolist() == [0.0, 0.0]
    a = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    assert nonnegative_least_squares(a, a @ [0.5, 0.25]) == pytest.approx([0.5, 0.25])


def test_the_router_predictor_reads_ahead_as_the_live_tier_did():
    """ROUTER_RECALL is the live tier's recall on both benchmark traces (their recorded reads)
    within 2 points, and the precision it gives is the live one's within 3 points."""
    _, rows = fit()
    for m in MEASURED:
        recall, precision = recorded_read_ahead(read_trace(str(TRACES / m.trace)))
        assert abs(recall - ROUTER_RECALL) < 0.02, m.shape
        modelled = next(r for r in rows if r.measured == m and r.mode == "on")
        assert abs(modelled.precision - precision) < 0.03, m.shape
