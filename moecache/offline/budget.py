"""The global byte-budget cache model (BigMoeOnEdge's route replay), offline only.

One cache over (layer, expert) entries under a byte budget: immediate admission, no insert
limit, eviction after each batch sparing the batch's own experts. A batch is one layer's
lookups (a turn's whole prefill, or one decode token); one lookup per distinct expert per
batch. Keys are layer index * n_expert + expert.

Its policies rank the resident keys of one global set (or of one layer's share of the
budget), one victim at a time, where the per-layer policies (moecache.core.policies) rank K
slots per layer for an engine with an insert limit: the same rule (LRU, random, Belady) is
a different algorithm there, so each model has its own, and the names here say "Budget".
Registry names mean one thing across both registries: this model's LFU counts plain uses
("plain-lfu"), the per-layer "lfu" decays them. Interface (BUDGET_POLICIES):

    bind(n_parts)                   allocate state
    admitted(part, key)             a missed key was just read in
    accessed(part, keys, touched)   after a batch's lookups: its keys in lookup order
                                    (repeats included) and `touched`, the distinct ones
    victim(part, touched) -> key    the next key to evict from partition `part`, never one
                                    in `touched`; None when nothing is evictable
    dropped(part, key)              the victim is gone
    evictions_done(part)            the batch's evictions are over

`part` is 0, or the layer for a partitioned policy (each layer gets an equal share of the
budget and evicts only within itself). The offline optimum reads ahead from the NextUse of
the batches (moecache.offline.steps.future), given to make_budget_policy.
"""

from __future__ import annotations

import heapq
import random
from typing import Callable

from ..core.lru import LruOrder
from ..core.model import CacheModel
from ..core.policies import NextUse


class BudgetPolicy:
    name = "policy"
    partitioned = False
    seeded = False
    offline_only = False  # reads ahead: make_budget_policy's future=

    def bind(self, n_parts: int) -> None:
        pass

    def admitted(self, part, key) -> None:
        pass

    def accessed(self, part, keys, touched) -> None:
        pass

    def victim(self, part, touched):
        raise NotImplementedError

    def dropped(self, part, key) -> None:
        pass

    def evictions_done(self, part) -> None:
        pass


class BudgetLru(BudgetPolicy):
    """Evict the key whose last lookup is oldest (lookup order within a batch)."""
    name = "lru"

    def bind(self, n_parts):
        self.recency = [LruOrder() for _ in range(n_parts)]

    def accessed(self, part, keys, touched):
        self.recency[part].use_all(keys)

    def victim(self, part, touched):
        return self.recency[part].oldest(spared=touched)  # the batch's own keys sit at the young end

    def dropped(self, part, key):
        self.recency[part].remove(key)


class BudgetLayerLru(BudgetLru):
    """LRU partitioned by layer."""
    name = "layer-lru"
    partitioned = True


class _LazyHeap(BudgetPolicy):
    """Victims from a min-heap per partition of (rank..., key) entries. Updating a key only
    pushes a new entry: an entry counts while it is its key's latest (`self.latest`), so
    stale ones are skipped when popped."""

    def bind(self, n_parts):
        self.heaps = [[] for _ in range(n_parts)]
        self.latest = {}    # resident key -> its current entry
        self.spared = []    # popped entries of the batch's own keys: pushed back afterwards

    def push(self, part, entry):
        self.latest[entry[-1]] = entry
        heapq.heappush(self.heaps[part], entry)

    def victim(self, part, touched):
        heap = self.heaps[part]
        while heap:
            entry = heapq.heappop(heap)
            key = entry[-1]
            if self.latest.get(key) is not entry:
                continue
            if key in touched:
                self.spared.append(entry)
                continue
            return key
        return None

    def dropped(self, part, key):
        del self.latest[key]

    def evictions_done(self, part):
        for entry in self.spared:
            heapq.heappush(self.heaps[part], entry)
        self.spared.clear()


class BudgetPlainLfu(_LazyHeap):
    """Evict the fewest batches used in, counted plainly (no decay; history survives
    eviction), then the oldest lookup."""
    name = "plain-lfu"

    def bind(self, n_parts):
        super().bind(n_parts)
        self.uses, self.last = {}, {}
        self.clock = 0  # one tick per lookup

    def accessed(self, part, keys, touched):
        last, clock = self.last, self.clock
        for key in keys:
            clock += 1
            last[key] = clock
        self.clock = clock
        uses = self.uses
        for key in touched:
            uses[key] = uses.get(key, 0) + 1
            self.push(part, (uses[key], last[key], key))


class BudgetLayerPlainLfu(BudgetPlainLfu):
    """Plain LFU partitioned by layer."""
    name = "layer-plain-lfu"
    partitioned = True


class BudgetBelady(_LazyHeap):
    """Offline optimum: evict the key used again furthest ahead (never again first), then the
    earliest admitted. `future`: the NextUse of the batches the cache will see."""
    name = "belady"
    offline_only = True

    def __init__(self, future: NextUse):
        self.future = future

    def bind(self, n_parts):
        super().bind(n_parts)
        self.seen = 0
        self.admissions = 0
        self.admitted_as = {}  # key -> its admission number

    def admitted(self, part, key):
        self.admitted_as[key] = self.admissions
        self.admissions += 1

    def accessed(self, part, keys, touched):
        b = self.seen
        expected = self.future.keys[b].tolist() if b < len(self.future) else None
        if sorted(touched) != expected:
            raise ValueError(f"belady: batch {b} differs from the batches it was given")
        self.seen += 1
        upcoming = dict(zip(expected, self.future.after[b].tolist()))
        for key in touched:
            self.push(part, (-upcoming[key], self.admitted_as[key], key))


class BudgetRandom(BudgetPolicy):
    """Evict a uniformly random resident key outside the batch (seeded, reproducible; its
    own generator and sampling, so it draws other victims than the per-layer "random")."""
    name = "random"
    seeded = True

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def bind(self, n_parts):
        self.members = []    # resident keys
        self.position = {}   # key -> index in members

    def admitted(self, part, key):
        self.position[key] = len(self.members)
        self.members.append(key)

    def victim(self, part, touched):
        members = self.members
        if len(touched) * 2 < len(members):  # mostly untouched: rejection sampling
            while True:
                key = members[self.rng.randrange(len(members))]
                if key not in touched:
                    return key
        candidates = [key for key in members if key not in touched]
        return self.rng.choice(candidates) if candidates else None

    def dropped(self, part, key):
        position = self.position.pop(key)
        last = self.members.pop()
        if last != key:
            self.members[position] = last
            self.position[last] = position


BUDGET_POLICIES: dict[str, Callable[..., BudgetPolicy]] = {
    policy.name: policy for policy in (BudgetLru, BudgetPlainLfu, BudgetRandom, BudgetBelady,
                                       BudgetLayerLru, BudgetLayerPlainLfu)}


def make_budget_policy(name: str, *, future: NextUse | None = None, seed: int = 0) -> BudgetPolicy:
    """Build a global-model policy by name. future: what the offline optimum (belady) reads
    ahead; seed: the random policy's; each goes only to the policies that use it."""
    if name not in BUDGET_POLICIES:
        raise ValueError(f"unknown policy {name!r} for the global model; valid: "
                         f"{', '.join(BUDGET_POLICIES)}")
    factory = BUDGET_POLICIES[name]
    if factory.offline_only:
        if future is None:
            raise ValueError(f"policy {name!r} needs the batches ahead (future=)")
        return factory(future)
    return factory(seed=seed) if factory.seeded else factory()


class ByteBudgetCache(CacheModel):
    """Resident (layer, expert) keys under `budget_bytes`, run one batch per step(). Its
    counters have CacheEngine.stats()'s names; uploads are the reads of missed experts."""

    def __init__(self, policy: BudgetPolicy, budget_bytes: int, expert_bytes, n_expert: int):
        n_layers = len(expert_bytes)
        self.policy = policy
        self.partitioned = policy.partitioned
        self.budget = budget_bytes // n_layers if self.partitioned else budget_bytes
        self.expert_bytes = [int(b) for b in expert_bytes]
        self.n_expert = n_expert
        self.used_bytes = [0] * (n_layers if self.partitioned else 1)
        self.resident = set()
        self.counters = dict.fromkeys(("hits", "misses", "uploads", "evictions", "upload_bytes"), 0)
        self.step_index = 0
        policy.bind(len(self.used_bytes))

    def step(self, batch) -> None:
        """batch: (layer index, keys in lookup order)."""
        layer, keys = batch
        self.step_index += 1
        part = layer if self.partitioned else 0
        touched = dict.fromkeys(keys)
        resident, policy = self.resident, self.policy
        hits = 0
        for key in touched:
            if key in resident:
                hits += 1
            else:
                resident.add(key)
                policy.admitted(part, key)
        misses = len(touched) - hits
        read = misses * self.expert_bytes[layer]
        self.used_bytes[part] += read
        policy.accessed(part, keys, touched)
        counters = self.counters
        counters["hits"] += hits
        counters["misses"] += misses
        counters["uploads"] += misses
        counters["upload_bytes"] += read
        if self.used_bytes[part] > self.budget:
            self._evict(part, touched)

    def _evict(self, part, touched):
        policy = self.policy
        while self.used_bytes[part] > self.budget:
            key = policy.victim(part, touched)
            if key is None:
                break
            self.resident.remove(key)
            self.used_bytes[part] -= self.expert_bytes[key // self.n_expert]
            self.counters["evictions"] += 1
            policy.dropped(part, key)
        policy.evictions_done(part)


