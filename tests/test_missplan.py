"""The miss planner (moecache.core.missplan): each miss where it costs least, uploads only when
they pay; on a hand-made handover, then through the engine in the one replay driver."""

import numpy as np
import pytest

from moecache.core.admission import Handover
from moecache.core.engine import CacheEngine
from moecache.core.missplan import MissPlanner, Rates
from moecache.core.policies import make_policy
from moecache.core.traces import RouteTrace, synthetic_routing
from moecache.offline.cost import Hardware
from moecache.offline.replay import PER_LAYER, simulate

MB = 10 ** 6
SLOW = Rates(host_gbps=50, link_gbps=1, dram_gbps=60, device_gbps=1000, ids_trip_us=10, join_us=5)
FAST = Rates(host_gbps=50, link_gbps=1000, dram_gbps=1000, device_gbps=1000, ids_trip_us=10, join_us=5)


def test_the_payback_is_the_miss_rate_over_the_upload_rate():
    # misses at min(50 + 1, 60) = 51 GB/s, an upload at 1: 51 later uses to pay back its link time
    assert SLOW.payback_uses == pytest.approx(51)
    assert FAST.payback_uses == pytest.approx(1.0)  # host memory bounds both: min(1050, 1000) / 1000
    r = Rates(host_gbps=50, link_gbps=25, dram_gbps=60, device_gbps=1000, ids_trip_us=0, join_us=0)
    assert r.payback_uses == pytest.approx(60 / 25)


def test_the_lane_takes_the_misses_that_shorten_the_layer():
    # 3 misses of 1 MB: the CPU alone 0.06 ms; one through a 25 GB/s lane: max(0.04, 0.04)
    r = Rates(host_gbps=50, link_gbps=25, dram_gbps=1000, device_gbps=1000, ids_trip_us=10, join_us=5)
    assert r.lane_split(MB, 0, hits=0, cpu_fixed=0, movable=3) == 1
    assert SLOW.lane_split(MB, 0, hits=0, cpu_fixed=0, movable=3) == 0
    assert FAST.lane_split(MB, 0, hits=0, cpu_fixed=0, movable=3) == 3
    # 2 misses: 0.04 ms on the CPU, or max(0.02, 0.04) with one copied: a tie, the fewer copies
    assert r.lane_split(MB, 0, hits=0, cpu_fixed=0, movable=2) == 0
    # with 4 more on their way (the CPU's): both copied, max(0.08, 0.08) against 0.1 or 0.12
    assert r.lane_split(MB, 0, hits=0, cpu_fixed=4, movable=2) == 2


def handover(worth):
    """One layer of 8 experts, slots 0 and 1 holding experts 5 and 6 (evictable, worth 1 and
    2), two slot writes allowed."""
    w = np.full((1, 8), 0.0)
    for e, value in worth.items():
        w[0, e] = value
    return Handover(victims=np.array([[0, 1]], dtype=np.int32), victim_worth=np.array([[1.0, 2.0]]),
                    worth=w, budget=np.array([2]))


SLOTS = np.array([[5, 6]], dtype=np.int32)
# the graph selects 0 and 1 (misses) and 5 (a hit: its slot is read, so not a victim)
IDS, HITS = np.array([[0, 1, 5]]), np.array([[False, False, True]])


def plan(rates, worth):
    return MissPlanner(rates, [MB]).plan(handover(worth), IDS, HITS, SLOTS, use_worth=1.0)


def test_a_slow_link_sends_misses_to_the_cpu_and_makes_no_upload_that_does_not_pay():
    p = plan(SLOW, {0: 10.0, 1: 3.0})
    assert p.lane.tolist() == [0] and len(p.jobs) == 0  # 10 - 51 uses does not beat the victim's 2


def test_an_upload_that_pays_takes_the_victim():
    p = plan(SLOW, {0: 3.0, 1: 100.0})
    assert p.lane.tolist() == [0] and p.lane_kept.tolist() == [0]
    assert p.jobs.tolist() == [[0, 1, 1]]  # expert 1 into slot 1 (expert 6); slot 0 is read


def test_a_fast_link_sends_misses_through_the_lane_kept_when_they_beat_the_victim():
    p = plan(FAST, {0: 3.0, 1: 100.0})
    assert p.lane.tolist() == [2] and p.lane_kept.tolist() == [1]
    assert p.jobs.tolist() == [[0, 1, 1]]  # the most valuable first; expert 0 used a scratch slot
    p = plan(FAST, {0: 1.5, 1: 0.5})       # neither beats the victim (2): both copies scratch
    assert p.lane.tolist() == [2] and len(p.jobs) == 0


def routing_trace():
    ids = synthetic_routing(64, 4, 32, 4, seed=3)
    return RouteTrace.from_routing(ids, 32, expert_bytes=[3 * MB] * 4)


def test_through_the_replay_the_link_decides_where_misses_go():
    trace = routing_trace()
    runs = {name: simulate(trace, PER_LAYER, "heat", 8, admission="eager", prefill="off", miss_plan=rates)
            for name, rates in (("slow", SLOW), ("fast", FAST))}
    plain = simulate(trace, PER_LAYER, "heat", 8, admission="eager", prefill="off")
    assert runs["slow"].totals["lane_misses"] == 0 < runs["fast"].totals["lane_misses"]
    assert runs["fast"].totals["lane_misses"] <= runs["fast"].totals["misses"]
    # a slow link: only the uploads that pay 51 uses, far fewer than eager heat's
    assert runs["slow"].totals["uploads"] < plain.totals["uploads"] / 2
    assert "lane_misses" not in plain.totals
    # the plan's lane is the timeline's: the fast link's token is shorter than the CPU's
    fast = Hardware("fast", "", FAST, "")
    assert runs["fast"].modelled_ms(fast) < plain.modelled_ms(fast)


def test_the_planner_needs_eager_admission_and_a_policy_that_counts_uses():
    planner = MissPlanner(SLOW, [MB])
    with pytest.raises(ValueError, match="eager admission"):
        CacheEngine(1, 8, 2, make_policy("heat"), miss_planner=planner)
    with pytest.raises(ValueError, match="counts uses"):
        CacheEngine(1, 8, 2, make_policy("lru"), admission="eager", miss_planner=planner)


def test_without_the_lane_the_plan_is_the_eager_rule_on_the_shaped_handover():
    """Live today: the planner acts only through the worths it hands libllama, whose own rule
    (admissions, mc_admit) then makes exactly the plan's paying uploads."""
    from moecache.core.admission import admissions, build_handover

    rng = np.random.default_rng(7)
    L, E, K, n = 3, 16, 4, 6
    admitted = 0
    for _ in range(300):
        slot_expert = np.array([np.where(rng.random(K) < 0.2, -1, rng.choice(E, K, replace=False))
                                for _ in range(L)], dtype=np.int32)
        evictable = (slot_expert >= 0) & (rng.random((L, K)) < 0.8)
        priority = rng.integers(0, 6, (L, K)).astype(np.float64)  # ties happen
        worth = rng.integers(0, 9, (L, E)).astype(np.float64)
        h = build_handover(slot_expert < 0, evictable, priority, worth, rng.integers(1, 4))
        ids = np.where(rng.random((L, n)) < 0.1, -1, rng.integers(0, E, (L, n)))
        hits = np.array([[e in row for e in line] for row, line in zip(slot_expert, ids)]) & (ids >= 0)
        planner = MissPlanner(SLOW if rng.random() < 0.5 else FAST, [MB] * L, lane=False)
        use_worth = float(rng.choice([0.5, 1.0, 2.0]))
        p = planner.plan(h, ids, hits, slot_expert, use_worth)
        assert p.lane.tolist() == [0] * L and p.lane_kept.tolist() == [0] * L
        shaped = admissions(planner.shaped(h, use_worth), ids, slot_expert)
        assert np.array_equal(p.jobs, shaped), (p.jobs.tolist(), shaped.tolist())
        admitted += len(shaped)
    assert admitted > 50  # the rule admitted something, not only refused


def test_the_replay_runs_the_planner_as_live_today_beside_the_modelled_lane():
    trace = routing_trace()
    live = simulate(trace, PER_LAYER, "heat", 8, admission="eager", prefill="off", miss_plan=SLOW, lane=False)
    lane = simulate(trace, PER_LAYER, "heat", 8, admission="eager", prefill="off", miss_plan=SLOW)
    plain = simulate(trace, PER_LAYER, "heat", 8, admission="eager", prefill="off")
    assert "lane_misses" not in live.totals and live.totals["declined"] > 0
    assert "declined" not in lane.totals
    # a slow link: the lane takes nothing, so both plans are the payback rule alone
    assert lane.totals["lane_misses"] == 0
    assert (live.totals["hits"], live.totals["uploads"]) == (lane.totals["hits"], lane.totals["uploads"])
    assert live.totals["uploads"] < plain.totals["uploads"]
    # a fast link: the lane takes misses the live planner leaves to the CPU, in less modelled time
    fast_live = simulate(trace, PER_LAYER, "heat", 8, admission="eager", prefill="off", miss_plan=FAST, lane=False)
    fast_lane = simulate(trace, PER_LAYER, "heat", 8, admission="eager", prefill="off", miss_plan=FAST)
    hardware = Hardware("fast", "", FAST, "")
    assert fast_lane.totals["lane_misses"] > 0
    assert fast_lane.modelled_ms(hardware) < fast_live.modelled_ms(hardware)
