"""llama.cpp's own MoE expert cache (`--moe-cache-mib`) as a replay model.

Modelled on the behaviour of upstream llama.cpp src/llama-moe-cache.cpp at commit
4b060f27a806dab2072a66007607f0e98b6b9b40 (after PR 30112), read from its source; this file
is a model of what it does, not a port of its code.

- Groups: layers whose expert tensors have the same layout share one bank of slots and ONE
  LRU over (layer, expert) keys. A route trace only gives each layer's expert size, so layers
  with equal expert_bytes form a group (one GPU: one device).
- Budget in bytes, split over the groups by their host expert bytes (each group caches the same
  fraction of its experts); a group gets the largest n_slots whose banks, with ONE spare slot
  (CUDA's MMQ reads past the last expert), fit: PAD(expert_bytes * (n_slots + 1), alignment).
  At most layers * n_expert slots; fewer than n_expert_used slots leaves the group uncached.
- Per ubatch and cached layer: ubatches of 0 or more than 32 tokens, or where
  min(n_tokens * n_expert_used, n_expert) exceeds the group's slots, bypass the cache (the
  experts run on the host) and leave the LRU untouched. Otherwise the layer's distinct experts
  are looked up: every hit is refreshed first, then every miss, in ascending expert id, takes
  the least recently used slot (empty slots come first: the LRU starts as slots 0..n-1, all
  empty), evicting whatever it held, possibly another layer's expert but never one of this
  call's (hits were refreshed, and distinct experts never outnumber the slots).
- A miss is copied synchronously over the link, then the GPU computes all of the layer's
  experts. Hits and misses are counted per distinct expert per (ubatch, layer), as upstream's
  statistics count them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..core.banks import layers_by_size
from ..core.model import CacheModel

MAX_BATCH = 32          # upstream's max_batch: larger ubatches bypass the cache
CUDA_ALIGNMENT = 128    # ggml's CUDA buffer alignment, the pad of each bank
DEFAULT_UBATCH = 512    # llama.cpp's default n_ubatch: how prompts are split


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


class SlotLru:
    """One group's slots in least-recently-used order, shared by the group's layers."""

    def __init__(self, n_slots: int, n_layers: int, n_expert: int):
        self.n_expert = n_expert
        self.order = OrderedDict.fromkeys(range(n_slots))  # first = least recently used
        self.key_of = [-1] * n_slots                        # layer * n_expert + expert, -1 empty
        self.slot_of = np.full((n_layers, n_expert), -1, dtype=np.int64)
        self.evictions = 0

    @property
    def n_slots(self) -> int:
        return len(self.key_of)

    def plan(self, layer: int, experts) -> tuple[int, list[tuple[int, int]]]:
        """Look up one (ubatch, layer): returns the hit count and the (expert, slot) fills."""
        distinct = list(dict.fromkeys(int(e) for e in experts if e >= 0))
        if len(distinct) > self.n_slots:
            raise ValueError(f"layer {layer}: {len(distinct)} distinct experts exceed {self.n_slots} slots "
                             f"(upstream bypasses such ubatches before planning)")
        slots = self.slot_of[layer]
        n_hit = 0
        for e in distinct:
            if slots[e] >= 0:
                self.order.move_to_end(int(slots[e]))
                n_hit += 1
        fills = []
        for e in sorted(distinct):
            if slots[e] >= 0:
                continue
            s = next(iter(self.order))
            victim = self.key_of[s]
            if victim >= 0:
                self.slot_of[victim // self.n_expert, victim % self.n_expert] = -1
                self.evictions += 1
            self.key_of[s] = layer * self.n_expert + e
            slots[e] = s
            self.order.move_to_end(s)
            fills.append((e, s))
        return n_hit, fills


class UpstreamCache(CacheModel):
    """All groups of one model under one byte budget, run one (layer, ubatch) per step(). Its
    counters have CacheEngine.stats()'s names: misses include the lookups the cache bypassed
    (read on the host), uploads only the experts copied to the device."""

    def __init__(self, expert_bytes, n_expert: int, n_expert_used: int, budget_bytes: int,
                 alignment: int = CUDA_ALIGNMENT):
        self.n_expert, self.n_expert_used = n_expert, n_expert_used
        self.expert_bytes = [int(b) for b in expert_bytes]
        self.groups = size_groups(self.expert_bytes, n_expert, n_expert_used, budget_bytes, alignment)
        self._lru_of: list[SlotLru | None] = [None] * len(self.expert_bytes)
        for group in self.groups:
            if group.n_slots:
                lru = SlotLru(group.n_slots, len(self.expert_bytes), n_expert)
                for layer in group.layers:
                    self._lru_of[layer] = lru
        self.counters = dict.fromkeys(("hits", "misses", "uploads", "evictions", "upload_bytes",
                                       "miss_bytes", "lookup_bytes"), 0)
        self.step_index = 0

    def lru(self, layer: int) -> SlotLru | None:
        return self._lru_of[layer]

    def device_bytes(self) -> int:
        """Bytes of the banks as sized (spare slot included)."""
        return sum(g.expert_bytes * (g.n_slots + 1) for g in self.groups if g.n_slots)

    def step(self, ubatch) -> tuple[int, int, int, int]:
        """ubatch: (layer, the expert ids its n_tokens tokens selected (-1 = none), n_tokens).
        Returns the layer's pass for the timeline (moecache.offline.cost): (layer, hits on the
        device, misses copied synchronously then computed there, misses the CPU computes
        because the cache was bypassed)."""
        layer, experts, n_tokens = ubatch
        self.step_index += 1
        lru = self._lru_of[layer]
        distinct = [int(e) for e in dict.fromkeys(experts) if e >= 0]
        size = self.expert_bytes[layer]
        counters = self.counters
        if lru is None or n_tokens == 0 or n_tokens > MAX_BATCH \
                or min(n_tokens * self.n_expert_used, self.n_expert) > lru.n_slots:
            hits, uploads, evictions = 0, 0, 0
        else:
            before = lru.evictions
            hits, fills = lru.plan(layer, distinct)
            uploads, evictions = len(fills), lru.evictions - before
        misses = len(distinct) - hits
        counters["hits"] += hits
        counters["misses"] += misses
        counters["uploads"] += uploads
        counters["evictions"] += evictions
        counters["upload_bytes"] += uploads * size
        counters["miss_bytes"] += misses * size
        counters["lookup_bytes"] += len(distinct) * size
        return layer, hits, uploads, misses - uploads
