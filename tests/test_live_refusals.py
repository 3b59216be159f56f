"""What the cache refuses, and what freezes it: a bad configuration or profile, a plan libllama
rejects, a device that cannot hold the slots, an architecture it does not know. Each is one line,
and decoding stays stock."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import PROMPT, greedy, load

llama_cpp = pytest.importorskip("llama_cpp")

from moecache.live import native  # noqa: E402
from moecache.live.activate import attach  # noqa: E402
from moecache.live.cache import CacheUnavailable  # noqa: E402
from moecache.live.config import ConfigError  # noqa: E402


@pytest.mark.parametrize("env,overrides,message", [
    ({"LLAMA_MOE_CACHE_SLOTS": "abc"}, {}, "LLAMA_MOE_CACHE_SLOTS='abc' is not an integer"),
    ({}, {"slots": -1}, "LLAMA_MOE_CACHE_SLOTS=-1 must be in [0, 2147483647]"),
    ({}, {"slots": 2, "inserts": 0}, "LLAMA_MOE_CACHE_INSERTS=0 must be in [1, 2147483647]"),
    ({"LLAMA_MOE_CACHE_INSERTS": str(2**31)}, {"slots": 2},
     "LLAMA_MOE_CACHE_INSERTS=2147483648 must be in [1, 2147483647]"),
    ({"LLAMA_MOE_CACHE_STATS": "/tmp/moecache-same.out", "LLAMA_MOE_CACHE_TRACE": "/tmp/../tmp/moecache-same.out"},
     {"slots": 2}, "LLAMA_MOE_CACHE_STATS and LLAMA_MOE_CACHE_TRACE name one file ('/tmp/moecache-same.out'): "
                   "give each its own"),
    ({}, {"slots": 9}, "LLAMA_MOE_CACHE_SLOTS=9 exceeds the 8 experts per layer of this model"),
    ({}, {"slots": 2, "policy": "belady"}, "only runs in offline replay"),
    ({"LLAMA_MOE_CACHE_MAX_BATCH": "8x"}, {"slots": 2}, "LLAMA_MOE_CACHE_MAX_BATCH='8x' is not an integer"),
    ({"LLAMA_MOE_CACHE_MAX_BATCH": "0"}, {"slots": 2}, "LLAMA_MOE_CACHE_MAX_BATCH=0 must be in [1, 512]"),
    ({}, {"slots": 2, "max_batch": 513}, "LLAMA_MOE_CACHE_MAX_BATCH=513 must be in [1, 512]"),
    ({"LLAMA_MOE_CACHE_REPACK": "2"}, {"slots": 2}, "LLAMA_MOE_CACHE_REPACK=2 must be in [0, 1]"),
    ({"LLAMA_MOE_CACHE_ADMISSION": "soon"}, {"slots": 2},
     "LLAMA_MOE_CACHE_ADMISSION='soon' is not a timing; choose from boundary, eager"),
    ({}, {"slots": 2, "policy": "arc", "admission": "eager"},
     "LLAMA_MOE_CACHE_ADMISSION=eager needs a policy that ranks experts; LLAMA_MOE_CACHE_POLICY='arc' picks"),
    ({}, {"slots": 2, "stats": "/nonexistent/s.json"},
     "LLAMA_MOE_CACHE_STATS='/nonexistent/s.json': directory /nonexistent does not exist"),
    ({"LLAMA_MOE_CACHE_TRACE": "/nonexistent/t.csv"}, {"slots": 2},
     "LLAMA_MOE_CACHE_TRACE='/nonexistent/t.csv': directory /nonexistent does not exist"),
    ({"LLAMA_MOE_CACHE_STATS": "/tmp"}, {"slots": 2}, "LLAMA_MOE_CACHE_STATS='/tmp': is a directory"),
    ({"LLAMA_MOE_CACHE_STATS": "/tmp/stats/"}, {"slots": 2},
     "LLAMA_MOE_CACHE_STATS='/tmp/stats/': ends with '/': a file name is needed"),
    ({"LLAMA_MOE_CACHE_STATS": "/proc/self/stats.json"}, {"slots": 2},
     "LLAMA_MOE_CACHE_STATS='/proc/self/stats.json': cannot create a file in /proc/self"),
    ({"LLAMA_MOE_CACHE_PROFILE": "/dev/null"}, {"slots": 2},
     "LLAMA_MOE_CACHE_PROFILE='/dev/null': is not a regular file"),
    ({"LLAMA_MOE_CACHE_SLOT": "2"}, {}, "LLAMA_MOE_CACHE_SLOT is not a moecache variable"),
])
def test_bad_configuration_is_one_line(monkeypatch, rpc_device, tiny_path, env, overrides, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    llm = load(tiny_path)
    with pytest.raises(ConfigError) as err:
        attach(llm, **overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    (json.dumps({"format": "moecache-profile", "version": 1, "model": "m", "n_expert": 8,
                 "layers": [0], "counts": [[1] * 8]}), "profile covers 1 layers x 8 experts"),
])
def test_a_bad_profile_releases_the_cache(tmp_path, rpc_device, tiny_path, content, message):
    """A failure after the slots are allocated frees them: decoding is stock, not an idle split."""
    profile = tmp_path / "profile.json"
    profile.write_text(content)
    llm = load(tiny_path)
    with pytest.raises(ConfigError) as err:
        attach(llm, slots=2, profile=str(profile))
    assert str(err.value).startswith("LLAMA_MOE_CACHE_PROFILE: ") and message in str(err.value)
    assert native.lib().llama_moe_cache_n_layers(native.as_context(llm.ctx), native.DEVICE) == 0


def test_a_refused_plan_freezes_the_cache_and_decoding_stays_exact(rpc_device, tiny_path):
    """libllama checks every row of a plan before applying any: a bad one (slot K) is refused
    whole, the scheduler freezes the cache with one logged line, the output stays stock."""
    stock = greedy(load(tiny_path), PROMPT, 24)
    llm = load(tiny_path)
    cache = attach(llm, slots=2, inserts=2, policy="lru", wait=1)
    step = cache.engine.step
    applied = []

    def bad_plan(ids=None, ready=None, admitted=None, **flags):
        plan = step(ids, ready, admitted, **flags)
        if plan.step == 3:
            counters = cache.engine.counters
            applied.append(int(counters["uploads"].sum() + counters["prefill_uploads"].sum()) - len(plan.upload))
            plan.upload = np.vstack([plan.upload, [[0, 1, 2]]]).astype(np.int32)  # slot 2 of K=2
        return plan

    cache.engine.step = bad_plan
    tokens, logits = greedy(llm, PROMPT, 24)
    assert cache.failed.startswith("RuntimeError: libllama refused the plan of step 3")
    assert tokens == stock[0] and np.array_equal(logits, stock[1])
    # none of step 3's rows was applied: its good uploads never started either
    assert sum(c["uploads"] for c in cache.native_counters()) == applied[0]


def test_device_allocation_failure_keeps_decode_stock(rpc_device, tiny_path):
    stock = greedy(load(tiny_path), PROMPT, 16)
    llm = load(tiny_path)
    ctx = native.as_context(llm.ctx)
    assert native.init(ctx, 1 << 30) == 0  # far beyond the device
    assert native.lib().llama_moe_cache_n_layers(ctx, native.DEVICE) == 0
    tokens, logits = greedy(llm, PROMPT, 16)
    assert tokens == stock[0] and np.array_equal(logits, stock[1])


def test_a_model_without_a_device_is_refused_and_stock(capfd, rpc_device, tiny_path):
    """Every layer on the CPU (n_gpu_layers=0): no router is on a device to cache next to, so
    attach refuses, libllama logs one line saying so, and decoding stays stock."""
    import logging

    stock = greedy(load(tiny_path, n_gpu_layers=0), PROMPT, 16)
    llm = load(tiny_path, n_gpu_layers=0)
    # llama_cpp prints llama.cpp's log to stderr only at its logger's level (ERROR unless verbose)
    logger = logging.getLogger("llama-cpp-python")
    level = logger.level
    capfd.readouterr()
    logger.setLevel(logging.WARNING)
    try:
        with pytest.raises(CacheUnavailable):
            attach(llm, slots=2)
    finally:
        logger.setLevel(level)
    lines = [line for line in capfd.readouterr().err.splitlines() if "expert cache disabled" in line]
    assert len(lines) == 1 and "router on a device" in lines[0], lines
    assert native.lib().llama_moe_cache_n_layers(native.as_context(llm.ctx), native.DEVICE) == 0
    tokens, logits = greedy(llm, PROMPT, 16)
    assert tokens == stock[0] and np.array_equal(logits, stock[1])
