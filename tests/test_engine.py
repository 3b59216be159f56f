import numpy as np
import pytest

from moecache.core.engine import CacheEngine
from moecache.core.policies import Lru, NextUse, Policy, make_policy
from moecache.formats.traces import synthetic_routing


class ReferenceLru:
    """The per-layer LRU cache model written out plainly, one layer and one expert at a time:
    hits against what was published during the observed graph, publication one boundary
    after the upload, at most `inserts` uploads per layer in router-rank order, free slots
    first (lowest index), victims by (last use, slot), never an expert of the observed step."""

    def __init__(self, n_layers, n_slots, inserts):
        self.n_slots, self.inserts = n_slots, inserts
        self.slots = [[None] * n_slots for _ in range(n_layers)]
        self.published = [set() for _ in range(n_layers)]
        self.pending = []
        self.last_use = [{} for _ in range(n_layers)]

    def step(self, t, ids):
        hits = []
        for layer, row in enumerate(ids):
            hits.append([e in self.published[layer] for e in row])
            for e in row:
                self.last_use[layer][e] = t
        for layer, e in self.pending:
            self.published[layer].add(e)
        self.pending = []
        for layer, row in enumerate(ids):
            slots = self.slots[layer]
            misses = []
            for e in row:
                if e not in slots and e not in misses:
                    misses.append(e)
            if self.inserts is not None:
                misses = misses[:self.inserts]
            for e in misses:
                if None in slots:
                    slot = slots.index(None)
                else:
                    candidates = [(self.last_use[layer].get(old, 0), s) for s, old in enumerate(slots)
                                  if old not in row]
                    if not candidates:
                        break
                    _, slot = min(candidates)
                    self.published[layer].discard(slots[slot])
                slots[slot] = e
                self.pending.append((layer, e))
        return hits


def check_invariants(engine, plan, ids, inserts, pinned=None):
    L, E = engine.expert_slot.shape
    # every published expert has its slot, and that slot holds it
    for layer in range(L):
        for e in np.flatnonzero(engine.expert_slot[layer] >= 0):
            assert engine.slot_expert[layer, engine.expert_slot[layer, e]] == e
        held = engine.slot_expert[layer][engine.slot_expert[layer] >= 0]
        assert len(set(held.tolist())) == held.size  # no expert in two slots
    # a slot is only reused after its old expert's table entry is cleared in the same plan
    for l, e, s in plan.upload.tolist():
        assert engine.expert_slot[l, e] == -1             # not visible until published
        assert not (engine.expert_slot[l] == s).any()     # no table entry points at the slot
    uploads = np.bincount(plan.upload[:, 0], minlength=L) if plan.upload.size else np.zeros(L)
    if inserts is not None and ids is not None:
        assert uploads.max() <= inserts
    if ids is not None:
        for l, e, s in plan.evict.tolist():
            assert e not in ids[l].tolist()                # the observed step's experts stay
            assert (l, s) in {(ul, us) for ul, _, us in plan.upload.tolist()}
            if pinned is not None:
                assert e not in pinned[l]


@pytest.mark.parametrize("inserts", [1, 2, None])
@pytest.mark.parametrize("n_slots", [3, 6, 12])
@pytest.mark.parametrize("seed", [0, 1])
def test_lru_engine_equals_brute_force_reference(inserts, n_slots, seed):
    L, E, k = 4, 24, 3
    routing = synthetic_routing(120, L, E, k, seed=seed, stickiness=1.0)
    engine = CacheEngine(L, E, n_slots, Lru(), inserts=inserts)
    reference = ReferenceLru(L, n_slots, inserts)
    engine.step(None)
    for t, ids in enumerate(routing, start=1):
        plan = engine.step(ids)
        expected = reference.step(t, ids.tolist())
        assert plan.hit_mask.tolist() == expected, f"step {t}"
        check_invariants(engine, plan, ids, inserts)
        for layer in range(L):
            assert engine.slot_expert[layer].tolist() == [-1 if e is None else e
                                                           for e in reference.slots[layer]]


def test_miss_is_usable_two_graphs_later():
    engine = CacheEngine(1, 8, 4, Lru(), inserts=2)
    engine.step(None)                               # boundary 0, graph 0 runs
    plan = engine.step(np.array([[5, 6]]))          # boundary 1 observes graph 0: misses
    assert plan.hit_mask.tolist() == [[False, False]]
    assert plan.upload.tolist() == [[0, 5, 0], [0, 6, 1]] and plan.publish.size == 0
    assert engine.expert_slot[0, 5] == -1           # in flight during graph 1
    plan = engine.step(np.array([[5, 6]]))          # graph 1 still missed them
    assert plan.hit_mask.tolist() == [[False, False]]
    assert plan.upload.size == 0                    # already on the way: no second upload
    assert plan.publish.tolist() == [[0, 5, 0], [0, 6, 1]]
    assert engine.expert_slot[0, 5] == 0
    plan = engine.step(np.array([[5, 6]]))          # graph 2 hits
    assert plan.hit_mask.tolist() == [[True, True]]
    assert plan.hits.tolist() == [2] and plan.misses.tolist() == [0]


def test_eviction_unpublishes_before_reuse_and_spares_the_observed_step():
    engine = CacheEngine(1, 8, 2, Lru(), inserts=2)
    engine.step(None)
    engine.step(np.array([[0, 1]]))                 # uploads 0, 1
    plan = engine.step(np.array([[2, 3]]))          # 0, 1 published, unused in graph 1: victims
    assert plan.publish[:, 1].tolist() == [0, 1]
    assert plan.evict.tolist() == [[0, 0, 0], [0, 1, 1]]
    assert engine.expert_slot[0, 0] == -1 and engine.expert_slot[0, 1] == -1
    assert plan.upload.tolist() == [[0, 2, 0], [0, 3, 1]]
    plan = engine.step(np.array([[2, 4]]))          # 2 was used: only 3 may go
    assert plan.evict.tolist() == [[0, 3, 1]]
    assert plan.upload.tolist() == [[0, 4, 1]]


def test_nothing_evictable_means_no_upload():
    engine = CacheEngine(1, 8, 2, Lru(), inserts=2)
    engine.step(None)
    engine.step(np.array([[0, 1]]))
    engine.step(np.array([[0, 1]]))     # both published
    plan = engine.step(np.array([[0, 1, 2]]))  # 0 and 1 protected: 2 cannot get a slot
    assert plan.upload.size == 0 and plan.evict.size == 0


def test_publish_delay_two_keeps_in_flight_slots_from_victims():
    engine = CacheEngine(1, 16, 2, Lru(), inserts=2, publish_delay=2)
    engine.step(None)
    plan = engine.step(np.array([[0, 1]]))
    assert plan.upload[:, 1].tolist() == [0, 1]
    plan = engine.step(np.array([[2, 3]]))  # both slots in flight: nothing to evict
    assert plan.upload.size == 0 and plan.publish.size == 0
    plan = engine.step(np.array([[2, 3]]))
    assert plan.publish[:, 1].tolist() == [0, 1]
    assert plan.upload[:, 1].tolist() == [2, 3]


def test_preload_ignores_inserts_and_publishes_next_boundary():
    engine = CacheEngine(2, 16, 4, Lru(), inserts=1)
    engine.preload([[3, 4, 5, 6, 7], [9]])
    plan = engine.step(None)
    assert sorted(plan.upload[:, 1].tolist()) == [3, 4, 5, 6, 9]  # K=4 caps layer 0
    assert (engine.expert_slot == -1).all()
    plan = engine.step(np.array([[3, 7], [9, 1]]))
    assert plan.hit_mask.tolist() == [[False, False], [False, False]]
    plan = engine.step(np.array([[3, 7], [9, 1]]))
    assert plan.hit_mask.tolist() == [[True, False], [True, False]]


@pytest.mark.parametrize("with_rates", [False, True])
def test_preload_rates_are_the_policys_prior(with_rates):
    """Heat seeded from a profile keeps its preloaded experts against one-off misses;
    without the rates they have no heat and the misses replace them."""
    engine = CacheEngine(1, 8, 2, make_policy("heat"), inserts=2)
    rates = np.array([[0.9, 0.9, 0.1, 0.1, 0, 0, 0, 0]])
    engine.preload([[0, 1]], rates=rates if with_rates else None)
    engine.step(None)
    engine.step(np.array([[0, 1]]))             # published now: hits from the next graph
    plan = engine.step(np.array([[2, 3]]))
    assert plan.hits.sum() == 0
    assert sorted(plan.upload[:, 1].tolist()) == ([] if with_rates else [2, 3])


def test_preload_rates_are_checked():
    engine = CacheEngine(2, 4, 2, make_policy("heat"))
    with pytest.raises(ValueError, match=r"rates must be finite and >= 0 with shape \(2, 4\)"):
        engine.preload([[0], [1]], rates=np.ones((2, 5)))
    with pytest.raises(ValueError, match="rates must be finite"):
        engine.preload([[0], [1]], rates=np.full((2, 4), np.nan))
    engine.step(None)
    with pytest.raises(ValueError, match="before the first step"):
        engine.preload([[0], [1]], rates=np.ones((2, 4)))
    CacheEngine(2, 4, 2, Lru()).preload([[0], [1]], rates=np.ones((2, 4)))  # no prior(): ignored


def test_pinned_experts_are_uploaded_first_and_never_evicted():
    routing = synthetic_routing(200, 3, 32, 4, seed=2)
    pinned = [{0, 1}, set(), {31}]
    engine = CacheEngine(3, 32, 6, Lru(), inserts=2, pinned=pinned)
    engine.preload([[5, 6, 7, 8, 9, 10]] * 3)
    plan = engine.step(None)
    assert {(l, e) for l, e, _ in plan.upload.tolist()} >= {(0, 0), (0, 1), (2, 31)}
    for ids in routing:
        plan = engine.step(ids)
        check_invariants(engine, plan, ids, 2, pinned)
    assert engine.expert_slot[0, 0] >= 0 and engine.expert_slot[0, 1] >= 0 and engine.expert_slot[2, 31] >= 0
    with pytest.raises(ValueError, match="at most"):
        CacheEngine(1, 8, 2, Lru(), pinned=[{0, 1}])


class PredictNext(Policy):
    """Test policy: LRU that predicts expert (e + 1) for every expert e just used."""
    name = "predict-next"
    predicts = True

    def bind(self, n_layers, n_expert, n_slots):
        super().bind(n_layers, n_expert, n_slots)
        self.lru = Lru()
        self.lru.bind(n_layers, n_expert, n_slots)
        self.guess = np.full((n_layers, 1), -1)

    def observe(self, step, ids, hit_mask, used):
        self.lru.observe(step, ids, hit_mask, used)
        self.guess = (ids[:, :1] + 1) % self.n_expert

    def priority(self, step, keys):
        return self.lru.priority(step, keys)

    def predict(self, step):
        return self.guess


def test_prefetch_uses_leftover_budget_and_counts_hits_and_waste():
    engine = CacheEngine(1, 16, 8, PredictNext(), inserts=2)
    engine.step(None)
    plan = engine.step(np.array([[3]]))            # one miss, one upload left for the guess 4
    assert plan.upload[:, 1].tolist() == [3, 4]
    assert engine.counters["prefetch_uploads"].tolist() == [1]
    engine.step(np.array([[3, 9]]))                # 4 published at this boundary
    engine.step(np.array([[4, 3]]))                # prefetched 4 used while published
    assert engine.counters["prefetch_hits"].tolist() == [1]
    assert engine.counters["prefetch_uploads"].tolist() == [2]  # and 5, guessed from 4, went up
    engine.step(np.array([[1, 2]]))                # two misses use the whole budget
    assert engine.counters["prefetch_uploads"].tolist() == [2]
    stats = engine.stats()
    assert stats["totals"]["prefetch_hits"] == 1 and set(stats["layers"]) >= {"hits", "prefetch_waste"}


class PredictFive(Lru):
    """Test policy: LRU that predicts expert 5 in layer 0 only, from the second boundary on."""
    name = "predict-five"
    predicts = True

    def predict(self, step):
        return np.array([[5 if step else -1], [-1]])


def test_prefetch_only_for_layers_whose_budget_the_misses_used():
    # layer 0's miss takes its whole budget, layer 1 has budget left but no prediction:
    # nothing is prefetched (this used to raise on an empty reduction)
    engine = CacheEngine(2, 16, 8, PredictFive(), inserts=1)
    engine.step(None)
    plan = engine.step(np.array([[3], [-1]]))
    assert plan.upload.tolist() == [[0, 3, 0]]
    assert engine.counters["prefetch_uploads"].tolist() == [0, 0]


def test_prefetch_waste_counted_when_evicted_unused():
    engine = CacheEngine(1, 16, 2, PredictNext(), inserts=2)
    engine.step(None)
    engine.step(np.array([[0]]))        # uploads 0 and prefetches 1
    plan = engine.step(np.array([[7]])) # 7 needs a victim: 1 was never used, so it goes
    assert plan.evict.tolist() == [[0, 1, 1]]
    assert engine.counters["prefetch_waste"].tolist() == [1]
    assert engine.counters["prefetch_uploads"].tolist() == [1]  # no free slot left for guess 8
    assert engine.counters["prefetch_hits"].tolist() == [0]


def test_duplicate_and_absent_ids():
    engine = CacheEngine(2, 8, 4, Lru(), inserts=4)
    engine.step(None)
    plan = engine.step(np.array([[1, 1, 2, -1], [-1, -1, -1, -1]]))
    assert plan.upload.tolist() == [[0, 1, 0], [0, 2, 1]]
    assert plan.misses.tolist() == [3, 0] and plan.hits.tolist() == [0, 0]


@pytest.mark.parametrize("name", ["lru", "heat"])
def test_a_multi_token_step_with_more_misses_than_slots(name):
    """A ubatch of several tokens (ids token by token, repeats, -1 where a layer ran fewer
    tokens) can miss more distinct experts than there are slots and inserts: the best take the
    slots, every lookup is counted."""
    engine = CacheEngine(2, 16, 2, make_policy(name), inserts=8)
    engine.step(None)
    ids = np.array([[1, 2, 3, 4, 5, 6, 1, 7, 8, 9], [0, 1, 2, 3, -1, -1, -1, -1, -1, -1]])
    plan = engine.step(ids)
    assert plan.misses.tolist() == [10, 4] and plan.hits.tolist() == [0, 0]
    assert np.bincount(plan.upload[:, 0], minlength=2).tolist() == [2, 2]
    check_invariants(engine, plan, ids, 8)
    plan = engine.step(ids)
    assert plan.hits.tolist() == [0, 0]  # uploaded at the last boundary: published now
    plan = engine.step(ids)
    assert plan.hits.sum() > 0


@pytest.mark.parametrize("ids, message", [
    (np.array([[1, 8], [0, 1]]), "in \\[-1, 8\\), got 8"),  # not layer 1's expert 0
    (np.array([[1, 2], [0, -2]]), "in \\[-1, 8\\), got -2"),
    (np.array([1, 2]), "ids must be"),
    (np.array([[1.0, 2.0], [0.0, 1.0]]), "ids must be"),
])
def test_bad_observations_are_rejected(ids, message):
    engine = CacheEngine(2, 8, 4, Lru())
    with pytest.raises(ValueError, match=message):
        engine.step(ids)


def test_offline_only_policy_refused_live():
    future = NextUse(first=np.full(8, np.inf), keys=[], after=[])  # nothing ahead
    with pytest.raises(ValueError, match="offline replay only"):
        CacheEngine(1, 8, 4, make_policy("belady", future=future))
    CacheEngine(1, 8, 4, make_policy("belady", future=future), offline=True)


def test_constructor_validation():
    with pytest.raises(ValueError):
        CacheEngine(1, 8, 9, Lru())
    with pytest.raises(ValueError):
        CacheEngine(1, 8, 4, Lru(), inserts=0)
    with pytest.raises(ValueError, match="preload has"):
        CacheEngine(2, 8, 4, Lru()).preload([[1]])


@pytest.mark.parametrize("name", ["lru", "lfu", "gdsf", "random", "arc", "sieve", "heat"])
def test_every_policy_keeps_engine_invariants(name):
    routing = synthetic_routing(150, 3, 24, 3, seed=5)
    engine = CacheEngine(3, 24, 5, make_policy(name), inserts=2)
    engine.step(None)
    for ids in routing:
        plan = engine.step(ids)
        check_invariants(engine, plan, ids, 2)
    stats = engine.stats()
    assert stats["totals"]["hits"] + stats["totals"]["misses"] == routing.size
    assert stats["totals"]["uploads"] <= 2 * 3 * len(routing)
    assert engine.usage.sum() == routing.size


def test_uploads_of_one_boundary_never_evict_each_other():
    engine = CacheEngine(1, 16, 3, Lru(), inserts=2, pinned=[{7}])
    engine.preload([[7, 1, 2, 3]])              # 7 is pinned already: not uploaded twice
    plan = engine.step(np.array([[4, 5]]))      # first boundary observes too: slots all loading
    assert sorted(plan.upload[:, 1].tolist()) == [1, 2, 7]
    assert plan.evict.size == 0
    check_invariants(engine, plan, np.array([[4, 5]]), None)


def test_an_upload_not_ready_stays_in_flight_until_a_later_boundary():
    from moecache.core.engine import CacheEngine
    from moecache.core.policies import make_policy

    engine = CacheEngine(1, 4, 1, make_policy("lru"), inserts=1)
    engine.step(None)
    plan = engine.step(np.array([[2]]))            # miss: upload expert 2 into slot 0
    assert plan.upload.tolist() == [[0, 2, 0]]
    assert engine.uploads_due == 1
    plan = engine.step(np.array([[3]]), ready=0)   # still copying: not published, not evicted
    assert plan.publish.size == 0 and plan.upload.size == 0 and plan.evict.size == 0
    assert engine.expert_slot[0, 2] == -1 and engine.counters["late"].tolist() == [1]
    plan = engine.step(np.array([[2]]), ready=1)   # done now: published; expert 2 missed once more
    assert plan.publish.tolist() == [[0, 2, 0]] and plan.hits.tolist() == [0]
    plan = engine.step(np.array([[2]]), ready=0)   # nothing was due: ready=0 changes nothing
    assert plan.hits.tolist() == [1]


def test_an_upload_late_at_several_boundaries_is_counted_late_once():
    from moecache.core.engine import CacheEngine
    from moecache.core.policies import make_policy

    engine = CacheEngine(1, 8, 2, make_policy("lru"), inserts=2)
    engine.step(None)
    assert len(engine.step(np.array([[2, 3]])).upload) == 2
    for _ in range(5):                             # both still copying at five boundaries: two late uploads
        assert engine.step(np.array([[2, 3]]), ready=0).upload.size == 0
    assert engine.counters["late"].tolist() == [2]
    engine.step(np.array([[2, 3]]), ready=1)       # one done; the other late still, not again
    assert engine.counters["late"].tolist() == [2] and engine.expert_slot[0, 2] == 0
    engine.step(np.array([[2, 3]]), ready=None)
    assert engine.counters["late"].tolist() == [2] and engine.expert_slot[0, 3] == 1


# --- prefill: a prompt ubatch the stock graph ran ----------------------------------------

def test_prefill_fills_free_slots_with_the_most_used_experts_ignoring_inserts():
    engine = CacheEngine(1, 16, 4, Lru(), inserts=1)
    engine.step(None)
    prompt = np.array([[3, 5, 3, 7, 3, 5, 9, 1, 2, 5]])  # 5 tokens, top-2: 3 and 5 three times
    plan = engine.step(prompt, prefill=True)
    assert not plan.hit_mask.any() and plan.hits.sum() == 0 and plan.misses.sum() == 0
    # most used first, ties to the lower id: 3, 5, then 1 and 2 of the experts used once
    assert plan.upload.tolist() == [[0, 3, 0], [0, 5, 1], [0, 1, 2], [0, 2, 3]]
    totals = engine.stats(expert_bytes=[100])["totals"]
    assert totals["hits"] + totals["misses"] == 0 and totals["uploads"] == 0
    assert totals["prefill_uploads"] == 4 and totals["prefill_upload_bytes"] == 400
    assert totals["upload_bytes"] == 0 and engine.usage.sum() == 0  # the profile counts decode steps
    plan = engine.step(np.array([[3, 9]]))               # published at the next boundary
    assert plan.publish[:, 1].tolist() == [3, 5, 1, 2]
    assert plan.hit_mask.tolist() == [[False, False]]    # graph after the prompt ran without them
    assert engine.step(np.array([[3, 9]])).hit_mask.tolist() == [[True, False]]


def test_prefill_evicts_by_priority_and_never_the_prompts_own_experts():
    engine = CacheEngine(1, 16, 3, Lru(), inserts=2)
    engine.step(None)
    engine.step(np.array([[0, 1]]))
    engine.step(np.array([[2, 0]]))          # 0, 1 published; 2 uploaded
    engine.step(np.array([[0, 1]]))          # 2 published; last uses: 0 and 1 at 3, 2 at 2
    prompt = np.array([[8, 1, 8, 9, 8, 9]])  # 8 x3, 9 x2, 1 x1 (resident: stays)
    plan = engine.step(prompt, prefill=True)
    assert plan.evict.tolist() == [[0, 2, 2], [0, 0, 0]]  # lowest priority first; 1 was used
    assert plan.upload.tolist() == [[0, 8, 2], [0, 9, 0]]
    assert engine.slot_expert[0].tolist() == [9, 1, 8]


def test_prefill_admission_keeps_residents_worth_more_than_the_candidate():
    """heat: a prompt's expert is worth one observation; a resident used in several decode
    steps is worth more and stays, one used once long ago goes."""
    engine = CacheEngine(1, 16, 2, make_policy("heat"), inserts=2)
    engine.step(None)
    engine.step(np.array([[0, 1]]))
    for _ in range(5):
        engine.step(np.array([[0, -1]]))     # 0 hot, 1 cold
    plan = engine.step(np.array([[5, 6, 5, 6]]), prefill=True)
    assert plan.evict[:, 1].tolist() == [1]
    assert plan.upload[:, 1].tolist() == [5]
    assert 0 in engine.slot_expert[0]


def test_prefill_keeps_pinned_experts_and_slots_in_flight():
    engine = CacheEngine(1, 16, 3, Lru(), inserts=2, pinned=[{7}])
    engine.step(None)                        # 7 uploaded
    engine.step(np.array([[0, 1]]))          # 7 published; 0, 1 uploaded
    plan = engine.step(np.array([[4, 5, 4, 5]]), prefill=True, ready=0)  # 0, 1 still loading
    assert plan.publish.size == 0 and plan.upload.size == 0 and plan.evict.size == 0
    plan = engine.step(np.array([[4, 5, 4, 5]]), prefill=True)           # loaded now
    assert plan.publish[:, 1].tolist() == [0, 1]
    assert sorted(plan.upload[:, 1].tolist()) == [4, 5] and 7 in engine.slot_expert[0]


def test_prefill_step_models_no_eager_admission_and_hands_over_for_the_next_graph():
    engine = CacheEngine(1, 16, 2, make_policy("heat"), inserts=2, admission="eager")
    engine.step(None)
    assert engine.handover is not None
    plan = engine.step(np.array([[3, 4, 3, 5]]), prefill=True)
    assert plan.admitted.size == 0           # the stock graph started no upload
    assert plan.upload[:, 1].tolist() == [3, 4]
    handover = engine.handover
    assert handover is not None and handover.worth[0, 3] == -np.inf  # on its way
    with pytest.raises(ValueError, match="stock graph admits nothing"):
        engine.step(np.array([[6, 7]]), prefill=True, admitted=np.array([[0, 6, 0]], dtype=np.int32))
    with pytest.raises(ValueError, match="prompt's ids"):
        engine.step(None, prefill=True)


def test_counter_names_are_the_c_enums_in_the_reported_order():
    """COUNTERS is read from engine_core.h's mc_counter: the names, their order (the stats'
    and the live report's) and the C's row of each must agree."""
    from moecache.core.bookkeeping import lib
    from moecache.core.engine import COUNTERS

    assert COUNTERS == ("hits", "misses", "uploads", "evictions", "prefetch_uploads", "prefetch_hits",
                        "prefetch_waste", "late", "prefill_uploads", "declined", "lane_misses")
    assert [getattr(lib, f"MC_{name.upper()}") for name in COUNTERS] == list(range(len(COUNTERS)))
    assert lib.MC_N_COUNTERS == len(COUNTERS)


def test_each_counter_lands_under_its_name():
    engine = CacheEngine(1, 8, 3, PredictNext(), inserts=2)
    engine.step(None)
    engine.step(np.array([[0]]))                    # miss 0: upload 0, prefetch the guess 1
    engine.step(np.array([[0]]), ready=1)           # 0 published, 1 late; 0 missed again
    engine.step(np.array([[1]]))                    # 1 published now: a miss; prefetch 2
    engine.step(np.array([[1]]))                    # the prefetched 1 hits
    engine.step(np.array([[5]]))                    # miss 5 evicts the unused prefetched 2
    engine.step(np.array([[7, 7]]), prefill=True)   # the prompt's 7 evicts 0
    totals = {name: int(row.sum()) for name, row in engine.counters.items()}
    assert totals == {"hits": 1, "misses": 4, "uploads": 4, "evictions": 2, "prefetch_uploads": 2,
                      "prefetch_hits": 1, "prefetch_waste": 1, "late": 1, "prefill_uploads": 1}


def test_residency_views_are_read_only_and_follow_the_engine():
    engine = CacheEngine(1, 8, 2, Lru(), inserts=2, pinned=[{3}])
    engine.step(None)                            # 3 uploaded
    assert engine.in_flight.tolist() == [[True, False]] and engine.assigned[0, 3] == 0
    assert engine.pinned[0].tolist() == [i == 3 for i in range(8)]
    engine.step(np.array([[1]]))                 # 3 published, 1 uploaded into slot 1
    assert engine.in_flight.tolist() == [[False, True]] and engine.assigned[0, 1] == 1
    for view in (engine.in_flight, engine.pinned, engine.assigned):
        with pytest.raises(ValueError, match="read-only"):
            view[0, 0] = 0
