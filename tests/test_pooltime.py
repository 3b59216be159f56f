"""The pooled default in the time model (moecache.offline.pooltime): the link's timing of a copy,
when a late copy is published at the boundary and at its layer, the planner's rule on a pool's
graph, and the replay without planner nor timing being the pooled model's."""

import numpy as np
import pytest

from moecache.core.admission import Handover
from moecache.core.hardware import Hardware
from moecache.core.missplan import Rates
from moecache.core.policies import make_policy
from moecache.formats.traces import RouteTrace, synthetic_routing
from moecache.offline.experiments import HeatSumAdmission
from moecache.offline.pooled import PoolPlan, Victims, pool_admissions, pooled_replay
from moecache.offline.pooltime import LinkClock, carry, timed_pooled_replay
from moecache.offline.replay import zero_configuration

# 1 MB experts; a CPU miss reads 1 ms (1 GB/s), a copy takes 2 ms (0.5 GB/s); the ids' trip 0.2 ms;
# no dense weights, no join: a layer with one CPU miss takes 0.2 + 1.0 = 1.2 ms
RATES = Rates(host_gbps=1.0, link_gbps=0.5, dram_gbps=100.0, device_gbps=1e6, ids_trip_us=200, join_us=0)


def test_a_copy_yields_the_link_to_the_lane_copies():
    assert carry(0.0, 1.0, []) == 1.0
    assert carry(2.0, 1.0, [(0.0, 1.0)]) == 3.0                   # a window before it
    assert carry(0.0, 1.0, [(0.5, 0.8)]) == pytest.approx(1.3)    # a window inside it: carried after
    assert carry(0.0, 1.0, [(0.5, 0.8), (1.0, 2.0)]) == pytest.approx(2.3)


def clock(publication):
    """One pool of two layers of 4 experts (keys: layer 0's 0-3, layer 1's 4-7), 1 MB each."""
    return LinkClock(RATES, [10 ** 6] * 2, [0, 0], np.array([[0, 1]]), 4, publication)


@pytest.mark.parametrize("publication", ["boundary", "layer"])
def test_a_late_copy_is_published_when_the_link_has_carried_it(publication):
    """A graph of two layers, one CPU miss each: 1.2 ms a layer, the observers at 0.2 and 1.4 ms,
    the boundary at 2.4. Layer 1's observer starts two copies: a miss of its own (key 5) and, a
    deferred copy, one of layer 0's (key 1). Both start at 1.4; the first is done at 3.4, the
    second queued behind it at 5.4: both late at the boundary (2.4). With publication at the
    layer, key 5 is published at layer 1's observer in the next graph (2.4 + 1.4 = 3.8 >= 3.4):
    as good as published at the boundary; key 1 is not (2.4 + 0.2 = 2.6 < 5.4)."""
    c = clock(publication)
    rows = [(0, 5, 0), (0, 1, 1)]
    graph_ms, link_ms = c.graph(np.array([0, 0]), np.array([0, 0]), np.array([1, 1]), rows, [1, 1], [False, False])
    assert graph_ms == pytest.approx(2.4) and link_ms == pytest.approx(4.0)
    assert c.done[0, 0] == pytest.approx((3.4, 1)) and c.done[0, 1] == pytest.approx((5.4, 0))
    assert c.offset == pytest.approx([0.2, 1.4])
    assert [c.ready(row) for row in rows] == [publication == "layer", False]
    # the next graph the same: the boundary at 4.8, key 1's layer at 4.8 + 0.2 = 5.0, still before 5.4
    c.graph(np.array([0, 0]), np.array([0, 0]), np.array([1, 1]), [], [], [])
    assert c.now == pytest.approx(4.8)
    assert [c.ready(row) for row in rows[publication == "layer":]] == [True, False][publication == "layer":]
    c.graph(np.array([0, 0]), np.array([0, 0]), np.array([1, 1]), [], [], [])
    assert c.ready(rows[1]) and not c.done  # 7.2 >= 5.4: published, and the clock forgets it


def test_a_lane_copy_is_done_in_its_layer_and_the_uploads_wait_for_it():
    c = clock("boundary")
    # layer 0: one lane copy (its window 0.2 .. 2.2) and an upload it started, carried after the lane's
    rows = [(0, 1, 0), (0, 2, 1)]
    c.graph(np.array([0, 0]), np.array([1, 0]), np.array([0, 1]), rows, [0, 0], [True, False])
    assert c.done[0, 0][0] == pytest.approx(2.2) and c.done[0, 1][0] == pytest.approx(4.2)


def test_the_planner_restricts_the_lane_to_slots_safe_now_and_applies_its_margin():
    """One pool of two layers of 4 experts and 2 slots: slot 0 holds layer 1's expert 0 (key 4), the
    first victim; slot 1 layer 0's expert 3 (key 3). Each victim is worth 1, each miss 2."""
    h = Handover(victims=np.array([[0, 1]], dtype=np.int32), victim_worth=np.ones((1, 2)),
                 worth=np.full((1, 8), 2.0), budget=np.array([2]))
    slots = np.array([[4, 3]], dtype=np.int32)
    ids = np.array([[1, -1, 6, -1]])  # layer 0 misses expert 1, layer 1 misses expert 2 (key 6)
    lane = np.ones((1, 2, 5), dtype=np.int32)  # every layer: one candidate through the lane
    tally = {}
    jobs, _ = pool_admissions(h, ids, slots, 2, None, Victims("defer"), tally=tally, plan=PoolPlan(0.0, 0.0, lane))
    # layer 0's lane copy may not take slot 0 (layer 1 has not run): it takes slot 1 (its own layer's
    # resident); layer 1's candidate finds slot 0 safe now (its own expert, not selected): a lane copy too
    assert jobs.tolist() == [[0, 1, 1], [0, 6, 0]] and tally["lane"] == [True, True] and tally["at"] == [0, 1]
    # a margin of 1.5: a miss worth 2 no longer beats a victim worth 1 by it (declined), unless the
    # lane's credit of 1 brings it under (lane copies owe margin - credit)
    tally = {}
    jobs, _ = pool_admissions(h, ids, slots, 2, None, Victims("defer"), tally=tally, plan=PoolPlan(1.5, 0.0, None))
    assert jobs.size == 0 and tally["declined"] == 2
    jobs, _ = pool_admissions(h, ids, slots, 2, None, Victims("defer"), plan=PoolPlan(1.5, 1.0, lane))
    assert jobs.tolist() == [[0, 1, 1], [0, 6, 0]]


def test_without_planner_nor_timing_the_replay_is_the_pooled_models():
    ids = synthetic_routing(80, 4, 16, 2, seed=5)
    trace = RouteTrace.from_routing(ids, 16, expert_bytes=[10 ** 6] * 4)
    policy = lambda: HeatSumAdmission((8, 64), (1.0, 2.0), credit=2.0)  # noqa: E731
    plain = pooled_replay(trace, policy(), 4, inserts=None, rule=Victims("defer"))
    timed = timed_pooled_replay(trace, policy(), 4, RATES, publication="all", planner=False)
    assert {k: timed.totals[k] for k in ("hits", "misses", "uploads")} == \
        {k: plain.totals[k] for k in ("hits", "misses", "uploads")}
    # on a link this slow the copies are late, and fewer hit
    late = {}
    slow = timed_pooled_replay(trace, policy(), 4, RATES, publication="boundary", planner=False, tally=late)
    assert late["late"] > 0 and slow.hit_rate < plain.hit_rate
    assert sum(timed.work.passes.values()) == 4 * timed.decode_steps  # every real layer of every decode graph


def test_the_control_a_pool_per_layer_is_the_shipped_zero_configuration():
    """Every layer its own pool, heat at INSERTS 2 with the planner, every copy at the next boundary:
    the planner's rule here (margin, lane credit, busy) is the engine's own (native/engine_core.c)."""
    ids = synthetic_routing(120, 4, 16, 2, seed=7)
    trace = RouteTrace.from_routing(ids, 16, expert_bytes=[10 ** 6] * 4)
    rates = Rates(host_gbps=1.0, link_gbps=2.0, dram_gbps=3.0, device_gbps=100.0, ids_trip_us=20, join_us=5)
    shipped = zero_configuration(trace, 4, rates)
    assert shipped.totals["lane_misses"] > 0 and shipped.totals["declined"] > 0  # the lane and the margin both act
    control = timed_pooled_replay(trace, make_policy("heat"), 4, rates, publication="all", inserts=2, per_layer=True)
    assert {k: control.totals[k] for k in ("hits", "misses", "uploads")} == \
        {k: shipped.totals[k] for k in ("hits", "misses", "uploads")}
    hw = Hardware("test", "test", rates, "none")
    assert control.modelled_ms(hw) == pytest.approx(shipped.modelled_ms(hw), rel=1e-4)
