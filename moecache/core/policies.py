"""Eviction/admission policies for the per-layer expert cache (see docs/policies.md).

The engine (moecache.core.engine.CacheEngine) owns slots and the one-step publication delay; a
policy only ranks experts. Interface, all arrays indexed by the engine's layer index:

    bind(n_layers, n_expert, n_slots)          allocate state; called once by the engine
    observe(step, ids, hit_mask, used)         the step's selections: ids (L, n) int, -1 =
                                               none; hit_mask like ids; used (L, E) bool
    priority(step, keys) -> float              keys = layer * n_expert + expert, any shape
                                               (junk where a slot is empty: ignored); the
                                               LOWEST evictable resident is evicted
    inserted(step, layers, experts, prefetch)  uploads just issued (1-d arrays)
    evicted(step, layers, experts)             victims just unpublished (1-d arrays)

Optional, each behind a capability the policy's class declares (a class attribute of Policy,
read by the engine and anything else that must know what a policy can do):

    admits: admit(step, keys) -> float         worth of a missed (or predicted) expert in
                                               priority units: it is uploaded only into a free
                                               slot or over a victim of strictly lower
                                               priority; -inf refuses. Also orders the misses
                                               when more than INSERTS compete (else rank order)
      worth_if_used(step, keys) -> float       eager admission (moecache.core.admission): the admit()
                                               worth a miss in the graph about to run will have
                                               once that use is observed (at step + 1); by
                                               default admit(). A policy that does not admit
                                               hands over +inf
    not ranks_residents:                       queue-based policies, which have no priority:
      choose_victims(step, layer, candidates, n) up to n experts to evict from `candidates`
                                               (evictable residents)
    predicts: predict(step) -> (L, p) int      experts to prefetch, best first, -1 padded,
                                               uploaded with the INSERTS budget the misses left
    takes_prior: prior(rates)                  before the first step: (L, E) uses per step
                                               from earlier runs (a usage profile) to start
                                               the policy's statistics from
    counts_uses: use_worth(step) -> float      the priority units of one use observed at
                                               `step`: worth and priority count expected uses
                                               (what an upload must pay back, moecache.core.missplan)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .lru import LruOrder


class Policy:
    name = "policy"
    offline_only = False  # needs the future observations (make_policy's future=)
    seeded = False        # takes make_policy's seed=
    # capabilities (see the module docstring); each class sets what it can do
    ranks_residents = True  # priority() orders the residents; False: choose_victims() picks them
    admits = False          # admit() values a miss against its victim (an admission test)
    predicts = False        # predict() names experts to prefetch
    takes_prior = False     # prior() starts the statistics from a usage profile
    counts_uses = False     # use_worth() converts priorities to expected uses

    def bind(self, n_layers: int, n_expert: int, n_slots: int) -> None:
        self.n_layers, self.n_expert, self.n_slots = n_layers, n_expert, n_slots

    def observe(self, step, ids, hit_mask, used) -> None:
        pass

    def priority(self, step, keys) -> np.ndarray:
        raise NotImplementedError

    def inserted(self, step, layers, experts, prefetch) -> None:
        pass

    def evicted(self, step, layers, experts) -> None:
        pass

    def worth_if_used(self, step, keys) -> np.ndarray:
        """Eager admission's worth of a miss (a policy that admits): admit() unless the
        policy counts the use about to be observed."""
        return self.admit(step, keys)


class Lru(Policy):
    """Evict the expert whose last use is oldest."""
    name = "lru"

    def bind(self, n_layers, n_expert, n_slots):
        super().bind(n_layers, n_expert, n_slots)
        self.last_use = np.zeros((n_layers, n_expert))

    def observe(self, step, ids, hit_mask, used):
        np.putmask(self.last_use, used, step)  # a masked copyto or ufunc costs more at this size

    def priority(self, step, keys):
        return self.last_use.take(keys)


class DecayedLfu(Policy):
    """Evict the lowest exponentially decayed use count (half-life in steps). History
    survives eviction. Counts are kept scaled by growth**step so that decaying is free: all
    scores share the factor, so their order is the order of the decayed counts."""
    name = "lfu"
    takes_prior = True
    counts_uses = True  # a decayed count is the uses expected over the next 1 / (1 - decay) steps

    def __init__(self, half_life: float = 32.0):
        if half_life <= 0:
            raise ValueError(f"half_life must be > 0, got {half_life}")
        self.growth = 2.0 ** (1.0 / half_life)

    def bind(self, n_layers, n_expert, n_slots):
        super().bind(n_layers, n_expert, n_slots)
        self.scaled = np.zeros((n_layers, n_expert))
        self.origin = 0  # step whose weight is 1

    def _weight(self, step):
        weight = self.growth ** (step - self.origin)
        if weight > 1e200:  # rebase before float overflow
            self.scaled *= self.growth ** (self.origin - step)
            self.origin = step
            weight = 1.0
        return weight

    def observe(self, step, ids, hit_mask, used):
        weight = self._weight(step)  # first: it may rebase `scaled`
        np.putmask(self.scaled, used, self.scaled + weight)  # cheaper than a masked add at this size

    def priority(self, step, keys):
        return self.scaled.take(keys)

    def use_worth(self, step):
        """The scaled weight of one use observed at `step` (no rebase: handed-over worths keep
        their scale)."""
        return self.growth ** (step - self.origin)

    def prior(self, rates):
        """Start from the decayed count an expert used at these rates through an endless
        history before the first step would have (rate x the decay series' sum): earlier runs
        weigh like a long history, which the run's own uses replace at the half-life."""
        self.scaled[:] = rates / (self.growth - 1.0)  # the first step's weight is 1


class Heat(DecayedLfu):
    """The shipped default: decayed frequency ("heat", half-life 16 steps) for eviction, plus
    admission by comparison. A miss is uploaded only into a free slot or over a victim whose
    heat is strictly lower, and competing misses go hottest first. Routing in decode is
    popularity-dominated (an expert's past use count predicts its next use better than its
    recency), so a one-off expert must not push out a popular one; the short half-life lets
    the estimate follow topic drift. One parameter, not tuned per model."""
    name = "heat"
    admits = True

    def __init__(self, half_life: float = 16.0):
        super().__init__(half_life)

    def admit(self, step, keys):
        return self.scaled.take(keys)

    def worth_if_used(self, step, keys):
        # the use is observed at step + 1 with that step's weight; no rebase here, so the
        # residents' priorities handed over with these worths keep their scale
        return self.scaled.take(keys) + self.use_worth(step + 1)


class Gdsf(Policy):
    """GreedyDual-Size-Frequency per layer: priority = floor at admission + uses since. The
    floor rises to each victim's priority, so experts that stop being used age out. Size and
    refetch cost are equal within a layer and eviction is per layer, so they drop out."""
    name = "gdsf"

    def bind(self, n_layers, n_expert, n_slots):
        super().bind(n_layers, n_expert, n_slots)
        self.floor = np.zeros(n_layers)
        self.value = np.zeros((n_layers, n_expert))

    def observe(self, step, ids, hit_mask, used):
        np.putmask(self.value, used, self.value + 1.0)

    def priority(self, step, keys):
        return self.value.take(keys)

    def inserted(self, step, layers, experts, prefetch):
        self.value[layers, experts] = self.floor[layers] + (0.0 if prefetch else 1.0)

    def evicted(self, step, layers, experts):
        np.maximum.at(self.floor, layers, self.value[layers, experts])


class RandomEviction(Policy):
    """Evict a uniformly random evictable resident (seeded, reproducible)."""
    name = "random"
    seeded = True

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)

    def priority(self, step, keys):
        return self.rng.random(np.shape(keys))


@dataclass(frozen=True)
class NextUse:
    """When each key (layer * n_expert + expert) is used next over the steps a cache will
    take: what the offline optima (Belady here, the global model's in moecache.offline.budget)
    read ahead. The replay's trace adapter computes it (moecache.offline.steps.future)."""

    first: np.ndarray           # (n_keys,) each key's first step; +inf: never used
    keys: list[np.ndarray]      # per step: the distinct keys it uses, ascending
    after: list[np.ndarray]     # per step, for each of its keys: the next step using it, or +inf

    def __len__(self) -> int:
        return len(self.keys)


class Belady(Policy):
    """Offline optimum (MIN) adapted to the engine's timing: evict the resident whose next use
    is furthest away, admit a miss only if it is needed again before that victim. `future`:
    the NextUse of the observations the engine will see, in order."""
    name = "belady"
    offline_only = True
    admits = True

    def __init__(self, future: NextUse):
        self.future = future

    def bind(self, n_layers, n_expert, n_slots):
        super().bind(n_layers, n_expert, n_slots)
        if self.future.first.size != n_layers * n_expert:
            raise ValueError(f"belady: the future's {self.future.first.size} keys differ from the "
                             f"engine's {n_layers} x {n_expert}")
        self.next_of = self.future.first.copy()  # each key's next use from the current observation on
        self.seen = 0                            # observations consumed

    def observe(self, step, ids, hit_mask, used):
        keys = np.flatnonzero(used.ravel())
        if self.seen >= len(self.future) or not np.array_equal(keys, self.future.keys[self.seen]):
            raise ValueError(f"belady: observation {self.seen} differs from the future it was given")
        self.next_of[keys] = self.future.after[self.seen]
        self.seen += 1

    def next_use(self, keys, after):
        """The observation index at which each key is next used, from `after` on (at most the
        one after the current); +inf: never again."""
        t = self.next_of[keys]
        now = t < after  # used by the current observation, which `after` has passed
        if now.any():
            current = self.future.keys[self.seen]
            t[now] = self.future.after[self.seen][np.searchsorted(current, np.asarray(keys)[now])]
        return t

    def priority(self, step, keys):
        # eviction unpublishes now, so losing the victim hurts from the next graph on
        return -self.next_use(keys, self.seen)

    def admit(self, step, keys):
        # an upload issued now is usable one graph later
        return -self.next_use(keys, self.seen + 1)


class Arc(Policy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST'03) per layer: T1 holds experts seen
    once recently, T2 those seen at least twice; ghost lists B1/B2 remember recent victims
    and steer the target size p of T1. Queue-based, so victims are chosen per layer."""
    name = "arc"
    ranks_residents = False

    def bind(self, n_layers, n_expert, n_slots):
        super().bind(n_layers, n_expert, n_slots)
        self.t1 = [LruOrder() for _ in range(n_layers)]
        self.t2 = [LruOrder() for _ in range(n_layers)]
        self.b1 = [LruOrder() for _ in range(n_layers)]
        self.b2 = [LruOrder() for _ in range(n_layers)]
        self.p = [0.0] * n_layers

    def observe(self, step, ids, hit_mask, used):
        for layer, experts in enumerate(ids.tolist()):
            t1, t2 = self.t1[layer], self.t2[layer]
            for e in experts:
                if e in t1:
                    t1.remove(e)
                    t2.use(e)
                elif e in t2:
                    t2.use(e)

    def inserted(self, step, layers, experts, prefetch):
        c = self.n_slots
        for layer, e in zip(layers.tolist(), experts.tolist()):
            b1, b2 = self.b1[layer], self.b2[layer]
            if e in b1:
                self.p[layer] = min(c, self.p[layer] + max(len(b2) / len(b1), 1.0))
                b1.remove(e)
                self.t2[layer].use(e)
            elif e in b2:
                self.p[layer] = max(0.0, self.p[layer] - max(len(b1) / len(b2), 1.0))
                b2.remove(e)
                self.t2[layer].use(e)
            else:
                self.t1[layer].use(e)

    def evicted(self, step, layers, experts):
        c = self.n_slots
        for layer, e in zip(layers.tolist(), experts.tolist()):
            if e in self.t1[layer]:
                self.t1[layer].remove(e)
                self.b1[layer].use(e)
            else:
                self.t2[layer].remove(e)
                self.b2[layer].use(e)
            b1, b2 = self.b1[layer], self.b2[layer]
            while len(b1) > c:
                b1.pop_oldest()
            while len(b1) + len(b2) > 2 * c and b2:
                b2.pop_oldest()

    def choose_victims(self, step, layer, candidates, n):
        allowed = set(candidates.tolist())
        t1 = [e for e in self.t1[layer] if e in allowed]
        t2 = [e for e in self.t2[layer] if e in allowed]
        victims = []
        size_t1 = len(self.t1[layer])
        while len(victims) < n and (t1 or t2):
            take_t1 = t1 and (size_t1 > self.p[layer] or not t2)
            victims.append(t1.pop(0) if take_t1 else t2.pop(0))
            size_t1 -= bool(take_t1)
        return victims


class Sieve(Policy):
    """SIEVE (Zhang et al., NSDI'24) per layer: a FIFO with a visited bit; the hand walks from
    the oldest entry, clearing bits, and evicts the first unvisited expert. Hits only set a
    bit (no queue move), which is what makes it cheap and scan-resistant."""
    name = "sieve"
    ranks_residents = False

    def bind(self, n_layers, n_expert, n_slots):
        super().bind(n_layers, n_expert, n_slots)
        self.visited = np.zeros((n_layers, n_expert), dtype=bool)
        self.queue = [[] for _ in range(n_layers)]  # oldest first
        self.hand = [0] * n_layers

    def observe(self, step, ids, hit_mask, used):
        self.visited |= used

    def inserted(self, step, layers, experts, prefetch):
        self.visited[layers, experts] = False
        for layer, e in zip(layers.tolist(), experts.tolist()):
            self.queue[layer].append(e)

    def evicted(self, step, layers, experts):
        for layer, e in zip(layers.tolist(), experts.tolist()):
            queue = self.queue[layer]
            i = queue.index(e)
            del queue[i]
            if i < self.hand[layer]:
                self.hand[layer] -= 1

    def choose_victims(self, step, layer, candidates, n):
        allowed = set(candidates.tolist())
        queue, visited = self.queue[layer], self.visited[layer]
        victims, hand, looked = [], self.hand[layer], 0
        # two passes suffice: the first clears every bit it passes
        while len(victims) < n and looked < 2 * len(queue):
            hand %= len(queue)
            e = queue[hand]
            if e in allowed and e not in victims:
                if visited[e]:
                    visited[e] = False
                else:
                    victims.append(e)
            hand += 1
            looked += 1
        self.hand[layer] = hand
        return victims


POLICIES: dict[str, Callable[..., Policy]] = {
    "lru": Lru,
    "lfu": DecayedLfu,
    "gdsf": Gdsf,
    "random": RandomEviction,
    "belady": Belady,
    "arc": Arc,
    "sieve": Sieve,
    "heat": Heat,
}
DEFAULT_POLICY = "heat"


def resolve_policy(name: str) -> str:
    """The registry name a policy name stands for: "default" is DEFAULT_POLICY."""
    return DEFAULT_POLICY if name == "default" else name


def make_policy(name: str, *, future=None, seed: int = 0, **params) -> Policy:
    """Build a policy by name (see resolve_policy). future: the NextUse an offline policy
    (belady) reads ahead; seed: the random policy's; each goes only to the policies that use it.
    params: the policy's own (e.g. half_life)."""
    name = resolve_policy(name)
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; valid: {', '.join(['default', *POLICIES])}")
    factory = POLICIES[name]
    if factory.offline_only:
        if future is None:
            raise ValueError(f"policy {name!r} needs the future routing: offline replay only")
        params["future"] = future
    if factory.seeded:
        params["seed"] = seed
    return factory(**params)
