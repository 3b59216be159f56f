"""Uploads on the loopback RPC device: slow ones never tear a slot, waiting for them is an
option, eager admission starts them during the graph, a long prompt warms the cache."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import PROMPT, greedy, load, replayed_as_live
from hypothesis import given, settings
from hypothesis import strategies as st

llama_cpp = pytest.importorskip("llama_cpp")

from moecache.live import native  # noqa: E402
from moecache.live.activate import attach  # noqa: E402


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


def test_waiting_for_uploads_is_an_option(rpc_device, tiny_path):
    llm = load(tiny_path)
    cache = attach(llm, slots=2, inserts=8, policy="lru", wait=1)
    native.lib().llama_moe_cache_set_upload_delay_us(cache.ctx, 3000)
    greedy(llm, PROMPT, 16)
    assert cache.stats()["totals"]["late"] == 0 and cache.stats()["upload_wait_us"] > 0


# --- eager admission: libllama's observers start the uploads of a graph's misses ------------------

def test_eager_admission_raises_the_live_hit_rate_and_replays_exactly(tmp_path, rpc_device, synth48):
    from moecache.formats.traces import read_trace
    from moecache.offline.replay import PerLayerReplay, simulate

    n_tokens = 128
    stock = greedy(load(synth48), PROMPT, n_tokens)
    rates = {}
    for admission in ("boundary", "eager"):
        trace_path = tmp_path / f"{admission}.route.csv"
        llm = load(synth48)
        # without the planner, which declines uploads that do not pay back the RPC link's time
        cache = attach(llm, slots=16, inserts=2, wait=1, admission=admission, planner=0, trace=str(trace_path))
        tokens, logits = greedy(llm, PROMPT, n_tokens)
        cache.close()
        live = cache.stats()
        # eager: at every boundary what libllama admitted equalled the engine's model (or it freezes)
        assert live["failed"] is None and live["admission"] == admission
        assert tokens == stock[0] and np.array_equal(logits, stock[1])
        trace = read_trace(str(trace_path))
        replayed = simulate(trace, PerLayerReplay(cache.config.policy, 16, inserts=2, **replayed_as_live(cache))).totals
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
    from moecache.formats.traces import PREFILL, read_trace
    from moecache.offline.replay import PerLayerReplay, simulate

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
    replay = {prefill: simulate(trace, PerLayerReplay(cache.config.policy, 16, inserts=2, prefill=prefill,
                                                      **replayed_as_live(cache)))
              for prefill in ("warm", "off")}
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

    def recording(ids=None, ready=None, admitted=None, **flags):
        plan = step(ids, ready, admitted, **flags)
        if steps:  # about the graph that ran since the last boundary
            steps[-1].update(ids=None if ids is None else np.array(ids), admitted=plan.admitted)
        steps.append({"table": cache.engine.expert_slot.copy(), "writing": cache.engine.in_flight.copy()})
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
