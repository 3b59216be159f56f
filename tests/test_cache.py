"""The expert cache on the loopback RPC device: exactness, accounting, bad input, activation.

The RPC device runs CPU kernels, so with the cache on the logits must be bit-identical to the
same placement with the cache off."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from conftest import default_params, greedy, load
from hypothesis import given, settings
from hypothesis import strategies as st

llama_cpp = pytest.importorskip("llama_cpp")

from moecache.core.profile import UsageProfile  # noqa: E402
from moecache.live import native  # noqa: E402
from moecache.live.activate import attach  # noqa: E402
from moecache.live.cache import CacheUnavailable  # noqa: E402
from moecache.live.config import ConfigError  # noqa: E402

PROMPT = b"The three primary colors are"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def record_plans(cache):
    """Wrap the cache's engine so that each step's observation and plan are kept."""
    plans = []
    step = cache.engine.step

    def recording(ids=None, ready=None, admitted=None, prefill=False):
        plan = step(ids, ready, admitted, prefill=prefill)
        plan.observed = None if ids is None else np.array(ids)
        plan.prefill = prefill
        plans.append(plan)
        return plan

    cache.engine.step = recording
    return plans


def unreported(cache) -> int:
    """Eager admission: the uploads the last graph started, which no boundary has reported to
    the engine yet (libllama counts them once they complete)."""
    return len(cache._read_admitted())


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
    from moecache.core.traces import read_trace
    from moecache.offline.replay import PER_LAYER, simulate

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
    replayed = simulate(trace, PER_LAYER, "lru", 2, inserts=2, admission=cache.config.admission).totals
    assert (replayed["hits"], replayed["misses"]) == (stats["totals"]["hits"], stats["totals"]["misses"])


def test_no_torn_slot_with_slow_uploads(rpc_device, tiny_path):
    stock = greedy(load(tiny_path), PROMPT, 48)
    llm = load(tiny_path)
    cache = attach(llm, slots=2, inserts=8, policy="lru")  # never waits: graphs run during uploads
    native.lib().llama_moe_cache_set_upload_delay_us(cache.ctx, 3000)
    tokens, logits = greedy(llm, PROMPT, 48)
    totals = cache.stats()["totals"]
    assert totals["uploads"] > 0
    assert totals["late"] > 0, "uploads must outlast a graph to test tearing"
    assert cache.stats()["upload_wait_us"] == 0
    assert tokens == stock[0] and np.array_equal(logits, stock[1])


def test_a_refused_plan_freezes_the_cache_and_decoding_stays_exact(rpc_device, tiny_path):
    """libllama checks every row of a plan before applying any: a bad one (slot K) is refused
    whole, the scheduler freezes the cache with one logged line, the output stays stock."""
    stock = greedy(load(tiny_path), PROMPT, 24)
    llm = load(tiny_path)
    cache = attach(llm, slots=2, inserts=2, policy="lru", wait=1)
    step = cache.engine.step
    applied = []

    def bad_plan(ids=None, ready=None, admitted=None, prefill=False):
        plan = step(ids, ready, admitted, prefill=prefill)
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


def test_waiting_for_uploads_is_an_option(rpc_device, tiny_path):
    llm = load(tiny_path)
    cache = attach(llm, slots=2, inserts=8, policy="lru", wait=1)
    native.lib().llama_moe_cache_set_upload_delay_us(cache.ctx, 3000)
    greedy(llm, PROMPT, 16)
    assert cache.stats()["totals"]["late"] == 0 and cache.stats()["upload_wait_us"] > 0


@pytest.mark.parametrize("env,overrides,message", [
    ({"LLAMA_MOE_CACHE_SLOTS": "abc"}, {}, "LLAMA_MOE_CACHE_SLOTS='abc' is not an integer"),
    ({}, {"slots": -1}, "LLAMA_MOE_CACHE_SLOTS=-1 must be >= 0"),
    ({}, {"slots": 2, "inserts": 0}, "LLAMA_MOE_CACHE_INSERTS=0 must be >= 1"),
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
    assert native.lib().llama_moe_cache_n_layers(native.as_context(llm._ctx.ctx)) == 0


@pytest.fixture(scope="module")
def q4_synth():
    """A synthetic Q4_0 MoE (4 layers, 16 experts, top-4) whose greedy decoding walks a fixed
    cycle with wide margins; its experts are what llama.cpp repacks on x86 (q4_0_8x8)."""
    from moecache.models import synth

    return str(synth.synth_moe("qwen3-30b-a3b", n_layer=4, n_expert=16, n_expert_used=4, n_embd=256,
                               n_ff_exp=128, n_head=4, n_head_kv=2, head_dim=64, n_ff=512, threads=1))


# Cached experts run the device's plain Q4_0 kernels, the others the host's repacked ones: the
# logits differ from stock repacked by float rounding only. Measured over 256 greedy tokens of
# q4_synth with K=4 of 16 (test_repacked_host_experts_stay_repacked prints it): 1.1e-4. The bound
# leaves ~100x of margin and stays far below the model's smallest top-2 logit gap.
REPACK_LOGIT_TOLERANCE = 1e-2


def test_repacked_host_experts_stay_repacked(capfd, rpc_device, q4_synth):
    """With the cache on, host experts are repacked as stock --cpu-moe loads them; the skip
    table and observer work in the repacked mul_mat_id (every lookup counted, cached rows
    zero), slots are read from the model file, and greedy decoding matches stock."""
    stock = greedy(load(q4_synth, repack=True), PROMPT, 256)
    capfd.readouterr()
    llm = load(q4_synth, repack=True, verbose=True)
    assert "CPU_REPACK model buffer size" in capfd.readouterr().err  # llama.cpp's load log
    cache = attach(llm, slots=4, inserts=2, policy="lru", wait=1)
    assert all(layer["from_file"] for layer in cache.layers)
    tokens, logits = greedy(llm, PROMPT, 256)

    diff = float(np.abs(logits - stock[1]).max())
    print(f"repacked: max |logit difference| over 256 tokens {diff:.3g}")
    assert tokens == stock[0]
    assert diff <= REPACK_LOGIT_TOLERANCE
    stats = cache.stats()
    assert stats["totals"]["hits"] > 0 and stats["totals"]["evictions"] > 0
    lookups = stats["totals"]["hits"] + stats["totals"]["misses"]
    native_counters = cache.native_counters()
    n_layers, k = len(cache.layers), cache.n_used
    assert sum(c["hits"] + c["misses"] for c in native_counters) == lookups + n_layers * k
    assert sum(c["uploads"] for c in native_counters) == \
        stats["totals"]["uploads"] + stats["totals"]["prefill_uploads"] + unreported(cache)


def moecache_log_lines(caplog, action) -> list[str]:
    """What the moecache logger says during action() (it does not propagate to caplog's root)."""
    import logging

    moecache_log = logging.getLogger("moecache")
    moecache_log.addHandler(caplog.handler)
    try:
        action()
    finally:
        moecache_log.removeHandler(caplog.handler)
    return [r.getMessage() for r in caplog.records if r.name == "moecache"]


def test_a_model_file_changed_after_load_stops_uploads_and_decoding_stays_stock(
        tmp_path, caplog, rpc_device, q4_synth):
    import shutil

    path = tmp_path / "model.gguf"
    shutil.copyfile(q4_synth, path)
    stock = greedy(load(str(path), repack=True), PROMPT, 24)
    llm = load(str(path), repack=True)
    cache = attach(llm, slots=4, inserts=2, policy="lru")
    with open(path, "ab") as f:  # the file is not what was loaded any more
        f.write(b"\0" * 64)
    decoded = []
    lines = moecache_log_lines(caplog, lambda: decoded.append(greedy(llm, PROMPT, 24)))
    tokens, logits = decoded[0]
    assert tokens == stock[0] and np.array_equal(logits, stock[1])  # no slot was ever used
    assert "model file changed" in cache.failed
    assert len(lines) == 1 and "model file changed" in lines[0], lines
    assert sum(c["uploads"] for c in cache.native_counters()) == 0


def test_a_relative_model_path_keeps_working_after_a_chdir(tmp_path, monkeypatch, rpc_device, q4_synth):
    monkeypatch.chdir(os.path.dirname(q4_synth))
    llm = load(os.path.basename(q4_synth), repack=True)
    cache = attach(llm, slots=4, inserts=2, policy="lru", wait=1)
    monkeypatch.chdir(tmp_path)
    greedy(llm, PROMPT, 16)
    assert cache.failed is None and sum(c["uploads"] for c in cache.native_counters()) > 0


def test_repacked_experts_of_a_split_model_are_read_from_their_split(tmp_path, rpc_device, q4_synth):
    """A model in several GGUF files: each expert tensor's bytes come from the split that
    holds it (llama_model::paths, in order)."""
    import gguf
    from gguf.scripts.gguf_new_metadata import copy_with_new_metadata

    reader = gguf.GGUFReader(q4_synth)
    writer = gguf.GGUFWriter(tmp_path / "split.gguf", reader.fields["general.architecture"].contents(),
                             split_max_tensors=len(reader.tensors) // 3 + 1)
    copy_with_new_metadata(reader, writer, {}, [])
    splits = sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert len(splits) == 3
    stock = greedy(load(q4_synth, repack=True), PROMPT, 64)
    llm = load(str(splits[0]), repack=True)
    cache = attach(llm, slots=4, inserts=2, policy="lru", wait=1)
    assert all(layer["from_file"] for layer in cache.layers)
    tokens, logits = greedy(llm, PROMPT, 64)
    assert tokens == stock[0] and float(np.abs(logits - stock[1]).max()) <= REPACK_LOGIT_TOLERANCE
    assert cache.failed is None and cache.stats()["totals"]["hits"] > 0
    totals = cache.stats()["totals"]
    assert sum(c["uploads"] for c in cache.native_counters()) == \
        totals["uploads"] + totals["prefill_uploads"] + unreported(cache) > 0


def test_a_repacked_model_without_a_file_source_loads_plain(monkeypatch, caplog):
    """Repacked experts need the model file to fill the slots: a path that is not a readable
    file gets plain buffers instead, with one logged line."""
    import llama_cpp.llama_cpp as lib

    from moecache.live import placement

    seen = []
    monkeypatch.setattr(lib, "llama_model_load_from_file", lambda path, params: seen.append(params.use_extra_bufts))

    def load_two():
        with placement.experts_on_host(repack=True):
            lib.llama_model_load_from_file(b"/nonexistent/model.gguf", lib.llama_model_default_params())
            lib.llama_model_load_from_file(REPO.encode() + b"/README.md", lib.llama_model_default_params())

    lines = moecache_log_lines(caplog, load_two)
    assert seen == [False, True]
    assert lines == [
        "moecache: /nonexistent/model.gguf is not a readable file to read repacked experts back "
        "from: experts kept in plain buffers"]


def test_device_allocation_failure_keeps_decode_stock(rpc_device, tiny_path):
    stock = greedy(load(tiny_path), PROMPT, 16)
    llm = load(tiny_path)
    ctx = native.as_context(llm._ctx.ctx)
    assert native.init(ctx, 1 << 30) == 0  # far beyond the device
    assert native.lib().llama_moe_cache_n_layers(ctx) == 0
    tokens, logits = greedy(llm, PROMPT, 16)
    assert tokens == stock[0] and np.array_equal(logits, stock[1])


def test_freed_contexts_do_not_keep_their_caches(tmp_path, rpc_device, tiny_path):
    """50 contexts created, used and freed: each cache reports when its context is freed and
    is then dropped (neither activate nor atexit keeps it)."""
    import gc
    import weakref

    from moecache.live import activate

    stats = tmp_path / "stats.json"
    kept = len(activate._caches)
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
    assert len(activate._caches) <= kept
    assert [ref for ref in caches if ref() is not None] == []


def test_zero_code_contexts_do_not_accumulate(tiny_path):
    run = _run_python("""
        import gc
        from moecache.live.rpc import RpcDevice
        device = RpcDevice(threads=1)
        from llama_cpp import Llama
        import moecache.live.activate as activate
        counts = []
        for i in range(50):
            llm = Llama(model_path=%r, n_gpu_layers=-1, n_ctx=256, verbose=False)
            llm.create_completion("hello", max_tokens=2)
            counts.append(len(activate._caches))
            llm.close()
        gc.collect()
        print("CACHES=%%d %%d" %% (max(counts), len(activate._caches)))
    """ % tiny_path, {"LLAMA_MOE_CACHE_SLOTS": "2"})
    assert run.returncode == 0, run.stderr
    assert _line(run.stdout, "CACHES=") == "1 0"


def _run_python(code: str, env: dict, timeout=300) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_MOE_CACHE_")}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


UNMODIFIED_PROGRAM = """
    from moecache.live.rpc import RpcDevice
    device = RpcDevice(threads=2)        # this machine has no GPU: the loopback test device
    # --- an unmodified llama-cpp-python program ---
    from llama_cpp import Llama
    llm = Llama(model_path={path!r}, n_gpu_layers=-1, n_ctx=256, verbose=False)
    out = llm.create_completion("The three primary colors are", max_tokens=24, temperature=0.0)
    print("TEXT=" + repr(out["choices"][0]["text"]))
    import llama_cpp, moecache.live.native as native
    print("LAYERS=%d" % native.lib().llama_moe_cache_n_layers(native.as_context(llm._ctx.ctx)))
"""


def test_zero_code_activation(tmp_path, tiny_path):
    stats = tmp_path / "stats.json"
    on = _run_python(UNMODIFIED_PROGRAM.format(path=tiny_path),
                     {"LLAMA_MOE_CACHE_SLOTS": "2", "LLAMA_MOE_CACHE_STATS": str(stats)})
    assert on.returncode == 0, on.stderr
    assert "LAYERS=2" in on.stdout
    report = json.loads(stats.read_text())
    assert report["slots"] == 2 and report["decode_steps"] > 0
    assert report["totals"]["hits"] + report["totals"]["misses"] > 0

    off = _run_python(UNMODIFIED_PROGRAM.format(path=tiny_path), {})
    assert off.returncode == 0, off.stderr
    assert "LAYERS=0" in off.stdout
    assert _line(off.stdout, "TEXT=") == _line(on.stdout, "TEXT=")


def test_zero_code_trace_of_a_model_whose_name_has_spaces(tmp_path, tiny_path):
    from moecache.core.traces import read_trace

    trace_path = tmp_path / "live.route.csv"
    run = _run_python(UNMODIFIED_PROGRAM.format(path=tiny_path),
                      {"LLAMA_MOE_CACHE_SLOTS": "2", "LLAMA_MOE_CACHE_TRACE": str(trace_path)})
    assert run.returncode == 0, run.stderr
    assert "LAYERS=2" in run.stdout, run.stderr  # general.name is "moecache tiny qwen3moe"
    trace = read_trace(str(trace_path))
    assert trace.model == "moecache_tiny_qwen3moe" and (trace.phase == 1).sum() > 0


def test_zero_code_trace_of_a_long_non_ascii_model_name(tmp_path, tiny_path):
    """general.name is read into 255 bytes: a long UTF-8 name is cut mid-character."""
    from moecache.core.traces import read_trace

    model = tmp_path / "named.gguf"
    subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", "--force", "--general-name",
                    "x" + "模型" * 100, tiny_path, str(model)], check=True, capture_output=True)
    trace_path = tmp_path / "live.route.csv"
    run = _run_python(UNMODIFIED_PROGRAM.format(path=str(model)),
                      {"LLAMA_MOE_CACHE_SLOTS": "2", "LLAMA_MOE_CACHE_TRACE": str(trace_path)})
    assert run.returncode == 0, run.stderr
    assert "LAYERS=2" in run.stdout, run.stderr
    assert read_trace(str(trace_path)).model == "x" + ("模型" * 42)[:84]


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
    moecache_log = logging.getLogger("moecache")  # it does not propagate to caplog's root handler
    moecache_log.addHandler(caplog.handler)
    try:
        cache.close()
    finally:
        moecache_log.removeHandler(caplog.handler)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith(f"moecache: error: LLAMA_MOE_CACHE_{broken.upper()}="), errors
    if broken == "stats":
        assert UsageProfile.load(str(paths["profile"])).counts.sum() == 7 * 2 * 2  # steps x layers x k
    else:
        assert json.loads(paths["stats"].read_text())["decode_steps"] == 7


def test_a_failing_trace_write_stops_the_trace_not_the_cache(tmp_path, caplog, rpc_device, tiny_path):
    stock = greedy(load(tiny_path), PROMPT, 16)
    llm = load(tiny_path)
    trace_path = tmp_path / "t.csv"
    cache = attach(llm, slots=2, trace=str(trace_path))
    greedy(llm, PROMPT, 4)
    read_only = os.open(os.devnull, os.O_RDONLY)  # writes to it fail, as on a full disk
    os.close(cache.trace._fd)
    cache.trace._fd = read_only
    moecache_log = logging.getLogger("moecache")  # it does not propagate to caplog's root handler
    moecache_log.addHandler(caplog.handler)
    try:
        tokens, logits = greedy(llm, PROMPT, 16)
    finally:
        moecache_log.removeHandler(caplog.handler)
    assert tokens == stock[0] and np.array_equal(logits, stock[1])
    errors = [r.getMessage() for r in caplog.records if "LLAMA_MOE_CACHE_TRACE" in r.getMessage()]
    assert len(errors) == 1 and "trace stopped after" in errors[0], errors
    assert cache.trace is None and cache.failed is None and cache.stats()["decode_steps"] > 16


DECODING_FOREVER = """
    import llama_cpp, numpy as np
    from moecache.live.rpc import RpcDevice
    device = RpcDevice(threads=1)
    print("DEVICE=%d" % device.process.pid, flush=True)
    llm = llama_cpp.Llama(model_path={path!r}, n_gpu_layers=-1, n_ctx=4096, verbose=False)
    llm.eval(llm.tokenize(b"The three primary colors are"))
    for step in range(4000):
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),))
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

    from moecache.core.traces import read_trace

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


def test_zero_code_bad_value_is_one_logged_line_and_stock(tiny_path):
    run = _run_python(UNMODIFIED_PROGRAM.format(path=tiny_path), {"LLAMA_MOE_CACHE_SLOTS": "abc"})
    assert run.returncode == 0, run.stderr
    assert "LAYERS=0" in run.stdout
    errors = [line for line in run.stderr.splitlines() if "moecache: error" in line]
    assert errors == ["moecache: error: LLAMA_MOE_CACHE_SLOTS='abc' is not an integer - expert cache disabled"]


def test_zero_code_refusal_is_the_only_line_in_a_verbose_log(tiny_path):
    """libllama reads no LLAMA_MOE_CACHE_* variable: a refused value is moecache's one line, with
    no second one from llama.cpp's log (its model load and context creation are stock)."""
    program = UNMODIFIED_PROGRAM.format(path=tiny_path).replace("verbose=False", "verbose=True")
    run = _run_python(program, {"LLAMA_MOE_CACHE_SLOTS": "abc"})
    assert run.returncode == 0, run.stderr
    assert "LAYERS=0" in run.stdout
    lines = [line for line in run.stderr.splitlines()
             if "LLAMA_MOE_CACHE" in line or line.startswith("moecache") or "expert cache" in line]
    assert len(lines) == 1 and lines[0].startswith("moecache: error: LLAMA_MOE_CACHE_SLOTS="), lines


def test_inert_without_the_variable(tiny_path):
    run = _run_python("""
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


def test_two_devices_each_hold_their_layers_cache(smol_path):
    run = _run_python("""
        import json, numpy as np, sys
        sys.path.insert(0, "tests")
        from moecache.live.rpc import RpcDevice
        devices = [RpcDevice(threads=1), RpcDevice(threads=1)]
        from conftest import default_params, greedy, load
        from moecache.live.activate import attach
        stock = greedy(load(%r), b"The three primary colors are", 48)
        llm = load(%r)
        cache = attach(llm, slots=2, inserts=1, policy="lru")
        tokens, logits = greedy(llm, b"The three primary colors are", 48)
        print("RESULT=" + json.dumps({"devices": sorted({l["device"] for l in cache.layers}),
              "exact": tokens == stock[0] and bool(np.array_equal(logits, stock[1])),
              "evictions": cache.stats()["totals"]["evictions"]}))
    """ % (smol_path, smol_path), {})
    assert run.returncode == 0, run.stderr
    result = json.loads(_line(run.stdout, "RESULT="))
    assert len(result["devices"]) == 2, result
    assert result["exact"] and result["evictions"] > 0


def _line(text: str, prefix: str) -> str:
    return next(line[len(prefix):] for line in text.splitlines() if line.startswith(prefix))


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
    assert off and not any("moe_cache" in name for name in off)
    assert any(name.startswith("ffn_moe_cache_down") for name in on)
    # the cache adds its own nodes and removes none of the stock graph's (unnamed nodes are
    # called after their index, which the added nodes shift)
    named = lambda names: {n for n in names if not n.startswith("node_")}  # noqa: E731
    assert named(off) <= named(on) and len(on) > len(off)


@pytest.mark.parametrize("policy", ["lru", "default"])
def test_live_trace_replays_to_the_live_hit_count(tmp_path, rpc_device, smol_path, policy):
    from moecache.core.traces import read_trace
    from moecache.offline.replay import PER_LAYER, simulate

    trace_path = tmp_path / "live.route.csv"
    llm = load(smol_path)
    cache = attach(llm, slots=2, inserts=1, policy=policy, trace=str(trace_path), wait=1)
    greedy(llm, PROMPT, 48)
    cache.close()
    live = cache.stats()["totals"]

    trace = read_trace(str(trace_path))
    assert int((trace.residency[trace.phase == 1] > 0).sum()) == live["hits"]
    replayed = simulate(trace, PER_LAYER, cache.config.policy, 2, inserts=1,
                        admission=cache.config.admission).totals
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


def test_unsupported_architecture_is_refused_and_stock(capfd, rpc_device):
    """A real MoE architecture outside the cache's list (granitemoe): attach refuses it,
    libllama logs one line naming it, and decoding stays stock."""
    import logging

    from moecache.models import tiny_moe

    path = str(tiny_moe(n_layer=2, n_expert=8, arch="granitemoe"))
    stock = greedy(load(path), PROMPT, 16)
    llm = load(path)  # experts in host memory, the rest on the RPC device
    assert native.model_metadata(native.as_context(llm._ctx.ctx), "general.architecture") == "granitemoe"
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
    assert len(lines) == 1 and "'granitemoe'" in lines[0], lines
    assert native.lib().llama_moe_cache_n_layers(native.as_context(llm._ctx.ctx)) == 0
    tokens, logits = greedy(llm, PROMPT, 16)
    assert tokens == stock[0] and np.array_equal(logits, stock[1])


# --- eager admission: libllama's observers start the uploads of a graph's misses ------------------

@pytest.fixture(scope="module")
def synth48():
    """The Qwen3-30B-A3B routing shape (48 layers, 128 experts, top-8), locality 0.6, with tiny
    widths: 23 MB, a few ms per token."""
    from moecache.models import synth

    return str(synth.synth_moe("qwen3-30b-a3b", n_layer=48, n_embd=64, n_ff_exp=32, n_head=2, n_head_kv=1,
                               head_dim=32))


def test_eager_admission_raises_the_live_hit_rate_and_replays_exactly(tmp_path, rpc_device, synth48):
    from moecache.core.traces import read_trace
    from moecache.offline.replay import PER_LAYER, simulate

    n_tokens = 128
    stock = greedy(load(synth48), PROMPT, n_tokens)
    rates = {}
    for admission in ("boundary", "eager"):
        trace_path = tmp_path / f"{admission}.route.csv"
        llm = load(synth48)
        cache = attach(llm, slots=16, inserts=2, wait=1, admission=admission, trace=str(trace_path))
        tokens, logits = greedy(llm, PROMPT, n_tokens)
        cache.close()
        live = cache.stats()
        # eager: at every boundary what libllama admitted equalled the engine's model (or it freezes)
        assert live["failed"] is None and live["admission"] == admission
        assert tokens == stock[0] and np.array_equal(logits, stock[1])
        trace = read_trace(str(trace_path))
        replayed = simulate(trace, PER_LAYER, cache.config.policy, 16, inserts=2, admission=admission).totals
        assert (replayed["hits"], replayed["misses"]) == (live["totals"]["hits"], live["totals"]["misses"])
        decode = trace.batch > trace.batch[0]  # the one-token ubatches after the prompt's
        rates[admission] = (trace.residency[decode] > 0).sum() / (trace.ids[decode] >= 0).sum()
    print(f"live decode hit rate, {cache.config.policy}, K=16, {n_tokens} tokens: "
          f"boundary {100 * rates['boundary']:.1f}%, eager {100 * rates['eager']:.1f}%")
    assert rates["eager"] >= rates["boundary"] + 0.02


LONG_PROMPT = b"The three primary colors are red, yellow and blue; mixing two of them gives the others. " * 4


@pytest.mark.parametrize("n_batch", [512, 32])
def test_a_long_prompt_warms_the_cache_exactly_and_replays_to_the_live_hit_count(tmp_path, rpc_device, synth48,
                                                                                n_batch):
    """A prompt longer than LLAMA_MOE_CACHE_MAX_BATCH runs the stock graph (in ubatches of n_batch
    tokens), each ubatch a prefill step that uploads its most used experts; the logits stay
    bit-identical, and the replay with prefill="warm" reproduces the live hit count."""
    from moecache.core.traces import PREFILL, read_trace
    from moecache.offline.replay import PER_LAYER, simulate

    n_tokens = 48
    stock = greedy(load(synth48, n_batch=n_batch), LONG_PROMPT, n_tokens)
    trace_path = tmp_path / "live.route.csv"
    llm = load(synth48, n_batch=n_batch)
    n_prompt = len(llm.tokenize(LONG_PROMPT))
    assert n_prompt > 32
    cache = attach(llm, slots=16, inserts=2, wait=1, trace=str(trace_path))
    tokens, logits = greedy(llm, LONG_PROMPT, n_tokens)
    cache.close()
    live = cache.stats()
    assert live["failed"] is None
    assert tokens == stock[0] and np.array_equal(logits, stock[1])
    assert (live["prefill_steps"], live["prefill_tokens"]) == (-(-n_prompt // n_batch), n_prompt)
    assert live["totals"]["prefill_uploads"] > 0 and live["totals"]["prefill_upload_bytes"] > 0

    trace = read_trace(str(trace_path))
    assert (trace.phase == PREFILL).sum() == n_prompt
    replay = {prefill: simulate(trace, PER_LAYER, cache.config.policy, 16, inserts=2, prefill=prefill,
                                admission=cache.config.admission) for prefill in ("warm", "off")}
    warm = replay["warm"].totals
    assert (warm["hits"], warm["misses"]) == (live["totals"]["hits"], live["totals"]["misses"])
    assert replay["warm"].totals_all["prefill_uploads"] == live["totals"]["prefill_uploads"]
    assert replay["off"].totals["hits"] != warm["hits"]  # the prompt's uploads made a difference


def record_residency(cache):
    """Per boundary: the table the next graph reads (published expert -> slot), the slots being
    written while it runs (uploads in flight), the ids that graph selected and the uploads
    libllama's observers started during it (both reported at the boundary after it)."""
    steps = []
    step = cache.engine.step

    def recording(ids=None, ready=None, admitted=None, prefill=False):
        plan = step(ids, ready, admitted, prefill=prefill)
        if steps:  # about the graph that ran since the last boundary
            steps[-1].update(ids=None if ids is None else np.array(ids), admitted=plan.admitted)
        steps.append({"table": cache.engine.expert_slot.copy(), "writing": cache.engine._in_flight.copy()})
        return plan

    cache.engine.step = recording
    return steps


_stock_runs: dict = {}


@settings(max_examples=10, deadline=None, derandomize=True)
@given(slots=st.integers(1, 3), delay_us=st.sampled_from([0, 1000, 4000]), wait=st.integers(0, 1),
       policy=st.sampled_from(["lru", "heat"]), inserts=st.integers(1, 3),
       prompt=st.sampled_from([PROMPT, b"Once upon a time", b"1, 2, 3, 4,"]))
def test_no_upload_ever_targets_a_slot_the_running_graph_reads(rpc_device, tiny_path, slots, delay_us, wait,
                                                               policy, inserts, prompt):
    if prompt not in _stock_runs:
        _stock_runs[prompt] = greedy(load(tiny_path), prompt, 24)
    stock = _stock_runs[prompt]
    llm = load(tiny_path)
    cache = attach(llm, slots=slots, inserts=inserts, policy=policy, wait=wait, admission="eager")
    native.lib().llama_moe_cache_set_upload_delay_us(cache.ctx, delay_us)
    steps = record_residency(cache)
    tokens, logits = greedy(llm, prompt, 24)
    llm.close()
    assert cache.failed is None
    assert tokens == stock[0] and np.array_equal(logits, stock[1])  # a torn slot changes the logits
    n_admitted = 0
    for before in steps:
        if before.get("ids") is None:
            continue
        for layer, row in enumerate(before["ids"]):
            table = before["table"][layer]
            read = {int(table[e]) for e in row if e >= 0 and table[e] >= 0}
            written = set(np.flatnonzero(before["writing"][layer]).tolist())
            written |= {slot for l, _, slot in before["admitted"].tolist() if l == layer}
            assert not read & written, (layer, sorted(read), sorted(written))
        n_admitted += len(before["admitted"])
    assert n_admitted > 0
