"""The cache engine: one model of the per-layer expert cache, driven by the live glue between
decode steps and by the offline replay alike.

Timing (boundary t sits between graph t-1 and graph t; no graph runs during step()):

    plan = engine.step(ids_of_graph_t_minus_1)   # None at the first boundary
    apply plan.publish, then plan.evict, then plan.upload

- An observed expert is a HIT iff it was published while graph t-1 ran, i.e. it is
  published now, before this boundary's publications.
- Uploads issued at boundary t run during graph t and are published at boundary
  t + publish_delay (1 by default): a miss seen in graph s is usable from graph s + 2.
- At most `inserts` uploads per layer per boundary (None = unlimited). Free slots are used
  before anything is evicted. Never evicted: an expert used in the step just observed, a
  pinned expert, a slot whose upload is still in flight.
- Evicting unpublishes the victim at this boundary, before its slot is reused.
- Prefetch (policies with predict()) only uses the upload budget the misses left.

Layers are the engine's own indices 0..n_layers-1 (the glue maps them to model layers).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from .policies import Policy

COUNTERS = ("hits", "misses", "uploads", "evictions", "prefetch_uploads", "prefetch_hits",
            "prefetch_waste")
_NO_JOBS = np.empty((0, 3), dtype=np.int32)


@dataclass
class StepPlan:
    """What the glue must do at one boundary. Job tables are (n, 3) int32 arrays of
    (layer, expert, slot) rows; apply publish, then evict, then upload."""

    step: int
    hit_mask: np.ndarray | None  # like the observed ids; None at an observation-less boundary
    hits: np.ndarray             # (n_layers,) hits in the observed step
    misses: np.ndarray           # (n_layers,)
    publish: np.ndarray          # uploads issued `publish_delay` boundaries ago: make visible now
    evict: np.ndarray            # clear these table entries now, before their slots are reused
    upload: np.ndarray           # start these copies now (published at a later boundary)


class CacheEngine:
    def __init__(self, n_layers: int, n_expert: int, n_slots: int, policy: Policy, *,
                 inserts: int | None = 2, pinned=None, publish_delay: int = 1,
                 offline: bool = False):
        if n_layers < 1 or n_expert < 1 or not 1 <= n_slots <= n_expert:
            raise ValueError(f"need n_layers >= 1, n_expert >= 1, 1 <= n_slots <= n_expert; got "
                             f"{n_layers}, {n_expert}, {n_slots}")
        if inserts is not None and inserts < 1:
            raise ValueError(f"inserts must be >= 1 or None (unlimited), got {inserts}")
        if publish_delay < 1:
            raise ValueError(f"publish_delay must be >= 1, got {publish_delay}")
        if policy.offline_only and not offline:
            raise ValueError(f"policy {policy.name!r} needs future routing: offline replay only")
        self.n_layers, self.n_expert, self.n_slots = n_layers, n_expert, n_slots
        self.inserts = inserts
        self.policy = policy
        policy.bind(n_layers, n_expert, n_slots)
        self._admit = getattr(policy, "admit", None)
        self._choose_victims = getattr(policy, "choose_victims", None)
        self._predict = getattr(policy, "predict", None)

        self.slot_expert = np.full((n_layers, n_slots), -1, dtype=np.int32)   # incl. in flight
        self.expert_slot = np.full((n_layers, n_expert), -1, dtype=np.int32)  # published only
        self._assigned = np.full((n_layers, n_expert), -1, dtype=np.int32)    # published or in flight
        self._in_flight = np.zeros((n_layers, n_slots), dtype=bool)
        self._prefetched = np.zeros((n_layers, n_expert), dtype=bool)         # prefetched, unused yet
        self._pinned = np.zeros((n_layers, n_expert), dtype=bool)
        self._pending = deque([_NO_JOBS] * publish_delay)
        self._warm: list[np.ndarray] = []  # per-layer experts to upload at the next boundary
        self._rows = np.arange(n_layers)
        self._rows_col = self._rows[:, None]
        self.usage = np.zeros((n_layers, n_expert), dtype=np.int64)  # steps each expert was used in
        self.counters = {name: np.zeros(n_layers, dtype=np.int64) for name in COUNTERS}
        self.step_index = 0

        if pinned is not None:
            if len(pinned) != n_layers:
                raise ValueError(f"pinned has {len(pinned)} layers, expected {n_layers}")
            for layer, experts in enumerate(pinned):
                experts = self._expert_list(experts, f"pinned[{layer}]")
                if experts.size > n_slots - 1:
                    raise ValueError(f"pinned[{layer}] has {experts.size} experts; at most "
                                     f"n_slots - 1 = {n_slots - 1} leaves room for misses")
                self._pinned[layer, experts] = True
            self._warm = [np.flatnonzero(row) for row in self._pinned]

    def _expert_list(self, experts, what):
        experts = np.unique(np.asarray(list(experts), dtype=np.int64))
        if experts.size and (experts[0] < 0 or experts[-1] >= self.n_expert):
            raise ValueError(f"{what}: expert ids must be in [0, {self.n_expert})")
        return experts

    def preload(self, per_layer_experts) -> None:
        """Warm start: upload these experts (best first, up to the free slots of each layer,
        ignoring INSERTS) at the next boundary, after the pinned ones."""
        if len(per_layer_experts) != self.n_layers:
            raise ValueError(f"preload has {len(per_layer_experts)} layers, expected {self.n_layers}")
        lists = []
        for layer, experts in enumerate(per_layer_experts):
            ordered = np.asarray(list(experts), dtype=np.int64)
            self._expert_list(ordered, f"preload[{layer}]")
            _, first = np.unique(ordered, return_index=True)
            lists.append(ordered[np.sort(first)])
        if self._warm:
            lists = [np.concatenate((pin, extra)) for pin, extra in zip(self._warm, lists)]
        self._warm = lists

    # --- the boundary -------------------------------------------------------------------

    def step(self, ids=None) -> StepPlan:
        """ids: (n_layers, n_used) int expert ids the previous graph selected, router-rank
        order (-1 = no selection), or None at the first boundary."""
        t = self.step_index
        self.step_index += 1
        L = self.n_layers
        hit_mask, used = None, None
        hits = misses = np.zeros(L, dtype=np.int64)
        if ids is not None:
            ids = np.asarray(ids)
            if ids.ndim != 2 or ids.shape[0] != L or ids.dtype.kind not in "iu":
                raise ValueError(f"ids must be an integer array ({L}, n_used), got {ids.dtype} {ids.shape}")
            lowest, highest = (int(ids.min()), int(ids.max())) if ids.size else (0, 0)
            if lowest < -1 or highest >= self.n_expert:
                raise ValueError(f"expert ids must be in [-1, {self.n_expert}), got {lowest}..{highest}")
            valid = ids >= 0 if lowest < 0 else None
            hit_mask = self.expert_slot[self._rows_col, ids] >= 0
            used = np.zeros((L, self.n_expert), dtype=bool)
            if valid is None:
                used[self._rows_col, ids] = True
                looked_up = ids.shape[1]
            else:
                hit_mask &= valid
                used[np.nonzero(valid)[0], ids[valid]] = True
                looked_up = valid.sum(axis=1)
            hits = hit_mask.sum(axis=1)
            misses = looked_up - hits
            self.counters["hits"] += hits
            self.counters["misses"] += misses
            self.usage += used
            if self._predict is not None:
                used_prefetch = used & self._prefetched & (self.expert_slot >= 0)
                self.counters["prefetch_hits"] += used_prefetch.sum(axis=1)
                self._prefetched &= ~used_prefetch
            self.policy.observe(t, ids, hit_mask, used)

        publish = self._pending.popleft()
        if publish.size:
            l, e, s = publish.T
            self.expert_slot[l, e] = s
            self._in_flight[l, s] = False

        evict_parts, upload_parts = [], []
        if self._warm:
            self._upload_warm(t, evict_parts, upload_parts)
        budget = np.full(L, self.inserts if self.inserts is not None else self.n_slots)
        if ids is not None:
            wanted = self._assigned[self._rows_col, ids] < 0
            if valid is not None:
                wanted &= valid
            if wanted.any():
                if int(used.sum()) != int(wanted.size if valid is None else valid.sum()):
                    wanted &= ~self._repeats(ids)
                self._fill(t, ids, wanted, budget, used, False, evict_parts, upload_parts)
        if self._predict is not None and budget.any():
            predicted = np.asarray(self._predict(t))
            if predicted.size:
                wanted = predicted >= 0
                wanted &= self._assigned[self._rows_col, np.maximum(predicted, 0)] < 0
                wanted &= ~self._repeats(predicted)
                self._fill(t, predicted, wanted, budget, used, True, evict_parts, upload_parts)

        evict = np.concatenate(evict_parts) if evict_parts else _NO_JOBS
        upload = np.concatenate(upload_parts) if upload_parts else _NO_JOBS
        self._pending.append(upload)
        return StepPlan(t, hit_mask, hits, misses, publish, evict, upload)

    @staticmethod
    def _repeats(ids):
        """True where a row repeats an id seen earlier in that row."""
        same = ids[:, :, None] == ids[:, None, :]
        return np.tril(same, k=-1).any(axis=2)

    def _upload_warm(self, t, evict_parts, upload_parts):
        """Pinned and preloaded experts go into free slots, lowest slot first."""
        layers, experts, slots = [], [], []
        for layer, wanted in enumerate(self._warm):
            wanted = wanted[self._assigned[layer, wanted] < 0]
            free = np.flatnonzero(self.slot_expert[layer] < 0)[:wanted.size]
            layers.append(np.full(free.size, layer))
            experts.append(wanted[:free.size])
            slots.append(free)
        self._warm = []
        self._commit(t, np.concatenate(layers), np.concatenate(experts), np.concatenate(slots),
                     False, evict_parts, upload_parts)

    def _fill(self, t, ids, wanted, budget, used, prefetch, evict_parts, upload_parts):
        """Upload up to budget[layer] of the `wanted` ids of each row into free slots, then
        over victims. Updates budget in place."""
        if self._admit is not None:
            rows = np.flatnonzero(wanted.any(axis=1))
            worth = np.full(ids.shape, -np.inf)
            worth[rows] = np.where(wanted[rows], self._admit(t, rows, np.maximum(ids[rows], 0)), -np.inf)
            wanted &= worth > -np.inf
            order = np.argsort(-worth, axis=1, kind="stable")
        else:
            order = np.argsort(~wanted, axis=1, kind="stable")  # rank order
        n_want = np.minimum(wanted.sum(axis=1), budget)
        rows = np.flatnonzero(n_want)
        if rows.size == 0:
            return
        width = int(n_want[rows].max())
        order = order[rows, :width]
        candidates = ids[rows[:, None], order]                       # (R, width) best first
        take = np.arange(width) < n_want[rows][:, None]

        # Slot ranking per row: free slots (-inf, lowest index first), evictable residents
        # by policy priority, blocked slots (+inf) never.
        held = self.slot_expert[rows]
        occupied = held >= 0
        held0 = np.maximum(held, 0)
        n_free = (~occupied).sum(axis=1)
        blocked = occupied & (self._in_flight[rows] | self._pinned[rows[:, None], held0])
        if used is not None:
            blocked |= occupied & used[rows[:, None], held0]
        rank = np.where(occupied, np.inf, -np.inf)
        short = n_want[rows] > n_free
        if short.any() and not (prefetch and self._admit is None):  # prefetch without admit: free slots only
            if self._choose_victims is None:
                evictable = occupied & ~blocked
                rank = np.where(evictable, self.policy.priority(t, rows, held0), rank)
            else:
                for r in np.flatnonzero(short):
                    layer = int(rows[r])
                    movable = held[r][~blocked[r] & occupied[r]]
                    need = int(n_want[rows[r]] - n_free[r])
                    for order_pos, e in enumerate(self._choose_victims(t, layer, movable, need)):
                        rank[r, self._assigned[layer, e]] = order_pos  # finite, in victim order
        if width <= 4:  # a few argmin passes beat a sort; ties go to the lowest slot
            chosen = np.empty((rows.size, width), dtype=np.int64)
            work = rank.copy()
            for j in range(width):
                chosen[:, j] = work.argmin(axis=1)
                work[np.arange(rows.size), chosen[:, j]] = np.inf
        else:
            chosen = np.argsort(rank, axis=1, kind="stable")[:, :width]
        chosen_rank = np.take_along_axis(rank, chosen, axis=1)
        ok = take & (chosen_rank < np.inf)
        if self._admit is not None:
            cand_worth = np.take_along_axis(worth[rows], order, axis=1)
            ok &= (chosen_rank == -np.inf) | (cand_worth > chosen_rank)
        ok = np.logical_and.accumulate(ok, axis=1)
        r_idx, j_idx = np.nonzero(ok)
        layers = rows[r_idx]
        self._commit(t, layers, candidates[r_idx, j_idx], chosen[r_idx, j_idx], prefetch,
                     evict_parts, upload_parts)
        budget -= np.bincount(layers, minlength=self.n_layers)

    def _commit(self, t, layers, experts, slots, prefetch, evict_parts, upload_parts):
        if layers.size == 0:
            return
        L = self.n_layers
        victims = self.slot_expert[layers, slots]
        gone = victims >= 0
        if gone.any():
            vl, ve, vs = layers[gone], victims[gone], slots[gone]
            self.expert_slot[vl, ve] = -1
            self._assigned[vl, ve] = -1
            self.counters["evictions"] += np.bincount(vl, minlength=L)
            wasted = self._prefetched[vl, ve]
            if wasted.any():
                self.counters["prefetch_waste"] += np.bincount(vl[wasted], minlength=L)
                self._prefetched[vl, ve] = False
            self.policy.evicted(t, vl, ve)
            evict_parts.append(np.stack((vl, ve, vs), axis=1).astype(np.int32))
        self.slot_expert[layers, slots] = experts
        self._assigned[layers, experts] = slots
        self._in_flight[layers, slots] = True
        self.counters["uploads"] += np.bincount(layers, minlength=L)
        if prefetch:
            self._prefetched[layers, experts] = True
            self.counters["prefetch_uploads"] += np.bincount(layers, minlength=L)
        self.policy.inserted(t, layers, experts, prefetch)
        upload_parts.append(np.stack((layers, experts, slots), axis=1).astype(np.int32))

    # --- reporting ----------------------------------------------------------------------

    def stats(self) -> dict:
        total = {name: int(v.sum()) for name, v in self.counters.items()}
        lookups = total["hits"] + total["misses"]
        return {
            "steps": self.step_index,
            "layers": {name: v.tolist() for name, v in self.counters.items()},
            "total": total,
            "hit_pct": 100.0 * total["hits"] / lookups if lookups else 0.0,
        }
