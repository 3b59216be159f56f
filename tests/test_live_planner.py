"""The miss planner live (issue 22): on the loopback RPC device a slow link keeps every miss on the
CPU and declines the eager uploads that would not pay back their link time; a fast one sends
misses through the copy-on-miss lane (copied during the graph that missed them, computed on the
device in it). The output stays the stock graph's, libllama's slot writes and declined uploads the
engine's model of them (WAIT=1), its own lane counters the engine's, and the offline replay at the
stats' rates reproduces the run (the declined uploads, which the engine takes from libllama, too). The rates are measured at attach unless given; bad values are one-line
errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import PROMPT, greedy, load, unreported_lane

llama_cpp = pytest.importorskip("llama_cpp")

from moecache.live.activate import attach  # noqa: E402
from moecache.live.config import CacheConfig, ConfigError  # noqa: E402

SLOW = {"link_gbps": 0.05, "host_gbps": 50}   # no lane; an upload pays back 1000 uses: almost none pays
FAST = {"link_gbps": 1000, "host_gbps": 1}    # the lane: a copy costs less than the CPU's read
COUNTED = ("hits", "misses", "uploads", "declined", "lane_misses")


def test_a_slow_link_keeps_misses_on_the_cpu_a_fast_one_sends_them_through_the_lane(tmp_path, rpc_device, synth48):
    from moecache.core.missplan import Rates
    from moecache.formats.traces import read_trace
    from moecache.offline.replay import PerLayerReplay, simulate

    n_tokens = 64
    stock = greedy(load(synth48), PROMPT, n_tokens)
    runs = {}
    for name, rates in (("off", None), ("slow", SLOW), ("fast", FAST)):
        trace_path = tmp_path / f"{name}.route.csv"
        llm = load(synth48)
        settings = {"planner": 1, **rates} if rates else {"planner": 0}
        cache = attach(llm, slots=16, inserts=2, wait=1, trace=str(trace_path), **settings)
        tokens, logits = greedy(llm, PROMPT, n_tokens)
        native, last = cache.native_counters(), unreported_lane(cache)
        cache.close()
        live = runs[name] = cache.stats()
        # WAIT=1: at every boundary libllama's slot writes and the uploads its margin declined equalled
        # the engine's model, or it froze
        assert live["failed"] is None
        assert tokens == stock[0] and np.array_equal(logits, stock[1])
        if rates is None:
            assert live["planner"] is None and "lane_misses" not in live["layers"][0]
            assert all(layer["lane"] == 0 for layer in native)
            continue
        assert live["planner"]["link_gbps"] == rates["link_gbps"]
        assert live["planner"]["link_source"] == "LLAMA_MOE_CACHE_LINK_GBPS"
        # libllama counted the lane's misses itself (its observers'): the engine's count of its rows,
        # and the last graph's, which no boundary reported
        assert [layer["lane"] for layer in native] == \
            [layer["lane_misses"] + int(n) for layer, n in zip(live["layers"], last)]
        assert sum(layer["declined"] for layer in live["layers"]) == live["totals"]["declined"]
        # the offline planner at the rates the stats report is the live run
        used = Rates(**{f.name: live["planner"][f.name] for f in dataclasses.fields(Rates)})
        replayed = simulate(read_trace(str(trace_path)),
                            PerLayerReplay("heat", 16, inserts=2, admission="eager", miss_plan=used)).totals
        assert {k: replayed[k] for k in COUNTED} == {k: live["totals"][k] for k in COUNTED}
    off, slow, fast = (runs[name]["totals"] for name in ("off", "slow", "fast"))
    print(f"decode, {n_tokens} tokens, K=16: planner off {off['misses']} misses, {off['uploads']} uploads; "
          f"fast link {fast['lane_misses']} of {fast['misses']} misses through the lane, {fast['uploads']} uploads "
          f"({fast['declined']} declined); slow link {slow['lane_misses']} through the lane, {slow['uploads']} "
          f"uploads ({slow['declined']} declined)")
    assert slow["lane_misses"] == 0 and fast["lane_misses"] > 0
    assert slow["declined"] > 0 and slow["uploads"] < fast["uploads"]
    assert runs["slow"]["link_bytes_per_token"] < runs["fast"]["link_bytes_per_token"]


def test_the_rates_are_measured_at_attach_and_printed(rpc_device, tiny_path):
    llm = load(tiny_path)
    cache = attach(llm, slots=2, planner=1)
    planner = cache.stats()["planner"]
    assert planner["link_source"].startswith("measured: median of 5 copies")
    assert planner["host_source"].startswith("measured: ")
    assert planner["link_gbps"] > 0 and planner["host_gbps"] > 0 and planner["payback_uses"] >= 1
    assert planner["dram_gbps"] >= planner["host_gbps"]
    # measured beside the link, for calibration: the ids' trip back; the RPC device has no pinned memory
    assert planner["ids_trip_measured_us"] > 0 and planner["link_pinned_gbps"] is None
    assert any(line.startswith("moecache: miss planner: link ") for line in cache.lines())
    greedy(llm, PROMPT, 8)
    assert cache.stats()["failed"] is None


@pytest.mark.parametrize("env, planner", [
    ({}, 1),                                                   # the default: heat, eager
    ({"LLAMA_MOE_CACHE_POLICY": "lfu"}, 1),
    ({"LLAMA_MOE_CACHE_POLICY": "lru"}, 0),                    # its worth counts no uses
    ({"LLAMA_MOE_CACHE_ADMISSION": "boundary"}, 0),
    ({"LLAMA_MOE_CACHE_RAM_MIB": "64"}, 0),                    # the RAM tier's reads are not planned
    ({"LLAMA_MOE_CACHE_PLANNER": "0"}, 0),
])
def test_the_planner_runs_by_default_wherever_it_can(env, planner):
    assert CacheConfig.from_env(env).planner == planner


@pytest.mark.parametrize("env, message", [
    ({"LLAMA_MOE_CACHE_PLANNER": "1", "LLAMA_MOE_CACHE_LINK_GBPS": "fast"},
     "LLAMA_MOE_CACHE_LINK_GBPS='fast' is not a decimal number of GB/s"),
    ({"LLAMA_MOE_CACHE_PLANNER": "1", "LLAMA_MOE_CACHE_HOST_GBPS": "0"},
     "LLAMA_MOE_CACHE_HOST_GBPS='0' must be in [0.001, 100000] GB/s"),
    ({"LLAMA_MOE_CACHE_PLANNER": "1", "LLAMA_MOE_CACHE_LINK_GBPS": "nan"},
     "LLAMA_MOE_CACHE_LINK_GBPS='nan' is not a decimal number of GB/s"),
    # the probe's: the planner paid back "inf uses" and the stats JSON held Infinity
    ({"LLAMA_MOE_CACHE_PLANNER": "1", "LLAMA_MOE_CACHE_LINK_GBPS": "5e-324"},
     "LLAMA_MOE_CACHE_LINK_GBPS='5e-324' is not a decimal number of GB/s"),
    ({"LLAMA_MOE_CACHE_PLANNER": "1", "LLAMA_MOE_CACHE_HOST_GBPS": "1e308"},
     "LLAMA_MOE_CACHE_HOST_GBPS='1e308' is not a decimal number of GB/s"),
    ({"LLAMA_MOE_CACHE_PLANNER": "1", "LLAMA_MOE_CACHE_HOST_GBPS": "1" + "0" * 400},  # inf as a float
     "LLAMA_MOE_CACHE_HOST_GBPS='100000000000000000000000000000000000... must be in [0.001, 100000] GB/s"),
    ({"LLAMA_MOE_CACHE_PLANNER": "1", "LLAMA_MOE_CACHE_LINK_GBPS": "0.0001"},
     "LLAMA_MOE_CACHE_LINK_GBPS='0.0001' must be in [0.001, 100000] GB/s"),
    # what the integer variables refuse: '_' between digits, other scripts' digits, spaces
    ({"LLAMA_MOE_CACHE_PLANNER": "1", "LLAMA_MOE_CACHE_LINK_GBPS": "1_0"},
     "LLAMA_MOE_CACHE_LINK_GBPS='1_0' is not a decimal number of GB/s"),
    ({"LLAMA_MOE_CACHE_PLANNER": "1", "LLAMA_MOE_CACHE_LINK_GBPS": "\u0665"},
     "LLAMA_MOE_CACHE_LINK_GBPS='\u0665' is not a decimal number of GB/s"),
    ({"LLAMA_MOE_CACHE_PLANNER": "1", "LLAMA_MOE_CACHE_HOST_GBPS": " 5 "},
     "LLAMA_MOE_CACHE_HOST_GBPS=' 5 ' is not a decimal number of GB/s"),
    ({"LLAMA_MOE_CACHE_PLANNER": "yes"}, "LLAMA_MOE_CACHE_PLANNER='yes' is not an integer"),
    ({"LLAMA_MOE_CACHE_PLANNER": "0", "LLAMA_MOE_CACHE_LINK_GBPS": "4"},
     "LLAMA_MOE_CACHE_LINK_GBPS sets a rate of the miss planner, which is off (LLAMA_MOE_CACHE_PLANNER=0)"),
    ({"LLAMA_MOE_CACHE_POLICY": "lru", "LLAMA_MOE_CACHE_HOST_GBPS": "4"},
     "LLAMA_MOE_CACHE_HOST_GBPS sets a rate of the miss planner, which is off for LLAMA_MOE_CACHE_POLICY=lru"),
    ({"LLAMA_MOE_CACHE_PLANNER": "1", "LLAMA_MOE_CACHE_POLICY": "lru"},
     "LLAMA_MOE_CACHE_PLANNER=1 needs eager admission and a policy whose worth counts uses"),
    ({"LLAMA_MOE_CACHE_PLANNER": "1", "LLAMA_MOE_CACHE_ADMISSION": "boundary"},
     "LLAMA_MOE_CACHE_PLANNER=1 needs eager admission"),
    ({"LLAMA_MOE_CACHE_PLANNER": "1", "LLAMA_MOE_CACHE_RAM_MIB": "64"},
     "LLAMA_MOE_CACHE_PLANNER=1 does not plan with the RAM tier"),
])
def test_bad_planner_settings_are_one_line_errors(env, message):
    with pytest.raises(ConfigError) as e:
        CacheConfig.from_env(env)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_run_py_takes_the_planner_flags():
    from moecache.live.cli import parse_args

    args = parse_args(["--planner", "1", "--link-gbps", "3.5", "--host-gbps", "40"])
    assert (args.planner, args.link_gbps, args.host_gbps) == (1, 3.5, 40.0)
    with pytest.raises(SystemExit):
        parse_args(["--link-gbps", "-2"])
