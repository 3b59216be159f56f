"""The miss planner live, without its lane (issue 22): on the loopback RPC device a slow link makes
the cache decline the eager uploads that would not pay back their link time, a fast one uploads;
the output stays the stock graph's, libllama's admissions the engine's model of them (WAIT=1),
and the offline replay at the stats' rates reproduces the run. The rates are measured at
attach unless given; bad values are one-line errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import PROMPT, greedy, load

llama_cpp = pytest.importorskip("llama_cpp")

from moecache.live.activate import attach  # noqa: E402
from moecache.live.config import CacheConfig, ConfigError  # noqa: E402

SLOW = {"link_gbps": 0.05, "host_gbps": 50}   # an upload pays back 1000 uses: almost none pays
FAST = {"link_gbps": 1000, "host_gbps": 1}    # 1 use: the uploads that beat the victim by one


def test_a_slow_link_declines_uploads_a_fast_one_makes_them_and_the_replay_agrees(tmp_path, rpc_device, synth48):
    from moecache.core.missplan import Rates
    from moecache.core.traces import read_trace
    from moecache.offline.replay import PER_LAYER, simulate

    n_tokens = 64
    stock = greedy(load(synth48), PROMPT, n_tokens)
    runs = {}
    for name, rates in (("off", None), ("slow", SLOW), ("fast", FAST)):
        trace_path = tmp_path / f"{name}.route.csv"
        llm = load(synth48)
        settings = {"planner": 1, **rates} if rates else {}
        cache = attach(llm, slots=16, inserts=2, wait=1, trace=str(trace_path), **settings)
        tokens, logits = greedy(llm, PROMPT, n_tokens)
        cache.close()
        live = runs[name] = cache.stats()
        # WAIT=1: at every boundary libllama's admissions equalled the engine's model, or it froze
        assert live["failed"] is None
        assert tokens == stock[0] and np.array_equal(logits, stock[1])
        if rates is None:
            assert live["planner"] is None and "declined" not in live["layers"][0]
            continue
        assert live["planner"]["link_gbps"] == rates["link_gbps"]
        assert live["planner"]["link_source"] == "LLAMA_MOE_CACHE_LINK_GBPS"
        assert sum(layer["declined"] for layer in live["layers"]) == live["totals"]["declined"]
        # the offline planner without its lane, at the rates the stats report, is the live run
        used = Rates(**{f.name: live["planner"][f.name] for f in dataclasses.fields(Rates)})
        replayed = simulate(read_trace(str(trace_path)), PER_LAYER, "heat", 16, inserts=2, admission="eager",
                            miss_plan=used, lane=False).totals
        assert {k: replayed[k] for k in ("hits", "misses", "uploads", "declined")} == \
            {k: live["totals"][k] for k in ("hits", "misses", "uploads", "declined")}
    off, slow, fast = (runs[name]["totals"] for name in ("off", "slow", "fast"))
    print(f"decode uploads, {n_tokens} tokens, K=16: planner off {off['uploads']}, fast link {fast['uploads']} "
          f"({fast['declined']} declined), slow link {slow['uploads']} ({slow['declined']} declined)")
    assert slow["declined"] > 0 and slow["uploads"] < fast["uploads"] <= off["uploads"]
    assert runs["slow"]["link_bytes_per_token"] < runs["fast"]["link_bytes_per_token"]


def test_the_rates_are_measured_at_attach_and_printed(rpc_device, tiny_path):
    llm = load(tiny_path)
    cache = attach(llm, slots=2, planner=1)
    planner = cache.stats()["planner"]
    assert planner["link_source"].startswith("measured: median of 5 copies")
    assert planner["host_source"].startswith("measured: ")
    assert planner["link_gbps"] > 0 and planner["host_gbps"] > 0 and planner["payback_uses"] >= 1
    assert planner["dram_gbps"] >= planner["host_gbps"]
    assert any(line.startswith("moecache: miss planner: link ") for line in cache.lines())
    greedy(llm, PROMPT, 8)
    assert cache.stats()["failed"] is None


@pytest.mark.parametrize("env, message", [
    ({"LLAMA_MOE_CACHE_PLANNER": "1", "LLAMA_MOE_CACHE_LINK_GBPS": "fast"},
     "LLAMA_MOE_CACHE_LINK_GBPS='fast' is not a number"),
    ({"LLAMA_MOE_CACHE_PLANNER": "1", "LLAMA_MOE_CACHE_HOST_GBPS": "0"},
     "LLAMA_MOE_CACHE_HOST_GBPS='0' must be a finite number of GB/s > 0"),
    ({"LLAMA_MOE_CACHE_PLANNER": "1", "LLAMA_MOE_CACHE_LINK_GBPS": "nan"},
     "LLAMA_MOE_CACHE_LINK_GBPS='nan' must be a finite number of GB/s > 0"),
    ({"LLAMA_MOE_CACHE_PLANNER": "yes"}, "LLAMA_MOE_CACHE_PLANNER='yes' is not an integer"),
    ({"LLAMA_MOE_CACHE_LINK_GBPS": "4"},
     "LLAMA_MOE_CACHE_LINK_GBPS sets a rate of the miss planner, which is off: set LLAMA_MOE_CACHE_PLANNER=1"),
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
