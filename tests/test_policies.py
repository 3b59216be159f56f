
import numpy as np
import pytest

from moecache.core.engine import CacheEngine
from moecache.core.policies import DEFAULT_POLICY, POLICIES, make_policy
from moecache.formats.traces import SHIPPED_TRACES, RouteTrace, read_trace, synthetic_routing
from moecache.offline.budget import BUDGET_POLICIES, make_budget_policy
from moecache.offline.replay import PerLayerReplay, simulate
from moecache.offline.steps import next_use, observation_keys

ONLINE = [name for name, factory in POLICIES.items() if name != "belady"]


def test_registry_and_default():
    assert DEFAULT_POLICY in POLICIES and DEFAULT_POLICY != "belady"
    assert make_policy("default").name == DEFAULT_POLICY
    assert {"lru", "lfu", "gdsf", "random", "belady", "arc", "sieve"} <= set(POLICIES)
    with pytest.raises(ValueError) as info:
        make_policy("lur")
    assert "'lur'" in str(info.value) and "lru" in str(info.value) and "default" in str(info.value)
    with pytest.raises(ValueError, match="offline replay only"):
        make_policy("belady")
    assert make_policy("belady", future=next_use([np.array([0])], 1)).offline_only


def hit_rate(routing, n_expert, slots, policy, inserts):
    return simulate(RouteTrace.from_routing(routing, n_expert), PerLayerReplay(policy, slots, inserts=inserts)).hit_rate


RANDOM_CASES = [  # (seed, experts, top-k, slots, generator options)
    (0, 32, 4, 4, {}), (1, 32, 4, 8, {}), (2, 64, 2, 8, {"stickiness": 1.0}),
    (3, 64, 8, 16, {"skew": 0.5, "drift": 0.2}), (4, 16, 2, 3, {"skew": 0.0, "stickiness": 0.0}),
]


@pytest.mark.parametrize("seed, experts, k, slots, options", RANDOM_CASES)
@pytest.mark.parametrize("inserts", [2, None])
def test_belady_beats_every_online_policy_on_random_traces(seed, experts, k, slots, options, inserts):
    routing = synthetic_routing(150, 3, experts, k, seed=seed, **options)
    best = hit_rate(routing, experts, slots, "belady", inserts)
    for name in ONLINE:
        assert hit_rate(routing, experts, slots, name, inserts) <= best + 1e-9, name


@pytest.mark.parametrize("path", SHIPPED_TRACES, ids=["qwen", "gptoss"])
def test_belady_beats_every_online_policy_on_real_traces(path):
    trace = read_trace(str(path))
    for slots, inserts in ((8, 2), (16, 2), (32, 2), (16, None)):
        best = simulate(trace, PerLayerReplay("belady", slots, inserts=inserts)).hit_rate
        for name in ONLINE:
            got = simulate(trace, PerLayerReplay(name, slots, inserts=inserts)).hit_rate
            assert got <= best + 1e-9, (name, slots, inserts)


def test_random_policy_is_seeded():
    routing = synthetic_routing(100, 2, 32, 4, seed=9)
    runs = []
    for _ in range(2):
        engine = CacheEngine(2, 32, 6, make_policy("random", seed=3))
        engine.step(None)
        runs.append([engine.step(ids).upload.tolist() for ids in routing])
    assert runs[0] == runs[1]


def test_belady_rejects_a_different_future():
    routing = synthetic_routing(5, 2, 16, 2, seed=1)
    future = next_use(observation_keys(routing, 16), 2 * 16)
    engine = CacheEngine(2, 16, 4, make_policy("belady", future=future), offline=True)
    engine.step(None)
    with pytest.raises(ValueError, match="differs from the future"):
        engine.step(routing[1])


def test_heat_admission_keeps_one_off_experts_from_displacing_popular_ones():
    # {0, 1} and {2, 3} alternate; every step also routes to two experts never seen again
    steps = [([0, 1] if t % 2 == 0 else [2, 3]) + [10 + 2 * t % 50, 11 + 2 * t % 50] for t in range(60)]
    routing = np.array(steps, dtype=np.int32)[:, None, :]
    lru = hit_rate(routing, 64, 4, "lru", 2)
    heat = hit_rate(routing, 64, 4, "heat", 2)
    assert heat > 2 * lru                     # LRU lets the one-offs push the pairs out
    assert heat <= hit_rate(routing, 64, 4, "belady", 2)


def test_decayed_counts_survive_rebasing_far_into_a_run():
    lfu = make_policy("lfu", half_life=2.0)
    lfu.bind(1, 4, 2)
    used = np.zeros((1, 4), dtype=bool)
    for step in range(0, 3000, 10):  # 2**(3000/2) would overflow without rebasing
        used[:] = False
        used[0, 1 if step < 2900 else 2] = True
        lfu.observe(step, None, None, used)
    heat = lfu.priority(3000, np.arange(4))
    assert np.isfinite(heat).all()
    assert heat[2] > heat[1] > heat[0] == 0.0  # recent uses outweigh decayed old ones


def test_next_use_is_each_keys_following_step():
    # steps use keys {0, 2}, {2}, {0, 1}; key 3 never
    future = next_use([np.array([0, 2]), np.array([2]), np.array([0, 1])], 4)
    assert future.first.tolist() == [0, 2, 0, np.inf]
    assert [after.tolist() for after in future.after] == [[2, 1], [np.inf], [np.inf, np.inf]]
    assert observation_keys([np.array([[3, -1], [0, 3]])], 4)[0].tolist() == [3, 4, 7]


def test_the_global_belady_refuses_other_batches():
    policy = make_budget_policy("belady", future=next_use([np.array([0, 1])], 4))
    policy.bind(1)
    with pytest.raises(ValueError, match="batch 0 differs"):
        policy.accessed(0, [2], {2: None})
    with pytest.raises(ValueError, match="needs the batches ahead"):
        make_budget_policy("belady")


def test_a_name_in_both_registries_is_the_same_rule():
    # the per-layer lfu decays its counts: the global model's plain one has its own name
    assert set(POLICIES) & set(BUDGET_POLICIES) == {"lru", "random", "belady"}
    assert "plain-lfu" in BUDGET_POLICIES


CAPABILITIES = {  # capability: the method it promises (choose_victims: when it is False)
    "ranks_residents": "choose_victims", "admits": "admit", "predicts": "predict", "takes_prior": "prior"}


def shipped_policy_classes():
    """The registry's policies and the ones the experiments try (moecache.offline.experiments)."""
    from moecache.core.policies import Policy
    from moecache.offline import experiments

    classes = set(POLICIES.values())
    classes |= {value for value in vars(experiments).values()
                if isinstance(value, type) and issubclass(value, Policy) and value is not Policy}
    return sorted(classes, key=lambda cls: cls.__qualname__)


@pytest.mark.parametrize("cls", shipped_policy_classes(), ids=lambda cls: cls.__qualname__)
def test_a_policy_declares_exactly_the_capabilities_it_implements(cls):
    """The engine reads the capability attributes, never the methods: a method without its
    attribute would silently go unused."""
    for capability, method in CAPABILITIES.items():
        implemented = hasattr(cls, method)
        assert getattr(cls, capability) == (not implemented if capability == "ranks_residents" else implemented), \
            (capability, method)


def test_issue_37s_candidates_score_as_they_say():
    """moecache.offline.experiments' candidates against ClassLRU (not shipped): heat-max keeps the
    larger memory, heat-sum counting a prompt's uses per token agrees with heat-sum on decode tokens
    and caps a prompt's, and class x heat keeps ClassLRU's classes at its defaults."""
    from moecache.offline.experiments import ClassHeat, HeatMax, HeatSum, HeatSumPromptCounts

    rng = np.random.default_rng(4)
    tokens = [rng.choice(16, size=(3, 2), replace=False) for _ in range(6)]
    summed, counted, larger = HeatSum(), HeatSumPromptCounts(cap=2), HeatMax()
    for policy in (summed, counted, larger):
        policy.bind(3, 16, 4)
    for t, ids in enumerate(tokens):  # decode tokens: each expert at most once a layer
        used = np.zeros((3, 16), dtype=bool)
        np.put_along_axis(used, ids, True, axis=1)
        for policy in (summed, counted, larger):
            policy.observe(t, ids, None, used)
    assert np.allclose(counted.S, summed.S)
    assert np.allclose(larger.S, np.maximum(summed.weights[0] * summed.rates[0], summed.weights[1] * summed.rates[1]))
    prompt = np.array([[5, 5, 5, 1]])  # one layer: a prompt whose tokens chose expert 5 three times
    fresh = HeatSumPromptCounts(cap=2)
    fresh.bind(1, 16, 4)
    fresh.observe(0, prompt, None, np.isin(np.arange(16), prompt)[None])
    assert fresh.S[0, 5] == pytest.approx(2 * fresh.S[0, 1]) and fresh.S[0, 0] == 0
    classes = ClassHeat()
    assert classes.n_classes == 8 and classes.base == 2.0 and classes.decay[1] == pytest.approx(2 ** (-1 / 128))


def test_fitted_slots_moves_slots_to_the_layer_that_uses_them():
    """experiments.fitted_slots (an oracle for issue 37): layers replayed alone add up to the whole
    replay, and the bank's slots go where they hit: a layer that always picks one expert gives
    its second slot to a layer cycling through three."""
    from moecache.offline.experiments import fitted_slots

    steps = 60
    routing = np.stack([np.zeros(steps, dtype=np.int32), np.arange(steps, dtype=np.int32) % 3], axis=1)[:, :, None]
    trace = RouteTrace.from_routing(routing, 8)
    replay_of = lambda k: PerLayerReplay("lru", k, admission="eager")  # noqa: E731
    uniform, fitted, slots = fitted_slots(trace, 2, replay_of, span=1)
    assert uniform == pytest.approx(simulate(trace, replay_of(2)).hit_rate)
    assert list(slots) == [1, 3] and fitted == pytest.approx((steps - 1 + steps - 3) / (2 * steps))
    sticky = RouteTrace.from_routing(synthetic_routing(80, 4, 16, 2, seed=5), 16, expert_bytes=[1, 1, 2, 2])
    uniform, fitted, slots = fitted_slots(sticky, 4, lambda k: PerLayerReplay("default", k, admission="eager"))
    assert uniform == pytest.approx(simulate(sticky, PerLayerReplay("default", 4, admission="eager")).hit_rate)
    assert fitted >= uniform and slots[:2].sum() == slots[2:].sum() == 8  # each bank keeps its bytes
