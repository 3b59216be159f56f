"""Shared fixtures and helpers for the tests that run llama.cpp: the loopback RPC test device,
model loading with the experts in host memory, and what the live cache tests observe with."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import weakref

import numpy as np
import pytest

N_THREADS = max(1, min(2, os.cpu_count() or 1))

from moecache.formats.traces import TRACES_DIR as TRACES  # noqa: E402  (the shipped real traces)
from moecache.live import decode  # noqa: E402

PROMPT = b"The three primary colors are"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# every model load() made; the device fixture frees those still alive before stopping the server
_loaded: weakref.WeakSet = weakref.WeakSet()


@pytest.fixture(scope="session")
def rpc_device():
    """One loopback RPC device for the whole session (ggml cannot unregister a device)."""
    from moecache.live.rpc import RpcDevice

    device = RpcDevice(threads=1)
    yield device
    # contexts and models on the device go first, including those a failed test's traceback
    # keeps alive: freed after the server is gone, they would hang the interpreter's exit
    for llm in list(_loaded):
        llm.close()
    device.close()


@pytest.fixture(scope="session")
def smol_path():
    from moecache.models import smol_moe

    return str(smol_moe())


@pytest.fixture(scope="session")
def synth48():
    """The Qwen3-30B-A3B routing shape (48 layers, 128 experts, top-8), locality 0.6, with tiny
    widths: 23 MB, a few ms per token."""
    from moecache.models import synth

    return str(synth.synth_moe("qwen3-30b-a3b", n_layer=48, n_embd=64, n_ff_exp=32, n_head=2, n_head_kv=1,
                               head_dim=32))


@pytest.fixture(scope="session")
def tiny_path():
    from moecache.models import tiny_moe

    return str(tiny_moe(n_layer=2, n_expert=8))


def load(path, *, n_gpu_layers=-1, experts_on_host=True, repack=False, from_file=False, n_ctx=512, verbose=False,
         **llama_kwargs):
    import llama_cpp

    from moecache.live.placement import experts_from_file
    from moecache.live.placement import experts_on_host as host_experts

    # experts on host (from_file: mapped and unread, for the RAM tier), or everything where
    # n_gpu_layers puts it without repacking (the RPC server does not repack)
    placement = (experts_from_file() if from_file else host_experts(repack=repack) if experts_on_host
                 else default_params("llama_model_default_params", use_extra_bufts=repack))
    with placement:
        llm = llama_cpp.Llama(path, n_gpu_layers=n_gpu_layers, n_ctx=n_ctx, n_threads=N_THREADS,
                              n_threads_batch=N_THREADS, verbose=verbose, **llama_kwargs)
    _loaded.add(llm)
    return llm


def own_copy(source, path) -> str:
    """source copied to path, a file of its own: no other mapping holds its pages in memory (the
    RAM tier cannot release pages another mapping holds, and residency checks read this one's)."""
    with open(source, "rb") as src, open(path, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 24)
        dst.flush()
        os.fsync(dst.fileno())  # clean pages: the tier's init can release them
    return str(path)


@contextlib.contextmanager
def default_params(name: str, **fields):
    """Within the block, llama_cpp's `name` (llama_model_default_params or
    llama_context_default_params, which Llama starts from) sets these fields."""
    import llama_cpp.llama_cpp as lib

    stock = getattr(lib, name)

    def changed():
        params = stock()
        for field, value in fields.items():
            setattr(params, field, value)
        return params

    setattr(lib, name, changed)
    try:
        yield
    finally:
        setattr(lib, name, stock)


def greedy(llm, prompt: bytes, n: int):
    """moecache.live.decode.greedy as (tokens, logits[n, n_vocab]), logits[i] the distribution token
    i was picked from."""
    run = decode.greedy(llm, prompt, n, keep_logits=True)
    return run.tokens, run.logits[:n]


def replayed_as_live(cache) -> dict:
    """PerLayerReplay's settings for what the live cache ran: its admission, and its miss planner at
    the rates attach measured (on by default where it can run)."""
    return {"admission": cache.config.admission, "miss_plan": cache.planner.rates if cache.planner else None}


def record_plans(cache):
    """Wrap the cache's engine so that each step's observation and plan are kept."""
    plans = []
    step = cache.engine.step

    def recording(ids=None, ready=None, admitted=None, **flags):
        plan = step(ids, ready, admitted, **flags)
        plan.observed = None if ids is None else np.array(ids)
        plan.prefill = flags.get("prefill", False)
        plans.append(plan)
        return plan

    cache.engine.step = recording
    return plans


def unreported(cache) -> int:
    """Eager admission: the uploads the last graph started, which no boundary has reported to
    the engine yet (libllama counts them once they complete)."""
    return len(cache.admitted()[0])


def unreported_lane(cache) -> np.ndarray:
    """Per layer, the lane copies of the last graph, which no boundary has reported yet."""
    rows, n_lane = cache.admitted()
    return np.bincount(rows[:n_lane, 0], minlength=len(cache.layers))


@contextlib.contextmanager
def moecache_log_lines(caplog):
    """Within the block, caplog also gets the moecache logger's records (it does not propagate
    to caplog's root handler); yields the list of their messages, filled when the block ends."""
    lines: list[str] = []
    moecache_log = logging.getLogger("moecache")
    moecache_log.addHandler(caplog.handler)
    propagate, moecache_log.propagate = moecache_log.propagate, False  # else caplog gets each twice
    try:
        yield lines
    finally:
        moecache_log.removeHandler(caplog.handler)
        moecache_log.propagate = propagate
        lines += [r.getMessage() for r in caplog.records if r.name == "moecache"]


def replay_cli(*args):
    """python -m moecache.replay's main() in this process; the exit status, also when argparse exits."""
    from moecache.offline.cli import main

    try:
        return main([str(a) for a in args])
    except SystemExit as e:
        return e.code


def run_python(code: str, env: dict, timeout=300) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter from the repository root, with env as its only
    LLAMA_MOE_CACHE_* variables."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_MOE_CACHE_")}
    full_env["PYTHONFAULTHANDLER"] = "1"  # a crash prints where it happened
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def output_line(text: str, prefix: str) -> str:
    """The rest of text's first line that starts with prefix."""
    return next(line[len(prefix):] for line in text.splitlines() if line.startswith(prefix))
