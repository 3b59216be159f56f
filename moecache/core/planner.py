"""Which experts a boundary uploads, and over which victims: the warm start (pinned and
preloaded experts), then the observed misses or a prompt's experts, then prefetch. The policy
decides through what it declares it can do (moecache.core.policies.Policy's capabilities);
the tables and counters are native/engine_core.c's (moecache.core.bookkeeping)."""

from __future__ import annotations

import numpy as np

from .bookkeeping import BY_PRIORITY, BY_VICTIM_ORDER, FREE_ONLY, Bookkeeping, Observation, native_ids
from .policies import Policy
from .state import NO_JOBS, NO_LAYERS, EngineState, join_jobs


class _Jobs:
    """The evict and upload tables of one boundary, in the order they are issued."""

    def __init__(self):
        self.evict: list[np.ndarray] = []
        self.upload: list[np.ndarray] = []

    def add(self, evict, upload):
        if len(evict):
            self.evict.append(evict)
        self.upload.append(upload)

    def tables(self) -> tuple[np.ndarray, np.ndarray]:
        return join_jobs(self.evict), join_jobs(self.upload)


class UploadPlanner:
    """The upload decisions of one engine (see moecache.core.engine for the rules)."""

    def __init__(self, state: EngineState, core: Bookkeeping, policy: Policy, inserts: int | None,
                 warm: list[np.ndarray]):
        self._state, self._core, self._policy = state, core, policy
        self.n_layers, self.n_expert, self.n_slots = core.n_layers, core.n_expert, core.n_slots
        # the upload budget of each layer per boundary: no more than its slots (a multi-token
        # step can miss more experts than both)
        K = self.n_slots
        self._cap = np.full(self.n_layers, K if inserts is None else min(inserts, K), dtype=np.int64)
        self.warm = warm  # per-layer experts to upload at the next boundary, best first
        # uploads and evictions are told to a policy that overrides Policy's no-ops for them
        self._tell_inserted = type(policy).inserted is not Policy.inserted
        self._tell_evicted = type(policy).evicted is not Policy.evicted

    def plan(self, t: int, seen: Observation | None, upload_misses: bool, spent: np.ndarray):
        """Warm-start uploads, then the observed misses (unless upload_misses is False), then
        prefetch with the budget left (spent: the job table of the uploads already counted
        against it): the (evict, upload) job tables of this boundary."""
        fill_misses = seen is not None and upload_misses and seen.any_miss  # nothing to upload after all hits
        if not (self.warm or fill_misses or self._policy.predicts):  # most eager boundaries
            return NO_JOBS, NO_JOBS
        jobs = _Jobs()
        if self.warm:
            self._upload_warm(t, jobs)
        uploaded = spent[:, 0]
        if fill_misses:
            uploaded = self._fill(t, seen.ids, self._cap, True, False, jobs)
        if self._policy.predicts:
            left = self._cap - np.bincount(uploaded, minlength=self.n_layers)
            predicted = np.asarray(self._policy.predict(t))
            if predicted.size and left.any():
                self._fill(t, native_ids(predicted, self.n_expert), left, seen is not None, True, jobs)
        return jobs.tables()

    def plan_prompt(self, t: int, ids: np.ndarray):
        """Warm-start uploads, then up to K of the prompt's experts per layer, most used first
        (ties: the lower id), ignoring INSERTS: the (evict, upload) job tables of a prefill step."""
        L, E, K = self.n_layers, self.n_expert, self.n_slots
        jobs = _Jobs()
        if self.warm:
            self._upload_warm(t, jobs)
        uses = np.bincount(self._state.keys(ids)[ids >= 0], minlength=L * E).reshape(L, E)
        top = np.argsort(-uses, axis=1, kind="stable")[:, :K]  # stable: the lower id first
        top = np.where(np.take_along_axis(uses, top, axis=1) > 0, top, -1)
        uploaded = self._fill(t, top, np.full(L, K, dtype=np.int64), True, False, jobs)
        if uploaded.size:
            n = np.bincount(uploaded, minlength=L)
            self._state.counters["uploads"] -= n
            self._state.counters["prefill_uploads"] += n
        return jobs.tables()

    def commit(self, t: int, upload: np.ndarray, prefetch: bool) -> np.ndarray:
        """Start these uploads over whatever their slots held and tell the policy: the victims'
        job table."""
        evict = self._core.commit(upload, prefetch)
        if self._tell_evicted and len(evict):
            self._policy.evicted(t, evict[:, 0], evict[:, 1])
        if self._tell_inserted:
            self._policy.inserted(t, upload[:, 0], upload[:, 1], prefetch)
        return evict

    def _upload_warm(self, t, jobs):
        """Pinned and preloaded experts go into free slots, lowest slot first."""
        state, rows = self._state, []
        for layer, wanted in enumerate(self.warm):
            wanted = wanted[state.assigned[layer, wanted] < 0]
            free = np.flatnonzero(state.slot_expert[layer] < 0)[:wanted.size]
            rows.append(np.column_stack((np.full(free.size, layer), wanted[:free.size], free)))
        self.warm = []
        upload = np.concatenate(rows).astype(np.int32)
        if len(upload):
            jobs.add(self.commit(t, upload, False), upload)

    def _fill(self, t, ids, cap, keep_used, prefetch, jobs):
        """Upload up to cap[l] of the wanted ids of each row l of native `ids` (not resident nor
        on its way, first occurrence) into free slots, then over victims; the experts of the
        observation (keep_used) and pinned ones stay. Returns the layer of every upload issued."""
        # Candidates sorted by layer, best first within a layer: router rank, or admission
        # worth (stable, so rank breaks ties) when the policy has one.
        core, admits = self._core, self._policy.admits
        m = core.candidates(ids, None if admits else cap)
        if m <= 0:
            if m < 0:
                raise ValueError(f"predicted expert ids must be below {self.n_expert}")
            return NO_LAYERS
        worth = None
        if admits:
            keys = core.cand_expert[:m] + core.cand_layer[:m] * self.n_expert
            worth = np.array(self._policy.admit(t, keys), dtype=np.float64)
        n_rows, short = core.prepare(worth, cap, keep_used)
        if n_rows == 0:  # prefetch: only layers without budget left wanted something
            return NO_LAYERS
        how, rank = FREE_ONLY, None
        if short and (admits or not prefetch):  # prefetch without an admission test: free slots only
            how, rank = self._victim_ranking(t, n_rows)
        upload = core.choose(how, rank)
        if not len(upload):
            return NO_LAYERS
        jobs.add(self.commit(t, upload, prefetch), upload)
        return upload[:, 0]

    def _victim_ranking(self, t, n_rows):
        """How the rows short of free slots rank their residents, and the (n_rows, K) ranks: the
        policy's priority, or the places in its own victim order (+inf: not a victim)."""
        core, policy = self._core, self._policy
        if policy.ranks_residents:
            return BY_PRIORITY, np.ascontiguousarray(policy.priority(t, core.keys[:n_rows]), dtype=np.float64)
        rank = np.full((n_rows, self.n_slots), np.inf)
        n_free = core.free_slot[:n_rows].sum(axis=1)
        for r in np.flatnonzero(core.n_want[:n_rows] > n_free):
            layer = int(core.rows[r])
            candidates = self._state.slot_expert[layer][core.evictable[r]]
            want = int(core.n_want[r] - n_free[r])
            for place, e in enumerate(policy.choose_victims(t, layer, candidates, want)):
                rank[r, self._state.assigned[layer, e]] = place
        return BY_VICTIM_ORDER, rank
