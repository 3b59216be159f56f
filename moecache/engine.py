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

admission="eager" moves the misses' uploads into the graph that missed them: at boundary t
the engine hands libllama a Handover (moecache.eager) for graph t, whose CPU observers start
uploads by its rule; step(ids of graph t) at boundary t+1 takes those admissions (modelled
from the handover, so replay and a waiting live run agree) and publishes them with the uploads
due: a miss in graph s is usable from graph s + 1. No boundary then uploads misses itself.

Layers are the engine's own indices 0..n_layers-1 (the glue maps them to model layers).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .eager import Handover, admissions, build_handover
from .policies import Policy

ADMISSIONS = ("boundary", "eager")  # a miss is uploaded at the next boundary, or during its graph
COUNTERS = ("hits", "misses", "uploads", "evictions", "prefetch_uploads", "prefetch_hits",
            "prefetch_waste", "late")  # late: due uploads not complete at their boundary
_NO_JOBS = np.empty((0, 3), dtype=np.int32)
_NO_LAYERS = np.empty(0, dtype=np.int64)


def _jobs(layers, experts, slots):
    """C-contiguous (n, 3) int32 rows of (layer, expert, slot)."""
    jobs = np.empty((len(layers), 3), dtype=np.int32)
    jobs[:, 0], jobs[:, 1], jobs[:, 2] = layers, experts, slots
    return jobs


def _join(parts):
    """One (n, 3) job table."""
    if not parts:
        return _NO_JOBS
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


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
    # eager: the uploads libllama started during the observed graph (already running; their
    # victims are in evict, and those complete in publish)
    admitted: np.ndarray = field(default_factory=lambda: _NO_JOBS)


class CacheEngine:
    """Per-layer cache of n_slots experts, decided by `policy` at each decode boundary.

    Live use: engine = CacheEngine(L, E, K, make_policy(name), inserts=2, pinned=...);
    optionally engine.preload(lists, rates); then plan = engine.step(None) at the first boundary and
    plan = engine.step(ids) at every later one. Residency for cross-checks: slot_expert
    (L, K), the expert held or being loaded per slot, -1 empty; expert_slot (L, E), the slot
    of each PUBLISHED expert, -1 otherwise. counters / stats() / usage for reporting.
    """

    def __init__(self, n_layers: int, n_expert: int, n_slots: int, policy: Policy, *,
                 inserts: int | None = 2, pinned=None, publish_delay: int = 1,
                 offline: bool = False, admission: str = "boundary"):
        if n_layers < 1 or n_expert < 1 or not 1 <= n_slots <= n_expert:
            raise ValueError(f"need n_layers >= 1, n_expert >= 1, 1 <= n_slots <= n_expert; got "
                             f"{n_layers}, {n_expert}, {n_slots}")
        if inserts is not None and inserts < 1:
            raise ValueError(f"inserts must be >= 1 or None (unlimited), got {inserts}")
        if publish_delay < 1:
            raise ValueError(f"publish_delay must be >= 1, got {publish_delay}")
        if admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {', '.join(ADMISSIONS)}, got {admission!r}")
        if admission == "eager" and hasattr(policy, "choose_victims"):
            raise ValueError(f"eager admission needs a policy that ranks experts (priority); "
                             f"{policy.name!r} picks its victims itself")
        if admission == "eager" and publish_delay != 1:
            raise ValueError(f"eager admission publishes at the next boundary: publish_delay must "
                             f"be 1, got {publish_delay}")
        if policy.offline_only and not offline:
            raise ValueError(f"policy {policy.name!r} needs future routing: offline replay only")
        self.n_layers, self.n_expert, self.n_slots = n_layers, n_expert, n_slots
        self.inserts = inserts
        self.admission = admission
        self.policy = policy
        policy.bind(n_layers, n_expert, n_slots)
        self._admit = getattr(policy, "admit", None)
        self._choose_victims = getattr(policy, "choose_victims", None)
        self._predict = getattr(policy, "predict", None)
        self._worth_if_used = getattr(policy, "worth_if_used", self._admit)
        self.handover: Handover | None = None  # eager: what the graph about to run follows

        self.slot_expert = np.full((n_layers, n_slots), -1, dtype=np.int32)   # incl. in flight
        self.expert_slot = np.full((n_layers, n_expert), -1, dtype=np.int32)  # published only
        self._assigned = np.full((n_layers, n_expert), -1, dtype=np.int32)    # published or in flight
        self._in_flight = np.zeros((n_layers, n_slots), dtype=bool)
        # flat views of the tables, indexed by layer * n_slots + slot or layer * n_expert + expert
        self._slot_expert_flat = self.slot_expert.reshape(-1)
        self._expert_slot_flat = self.expert_slot.reshape(-1)
        self._assigned_flat = self._assigned.reshape(-1)
        self._in_flight_flat = self._in_flight.reshape(-1)
        self._n_free = n_layers * n_slots  # empty slots not being loaded, all layers
        self._prefetched = np.zeros((n_layers, n_expert), dtype=bool)         # prefetched, unused yet
        self._pinned = np.zeros((n_layers, n_expert), dtype=bool)
        self._pending = deque([_NO_JOBS] * publish_delay)
        self.publish_delay = publish_delay
        self._warm: list[np.ndarray] = []  # per-layer experts to upload at the next boundary
        self._rows_col = np.arange(n_layers)[:, None]
        self._key_base = self._rows_col * n_expert  # key = layer * n_expert + expert
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
        self._any_pinned = bool(self._pinned.any())

    def _expert_list(self, experts, what):
        experts = np.unique(np.asarray(list(experts), dtype=np.int64))
        if experts.size and (experts[0] < 0 or experts[-1] >= self.n_expert):
            raise ValueError(f"{what}: expert ids must be in [0, {self.n_expert})")
        return experts

    def preload(self, per_layer_experts, rates=None) -> None:
        """Warm start: upload these experts (best first, up to the free slots of each layer,
        ignoring INSERTS) at the next boundary, after the pinned ones. rates: optional
        (n_layers, n_expert) uses per step from earlier runs, handed to a policy that has
        prior() before the first step."""
        if len(per_layer_experts) != self.n_layers:
            raise ValueError(f"preload has {len(per_layer_experts)} layers, expected {self.n_layers}")
        lists = []
        for layer, experts in enumerate(per_layer_experts):
            ordered = np.asarray(list(experts), dtype=np.int64)
            self._expert_list(ordered, f"preload[{layer}]")
            if self._warm:  # pinned experts still waiting go first
                ordered = np.concatenate((self._warm[layer], ordered))
            _, first = np.unique(ordered, return_index=True)
            lists.append(ordered[np.sort(first)])
        if rates is not None:
            rates = np.asarray(rates, dtype=np.float64)
            if rates.shape != (self.n_layers, self.n_expert) or not np.isfinite(rates).all() \
                    or (rates < 0).any():
                raise ValueError(f"rates must be finite and >= 0 with shape ({self.n_layers}, "
                                 f"{self.n_expert}), got shape {rates.shape}")
            if self.step_index:
                raise ValueError("rates must be given before the first step")
            prior = getattr(self.policy, "prior", None)
            if prior is not None:
                prior(rates)
        self._warm = lists

    # --- the boundary -------------------------------------------------------------------

    def step(self, ids=None, ready: int | None = None) -> StepPlan:
        """ids: (n_layers, n_used) int expert ids the previous graph selected, router-rank
        order (-1 = no selection), or None at the first boundary. ready: how many of the
        uploads due now are complete, counted in the order they were issued (the live glue
        reads it off the upload worker, which completes them in that order); the others stay
        in flight, unpublished and unevictable, and are due again at the next boundary.
        None: all of them (offline replay, or a glue that waited). Eager admission: the
        uploads due are the boundary's from the last boundary, then the graph's admissions."""
        t = self.step_index
        self.step_index += 1
        eager = self.admission == "eager"
        admitted, eager_evict = _NO_JOBS, []
        if ids is None:
            hit_mask, hits, misses, seen = None, np.zeros(self.n_layers, dtype=np.int64), \
                np.zeros(self.n_layers, dtype=np.int64), None
        else:
            ids = np.asarray(ids)
            hit_mask, hits, misses, seen = self._observe(t, ids)
            if eager and self.handover is not None:
                admitted = admissions(self.handover, ids, self.slot_expert)
                if admitted.size:
                    self._commit(t, *admitted.T, False, eager_evict, [])
                    self._pending[0] = _join([self._pending[0], admitted])  # issued last
        publish, late = self._publish(ready)
        evict, upload = self._plan(t, seen, late.size > 0, upload_misses=not eager,
                                   spent=admitted[:, 0])
        if eager_evict:
            evict = _join(eager_evict + [evict])
        self._pending.append(upload)
        if late.size:  # issued first, so completed first: ahead of the next due uploads
            self._pending[0] = _join([late, self._pending[0]])
        if eager:
            self.handover = self._handover(t)
        return StepPlan(t, hit_mask, hits, misses, publish, evict, upload, admitted)

    def _handover(self, t) -> Handover:
        """Eager: the victim order and worths the graph about to run follows."""
        held = self.slot_expert
        keys = np.maximum(held, 0) + self._key_base  # junk where a slot is empty: masked
        free = held < 0
        evictable = ~free & ~self._in_flight
        if self._any_pinned:
            evictable &= ~self._pinned.take(keys)
        if self._worth_if_used is None:  # no admission test: every miss is worth a victim
            worth = np.full((self.n_layers, self.n_expert), np.inf)
        else:
            all_keys = np.arange(self.n_layers * self.n_expert).reshape(self.n_layers, self.n_expert)
            worth = np.array(self._worth_if_used(t, all_keys), dtype=np.float64)
        worth[self._assigned >= 0] = -np.inf  # resident or on its way
        budget = self.inserts if self.inserts is not None else self.n_slots
        return build_handover(free, evictable, self.policy.priority(t, keys), worth, budget)

    def _observe(self, t, ids):
        """Count the observed step's hits and uses and hand it to the policy. Returns the hit
        mask, hits and misses per layer, and (ids, flat keys, valid mask or None, used (L, E),
        whether anything missed) for planning."""
        L = self.n_layers
        if ids.ndim != 2 or ids.shape[0] != L or ids.dtype.kind not in "iu":
            raise ValueError(f"ids must be an integer array ({L}, n_used), got {ids.dtype} {ids.shape}")
        lowest, highest = (int(ids.min()), int(ids.max())) if ids.size else (0, 0)
        if lowest < -1 or highest >= self.n_expert:  # a flat key would hit another layer
            raise ValueError(f"expert ids must be in [-1, {self.n_expert}), got "
                             f"{lowest if lowest < -1 else highest}")
        # flat (layer, expert) keys: one take per table instead of 2-d fancy indexing
        keys = ids + self._key_base  # junk where ids is -1: masked with `valid`
        hit_mask = self.expert_slot.take(keys) >= 0
        used = np.zeros(L * self.n_expert, dtype=bool)
        valid = None
        if lowest >= 0:
            used[keys] = True
            looked_up = ids.shape[1]
        else:
            valid = ids >= 0
            hit_mask &= valid
            used[keys[valid]] = True
            looked_up = valid.sum(axis=1)
        used = used.reshape(L, self.n_expert)
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
        return hit_mask, hits, misses, (ids, keys, valid, used, misses.any())

    def _publish(self, ready):
        """Make the uploads due now visible (the first `ready` of them); returns them and the
        late ones, which stay in flight."""
        publish = self._pending.popleft()
        late = _NO_JOBS
        if ready is not None and ready < len(publish):
            ready = max(ready, 0)
            publish, late = publish[:ready], publish[ready:]
            self.counters["late"] += np.bincount(late[:, 0], minlength=self.n_layers)
        if publish.size:
            l, e, s = publish.T
            self.expert_slot[l, e] = s
            self._in_flight[l, s] = False
        return publish, late

    def _plan(self, t, seen, late, upload_misses=True, spent=_NO_LAYERS):
        """Warm-start uploads, then the observed misses (unless upload_misses is False), then
        prefetch with the budget left (spent: the layer of each upload already counted against
        it): the (evict, upload) job tables of this boundary."""
        L = self.n_layers
        self._late = late
        evict_parts, upload_parts = [], []
        if self._warm:
            self._upload_warm(t, evict_parts, upload_parts)
        # no more uploads per layer than slots (a multi-token step can miss more experts than both)
        budget = self.n_slots if self.inserts is None else min(self.inserts, self.n_slots)
        used = None if seen is None else seen[3]
        blocked = self._pinned if used is None else (used | self._pinned if self._any_pinned else used)
        uploaded = spent
        if seen is not None and upload_misses and seen[4]:  # nothing to upload after all hits
            ids, keys, valid, _, _ = seen
            wanted = self._assigned.take(keys) < 0
            if valid is not None:
                wanted &= valid
            if used.sum() != (wanted.size if valid is None else valid.sum()):
                wanted &= ~self._repeats(ids)
            uploaded = self._fill(t, ids, wanted, budget, blocked, False, evict_parts, upload_parts)
        if self._predict is not None:
            left = budget - np.bincount(uploaded, minlength=L)[:, None]
            predicted = np.asarray(self._predict(t))
            if predicted.size and left.any():
                wanted = predicted >= 0
                wanted &= self._assigned[self._rows_col, np.maximum(predicted, 0)] < 0
                wanted &= ~self._repeats(predicted)
                self._fill(t, predicted, wanted, left, blocked, True, evict_parts, upload_parts)
        return _join(evict_parts), _join(upload_parts)

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

    def _fill(self, t, ids, wanted, budget, blocked, prefetch, evict_parts, upload_parts):
        """Upload up to `budget` (a number, or (L, 1) per layer) of the `wanted` ids of each row
        into free slots, then over victims; blocked (L, E) marks experts that must stay.
        Returns the layer of every upload issued."""
        # Candidates as flat lists sorted by layer, best first within a layer: router rank,
        # or admission worth (stable, so rank breaks ties) when the policy has one. Each row
        # keeps its best `budget`. (Few numpy calls: a step's cost is mostly per call.)
        per_layer_budget = isinstance(budget, np.ndarray)
        cap = budget.min() if per_layer_budget else budget
        if self._admit is None:
            n_want = wanted.sum(axis=1)
            if n_want.max() > cap:  # keep each row's first `budget`
                wanted = wanted & (np.cumsum(wanted, axis=1) <= budget)
                n_want = np.minimum(n_want, budget[:, 0] if per_layer_budget else budget)
            cand_layer, cand_col = np.nonzero(wanted)
            if cand_layer.size == 0:
                return cand_layer
            cand_expert = ids[cand_layer, cand_col]
            cand_worth = None
        else:
            cand_layer, cand_col = np.nonzero(wanted)
            if cand_layer.size == 0:
                return cand_layer
            cand_expert = ids[cand_layer, cand_col]
            cand_worth = self._admit(t, cand_expert + cand_layer * self.n_expert)
            admitted = cand_worth > -np.inf
            if not admitted.all():
                cand_layer, cand_expert, cand_worth = (
                    cand_layer[admitted], cand_expert[admitted], cand_worth[admitted])
                if cand_layer.size == 0:
                    return cand_layer
            order = np.lexsort((-cand_worth, cand_layer))
            cand_layer, cand_expert, cand_worth = cand_layer[order], cand_expert[order], cand_worth[order]
            n_want = np.bincount(cand_layer, minlength=self.n_layers)
            if n_want.max() > cap:  # keep each row's best
                cand_pos = np.arange(cand_layer.size) - np.searchsorted(cand_layer, cand_layer)
                keep = cand_pos < (budget[cand_layer, 0] if per_layer_budget else budget)
                cand_layer, cand_expert, cand_worth = cand_layer[keep], cand_expert[keep], cand_worth[keep]
                n_want = np.minimum(n_want, budget[:, 0] if per_layer_budget else budget)
        rows = np.flatnonzero(n_want)
        if rows.size == 0:  # prefetch: only layers without budget left wanted something
            return _NO_LAYERS
        n_want = n_want[rows]
        width = int(n_want.max())  # candidates of the busiest row
        # Slot ranking per row: free slots -inf (lowest index first), evictable residents by
        # policy priority, anything else +inf (never). Only rows short of free slots evict.
        held = self.slot_expert[rows]
        if self._n_free:
            free = held < 0
            short = (n_want > free.sum(axis=1)).any()
        else:  # the usual case once the cache is full
            free, short = None, True
        if short and (self._admit is not None or not prefetch):  # prefetch w/o admit: free slots only
            keys = held + self._key_base[rows]  # junk where a slot is empty: masked
            evictable = blocked.take(keys)
            if free is not None:
                evictable |= free
            np.logical_not(evictable, out=evictable)
            # with a one-step delay nothing is in flight at a boundary until it commits uploads
            if self.publish_delay > 1 or upload_parts or self._late:
                evictable &= ~self._in_flight[rows]
            if self._choose_victims is None:
                rank = np.where(evictable, self.policy.priority(t, keys), np.inf)
            else:
                rank = np.full(held.shape, np.inf)
                n_free = free.sum(axis=1) if free is not None else np.zeros(rows.size, dtype=np.int64)
                for r in np.flatnonzero(n_want > n_free):
                    layer = int(rows[r])
                    want = int(n_want[r] - n_free[r])
                    for place, e in enumerate(self._choose_victims(t, layer, held[r][evictable[r]], want)):
                        rank[r, self._assigned[layer, e]] = place  # finite, victim order
            if free is not None:
                rank[free] = -np.inf
        elif free is not None:
            rank = np.where(free, -np.inf, np.inf)
        else:
            return _NO_LAYERS
        # each row's `width` best slots in rank order; ties go to the lowest slot
        if width == 1:
            chosen, chosen_rank = rank.argmin(axis=1), rank.min(axis=1)
        elif width <= 4:  # a few argmin passes beat a sort
            chosen = np.empty((rows.size, width), dtype=np.int64)
            chosen_rank = np.empty((rows.size, width))
            all_rows = np.arange(rows.size)
            for j in range(width):
                pick = rank.argmin(axis=1)
                chosen[:, j] = pick
                chosen_rank[:, j] = rank[all_rows, pick]  # +inf once a row runs out of slots
                if j + 1 < width:
                    rank[all_rows, pick] = np.inf
        else:
            chosen = np.argsort(rank, axis=1, kind="stable")[:, :width]
            chosen_rank = np.take_along_axis(rank, chosen, axis=1)

        # Row r's j-th candidate takes its j-th slot: a row-major mask lists them in candidate
        # order. Slot ranks ascend along j and worth descends, so the accepted candidates of
        # a row are always a prefix.
        if n_want.min() == width:
            cand_slot, slot_rank = chosen.ravel(), chosen_rank.ravel()
        else:
            taken = np.arange(width) < n_want[:, None]
            cand_slot, slot_rank = chosen[taken], chosen_rank[taken]
        # over a free slot (-inf) always; over a victim only if strictly worth more (no
        # admission test: every miss is worth any victim); never over an unlisted slot (+inf)
        ok = slot_rank < np.inf if cand_worth is None else cand_worth > slot_rank
        if not ok.all():
            cand_layer, cand_expert, cand_slot = cand_layer[ok], cand_expert[ok], cand_slot[ok]
        self._commit(t, cand_layer, cand_expert, cand_slot, prefetch, evict_parts, upload_parts)
        return cand_layer

    def _commit(self, t, layers, experts, slots, prefetch, evict_parts, upload_parts):
        if layers.size == 0:
            return
        L, E = self.n_layers, self.n_expert
        at = layers * self.n_slots + slots  # flat (layer, slot) index
        victims = self._slot_expert_flat[at]
        gone = victims >= 0
        n_gone = int(gone.sum())
        self._n_free -= layers.size - n_gone
        if n_gone:
            if n_gone == gone.size:  # the usual case once the cache is full
                vl, ve, vs = layers, victims, slots
            else:
                vl, ve, vs = layers[gone], victims[gone], slots[gone]
            victim_keys = vl * E + ve
            self._expert_slot_flat[victim_keys] = -1
            self._assigned_flat[victim_keys] = -1
            self.counters["evictions"] += np.bincount(vl, minlength=L)
            if self._predict is not None:
                wasted = self._prefetched[vl, ve]
                self.counters["prefetch_waste"] += np.bincount(vl[wasted], minlength=L)
                self._prefetched[vl, ve] = False
            self.policy.evicted(t, vl, ve)
            evict_parts.append(_jobs(vl, ve, vs))
        self._slot_expert_flat[at] = experts
        self._assigned_flat[layers * E + experts] = slots
        self._in_flight_flat[at] = True
        self.counters["uploads"] += np.bincount(layers, minlength=L)
        if prefetch:
            self._prefetched[layers, experts] = True
            self.counters["prefetch_uploads"] += np.bincount(layers, minlength=L)
        self.policy.inserted(t, layers, experts, prefetch)
        upload_parts.append(_jobs(layers, experts, slots))

    @property
    def uploads_due(self) -> int:
        """How many uploads the next step() publishes (when they are complete)."""
        return len(self._pending[0])

    # --- reporting ----------------------------------------------------------------------

    def stats(self, expert_bytes=None) -> dict:
        """The totals every report uses (live stats, replay results): "totals", the counters
        summed over layers; "hit_rate", hits / lookups as a FRACTION (None before any lookup);
        "layers", each counter per layer. With expert_bytes (per layer), totals also carry
        "upload_bytes", "miss_bytes" and "lookup_bytes" (exact: Python integers)."""
        layers = {name: v.tolist() for name, v in self.counters.items()}
        totals = {name: sum(values) for name, values in layers.items()}
        if expert_bytes is not None:
            if len(expert_bytes) != self.n_layers:
                raise ValueError(f"expert_bytes has {len(expert_bytes)} layers, expected {self.n_layers}")
            for name, counts in (("upload_bytes", layers["uploads"]), ("miss_bytes", layers["misses"]),
                                 ("lookup_bytes", [h + m for h, m in zip(layers["hits"], layers["misses"])])):
                totals[name] = sum(n * int(size) for n, size in zip(counts, expert_bytes))
        lookups = totals["hits"] + totals["misses"]
        return {"steps": self.step_index, "hit_rate": totals["hits"] / lookups if lookups else None,
                "totals": totals, "layers": layers}
