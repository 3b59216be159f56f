"""The global byte-budget cache model (BigMoeOnEdge's route replay), offline only.

One cache over (layer, expert) entries under a byte budget: immediate admission, no insert
limit, eviction after each batch sparing the batch's own experts. A batch is one layer's
lookups (a turn's whole prefill, or one decode token); one lookup per distinct expert per
batch. Keys are layer index * n_expert + expert.

A policy ranks the resident keys; like the per-layer policies (moecache.core.policies) it is one
small class behind one interface, in a registry (BUDGET_POLICIES):

    bind(n_parts, batches)          allocate state; batches: every (layer, keys) the cache
                                    will see, in order (the offline optimum reads ahead)
    admitted(part, key)             a missed key was just read in
    accessed(part, keys, touched)   after a batch's lookups: its keys in lookup order
                                    (repeats included) and `touched`, the distinct ones
    victim(part, touched) -> key    the next key to evict from partition `part`, never one
                                    in `touched`; None when nothing is evictable
    dropped(part, key)              the victim is gone
    evictions_done(part)            the batch's evictions are over

`part` is 0, or the layer for a partitioned policy (each layer gets an equal share of the
budget and evicts only within itself).
"""

from __future__ import annotations

import heapq
import random
from collections import OrderedDict
from typing import Callable


class BudgetPolicy:
    name = "policy"
    partitioned = False
    seeded = False

    def bind(self, n_parts: int, batches) -> None:
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


class Lru(BudgetPolicy):
    """Evict the key whose last lookup is oldest."""
    name = "lru"

    def bind(self, n_parts, batches):
        self.recency = [OrderedDict() for _ in range(n_parts)]  # oldest first

    def accessed(self, part, keys, touched):
        recency = self.recency[part]
        for key in keys:
            recency[key] = None
            recency.move_to_end(key)

    def victim(self, part, touched):
        for key in self.recency[part]:  # the batch's own keys sit at the young end
            if key not in touched:
                return key
        return None

    def dropped(self, part, key):
        del self.recency[part][key]


class LayerLru(Lru):
    """LRU partitioned by layer."""
    name = "layer"
    partitioned = True


class _LazyHeap(BudgetPolicy):
    """Victims from a min-heap per partition of (rank..., key) entries. Updating a key only
    pushes a new entry: an entry counts while it is its key's latest (`self.latest`), so
    stale ones are skipped when popped."""

    def bind(self, n_parts, batches):
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


class Lfu(_LazyHeap):
    """Evict the fewest batches used in (history survives eviction), then the oldest lookup."""
    name = "lfu"

    def bind(self, n_parts, batches):
        super().bind(n_parts, batches)
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


class LayerLfu(Lfu):
    """LFU partitioned by layer."""
    name = "layerlfu"
    partitioned = True


class Belady(_LazyHeap):
    """Offline optimum: evict the key used again furthest ahead (never again first), then the
    earliest admitted."""
    name = "belady"

    def bind(self, n_parts, batches):
        super().bind(n_parts, batches)
        self.batches = batches
        self.next_use = [None] * len(batches)  # per batch, {key: next batch using it, or inf}
        upcoming = {}
        for b in range(len(batches) - 1, -1, -1):
            keys = set(batches[b][1])
            self.next_use[b] = {key: upcoming.get(key, float("inf")) for key in keys}
            for key in keys:
                upcoming[key] = b
        self.seen = 0
        self.admissions = 0
        self.admitted_as = {}  # key -> its admission number

    def admitted(self, part, key):
        self.admitted_as[key] = self.admissions
        self.admissions += 1

    def accessed(self, part, keys, touched):
        b = self.seen
        expected = self.batches[b][1] if b < len(self.batches) else None
        if keys is not expected and keys != expected:
            raise ValueError(f"belady: batch {b} differs from the batches it was given")
        self.seen += 1
        upcoming = self.next_use[b]
        for key in touched:
            self.push(part, (-upcoming[key], self.admitted_as[key], key))


class RandomEviction(BudgetPolicy):
    """Evict a uniformly random resident key outside the batch (seeded, reproducible)."""
    name = "random"
    seeded = True

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def bind(self, n_parts, batches):
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
    "lru": Lru,
    "lfu": Lfu,
    "random": RandomEviction,
    "belady": Belady,
    "layer": LayerLru,
    "layerlfu": LayerLfu,
}


def make_budget_policy(name: str, *, seed: int = 0) -> BudgetPolicy:
    if name not in BUDGET_POLICIES:
        raise ValueError(f"unknown policy {name!r} for the global model; valid: "
                         f"{', '.join(BUDGET_POLICIES)}")
    factory = BUDGET_POLICIES[name]
    return factory(seed=seed) if factory.seeded else factory()


class ByteBudgetCache:
    """Resident (layer, expert) keys under `budget_bytes`, run one batch per step().
    stats() reports in CacheEngine.stats()'s names; uploads are the reads of missed experts."""

    def __init__(self, policy: BudgetPolicy, budget_bytes: int, expert_bytes, n_expert: int,
                 batches):
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
        policy.bind(len(self.used_bytes), batches)

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

    def stats(self) -> dict:
        totals = dict(self.counters)
        lookups = totals["hits"] + totals["misses"]
        return {"steps": self.step_index, "hit_rate": totals["hits"] / lookups if lookups else None,
                "totals": totals}

