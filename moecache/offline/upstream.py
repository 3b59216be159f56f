"""llama.cpp's own MoE expert cache (`--moe-cache-mib`) as a replay model, in two versions that
the replay runs by name (UPSTREAM_POLICIES):

- "upstream": tag b12191, ClassLRU (PR 31233, tag b12170) and `--moe-cache-cpu-share F`. Read
  from the header comment of src/llama-moe-cache.cpp at commit
  c4fb579695320929b6a453f4f3a56951bda332ee, docs/moe-cache.md and scripts/moe-cache-tune.py at
  tag b12191, and the commit list of PR 31233.
- "upstream-b11480": tag b11480, commit 4b060f27a806dab2072a66007607f0e98b6b9b40 (after PR
  30112): one plain LRU, every miss copied.

This file models what those versions do; it is not a port of their code.

Common to both:
- Groups: layers whose expert tensors have the same layout share one bank of slots and ONE
  eviction order over (layer, expert) keys. A route trace only gives each layer's expert size,
  so layers with equal expert_bytes form a group (one GPU: one device).
- Budget in bytes, split over the groups by their host expert bytes (each group caches the same
  fraction of its experts); a group gets the largest n_slots whose banks, with ONE spare slot
  (CUDA's MMQ reads past the last expert), fit: PAD(expert_bytes * (n_slots + 1), alignment).
  At most layers * n_expert slots; fewer than n_expert_used slots leaves the group uncached.
- Per ubatch and cached layer: ubatches of 0 or more than 32 tokens, or where
  min(n_tokens * n_expert_used, n_expert) exceeds the group's slots, bypass the cache (the
  experts run on the host) and leave its state untouched, the clocks and counts included.
  Otherwise the layer's distinct experts are looked up: every hit is refreshed first, then
  every miss, in ascending expert id, takes an empty slot (the lowest first) or a victim,
  possibly another layer's expert but never one of this call's.
- A miss is copied synchronously over the link, then the GPU computes all of the layer's
  experts. Hits and misses are counted per distinct expert per (ubatch, layer), as upstream's
  statistics count them.

b11480's victim is the least recently used slot.

b12191's ClassLRU: each (layer, expert) has a CRF, its uses decayed with a half-life of
CRF_HALF_LIFE tokens of its layer's clock, kept across evictions; its class is
min(floor(log2 CRF), N_CLASSES - 1) as of its last use, and each slot sits in its class's LRU
list. The victim is, among the least recently used slot of each list that this call does not
use, the one with the largest age / 2^class. Where the sources leave a detail open, this model
chooses (each pinned in tests/test_upstream.py):
- The clock: a layer's clock advances by the call's token count (PR 31233: "make the clock
  advance by N tokens: use the real token count") before its uses are counted; a use is counted
  once per distinct expert and call, at the advanced clock: CRF = CRF * 2^(-(clock - last use) /
  CRF_HALF_LIFE) + 1. A miss computed on the CPU (below) is a use too.
- The age of a slot is its layer's clock now less its expert's last use, in tokens.
- Ties of age / 2^class go to the lower class; within a list the least recently used comes
  first (a list is in last-use order).
- The CPU share F: a miss that finds an empty slot is always uploaded ("until the cache is full
  every miss is uploaded"); of the misses that would take a victim, a share F is computed on
  the CPU from the host experts, deterministically: each adds F to its group's credit, and the
  miss goes to the CPU, taking no victim, when the credit reaches 1 (1 is then taken off). A
  replay is reproducible, and over a run the share is F to within one miss. With F > 0 every
  cached layer's graph has the CPU node (upstream's get_slot_map takes cpu_part), so the join
  of the CPU's result is paid (moecache.core.missplan.UPSTREAM_CPU_SHARE_LAYOUT).
- TUNER_SHARES are scripts/moe-cache-tune.py's SHARES: the shares its tuner picks from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..core.banks import layers_by_size
from ..core.lru import LruOrder
from ..core.model import CacheModel

MAX_BATCH = 32          # upstream's max_batch: larger ubatches bypass the cache
CUDA_ALIGNMENT = 128    # ggml's CUDA buffer alignment, the pad of each bank
DEFAULT_UBATCH = 512    # llama.cpp's default n_ubatch: how prompts are split
CRF_HALF_LIFE = 128.0   # ClassLRU: tokens of the layer's clock
N_CLASSES = 8           # ClassLRU: floor(log2 of the most a CRF reaches at half-life 128) = 7
TUNER_SHARES = (0.0, 0.5, 0.8, 0.9, 0.95, 0.98)  # scripts/moe-cache-tune.py's SHARES (b12191)


def _pad(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class Group:
    layers: tuple[int, ...]     # engine layer indices
    expert_bytes: int           # bytes of one expert (all its tensors) in these layers
    n_slots: int                # 0: not cached


def size_groups(expert_bytes, n_expert: int, n_expert_used: int, budget_bytes: int,
                alignment: int = CUDA_ALIGNMENT) -> list[Group]:
    """Groups of layers with equal expert size, each sized as upstream sizes it (one device)."""
    expert_bytes = [int(b) for b in expert_bytes]
    if budget_bytes < 0 or n_expert < 1 or n_expert_used < 1 or alignment < 1:
        raise ValueError("budget_bytes must be >= 0, n_expert, n_expert_used and alignment >= 1")
    host_total = sum(expert_bytes) * n_expert
    groups = []
    for size, layers in layers_by_size(expert_bytes).items():
        share = budget_bytes * (size * len(layers) * n_expert) // host_total if host_total else 0
        n_slots = 0
        max_slots = len(layers) * n_expert
        while n_slots < max_slots and _pad(size * (n_slots + 2), alignment) <= share:
            n_slots += 1
        if n_slots < n_expert_used:
            n_slots = 0
        groups.append(Group(tuple(layers), size, n_slots))
    return groups


class SlotPool:
    """One group's slots, shared by the group's layers: the lookup, the placement and the CPU
    share; a subclass is the eviction order (refresh() on every use of a slot, victim())."""

    takes_cpu_share = False

    def __init__(self, n_slots: int, n_layers: int, n_expert: int, cpu_share: float = 0.0):
        if not 0.0 <= cpu_share < 1.0 or (cpu_share and not self.takes_cpu_share):
            raise ValueError(f"{type(self).__name__} takes a CPU share in [0, 1): "
                             f"{'0 only' if not self.takes_cpu_share else 'got ' + repr(cpu_share)}")
        self.n_expert, self.cpu_share = n_expert, cpu_share
        self.key_of = [-1] * n_slots                        # layer * n_expert + expert, -1 empty
        self.slot_of = np.full((n_layers, n_expert), -1, dtype=np.int64)
        self.n_filled = 0  # slots are filled in order and never emptied: the empty ones are the rest
        self.credit = 0.0  # the CPU share's, in misses
        self.evictions = 0

    @property
    def n_slots(self) -> int:
        return len(self.key_of)

    def plan(self, layer: int, experts, n_tokens: int = 1) -> tuple[int, list[tuple[int, int]], list[int]]:
        """Look up one (ubatch, layer): returns the hit count, the (expert, slot) fills (copied
        over the link) and the misses the CPU computes (the CPU share)."""
        distinct = list(dict.fromkeys(int(e) for e in experts if e >= 0))
        if len(distinct) > self.n_slots:
            raise ValueError(f"layer {layer}: {len(distinct)} distinct experts exceed {self.n_slots} slots "
                             f"(upstream bypasses such ubatches before planning)")
        self.count_uses(layer, distinct, n_tokens)
        slots = self.slot_of[layer]
        busy = set()  # this call's slots: never a victim
        n_hit = 0
        for e in distinct:
            if slots[e] >= 0:
                busy.add(int(slots[e]))
                self.refresh(int(slots[e]), layer * self.n_expert + e)
                n_hit += 1
        fills, cpu = [], []
        for e in sorted(distinct):
            if slots[e] >= 0:
                continue
            if self.n_filled < self.n_slots:
                s = self.n_filled
                self.n_filled += 1
            else:
                self.credit += self.cpu_share
                if self.credit >= 1.0:
                    self.credit -= 1.0
                    cpu.append(e)
                    continue
                s = self.victim(busy)
                victim = self.key_of[s]
                self.slot_of[victim // self.n_expert, victim % self.n_expert] = -1
                self.evictions += 1
            self.key_of[s] = layer * self.n_expert + e
            slots[e] = s
            busy.add(s)
            self.refresh(s, layer * self.n_expert + e)
            fills.append((e, s))
        return n_hit, fills, cpu

    def count_uses(self, layer: int, experts: list[int], n_tokens: int) -> None:
        """The call's distinct experts are used (before the lookup)."""

    def refresh(self, slot: int, key: int) -> None:
        raise NotImplementedError

    def victim(self, busy: set) -> int:
        raise NotImplementedError


class SlotLru(SlotPool):
    """b11480: the group's slots in least-recently-used order."""

    def __init__(self, n_slots, n_layers, n_expert, cpu_share=0.0):
        super().__init__(n_slots, n_layers, n_expert, cpu_share)
        self.order = LruOrder()  # the filled slots

    def refresh(self, slot, key):
        self.order.use(slot)

    def victim(self, busy):
        return self.order.oldest(spared=busy)


class ClassLru(SlotPool):
    """b12191: decayed use counts (CRF) in classes, one LRU list per class (module docstring)."""

    takes_cpu_share = True

    def __init__(self, n_slots, n_layers, n_expert, cpu_share=0.0):
        super().__init__(n_slots, n_layers, n_expert, cpu_share)
        self.clock = [0] * n_layers                        # tokens each layer has seen
        self.crf = [0.0] * (n_layers * n_expert)            # as of the last use
        self.last_use = [-1] * (n_layers * n_expert)        # the layer's clock then; -1: never
        self.lists = [LruOrder() for _ in range(N_CLASSES)]  # each class's slots
        self.list_of = [-1] * n_slots

    @staticmethod
    def class_of(crf: float) -> int:
        return min(math.floor(math.log2(crf)), N_CLASSES - 1)

    def count_uses(self, layer, experts, n_tokens):
        self.clock[layer] += n_tokens
        now = self.clock[layer]
        for e in experts:
            key = layer * self.n_expert + e
            self.crf[key] = self.crf[key] * 2.0 ** (-(now - self.last_use[key]) / CRF_HALF_LIFE) + 1.0
            self.last_use[key] = now

    def refresh(self, slot, key):
        if self.list_of[slot] >= 0:
            self.lists[self.list_of[slot]].remove(slot)
        c = self.class_of(self.crf[key])
        self.lists[c].use(slot)
        self.list_of[slot] = c

    def age(self, slot: int) -> int:
        key = self.key_of[slot]
        return self.clock[key // self.n_expert] - self.last_use[key]

    def victim(self, busy):
        best, best_score = -1, -1.0
        for c, members in enumerate(self.lists):
            s = members.oldest(spared=busy)
            if s is not None and self.age(s) / 2 ** c > best_score:
                best, best_score = s, self.age(s) / 2 ** c
        return best


UPSTREAM_POLICIES = {"upstream": ClassLru, "upstream-b11480": SlotLru}  # the versions, by name
UPSTREAM_TAGS = {"upstream": "b12191", "upstream-b11480": "b11480"}


class UpstreamCache(CacheModel):
    """All groups of one model under one byte budget, run one (layer, ubatch) per step(); `pool`
    is the version's SlotPool class, `cpu_share` its F. Its counters have CacheEngine.stats()'s
    names: misses include the lookups read on the host (bypassed, or the CPU share), uploads
    only the experts copied to the device."""

    def __init__(self, expert_bytes, n_expert: int, n_expert_used: int, budget_bytes: int,
                 alignment: int = CUDA_ALIGNMENT, *, pool=ClassLru, cpu_share: float = 0.0):
        self.n_expert, self.n_expert_used = n_expert, n_expert_used
        self.expert_bytes = [int(b) for b in expert_bytes]
        self.groups = size_groups(self.expert_bytes, n_expert, n_expert_used, budget_bytes, alignment)
        self._pool_of: list[SlotPool | None] = [None] * len(self.expert_bytes)
        for group in self.groups:
            if group.n_slots:
                shared = pool(group.n_slots, len(self.expert_bytes), n_expert, cpu_share)
                for layer in group.layers:
                    self._pool_of[layer] = shared
        self.counters = dict.fromkeys(("hits", "misses", "uploads", "evictions", "upload_bytes",
                                       "miss_bytes", "lookup_bytes"), 0)
        self.step_index = 0

    def pool(self, layer: int) -> SlotPool | None:
        return self._pool_of[layer]

    def device_bytes(self) -> int:
        """Bytes of the banks as sized (spare slot included)."""
        return sum(g.expert_bytes * (g.n_slots + 1) for g in self.groups if g.n_slots)

    def step(self, ubatch) -> tuple[int, int, int, int]:
        """ubatch: (layer, the expert ids its n_tokens tokens selected (-1 = none), n_tokens).
        Returns the layer's pass for the timeline (moecache.offline.cost): (layer, hits on the
        device, misses copied synchronously then computed there, misses the CPU computes:
        bypassed, or its share)."""
        layer, experts, n_tokens = ubatch
        self.step_index += 1
        pool = self._pool_of[layer]
        distinct = [int(e) for e in dict.fromkeys(experts) if e >= 0]
        size = self.expert_bytes[layer]
        counters = self.counters
        if pool is None or n_tokens == 0 or n_tokens > MAX_BATCH \
                or min(n_tokens * self.n_expert_used, self.n_expert) > pool.n_slots:
            hits, uploads, evictions = 0, 0, 0
        else:
            before = pool.evictions
            hits, fills, _ = pool.plan(layer, distinct, n_tokens)
            uploads, evictions = len(fills), pool.evictions - before
        misses = len(distinct) - hits
        counters["hits"] += hits
        counters["misses"] += misses
        counters["uploads"] += uploads
        counters["evictions"] += evictions
        counters["upload_bytes"] += uploads * size
        counters["miss_bytes"] += misses * size
        counters["lookup_bytes"] += len(distinct) * size
        return layer, hits, uploads, misses - uploads
