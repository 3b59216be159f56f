"""The RAM tier (LLAMA_MOE_CACHE_RAM_MIB): K experts per layer kept in memory, the others read from
the model file when selected, dropped after use.

Both runs compute on the CPU with the same plain kernels over the same bytes (the tier changes
where the bytes come from, not which ones), so the logits must be bit-identical to stock mmap's;
the engine and libllama must count every lookup, and the model file's mapping must stay within
the budget (the tier's drops work)."""

from __future__ import annotations

import os
import shutil
import sys

import numpy as np
import pytest
from conftest import N_THREADS, PROMPT, REPO, default_params, greedy, record_plans, run_python

llama_cpp = pytest.importorskip("llama_cpp")

from moecache.live import native  # noqa: E402
from moecache.live.activate import attach  # noqa: E402
from moecache.live.config import CacheConfig, ConfigError  # noqa: E402
from moecache.live.placement import experts_from_file  # noqa: E402
from moecache.live.probe import CacheUnavailable  # noqa: E402

MIB = 1 << 20
N_TOKENS = 64


def load_from_file(path):
    with experts_from_file():
        return llama_cpp.Llama(path, n_gpu_layers=0, n_ctx=512, n_threads=N_THREADS, n_threads_batch=N_THREADS,
                               verbose=False)


def mapped_rss(path: str) -> int:
    """Bytes of this process's mappings of path that are resident (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                inside = len(fields) >= 6 and fields[5] == os.path.realpath(path)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


@pytest.fixture(scope="module")
def tier_path(smol_path, tmp_path_factory):
    """smol-moe, a file of its own: no other test's mapping holds its pages in memory (the tier
    cannot release pages another mapping holds, and the residency checks below read this one's)."""
    path = tmp_path_factory.mktemp("ram-tier") / "smol-moe.gguf"
    with open(smol_path, "rb") as src, open(path, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 24)
        dst.flush()
        os.fsync(dst.fileno())  # clean pages: the tier's init can release them
    return str(path)


@pytest.fixture(scope="module")
def smol_stock(smol_path):
    """Stock llama.cpp on the CPU: the file mapped, plain buffers, no cache."""
    with default_params("llama_model_default_params", use_extra_bufts=False):
        llm = llama_cpp.Llama(smol_path, n_gpu_layers=0, n_ctx=512, n_threads=N_THREADS,
                              n_threads_batch=N_THREADS, verbose=False)
    run = greedy(llm, PROMPT, N_TOKENS)
    llm.close()
    return run


@pytest.fixture(scope="module")
def expert_bytes(tier_path):
    """One expert of every layer, and the layer count, of the tier's smol model."""
    llm = load_from_file(tier_path)
    cache = attach(llm, ram_mib=1 << 20)
    n = sum(layer.expert_bytes for layer in cache.layers)
    n_layers, n_expert = len(cache.layers), cache.layers[0].n_expert
    llm.close()
    return n, n_layers, n_expert


def test_ram_tier_is_bit_identical_to_stock_and_counts_every_lookup(tier_path, smol_stock, expert_bytes):
    per_k, n_layers, n_expert = expert_bytes
    llm = load_from_file(tier_path)
    cache = attach(llm, ram_mib=2 * per_k // MIB + 1, policy="lru", wait=1)
    assert cache.slots == 2 and cache.layers[0].device == "RAM"
    plans = record_plans(cache)
    tokens, logits = greedy(llm, PROMPT, N_TOKENS)

    assert tokens == smol_stock[0]
    assert np.array_equal(logits, smol_stock[1]), f"max |diff| {np.abs(logits - smol_stock[1]).max()}"

    # every ubatch is observed, the prompt's too: its lookups count
    stats = cache.stats()
    observed = [p for p in plans if p.hit_mask is not None]
    assert not any(p.prefill for p in observed)
    lookups = sum(int((p.observed >= 0).sum()) for p in observed)
    assert stats["totals"]["hits"] + stats["totals"]["misses"] == lookups
    assert 0 < stats["totals"]["hits"] < lookups
    native_counters = cache.native_counters()
    k = cache.n_used
    assert sum(c["hits"] + c["misses"] for c in native_counters) == lookups + n_layers * k  # + the last graph
    # every miss was read: at least one expert's bytes per layer per miss-bearing step
    assert sum(c["upload_bytes"] for c in native_counters) >= per_k * (len(observed) - 1) // n_layers
    # the experts not kept were dropped: the mapping holds about K experts per layer, far from all of them
    # (what a layer read for the last token without keeping it, dropped at the next boundary, is
    # under one expert of every layer)
    resident = mapped_rss(tier_path)
    assert resident < (cache.slots + 1) * per_k + 4 * MIB < n_expert * per_k / 2, resident / MIB


def test_ram_tier_keeps_every_expert_that_fits(tier_path, smol_stock, expert_bytes):
    per_k, n_layers, n_expert = expert_bytes
    llm = load_from_file(tier_path)
    cache = attach(llm, ram_mib=n_expert * per_k // MIB + 64, wait=1)
    assert cache.slots == n_expert
    first = greedy(llm, PROMPT, N_TOKENS)
    misses = cache.stats()["totals"]["misses"]
    again = greedy(llm, PROMPT, N_TOKENS)
    assert first[0] == again[0] == smol_stock[0]
    # the second pass selects what the first did, all of it kept: no expert was dropped
    assert misses > 0 and cache.stats()["totals"]["misses"] == misses


def test_ram_tier_refusals(tier_path, expert_bytes):
    llm = load_from_file(tier_path)
    with pytest.raises(CacheUnavailable, match=r"RAM_MIB=1: 1 MiB keep fewer than one expert per layer"):
        attach(llm, ram_mib=1)
    assert native.lib().llama_moe_cache_n_layers(native.as_context(llm._ctx.ctx)) == 0  # stock again
    llm.close()
    # experts read into memory: dropping their pages would lose them, so no tier
    with default_params("llama_model_default_params", use_extra_bufts=False):
        loaded = llama_cpp.Llama(tier_path, n_gpu_layers=0, n_ctx=512, use_mmap=False, verbose=False)
    with pytest.raises(CacheUnavailable, match="no MoE layer has its experts mapped from the model file"):
        attach(loaded, ram_mib=1000)
    loaded.close()
    with pytest.raises(ConfigError, match="RAM_MIB=100 and LLAMA_MOE_CACHE_SLOTS=4: the RAM tier and a device"):
        CacheConfig(ram_mib=100, slots=4)
    with pytest.raises(ConfigError, match="LLAMA_MOE_CACHE_RAM_MIB"):
        CacheConfig.from_env({"LLAMA_MOE_CACHE_RAM_MIB": "lots"})


def test_zero_code_ram_tier_sizes_itself_from_the_memory_it_may_use(smol_path):
    run = run_python(f"""
        import llama_cpp
        llm = llama_cpp.Llama({smol_path!r}, n_gpu_layers=0, n_ctx=512, verbose=False)
        print(llm.create_completion("The three primary colors are", max_tokens=8, temperature=0)["choices"][0]["text"])
        from moecache.live.activate import live_caches
        cache = live_caches()[0]
        print("SLOTS", cache.slots, cache.layers[0].device, cache.stats()["totals"]["misses"] > 0)
    """, {"LLAMA_MOE_CACHE_RAM_MIB": "auto", "LLAMA_MOE_CACHE_DEBUG": "1"})
    assert run.returncode == 0, run.stderr
    assert "RAM tier" in run.stderr and "may be used" in run.stderr, run.stderr
    slots_line = next(line for line in run.stdout.splitlines() if line.startswith("SLOTS"))
    assert slots_line.split()[2:] == ["RAM", "True"]


def test_run_py_ram_mib(smol_path):
    import subprocess

    run = subprocess.run([sys.executable, os.path.join(REPO, "run.py"), "-m", smol_path, "--ram-mib", "200",
                          "-n", "8", "--no-chat"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "RAM tier" in run.stderr and "hit rate" in run.stderr, run.stderr


@pytest.mark.parametrize("change", ["rewritten in place", "truncated"])
def test_ram_tier_stops_decoding_when_the_model_file_changes(tmp_path, change, caplog):
    """A file rewritten under a running tier (same size, its mtime restored) or cut short: the next
    decode fails with one logged line and every later one too; never a crash (a read past a cut
    mapping is a SIGBUS) or an output computed from other bytes."""
    from moecache.models import tiny_moe

    path = tmp_path / "model.gguf"
    path.write_bytes(tiny_moe(n_layer=2, n_expert=8, n_embd=128).read_bytes())
    llm = load_from_file(str(path))
    cache = attach(llm, ram_mib=1, wait=1)  # fewer experts kept than a layer has: reads go on
    assert 0 < cache.slots < cache.layers[0].n_expert
    llm.eval(llm.tokenize(PROMPT))
    size, stat = path.stat().st_size, path.stat()
    with open(path, "r+b") as f:
        if change == "truncated":
            f.truncate(size // 2)
        else:
            f.seek(size // 2)
            block = f.read(1 << 16)
            f.seek(size // 2)
            f.write(bytes(b ^ 0xFF for b in block))
    if change != "truncated":
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    for _ in range(2):  # the failure stays
        with pytest.raises(RuntimeError, match="llama_decode returned -3"):
            llm.eval([llm.token_eos()])
    assert "the model file changed" in cache.failed
