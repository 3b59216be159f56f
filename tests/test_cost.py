"""The per-layer timeline of a decode token (moecache.core.missplan.Rates.layer_ms and
moecache.offline.cost): each formula on small cases computed by hand, the hardware classes,
and --hardware on the command line."""

import pytest
from conftest import TRACES

from moecache.core.hardware import DEFAULT_HARDWARE, HARDWARE, ddr_peak_gbps, pcie_peak_gbps
from moecache.core.missplan import OUR_LAYOUT, STOCK_LAYOUT, UPSTREAM_LAYOUT, Rates
from moecache.offline.cli import main
from moecache.offline.cost import WorkTally

MB = 1e6
# host 50 GB/s: 1 MB in 0.02 ms; link 25: 0.04 ms; dram 80: 0.0125 ms; device 500: 0.002 ms
RATES = Rates(host_gbps=50, link_gbps=25, dram_gbps=80, device_gbps=500, ids_trip_us=10, join_us=5)
DENSE = 5 * MB  # the router: 5 MB / 500 GB/s = 0.01 ms


def layer(layout, hits=0, lane=0, cpu=0, rates=RATES):
    return rates.layer_ms(layout, MB, DENSE, hits, lane, cpu)


def test_stock_waits_for_the_ids_reads_every_expert_on_the_cpu_and_joins():
    # router 0.01 + ids 0.01 + 4 MB / 50 GB/s 0.08 + join 0.005
    assert layer(STOCK_LAYOUT, cpu=4) == pytest.approx(0.105)


def test_our_hits_run_beside_the_cpu_misses():
    # CPU branch: 0.01 + 0.01 + 0.02 + 0.005; device branch: 3 hits, 0.006 from the router on
    assert layer(OUR_LAYOUT, hits=3, cpu=1) == pytest.approx(0.01 + 0.035)
    # 30 hits (0.06 ms) outlast the CPU's branch
    assert layer(OUR_LAYOUT, hits=30, cpu=1) == pytest.approx(0.01 + 0.06)
    # every expert a hit: the static graph still sends the ids over and joins
    assert layer(OUR_LAYOUT, hits=6) == pytest.approx(0.01 + max(0.015, 0.012))


def test_the_lane_copies_beside_the_cpu_then_the_device_computes_after_it():
    # host window: max(1 MB / 50, 1 MB / 25, 2 MB / 80) = 0.04; device after ids + copy: 3 x 0.002
    assert layer(OUR_LAYOUT, hits=2, lane=1, cpu=1) == pytest.approx(0.01 + 0.01 + 0.04 + 0.006)


def test_cpu_and_dma_share_host_memory():
    shared = Rates(host_gbps=50, link_gbps=25, dram_gbps=60, device_gbps=500, ids_trip_us=0, join_us=0)
    # 3 MB on the CPU (0.06 ms) and 1 MB copied (0.04 ms) alone; together 4 MB / 60 GB/s
    assert shared.host_ms(3 * MB, 1 * MB) == pytest.approx(4 / 60)
    assert shared.host_ms(3 * MB, 0) == pytest.approx(0.06)


def test_upstream_copies_synchronously_then_computes_every_expert():
    # ids 0.01, copy 0.04, then 3 experts on the device; no CPU node, no join
    assert layer(UPSTREAM_LAYOUT, hits=2, lane=1) == pytest.approx(0.01 + 0.01 + 0.04 + 0.006)
    # all hits: it still reads the ids back before computing
    assert layer(UPSTREAM_LAYOUT, hits=3) == pytest.approx(0.01 + 0.01 + 0.006)
    # a bypassed layer runs as stock
    assert layer(UPSTREAM_LAYOUT, cpu=4) == pytest.approx(layer(STOCK_LAYOUT, cpu=4))


def test_bad_rates_are_refused():
    for name, bad in (("link_gbps", 0), ("host_gbps", float("inf")), ("ids_trip_us", -1), ("dram_gbps", float("nan"))):
        fields = dict(host_gbps=50, link_gbps=25, dram_gbps=80, device_gbps=500, ids_trip_us=10, join_us=5)
        fields[name] = bad
        with pytest.raises(ValueError, match=name):
            Rates(**fields)


def test_a_token_is_its_layers_unless_the_background_uploads_outgrow_the_link_or_host_memory():
    tally = WorkTally(OUR_LAYOUT, [MB, 2 * MB], [DENSE, DENSE])
    tally.add_layers([1, 0], [0, 0], [1, 2])   # token 1
    tally.add_layers([1, 0], [0, 0], [1, 2])   # token 2
    # layer 0: 0.01 + max(0.01 + 0.02 + 0.005, 0.002); layer 1: 0.01 + 0.01 + 4 MB / 50 + 0.005
    per_token = 0.045 + 0.105
    assert tally.token_ms(RATES, 2) == pytest.approx(per_token)
    tally.add_async([10, 0])                  # 10 MB over the run: 0.4 ms of link, beyond 2 tokens
    assert tally.token_ms(RATES, 2) == pytest.approx(10 * MB / 25e6 / 2)
    # stock on the same passes: every expert on the CPU
    assert tally.as_stock().token_ms(RATES, 2) == pytest.approx(
        layer(STOCK_LAYOUT, cpu=2) + RATES.layer_ms(STOCK_LAYOUT, 2 * MB, DENSE, 0, 0, 2))


def test_a_tokens_breakdown_is_its_terms_per_token():
    tally = WorkTally(OUR_LAYOUT, [MB, 2 * MB], [DENSE, DENSE])
    tally.add_layers([1, 0], [1, 0], [1, 2])   # token 1: layer 0 a hit, a lane copy, a CPU miss
    tally.add_layers([0, 1], [0, 0], [2, 1])   # token 2
    tally.add_async([3, 0])
    terms = tally.breakdown(RATES, 2)
    assert tally.token_ms(RATES, 2) == max(terms["layers"], terms["link"], terms["dram"])
    assert (terms["hits"], terms["lane"], terms["cpu"]) == (1.0, 0.5, 3.0)
    assert terms["router"] == pytest.approx(4 * 0.01 / 2)
    assert terms["joins"] == pytest.approx(4 * 0.005 / 2)  # our graph always has the CPU node
    # CPU reads: 1 + 2 MB of layer 0, 4 + 2 MB of layer 1: 9 MB at 50 GB/s; the lane's 1 MB at 25
    assert terms["cpu reads"] == pytest.approx(9 * MB / 50e6 / 2)
    assert terms["lane copies"] == pytest.approx(MB / 25e6 / 2)
    assert terms["link"] == pytest.approx(4 * MB / 25e6 / 2) and terms["dram"] == pytest.approx(13 * MB / 80e6 / 2)
    assert terms["device"] == pytest.approx((2 * MB + 2 * MB) / 500e6 / 2)
    # the window: each pass's ids trip and the host's reads and copies beside each other
    window = sum(0.01 + float(RATES.host_ms(cpu, lane)) for cpu, lane in
                 ((MB, MB), (4 * MB, 0), (2 * MB, 0), (2 * MB, 0)))
    assert terms["window"] == pytest.approx(window / 2)


def test_hardware_classes_follow_their_peaks_and_stated_efficiencies():
    assert set(HARDWARE) >= {"pcie3-x4-egpu", "pcie4-x16", "pcie5-x16"} and DEFAULT_HARDWARE == "pcie4-x16"
    assert ddr_peak_gbps(3200) == pytest.approx(51.2) and ddr_peak_gbps(5600) == pytest.approx(89.6)
    assert pcie_peak_gbps(16, 16) == pytest.approx(31.5, abs=0.01)
    assert pcie_peak_gbps(8, 4) == pytest.approx(3.94, abs=0.01)
    egpu, x16, gen5 = (HARDWARE[n].rates for n in ("pcie3-x4-egpu", "pcie4-x16", "pcie5-x16"))
    assert egpu.link_gbps < x16.link_gbps < gen5.link_gbps
    assert egpu.host_gbps < x16.host_gbps < gen5.host_gbps
    for h in HARDWARE.values():  # host memory serves the CPU and DMA together at least as fast as the CPU alone
        assert h.rates.host_gbps <= h.rates.dram_gbps and h.sources
    assert x16.link_gbps == pytest.approx(0.8 * 31.5, abs=0.02)


GPTOSS = TRACES / "gpt-oss-120b.route.csv"


def test_the_command_line_prints_the_hardware_class_and_takes_explicit_rates(capsys):
    args = [str(GPTOSS), "--slots", "8", "--policies", "upstream"]
    assert main(args + ["--hardware", "pcie3-x4-egpu"]) == 0
    egpu = capsys.readouterr().out
    assert "pcie3-x4-egpu: host 34.1 GB/s (CPU), dram 41.0 (CPU + DMA), link 3.2" in egpu
    assert main(args + ["--hardware", "pcie3-x4-egpu", "--link-gbps", "1000", "--ids-trip-us", "0"]) == 0
    fast = capsys.readouterr().out
    assert "pcie3-x4-egpu with link_gbps=1000, ids_trip_us=0" in fast

    def upstream_ms(out):
        return float(next(line for line in out.splitlines()
                          if line.startswith("upstream ") and "cache" not in line).split()[-2])
    # its synchronous copies were the eGPU's time; host memory (41 GB/s) now bounds them
    assert upstream_ms(fast) < upstream_ms(egpu) / 5


def test_the_comparison_script_ends_with_the_geomean_line(capsys):
    """scripts/compare_upstream.py's issue-22 grid on a small routing: one row per (K, class)
    and its last line in the issue's form, computed from the rows."""
    import importlib.util
    import math
    import re
    from pathlib import Path

    from moecache.formats.traces import RouteTrace, synthetic_routing

    script = Path(__file__).resolve().parents[1] / "scripts" / "compare_upstream.py"
    spec = importlib.util.spec_from_file_location("compare_upstream", script)
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    trace = RouteTrace.from_routing(synthetic_routing(32, 3, 16, 2, seed=1), 16,
                                    expert_bytes=[4 * 10 ** 6] * 3, name="small")
    compare.timeline_grid([trace], sizes=(4, 8))
    lines = capsys.readouterr().out.strip().splitlines()
    rows = [line for line in lines if line.startswith("| small |")]
    assert len(rows) == 2 * len(HARDWARE)
    ratios = [float(row.strip("|").split("|")[-1]) for row in rows]
    match = re.fullmatch(r"geomean ours/min\(stock,upstream\) = (\d\.\d\d) over (\d+) cells, (\d+) cells above 1\.0",
                         lines[-1])
    assert match and int(match[2]) == len(rows) and int(match[3]) == sum(r > 1.0 for r in ratios)
    assert float(match[1]) == pytest.approx(math.exp(sum(map(math.log, ratios)) / len(ratios)), abs=0.01)


def test_upstream_with_a_cpu_share_computes_misses_beside_its_copies_and_joins():
    from moecache.core.missplan import UPSTREAM_CPU_SHARE_LAYOUT
    # ids 0.01; the CPU's miss (0.02) beside the copy (0.04); the device after the copy: 3 x 0.002;
    # the CPU's branch ends at 0.01 + 0.04 + 0.005, before the device's
    assert layer(UPSTREAM_CPU_SHARE_LAYOUT, hits=2, lane=1, cpu=1) == pytest.approx(0.01 + 0.01 + 0.04 + 0.006)
    # a slow CPU share outlasts the device: its join is on the critical path
    assert layer(UPSTREAM_CPU_SHARE_LAYOUT, hits=1, cpu=4) == pytest.approx(0.01 + 0.01 + 0.08 + 0.005)
    # all hits: the graph's CPU node still sends its (empty) result back
    assert layer(UPSTREAM_CPU_SHARE_LAYOUT, hits=1) == pytest.approx(0.01 + 0.01 + 0.005)
