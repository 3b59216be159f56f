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
the engine hands libllama a Handover (moecache.core.admission) for graph t, whose CPU observers start
uploads by its rule; step(ids of graph t) at boundary t+1 takes those admissions (modelled
from the handover, so replay and a waiting live run agree) and publishes them with the uploads
due: a miss in graph s is usable from graph s + 1. No boundary then uploads misses itself.

step(ids, prefill=True) takes a prompt ubatch that the stock graph ran (moecache.live.cache: every
ubatch in which not every token needs an output): no slot was read, so nothing is a hit or a
miss nor counted in usage (the profile), and the stock graph started no eager upload. The
policy observes the prompt as one step; then each layer takes up to K of the prompt's experts,
most used first (ties: the lower id), ignoring INSERTS: into free slots, then over residents
the prompt did not use whose priority is below the candidate's admission worth (pinned experts
and slots in flight stay), ordered and accepted as every upload (the policy's worth, stable).
Those uploads count as prefill_uploads, not uploads, and are published at the next boundary as
any other.

Layers are the engine's own indices 0..n_layers-1 (the glue maps them to model layers).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .._core import ffi, lib
from .admission import ADMISSIONS, Handover, admissions
from .policies import Policy

COUNTERS = ("hits", "misses", "uploads", "evictions", "prefetch_uploads", "prefetch_hits",
            "prefetch_waste", "late",  # late: due uploads not complete at their boundary
            "prefill_uploads")  # uploads of the prompt's experts (step(..., prefill=True))
_NO_JOBS = np.empty((0, 3), dtype=np.int32)
_NO_LAYERS = np.empty(0, dtype=np.int64)


def _i64(array):
    return ffi.from_buffer("int64_t[]", array)


def _u8(array):  # numpy bool
    return ffi.from_buffer("uint8_t[]", array)


def _f64(array):
    return ffi.NULL if array is None else ffi.from_buffer("double[]", array)


def _read_only(array):
    """A view of one of the engine's tables that callers cannot write through."""
    view = array.view()
    view.flags.writeable = False
    return view


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
        self._prefetched = np.zeros((n_layers, n_expert), dtype=bool)         # prefetched, unused yet
        self._pinned = np.zeros((n_layers, n_expert), dtype=bool)
        self._pending = deque([_NO_JOBS] * publish_delay)
        self.publish_delay = publish_delay
        self._warm: list[np.ndarray] = []  # per-layer experts to upload at the next boundary
        self._key_base = np.arange(n_layers)[:, None] * n_expert  # key = layer * n_expert + expert
        self.usage = np.zeros((n_layers, n_expert), dtype=np.int64)  # steps each expert was used in, prompts not
        self._counts = np.zeros((len(COUNTERS), n_layers), dtype=np.int64)
        self.counters = {name: row for name, row in zip(COUNTERS, self._counts)}
        # the last observation's experts (native/engine_core.c fills a new table each step) and
        # a scratch table of engine_core.c
        self._used = np.zeros((n_layers, n_expert), dtype=bool)
        self._mark = np.zeros((n_layers, n_expert), dtype=bool)
        # the upload budget of each layer per boundary: no more than its slots (a multi-token
        # step can miss more experts than both)
        self._cap = np.full(n_layers, n_slots if inserts is None else min(inserts, n_slots), dtype=np.int64)
        # scratch of native/engine_core.c, with the pointers it is handed: a boundary's rows
        # (layers wanting slots), their (row, K) slot keys, evictable and free slots, and
        # (candidates, then accepted uploads) as (layer, expert, slot) rows
        self._rows, self._n_want = np.empty(n_layers, dtype=np.int64), np.empty(n_layers, dtype=np.int64)
        self._keys = np.empty((n_layers, n_slots), dtype=np.int64)
        self._evictable = np.empty((n_layers, n_slots), dtype=bool)
        self._free = np.empty((n_layers, n_slots), dtype=bool)
        self._scratch_args = (_i64(self._cap), _i64(self._rows), _i64(self._n_want), _i64(self._keys),
                              _u8(self._evictable), _u8(self._free))
        self._cand = np.empty((3, n_layers * n_slots), dtype=np.int64)  # grows for longer observations
        self._cand_args = tuple(_i64(row) for row in self._cand)
        self._out = ffi.new("int64_t[2]")  # out-parameters
        if admission == "eager":  # the handover's constant parts and scratch
            self._all_keys = np.arange(n_layers * n_expert).reshape(n_layers, n_expert)
            self._handover_budget = np.full(n_layers, n_slots if inserts is None else inserts, dtype=np.int64)
            self._ranked = ffi.new("mc_ranked[]", n_slots)
        self._flags = ffi.new("int32_t[2]")
        core = self._core = ffi.new("mc_engine *")
        core.n_layers, core.n_expert, core.n_slots = n_layers, n_expert, n_slots
        core.track_prefetch = self._predict is not None
        for field, table in (("slot_expert", self.slot_expert), ("expert_slot", self.expert_slot),
                             ("assigned", self._assigned), ("in_flight", self._in_flight),
                             ("prefetched", self._prefetched), ("pinned", self._pinned),
                             ("used", self._used), ("mark", self._mark), ("usage", self.usage),
                             ("counts", self._counts)):
            setattr(core, field, ffi.cast(ffi.typeof(getattr(core, field)), table.ctypes.data))
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
        self._core.any_pinned = self._any_pinned

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

    def step(self, ids=None, ready: int | None = None, admitted=None, prefill: bool = False) -> StepPlan:
        """ids: (n_layers, n_used) int expert ids the previous graph selected, router-rank
        order (-1 = no selection), or None at the first boundary. ready: how many of the
        uploads due now are complete, counted in the order they were issued (the live glue
        reads it off the upload worker, which completes them in that order); the others stay
        in flight, unpublished and unevictable, and are due again at the next boundary.
        None: all of them (offline replay, or a glue that waited). Eager admission: the
        uploads due are the boundary's from the last boundary, then the graph's admissions;
        admitted: those libllama reports (rows of eager.admissions, in the order it started
        them), None: the modelled ones. prefill: ids are a prompt ubatch the stock graph ran
        (see the module docstring)."""
        t = self.step_index
        self.step_index += 1
        eager = self.admission == "eager"
        reported, admitted, eager_evict = admitted, _NO_JOBS, []
        if prefill and (ids is None or (reported is not None and len(reported))):
            raise ValueError("a prefill step needs the prompt's ids, and the stock graph admits nothing")
        if ids is None:
            hit_mask, hits, misses, seen = None, np.zeros(self.n_layers, dtype=np.int64), \
                np.zeros(self.n_layers, dtype=np.int64), None
        else:
            ids = np.asarray(ids)
            hit_mask, hits, misses, seen = self._observe(t, ids, lookups=not prefill)
            if eager and self.handover is not None and not prefill:
                admitted = admissions(self.handover, ids, self.slot_expert) if reported is None \
                    else reported
                if admitted.size:
                    self._commit(t, *admitted.T, False, eager_evict, [])
                    self._pending[0] = _join([self._pending[0], admitted])  # issued last
        publish, late = self._publish(ready)
        if prefill:
            evict, upload = self._plan_prompt(t, seen[0])
        else:
            evict, upload = self._plan(t, seen, upload_misses=not eager,
                                       spent=admitted[:, 0] if eager else _NO_LAYERS)
        if eager_evict:
            evict = _join(eager_evict + [evict])
        self._pending.append(upload)
        if late.size:  # issued first, so completed first: ahead of the next due uploads
            self._pending[0] = _join([late, self._pending[0]])
        if eager:
            self.handover = self._handover(t)
        return StepPlan(t, hit_mask, hits, misses, publish, evict, upload, admitted)

    def _handover(self, t) -> Handover:
        """Eager: the victim order and worths the graph about to run follows (native/engine_core.c
        orders the slots as moecache.core.admission.build_handover does)."""
        keys = np.maximum(self.slot_expert, 0) + self._key_base  # junk where a slot is empty: ignored
        priority = np.asarray(self.policy.priority(t, keys), dtype=np.float64)
        if self._worth_if_used is None:  # no admission test: every miss is worth a victim
            worth = np.full((self.n_layers, self.n_expert), np.inf)
        else:
            worth = np.array(self._worth_if_used(t, self._all_keys), dtype=np.float64)
        victims = np.empty((self.n_layers, self.n_slots), dtype=np.int32)
        victim_worth = np.empty((self.n_layers, self.n_slots))
        lib.mc_handover(self._core, _f64(np.ascontiguousarray(priority)), _f64(worth),
                        ffi.from_buffer("int32_t[]", victims), _f64(victim_worth), self._ranked)
        return Handover(victims, victim_worth, worth, self._handover_budget)

    def _observe(self, t, ids, lookups=True):
        """Count the observed step's hits (unless it made no lookups: a prompt) and uses and
        hand it to the policy. Returns the hit mask, hits and misses per layer, and (ids as
        native/engine_core.c reads them, whether anything missed) for planning."""
        L = self.n_layers
        if ids.ndim != 2 or ids.shape[0] != L or ids.dtype.kind not in "iu":
            raise ValueError(f"ids must be an integer array ({L}, n_used), got {ids.dtype} {ids.shape}")
        native = ids if ids.dtype.kind == "i" and ids.itemsize >= 4 and ids.flags.c_contiguous \
            else self._native_ids(ids)
        hit_mask = np.empty(ids.shape, dtype=bool)
        used = np.zeros((L, self.n_expert), dtype=bool)  # new each step: a policy may keep it
        counts = np.empty((2, L), dtype=np.int64)  # hits, misses
        fb = ffi.from_buffer
        if lib.mc_observe(self._core, fb(native), native.itemsize == 8, ids.shape[1], lookups, fb("uint8_t[]", used),
                          fb("uint8_t[]", hit_mask), fb("int64_t[]", counts), self._out, self._flags):
            raise ValueError(f"expert ids must be in [-1, {self.n_expert}), got {self._out[0]}")
        self._used = used  # what engine_core.c reads until the next observation
        self.policy.observe(t, ids, hit_mask, used)
        return hit_mask, counts[0], counts[1], (native, self._flags[0])

    def _native_ids(self, ids):
        """ids as C-contiguous int32 or int64, range-checked where converting could wrap them."""
        if ids.dtype.kind != "i" or ids.itemsize < 4:  # not int32 or int64
            if ids.size and (ids.min() < -1 or ids.max() >= self.n_expert):
                bad = ids.min() if ids.min() < -1 else ids.max()
                raise ValueError(f"expert ids must be in [-1, {self.n_expert}), got {bad}")
            ids = ids.astype(np.int64)
        return ids if ids.flags.c_contiguous else np.ascontiguousarray(ids)

    def _publish(self, ready):
        """Make the uploads due now visible (the first `ready` of them); returns them and the
        late ones, which stay in flight."""
        publish = self._pending.popleft()
        n = len(publish)
        if n:
            ready = lib.mc_publish(self._core, ffi.from_buffer("int32_t[]", publish), n,
                                   n if ready is None else ready)
            if ready < n:
                return publish[:ready], publish[ready:]
        return publish, _NO_JOBS

    def _plan(self, t, seen, upload_misses=True, spent=_NO_LAYERS):
        """Warm-start uploads, then the observed misses (unless upload_misses is False), then
        prefetch with the budget left (spent: the layer of each upload already counted against
        it): the (evict, upload) job tables of this boundary."""
        L = self.n_layers
        evict_parts, upload_parts = [], []
        if self._warm:
            self._upload_warm(t, evict_parts, upload_parts)
        uploaded = spent
        if seen is not None and upload_misses and seen[1]:  # nothing to upload after all hits
            uploaded = self._fill(t, seen[0], self._cap, True, False, evict_parts, upload_parts)
        if self._predict is not None:
            left = self._cap - np.bincount(uploaded, minlength=L)
            predicted = np.asarray(self._predict(t))
            if predicted.size and left.any():
                self._fill(t, self._native_ids(predicted), left, seen is not None, True,
                           evict_parts, upload_parts)
        return _join(evict_parts), _join(upload_parts)

    def _plan_prompt(self, t, ids):
        """Warm-start uploads, then up to K of the prompt's experts per layer, most used first
        (ties: the lower id), ignoring INSERTS: the (evict, upload) job tables of a prefill step."""
        L, E, K = self.n_layers, self.n_expert, self.n_slots
        evict_parts, upload_parts = [], []
        if self._warm:
            self._upload_warm(t, evict_parts, upload_parts)
        keys = (ids + self._key_base)[ids >= 0]
        uses = np.bincount(keys, minlength=L * E).reshape(L, E)
        top = np.argsort(-uses, axis=1, kind="stable")[:, :K]  # stable: the lower id first
        top = np.where(np.take_along_axis(uses, top, axis=1) > 0, top, -1)
        uploaded = self._fill(t, top, np.full(L, K, dtype=np.int64), True, False, evict_parts, upload_parts)
        if uploaded.size:
            n = np.bincount(uploaded, minlength=L)
            self.counters["uploads"] -= n
            self.counters["prefill_uploads"] += n
        return _join(evict_parts), _join(upload_parts)

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

    def _fill(self, t, ids, cap, use_used, prefetch, evict_parts, upload_parts):
        """Upload up to cap[l] of the wanted ids of each row l of `ids` (not resident nor on its
        way, first occurrence) into free slots, then over victims; the experts of the observation
        (use_used) and pinned ones stay. Returns the layer of every upload issued."""
        # Candidates sorted by layer, best first within a layer: router rank, or admission
        # worth (stable, so rank breaks ties) when the policy has one.
        K = self.n_slots
        cap_arg, rows_arg, n_want_arg, keys_arg, evictable_arg, free_arg = self._scratch_args
        if cap is not self._cap:
            cap_arg = _i64(cap)
        if self._cand.shape[1] < ids.size:  # (layer, expert, slot) rows, reused
            self._cand = np.empty((3, ids.size), dtype=np.int64)
            self._cand_args = tuple(_i64(row) for row in self._cand)
        cand, (layer_arg, expert_arg, slot_arg) = self._cand, self._cand_args
        m = lib.mc_candidates(self._core, ffi.from_buffer(ids), ids.itemsize == 8, ids.shape[1],
                              ffi.NULL if self._admit is not None else cap_arg, layer_arg, expert_arg)
        if m <= 0:
            if m < 0:
                raise ValueError(f"predicted expert ids must be below {self.n_expert}")
            return _NO_LAYERS
        worth = None
        if self._admit is not None:
            worth = np.array(self._admit(t, cand[1, :m] + cand[0, :m] * self.n_expert), dtype=np.float64)
        kept = self._out
        kept[0] = m
        n_rows = lib.mc_prepare(self._core, kept, layer_arg, expert_arg, _f64(worth), cap_arg, use_used,
                                rows_arg, n_want_arg, keys_arg, evictable_arg, free_arg, self._flags)
        if n_rows == 0:  # prefetch: only layers without budget left wanted something
            return _NO_LAYERS
        # Slot ranking per row: free slots -inf (lowest index first), evictable residents by
        # policy priority, anything else +inf (never). Only rows short of free slots evict.
        mode, rank = 0, None
        if self._flags[0] and (self._admit is not None or not prefetch):  # prefetch w/o admit: free slots only
            if self._choose_victims is None:
                mode, rank = 1, np.ascontiguousarray(self.policy.priority(t, self._keys[:n_rows]), dtype=np.float64)
            else:
                mode, rank = 2, np.full((n_rows, K), np.inf)
                n_free = self._free[:n_rows].sum(axis=1)
                for r in np.flatnonzero(self._n_want[:n_rows] > n_free):
                    layer = int(self._rows[r])
                    candidates = self.slot_expert[layer][self._evictable[r]]
                    want = int(self._n_want[r] - n_free[r])
                    for place, e in enumerate(self._choose_victims(t, layer, candidates, want)):
                        rank[r, self._assigned[layer, e]] = place  # finite, victim order
        n = lib.mc_choose(self._core, mode, _f64(rank), n_rows, rows_arg, n_want_arg, evictable_arg,
                          free_arg, layer_arg, expert_arg, _f64(worth), layer_arg, expert_arg, slot_arg)
        return self._commit_rows(t, n, prefetch, evict_parts, upload_parts)

    def _commit(self, t, layers, experts, slots, prefetch, evict_parts, upload_parts):
        """Start these uploads over whatever their slots held. Returns the layer of each."""
        m = len(layers)
        if self._cand.shape[1] < m:
            self._cand = np.empty((3, m), dtype=np.int64)
            self._cand_args = tuple(_i64(row) for row in self._cand)
        self._cand[0, :m], self._cand[1, :m], self._cand[2, :m] = layers, experts, slots
        return self._commit_rows(t, m, prefetch, evict_parts, upload_parts)

    def _commit_rows(self, t, m, prefetch, evict_parts, upload_parts):
        """_commit of the first m (layer, expert, slot) rows of the scratch table."""
        if m == 0:
            return _NO_LAYERS
        jobs = np.empty((2 * m, 3), dtype=np.int32)  # uploads, then evictions
        lib.mc_commit(self._core, m, *self._cand_args, prefetch, ffi.from_buffer("int32_t[]", jobs),
                      ffi.from_buffer("int32_t[]", jobs[m:]), self._out)
        upload, n_gone = jobs[:m], self._out[0]
        if n_gone:
            evict = jobs[m:m + n_gone]
            self.policy.evicted(t, evict[:, 0], evict[:, 1])
            evict_parts.append(evict)
        self.policy.inserted(t, upload[:, 0], upload[:, 1], prefetch)
        upload_parts.append(upload)
        return upload[:, 0]

    @property
    def uploads_due(self) -> int:
        """How many uploads the next step() publishes (when they are complete)."""
        return len(self._pending[0])

    @property
    def in_flight(self) -> np.ndarray:
        """(n_layers, n_slots) bool, read-only: slots whose upload has not been published yet."""
        return _read_only(self._in_flight)

    @property
    def pinned(self) -> np.ndarray:
        """(n_layers, n_expert) bool, read-only: experts pinned in their slots."""
        return _read_only(self._pinned)

    @property
    def assigned(self) -> np.ndarray:
        """(n_layers, n_expert) int32, read-only: each expert's slot, published or in flight (-1: none)."""
        return _read_only(self._assigned)

    # --- reporting ----------------------------------------------------------------------

    def stats(self, expert_bytes=None) -> dict:
        """The totals every report uses (live stats, replay results): "totals", the counters
        summed over layers; "hit_rate", hits / lookups as a FRACTION (None before any lookup);
        "layers", each counter per layer. With expert_bytes (per layer), totals also carry
        "upload_bytes", "miss_bytes", "lookup_bytes" and "prefill_upload_bytes" (exact:
        Python integers)."""
        layers = {name: v.tolist() for name, v in self.counters.items()}
        totals = {name: sum(values) for name, values in layers.items()}
        if expert_bytes is not None:
            if len(expert_bytes) != self.n_layers:
                raise ValueError(f"expert_bytes has {len(expert_bytes)} layers, expected {self.n_layers}")
            for name, counts in (("upload_bytes", layers["uploads"]), ("miss_bytes", layers["misses"]),
                                 ("prefill_upload_bytes", layers["prefill_uploads"]),
                                 ("lookup_bytes", [h + m for h, m in zip(layers["hits"], layers["misses"])])):
                totals[name] = sum(n * int(size) for n, size in zip(counts, expert_bytes))
        lookups = totals["hits"] + totals["misses"]
        return {"steps": self.step_index, "hit_rate": totals["hits"] / lookups if lookups else None,
                "totals": totals, "layers": layers}
