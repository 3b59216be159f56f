"""The eager-admission rule libllama follows during a graph, modelled in moecache.core.admission."""

import numpy as np
import pytest

from moecache.core.admission import Handover, admissions, build_handover
from moecache.core.engine import CacheEngine
from moecache.core.policies import Lru, make_policy
from moecache.formats.traces import synthetic_routing

INF = np.inf


def handover(victims, victim_worth, worth, budget=2):
    victims = np.asarray(victims, dtype=np.int32)
    return Handover(victims, np.asarray(victim_worth, dtype=float), np.asarray(worth, dtype=float),
                    np.full(victims.shape[0], budget))


def test_victim_list_puts_free_slots_first_then_lowest_priority():
    free = np.array([[False, True, False, False, True]])
    evictable = np.array([[True, False, True, False, False]])  # slot 3: in flight or pinned
    priority = np.array([[5.0, 0.0, 2.0, 0.0, 0.0]])
    h = build_handover(free, evictable, priority, np.zeros((1, 8)), 2)
    assert h.victims.tolist() == [[1, 4, 2, 0, -1]]
    assert h.victim_worth[0, :4].tolist() == [-INF, -INF, 2.0, 5.0]
    assert h.budget.tolist() == [2]


def test_free_slots_come_first_even_against_minus_infinite_priorities():
    h = build_handover(np.array([[False, True]]), np.array([[True, False]]),
                       np.array([[-INF, 0.0]]), np.zeros((1, 4)), 1)
    assert h.victims.tolist() == [[1, 0]]


def test_misses_are_admitted_in_router_rank_order_within_the_budget():
    # 4 slots, slot 0 holds expert 9 (priority 1), slots 1-3 hold 10, 11, 12 (priorities 2-4)
    slot_expert = np.array([[9, 10, 11, 12]])
    worth = np.full((1, 16), 10.0)
    h = handover([[0, 1, 2, 3]], [[1, 2, 3, 4]], worth, budget=2)
    jobs = admissions(h, np.array([[5, 3, 7]]), slot_expert)
    assert jobs.tolist() == [[0, 5, 0], [0, 3, 1]]  # rank order; the third miss: budget spent


def test_a_miss_must_beat_the_next_victim_strictly_and_a_loser_keeps_the_victim():
    slot_expert = np.array([[9, 10]])
    worth = np.zeros((1, 16))
    worth[0, [5, 3, 7]] = [1.0, 0.5, 2.0]
    h = handover([[0, 1]], [[1.0, 3.0]], worth, budget=3)
    # 5 ties the victim (not admitted), 3 loses, 7 beats it and takes slot 0; none beats 3.0
    assert admissions(h, np.array([[5, 3, 7]]), slot_expert).tolist() == [[0, 7, 0]]


def test_minus_infinite_worth_is_never_uploaded_even_into_a_free_slot():
    worth = np.full((1, 16), -INF)
    worth[0, 4] = 0.0
    h = handover([[1, 0]], [[-INF, 1.0]], worth)
    assert admissions(h, np.array([[3, 4]]), np.array([[9, -1]])).tolist() == [[0, 4, 1]]


def test_victims_selected_by_the_running_graph_are_skipped():
    slot_expert = np.array([[9, 10, 11]])
    h = handover([[0, 1, 2]], [[1, 2, 3]], np.full((1, 16), INF), budget=3)
    # expert 9 (the first victim) is a hit in this graph: its slot is read, so 10's goes first
    jobs = admissions(h, np.array([[9, 4, 5]]), slot_expert)
    assert jobs.tolist() == [[0, 4, 1], [0, 5, 2]]


def test_repeated_ids_of_a_multi_token_step_are_admitted_once_and_layers_are_independent():
    slot_expert = np.array([[-1, -1], [7, 8]])
    worth = np.full((2, 16), INF)
    h = handover([[0, 1], [1, 0]], [[-INF, -INF], [1, 2]], worth, budget=2)
    ids = np.array([[3, 3, 4, -1], [8, 6, 8, 6]])  # two tokens per layer
    jobs = admissions(h, ids, slot_expert)
    # layer 1: 8 is selected, so only slot 0 (expert 7) is a victim; 6 takes it
    assert jobs.tolist() == [[0, 3, 0], [0, 4, 1], [1, 6, 0]]


def test_no_upload_ever_targets_a_slot_the_running_graph_reads():
    rng = np.random.default_rng(0)
    for _ in range(300):
        L, K, E = 3, int(rng.integers(1, 4)), 8
        n = int(rng.integers(1, 5))
        slot_expert = np.stack([rng.choice(np.arange(-1, E), K, replace=False) for _ in range(L)])
        slot_expert[(slot_expert == -1).cumsum(axis=1) > 1] = -1
        free = slot_expert < 0
        evictable = ~free & (rng.random((L, K)) < 0.8)
        worth = rng.choice([-INF, 0.0, 1.0, 2.0, INF], (L, E))
        h = build_handover(free, evictable, rng.random((L, K)) * 2, worth, int(rng.integers(1, 4)))
        ids = rng.integers(-1, E, (L, n))
        jobs = admissions(h, ids, slot_expert)
        for layer, expert, slot in jobs.tolist():
            assert slot_expert[layer, slot] < 0 or slot_expert[layer, slot] not in ids[layer]
            assert free[layer, slot] or evictable[layer, slot]          # never in flight/pinned
            assert expert in ids[layer] and worth[layer, expert] > -INF
        targets = [tuple(j) for j in jobs[:, [0, 2]].tolist()]
        assert len(targets) == len(set(targets))                         # one upload per slot
        assert (np.bincount(jobs[:, 0], minlength=L) <= h.budget).all()


def plain_admissions(h, ids, slot_expert, per_token=None):
    """admissions' rule as the module docstring writes it, one layer and one id at a time."""
    jobs = []
    for layer, row in enumerate(ids.tolist()):
        step = per_token or len(row)
        by_token = [row[t:t + step] for t in range(0, len(row), step)]
        victims = [v for v in h.victims[layer].tolist()
                   if v >= 0 and not (slot_expert[layer, v] >= 0 and slot_expert[layer, v] in row)]
        worths = [h.victim_worth[layer, at] for at, v in enumerate(h.victims[layer].tolist())
                  if v >= 0 and not (slot_expert[layer, v] >= 0 and slot_expert[layer, v] in row)]
        nxt = started = 0
        for e in dict.fromkeys(e for token in reversed(by_token) for e in token if e >= 0):
            if e in slot_expert[layer].tolist():
                continue
            if started == h.budget[layer] or nxt == len(victims):
                break
            if h.worth[layer, e] > worths[nxt]:
                jobs.append([layer, e, victims[nxt]])
                nxt += 1
                started += 1
    return jobs


def test_the_native_rule_is_the_rule_written_out_plainly():
    rng = np.random.default_rng(1)
    for _ in range(500):
        L, K, E, n = 3, int(rng.integers(1, 6)), 10, int(rng.integers(1, 9))
        slot_expert = np.stack([rng.choice(np.arange(-1, E), K, replace=False) for _ in range(L)])
        free = slot_expert < 0
        evictable = ~free & (rng.random((L, K)) < 0.8)
        worth = rng.choice([-INF, 0.0, 1.0, 2.0, INF], (L, E))
        priority = rng.choice([-INF, 0.5, 1.0, 1.5, INF], (L, K))
        h = build_handover(free, evictable, priority, worth, int(rng.integers(0, 5)))
        ids = rng.integers(-1, E, (L, n)).astype(rng.choice([np.int32, np.int64]))
        per_token = rng.choice([None, 1, 2, 3])
        assert admissions(h, ids, slot_expert, per_token).tolist() == plain_admissions(h, ids, slot_expert, per_token)


def test_a_step_of_several_tokens_admits_its_last_tokens_experts_first():
    # two tokens of two experts each, one free slot: the last token's first expert takes it
    h = handover([[0, -1]], [[-INF, -INF]], np.full((1, 8), INF), budget=1)
    ids = np.array([[1, 2, 5, 6]])
    assert admissions(h, ids, np.array([[-1, -1]]), per_token=2).tolist() == [[0, 5, 0]]
    assert admissions(h, ids, np.array([[-1, -1]])).tolist() == [[0, 1, 0]]  # one token: rank order


def test_an_id_out_of_range_is_refused_in_one_line():
    h = handover([[0, 1]], [[-INF, -INF]], np.full((1, 4), INF))
    with pytest.raises(ValueError, match=r"expert ids must be in \[-1, 4\), got 4"):
        admissions(h, np.array([[1, 4]]), np.array([[-1, -1]]))
    assert admissions(h, np.array([[1, 3]]), np.array([[-1, -1]])).tolist() == [[0, 1, 0], [0, 3, 1]]


# --- the engine's eager timing ------------------------------------------------------------

class ReferenceEagerLru:
    """Eager LRU written out plainly, one layer and one expert at a time: hits against what was
    published while the graph ran; during the graph each miss, in router-rank order, while
    the layer's budget lasts, takes a free slot (lowest first) or the least recently used
    resident (ties: lowest slot) that the graph did not select; published at the next
    boundary."""

    def __init__(self, n_layers, n_slots, inserts):
        self.inserts = inserts
        self.slots = [[None] * n_slots for _ in range(n_layers)]
        self.published = [set() for _ in range(n_layers)]
        self.last_use = [{} for _ in range(n_layers)]

    def step(self, t, ids):
        hits = []
        for layer, row in enumerate(ids):
            slots, published = self.slots[layer], self.published[layer]
            hits.append([e in published for e in row])
            started = 0
            for e in dict.fromkeys(row):
                if e in slots or (self.inserts is not None and started == self.inserts):
                    continue
                free = [s for s, old in enumerate(slots) if old is None]
                victims = sorted((self.last_use[layer].get(old, -1), s) for s, old in enumerate(slots)
                                 if old is not None and old not in row)
                if not free and not victims:
                    break
                slot = free[0] if free else victims[0][1]
                published.discard(slots[slot])
                slots[slot] = e
                started += 1
            for e in row:
                self.last_use[layer][e] = t
            published.update(e for e in slots if e is not None)  # the next boundary publishes
        return hits


@pytest.mark.parametrize("inserts", [1, 2, None])
@pytest.mark.parametrize("n_slots", [1, 3, 6])
def test_eager_lru_engine_equals_brute_force_reference(inserts, n_slots):
    L, E, k = 4, 24, 3
    routing = synthetic_routing(120, L, E, k, seed=n_slots, stickiness=1.0)
    engine = CacheEngine(L, E, n_slots, Lru(), inserts=inserts, admission="eager")
    reference = ReferenceEagerLru(L, n_slots, inserts)
    engine.step(None)
    for t, ids in enumerate(routing, start=1):
        plan = engine.step(ids)
        assert plan.hit_mask.tolist() == reference.step(t, ids.tolist()), f"step {t}"
        for layer in range(L):
            assert engine.slot_expert[layer].tolist() == [-1 if e is None else e
                                                           for e in reference.slots[layer]]


def test_a_miss_is_usable_from_the_next_graph():
    engine = CacheEngine(1, 8, 4, Lru(), inserts=2, admission="eager")
    engine.step(None)
    assert engine.handover.victims.tolist() == [[0, 1, 2, 3]]
    plan = engine.step(np.array([[5, 6]]))          # graph 0 missed both and uploaded them
    assert plan.hit_mask.tolist() == [[False, False]]
    assert plan.admitted.tolist() == [[0, 5, 0], [0, 6, 1]]
    assert plan.publish.tolist() == [[0, 5, 0], [0, 6, 1]] and plan.upload.size == 0
    assert engine.handover.worth[0, [5, 6]].tolist() == [-np.inf, -np.inf]  # resident now
    plan = engine.step(np.array([[5, 7]]))          # graph 1 hits 5
    assert plan.hit_mask.tolist() == [[True, False]]


def test_victims_are_unpublished_and_reported_to_the_policy():
    class Recording(Lru):
        def bind(self, *shape):
            super().bind(*shape)
            self.events = []

        def inserted(self, step, layers, experts, prefetch):
            self.events.append(("inserted", experts.tolist()))

        def evicted(self, step, layers, experts):
            self.events.append(("evicted", experts.tolist()))

    policy = Recording()
    engine = CacheEngine(1, 8, 2, policy, inserts=2, admission="eager")
    engine.step(None)
    engine.step(np.array([[1, 2]]))
    plan = engine.step(np.array([[2, 3]]))          # 3 replaces 1, the only one not selected
    assert plan.admitted.tolist() == [[0, 3, 0]]
    assert plan.evict.tolist() == [[0, 1, 0]] and plan.publish.tolist() == [[0, 3, 0]]
    assert engine.expert_slot[0, 1] == -1 and engine.expert_slot[0, 3] == 0
    assert policy.events == [("inserted", [1, 2]), ("evicted", [1]), ("inserted", [3])]


def test_late_admissions_stay_in_flight_and_are_never_victims():
    engine = CacheEngine(1, 8, 2, Lru(), inserts=2, admission="eager")
    engine.step(None)
    plan = engine.step(np.array([[1, 2]]), ready=1)  # 2's copy is not done
    assert plan.publish.tolist() == [[0, 1, 0]]
    assert engine.expert_slot[0, 2] == -1
    assert engine.handover.victims.tolist() == [[0, -1]]  # slot 1 is still being written
    plan = engine.step(np.array([[3, 4]]))              # 3 takes slot 0; 4 has no victim
    assert plan.admitted.tolist() == [[0, 3, 0]]
    assert plan.publish.tolist() == [[0, 2, 1], [0, 3, 0]]  # the late one first


def test_heat_hands_over_the_worth_its_boundary_admission_would_compare():
    # eager: worth_if_used(t) == admit() once the use is observed at t + 1 (the boundary
    # timing's comparison), against the victims' priorities at t, which that use leaves alone
    heat = make_policy("heat")
    heat.bind(1, 8, 4)
    used = np.zeros((1, 8), dtype=bool)
    for t, experts in enumerate([[1, 2], [1, 3], [1]]):
        used[:] = False
        used[0, experts] = True
        heat.observe(t, np.array([experts]), None, used)
    keys = np.arange(8)
    worth = heat.worth_if_used(2, keys)
    priority = heat.priority(2, keys)
    used[:] = True
    heat.observe(3, np.array([list(range(8))]), None, used)
    assert np.allclose(worth, heat.admit(3, keys))
    assert (worth > priority).all()


def test_eager_admission_refuses_queue_policies_and_other_delays():
    with pytest.raises(ValueError, match="picks its victims itself"):
        CacheEngine(2, 8, 2, make_policy("sieve"), admission="eager")
    with pytest.raises(ValueError, match="publish_delay must be 1"):
        CacheEngine(2, 8, 2, Lru(), publish_delay=2, admission="eager")
    with pytest.raises(ValueError, match="admission must be one of boundary, eager"):
        CacheEngine(2, 8, 2, Lru(), admission="early")


@pytest.mark.parametrize("n_slots", [1, 2, 3])
@pytest.mark.parametrize("policy", ["lru", "heat", "gdsf"])
def test_no_upload_targets_a_slot_the_running_graph_reads_even_when_uploads_are_slow(n_slots, policy):
    L, E, k = 3, 12, 2
    rng = np.random.default_rng(n_slots)
    routing = synthetic_routing(150, L, E, k, seed=n_slots)
    engine = CacheEngine(L, E, n_slots, make_policy(policy), inserts=2, admission="eager")
    engine.step(None)
    for ids in routing:
        held_before = engine.slot_expert.copy()
        in_flight_before = engine.in_flight.copy()
        due = engine.uploads_due
        plan = engine.step(ids, ready=int(rng.integers(0, 4)))  # a slow upload worker
        for layer, expert, slot in plan.admitted.tolist():
            assert held_before[layer, slot] not in ids[layer]   # the graph never reads it
            assert not in_flight_before[layer, slot]            # nor is it still being written
            assert expert in ids[layer]
        published = engine.expert_slot
        for layer in range(L):  # a published expert's slot holds it and is not being written
            for e in np.flatnonzero(published[layer] >= 0):
                assert engine.slot_expert[layer, published[layer, e]] == e
                assert not engine.in_flight[layer, published[layer, e]]
        assert plan.publish.shape[0] <= due + plan.admitted.shape[0]


@pytest.mark.parametrize("policy", ["lru", "heat"])
def test_the_engines_handover_is_build_handovers(policy):
    """The engine builds its handover in native/engine_core.c: it must equal the reference
    build_handover on the same state, with pinned experts, late uploads and multi-token steps."""
    rng = np.random.default_rng(7)
    L, E, K = 3, 12, 4
    engine = CacheEngine(L, E, K, make_policy(policy), admission="eager", inserts=2,
                         pinned=[[0], [], [5]])
    engine.step(None)
    for t in range(1, 200):
        t_handover = engine.step_index - 1
        held = engine.slot_expert
        keys = np.maximum(held, 0) + np.arange(L)[:, None] * E
        free = held < 0
        evictable = ~free & ~engine.in_flight & ~engine.pinned.take(keys)
        worth = np.array(engine.policy.worth_if_used(t_handover, np.arange(L * E).reshape(L, E))
                         if policy == "heat" else np.full((L, E), np.inf))
        worth[engine.assigned >= 0] = -np.inf
        expected = build_handover(free, evictable, engine.policy.priority(t_handover, keys), worth, 2)
        got = engine.handover
        for field in ("victims", "victim_worth", "worth", "budget"):
            np.testing.assert_array_equal(getattr(got, field), getattr(expected, field), err_msg=field)
        ids = rng.integers(0, E, size=(L, 2 * int(rng.integers(1, 3))))
        engine.step(ids, ready=int(rng.integers(0, 3)))
