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

from .bookkeeping import admit

ADMISSIONS = ("boundary", "eager")  # a miss is uploaded at the next boundary, or during its graph


def live_admission(policy) -> str:
    """The live cache's default timing for a policy (class or object): eager, or boundary for
    one that picks its victims itself (eager admission needs residents ranked by priority)."""
    return "eager" if policy.ranks_residents else "boundary"


@dataclass
class Handover:
    """A boundary's instructions for the next graph (see the module docstring)."""

    victims: np.ndarray        # (L, K) int32 slots, eviction order, -1 padded
    victim_worth: np.ndarray   # (L, K) float64, aligned with victims (+inf in the padding)
    worth: np.ndarray          # (L, E) float64
    budget: np.ndarray         # (L,) int64


_FINITE = np.finfo(np.float64).max


def build_handover(free, evictable, priority, worth, budget) -> Handover:
    """free, evictable: (L, K) bool slots (an empty slot not being loaded; a resident the
    policy may evict); priority: (L, K) the residents' priority (read where evictable);
    worth: (L, E); budget: (L,) or a number. Ties go to the lowest slot."""
    keep = np.where(free, -np.inf, np.where(evictable, priority, np.inf))
    # free slots sort first and unlisted ones last even against infinite priorities
    order_key = np.where(free, -np.inf, np.where(evictable, np.clip(priority, -_FINITE, _FINITE), np.inf))
    victims = np.argsort(order_key, axis=1, kind="stable").astype(np.int32)
    rows = np.arange(free.shape[0])[:, None]
    victim_worth = keep[rows, victims]
    victims[~(free | evictable)[rows, victims]] = -1
    budget = np.broadcast_to(np.asarray(budget, dtype=np.int64), (free.shape[0],)).copy()
    return Handover(victims, victim_worth, np.asarray(worth, dtype=np.float64), budget)


def admissions(handover: Handover, ids: np.ndarray, slot_expert: np.ndarray) -> np.ndarray:
    """The uploads C starts during a graph that selects `ids` ((L, n) int, router-rank order,
    -1 = none), given the handover of its boundary and the slot contents it was computed
    from (slot_expert (L, K), -1 empty). Returns (n_admitted, 3) rows of (layer, expert, slot)
    in the order C starts them (layer by layer, rank order within a layer). The rule runs in
    native/engine_core.c (mc_admit), as libllama runs it: in numpy it cost half a replay."""
    return admit(handover, ids, slot_expert)


class EagerAdmission:
    """The engine's side of eager admission: the handover of each boundary (native/engine_core.c
    orders the slots as build_handover does) and the admissions a graph made under it."""

    def __init__(self, state, core, policy, inserts: int | None, miss_planner=None):
        L, E = state.expert_slot.shape
        K = state.slot_expert.shape[1]
        self._state, self._core, self._policy = state, core, policy
        self._all_keys = np.arange(L * E).reshape(L, E)
        self._budget = np.full(L, K if inserts is None else inserts, dtype=np.int64)
        self.handover: Handover | None = None  # what the graph about to run follows
        # moecache.core.missplan.MissPlanner: lane and paying uploads instead of admissions();
        # without its lane, admissions() on the handover it shaped
        self._miss_planner = miss_planner
        self._use_worth = 1.0  # the handover's worth units of one use (the planner's margin)
        self.lane_plan = None  # the last graph's MissPlan (with a planner that has the lane)
        self._unshaped: Handover | None = None  # the policy's handover, before a lane-less planner's margin

    def admitted(self, ids: np.ndarray, reported, hit_mask=None) -> np.ndarray:
        """The uploads the graph that selected `ids` started under the current handover:
        `reported` by libllama (rows of admissions(), in the order it started them), or when
        None the modelled ones (with a miss planner that has the lane: its plan, hit_mask needed)."""
        if reported is not None:
            return np.ascontiguousarray(reported, dtype=np.int32)
        if self._miss_planner is None or not self._miss_planner.lane:
            return admissions(self.handover, ids, self._state.slot_expert)
        self.lane_plan = self._miss_planner.plan(self.handover, ids, hit_mask, self._state.slot_expert,
                                                 self._use_worth)
        return self.lane_plan.jobs

    def hand_over(self, t: int) -> Handover:
        """The handover for the graph about to run, from the policy's view at boundary t."""
        policy = self._policy
        keys = self._core.slot_keys()  # junk where a slot is empty: ignored
        priority = np.ascontiguousarray(policy.priority(t, keys), dtype=np.float64)
        if policy.admits:
            worth = np.array(policy.worth_if_used(t, self._all_keys), dtype=np.float64)
        else:  # no admission test: every miss is worth a victim
            worth = np.full(self._all_keys.shape, np.inf)
        victims, victim_worth = self._core.handover(priority, worth)
        self.handover = Handover(victims, victim_worth, worth, self._budget)
        if self._miss_planner is not None:
            self._use_worth = policy.use_worth(t + 1)  # worth_if_used counts the use at t + 1
            if not self._miss_planner.lane:  # libllama follows the payback rule as its own
                self._unshaped = self.handover
                self.handover = self._miss_planner.shaped(self.handover, self._use_worth)
        return self.handover

    def declined(self, ids: np.ndarray, admitted: np.ndarray) -> np.ndarray | None:
        """Per layer, the uploads the graph that selected `ids` would have started under the
        policy's own handover (modelled, from the same slots), less those it started under the
        shaped one (`admitted`); None without a lane-less planner."""
        if self._unshaped is None:
            return None
        L = len(self.handover.budget)
        return np.bincount(admissions(self._unshaped, ids, self._state.slot_expert)[:, 0], minlength=L) - \
            np.bincount(admitted[:, 0], minlength=L)
