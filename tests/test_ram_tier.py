"""The RAM tier (LLAMA_MOE_CACHE_RAM_MIB): K experts per layer kept in memory, the others read from
the model file when selected, and dropped when the room beyond the slots needs their memory.

Both runs compute on the CPU with the same plain kernels over the same bytes (the tier changes
where the bytes come from, not which ones), so the logits must be bit-identical to stock mmap's;
the engine and libllama must count every lookup, and the model file's mapping must stay within
the budget (the tier's drops work). Under a device cache on the loopback RPC device (both tiers)
the same holds against stock with the experts in host memory and the rest on the device."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from conftest import (N_THREADS, PROMPT, REPO, default_params, greedy, load, output_line, own_copy, record_plans,
                      run_python)

llama_cpp = pytest.importorskip("llama_cpp")

from moecache.formats.traces import DECODE, PREFILL, READS, read_trace  # noqa: E402
from moecache.live import native, ramtier  # noqa: E402
from moecache.live.activate import attach  # noqa: E402
from moecache.live.config import CacheConfig, ConfigError  # noqa: E402
from moecache.live.placement import experts_from_file  # noqa: E402
from moecache.live.probe import CacheUnavailable  # noqa: E402
from moecache.models.tiny import ARCHS, tiny_moe  # noqa: E402

MIB = 1 << 20
N_TOKENS = 64


def load_from_file(path):
    with experts_from_file():
        return llama_cpp.Llama(path, n_gpu_layers=0, n_ctx=512, n_threads=N_THREADS, n_threads_batch=N_THREADS,
                               verbose=False)


def bytes_read(counter: str = "rchar") -> int:
    """Bytes this process has passed through read calls (rchar of /proc/self/io), or had read from
    the disk (read_bytes)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(counter + ":"))


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


def stock_greedy(path, n: int = N_TOKENS):
    """Stock llama.cpp on the CPU (the file mapped, plain buffers, no cache): greedy's tokens and
    logits."""
    with default_params("llama_model_default_params", use_extra_bufts=False):
        llm = llama_cpp.Llama(str(path), n_gpu_layers=0, n_ctx=512, n_threads=N_THREADS,
                              n_threads_batch=N_THREADS, verbose=False)
    run = greedy(llm, PROMPT, n)
    llm.close()
    return run


def ram_mib_keeping(path, k: int) -> int:
    """The RAM_MIB that keeps k experts a layer of the model at path (a trial cache reads their sizes)."""
    llm = load_from_file(path)
    per_k = sum(layer.expert_bytes for layer in attach(llm, ram_mib=1 << 20).layers)
    llm.close()
    return k * per_k // MIB + 1


@pytest.fixture(scope="module")
def tier_path(smol_path, tmp_path_factory):
    return own_copy(smol_path, tmp_path_factory.mktemp("ram-tier") / "smol-moe.gguf")


@pytest.fixture(scope="module")
def smol_stock(smol_path):
    return stock_greedy(smol_path)


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


def test_ram_tier_read_ahead_costs_bytes_never_the_output(tier_path, smol_stock, expert_bytes):
    """The next layer's router on this layer's input predicts its experts (read_ahead): on or off,
    the logits are stock's; on, the predictions are counted, most selected and some not, and those
    not selected cost their bytes and nothing else."""
    per_k, n_layers, n_expert = expert_bytes
    runs = {}
    for read_ahead in (1, 0):
        llm = load_from_file(tier_path)
        cache = attach(llm, ram_mib=2 * per_k // MIB + 1, policy="lru", wait=1, read_ahead=read_ahead)
        tokens, logits = greedy(llm, PROMPT, N_TOKENS)
        assert tokens == smol_stock[0]
        assert np.array_equal(logits, smol_stock[1]), f"read_ahead={read_ahead}: max |diff| " \
                                                       f"{np.abs(logits - smol_stock[1]).max()}"
        runs[read_ahead] = (cache.native_counters(), cache.stats()["reads"])
        n_prompt = len(llm.tokenize(PROMPT))
        llm.close()
    (on, on_reads), (off, off_reads) = runs[1], runs[0]
    # off, decode reads nothing ahead; a prompt, which selects most experts of every layer, reads the
    # next layer whole either way
    assert off_reads["decode"]["read_ahead"] == off_reads["decode"]["read_ahead_wasted_bytes"] == 0
    assert off_reads["decode"]["read_bytes"] > 0 and off_reads["decode_per_token"]["read_ahead_precision"] is None
    assert off_reads["prompt"]["read_ahead"] > 0
    assert on[0]["read_ahead"] > 0  # the token embeddings predict the first layer's experts in decode
    ahead, used = sum(c["read_ahead"] for c in on), sum(c["read_ahead_used"] for c in on)
    wasted = sum(c["read_ahead_wasted_bytes"] for c in on)
    # smol-moe's stale gate finds most of the next layer's experts, not all of them
    assert 0 < ahead - used < used, (ahead, used)
    largest = max(per_layer.expert_bytes for per_layer in cache.layers)
    assert 0 < wasted <= (ahead - used) * largest
    for c in on:
        assert c["read_ahead_wasted_bytes"] <= c["read_ahead_bytes"] <= c["upload_bytes"]
    decode = on_reads["decode"]
    # decode's tokens are its own: every observed single-token graph (the last one has no step after it)
    assert (decode["tokens"], on_reads["prompt"]["tokens"]) == (N_TOKENS - 1, n_prompt)
    assert 0 < decode["read_ahead_used"] <= decode["read_ahead"] <= ahead
    assert on_reads["prompt"]["read_bytes"] > 0 and on_reads["prompt"]["read_ahead"] > 0
    precision = on_reads["decode_per_token"]["read_ahead_precision"]
    assert precision == decode["read_ahead_used"] / decode["read_ahead"] and 0.5 < precision < 1
    assert on_reads["decode_per_token"]["wasted_bytes_per_token"] > 0


def test_ram_tier_trace_records_each_layers_reads_as_the_stats_count_them(tier_path, expert_bytes, tmp_path):
    """The tier's trace carries, per batch and layer, what it read (READS): summed over the steps
    of each phase they are the stats' reads of that phase, and over all steps each layer's."""
    per_k, n_layers, _ = expert_bytes
    path = str(tmp_path / "ram.route.csv")
    llm = load_from_file(tier_path)
    cache = attach(llm, ram_mib=2 * per_k // MIB + 1, policy="lru", wait=1, trace=path)
    greedy(llm, PROMPT, 16)
    stats = cache.stats()
    llm.close()
    trace = read_trace(path)
    assert trace.reads.shape == (trace.ids.shape[0], n_layers, len(READS))
    for i, layer in enumerate(stats["layers"]):
        assert trace.reads[:, i].sum(axis=0).tolist() == [layer[name] for name in READS], f"layer {i}"
    for phase, name in ((PREFILL, "prompt"), (DECODE, "decode")):
        assert trace.reads[trace.phase == phase].sum(axis=(0, 1)).tolist() == \
            [stats["reads"][name][column] for column in READS], name
    decode = dict(zip(READS, trace.reads[trace.phase == DECODE].sum(axis=(0, 1)).tolist()))
    # decode read ahead, some of it wasted, and read on demand what it did not predict
    assert 0 < decode["read_ahead_used"] < decode["read_ahead"] and decode["read_ahead_wasted_bytes"] > 0
    assert decode["read_bytes"] > decode["read_ahead_bytes"]


def test_ram_tier_reads_ahead_of_a_prompts_layer_within_one_layers_reads(tier_path, expert_bytes, tmp_path):
    """A prompt selects most experts of each layer: the tier reads the next layer ahead while the
    layer computes, but holds at most one layer's reads beyond its slots (what the sizing leaves for
    them), read-ahead included. What it holds of layer l - 1 while layer l is read ahead are the
    experts it read and did not admit, so layer l gets at most E minus those (every expert of the
    next layer before: a model with few layers of many experts went past its memory limit and
    thrashed)."""
    _, n_layers, n_expert = expert_bytes
    path = str(tmp_path / "ram.route.csv")
    llm = load_from_file(tier_path)
    cache = attach(llm, ram_mib=2 * expert_bytes[0] // MIB + 1, policy="lru", wait=1, trace=path)
    prompt = list(range(1000, 1400))  # one ubatch of varied tokens
    llm.eval(prompt)
    counters = cache.native_counters()
    llm.eval(prompt[:1])  # (the trace has the prompt's step once the next one starts)
    llm.close()
    trace = read_trace(path)
    ids = trace.ids[trace.phase == PREFILL]
    selected = [len(np.unique(ids[:, layer][ids[:, layer] >= 0])) for layer in range(n_layers)]
    held = [n - c["uploads"] for n, c in zip(selected, counters)]
    read_ahead = [c["read_ahead"] for c in counters]
    # (a prompt reads its first layer whole at its observer; the last layer runs the outputs only)
    assert read_ahead[0] == 0 and min(read_ahead[1:]) > 0 and min(held[:-1]) > 0, (read_ahead, held)
    assert all(read_ahead[i] <= n_expert - held[i - 1] for i in range(1, n_layers)), (read_ahead, held)


@pytest.mark.parametrize("arch, last_runs_every_token", [("gpt-oss", True), ("qwen3moe", False)])
def test_ram_tier_reads_ahead_what_each_token_of_a_prompt_predicts(arch, last_runs_every_token):
    """In a prompt the next router's prediction has a row per token (build_moe_ffn's input is [n_embd,
    1, n_tokens]): the tier reads ahead the experts any token predicts, not the first token's alone.
    Whether the last layer runs every token or only the outputs is the architecture's (gpt-oss runs
    its last MoE layer on every token, qwen3moe on the outputs alone): the graph tells the tier
    (llama_moe_cache::built), which reads ahead for that many rows."""
    path = str(tiny_moe(arch=arch, n_layer=3, n_expert=16, n_expert_used=2, n_embd=128, n_ff_exp=512,
                        n_head=4, n_head_kv=2))
    ram_mib = ram_mib_keeping(path, 2)
    llm = load_from_file(path)
    cache = attach(llm, ram_mib=ram_mib, policy="lru", wait=1)
    k = cache.layers[0].n_expert_used
    llm.eval([int(t) for t in np.random.default_rng(0).integers(1, llm.n_vocab(), 3)])  # 3 x 2 < 16: no layer read whole
    counters = cache.native_counters()
    llm.close()
    read_ahead = [c["read_ahead"] for c in counters]
    misses = [c["misses"] for c in counters]
    assert read_ahead[1] > k, read_ahead  # the first token's prediction alone is k experts
    assert (misses[-1] > k) == last_runs_every_token, misses
    assert (read_ahead[-1] > k) == last_runs_every_token, read_ahead


def test_ram_tier_reads_ahead_of_a_prompt_only_the_experts_its_tokens_predict():
    """A prompt that selects most of a layer's experts, with room to read the next layer whole: the
    tier reads ahead the experts some token's prediction names, not every expert it does not keep
    (most of the others are selected by no token: reading them read 1.2x a prompt's bytes on the
    benchmark's model)."""
    path = str(tiny_moe(n_layer=3, n_expert=32, n_expert_used=2, n_embd=128, n_ff_exp=512, n_head=4, n_head_kv=2))
    ram_mib = ram_mib_keeping(path, 24)
    llm = load_from_file(path)
    cache = attach(llm, ram_mib=ram_mib, policy="lru", wait=1)
    llm.eval([int(t) for t in np.random.default_rng(0).integers(1, llm.n_vocab(), 20)])  # 20 x 2 >= 32: read whole
    layer = cache.native_counters()[1]
    llm.close()
    assert 0 < layer["read_ahead"] < 32 and layer["read_ahead_used"] >= 0.8 * layer["read_ahead"], layer


def test_ram_tier_keeps_experts_it_read_without_a_slot_while_its_room_has_space(tmp_path):
    """An expert read without a slot (or a slot's victim) stays in memory while the room beyond the
    slots (one layer's reads for a full ubatch) has space, oldest dropped first: a decode token that
    selects it again reads nothing. Few layers of many experts: the room holds most of what decode
    reads again, so decode reads a fraction of its misses' bytes (each of them read anew before),
    the mapping stays within the slots and the room, and the logits are stock's."""
    from moecache.models import synth

    source = synth.synth_moe("qwen3-30b-a3b", n_layer=2, n_expert=64, n_expert_used=4, n_embd=512,
                             n_ff_exp=512, n_head=2, n_head_kv=1)
    path = own_copy(source, tmp_path / "spares.gguf")
    stock_tokens, stock_logits = stock_greedy(path)
    llm = load_from_file(path)
    cache = attach(llm, ram_mib=4, policy="lru", wait=1, trace=str(tmp_path / "spares.route.csv"))
    layers = cache.layers
    assert cache.slots == 4 and layers[0].n_expert == 64
    tokens, logits = greedy(llm, PROMPT, N_TOKENS)
    llm.eval(tokens[-1:])  # (the trace has the last decode step once the next one starts)
    assert tokens == stock_tokens
    assert np.array_equal(logits, stock_logits), f"max |diff| {np.abs(logits - stock_logits).max()}"
    reads = cache.stats()["reads"]["decode"]
    resident = mapped_rss(path)
    llm.close()
    trace = read_trace(str(tmp_path / "spares.route.csv"))
    decode = trace.phase == DECODE
    misses = int(((trace.ids[decode] >= 0) & (trace.residency[decode] == 0)).sum())
    expert = layers[0].expert_bytes
    assert misses > 200, misses  # of 64 x 2 x 4 lookups
    assert 0 < reads["read_bytes"] < misses * expert / 3, (reads["read_bytes"] / expert, misses)
    room = min(64, 512 * 4) * expert  # n_ubatch 512
    assert resident <= (cache.slots * len(layers)) * expert + room + 4 * MIB, resident / expert


def test_ram_tier_reads_the_huge_pages_inside_large_experts_as_it_counts_them(tmp_path):
    """Experts whose parts hold whole huge pages (4 MiB parts; 2 MiB pages on x86-64): the tier
    leaves those pages to its mapping's faults, one large folio each (MADV_HUGEPAGE), and reads the
    rest of each part as before. The logits are stock's; the disk reads no more than the tier counts
    (a fault in a huge page reads no neighbour's bytes: every huge page read lies inside one part);
    and the drops release them (the mapping stays within the slots and the room)."""
    path = own_copy(tiny_moe(n_layer=2, n_expert=8, n_expert_used=2, n_embd=512, n_ff_exp=2048), tmp_path / "large.gguf")
    stock_tokens, stock_logits = stock_greedy(path, 24)
    llm = load_from_file(path)
    disk_before = bytes_read("read_bytes")
    cache = attach(llm, ram_mib=2 * 2 * 12 + 1, policy="lru", wait=1)  # 2 of 8 experts of 12 MiB per layer
    layers = cache.layers
    assert cache.slots == 2 and layers[0].expert_bytes == 3 * 4 * MIB
    tokens, logits = greedy(llm, PROMPT, 24)
    disk = bytes_read("read_bytes") - disk_before
    assert tokens == stock_tokens
    assert np.array_equal(logits, stock_logits), f"max |diff| {np.abs(logits - stock_logits).max()}"
    counted = sum(c["upload_bytes"] for c in cache.native_counters())  # (the stats have the last step's next step)
    resident = mapped_rss(path)
    llm.close()
    assert counted > 4 * layers[0].expert_bytes, counted
    assert disk <= counted + 2 * MIB, (disk / MIB, counted / MIB)  # (0 where the file is not on a disk)
    room = 8 * layers[0].expert_bytes  # a full ubatch selects every expert of a layer
    assert resident <= cache.slots * len(layers) * layers[0].expert_bytes + room + 4 * MIB, resident / MIB


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


def test_ram_tier_keeping_every_expert_reads_what_the_kernel_evicted_in_one_pass(tier_path, smol_stock,
                                                                                 expert_bytes):
    """A tier that keeps every expert reads them all in at init, and its layers run one pass (no
    second table). Pages the kernel evicts before an expert has its slot (memory pressure: here the
    file's mapping unmapped and its page cache dropped right after attach) are read on demand in
    that one pass: the path that wrote through the missing second table (SIGSEGV, 1 run in 257,
    fixed in 3ff7b95). In a fresh process, so that a crash fails the test."""
    per_k, _, n_expert = expert_bytes
    n = 8
    run = run_python(f"""
        import ctypes, mmap, os
        import llama_cpp
        from moecache.live.activate import attach
        from moecache.live.decode import greedy
        from moecache.live.placement import experts_from_file
        path = {tier_path!r}
        with experts_from_file():
            llm = llama_cpp.Llama(path, n_gpu_layers=0, n_ctx=512, n_threads={N_THREADS},
                                  n_threads_batch={N_THREADS}, verbose=False)
        cache = attach(llm, ram_mib={n_expert * per_k // MIB + 64}, policy="lru", wait=1)
        assert cache.slots == {n_expert}
        # unmapped (the mapping refaults from the file), then out of the page cache: as reclaim would
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        with open("/proc/self/maps") as f:
            spans = [line.split()[0].split("-") for line in f if line.rstrip().endswith(os.path.realpath(path))]
        for start, end in spans:
            assert madvise(int(start, 16), int(end, 16) - int(start, 16), mmap.MADV_DONTNEED) == 0
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        print("TOKENS", greedy(llm, {PROMPT!r}, {n}).tokens)
        print("READ", sum(c["upload_bytes"] for c in cache.native_counters()))
    """, {})
    assert run.returncode == 0, run.stderr
    assert output_line(run.stdout, "TOKENS ") == str(smol_stock[0][:n])
    # the prompt's layers found their experts evicted and read them: reads were pending in one pass
    assert int(output_line(run.stdout, "READ ")) >= per_k, run.stdout


def test_ram_tier_refusals(tier_path, expert_bytes):
    llm = load_from_file(tier_path)
    with pytest.raises(CacheUnavailable, match=r"RAM_MIB=1: 1 MiB keep fewer than one expert per layer"):
        attach(llm, ram_mib=1)
    assert native.lib().llama_moe_cache_n_layers(native.as_context(llm.ctx), native.RAM) == 0  # stock again
    llm.close()
    # experts read into memory: dropping their pages would lose them, so no tier
    with default_params("llama_model_default_params", use_extra_bufts=False):
        loaded = llama_cpp.Llama(tier_path, n_gpu_layers=0, n_ctx=512, use_mmap=False, verbose=False)
    with pytest.raises(CacheUnavailable, match="no MoE layer has its experts mapped from the model file"):
        attach(loaded, ram_mib=1000)
    loaded.close()
    with pytest.raises(ConfigError, match="LLAMA_MOE_CACHE_RAM_MIB"):
        CacheConfig.from_env({"LLAMA_MOE_CACHE_RAM_MIB": "lots"})


def test_zero_code_ram_tier_at_auto_steps_aside_for_a_model_that_fits(smol_path):
    """RAM_MIB=auto where every expert fits what the process may use: the model loads as without
    the tier (stock's loading repacks the experts, which the tier's mapping cannot), one line says
    why, and the text is stock's."""
    code = f"""
        import llama_cpp
        llm = llama_cpp.Llama({smol_path!r}, n_gpu_layers=0, n_ctx=512, verbose=False)
        print(llm.create_completion("The three primary colors are", max_tokens=8, temperature=0)["choices"][0]["text"])
        from moecache.live.activate import live_caches
        print("CACHES", len(live_caches()))
    """
    stock = run_python(code, {})
    run = run_python(code, {"LLAMA_MOE_CACHE_RAM_MIB": "auto"})
    assert run.returncode == 0 and stock.returncode == 0, run.stderr + stock.stderr
    assert run.stdout == stock.stdout and "CACHES 0" in run.stdout, (run.stdout, stock.stdout)
    lines = [line for line in run.stderr.splitlines() if line.startswith("moecache:")]
    assert len(lines) == 1 and "LLAMA_MOE_CACHE_RAM_MIB=auto: all of" in lines[0] and "fits" in lines[0] \
        and lines[0].endswith("no RAM tier, the model was loaded as without it"), run.stderr


def test_zero_code_ram_tier_keeps_what_its_budget_holds(smol_path):
    run = run_python(f"""
        import llama_cpp
        llm = llama_cpp.Llama({smol_path!r}, n_gpu_layers=0, n_ctx=512, verbose=False)
        print(llm.create_completion("The three primary colors are", max_tokens=8, temperature=0)["choices"][0]["text"])
        from moecache.live.activate import live_caches
        cache = live_caches()[0]
        print("SLOTS", cache.slots, cache.layers[0].device, cache.stats()["totals"]["misses"] > 0)
    """, {"LLAMA_MOE_CACHE_RAM_MIB": "200", "LLAMA_MOE_CACHE_DEBUG": "1"})
    assert run.returncode == 0, run.stderr
    assert "RAM tier" in run.stderr and "RAM_MIB=200" in run.stderr, run.stderr
    slots_line = next(line for line in run.stdout.splitlines() if line.startswith("SLOTS"))
    assert 0 < int(slots_line.split()[1]) < 8 and slots_line.split()[2:] == ["RAM", "True"], slots_line


def test_the_ram_tier_is_needed_only_where_some_expert_does_not_fit(smol_path):
    """fits_whole: RAM_MIB=N against the experts' bytes; auto against what the process may use, with
    the weights outside the experts and a KV cache of the model's whole context."""
    assert ramtier.fits_whole(smol_path, 381).endswith("fits (380 MiB)")  # 30 layers x 8 experts of 1.58 MiB
    assert ramtier.fits_whole(smol_path, 379) is None
    fits = ramtier.fits_whole(smol_path, "auto", available=(800 * MIB, "MemAvailable"))
    assert fits.endswith("fits (682 MiB with its 380 MiB of experts and a KV cache of 8192 tokens, 800 MiB "
                         "available, MemAvailable)"), fits  # (45 MiB of other weights, 180 of KV, 13 of reads, 64 reserve)
    assert ramtier.fits_whole(smol_path, "auto", available=(600 * MIB, "MemAvailable")) is None
    assert ramtier.fits_whole(smol_path, "auto", available=(None, "unknown")) is None


def test_run_py_ram_mib(smol_path):
    import subprocess

    run = subprocess.run([sys.executable, os.path.join(REPO, "run.py"), "-m", smol_path, "--ram-mib", "200",
                          "-n", "8", "--no-chat"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "RAM tier" in run.stderr and "hit rate" in run.stderr, run.stderr


@pytest.mark.parametrize("change", ["rewritten in place", "truncated"])
@pytest.mark.parametrize("device", [False, True], ids=["alone", "under a device cache"])
def test_ram_tier_stops_decoding_when_the_model_file_changes(tmp_path, change, device, request):
    """A file rewritten under a running tier (same size, its mtime restored) or cut short: the next
    decode fails with one logged line and every later one too; never a crash (a read past a cut
    mapping is a SIGBUS) or an output computed from other bytes. Under a device cache too (its
    uploads read the same file)."""
    from moecache.models import tiny_moe

    path = tmp_path / "model.gguf"
    path.write_bytes(tiny_moe(n_layer=2, n_expert=8, n_embd=128).read_bytes())
    if device:
        request.getfixturevalue("rpc_device")
        llm = load(str(path), from_file=True)
        tier = attach(llm, slots=1, ram_mib=1, wait=1).below
    else:
        llm = load_from_file(str(path))
        tier = attach(llm, ram_mib=1, wait=1)
    assert 0 < tier.slots < tier.layers[0].n_expert  # fewer experts kept than a layer has: reads go on
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
    assert "the model file changed" in tier.failed


@pytest.mark.parametrize("change", ["unlinked", "replaced by a rename"])
@pytest.mark.parametrize("device", [False, True], ids=["alone", "under a device cache"])
def test_ram_tier_decodes_on_when_the_model_file_loses_its_name(tmp_path, change, device, request):
    """A file unlinked, or another renamed over its path (an atomic update): the descriptor and the
    mapping the tier reads still hold the model's bytes, as stock mmap's mapping does, so decoding
    goes on, with the logits of a run where the file stayed."""
    from moecache.models import tiny_moe

    path = tmp_path / "model.gguf"
    path.write_bytes(tiny_moe(n_layer=2, n_expert=8, n_embd=128).read_bytes())

    def open_tier():
        if device:
            request.getfixturevalue("rpc_device")
            llm = load(str(path), from_file=True)
            return llm, attach(llm, slots=1, ram_mib=1, wait=1).below
        llm = load_from_file(str(path))
        return llm, attach(llm, ram_mib=1, wait=1)

    llm, tier = open_tier()
    expected = greedy(llm, PROMPT, 16)
    llm.close()

    llm, tier = open_tier()
    assert 0 < tier.slots < tier.layers[0].n_expert  # reads go on after the change
    llm.eval(llm.tokenize(PROMPT))
    if change == "unlinked":
        path.unlink()
    else:
        other = tmp_path / "update.gguf"
        other.write_bytes(bytes(b ^ 0xFF for b in path.read_bytes()))
        os.replace(other, path)
    tokens, logits = greedy(llm, PROMPT, 16)
    assert tier.failed is None
    assert tokens == expected[0] and np.array_equal(logits, expected[1])


# --- both tiers: a device cache over the RAM tier ----------------------------------------------


@pytest.fixture(scope="module")
def smol_stock_rpc(rpc_device, smol_path):
    """Stock llama.cpp with the experts in host memory (mapped, plain buffers) and the rest on the
    RPC device, no cache (smol_path: not the tier's file, whose residency is measured)."""
    llm = load(smol_path)
    run = greedy(llm, PROMPT, N_TOKENS)
    llm.close()
    return run


@pytest.mark.parametrize("admission", ["eager", "boundary"])
def test_both_tiers_are_bit_identical_to_stock_and_count_every_lookup_once(tier_path, smol_stock_rpc,
                                                                            expert_bytes, admission):
    per_k, n_layers, n_expert = expert_bytes
    llm = load(tier_path, from_file=True)
    cache = attach(llm, slots=2, ram_mib=4 * per_k // MIB + 1, policy="lru", wait=1, admission=admission)
    ram = cache.below
    assert (cache.slots, ram.slots) == (2, 4) and cache.slots < ram.slots < n_expert
    assert ram.layers[0].device == "RAM" and cache.layers[0].device != "RAM"
    assert [layer.il for layer in ram.layers] == [layer.il for layer in cache.layers]
    assert cache.layers[0].from_file  # the device's uploads read the file, not the mapping
    device_plans, ram_plans = record_plans(cache), record_plans(ram)
    read_before = bytes_read()
    tokens, logits = greedy(llm, PROMPT, N_TOKENS)
    read = bytes_read() - read_before

    assert tokens == smol_stock_rpc[0]
    assert np.array_equal(logits, smol_stock_rpc[1]), f"max |diff| {np.abs(logits - smol_stock_rpc[1]).max()}"

    # every boundary steps both tiers, the device first: the RAM tier saw the prompt (the stock
    # graph, its observer) and, in each decode step, exactly the device's misses (-1 where it hit)
    assert len(device_plans) == len(ram_plans)
    observed = [(d, r) for d, r in zip(device_plans, ram_plans) if d.hit_mask is not None]
    assert observed[0][0].prefill and not observed[0][1].prefill
    for d, r in observed[1:]:
        assert np.array_equal(r.observed, np.where(d.hit_mask, -1, d.observed))
    stats = cache.stats()
    assert stats["ram_tier"] == ram.stats() and stats["ram_tier"]["tier"] == "RAM"
    k, n_prompt = cache.n_used, len(llm.tokenize(PROMPT))
    decode_lookups = k * n_layers * (N_TOKENS - 1)
    prompt_lookups = k * (n_layers * n_prompt - n_prompt + 1)  # the last layer runs the output only
    device, below = stats["totals"], stats["ram_tier"]["totals"]
    assert device["hits"] + device["misses"] == decode_lookups
    assert below["hits"] + below["misses"] == device["misses"] + prompt_lookups
    assert 0 < device["hits"] and 0 < below["hits"] and 0 < below["misses"]  # each tier serves some
    # libllama's observers agree, plus the graph not observed yet
    dev_native, ram_native = cache.native_counters(), ram.native_counters()
    assert sum(c["hits"] + c["misses"] for c in dev_native) == decode_lookups + n_layers * k
    for d, r in zip(dev_native, ram_native):
        assert r["hits"] + r["misses"] >= d["misses"]  # and the prompt's
    assert sum(r["hits"] + r["misses"] - d["misses"] for d, r in zip(dev_native, ram_native)) == prompt_lookups
    uploaded, ram_read = (sum(c["upload_bytes"] for c in counters) for counters in (dev_native, ram_native))
    assert uploaded > 0 and ram_read > 0

    # the device's uploads read the model file (read calls, which /proc/self/io counts, the page
    # cache's hits too), not the mapping; the RAM tier's reads are none (readahead(2), then the
    # mapping populated); what is mapped is the RAM tier's slots (and under one expert per layer read
    # for the last token)
    assert read >= uploaded, (read, uploaded, ram_read)
    resident = mapped_rss(tier_path)
    assert resident < (ram.slots + 1) * per_k + 4 * MIB < (ram.slots + cache.slots) * per_k, resident / MIB
    llm.close()


def test_both_tiers_refuse_and_are_replaced_together(rpc_device, tier_path):
    """A RAM budget below one expert per layer: neither tier stays (stock again). A new cache
    replaces both tiers: the RAM tier alone leaves no device cache calling a replaced cache."""
    llm = load(tier_path, from_file=True)
    with pytest.raises(CacheUnavailable, match=r"RAM_MIB=1: 1 MiB keep fewer than one expert per layer"):
        attach(llm, slots=2, ram_mib=1)
    ctx, lib = native.as_context(llm.ctx), native.lib()
    assert lib.llama_moe_cache_n_layers(ctx, native.DEVICE) == lib.llama_moe_cache_n_layers(ctx, native.RAM) == 0
    attach(llm, slots=2)
    assert lib.llama_moe_cache_n_layers(ctx, native.DEVICE) > 0
    cache = attach(llm, ram_mib=1 << 20)
    assert lib.llama_moe_cache_n_layers(ctx, native.DEVICE) == 0 < lib.llama_moe_cache_n_layers(ctx, native.RAM)
    greedy(llm, PROMPT, 4)
    assert cache.stats()["decode_steps"] == 4 and cache.failed is None  # the RAM tier observes the prompt too
    llm.close()


def test_zero_code_both_tiers_size_themselves(smol_path):
    run = run_python(f"""
        from moecache.live.rpc import RpcDevice
        device = RpcDevice(threads=1)
        import llama_cpp
        llm = llama_cpp.Llama({smol_path!r}, n_gpu_layers=-1, n_ctx=512, verbose=False)
        print(llm.create_completion("The three primary colors are", max_tokens=16, temperature=0)["choices"][0]["text"])
        from moecache.live.activate import live_caches
        cache = live_caches()[0]
        stats = cache.stats()
        print("TIERS", cache.slots, cache.below.slots, stats["ram_tier"]["tier"],
              stats["totals"]["hits"] + stats["totals"]["misses"] > 0,
              stats["ram_tier"]["totals"]["hits"] + stats["ram_tier"]["totals"]["misses"] > 0)
        llm.close()
    """, {"LLAMA_MOE_CACHE_SLOTS": "2", "LLAMA_MOE_CACHE_RAM_MIB": "200", "LLAMA_MOE_CACHE_DEBUG": "1"})
    assert run.returncode == 0, run.stderr
    assert "RAM tier" in run.stderr and "RAM_MIB=200" in run.stderr and "the device did not serve" in run.stderr, \
        run.stderr
    tiers = next(line for line in run.stdout.splitlines() if line.startswith("TIERS")).split()
    assert tiers[1] == "2" and int(tiers[2]) >= 1 and tiers[3:] == ["RAM", "True", "True"], tiers


def test_zero_code_both_tiers_at_auto_keep_the_device_cache_alone_for_a_model_that_fits(smol_path):
    """SLOTS with RAM_MIB=auto where every expert fits: the experts load on the host as for the
    device cache alone (repacked, its default), which serves them; one line says the tier is not
    needed."""
    run = run_python(f"""
        from moecache.live.rpc import RpcDevice
        device = RpcDevice(threads=1)
        import llama_cpp
        llm = llama_cpp.Llama({smol_path!r}, n_gpu_layers=-1, n_ctx=512, verbose=False)
        print(llm.create_completion("The three primary colors are", max_tokens=16, temperature=0)["choices"][0]["text"])
        from moecache.live.activate import live_caches
        cache = live_caches()[0]
        print("TIERS", cache.slots, cache.below, cache.stats()["totals"]["hits"] + cache.stats()["totals"]["misses"] > 0)
        llm.close()
    """, {"LLAMA_MOE_CACHE_SLOTS": "2", "LLAMA_MOE_CACHE_RAM_MIB": "auto"})
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("moecache:")]
    assert len(lines) == 1 and "LLAMA_MOE_CACHE_RAM_MIB=auto: all of" in lines[0] \
        and lines[0].endswith("no RAM tier, the device cache alone"), run.stderr
    tiers = next(line for line in run.stdout.splitlines() if line.startswith("TIERS")).split()
    assert tiers[1:] == ["2", "None", "True"], tiers


def test_run_py_ram_mib_with_slots(smol_path):
    import subprocess

    run = subprocess.run([sys.executable, os.path.join(REPO, "run.py"), "-m", smol_path, "--ram-mib", "200",
                          "--slots", "2", "-n", "8", "--no-chat"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "RAM tier" in run.stderr and "loopback RPC device" in run.stderr, run.stderr
    assert "layers x 2 slots" in run.stderr and "the device did not serve" in run.stderr, run.stderr


LIMITED = "cgroup /sys/fs/cgroup/memory/job: 130 MiB limit, 20 MiB used"


def test_run_py_refuses_ram_mib_auto_before_loading_into_too_little_memory(smol_path, monkeypatch, capsys):
    """run.py --ram-mib auto in a memory cgroup of 100 or 130 MB was OOM-killed while smol-moe
    loaded, nothing printed: now one line, before loading, from the sizing's rule over the GGUF's
    weights outside the experts and its KV cache."""
    from moecache.live import cli, ramtier

    monkeypatch.setattr(ramtier, "available_memory", lambda: (110 * MIB, LIMITED))
    monkeypatch.setattr(cli, "load_model", lambda *a: pytest.fail("loaded"))
    assert cli.main(["-m", smol_path, "--ram-mib", "auto", "-n", "4"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"run.py: error: LLAMA_MOE_CACHE_RAM_MIB=auto: {smol_path} needs 214 MiB to load and keep one expert per "
        f"layer (45 MiB of weights outside its experts, a KV cache of 2048 tokens 45 MiB, one expert per layer "
        f"47 MiB, 13 MiB for one layer's reads, 64 MiB reserve), 110 MiB available ({LIMITED})"]
    ramtier.check_room(smol_path, 2048, 512, available=(300 * MIB, "MemAvailable"))  # room: no error
    ramtier.check_room(smol_path, 2048, 512, available=(None, "unknown"))             # nothing to say


def test_the_ram_tiers_sizing_takes_the_memory_available_as_given():
    from moecache.live.probe import CachedLayer
    from moecache.live.ramtier import plan_ram

    layers = [CachedLayer(il, 8, 2, MIB, True, "RAM") for il in range(4)]
    config = CacheConfig(ram_mib="auto")
    plan = plan_ram(config, layers, 512, available=(1024 * MIB, "cgroup /x: 1100 MiB limit, 76 MiB used"))
    assert plan.slots == 8 and "(cgroup /x: 1100 MiB limit, 76 MiB used)" in plan.lines()[1]
    with pytest.raises(CacheUnavailable, match="keep fewer than one expert per layer"):
        plan_ram(config, layers, 512, available=(70 * MIB, "MemAvailable"))


def _memory_cgroup_dir() -> str | None:
    """This process's cgroup v1 memory directory, where a child can be made (as root)."""
    try:
        with open("/proc/self/cgroup") as f:
            path = next(line.split(":", 2)[2].strip() for line in f if line.split(":")[1] == "memory")
    except (OSError, StopIteration):
        return None
    directory = "/sys/fs/cgroup/memory" + path.rstrip("/")
    return directory if os.geteuid() == 0 and os.access(directory, os.W_OK) else None


@pytest.mark.skipif(_memory_cgroup_dir() is None, reason="needs root and cgroup v1's memory controller")
def test_run_py_ram_mib_auto_in_a_130_mb_cgroup_says_why_and_is_not_killed(smol_path, tmp_path):
    import subprocess

    child = os.path.join(_memory_cgroup_dir(), f"moecache-test-{os.getpid()}")
    os.mkdir(child)
    try:
        with open(os.path.join(child, "memory.limit_in_bytes"), "w") as f:
            f.write(str(130 * MIB))

        def enter():
            with open(os.path.join(child, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))

        run = subprocess.run([sys.executable, os.path.join(REPO, "run.py"), "-m", smol_path, "--ram-mib", "auto",
                              "-n", "4", "--no-chat"], capture_output=True, text=True, timeout=300, preexec_fn=enter)
    finally:
        os.rmdir(child)
    assert run.returncode == 2, (run.returncode, run.stderr)
    assert run.stderr.startswith("run.py: error: LLAMA_MOE_CACHE_RAM_MIB=auto: ") and run.stderr.count("\n") == 1
    assert f"{os.path.basename(child)}: 130 MiB limit" in run.stderr


def test_run_py_says_why_a_decode_failed_when_the_model_file_changed(tmp_path, monkeypatch, capsys):
    """run.py printed only "llama_decode returned -3" when the RAM tier stopped on a changed
    model file (libllama's reason is logged at a level llama-cpp-python shows only when
    verbose): the one error line says why, from the cache."""
    from moecache.live import cli
    from moecache.models import tiny_moe

    path = tmp_path / "model.gguf"
    path.write_bytes(tiny_moe(n_layer=2, n_expert=8, n_embd=128).read_bytes())
    generate = cli.generate

    def cut_then_generate(llm, args):
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)
        return generate(llm, args)

    monkeypatch.setattr(cli, "generate", cut_then_generate)
    assert cli.main(["-m", str(path), "--ram-mib", "1", "-n", "8", "--no-chat", "-p", "The three"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("run.py: error: llama_decode returned -3: the RAM tier stopped: RuntimeError: the "
                              "model file changed since it was loaded"), err


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_ram_tier_with_read_ahead_is_bit_identical_on_every_architecture(arch):
    """The tier alone, read-ahead on (the default): each architecture's next router, with its bias
    and probability function, predicts from this layer's input; whatever it predicts, the logits
    are stock mmap's, and the tier misses, reads and (with a next MoE layer) reads ahead."""
    # 3 layers of 8 experts of about 768 KiB, 2 or 3 kept per layer: most selections are read
    path = str(tiny_moe(arch=arch, n_layer=3, n_expert=8, n_expert_used=2, n_embd=128, n_ff_exp=512,
                        n_head=4, n_head_kv=2))
    stock_tokens, stock_logits = stock_greedy(path, 24)
    ram_mib = ram_mib_keeping(path, 2)
    llm = load_from_file(path)
    cache = attach(llm, ram_mib=ram_mib, policy="lru", wait=1)
    tokens, logits = greedy(llm, PROMPT, 24)
    assert cache.slots < cache.layers[0].n_expert
    assert tokens == stock_tokens
    assert np.array_equal(logits, stock_logits), f"max |diff| {np.abs(logits - stock_logits).max()}"
    counters = cache.native_counters()
    assert sum(c["upload_bytes"] for c in counters) > 0
    if len(cache.layers) > 1:
        assert sum(c["read_ahead"] for c in counters) > 0, counters
    llm.close()
