"""The engine's calls into native/engine_core.c (moecache._core): the C structs, the scratch
buffers the calls share, and their results as numpy arrays. Nothing here decides: the rules
are the C's (engine_core.c, moecache.core.engine), the choices the policy's
(moecache.core.planner)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .._core import ffi, lib


def _counter_names() -> tuple[str, ...]:
    """engine_core.h's mc_counter in value order, "MC_PREFETCH_HITS" -> "prefetch_hits"."""
    values = ffi.typeof("mc_counter").relements
    return tuple(name[len("MC_"):].lower()
                 for name, _ in sorted(values.items(), key=lambda item: item[1]) if name != "MC_N_COUNTERS")


COUNTERS = _counter_names()  # the names of mc_engine.counts' rows: the C enum is their one list
# the slots a candidate may take besides free ones (mc_victims)
FREE_ONLY, BY_PRIORITY, BY_VICTIM_ORDER = lib.MC_FREE_ONLY, lib.MC_BY_PRIORITY, lib.MC_BY_VICTIM_ORDER


def _i64(array):
    return ffi.from_buffer("int64_t[]", array)


def _i32(array):
    return ffi.from_buffer("int32_t[]", array)


def _u8(array):  # numpy bool
    return ffi.from_buffer("uint8_t[]", array)


NO_JOBS = np.empty((0, 3), dtype=np.int32)  # a job table of nothing (moecache.core.state's job tables)


def _f64(array):
    return ffi.NULL if array is None else ffi.from_buffer("double[]", array)


def native_ids(ids: np.ndarray, n_expert: int) -> np.ndarray:
    """ids as the C reads them: C-contiguous int32 or int64, range-checked where converting
    could wrap them."""
    if ids.dtype.kind == "i" and ids.itemsize >= 4 and ids.flags.c_contiguous:
        return ids
    if ids.dtype.kind != "i" or ids.itemsize < 4:  # not int32 or int64
        if ids.size and (ids.min() < -1 or ids.max() >= n_expert):
            bad = ids.min() if ids.min() < -1 else ids.max()
            raise ValueError(f"expert ids must be in [-1, {n_expert}), got {bad}")
        ids = ids.astype(np.int64)
    return ids if ids.flags.c_contiguous else np.ascontiguousarray(ids)


class Observation(NamedTuple):
    hit_mask: np.ndarray   # like the ids
    hits: np.ndarray       # (L,) int64
    misses: np.ndarray     # (L,) int64
    ids: np.ndarray        # the ids as the C reads them (native_ids)
    any_miss: bool
    # a miss planner's decode graph (model_graphs), else None, -1, 0: its lane copies per layer
    # ((L,) int64, among the misses), its modelled time (-1: a count outside the table) and link time
    lane: np.ndarray | None
    graph_ms: float
    link_ms: float


class Bookkeeping:
    """One engine's C side: mc_engine pointing at the EngineState's arrays, and the scratch of
    an upload decision (mc_choice), whose rows and slots Python reads between the calls."""

    def __init__(self, state, track_prefetch: bool):
        L, K = state.slot_expert.shape
        E = state.expert_slot.shape[1]
        self.n_layers, self.n_expert, self.n_slots = L, E, K
        self._state = state
        self._mark = np.zeros((L, E), dtype=bool)  # mc_engine.mark
        core = self._core = ffi.new("mc_engine *")
        core.n_layers, core.n_expert, core.n_slots = L, E, K
        core.track_prefetch = track_prefetch
        core.any_pinned = bool(state.pinned.any())
        for name, table in (("slot_expert", state.slot_expert), ("expert_slot", state.expert_slot),
                            ("assigned", state.assigned), ("in_flight", state.in_flight),
                            ("late", state.late), ("prefetched", state.prefetched), ("pinned", state.pinned),
                            ("used", state.used),
                            ("mark", self._mark), ("usage", state.usage), ("counts", state.counts)):
            setattr(core, name, ffi.cast(ffi.typeof(getattr(core, name)), table.ctypes.data))
        self._observation = ffi.new("mc_observation *")
        # an upload decision's rows (layers wanting slots) and their slots, for the victim ranking
        self.rows, self.n_want = np.empty(L, dtype=np.int64), np.empty(L, dtype=np.int64)
        self.keys = np.empty((L, K), dtype=np.int64)
        self.free_slot = np.empty((L, K), dtype=bool)
        self.evictable = np.empty((L, K), dtype=bool)
        choice = self._choice = ffi.new("mc_choice *")
        choice.rows, choice.n_want, choice.keys = _i64(self.rows), _i64(self.n_want), _i64(self.keys)
        choice.free_slot, choice.evictable = _u8(self.free_slot), _u8(self.evictable)
        self._grow_candidates(L * K)
        self._cap = None  # the cap array choice.cap points at
        self._ranked = ffi.new("mc_ranked[]", K)  # mc_handover's scratch

    def _grow_candidates(self, n):
        self.cand_layer, self.cand_expert = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
        self._choice.cand_layer, self._choice.cand_expert = _i64(self.cand_layer), _i64(self.cand_expert)

    def model_graphs(self, table: np.ndarray, group: np.ndarray, copy_bytes: np.ndarray, link_gbps: float,
                     decay: float) -> None:
        """From now on each decode observation also models the graph for a miss planner
        (mc_observe): its time, summed from a table ((G, n, n, n) float64 of one layer's time by
        hits, lane copies and misses on the CPU; group: (L,) int64, each layer's row), and the
        time its copies held the link (copy_bytes (L,) per copy, at link_gbps), both taken into
        decayed averages (weight `decay` on the past) whose ratio is `busy`."""
        table, group = np.ascontiguousarray(table), np.ascontiguousarray(group, dtype=np.int64)
        copy_bytes = np.ascontiguousarray(copy_bytes, dtype=np.float64)
        L = self.n_layers
        if table.ndim != 4 or len(set(table.shape[1:])) != 1 or group.shape != (L,) or copy_bytes.shape != (L,):
            raise ValueError(f"a (G, n, n, n) table, ({L},) groups and ({L},) copy bytes, got {table.shape}, "
                             f"{group.shape}, {copy_bytes.shape}")
        self._graph_arrays = table, group, copy_bytes  # what the C points at
        self._link = ffi.new("mc_link *", (_f64(copy_bytes), link_gbps * 1e6, decay, 0.0, 0.0, 1.0))
        obs = self._observation
        obs.graph_table, obs.graph_group, obs.graph_n = _f64(table), _i64(group), table.shape[1]
        obs.link = self._link

    @property
    def busy(self) -> float:
        """The link's share of the recent decode graphs' modelled time (model_graphs), at most 1;
        1 before any graph."""
        return self._link.busy

    def link_update(self, graph_ms: float, link_ms: float) -> None:
        """Take a decode graph whose time the table could not give into the link's averages."""
        lib.mc_link_update(self._link, graph_ms, link_ms)

    def observe(self, ids: np.ndarray, lookups: bool, writes=NO_JOBS, n_lane: int = 0, uploads=NO_JOBS,
                declined=None) -> Observation:
        """Count an (L, n) observation (mc_observe): hits, misses, uses, usage, prefetch hits.
        Without lookups (a prompt the stock graph ran) nothing is a hit or a miss. With
        model_graphs, a decode graph's slot writes ((n, 3) int32 job rows, the first n_lane lane
        copies, among the misses), the boundary's uploads that ran beside it and the (L,) int32
        uploads its margin declined (None: none) are counted and modelled."""
        L = self.n_layers
        if ids.ndim != 2 or ids.shape[0] != L or ids.dtype.kind not in "iu":
            raise ValueError(f"ids must be an integer array ({L}, n_used), got {ids.dtype} {ids.shape}")
        native = native_ids(ids, self.n_expert)
        hit_mask = np.empty(ids.shape, dtype=bool)
        counts = np.empty((2, L), dtype=np.int64)  # hits, misses
        used = np.zeros((L, self.n_expert), dtype=bool)  # new each step: a policy may keep it
        obs = self._observation
        obs.ids, obs.wide, obs.n = ffi.from_buffer(native), native.itemsize == 8, ids.shape[1]
        obs.lookups = lookups
        obs.used, obs.hit = _u8(used), _u8(hit_mask)
        obs.counts = _i64(counts)
        lane = None
        if obs.graph_table and lookups:
            lane = np.empty(L, dtype=np.int64)
            obs.lane = _i64(lane)
            obs.writes, obs.n_writes, obs.n_lane = _i32(writes), len(writes), n_lane
            obs.uploads, obs.n_uploads = _i32(uploads), len(uploads)
            obs.declined = ffi.NULL if declined is None else _i32(declined)
        status = lib.mc_observe(self._core, obs)
        if status == 1:
            raise ValueError(f"expert ids must be in [-1, {self.n_expert}), got {obs.bad_id}")
        if status:
            raise ValueError(f"a copy of layer {obs.bad_id}: layers are in [0, {L})")
        self._state.used = used  # what mc_engine.used points at until the next observation
        return Observation(hit_mask, counts[0], counts[1], native, bool(obs.any_miss), lane, obs.graph_ms,
                           obs.link_ms)

    def publish(self, jobs: np.ndarray, ready: int) -> int:
        """Publish the first `ready` of these due uploads (the others count as late); returns
        how many were published."""
        return lib.mc_publish(self._core, _i32(jobs), len(jobs), ready)

    def candidates(self, ids: np.ndarray, cap: np.ndarray | None) -> int:
        """List the wanted experts of native (L, n) ids: not resident nor on their way, first
        occurrence, at most cap[l] per layer (cap None: all). Returns how many (cand_layer,
        cand_expert), -1 if an id is >= n_expert."""
        if self.cand_layer.size < ids.size:
            self._grow_candidates(ids.size)
        return lib.mc_candidates(self._core, ffi.from_buffer(ids), ids.itemsize == 8, ids.shape[1],
                                 ffi.NULL if cap is None else self._cap_arg(cap), self._choice)

    def _cap_arg(self, cap):
        if cap is not self._cap:
            self._cap, self._choice.cap = cap, _i64(cap)
        return self._choice.cap

    def prepare(self, worth: np.ndarray | None, cap: np.ndarray, keep_used: bool) -> tuple[int, bool]:
        """Keep the candidates to place, in admission order (by worth when given: (n_cand,)
        float64, -inf refused), cap[l] per layer, and list the rows wanting slots (rows,
        n_want, keys, free_slot, evictable). Returns the number of rows and whether any row
        wants more slots than it has free."""
        choice = self._choice
        choice.worth = _f64(worth)
        self._cap_arg(cap)
        n_rows = lib.mc_prepare(self._core, choice, keep_used)
        return n_rows, bool(choice.short_of_free)

    def choose(self, how: int, rank: np.ndarray | None) -> np.ndarray:
        """Place the kept candidates (mc_choose): the accepted uploads' job table."""
        upload = np.empty((self._choice.n_cand, 3), dtype=np.int32)
        n = lib.mc_choose(self._core, self._choice, how, _f64(rank), _i32(upload))
        return upload[:n]

    def commit(self, upload: np.ndarray, prefetch: bool) -> np.ndarray:
        """Start these uploads over whatever their slots held (mc_commit): the victims' job table."""
        evict = np.empty((len(upload), 3), dtype=np.int32)
        n = lib.mc_commit(self._core, _i32(upload), len(upload), prefetch, _i32(evict))
        return evict[:n]

    def slot_keys(self) -> np.ndarray:
        """The (L, K) key of each slot's expert (mc_slot_keys; junk where a slot is empty)."""
        keys = np.empty((self.n_layers, self.n_slots), dtype=np.int64)
        lib.mc_slot_keys(self._core, _i64(keys))
        return keys

    def handover(self, priority: np.ndarray, worth: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Eager admission's victim order and the worth each victim keeps (mc_handover), from the
        residents' (L, K) priority; sets worth (L, E) to -inf for experts resident or on their
        way."""
        victims = np.empty((self.n_layers, self.n_slots), dtype=np.int32)
        victim_worth = np.empty((self.n_layers, self.n_slots))
        lib.mc_handover(self._core, _f64(priority), _f64(worth), _i32(victims), _f64(victim_worth),
                        self._ranked)
        return victims, victim_worth


class NativeHandover:
    """A handover's tables as mc_admit reads them, converted once, with the call's scratch."""

    def __init__(self, handover):
        L, K = handover.victims.shape
        E = handover.worth.shape[1]
        self.shape = L, K, E
        self._arrays = [np.ascontiguousarray(handover.victims, dtype=np.int32),
                        np.ascontiguousarray(handover.victim_worth, dtype=np.float64),
                        np.ascontiguousarray(handover.worth, dtype=np.float64),
                        np.ascontiguousarray(handover.budget, dtype=np.int64)]
        lane = ffi.NULL
        if handover.lane is not None:
            lane_table = np.ascontiguousarray(handover.lane, dtype=np.int32)
            if lane_table.shape != (L, E + 1):
                raise ValueError(f"the handover's lane table must be ({L}, {E + 1}), got {lane_table.shape}")
            self._arrays.append(lane_table)
            lane = _i32(lane_table)
        victims, victim_worth, worth, budget = self._arrays[:4]
        self.table = ffi.new("mc_handover_table *", (L, K, E, _i32(victims), _f64(victim_worth), _f64(worth),
                                                     _i64(budget), lane, handover.margin))
        self.mark = ffi.new("uint8_t[]", E)
        self.cand = ffi.new("int64_t[]", 1)


def admit(handover, ids: np.ndarray, slot_expert: np.ndarray,
          per_token: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """moecache.core.admission.admissions in C (mc_admit): the (n, 3) int32 job rows, and per
    layer the (L,) int32 lane rows and uploads the margin declined."""
    if handover.native is None:
        handover.native = NativeHandover(handover)
    native = handover.native
    L, K, E = native.shape
    ids = np.asarray(ids)
    if ids.ndim != 2 or ids.shape[0] != L or ids.dtype.kind not in "iu":
        raise ValueError(f"ids must be an integer array ({L}, n), got {ids.dtype} {ids.shape}")
    ids = native_ids(ids, E)
    n = ids.shape[1]
    per_token = n if per_token is None else per_token
    if per_token < 1:
        raise ValueError(f"per_token must be >= 1, got {per_token}")
    if len(native.cand) < n:
        native.cand = ffi.new("int64_t[]", n)
    slots = slot_expert if slot_expert.dtype == np.int32 and slot_expert.flags.c_contiguous else \
        np.ascontiguousarray(slot_expert, dtype=np.int32)
    jobs = np.empty((L * min(n, K), 3), dtype=np.int32)
    lane_rows, declined = np.empty((2, L), dtype=np.int32)
    n_jobs = lib.mc_admit(native.table, ffi.from_buffer(ids), ids.itemsize == 8, n, per_token, _i32(slots), native.mark,
                          native.cand, _i32(jobs), _i32(lane_rows), _i32(declined))
    if n_jobs < 0:
        raise ValueError(f"expert ids must be in [-1, {E}), got {ids.flat[-1 - n_jobs]}")
    return jobs[:n_jobs], lane_rows, declined
