"""What a live cache writes: a trace that replays to its hit count, debug lines, stats and a
profile that warms the next run; a failing write, or a crash, loses only what it must."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from conftest import PROMPT, REPO, greedy, load, moecache_log_lines, record_plans, replayed_as_live

llama_cpp = pytest.importorskip("llama_cpp")

from moecache.formats.profile import UsageProfile  # noqa: E402
from moecache.formats.traces import read_trace  # noqa: E402
from moecache.live.activate import attach  # noqa: E402


@pytest.mark.parametrize("policy", ["lru", "default"])
def test_live_trace_replays_to_the_live_hit_count(tmp_path, rpc_device, smol_path, policy):
    from moecache.offline.replay import PerLayerReplay, simulate

    trace_path = tmp_path / "live.route.csv"
    llm = load(smol_path)
    cache = attach(llm, slots=2, inserts=1, policy=policy, trace=str(trace_path), wait=1)
    greedy(llm, PROMPT, 48)
    cache.close()
    live = cache.stats()["totals"]

    trace = read_trace(str(trace_path))
    assert int((trace.residency[trace.phase == 1] > 0).sum()) == live["hits"]
    replayed = simulate(trace, PerLayerReplay(cache.config.policy, 2, inserts=1, **replayed_as_live(cache))).totals
    assert (replayed["hits"], replayed["misses"]) == (live["hits"], live["misses"])


def test_debug_stats_go_to_stderr(capfd, rpc_device, tiny_path):
    llm = load(tiny_path)
    cache = attach(llm, slots=2, debug=8)
    greedy(llm, PROMPT, 20)
    cache.close()
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("moecache: ")]
    assert len(lines) >= 3  # every 8 steps and at close
    assert "decode steps (" in lines[-1] and "hit rate" in lines[-1]


def test_profile_warms_the_next_run(tmp_path, rpc_device, tiny_path):
    profile = tmp_path / "profile.json"
    first = load(tiny_path)
    # waiting makes the uploads due at a boundary published there, whatever the timing
    cold = attach(first, slots=4, profile=str(profile), wait=1)
    first_plans = record_plans(cold)
    greedy(first, PROMPT, 24)
    cold.close()
    assert profile.exists()

    second = load(tiny_path)
    warm = attach(second, slots=4, profile=str(profile), wait=1)
    # the default policy starts from the profile's counts: most used, hottest
    saved = UsageProfile.load(str(profile)).counts
    heat = warm.engine.policy.scaled
    assert warm.config.policy == "heat" and (np.argsort(-heat, axis=1, kind="stable")[:, 0] ==
                                              np.argsort(-saved, axis=1, kind="stable")[:, 0]).all()
    second_plans = record_plans(warm)
    greedy(second, PROMPT, 24)
    # preloaded at the first boundary, published at the second: they serve from the second step on
    early = lambda plans: [int(p.hits.sum()) for p in plans if p.hit_mask is not None][:4]  # noqa: E731
    cold_hits, warm_hits = early(first_plans), early(second_plans)
    assert cold_hits[0] == warm_hits[0] == 0
    assert sum(warm_hits) > sum(cold_hits), (cold_hits, warm_hits)


@pytest.mark.parametrize("broken", ["stats", "profile"])
def test_a_failing_report_write_keeps_the_other(tmp_path, caplog, rpc_device, tiny_path, broken):
    """The stats and the profile are written independently: one that cannot be written (its
    path became a directory after the check) is one error line, the other is still saved."""
    paths = {"stats": tmp_path / "stats.json", "profile": tmp_path / "profile.json"}
    llm = load(tiny_path)
    # max_batch=1: the prompt stays stock, every step one token (the counts below)
    cache = attach(llm, slots=2, stats=str(paths["stats"]), profile=str(paths["profile"]), flush_steps=0,
                   max_batch=1)
    greedy(llm, PROMPT, 8)
    paths[broken].mkdir()
    with moecache_log_lines(caplog):
        cache.close()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith(f"moecache: error: LLAMA_MOE_CACHE_{broken.upper()}="), errors
    if broken == "stats":
        assert UsageProfile.load(str(paths["profile"])).counts.sum() == 7 * 2 * 2  # steps x layers x k
    else:
        assert json.loads(paths["stats"].read_text())["decode_steps"] == 7


def test_a_failing_trace_write_stops_the_trace_not_the_cache(tmp_path, caplog, monkeypatch, rpc_device,
                                                             tiny_path):
    stock = greedy(load(tiny_path), PROMPT, 16)
    llm = load(tiny_path)
    trace_path = tmp_path / "t.csv"
    cache = attach(llm, slots=2, trace=str(trace_path))
    greedy(llm, PROMPT, 4)
    trace_file, write = os.stat(trace_path), os.write

    def full_disk_for_the_trace(fd, data):
        if os.path.samestat(os.fstat(fd), trace_file):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(fd, data)

    monkeypatch.setattr("moecache.formats.trace_writer.os.write", full_disk_for_the_trace)
    with moecache_log_lines(caplog) as lines:
        tokens, logits = greedy(llm, PROMPT, 16)
    assert tokens == stock[0] and np.array_equal(logits, stock[1])
    errors = [line for line in lines if "LLAMA_MOE_CACHE_TRACE" in line]
    assert len(errors) == 1 and "trace stopped after" in errors[0], errors
    assert cache.trace is None and cache.failed is None and cache.stats()["decode_steps"] > 16


def test_a_full_disk_at_start_leaves_the_cache_without_its_trace(tmp_path, caplog, monkeypatch, rpc_device,
                                                                tiny_path):
    llm = load(tiny_path)
    trace_path, write = tmp_path / "t.csv", os.write

    def full_disk_for_the_trace(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}") == str(trace_path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(fd, data)

    monkeypatch.setattr("moecache.formats.trace_writer.os.write", full_disk_for_the_trace)
    with moecache_log_lines(caplog) as lines:
        cache = attach(llm, slots=2, trace=str(trace_path))
        greedy(llm, PROMPT, 4)
    errors = [line for line in lines if "LLAMA_MOE_CACHE_TRACE" in line]
    assert len(errors) == 1 and "No space left on device - no trace, the cache runs" in errors[0], errors
    assert cache.trace is None and cache.failed is None and cache.stats()["decode_steps"] == 3  # it runs


DECODING_FOREVER = """
    import llama_cpp, numpy as np
    from moecache.live.rpc import RpcDevice
    device = RpcDevice(threads=1)
    print("DEVICE=%d" % device.process.pid, flush=True)
    llm = llama_cpp.Llama(model_path={path!r}, n_gpu_layers=-1, n_ctx=4096, verbose=False)
    llm.eval(llm.tokenize(b"The three primary colors are"))
    for step in range(4000):
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
        llm.eval([int(np.argmax(logits))])
        print("STEP=%d" % step, flush=True)
"""


def _flushed_steps(stats_path) -> int:
    return json.loads(stats_path.read_text())["decode_steps"] if stats_path.exists() else 0


@pytest.mark.parametrize("killed", ["client", "device"])
def test_stats_profile_and_trace_survive_a_crash(tmp_path, tiny_path, killed):
    """SIGKILL of the decoding process, or of its device (the client then aborts in ggml-rpc):
    the files hold the run up to the last flush (every FLUSH_STEPS decode steps)."""
    import select
    import signal


    files = {name: tmp_path / name for name in ("stats.json", "profile.json", "trace.csv")}
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_MOE_CACHE_")}
    # MAX_BATCH=1: the prompt stays stock, every step one token (the counts below)
    env.update({"LLAMA_MOE_CACHE_SLOTS": "2", "LLAMA_MOE_CACHE_FLUSH_STEPS": "4", "LLAMA_MOE_CACHE_MAX_BATCH": "1",
                "LLAMA_MOE_CACHE_STATS": str(files["stats.json"]),
                "LLAMA_MOE_CACHE_PROFILE": str(files["profile.json"]),
                "LLAMA_MOE_CACHE_TRACE": str(files["trace.csv"])})
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(DECODING_FOREVER.format(path=tiny_path))],
                            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # killed mid-decode once a flush of at least 8 steps is on disk (a thread writes them)
        device, step, deadline = None, -1, time.monotonic() + 120
        while step < 8 or _flushed_steps(files["stats.json"]) < 8 or not files["profile.json"].exists():
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = proc.stdout.readline() if ready else ""
            assert line, f"no progress: {proc.poll()} {proc.stderr.read() if proc.poll() is not None else ''}"
            key, _, value = line.strip().partition("=")
            device = int(value) if key == "DEVICE" else device
            step = int(value) if key == "STEP" else step
        os.kill(device if killed == "device" else proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()

    stats = json.loads(files["stats.json"].read_text())
    steps = stats["decode_steps"]
    assert steps >= 8 and steps % 4 == 0, steps
    assert stats["totals"]["hits"] + stats["totals"]["misses"] == steps * 2 * 2  # layers x top-k
    profile = UsageProfile.load(str(files["profile.json"]))
    profile_steps = profile.counts.sum(axis=1) // 2  # each step uses 2 distinct experts per layer
    assert (profile_steps == profile_steps[0]).all() and profile_steps[0] % 4 == 0 and profile_steps[0] >= 4
    trace = read_trace(str(files["trace.csv"]))
    assert (trace.phase == 1).sum() >= steps


def test_two_contexts_sharing_report_paths_each_get_their_own(tmp_path, caplog, rpc_device, tiny_path):
    # one process, two contexts, one TRACE and STATS setting: the second writes NAME.1.EXT
    stats, trace = tmp_path / "stats.json", tmp_path / "trace.csv"
    first, second = load(tiny_path), load(tiny_path)
    with moecache_log_lines(caplog) as lines:
        caches = [attach(llm, slots=2, stats=str(stats), trace=str(trace)) for llm in (first, second)]
        for llm in (first, second):
            greedy(llm, PROMPT, 6)
    assert [line for line in lines if "another context" in line] == [
        f"moecache: LLAMA_MOE_CACHE_STATS={str(stats)!r} is another context's in this process: this context "
        f"writes {str(tmp_path / 'stats.1.json')!r}",
        f"moecache: LLAMA_MOE_CACHE_TRACE={str(trace)!r} is another context's in this process: this context "
        f"writes {str(tmp_path / 'trace.1.csv')!r}"]
    for cache in caches:
        cache.close()
    for path in (stats, tmp_path / "stats.1.json"):
        assert json.loads(path.read_text())["decode_steps"] > 0
    for path in (trace, tmp_path / "trace.1.csv"):
        assert read_trace(str(path)).ids.shape[0] > 0  # readable: one writer each
