"""The expert cache on every architecture moecache.models.tiny builds: a tiny random model of each
decodes with the cache exactly as without it on the loopback RPC device (bit-identical logits
with plain host experts; the same greedy tokens with repacked ones), hitting and uploading."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import PROMPT, greedy, load

llama_cpp = pytest.importorskip("llama_cpp")

from moecache.live.activate import attach  # noqa: E402
from moecache.live.probe import expert_shapes  # noqa: E402
from moecache.models.tiny import ARCHS, tiny_moe  # noqa: E402

N_TOKENS = 24
# f32 experts, 8 per layer, top-2, K=2: misses, evictions and hits within a few tokens
TINY = dict(n_layer=2, n_expert=8, n_expert_used=2, n_embd=64, n_head=4, n_head_kv=2)


# the miss planner's rates set so that every miss it may take goes through the copy-on-miss lane:
# copied into a slot during the graph that selected it and computed there by the device half
LANE = dict(policy="heat", planner=1, link_gbps=1000, host_gbps=1)


def _cached_run(path, *, repack, n_tokens=N_TOKENS, **settings):
    llm = load(path, repack=repack)
    settings = {"policy": "lru", **settings}
    cache = attach(llm, slots=2, inserts=2, wait=1, **settings)  # deterministic counts
    tokens, logits = greedy(llm, PROMPT, n_tokens)
    return cache, tokens, logits


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_cached_decode_is_bit_identical(rpc_device, arch):
    path = str(tiny_moe(arch=arch, **TINY))
    stock_tokens, stock_logits = greedy(load(path), PROMPT, N_TOKENS)
    cache, tokens, logits = _cached_run(path, repack=False)

    assert [layer.il for layer in cache.layers] == sorted(expert_shapes(path))
    assert tokens == stock_tokens
    assert np.array_equal(logits, stock_logits), f"max |diff| {np.abs(logits - stock_logits).max()}"
    totals = cache.stats()["totals"]
    assert totals["hits"] > 0 and totals["uploads"] > 0 and totals["evictions"] > 0, totals


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_repacked_decode_keeps_the_greedy_tokens(rpc_device, arch):
    # q4_0 experts, which llama.cpp repacks on x86: the cached rows run the device's plain kernels
    path = str(tiny_moe(arch=arch, expert_type="q4_0", **TINY))
    stock_tokens, _ = greedy(load(path, repack=True), PROMPT, N_TOKENS)
    cache, tokens, _ = _cached_run(path, repack=True)

    assert tokens == stock_tokens
    totals = cache.stats()["totals"]
    assert totals["hits"] > 0 and totals["uploads"] > 0, totals


@pytest.mark.parametrize("repack", [False, True])
def test_gpt_oss_with_its_mxfp4_experts(rpc_device, repack):
    """gpt-oss ships its experts in MXFP4 (biases F32): bit-identical in plain buffers, the same
    greedy tokens with the CPU's repacked ones."""
    path = str(tiny_moe(arch="gpt-oss", expert_type="mxfp4", **TINY))
    stock_tokens, stock_logits = greedy(load(path, repack=repack), PROMPT, N_TOKENS)
    cache, tokens, logits = _cached_run(path, repack=repack)

    assert tokens == stock_tokens
    if not repack:
        assert np.array_equal(logits, stock_logits), f"max |diff| {np.abs(logits - stock_logits).max()}"
    totals = cache.stats()["totals"]
    assert totals["hits"] > 0 and totals["uploads"] > 0, totals



@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_lane_decode_is_bit_identical(rpc_device, arch):
    """The lane writes a slot and its table entry while the graph runs: the device half must read
    them after the CPU half's observer wrote them, on the device (gpt-oss's down bias once pulled
    its device half onto the CPU, over a copy of the slots taken before the lane wrote them)."""
    path = str(tiny_moe(arch=arch, **TINY))
    stock_tokens, stock_logits = greedy(load(path), PROMPT, N_TOKENS)
    cache, tokens, logits = _cached_run(path, repack=False, **LANE)

    assert tokens == stock_tokens
    assert np.array_equal(logits, stock_logits), f"max |diff| {np.abs(logits - stock_logits).max()}"
    assert cache.failed is None and cache.stats()["totals"]["lane_misses"] > 0


@pytest.mark.parametrize("expert_type", ["f32", "mxfp4"])
def test_gpt_oss_lane_is_bit_identical_over_96_tokens(rpc_device, expert_type):
    path = str(tiny_moe(arch="gpt-oss", expert_type=expert_type, **TINY))
    stock_tokens, stock_logits = greedy(load(path), PROMPT, 96)
    cache, tokens, logits = _cached_run(path, repack=False, n_tokens=96, **LANE)

    assert tokens == stock_tokens
    assert np.array_equal(logits, stock_logits), f"max |diff| {np.abs(logits - stock_logits).max()}"
    assert cache.stats()["totals"]["lane_misses"] > 0
