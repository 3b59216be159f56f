"""One pool of slots per group of layers under our cache's rules (moecache.offline.pooled): the
pooled trace, the graph's slot writes under each victim rule, and a pool of one layer replaying
as the per-layer engine does."""

import numpy as np
import pytest

from moecache.core.admission import Handover
from moecache.core.engine import CacheEngine
from moecache.core.policies import make_policy
from moecache.formats.traces import RouteTrace, synthetic_routing
from moecache.offline.experiments import HeatSum
from moecache.offline.pooled import PooledEngine, Victims, pool_admissions, pooled_replay, pooled_trace
from moecache.offline.replay import PerLayerReplay, simulate


def routing(n_layers=4, sizes=None, steps=40, seed=3):
    ids = synthetic_routing(steps, n_layers, 16, 2, seed=seed)
    return RouteTrace.from_routing(ids, 16, expert_bytes=sizes or [10 ** 6] * n_layers)


def test_a_pooled_layer_is_its_groups_layers_side_by_side():
    trace = routing(4, sizes=[1, 2, 1, 2])
    pooled, n = pooled_trace(trace)
    assert n == 2 and pooled.n_expert == 32 and pooled.n_expert_used == 4
    assert pooled.expert_bytes.tolist() == [1, 2]
    # group 0 holds layers 0 and 2: layer 2's expert e is 16 + e, after layer 0's selections
    assert np.array_equal(pooled.ids[:, 0, :2], trace.ids[:, 0])
    assert np.array_equal(pooled.ids[:, 0, 2:], trace.ids[:, 2] + 16)
    assert np.array_equal(pooled.ids[:, 1, 2:], trace.ids[:, 3] + 16)
    with pytest.raises(ValueError, match="equal layer counts"):
        pooled_trace(routing(3, sizes=[1, 2, 1]))


@pytest.mark.parametrize("policy, inserts", [("heat", 2), ("heat-sum", None), ("lru", 1)])
def test_a_pool_of_one_layer_replays_as_the_per_layer_engine(policy, inserts):
    """Every layer its own group: the pool is the layer, and the slot writes computed layer by
    layer are the engine's own (native/engine_core.c's mc_admit)."""
    trace = routing(4, sizes=[1, 2, 3, 4], steps=60)
    make = (lambda: HeatSum()) if policy == "heat-sum" else (lambda: make_policy(policy))
    for rule in ("oracle", "run", "ahead", "defer", "run-first"):
        pooled = pooled_replay(trace, make(), 4, inserts=inserts, rule=rule)
        plain = simulate(trace, PerLayerReplay(make(), 4, inserts=inserts, admission="eager", prefill="warm"))
        assert {k: pooled.totals[k] for k in ("hits", "misses", "uploads")} == \
            {k: plain.totals[k] for k in ("hits", "misses", "uploads")}, rule


def handover(n_slots, worth, n_keys=8):
    """One pool: its slots are victims in slot order, each worth 1; every miss worth `worth`."""
    return Handover(victims=np.arange(n_slots, dtype=np.int32)[None], victim_worth=np.ones((1, n_slots)),
                    worth=np.full((1, n_keys), worth), budget=np.array([n_slots]))


# two layers of 4 experts in one pool of 2 slots: slot 0 holds layer 1's expert 0 (key 4), slot 1
# layer 0's expert 3 (key 3)
SLOTS = np.array([[4, 3]], dtype=np.int32)


def writes(ids, rule, inserts=None, recent=None, worth=2.0, tally=None):
    h = handover(2, worth)
    jobs, clobbered = pool_admissions(h, np.array([ids]), SLOTS, 2, inserts, rule,
                                      None if recent is None else np.array([recent]), tally)
    return jobs.tolist(), clobbered


def test_victims_under_each_rule():
    # layer 0 misses 1, layer 1 selects its own expert 0 (key 4, a hit) and misses 1 (key 5)
    ids = [1, -1, 4, 5]
    # oracle: slot 0's expert is read later in the graph; layer 0 takes slot 1, then layer 1 has none
    assert writes(ids, "oracle") == ([[0, 1, 1]], 0)
    # run: layer 0 may not take a later layer's slot; its own (slot 1) it may
    assert writes(ids, "run") == ([[0, 1, 1]], 0)
    # ahead: slot 0 first (not used lately), though layer 1 then reads it: a miss, counted
    # (and layer 1's miss takes slot 1, layer 0's: layer 0 has run)
    assert writes(ids, "ahead") == ([[0, 1, 0], [0, 5, 1]], 1)
    assert writes(ids, "ahead", recent=[4]) == ([[0, 1, 1]], 0)  # used in the last graph: not taken ahead
    # a later layer's expert that the graph does not select is every rule's but run's victim
    ids = [1, -1, 6, -1]
    assert writes(ids, "oracle")[0] == writes(ids, "ahead")[0] == [[0, 1, 0], [0, 6, 1]]
    assert writes(ids, "run")[0] == [[0, 1, 1], [0, 6, 0]]


def test_inserts_cap_each_layer_not_the_pool():
    slots = np.array([[-1, -1, -1, -1]], dtype=np.int32)
    h = handover(4, 2.0)
    h.victim_worth[:] = -np.inf  # free slots
    jobs, _ = pool_admissions(h, np.array([[0, 1, 4, 5]]), slots, 2, 1, "oracle")
    assert jobs.tolist() == [[0, 0, 0], [0, 4, 1]]  # one per layer


def test_an_expert_evicted_ahead_and_used_later_in_the_graph_is_a_miss():
    trace = routing(4, steps=60)
    pooled, n = pooled_trace(trace)
    engine = PooledEngine(pooled.layers.size, pooled.n_expert, 4 * n, make_policy("lru"), n_sub=n, inserts=None,
                          rule="ahead")
    result = simulate(pooled, PerLayerReplay(engine, prefill="warm"))
    counted = CacheEngine.stats(engine)["totals"]  # the engine's own count: hits while published
    assert engine.clobbered > 0
    assert result.totals["hits"] == counted["hits"] - engine.clobbered
    assert result.totals["misses"] == counted["misses"] + engine.clobbered


def test_a_deferred_copy_waits_for_its_victims_layer():
    """defer: layer 0's miss reserves slot 0 (layer 1's expert 0, first in the order); its copy
    starts when layer 1 has run, or, layer 1 selecting that expert, the miss takes the next victim
    it may take then: the oracle's writes, nothing evicted ahead."""
    tally = {}
    # layer 1 selects key 4: the reservation falls through, layer 0's miss takes slot 1 (layer 0's
    # expert 3, its layer run) at layer 1, one layer late; layer 1's miss 5 finds no victim left
    assert writes([1, -1, 4, 5], "defer", tally=tally) == writes([1, -1, 4, 5], "oracle") == ([[0, 1, 1]], 0)
    assert tally == {"copies": 1, "waited": 1, "started": 1.0, "waits": [True], "starts": [1.0]}
    # layer 1 does not select key 4: the copy into slot 0 starts at layer 1, ahead of layer 1's own
    assert writes([1, -1, 6, -1], "defer") == writes([1, -1, 6, -1], "oracle") == ([[0, 1, 0], [0, 6, 1]], 0)
    # a reach of 0 layers never waits: the window's marks decide, as ahead's
    assert writes([1, -1, 4, 5], Victims("defer", 1, reach=0)) == writes([1, -1, 4, 5], "ahead")
    assert writes([1, -1, 4, 5], Victims("defer", 1, reach=0), recent=[4]) == ([[0, 1, 1]], 0)


def test_ahead_marks_by_worth_and_readmission():
    # marked by worth instead of a window: slot 0 keeps 1.0, taken ahead only below a larger bound
    assert writes([1, -1, 4, 5], Victims("ahead", below=0.5)) == ([[0, 1, 1]], 0)
    assert writes([1, -1, 4, 5], Victims("ahead", below=1.5)) == ([[0, 1, 0], [0, 5, 1]], 1)
    # readmit: layer 1 finds key 4 evicted ahead and copies it back (a miss, counted) before its
    # miss 5, when the policy admits every miss; with an admission test it is worth what it kept
    assert writes([1, -1, 4, 5], Victims("ahead", readmit=True), worth=np.inf) == ([[0, 1, 0], [0, 4, 1]], 1)
    assert writes([1, -1, 4, 5], Victims("ahead", readmit=True)) == writes([1, -1, 4, 5], "ahead")


def overwritten_reads(rule, seed):
    """Over random graphs of 4 layers of 8 experts (top-2) in one pool of 12 slots, the copies
    into a slot whose expert the graph selects."""
    rng = np.random.default_rng(seed)
    bad = 0
    for _ in range(200):
        slot_expert = rng.choice(32, 12, replace=False).astype(np.int32)[None]
        h = Handover(victims=rng.permutation(12).astype(np.int32)[None], victim_worth=np.zeros((1, 12)),
                     worth=np.full((1, 32), 1.0), budget=np.array([12]))
        ids = np.concatenate([layer * 8 + rng.choice(8, 2, replace=False) for layer in range(4)])[None]
        jobs, _ = pool_admissions(h, ids, slot_expert, 4, None, rule, np.array([[]], dtype=np.int32))
        bad += sum(int(slot_expert[0, s]) in ids[0] for _, _, s in jobs)
    return bad


def test_deferred_copies_never_overwrite_what_the_graph_reads():
    assert overwritten_reads("defer", 1) == overwritten_reads("oracle", 1) == 0
    assert overwritten_reads("ahead", 1) > 0  # taken ahead at once, a later layer reads it
    trace = routing(4, steps=80, seed=5)
    pooled, n = pooled_trace(trace)
    engine = PooledEngine(pooled.layers.size, pooled.n_expert, 3 * n, HeatSum(), n_sub=n, inserts=None,
                          rule="defer")
    simulate(pooled, PerLayerReplay(engine, prefill="warm"))
    assert engine.clobbered == 0 and engine.tally["waited"] > 0
    with pytest.raises(ValueError, match="rule must be one of"):
        Victims("later")


def test_late_copies_are_published_a_boundary_later():
    """The worst cases of a copy's start: copies that waited for their victim's layer (late), or
    started after a share of the pool's layers (late_after), published a boundary late, cost
    hits; a share no copy starts after costs none."""
    trace = routing(4, steps=80, seed=5)
    on_time = pooled_replay(trace, HeatSum(), 3, inserts=None, rule=Victims("defer")).totals
    assert pooled_replay(trace, HeatSum(), 3, inserts=None, rule=Victims("defer", late_after=1.0)).totals == on_time
    for late in (Victims("defer", late=True), Victims("defer", late_after=0.5), Victims("oracle", late_after=0.5)):
        assert pooled_replay(trace, HeatSum(), 3, inserts=None, rule=late).totals["hits"] < on_time["hits"], late
