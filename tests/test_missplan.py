"""The miss planner (moecache.core.missplan): each miss where it costs least, uploads only when
they pay; on a hand-made handover, then through the engine in the one replay driver."""

from dataclasses import replace

import numpy as np
import pytest

from moecache.core.admission import Handover, admissions, admissions_with_lane, build_handover
from moecache.core.engine import CacheEngine
from moecache.core.missplan import BUSY_POWER, OUR_LAYOUT, MissPlanner, Rates
from moecache.core.policies import make_policy
from moecache.formats.traces import RouteTrace, synthetic_routing
from moecache.core.hardware import Hardware
from moecache.offline.replay import PerLayerReplay, simulate

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


def test_the_lane_table_is_the_split_of_each_count_of_candidates_the_others_hits():
    r = Rates(host_gbps=50, link_gbps=25, dram_gbps=1000, device_gbps=1000, ids_trip_us=10, join_us=5)
    planner = MissPlanner(r, [MB, MB, 2 * MB], [0, 0, 0], n_used=4)
    table = planner.lane_table(6, 4)
    assert table.shape == (3, 7) and table.dtype == np.int32
    for layer, size in enumerate((MB, MB, 2 * MB)):
        assert table[layer].tolist() == [r.lane_split(size, 0, hits=max(4 - m, 0), cpu_fixed=0, movable=m)
                                          for m in range(7)]
    assert table[0, 3] == 1 and table[0, 0] == 0  # 3 misses and a hit: one through the lane
    assert planner.lane_table(6, 4) is table      # computed once
    assert not table.flags.writeable


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
IDS = np.array([[0, 1, 5]])


def planned(rates, worth, lane=True):
    """The planner's handover and the slot writes the graph makes under it."""
    planner = MissPlanner(rates, [MB], n_used=3, lane=lane)
    margin, lowered = planner.terms(1.0, busy=1.0)
    h = handover(worth)
    h = replace(h, victim_worth=h.victim_worth - lowered, lane=planner.lane_table(8, 3) if lane else None,
                margin=margin)
    return h, admissions_with_lane(h, IDS, SLOTS)


def test_the_planner_hands_over_the_policys_worths_with_its_lane_table_and_margin():
    h, _ = planned(SLOW, {0: 10.0, 1: 3.0})
    assert h.margin == pytest.approx(51) and h.lane.shape == (1, 9) and not h.lane.any()
    for lane in (True, False):  # an engine's handover: the policy's worths, the planner's table and margin
        planner = MissPlanner(FAST, [MB, MB], n_used=2, lane=lane)
        engine = CacheEngine(2, 8, 4, make_policy("heat"), admission="eager", miss_planner=planner)
        engine.step(None)
        h = engine.handover
        plain = CacheEngine(2, 8, 4, make_policy("heat"), admission="eager")
        plain.step(None)
        assert np.array_equal(h.worth, plain.handover.worth) and plain.handover.margin == 0
        assert h.lane is (planner.lane_table(8, 2) if lane else None)
        margin = planner.margin(engine.policy.use_worth(1), busy=1.0)
        assert margin > 0
        if lane:  # the lane's credit: the margin, and the victims' worths lowered by credit - margin
            credit = planner.lane_credit * engine.policy.use_worth(1)
            assert h.margin == pytest.approx(credit) and credit > margin
            assert np.array_equal(h.victim_worth, plain.handover.victim_worth - (credit - margin))
        else:
            assert h.margin == pytest.approx(margin)
            assert np.array_equal(h.victim_worth, plain.handover.victim_worth)


def planned_core(planner, n_expert=8):
    """The C side of an engine running this planner: its observations model the graphs."""
    return CacheEngine(len(planner.expert_bytes), n_expert, 4, make_policy("heat"), admission="eager",
                       miss_planner=planner).bookkeeping


def copies(n, layer=0):
    """n copies in one layer, as a job table."""
    return np.tile(np.array([[layer, 7, 0]], dtype=np.int32), (n, 1))


def test_a_lane_copy_is_credited_the_most_it_shortens_a_layer_in_misses():
    # one copy of 3 misses of 1 MB through a 25 GB/s lane: the layer from 0.06 ms (the CPU's three
    # reads) to max(0.04, 0.04), 0.02 ms, one CPU read; misses at min(50 + 25, 1000) GB/s: 1.5 uses
    r = Rates(host_gbps=50, link_gbps=25, dram_gbps=1000, device_gbps=1000, ids_trip_us=10, join_us=5)
    assert MissPlanner(r, [MB], n_used=3).lane_credit == pytest.approx(75 / 50)
    # no copy at any count of misses (or no lane): no credit, the handover's margin as it was
    assert MissPlanner(SLOW, [MB], n_used=3).lane_credit == 0
    assert MissPlanner(FAST, [MB], n_used=3, lane=False).lane_credit == 0
    assert MissPlanner(SLOW, [MB], n_used=3).terms(2.0, busy=1.0) == (2 * 51, 0.0)
    # with the credit: an upload still owes the margin, a lane copy the margin less the credit
    planner = MissPlanner(r, [MB], n_used=3)
    margin, lowered = planner.terms(2.0, busy=1.0)
    assert margin == pytest.approx(2 * 1.5) and lowered == pytest.approx(2 * 1.5 - 2 * 75 / 25)
    assert margin - lowered == pytest.approx(planner.margin(2.0, busy=1.0))


def test_the_margin_is_paid_as_far_as_the_link_is_busy():
    planner = MissPlanner(SLOW, [MB], n_used=3)
    assert planner.margin(1.0, busy=1.0) == pytest.approx(51) and planner.margin(1.0, busy=0.0) == 0
    assert planner.margin(2.0, busy=0.5) == pytest.approx(2 * 51 * 0.5 ** BUSY_POWER)
    core = planned_core(planner)
    assert core.busy == 1.0  # before any graph: all of it
    token = IDS  # one token: 0 hits, 3 misses on an empty cache
    graph_ms = planner.graph_ms([0], [0], [3])
    for _ in range(300):  # graphs that copy nothing: an idle link, an upload costs nothing
        seen = core.observe(token, True)
        assert seen.graph_ms == pytest.approx(graph_ms) and seen.link_ms == 0
    assert core.busy < 1e-9
    for _ in range(300):  # uploads that hold the link longer than the graph runs: all of it again
        core.observe(token, True, uploads=copies(50))
    assert core.busy == 1.0
    assert core.observe(token, False, uploads=copies(50)).graph_ms == -1  # a prompt: not a decode graph
    assert core.busy == 1.0
    for _ in range(300):  # several tokens' counts: outside the table (-1); the caller gives the formula's time
        seen = core.observe(np.array([[0, 1, 2, 3, 4, 5]]), True, copies(1), 1)
        assert seen.graph_ms == -1 and seen.lane.tolist() == [1]
        core.link_update(planner.graph_ms(seen.hits, seen.lane, seen.misses), seen.link_ms)
    busy = MB / (SLOW.link_gbps * 1e6) / planner.graph_ms([0], [1], [6])
    assert 0.5 < busy < 1 and core.busy == pytest.approx(busy)


def test_an_engine_takes_several_tokens_graphs_by_the_formula():
    planner = MissPlanner(FAST, [MB, MB], n_used=2)
    engine = CacheEngine(2, 8, 4, make_policy("heat"), admission="eager", miss_planner=planner)
    engine.step(None)
    rng = np.random.default_rng(3)
    for _ in range(20):  # graphs of three tokens: the table holds one token's counts
        engine.step(rng.integers(0, 8, (2, 6)))
    assert 0 < engine.bookkeeping.busy < 1


def test_the_link_carries_each_copys_layer_bytes_and_the_counters_the_planners():
    writes = np.array([[0, 1, 2], [1, 3, 0], [1, 4, 1]], dtype=np.int32)  # the first a lane copy
    ids = np.array([[1, 5], [3, 4]])
    for layer_bytes, copied in (([MB, 2 * MB], 6 * MB), ([MB, MB], 4 * MB)):
        planner = MissPlanner(SLOW, layer_bytes, n_used=2)
        core = planned_core(planner)
        seen = core.observe(ids, True, writes, 1, writes[:1], np.array([2, 0], dtype=np.int32))
        assert seen.link_ms == pytest.approx(copied / (SLOW.link_gbps * 1e6))
        assert seen.lane.tolist() == [1, 0]
        assert seen.graph_ms == pytest.approx(planner.graph_ms(seen.hits, seen.lane, seen.misses))
        assert core.busy == pytest.approx(min(1.0, seen.link_ms / seen.graph_ms))
    engine = CacheEngine(2, 8, 4, make_policy("heat"), admission="eager", miss_planner=planner)
    core = engine.bookkeeping
    core.observe(ids, True, writes, 1, declined=np.array([2, 0], dtype=np.int32))
    core.observe(ids, False, writes, 1, declined=np.array([2, 0], dtype=np.int32))  # a prompt: not counted
    assert engine.counters["lane_misses"].tolist() == [1, 0] and engine.counters["declined"].tolist() == [2, 0]
    with pytest.raises(ValueError, match="a copy of layer 2"):
        core.observe(ids, True, np.array([[2, 1, 0]], dtype=np.int32))
    # without a lane no lane counter, without a planner neither
    assert "lane_misses" not in CacheEngine(2, 8, 4, make_policy("heat"), admission="eager",
                                            miss_planner=MissPlanner(SLOW, [MB, MB], lane=False)).counters
    assert not {"lane_misses", "declined"} & CacheEngine(2, 8, 4, make_policy("heat"), admission="eager").counters.keys()


def test_a_graphs_time_is_the_formulas_and_the_observation_sums_it_for_one_token():
    expert_bytes, dense_bytes = (MB, 2 * MB, MB), (0.0, MB, 0.0)
    planner = MissPlanner(SLOW, expert_bytes, dense_bytes, n_used=2)
    rng = np.random.default_rng(5)
    for n_max in (2, 9):
        hits, lane, cpu = rng.integers(0, n_max + 1, (3, 3))
        expected = sum(float(SLOW.layer_ms(OUR_LAYOUT, eb, db, h, n, c))
                       for eb, db, h, n, c in zip(expert_bytes, dense_bytes, hits, lane, cpu))
        assert planner.graph_ms(hits, lane, lane + cpu) == pytest.approx(expected)
    # the engine's C observation: the table for one token's counts, -1 beyond it
    core = planned_core(planner)
    summed = 0
    for n in (2, 2, 2, 2, 6, 6):
        ids = rng.integers(-1, 8, (3, n))
        misses = core.observe(ids, True).misses
        lane = np.minimum(rng.integers(0, 3, 3), misses)
        writes = np.concatenate([copies(k, layer) for layer, k in enumerate(lane)])
        seen = core.observe(ids, True, writes, len(writes))
        assert seen.lane.tolist() == lane.tolist()
        if max(seen.hits.max(), seen.misses.max()) <= 2:
            assert seen.graph_ms == pytest.approx(planner.graph_ms(seen.hits, lane, seen.misses))
            summed += 1
        else:
            assert seen.graph_ms == -1
    assert summed >= 4
    plain = CacheEngine(3, 8, 4, make_policy("heat"), admission="eager").bookkeeping
    seen = plain.observe(rng.integers(-1, 8, (3, 2)), True)
    assert seen.graph_ms == -1 and seen.lane is None  # no planner, no table


def test_a_slow_link_sends_misses_to_the_cpu_and_makes_no_upload_that_does_not_pay():
    _, a = planned(SLOW, {0: 10.0, 1: 3.0})
    assert a.lane.tolist() == [0] and len(a.jobs) == 0  # 10 - 51 uses does not beat the victim's 2


def test_an_upload_that_pays_takes_the_victim():
    _, a = planned(SLOW, {0: 3.0, 1: 100.0})
    assert a.lane.tolist() == [0]
    assert a.jobs.tolist() == [[0, 1, 1]]  # expert 1 into slot 1 (expert 6); slot 0 is read


def test_a_fast_link_sends_misses_through_the_lane_when_they_beat_the_victim_and_no_scratch_slot():
    _, a = planned(FAST, {0: 3.0, 1: 100.0})
    assert a.lane.tolist() == [1]           # lane[0, 2] = 2, the most valuable first
    assert a.jobs.tolist() == [[0, 1, 1]]   # expert 0: no victim left, computed on the CPU
    # both colder than the victim (2), by less than a lane copy's credit less the margin (1 use): the
    # hotter one through the lane; as uploads they would owe the margin, and none pays
    assert MissPlanner(FAST, [MB], n_used=3).lane_credit > 1.0 + 2 - 0.5
    h, a = planned(FAST, {0: 1.5, 1: 0.5})
    assert a.lane.tolist() == [1] and a.jobs.tolist() == [[0, 0, 1]]
    assert len(admissions(replace(h, lane=None), IDS, SLOTS)) == 0


def plain_rule(h, ids, slot_expert):
    """The handover's rule as moecache.core.admission writes it, one layer and one id at a time:
    (job rows, lane rows per layer, uploads the margin declined per layer)."""
    jobs, lanes, declined = [], [], []
    for layer, row in enumerate(ids.tolist()):
        held = [e for e in slot_expert[layer].tolist() if e >= 0]
        worth = h.worth[layer]
        cand = [e for e in dict.fromkeys(row) if e >= 0 and e not in held and worth[e] > -np.inf]
        n = 0 if h.lane is None else min(int(h.lane[layer, len(cand)]), len(cand))
        lset = sorted(cand, key=lambda e: -worth[e])[:n]  # stable: rank breaks ties
        order = lset + [e for e in cand if e not in lset]
        victims = [(v, w) for v, w in zip(h.victims[layer].tolist(), h.victim_worth[layer].tolist())
                   if v >= 0 and not (slot_expert[layer, v] >= 0 and slot_expert[layer, v] in row)]
        nxt = started = lane = margin_declined = 0
        for e in order:
            if started == h.budget[layer] or nxt == len(victims):
                break
            if worth[e] - (0.0 if e in lset else h.margin) > victims[nxt][1]:
                jobs.append([layer, e, victims[nxt][0]])
                nxt += 1
                started += 1
                lane += e in lset
            elif e not in lset and worth[e] > victims[nxt][1]:
                margin_declined += 1
        lanes.append(lane)
        declined.append(margin_declined)
    return jobs, lanes, declined


def random_handover(rng, L, E, K):
    slot_expert = np.stack([rng.choice(np.arange(-1, E), K, replace=False) for _ in range(L)]).astype(np.int32)
    free = slot_expert < 0
    evictable = ~free & (rng.random((L, K)) < 0.8)
    worth = rng.choice([-np.inf, 0.0, 1.0, 2.0, 3.0, np.inf], (L, E))  # ties happen
    priority = rng.choice([-np.inf, 0.5, 1.0, 1.5, np.inf], (L, K))
    h = build_handover(free, evictable, priority, worth, rng.integers(0, 5, L))
    return h, slot_expert


def test_the_native_rule_with_a_lane_and_a_margin_is_the_rule_written_out_plainly():
    rng = np.random.default_rng(5)
    lane_rows = admitted = declined_uploads = 0
    for _ in range(600):
        L, E, K = 3, 12, int(rng.integers(1, 7))
        h, slot_expert = random_handover(rng, L, E, K)
        h = replace(h, lane=None if rng.random() < 0.2 else rng.integers(0, E + 1, (L, E + 1)).astype(np.int32),
                    margin=float(rng.choice([0.0, 0.5, 1.0, 2.5])))
        ids = rng.integers(-1, E, (L, int(rng.integers(1, 4)) * int(rng.integers(1, 5))))  # tokens x n_used
        got = admissions_with_lane(h, ids.astype(rng.choice([np.int32, np.int64])), slot_expert)
        assert np.array_equal(admissions(h, ids, slot_expert), got.jobs)
        jobs, lanes, declined = plain_rule(h, ids, slot_expert)
        assert got.jobs.tolist() == jobs and got.lane.tolist() == lanes and got.declined.tolist() == declined
        ordered, n_lane = got.lane_first()
        first = [row for layer in range(L) for row in [r for r in jobs if r[0] == layer][:lanes[layer]]]
        assert n_lane == sum(lanes) and ordered[:n_lane].tolist() == first
        assert sorted(ordered.tolist()) == sorted(jobs)
        lane_rows += n_lane
        admitted += len(jobs) - n_lane
        declined_uploads += sum(declined)
    assert lane_rows > 100 and admitted > 100 and declined_uploads > 20  # each happened


def test_a_margin_acts_as_worths_lowered_by_it_without_a_lane():
    rng = np.random.default_rng(7)
    for _ in range(200):
        h, slot_expert = random_handover(rng, 3, 16, 4)
        margin = float(rng.choice([0.5, 1.0, 2.0]))
        ids = rng.integers(-1, 16, (3, 6))
        shaped = replace(h, worth=h.worth - margin)
        assert np.array_equal(admissions(replace(h, margin=margin), ids, slot_expert),
                              admissions(shaped, ids, slot_expert))


def lane_engine():
    """heat, 1 layer of 8 experts, 4 slots, the fast link's planner (every candidate may take
    the lane), experts 0 and 1 preloaded: due at the second boundary."""
    engine = CacheEngine(1, 8, 4, make_policy("heat"), inserts=4, admission="eager",
                         miss_planner=MissPlanner(FAST, [MB], n_used=2))
    engine.preload([[0, 1]])
    engine.step(None)
    return engine


def test_lane_copies_libllama_reports_are_due_first_complete_with_their_graph():
    engine = lane_engine()
    assert engine.handover.lane is not None and engine.uploads_due == 2
    # the graph copied expert 2 through the lane into slot 2 and started an upload of 3 into slot 3
    plan = engine.step(np.array([[2, 3]]), ready=1, admitted=np.array([[0, 2, 2], [0, 3, 3]]), lane_rows=1,
                       declined=np.array([1]))
    assert plan.publish.tolist() == [[0, 2, 2]]  # the lane copy, ahead of the preloads issued before it
    assert engine.expert_slot[0, 2] == 2 and engine.expert_slot[0, 0] == -1
    assert plan.lane.tolist() == [1] and engine.counters["lane_misses"].tolist() == [1]
    assert plan.misses.tolist() == [2]  # a lane miss is a miss
    assert engine.counters["declined"].tolist() == [1]  # as libllama reported it
    with pytest.raises(ValueError, match="the uploads its margin declined per layer"):
        engine.step(np.array([[2, 0]]), admitted=np.empty((0, 3)))
    plan = engine.step(np.array([[2, 0]]), ready=None)
    assert plan.publish.tolist() == [[0, 0, 0], [0, 1, 1], [0, 3, 3]]  # the late ones, in issue order
    with pytest.raises(ValueError, match="lane_rows must be in"):
        engine.step(np.array([[4, 5]]), admitted=np.array([[0, 4, 2]]), lane_rows=2, declined=np.array([0]))


def test_modelled_lane_copies_come_from_the_rule_and_are_due_first():
    engine = lane_engine()
    h, slots = engine.handover, engine.slot_expert.copy()
    ids = np.array([[2, 3]])
    expected, n_lane = admissions_with_lane(h, ids, slots).lane_first()
    assert n_lane >= 1
    plan = engine.step(ids, ready=n_lane)
    assert plan.admitted.tolist() == expected.tolist()
    assert plan.publish.tolist() == expected[:n_lane].tolist() and plan.lane.tolist() == [n_lane]
    assert engine.counters["lane_misses"].tolist() == [n_lane] and "lane_uploads" not in engine.counters


def test_without_a_lane_libllama_reports_no_lane_copies():
    engine = CacheEngine(1, 8, 4, make_policy("heat"), inserts=4, admission="eager",
                         miss_planner=MissPlanner(FAST, [MB], lane=False))
    engine.step(None)
    assert engine.handover.lane is None and engine.handover.margin > 0
    with pytest.raises(ValueError, match="lane_rows must be in"):
        engine.step(np.array([[2, 3]]), admitted=np.array([[0, 2, 0]]), lane_rows=1, declined=np.array([0]))


def routing_trace():
    ids = synthetic_routing(64, 4, 32, 4, seed=3)
    return RouteTrace.from_routing(ids, 32, expert_bytes=[3 * MB] * 4)


def test_through_the_replay_the_link_decides_where_misses_go():
    trace = routing_trace()
    runs = {name: simulate(trace, PerLayerReplay("heat", 8, admission="eager", prefill="off", miss_plan=rates))
            for name, rates in (("slow", SLOW), ("fast", FAST))}
    plain = simulate(trace, PerLayerReplay("heat", 8, admission="eager", prefill="off"))
    assert runs["slow"].totals["lane_misses"] == 0 < runs["fast"].totals["lane_misses"]
    assert runs["fast"].totals["lane_misses"] <= min(runs["fast"].totals["misses"], runs["fast"].totals["uploads"])
    # a slow link: only the uploads that pay 51 uses, far fewer than eager heat's
    assert runs["slow"].totals["uploads"] < plain.totals["uploads"] / 2
    assert runs["slow"].totals["declined"] > 0
    assert "lane_misses" not in plain.totals and "declined" not in plain.totals
    # the lane's misses are the timeline's: the fast link's token is shorter than the CPU's
    fast = Hardware("fast", "", FAST, "")
    assert runs["fast"].modelled_ms(fast) < plain.modelled_ms(fast)


def test_the_planner_needs_eager_admission_a_policy_that_counts_uses_and_n_used_for_its_lane():
    planner = MissPlanner(SLOW, [MB], n_used=2)
    with pytest.raises(ValueError, match="eager admission"):
        CacheEngine(1, 8, 2, make_policy("heat"), miss_planner=planner)
    with pytest.raises(ValueError, match="counts uses"):
        CacheEngine(1, 8, 2, make_policy("lru"), admission="eager", miss_planner=planner)
    with pytest.raises(ValueError, match="needs n_used"):
        MissPlanner(SLOW, [MB])


def test_the_replay_runs_the_planner_without_its_lane_beside_it():
    trace = routing_trace()
    kw = dict(admission="eager", prefill="off")
    no_lane = simulate(trace, PerLayerReplay("heat", 8, miss_plan=SLOW, lane=False, **kw))
    lane = simulate(trace, PerLayerReplay("heat", 8, miss_plan=SLOW, **kw))
    plain = simulate(trace, PerLayerReplay("heat", 8, **kw))
    assert "lane_misses" not in no_lane.totals and no_lane.totals["declined"] > 0
    # a slow link: the lane takes nothing, so both are the payback rule alone
    assert lane.totals["lane_misses"] == 0
    assert {k: no_lane.totals[k] for k in ("hits", "uploads", "declined")} == \
        {k: lane.totals[k] for k in ("hits", "uploads", "declined")}
    assert no_lane.totals["uploads"] < plain.totals["uploads"]
    # a fast link: the lane takes misses the lane-less planner leaves to the CPU, in less modelled time
    fast_no_lane = simulate(trace, PerLayerReplay("heat", 8, miss_plan=FAST, lane=False, **kw))
    fast_lane = simulate(trace, PerLayerReplay("heat", 8, miss_plan=FAST, **kw))
    hardware = Hardware("fast", "", FAST, "")
    assert fast_lane.totals["lane_misses"] > 0
    assert fast_lane.modelled_ms(hardware) < fast_no_lane.modelled_ms(hardware)


def test_the_planner_is_on_by_default_wherever_it_can_run():
    from moecache.core.missplan import planner_by_default
    from moecache.core.policies import POLICIES
    assert planner_by_default(POLICIES["heat"], "eager") and planner_by_default(make_policy("lfu"), "eager")
    assert not planner_by_default(POLICIES["heat"], "boundary")
    assert not any(planner_by_default(POLICIES[name], "eager") for name in ("lru", "gdsf", "random", "arc", "sieve"))


def test_zero_configuration_replays_the_default_with_the_planner_it_turns_on():
    from moecache.offline.replay import PerLayerReplay, zero_configuration
    trace = RouteTrace.from_routing(synthetic_routing(24, 4, 16, 2, seed=3), 16, expert_bytes=[4 * MB] * 4)
    ours = zero_configuration(trace, 4, SLOW)
    planned = simulate(trace, PerLayerReplay("heat", 4, admission="eager", prefill="warm", miss_plan=SLOW))
    assert ours.totals == planned.totals and ours.admission == "eager" and ours.totals["declined"] > 0
    assert ours.totals != simulate(trace, PerLayerReplay("heat", 4, admission="eager", prefill="warm")).totals
