"""The eager-admission rule libllama follows during a graph, modelled in moecache.eager."""

import numpy as np

from moecache.eager import Handover, admissions, build_handover

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
