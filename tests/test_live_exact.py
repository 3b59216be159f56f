"""The expert cache on the loopback RPC device is exact and counts every lookup.

The RPC device runs CPU kernels, so with the cache on the logits must be bit-identical to the
same placement with the cache off; the engine's counters and libllama's observers must agree."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import PROMPT, default_params, greedy, load, output_line, record_plans, run_python, unreported

llama_cpp = pytest.importorskip("llama_cpp")

from moecache.live import native  # noqa: E402
from moecache.live.activate import attach  # noqa: E402


def test_llama_cpp_is_the_patched_build():
    assert "+moecache." in llama_cpp.__version__
    assert native.patch_version() == native.PATCH_VERSION


def test_rpc_placement_is_bit_identical_to_all_cpu(rpc_device, smol_path):
    on_cpu = load(smol_path, n_gpu_layers=0, experts_on_host=False)
    tokens_cpu, logits_cpu = greedy(on_cpu, PROMPT, 64)
    del on_cpu
    split = load(smol_path)  # experts in host memory, the rest on the RPC device
    tokens_rpc, logits_rpc = greedy(split, PROMPT, 64)
    assert tokens_rpc == tokens_cpu
    assert np.array_equal(logits_rpc, logits_cpu)


@pytest.fixture(scope="module")
def smol_stock(rpc_device, smol_path):
    llm = load(smol_path)
    return greedy(llm, PROMPT, 256)


@pytest.mark.parametrize("slots,inserts,n_tokens,admission", [
    (2, 1, 256, "boundary"), (2, 1, 256, "eager"), (8, 2, 128, "eager"), (1, 1, 128, "eager")])
def test_cache_is_bit_identical_and_accounts_every_lookup(smol_stock, smol_path, slots, inserts, n_tokens,
                                                          admission):
    llm = load(smol_path)
    cache = attach(llm, slots=slots, inserts=inserts, policy="lru", wait=1,  # deterministic counts
                   admission=admission)
    plans = record_plans(cache)
    tokens, logits = greedy(llm, PROMPT, n_tokens)

    assert tokens == smol_stock[0][:n_tokens]
    stock_logits = smol_stock[1][:n_tokens]
    assert np.array_equal(logits, stock_logits), f"max |diff| {np.abs(logits - stock_logits).max()}"

    n_layers, k = len(cache.layers), cache.n_used
    stats = cache.stats()
    observed = [p for p in plans if p.hit_mask is not None]
    # the prompt ran the stock graph, its last layer the output token only: a prefill step,
    # no lookups; the last graph is not observed yet
    n_prompt = len(llm.tokenize(PROMPT))
    assert [p.prefill for p in observed] == [True] + [False] * (n_tokens - 1)
    assert (stats["prefill_steps"], stats["prefill_tokens"]) == (1, n_prompt)
    assert stats["decode_steps"] == stats["decode_tokens"] == n_tokens - 1
    assert [int((p.observed >= 0).sum()) for p in observed] == \
        [k * (n_layers * n_prompt - n_prompt + 1)] + [n_layers * k] * (n_tokens - 1)
    assert not observed[0].hit_mask.any() and stats["totals"]["prefill_uploads"] == len(observed[0].upload) > 0
    lookups = k * n_layers * (n_tokens - 1)
    assert stats["totals"]["hits"] + stats["totals"]["misses"] == lookups
    for plan in plans[2:]:  # after the prompt's step, which ignores INSERTS
        assert np.bincount(plan.upload[:, 0], minlength=n_layers).max(initial=0) <= inserts
        assert np.bincount(plan.admitted[:, 0], minlength=n_layers).max(initial=0) <= inserts
        assert plan.upload.size == 0 or admission == "boundary"

    # libllama's CPU observer saw the same hits, plus the graph not observed yet
    native_counters = cache.native_counters()
    assert sum(c["hits"] + c["misses"] for c in native_counters) == lookups + n_layers * k
    engine_hits = stats["totals"]["hits"]
    assert engine_hits <= sum(c["hits"] for c in native_counters) <= engine_hits + n_layers * k
    assert sum(c["uploads"] for c in native_counters) == \
        stats["totals"]["uploads"] + stats["totals"]["prefill_uploads"] + unreported(cache)

    if admission == "eager":
        assert sum(len(p.admitted) for p in plans) == stats["totals"]["uploads"] > 0
    if slots == 8:
        # every expert fits: once its upload is issued (boundary t) an expert misses at most in
        # the graph that ran during the upload (observed at t + 1), then never again
        issued = {}
        for plan in plans:
            if plan.hit_mask is not None and not plan.prefill:
                for layer, rank in zip(*np.nonzero(~plan.hit_mask & (plan.observed >= 0))):
                    key = (int(layer), int(plan.observed[layer, rank]))
                    assert key not in issued or plan.step <= issued[key] + 1, (key, plan.step, issued[key])
            for layer, expert, _ in plan.upload.tolist():
                issued.setdefault((layer, expert), plan.step)
            for layer, expert, _ in plan.admitted.tolist():  # issued during the graph it missed in
                issued.setdefault((layer, expert), plan.step - 1)
        assert stats["totals"]["evictions"] == 0
        assert stats["hit_rate"] > 0.9
    if slots < 8:
        assert stats["totals"]["evictions"] > 0, "the test must churn the slots"


# prompt-lookup drafting proposes continuations of n-grams seen before: a counting prompt makes
# the model repeat it, so drafts are accepted and verification ubatches carry several tokens
COUNTING = "one two three four five six seven eight nine ten, one two three four five six seven eight nine ten, one two"


def speculative(path, n_tokens, **cache_args):
    """Greedy completion with prompt-lookup speculative decoding (ubatches of 1 + up to 4 drafted
    tokens). Returns (text, [(tokens, logits of every row)] per evaluation, cache or None)."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    llm = load(path, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=4))
    cache = attach(llm, **cache_args) if cache_args else None
    evals = []
    evaluate = llm.eval

    def recording(tokens):
        start = llm.n_tokens
        evaluate(tokens)
        evals.append((list(tokens), llm.scores[start:start + len(tokens)].copy()))

    llm.eval = recording
    out = llm.create_completion(COUNTING, max_tokens=n_tokens, temperature=0.0)
    return out["choices"][0]["text"], evals, cache


def test_speculative_decoding_is_bit_identical_and_accounts_every_lookup(tmp_path, rpc_device, smol_path):
    from moecache.formats.traces import read_trace
    from moecache.offline.replay import PerLayerReplay, simulate

    text_off, evals_off, _ = speculative(smol_path, 128)
    trace_path = tmp_path / "spec.route.csv"
    text_on, evals_on, cache = speculative(smol_path, 128, slots=2, inserts=2, policy="lru", wait=1,
                                           trace=str(trace_path))
    assert text_on == text_off
    assert [tokens for tokens, _ in evals_on] == [tokens for tokens, _ in evals_off]
    for (_, on), (_, off) in zip(evals_on, evals_off):
        assert np.array_equal(on, off), f"max |diff| {np.abs(on - off).max()}"

    # the prompt, then each step's sampled token with up to 4 drafted ones
    sizes = [len(tokens) for tokens, _ in evals_on]
    assert max(sizes[1:]) > 1 and len(sizes) - 1 < 128, "drafts must be accepted"
    assert max(sizes) <= cache.config.max_batch  # every ubatch through the cache
    n_layers, k = len(cache.layers), cache.n_used
    stats = cache.stats()
    # every (token, layer, top-k) of every ubatch (a draft model makes Llama want the logits of
    # every row: every layer runs every token), the last ubatch not observed yet
    assert stats["decode_steps"] == len(sizes) - 1
    assert stats["decode_tokens"] == sum(sizes[:-1])
    assert stats["totals"]["hits"] + stats["totals"]["misses"] == n_layers * k * sum(sizes[:-1])
    assert sum(c["hits"] + c["misses"] for c in cache.native_counters()) == n_layers * k * sum(sizes)
    assert stats["totals"]["hits"] > 0 and stats["totals"]["evictions"] > 0

    # the live trace keeps each ubatch together, and the replay observes it as one step
    cache.close()
    trace = read_trace(str(trace_path))
    assert len(np.unique(trace.batch)) == len(sizes) - 1
    replayed = simulate(trace, PerLayerReplay("lru", 2, inserts=2, admission=cache.config.admission)).totals
    assert (replayed["hits"], replayed["misses"]) == (stats["totals"]["hits"], stats["totals"]["misses"])


def _decode_graph_names(path: str, slots: int) -> list[str]:
    """Names of the nodes of one single-token decode graph, through the scheduler's eval callback."""
    import ctypes

    import llama_cpp.llama_cpp as lib

    from moecache.live import ggml

    base = ggml.libggml_base()
    base.ggml_get_name.restype = ctypes.c_char_p
    base.ggml_get_name.argtypes = [ctypes.c_void_p]
    names: list[str] = []

    @lib.ggml_backend_sched_eval_callback
    def ask(tensor, ask_only, user_data):
        if ask_only:
            names.append(base.ggml_get_name(tensor).decode())
        return False  # asked about every node, observe none

    with default_params("llama_context_default_params", cb_eval=ask):
        llm = load(path)
    if slots:
        attach(llm, slots=slots)
    llm.eval(llm.tokenize(PROMPT))
    names.clear()
    llm.eval([llm.tokenize(b" red")[-1]])
    return list(names)


def test_cache_off_builds_the_stock_graph(rpc_device, tiny_path):
    off = _decode_graph_names(tiny_path, 0)
    on = _decode_graph_names(tiny_path, 2)
    assert off and not any(name.startswith(("ffn_moe_cache", "ffn_moe_down_merged")) for name in off)
    assert any(name.startswith("ffn_moe_cache_slots") for name in on)  # the device half reads its slots
    # the cache adds its own nodes and removes none of the stock graph's (unnamed nodes are
    # called after their index, which the added nodes shift)
    named = lambda names: {n for n in names if not n.startswith("node_")}  # noqa: E731
    assert named(off) <= named(on) and len(on) > len(off)


def test_two_devices_each_hold_their_layers_cache(smol_path):
    # eager admission on both: misses uploaded during the graph that missed them, on the device
    # of their layer, and the output stays exact
    run = run_python("""
        import json, numpy as np, sys
        sys.path.insert(0, "tests")
        from moecache.live.rpc import RpcDevice
        devices = [RpcDevice(threads=1), RpcDevice(threads=1)]
        from conftest import greedy, load, record_plans
        from moecache.live.activate import attach
        stock = greedy(load(%r), b"The three primary colors are", 48)
        llm = load(%r)
        cache = attach(llm, slots=2, inserts=1, policy="lru", admission="eager")
        plans = record_plans(cache)
        tokens, logits = greedy(llm, b"The three primary colors are", 48)
        admitted = {}
        for plan in plans:
            for layer in plan.admitted[:, 0]:
                device = cache.layers[int(layer)].device
                admitted[device] = admitted.get(device, 0) + 1
        print("RESULT=" + json.dumps({"devices": sorted({l.device for l in cache.layers}),
              "exact": tokens == stock[0] and bool(np.array_equal(logits, stock[1])),
              "admitted": admitted, "evictions": cache.stats()["totals"]["evictions"]}))
    """ % (smol_path, smol_path), {})
    assert run.returncode == 0, run.stderr
    result = json.loads(output_line(run.stdout, "RESULT="))
    assert len(result["devices"]) == 2, result
    assert sorted(result["admitted"]) == result["devices"] and min(result["admitted"].values()) > 0, result
    assert result["exact"] and result["evictions"] > 0
