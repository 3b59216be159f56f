"""Zero-code activation (LLAMA_MOE_CACHE_* set, an unmodified llama-cpp-python program) and the
lifetime of a cache: it goes with its context."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import PROMPT, greedy, load, output_line, run_python

llama_cpp = pytest.importorskip("llama_cpp")

from moecache.live.activate import attach  # noqa: E402

UNMODIFIED_PROGRAM = """
    from moecache.live.rpc import RpcDevice
    device = RpcDevice(threads=2)        # this machine has no GPU: the loopback test device
    # --- an unmodified llama-cpp-python program ---
    from llama_cpp import Llama
    llm = Llama(model_path={path!r}, n_gpu_layers=-1, n_ctx=256, verbose=False)
    out = llm.create_completion("The three primary colors are", max_tokens=24, temperature=0.0)
    print("TEXT=" + repr(out["choices"][0]["text"]))
    import llama_cpp, moecache.live.native as native
    print("LAYERS=%d" % native.lib().llama_moe_cache_n_layers(native.as_context(llm.ctx), native.DEVICE))
"""


def test_zero_code_activation(tmp_path, tiny_path):
    stats = tmp_path / "stats.json"
    on = run_python(UNMODIFIED_PROGRAM.format(path=tiny_path),
                     {"LLAMA_MOE_CACHE_SLOTS": "2", "LLAMA_MOE_CACHE_STATS": str(stats)})
    assert on.returncode == 0, on.stderr
    assert "LAYERS=2" in on.stdout
    report = json.loads(stats.read_text())
    assert report["slots"] == 2 and report["decode_steps"] > 0
    assert report["totals"]["hits"] + report["totals"]["misses"] > 0

    off = run_python(UNMODIFIED_PROGRAM.format(path=tiny_path), {})
    assert off.returncode == 0, off.stderr
    assert "LAYERS=0" in off.stdout
    assert output_line(off.stdout, "TEXT=") == output_line(on.stdout, "TEXT=")


def test_zero_code_trace_of_a_model_whose_name_has_spaces(tmp_path, tiny_path):
    from moecache.formats.traces import read_trace

    trace_path = tmp_path / "live.route.csv"
    run = run_python(UNMODIFIED_PROGRAM.format(path=tiny_path),
                      {"LLAMA_MOE_CACHE_SLOTS": "2", "LLAMA_MOE_CACHE_TRACE": str(trace_path)})
    assert run.returncode == 0, run.stderr
    assert "LAYERS=2" in run.stdout, run.stderr  # general.name is "moecache tiny qwen3moe"
    trace = read_trace(str(trace_path))
    assert trace.model == "moecache_tiny_qwen3moe" and (trace.phase == 1).sum() > 0


def test_zero_code_trace_of_a_long_non_ascii_model_name(tmp_path, tiny_path):
    """general.name is read into 255 bytes: a long UTF-8 name is cut mid-character."""
    from moecache.formats.traces import read_trace

    model = tmp_path / "named.gguf"
    subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", "--force", "--general-name",
                    "x" + "模型" * 100, tiny_path, str(model)], check=True, capture_output=True)
    trace_path = tmp_path / "live.route.csv"
    run = run_python(UNMODIFIED_PROGRAM.format(path=str(model)),
                      {"LLAMA_MOE_CACHE_SLOTS": "2", "LLAMA_MOE_CACHE_TRACE": str(trace_path)})
    assert run.returncode == 0, run.stderr
    assert "LAYERS=2" in run.stdout, run.stderr
    assert read_trace(str(trace_path)).model == "x" + ("模型" * 42)[:84]


def test_zero_code_bad_value_is_one_logged_line_and_stock(tiny_path):
    run = run_python(UNMODIFIED_PROGRAM.format(path=tiny_path), {"LLAMA_MOE_CACHE_SLOTS": "abc"})
    assert run.returncode == 0, run.stderr
    assert "LAYERS=0" in run.stdout
    errors = [line for line in run.stderr.splitlines() if "moecache: error" in line]
    assert errors == ["moecache: error: LLAMA_MOE_CACHE_SLOTS='abc' is not an integer - expert cache disabled"]


def test_zero_code_refusal_is_the_only_line_in_a_verbose_log(tiny_path):
    """libllama reads no LLAMA_MOE_CACHE_* variable: a refused value is moecache's one line, with
    no second one from llama.cpp's log (its model load and context creation are stock)."""
    program = UNMODIFIED_PROGRAM.format(path=tiny_path).replace("verbose=False", "verbose=True")
    run = run_python(program, {"LLAMA_MOE_CACHE_SLOTS": "abc"})
    assert run.returncode == 0, run.stderr
    assert "LAYERS=0" in run.stdout
    lines = [line for line in run.stderr.splitlines()
             if "LLAMA_MOE_CACHE" in line or line.startswith("moecache") or "expert cache" in line]
    assert len(lines) == 1 and lines[0].startswith("moecache: error: LLAMA_MOE_CACHE_SLOTS="), lines


def test_inert_without_the_variable(tiny_path):
    run = run_python("""
        import sys
        from moecache.live.rpc import RpcDevice
        device = RpcDevice(threads=2)
        from llama_cpp import Llama
        llm = Llama(model_path=%r, n_gpu_layers=-1, n_ctx=256, verbose=False)
        llm.create_completion("hello", max_tokens=4)
        print("ACTIVATED=%%s" %% ("moecache.live.activate" in sys.modules))
    """ % tiny_path, {})
    assert run.returncode == 0, run.stderr
    assert "ACTIVATED=False" in run.stdout


def test_freed_contexts_do_not_keep_their_caches(tmp_path, rpc_device, tiny_path):
    """50 contexts created, used and freed: each cache reports when its context is freed and
    is then dropped (neither activate nor atexit keeps it)."""
    import gc
    import weakref

    from moecache.live import activate

    stats = tmp_path / "stats.json"
    kept = len(activate.live_caches())
    caches = []
    for i in range(50):
        llm = load(tiny_path)
        cache = attach(llm, slots=2, stats=str(stats))
        greedy(llm, PROMPT, 3)
        caches.append(weakref.ref(cache))
        del cache
        llm.close()
        # written at the free: two decodes after the prompt's stock ubatch (the last not observed yet)
        assert json.loads(stats.read_text())["decode_steps"] == 2
        stats.unlink()
    gc.collect()
    assert len(activate.live_caches()) <= kept
    assert [ref for ref in caches if ref() is not None] == []


def test_zero_code_contexts_do_not_accumulate(tiny_path):
    run = run_python("""
        import gc
        from moecache.live.rpc import RpcDevice
        device = RpcDevice(threads=1)
        from llama_cpp import Llama
        import moecache.live.activate as activate
        counts = []
        for i in range(50):
            llm = Llama(model_path=%r, n_gpu_layers=-1, n_ctx=256, verbose=False)
            llm.create_completion("hello", max_tokens=2)
            counts.append(len(activate.live_caches()))
            llm.close()
        gc.collect()
        print("CACHES=%%d %%d" %% (max(counts), len(activate.live_caches())))
    """ % tiny_path, {"LLAMA_MOE_CACHE_SLOTS": "2"})
    assert run.returncode == 0, run.stderr
    assert output_line(run.stdout, "CACHES=") == "1 0"
