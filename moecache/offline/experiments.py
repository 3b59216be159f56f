"""Policies tried and not shipped, and diagnostic oracles: what the tables of
docs/notes/policy-experiments.md and docs/notes/upstream-comparison.md compare the shipped
policies with (scripts/replay_table.py, scripts/policy_experiments.py,
scripts/compare_upstream.py) and what tests/replay_values.py pins. They live here, outside
moecache.core.policies, so the negative results stay reproducible; each is a
moecache.core.policies.Policy replayed through moecache.offline.replay.simulate.

Issue 4's candidate defaults (DEFAULT_CANDIDATES, tried against heat):

- markov-same / markov-prev: heat plus a co-activation term learned online: P(expert b is
  used in layer l two steps later | expert a used now in layer l) (same layer), or in layer
  l-1 now (the previous layer: consecutive layers' routing is correlated).
- near-use: a table learned online, shared by all layers, of P(used within the next 8 steps)
  for each (log2 use count, log2 steps since last use) state; priority = admission = that.
- value: the same states, learning the expected discounted future uses (half-life 8, 16
  steps ahead) instead.
- hl-mix: the mean of normalized heats with half-lives 4, 16, 64.
- hl-select: per layer, the half-life (4, 16, 64) whose normalized heat put the most mass
  on the experts actually used two steps later (ARC-like adaptation of recency/frequency).
- prefetch: heat plus predict() = the hottest non-resident experts (uses the INSERTS budget
  misses leave; admitted only over a colder victim).

Eager-admission candidates (compare_upstream.py): HeatSeenBefore, HeatMargin. Diagnostics
that read the future: PopularityOracle, HeatOracleAdmission.

Issue 37's candidate defaults against upstream's ClassLRU (CLASSLRU_CANDIDATES, compare_upstream.py's
"Candidate defaults against ClassLRU"): ClassLruRule (ClassLRU's own rule in each layer),
ClassHeat (ClassLRU's classes of a long memory times heat), HeatSum (decayed counts at two or
three half-lives, added), HeatMax (their maximum), HeatSumPromptCounts (a prompt's uses counted
per token), with heat's admission test, credited some uses, or without it, at INSERTS 2 or
unlimited; scripts/classlru_search.py sweeps their parameters (CLASSLRU_SEARCH). The same
policies over one pool of slots per group: moecache.offline.pooled. An oracle for a K of its own
for each layer: fitted_slots (layer_hits, fit_slots, hits_at; scripts/classlru_search.py --fitted-slots).
"""

from __future__ import annotations

import numpy as np

from ..core.engine import CacheEngine
from ..core.policies import Belady, DecayedLfu, Heat, NextUse, Policy, make_policy
from ..formats.profile import UsageProfile
from ..formats.traces import RouteTrace, synthetic_routing
from .replay import PerLayerReplay, ReplayResult, simulate
from .upstream import CRF_HALF_LIFE, N_CLASSES

SYNTHETIC = [  # the tables' synthetic locality routing: (label, layers, experts, top-k, options), seeds 3..
    ("8 of 128, sticky", 24, 128, 8, {}),
    ("2 of 64", 24, 64, 2, {"stickiness": 1.0}),
    ("4 of 64, fast drift", 24, 64, 4, {"skew": 0.5, "stickiness": 2.5, "drift": 0.2}),
]
SKEWED = ("2 of 128, skew 1.2", 36, 128, 2, {"skew": 1.2})  # the default candidates' fourth (seed 6)


def synthetic_routings(rows=SYNTHETIC, n_steps: int = 300):
    """(label, seed, routing (n_steps, layers, top-k) ids, n_expert) of each row, seeded 3, 4, ...
    in order."""
    for seed, (label, layers, experts, k, options) in enumerate(rows, start=3):
        yield label, seed, synthetic_routing(n_steps, layers, experts, k, seed=seed, **options), experts


def synthetic_traces(rows=(*SYNTHETIC, SKEWED), expert_bytes: int = 1 << 20):
    """(label, trace) of each synthetic routing, its experts `expert_bytes` each (sizes that keep
    upstream's 128-byte bank alignment out of an equal-bytes comparison)."""
    for label, _, routing, experts in synthetic_routings(rows):
        yield label, RouteTrace.from_routing(routing, experts, expert_bytes=[expert_bytes] * routing.shape[1])


def preloaded_only(trace: RouteTrace, policy: str, slots: int, profile: UsageProfile) -> ReplayResult:
    """A warm start without the prior: the profile's top experts preloaded, the policy's
    statistics left cold (moecache.offline.replay.simulate's profile= does both)."""
    engine = CacheEngine(trace.layers.size, trace.n_expert, slots, make_policy(policy), offline=True)
    engine.preload(profile.top(slots))
    return simulate(trace, PerLayerReplay(engine, prefill="off"))


class PopularityOracle(Policy):
    """Diagnostic, offline: ranks experts by their use count over the WHOLE replay (known up
    front: `ids`, the (steps, layers, k) routing it will see) and admits a miss only over a
    less popular victim. It bounds what learning popularity online could reach; it knows
    nothing about when an expert is used."""
    name = "popularity-oracle"
    offline_only = True
    admits = True

    def __init__(self, ids):
        self.ids = ids

    def bind(self, n_layers, n_expert, n_slots):
        super().bind(n_layers, n_expert, n_slots)
        self.total = UsageProfile.from_ids("", range(n_layers), n_expert, self.ids).counts.astype(float)

    def priority(self, step, keys):
        return self.total.take(keys)

    def admit(self, step, keys):
        return self.total.take(keys)


def log_bucket(x, n):
    """0 -> 0, 1 -> 1, 2-3 -> 2, 4-7 -> 3, ..., capped at n - 1."""
    return np.where(x < 1, 0, np.minimum(np.floor(np.log2(np.maximum(x, 1))) + 1, n - 1)).astype(np.int64)


class ScoreTable(Policy):
    """Base: a full (L, E) score matrix recomputed at each observation."""
    admits = True

    def bind(self, n_layers, n_expert, n_slots):
        super().bind(n_layers, n_expert, n_slots)
        self.S = np.zeros((n_layers, n_expert))

    def priority(self, step, keys):
        return self.S.take(keys)

    def admit(self, step, keys):
        return self.S.take(keys)


class HeatMarkov(ScoreTable):
    def __init__(self, weight=0.5, shift=0, lag=2, half_life=16.0):
        self.weight, self.shift, self.lag, self.g = weight, shift, lag, 2 ** (-1 / half_life)

    def bind(self, n_layers, n_expert, n_slots):
        super().bind(n_layers, n_expert, n_slots)
        self.heat = np.zeros((n_layers, n_expert))
        self.M = np.zeros((n_layers, n_expert, n_expert))
        self.n = np.zeros((n_layers, n_expert))
        self.hist = []

    def observe(self, step, ids, hit_mask, used):
        u = used.astype(float)
        self.heat = self.heat * self.g + u
        self.hist.append(u)
        if len(self.hist) > self.lag:
            src = np.roll(self.hist.pop(0), self.shift, axis=0)  # src[l] = layer l - shift
            self.M += src[:, :, None] * u[:, None, :]
            self.n += src
        P = self.M / np.maximum(self.n, 1)[:, :, None]
        markov = np.einsum("la,lab->lb", np.roll(u, self.shift, axis=0), P)
        self.S = self.heat * (1 - self.g) + self.weight * markov  # both: expected uses per step


class StateTable(ScoreTable):
    """(log2 count, log2 age) states shared by all layers; learns a target per state."""

    def __init__(self, horizon=8, discount_half_life=None, n_count=8, n_age=7, half_life=16.0):
        self.H, self.nc, self.na = horizon, n_count, n_age
        self.g = 2 ** (-1 / half_life)
        self.w = None if discount_half_life is None else 2 ** (-np.arange(horizon) / discount_half_life)

    def bind(self, n_layers, n_expert, n_slots):
        super().bind(n_layers, n_expert, n_slots)
        self.count = np.zeros((n_layers, n_expert))
        self.heat = np.zeros((n_layers, n_expert))
        self.last = np.full((n_layers, n_expert), -10 ** 6)
        self.t, self.states, self.useds = 0, [], []
        self.n = np.zeros(self.nc * self.na)
        self.v = np.zeros(self.nc * self.na)

    def observe(self, step, ids, hit_mask, used):
        self.t += 1
        self.count += used
        self.heat = self.heat * self.g + used
        self.last[used] = self.t
        self.useds.append(used)
        if len(self.useds) > self.H:
            state = self.states.pop(0).ravel()
            if self.w is None:  # used within the next H steps
                target = np.any(self.useds[1:1 + self.H], axis=0)
            else:               # discounted uses over the next H steps
                target = sum(w * u for w, u in zip(self.w, self.useds[1:1 + self.H]))
            self.useds.pop(0)
            self.n += np.bincount(state, minlength=self.n.size)
            self.v += np.bincount(state, weights=target.ravel(), minlength=self.n.size)
        state = log_bucket(self.count, self.nc) * self.na + log_bucket((self.t - self.last).astype(float), self.na)
        self.states.append(state)
        mean = (self.v.sum() + 1e-3) / (self.n.sum() + 1)
        value = (self.v + mean) / (self.n + 1)
        self.S = value[state] + 1e-3 * mean * self.heat / (1 + self.heat)  # heat breaks ties


class HeatMix(ScoreTable):
    def __init__(self, half_lives=(4, 16, 64), select=False, score_half_life=32.0, lag=2):
        self.g = np.array([2 ** (-1 / h) for h in half_lives])
        self.select, self.sg, self.lag = select, 2 ** (-1 / score_half_life), lag

    def bind(self, n_layers, n_expert, n_slots):
        super().bind(n_layers, n_expert, n_slots)
        self.heat = np.zeros((len(self.g), n_layers, n_expert))
        self.score = np.zeros((len(self.g), n_layers))
        self.hist = []

    def observe(self, step, ids, hit_mask, used):
        if len(self.hist) >= self.lag:
            self.score = self.score * self.sg + (self.hist.pop(0) * used[None]).sum(axis=2)
        self.heat = self.heat * self.g[:, None, None] + used[None]
        norm = self.heat / np.maximum(self.heat.sum(axis=2, keepdims=True), 1e-12)
        self.hist.append(norm)
        self.S = norm[self.score.argmax(axis=0), np.arange(self.n_layers)] if self.select else norm.mean(axis=0)


class HeatPrefetch(DecayedLfu):
    name = "heat-prefetch"
    admits = predicts = True

    def __init__(self, width=2):
        super().__init__(16.0)
        self.width = width

    def bind(self, n_layers, n_expert, n_slots):
        super().bind(n_layers, n_expert, n_slots)
        self.resident = np.zeros((n_layers, n_expert), dtype=bool)

    def admit(self, step, keys):
        return self.scaled.take(keys)

    def inserted(self, step, layers, experts, prefetch):
        self.resident[layers, experts] = True

    def evicted(self, step, layers, experts):
        self.resident[layers, experts] = False

    def predict(self, step):
        score = np.where(self.resident, -np.inf, self.scaled)
        top = np.argsort(-score, axis=1)[:, :self.width]
        return np.where(np.take_along_axis(score, top, axis=1) > 0, top, -1)


DEFAULT_CANDIDATES = {  # issue 4: tried against heat as the default, not shipped
    "heat": lambda: make_policy("heat"),
    "markov-same": lambda: HeatMarkov(0.5, shift=0),
    "markov-prev": lambda: HeatMarkov(0.5, shift=1),
    "near-use": lambda: StateTable(horizon=8),
    "value": lambda: StateTable(horizon=16, discount_half_life=8.0),
    "hl-mix": lambda: HeatMix(),
    "hl-select": lambda: HeatMix(select=True),
    "prefetch": lambda: HeatPrefetch(),
}


class HeatSeenBefore(Heat):
    """Candidate: heat whose eager admission refuses an expert whose heat before this use is
    under `threshold` of a fresh use (0.5: not used within about the last half-life),
    TinyLFU's doorkeeper idea: first uses are rarely reused soon on these traces, and each
    refused upload saves host bandwidth."""
    name = "heat-seen-before"

    def __init__(self, threshold: float = 0.5):
        super().__init__()
        self.threshold = threshold

    def worth_if_used(self, step, keys):
        worth = super().worth_if_used(step, keys)
        fresh = self.growth ** (step - self.origin)
        return np.where(self.scaled.take(keys) >= self.threshold * fresh, worth, -np.inf)


class HeatMargin(Heat):
    """Candidate: heat whose eager admission counts the running graph's use at 1 - margin of
    a fresh use, so a miss must beat its victim by `margin` uses. margin 1 hands over heat's
    plain admit() (the count before the use): "stale worth"."""
    name = "heat-margin"

    def __init__(self, margin: float):
        super().__init__()
        self.margin = margin

    def worth_if_used(self, step, keys):
        return self.admit(step, keys) + (1.0 - self.margin) * self.growth ** (step + 1 - self.origin)


class HeatOracleAdmission(Heat):
    """Not a candidate (it reads the future, a NextUse): heat's eviction with an admission that
    uploads a miss only if it is used again within `horizon` observations, to separate what
    admission could save from what eviction loses."""
    name = "heat-oracle-admission"

    def __init__(self, future: NextUse, horizon: int):
        super().__init__()
        self.oracle, self.horizon = Belady(future), horizon

    def bind(self, n_layers, n_expert, n_slots):
        super().bind(n_layers, n_expert, n_slots)
        self.oracle.bind(n_layers, n_expert, n_slots)

    def observe(self, step, ids, hit_mask, used):
        super().observe(step, ids, hit_mask, used)
        self.oracle.observe(step, ids, hit_mask, used)

    def worth_if_used(self, step, keys):
        # the miss is observed next, so "again" is after that observation
        soon = self.oracle.next_use(keys, self.oracle.seen + 1) - self.oracle.seen <= self.horizon
        return np.where(soon, super().worth_if_used(step, keys), -np.inf)


class ClassLruRule(Policy):
    """Candidate: upstream's ClassLRU rule (moecache.offline.upstream.ClassLru) in each layer:
    a CRF (uses decayed with a half-life of CRF_HALF_LIFE steps), class min(floor(log2 CRF), 7)
    as of the last use, evict the largest age / 2^class; every miss admitted."""
    name = "classlru-rule"

    def bind(self, n_layers, n_expert, n_slots):
        super().bind(n_layers, n_expert, n_slots)
        self.crf = np.zeros((n_layers, n_expert))
        self.last = np.zeros((n_layers, n_expert))
        self.scale = np.ones((n_layers, n_expert))  # 2^class

    def observe(self, step, ids, hit_mask, used):
        np.putmask(self.crf, used, self.crf * 2.0 ** ((self.last - step) / CRF_HALF_LIFE) + 1.0)
        np.putmask(self.last, used, step)
        self.scale = 2.0 ** np.minimum(np.floor(np.log2(np.maximum(self.crf, 1.0))), N_CLASSES - 1)

    def priority(self, step, keys):
        return (self.last.take(keys) - step) / self.scale.take(keys)


class DecayedCounts(Policy):
    """Base: each expert's uses decayed at several half-lives, as uses per step (a count times
    1 - decay), combined by score(); every miss admitted."""

    def __init__(self, half_lives):
        self.decay = np.array([2.0 ** (-1.0 / h) for h in half_lives])

    def bind(self, n_layers, n_expert, n_slots):
        super().bind(n_layers, n_expert, n_slots)
        self.rates = np.zeros((len(self.decay), n_layers, n_expert))
        self.S = self.score(self.rates)

    def observe(self, step, ids, hit_mask, used):
        self.rates *= self.decay[:, None, None]
        self.rates += (1.0 - self.decay)[:, None, None] * used
        self.S = self.score(self.rates)

    def priority(self, step, keys):
        return self.S.take(keys)

    def if_used(self) -> np.ndarray:
        """(L, E) each expert's score with one more use counted (compared with the residents'
        scores of the same moment)."""
        return self.score(self.rates + (1.0 - self.decay)[:, None, None])


class HeatSum(DecayedCounts):
    """Candidate: a short and a long memory added: sum of weight x rate at each half-life. Its
    score is linear in uses, so the miss planner can price an upload in them (counts_uses)."""
    name = "heat-sum"
    counts_uses = True

    def __init__(self, half_lives=(10, 64), weights=(1.0, 2.0)):
        super().__init__(half_lives)
        self.weights = np.array(weights, dtype=float)

    def score(self, rates):
        return np.tensordot(self.weights, rates, 1)

    def use_worth(self, step):
        return float(self.weights @ (1.0 - self.decay))


class HeatMax(DecayedCounts):
    """Candidate: the larger of weight x rate at each half-life: an expert is kept by whichever
    memory, short or long, values it more."""
    name = "heat-max"

    def __init__(self, half_lives=(10, 64), weights=(1.0, 2.0)):
        super().__init__(half_lives)
        self.weights = np.array(weights, dtype=float)

    def score(self, rates):
        return np.max(self.weights[:, None, None] * rates, axis=0)


class HeatSumPromptCounts(HeatSum):
    """Candidate: heat-sum counting an observation's uses per token, at most `cap` an expert (a
    decode token's are the same; a prompt's weigh by how many of its tokens selected each)."""
    name = "heat-sum-prompt-counts"

    def __init__(self, half_lives=(10, 64), weights=(1.0, 2.0), cap: float = 2.0):
        super().__init__(half_lives, weights)
        self.cap = cap

    def observe(self, step, ids, hit_mask, used):
        counts = np.zeros(used.size)
        np.add.at(counts, (np.arange(used.shape[0])[:, None] * used.shape[1] + ids)[ids >= 0], 1.0)
        self.rates *= self.decay[:, None, None]
        self.rates += (1.0 - self.decay)[:, None, None] * np.minimum(counts, self.cap).reshape(used.shape)
        self.S = self.score(self.rates)


class ClassHeat(DecayedCounts):
    """Candidate: ClassLRU's classes of a long memory (half-life `long`, CRF_HALF_LIFE as
    upstream) times heat's short one (half-life `short`): class min(floor(log_base CRF),
    n_classes - 1) and score heat x base^class, so a frequent expert's class protects it and
    recency (heat) orders it within its class."""
    name = "class-heat"

    def __init__(self, short: float = 16.0, long: float = CRF_HALF_LIFE, n_classes: int = N_CLASSES,
                 base: float = 2.0):
        super().__init__((short, long))
        self.n_classes, self.base = n_classes, base

    def score(self, rates):
        count = rates[1] / (1.0 - self.decay[1])  # the CRF, in uses
        level = np.floor(np.log2(np.maximum(count, 1.0)) / np.log2(self.base))
        return rates[0] * self.base ** np.minimum(level, self.n_classes - 1)


class HeatSumAdmission(HeatSum):
    """Candidate: heat-sum with heat's admission test: a miss is uploaded only over a victim
    whose score is below the miss's with this use counted and `credit` more uses."""
    name = "heat-sum-admission"
    admits = True

    def __init__(self, half_lives=(10, 64), weights=(1.0, 2.0), credit: float = 0.0):
        super().__init__(half_lives, weights)
        self.credit = credit

    def admit(self, step, keys):
        return self.S.take(keys)

    def worth_if_used(self, step, keys):
        return self.if_used().take(keys) + self.credit * self.use_worth(step)


class ClassHeatAdmission(ClassHeat):
    """Candidate: class x heat with heat's admission test (the miss's score with this use counted
    against its victim's)."""
    name = "class-heat-admission"
    admits = True

    def admit(self, step, keys):
        return self.S.take(keys)

    def worth_if_used(self, step, keys):
        return self.if_used().take(keys)


CLASSLRU_CANDIDATES = [  # issue 37: (label, policy factory, inserts), eager, prompt warm
    ("heat (today's default)", lambda: make_policy("heat"), 2),
    ("heat, unlimited inserts", lambda: make_policy("heat"), None),
    ("heat, a miss credited 1 more use", lambda: HeatMargin(-1.0), 2),
    ("heat, a miss credited 2 more uses", lambda: HeatMargin(-2.0), 2),
    ("lfu (half-life 32, no admission test)", lambda: make_policy("lfu"), 2),
    ("lfu, unlimited inserts", lambda: make_policy("lfu"), None),
    ("lru, unlimited inserts", lambda: make_policy("lru"), None),
    ("ClassLRU's rule per layer", ClassLruRule, 2),
    ("ClassLRU's rule per layer, unlimited inserts", ClassLruRule, None),
    ("class x heat, heat's admission test, unlimited", ClassHeatAdmission, None),
    ("class x heat, unlimited inserts", ClassHeat, None),
    ("heat-sum 10+64 (1:2)", HeatSum, 2),
    ("heat-sum 10+64 (1:2), heat's admission test, unlimited", HeatSumAdmission, None),
    ("heat-sum 8+64 (1:2), admission test with 2 uses' credit, unlimited",
     lambda: HeatSumAdmission((8, 64), (1.0, 2.0), credit=2.0), None),
    ("heat-sum 16+64 (1:0.5), unlimited inserts", lambda: HeatSum((16, 64), (1.0, 0.5)), None),
    ("heat-sum 8+64 (1:2), unlimited inserts", lambda: HeatSum((8, 64), (1.0, 2.0)), None),
    ("heat-sum 10+64 (1:2), unlimited inserts", HeatSum, None),
    ("heat-sum 10+64 (1:2), admission test with 4 uses' credit, unlimited",
     lambda: HeatSumAdmission(credit=4.0), None),
    ("heat-sum 10+40+160 (1:0.5:2), unlimited inserts", lambda: HeatSum((10, 40, 160), (1.0, 0.5, 2.0)), None),
    ("heat-max 10+64 (1:2), unlimited inserts", HeatMax, None),
    ("class x heat, long memory 64, unlimited inserts", lambda: ClassHeat(long=64.0), None),
    ("lfu half-life 24, unlimited inserts", lambda: make_policy("lfu", half_life=24), None),
    ("heat-sum 10+64 (1:2), a prompt's uses per token (at most 2), unlimited", HeatSumPromptCounts, None),
]


def layer_hits(trace: RouteTrace, k: int, replay_of, span: int | None = None):
    """Each layer replayed alone (`replay_of(slots)`, a PerLayerReplay: its rules are per layer,
    so the layers' hits add up to the whole replay's) at every K within `span` of k (default
    k/2, at least 4). Returns those Ks, the decode hits (n_layers, len(Ks)) and the lookups."""
    span = max(4, k // 2) if span is None else span
    ks = np.arange(max(1, k - span), min(trace.n_expert, k + span) + 1)
    hits = np.zeros((len(trace.layers), len(ks)))
    lookups = 0
    for i in range(len(trace.layers)):
        alone = trace.layer(i)
        for j, slots in enumerate(ks):
            totals = simulate(alone, replay_of(int(slots))).totals
            hits[i, j] = totals["hits"]
        lookups += totals["hits"] + totals["misses"]
    return ks, hits, lookups


def fit_slots(ks: np.ndarray, hits: np.ndarray, k: int, expert_bytes: np.ndarray) -> np.ndarray:
    """The K of each layer (from layer_hits' Ks) that gets the most of `hits`, the layers of each
    bank (one expert size) sharing that bank's k slots a layer: the same device bytes."""
    fitted = np.full(len(expert_bytes), k)
    for size in np.unique(expert_bytes):
        bank = np.flatnonzero(expert_bytes == size)
        fitted[bank] = ks[_share(hits[bank], len(bank) * (k - ks[0]))]
    return fitted


def fitted_slots(trace: RouteTrace, k: int, replay_of, span: int | None = None):
    """Not a candidate (it reads the whole trace): the most decode hits K slots per layer on
    average could give if each layer had its own K, fitted to this trace (exactly, within
    layer_hits' span). Returns the decode hit rates at k slots per layer and at the fitted
    ones, and the fitted K of each layer."""
    ks, hits, lookups = layer_hits(trace, k, replay_of, span)
    slots = fit_slots(ks, hits, k, trace.expert_bytes)
    return hits_at(ks, hits, k) / lookups, hits_at(ks, hits, slots) / lookups, slots


def hits_at(ks: np.ndarray, hits: np.ndarray, slots) -> float:
    """layer_hits' hits summed over the layers, each at its K in `slots` (one K for all, or one each)."""
    slots = np.broadcast_to(slots, hits.shape[:1])
    return float(hits[np.arange(len(slots)), slots - ks[0]].sum())


def _share(gains: np.ndarray, total: int) -> np.ndarray:
    """The column of each row of `gains` (one row a layer, column j: j slots over the least)
    whose sum over rows is `total` and whose gains add up to the most."""
    n_rows, n_cols = gains.shape
    best = np.full((n_rows + 1, total + 1), -np.inf)
    best[0, 0] = 0.0
    choice = np.zeros((n_rows, total + 1), dtype=np.int64)
    for r in range(n_rows):
        for used in range(total + 1):
            options = [best[r, used - j] + gains[r, j] for j in range(min(n_cols, used + 1))]
            choice[r, used] = int(np.argmax(options))
            best[r + 1, used] = options[choice[r, used]]
    columns, used = np.zeros(n_rows, dtype=np.int64), total
    for r in reversed(range(n_rows)):
        columns[r] = choice[r, used]
        used -= columns[r]
    return columns


def _search():
    """CLASSLRU_SEARCH: (family, [(label, policy factory, inserts), ...]) of each family's settings."""
    inserts = {2: "INSERTS 2", 4: "INSERTS 4", None: "unlimited"}
    pairs = [(h1, h2) for h1 in (4, 8, 10, 16) for h2 in (32, 64, 128, 256)]
    triples = [(4, 16, 128), (8, 32, 128), (8, 16, 64), (4, 32, 256), (6, 24, 96), (10, 40, 160), (8, 64, 256),
               (12, 48, 256)]
    triple_weights = [(1, 1, 1), (1, 1, 2), (1, 2, 2), (1, 2, 4), (1, 0.5, 2), (1, 1, 4), (2, 1, 1), (1, 4, 2)]
    return [
        ("heat-sum, two half-lives", [
            (f"{h1}+{h2} (1:{w:g}), {inserts[n]}", lambda h=(h1, h2), w=w: HeatSum(h, (1.0, w)), n)
            for h1, h2 in pairs for w in (0.5, 1, 2, 4) for n in (2, 4, None)]),
        ("heat-sum, three half-lives, unlimited", [
            (f"{'+'.join(map(str, h))} ({':'.join(f'{x:g}' for x in w)})", lambda h=h, w=w: HeatSum(h, w), None)
            for h in triples for w in triple_weights]),
        ("heat-sum with heat's admission test credited c uses", [
            (f"{h1}+64 (1:2), c {c:g}, {inserts[n]}",
             lambda h=(h1, 64), c=c: HeatSumAdmission(h, (1.0, 2.0), credit=c), n)
            for h1 in (8, 10) for c in (0, 1, 2, 3, 4, 6, 8) for n in (2, None)]),
        ("class x heat, unlimited", [
            (f"short {s}, long {lg}, {nc} classes, base {b:g}", lambda s=s, lg=lg, nc=nc, b=b: ClassHeat(s, lg, nc, b),
             None)
            for s in (8, 16) for lg in (64, 128, 256) for nc in (4, 8) for b in (2.0, 4.0)]),
        ("heat-max, unlimited", [
            (f"{h[0]}+{h[1]} (1:{w:g})", lambda h=h, w=w: HeatMax(h, (1.0, w)), None)
            for h in ((8, 64), (10, 64), (8, 128)) for w in (1, 2, 4)]),
        ("lfu (decayed counts, no admission test), unlimited", [
            (f"half-life {h}", lambda h=h: make_policy("lfu", half_life=h), None) for h in (16, 24, 32, 48, 64)]),
        ("heat-sum 10+64 (1:2) and 8+64 (1:2), a prompt's uses per token, unlimited", [
            (f"{h[0]}+64, at most {c:g}", lambda h=h, c=c: HeatSumPromptCounts(h, (1.0, 2.0), cap=c), None)
            for h in ((10, 64), (8, 64)) for c in (2, 4, 8, 1000)]),
    ]


CLASSLRU_SEARCH = _search()  # issue 37: scripts/classlru_search.py
