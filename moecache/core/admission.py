"""Eager admission: what a boundary hands libllama, and the rule libllama follows with it.

With eager admission a miss is uploaded while the graph that missed it still runs (the CPU
observer of its layer starts the copy), so it is usable from the next graph instead of the
one after. Policy stays in Python: at each boundary the engine computes a `Handover` for the
graph about to run, and during that graph C only follows it, per cached layer:

    victims[l]       slots in eviction order: free slots first (lowest first), then the
                     evictable residents by ascending policy priority; -1 pads the row.
                     Never listed: a slot whose upload is in flight, a pinned expert.
    victim_worth[l]  the worth a victim keeps (its priority; -inf for a free slot), lowered by a
                     miss planner's lane credit less its margin (moecache.core.missplan)
    worth[l, e]      the worth of expert e if this graph selects it and misses it (the
                     policy's admission value counting that use; +inf for policies that admit
                     everything; -inf: never upload, e.g. already resident or on its way)
    budget[l]        slot writes the layer may start during this graph
    lane[l, m]       of m candidates, how many take the copy-on-miss lane (None: no lane)
    margin           what an upload outside the lane must beat its victim's worth by

    rule, when layer l's selected ids are known (router-rank order, one token or several):
        cand  = the distinct selected e, the last token's first (the next token's likeliest), each
                token's in rank order, not held (not in slot_expert[l]: resident or on its way)
                with worth[l, e] > -inf
        n     = lane[l, len(cand)] (0 without a lane), at most len(cand)
        lset  = the first n of cand stably sorted by worth, highest first (rank breaks ties)
        order = lset, then the rest of cand in cand's order
        next = 0; started = 0
        for e in order:
            if started == budget[l]: stop
            skip victims[l][next...] that are -1 or whose expert is selected in this graph
                (its slot is read)
            if no victim is left: stop
            if worth[l, e] - (0 if e in lset else margin) > victim_worth[l][next]:   (strictly)
                write e into slot victims[l][next]; next += 1; started += 1
            else: e stays on the CPU (the next candidate may still beat the victim); if e is not
                in lset and worth[l, e] > victim_worth[l][next], the margin DECLINED its upload

A write of an expert in lset is a LANE copy: made during the graph once the layer's ids are
known, computed on the device in that same graph (the CPU skips it), complete when the graph
is. The others are asynchronous uploads, usable from the next graph. A lane candidate that
fails the test is computed on the CPU: there are no scratch slots. Without a lane and with
margin 0 this is plain eager admission (worth > victim's).

C writes no table during the graph but a lane copy's own entries (the CPU's skip, the device's
slot): the next boundary unpublishes each victim and publishes each completed upload (late ones
at a later boundary). The engine models the rule itself
(`admissions`), so replay and a live run that waits for its uploads agree exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

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
    lane: np.ndarray | None = None  # (L, E + 1) int32: of m candidates, lane[l, m] take the lane
    margin: float = 0.0             # what an upload outside the lane must beat its victim by
    # the tables as mc_admit reads them (bookkeeping.NativeHandover), made by the first admissions()
    native: object = field(default=None, init=False, repr=False, compare=False)


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


class Admissions(NamedTuple):
    """The slot writes of a graph under a handover (admissions_with_lane())."""

    jobs: np.ndarray      # (n, 3) int32 (layer, expert, slot): layer by layer, the lane's first in a layer
    lane: np.ndarray      # (L,) int32: how many of a layer's rows are lane copies (its first ones)
    declined: np.ndarray  # (L,) int32: the layer's uploads the margin declined

    def lane_first(self) -> tuple[np.ndarray, int]:
        """The rows with every layer's lane copies first (layer by layer), then the uploads:
        the order the engine takes them in (engine.step's admitted, lane_rows), and their
        number of lane copies."""
        n_lane = int(self.lane.sum())
        if not n_lane:
            return self.jobs, 0
        layers = self.jobs[:, 0]
        place = np.arange(len(layers)) - np.searchsorted(layers, layers)  # the row's place in its layer
        is_lane = place < self.lane[layers]
        return np.concatenate((self.jobs[is_lane], self.jobs[~is_lane])), n_lane


def admissions(handover: Handover, ids: np.ndarray, slot_expert: np.ndarray,
               per_token: int | None = None) -> np.ndarray:
    """The slot writes libllama makes during a graph that selects `ids` ((L, n) int,
    router-rank order, per_token of them a token (None: one token), -1 = none), given the
    handover of its boundary and the slot contents it
    was computed from (slot_expert (L, K), -1 empty): (n, 3) int32 rows of (layer, expert,
    slot) in the order it starts them, layer by layer, the lane's copies first in a layer.
    admissions_with_lane(...).jobs."""
    return admissions_with_lane(handover, ids, slot_expert, per_token).jobs


def admissions_with_lane(handover: Handover, ids: np.ndarray, slot_expert: np.ndarray,
                         per_token: int | None = None) -> Admissions:
    """admissions(), how many of each layer's rows are lane copies and its uploads the margin
    declined. The rule runs in native/engine_core.c (mc_admit), as libllama runs it: in numpy
    it cost half a replay."""
    return Admissions(*admit(handover, ids, slot_expert, per_token))


class EagerAdmission:
    """The engine's side of eager admission: the handover of each boundary (native/engine_core.c
    orders the slots as build_handover does; a miss planner adds its lane table and margin) and
    the slot writes a graph made under it."""

    def __init__(self, state, core, policy, inserts: int | None, miss_planner=None, n_used: int | None = None):
        L, E = state.expert_slot.shape
        K = state.slot_expert.shape[1]
        self.n_used = n_used  # the ids of one token in a step's (None: every step one token)
        self._state, self._core, self._policy = state, core, policy
        self._all_keys = np.arange(L * E).reshape(L, E)
        self._budget = np.full(L, K if inserts is None else inserts, dtype=np.int64)
        self.handover: Handover | None = None  # what the graph about to run follows
        self._miss_planner = miss_planner  # moecache.core.missplan.MissPlanner or None
        # its lane table (None without the lane), built now: every call costs in a live step
        self._lane = miss_planner.lane_table(E, miss_planner.n_used) \
            if miss_planner is not None and miss_planner.lane else None

    def admitted(self, ids: np.ndarray, reported, lane_rows: int, declined):
        """The slot writes the graph that selected `ids` made under the current handover,
        lane copies first (Admissions.lane_first): `reported` by libllama, of which the first
        `lane_rows` are lane copies, with the (L,) uploads the margin `declined` per layer, or
        when None the modelled ones. Returns them, their number of lane copies and the (L,)
        int32 uploads the margin declined (None when reported without a miss planner)."""
        if reported is None:
            modelled = admissions_with_lane(self.handover, ids, self._state.slot_expert, self.n_used)
            return (*modelled.lane_first(), modelled.declined)
        jobs = np.ascontiguousarray(reported, dtype=np.int32).reshape(-1, 3)
        L = len(self._budget)
        if not 0 <= lane_rows <= len(jobs) or (lane_rows and self.handover.lane is None):
            raise ValueError(f"lane_rows must be in [0, {len(jobs)}] with a lane in the handover, got {lane_rows}")
        if self._miss_planner is None:  # no margin: nothing declined
            declined = None
        elif declined is None or np.shape(declined) != (L,):
            raise ValueError(f"reported admissions under a miss planner need the uploads its margin declined per "
                             f"layer ({L},), got {None if declined is None else np.shape(declined)}")
        else:
            declined = np.ascontiguousarray(declined, dtype=np.int32)
        return jobs, lane_rows, declined

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
        # the miss planner's lane table and margin (worth_if_used counts the use at t + 1), as far as
        # the link is busy, and the lane copies' credit, as the victims' worths lowered
        margin = 0.0
        if self._miss_planner is not None:
            margin, lowered = self._miss_planner.terms(policy.use_worth(t + 1), self._core.busy)
            if lowered:
                victim_worth -= lowered
        self.handover = Handover(victims, victim_worth, worth, self._budget, self._lane, margin)
        return self.handover
