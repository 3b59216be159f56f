"""Eager admission: what a boundary hands libllama, and the rule libllama follows with it.

With eager admission a miss is uploaded while the graph that missed it still runs (the CPU
observer of its layer starts the copy), so it is usable from the next graph instead of the
one after. Policy stays in Python: at each boundary the engine computes a `Handover` for the
graph about to run, and during that graph C only follows it, per cached layer:

    victims[l]       slots in eviction order: free slots first (lowest first), then the
                     evictable residents by ascending policy priority; -1 pads the row.
                     Never listed: a slot whose upload is in flight, a pinned expert.
    victim_worth[l]  the worth a victim keeps (its priority; -inf for a free slot)
    worth[l, e]      the worth of expert e if this graph selects it and misses it (the
                     policy's admission value counting that use; +inf for policies that admit
                     everything; -inf: never upload, e.g. already resident or on its way)
    budget[l]        uploads the layer may start during this graph

    rule, when layer l's selected ids are known (router-rank order, one token or several):
        next = 0; started = 0
        for each distinct selected id e that misses (not resident, not on its way), in order:
            if started == budget[l]: stop
            skip victims[l][next...] whose expert is selected in this graph (its slot is read)
            if no victim is left: stop
            if worth[l, e] > victim_worth[l][next]:     (strictly)
                start copying e into slot victims[l][next]; next += 1; started += 1
            (else e stays a host-only miss; the next selected id may still beat the victim)

C writes no table during the graph: the next boundary unpublishes each victim and publishes
each completed upload (late ones at a later boundary). The engine models the rule itself
(`admissions`), so replay and a live run that waits for its uploads agree exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Handover:
    """A boundary's instructions for the next graph (see the module docstring)."""

    victims: np.ndarray        # (L, K) int32 slots, eviction order, -1 padded
    victim_worth: np.ndarray   # (L, K) float64, aligned with victims (+inf in the padding)
    worth: np.ndarray          # (L, E) float64
    budget: np.ndarray         # (L,) int64


def build_handover(free, evictable, priority, worth, budget) -> Handover:
    """free, evictable: (L, K) bool slots (an empty slot not being loaded; a resident the
    policy may evict); priority: (L, K) the residents' priority (read where evictable);
    worth: (L, E); budget: (L,) or a number. Ties go to the lowest slot."""
    rank = np.where(free, -np.inf, np.where(evictable, priority, np.inf))
    group = np.where(free, 0, np.where(evictable, 1, 2))  # free slots, then victims, then none
    slot = np.broadcast_to(np.arange(free.shape[1]), free.shape)
    victims = np.lexsort((slot, rank, group), axis=1).astype(np.int32)
    victim_worth = np.take_along_axis(rank, victims, axis=1)
    victims[np.take_along_axis(group, victims, axis=1) == 2] = -1
    budget = np.broadcast_to(np.asarray(budget, dtype=np.int64), (free.shape[0],)).copy()
    return Handover(victims, victim_worth, np.asarray(worth, dtype=np.float64), budget)


def admissions(handover: Handover, ids: np.ndarray, slot_expert: np.ndarray) -> np.ndarray:
    """The uploads C starts during a graph that selects `ids` ((L, n) int, router-rank order,
    -1 = none), given the handover of its boundary and the slot contents it was computed
    from (slot_expert (L, K), -1 empty). Returns (n_admitted, 3) rows of (layer, expert, slot)
    in the order C starts them (layer by layer, rank order within a layer)."""
    ids = np.asarray(ids)
    L, n = ids.shape
    rows = np.arange(L)
    victims = handover.victims
    # the running graph reads the slots of the experts it selects: those victims are skipped
    held = np.where(victims >= 0, slot_expert[rows[:, None], np.maximum(victims, 0)], -1)
    selected = (held[:, :, None] == ids[:, None, :]).any(axis=2) & (held >= 0)
    usable = (victims >= 0) & ~selected
    order = np.argsort(~usable, axis=1, kind="stable")     # usable victims first, in order
    slots = np.take_along_axis(victims, order, axis=1)
    keep = np.take_along_axis(handover.victim_worth, order, axis=1)
    n_usable = usable.sum(axis=1)

    next_victim = np.zeros(L, dtype=np.int64)
    started = np.zeros(L, dtype=np.int64)
    seen = np.zeros((L, n), dtype=bool)                     # the id repeats an earlier one
    if n > 1:
        seen = np.tril(ids[:, :, None] == ids[:, None, :], k=-1).any(axis=2)
    out_layer, out_expert, out_slot = [], [], []
    for j in range(n):
        e = ids[:, j]
        held_now = (slot_expert == e[:, None]).any(axis=1)  # a hit, or already on its way
        can = (e >= 0) & ~held_now & ~seen[:, j] & (started < handover.budget) & (next_victim < n_usable)
        at = np.minimum(next_victim, slots.shape[1] - 1)
        worth = handover.worth[rows, np.maximum(e, 0)]
        go = can & (worth > keep[rows, at])
        layers = np.flatnonzero(go)
        out_layer.append(layers)
        out_expert.append(e[layers])
        out_slot.append(slots[layers, at[layers]])
        next_victim += go
        started += go
    layer = np.concatenate(out_layer)
    jobs = np.empty((layer.size, 3), dtype=np.int32)
    order = np.argsort(layer, kind="stable")                # layer by layer, rank order within
    jobs[:, 0] = layer[order]
    jobs[:, 1] = np.concatenate(out_expert)[order]
    jobs[:, 2] = np.concatenate(out_slot)[order]
    return jobs
