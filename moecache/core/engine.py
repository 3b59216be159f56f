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
- Prefetch (a policy that predicts) only uses the upload budget the misses left.

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

miss_planner (moecache.core.missplan.MissPlanner, eager admission only) adds its rule to each
handover: a lane table (how many of a layer's misses take the copy-on-miss lane) and a margin
(what an upload outside the lane must beat its victim by: it must pay back its link time). The
graph's slot writes are then lane copies, computed on the device in the graph that missed them
and complete with it, and asynchronous uploads. A lane copy is due at the next boundary ahead of
every upload due there (step()'s `ready` counts completed uploads in due order, and lane
copies complete first); StepPlan.lane counts them per layer, counter lane_misses sums them (they
are misses too), counter declined counts per layer the uploads the margin declined (candidates
outside the lane whose worth beat their victim's, but not by the margin; moecache.core.admission).
Without a miss planner nothing changes.

Layers are the engine's own indices 0..n_layers-1 (the glue maps them to model layers).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .admission import ADMISSIONS, EagerAdmission, Handover
from .bookkeeping import COUNTERS, Bookkeeping, Observation
from .missplan import BUSY_DECAY
from .model import CacheModel
from .planner import UploadPlanner
from .policies import Policy
from .state import NO_JOBS, EngineState, join_jobs, read_only

__all__ = ["COUNTERS", "CacheEngine", "StepPlan"]


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
    admitted: np.ndarray = field(default_factory=lambda: NO_JOBS)
    # with a miss planner that has the lane (moecache.core.missplan): per layer, the observed
    # graph's misses computed on the device through the copy-on-miss lane (the first of
    # `admitted`, each kept in its slot); None without one
    lane: np.ndarray | None = None


def _check_arguments(n_layers, n_expert, n_slots, policy, inserts, publish_delay, offline, admission,
                     miss_planner):
    if n_layers < 1 or n_expert < 1 or not 1 <= n_slots <= n_expert:
        raise ValueError(f"need n_layers >= 1, n_expert >= 1, 1 <= n_slots <= n_expert; got "
                         f"{n_layers}, {n_expert}, {n_slots}")
    if inserts is not None and inserts < 1:
        raise ValueError(f"inserts must be >= 1 or None (unlimited), got {inserts}")
    if publish_delay < 1:
        raise ValueError(f"publish_delay must be >= 1, got {publish_delay}")
    if admission not in ADMISSIONS:
        raise ValueError(f"admission must be one of {', '.join(ADMISSIONS)}, got {admission!r}")
    if admission == "eager" and not policy.ranks_residents:
        raise ValueError(f"eager admission needs a policy that ranks experts (priority); "
                         f"{policy.name!r} picks its victims itself")
    if admission == "eager" and publish_delay != 1:
        raise ValueError(f"eager admission publishes at the next boundary: publish_delay must "
                         f"be 1, got {publish_delay}")
    if miss_planner is not None and (admission != "eager" or not policy.counts_uses):
        raise ValueError(f"a miss planner plans the graph's own copies: it needs eager admission and "
                         f"a policy whose worth counts uses (heat, lfu); got {admission}, {policy.name!r}")
    if policy.offline_only and not offline:
        raise ValueError(f"policy {policy.name!r} needs future routing: offline replay only")


def _expert_list(experts, n_expert, what) -> np.ndarray:
    experts = np.unique(np.asarray(list(experts), dtype=np.int64))
    if experts.size and (experts[0] < 0 or experts[-1] >= n_expert):
        raise ValueError(f"{what}: expert ids must be in [0, {n_expert})")
    return experts


class _UploadQueue:
    """Uploads issued and not published yet, by the boundary they are due at (the front: now)."""

    def __init__(self, core: Bookkeeping, publish_delay: int):
        self._core = core
        self._due = deque([NO_JOBS] * publish_delay)

    @property
    def n_due(self) -> int:
        """How many uploads are due now."""
        return len(self._due[0])

    def add_due(self, jobs, n_lane: int):
        """Eager admissions: due now; the first n_lane, lane copies complete with their graph,
        ahead of the ones already due, the others issued after them."""
        self._due[0] = join_jobs([jobs[:n_lane], self._due[0], jobs[n_lane:]])

    def publish(self, ready):
        """Make the uploads due now visible (the first `ready` of them, None: all); returns them
        and the late ones, which stay in flight."""
        publish = self._due.popleft()
        n = len(publish)
        if n:
            ready = self._core.publish(publish, n if ready is None else ready)
            if ready < n:
                return publish[:ready], publish[ready:]
        return publish, NO_JOBS

    def push(self, upload, late):
        """This boundary's uploads, and the late ones: issued first, so completed first, they
        go ahead of the next due uploads."""
        self._due.append(upload)
        if late.size:
            self._due[0] = join_jobs([late, self._due[0]])


class CacheEngine(CacheModel):
    """Per-layer cache of n_slots experts, decided by `policy` at each decode boundary.

    Live use: engine = CacheEngine(L, E, K, make_policy(name), inserts=2, pinned=...);
    optionally engine.preload(lists, rates); then plan = engine.step(None) at the first boundary and
    plan = engine.step(ids) at every later one. Residency for cross-checks: slot_expert
    (L, K), the expert held or being loaded per slot, -1 empty; expert_slot (L, E), the slot
    of each PUBLISHED expert, -1 otherwise; the read-only views assigned, in_flight and pinned.
    counters / stats() / usage for reporting. bookkeeping: its C side (moecache.core.bookkeeping).
    n_used: the experts a token selects, which a step of several tokens lists token by token
    (eager admission takes its last token's first); None: every step is one token.
    """

    def __init__(self, n_layers: int, n_expert: int, n_slots: int, policy: Policy, *,
                 inserts: int | None = 2, pinned=None, publish_delay: int = 1,
                 offline: bool = False, admission: str = "boundary", miss_planner=None,
                 n_used: int | None = None):
        _check_arguments(n_layers, n_expert, n_slots, policy, inserts, publish_delay, offline, admission,
                         miss_planner)
        if n_used is not None and n_used < 1:
            raise ValueError(f"n_used must be >= 1, got {n_used}")
        self.n_layers, self.n_expert, self.n_slots = n_layers, n_expert, n_slots
        self.inserts, self.publish_delay, self.admission = inserts, publish_delay, admission
        self.policy = policy
        policy.bind(n_layers, n_expert, n_slots)
        self._state = state = EngineState(n_layers, n_expert, n_slots)
        warm = [] if pinned is None else self._pin(pinned)
        self.bookkeeping = Bookkeeping(state, track_prefetch=policy.predicts)
        self._planner = UploadPlanner(state, self.bookkeeping, policy, inserts, warm)
        self._eager = EagerAdmission(state, self.bookkeeping, policy, inserts, miss_planner, n_used) \
            if admission == "eager" else None
        self.miss_planner = miss_planner
        if miss_planner is None:  # the planner's counters only where it runs
            del state.counters["declined"], state.counters["lane_misses"]
        else:  # the C's observation models each decode graph for it
            if not miss_planner.lane:
                del state.counters["lane_misses"]
            self.bookkeeping.model_graphs(miss_planner.token_table, miss_planner.layer_group,
                                          miss_planner.expert_bytes, miss_planner.rates.link_gbps, BUSY_DECAY)
        self._beside = NO_JOBS  # the last decode boundary's uploads, which ran beside the next graph
        self._queue = _UploadQueue(self.bookkeeping, publish_delay)
        self.slot_expert, self.expert_slot, self.usage = state.slot_expert, state.expert_slot, state.usage
        self.assigned = read_only(state.assigned)    # (L, E) slot of each published or in-flight expert
        self.in_flight = read_only(state.in_flight)  # (L, K)
        self.pinned = read_only(state.pinned)        # (L, E)
        self.counters = state.counters
        self.step_index = 0

    def _pin(self, pinned) -> list[np.ndarray]:
        """Mark the pinned experts; returns them per layer, to upload first."""
        if len(pinned) != self.n_layers:
            raise ValueError(f"pinned has {len(pinned)} layers, expected {self.n_layers}")
        for layer, experts in enumerate(pinned):
            experts = _expert_list(experts, self.n_expert, f"pinned[{layer}]")
            if experts.size > self.n_slots - 1:
                raise ValueError(f"pinned[{layer}] has {experts.size} experts; at most "
                                 f"n_slots - 1 = {self.n_slots - 1} leaves room for misses")
            self._state.pinned[layer, experts] = True
        return [np.flatnonzero(row) for row in self._state.pinned]

    @property
    def handover(self) -> Handover | None:
        """Eager admission: what the graph about to run follows (None before the first step,
        and with admission at the boundary)."""
        return None if self._eager is None else self._eager.handover

    def preload(self, per_layer_experts, rates=None) -> None:
        """Warm start: upload these experts (best first, up to the free slots of each layer,
        ignoring INSERTS) at the next boundary, after the pinned ones. rates: optional
        (n_layers, n_expert) uses per step from earlier runs, handed to a policy that takes a
        prior before the first step."""
        if len(per_layer_experts) != self.n_layers:
            raise ValueError(f"preload has {len(per_layer_experts)} layers, expected {self.n_layers}")
        waiting, lists = self._planner.warm, []
        for layer, experts in enumerate(per_layer_experts):
            ordered = np.asarray(list(experts), dtype=np.int64)
            _expert_list(ordered, self.n_expert, f"preload[{layer}]")
            if waiting:  # pinned experts still waiting go first
                ordered = np.concatenate((waiting[layer], ordered))
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
            if self.policy.takes_prior:
                self.policy.prior(rates)
        self._planner.warm = lists

    # --- the boundary -------------------------------------------------------------------

    def step(self, ids=None, ready: int | None = None, admitted=None, prefill: bool = False,
             lane_rows: int = 0, declined=None) -> StepPlan:
        """ids: (n_layers, n_used) int expert ids the previous graph selected, router-rank
        order (-1 = no selection), or None at the first boundary. ready: how many of the
        uploads due now are complete, counted in the order they were issued (the live glue
        reads it off the upload worker, which completes them in that order); the others stay
        in flight, unpublished and unevictable, and are due again at the next boundary.
        None: all of them (offline replay, or a glue that waited). Eager admission: the
        uploads due are the graph's lane copies (complete), the boundary's from the last
        boundary, then the graph's uploads; admitted: the slot writes libllama reports (rows of
        admission.admissions), of which the first lane_rows are lane copies, then the uploads
        in the order it started them, and declined, per layer the uploads its margin declined
        (with a miss planner); None: the modelled ones. prefill: ids are a prompt ubatch the
        stock graph ran (see the module docstring)."""
        t = self.step_index
        self.step_index += 1
        if prefill and (ids is None or (admitted is not None and len(admitted)) or lane_rows):
            raise ValueError("a prefill step needs the prompt's ids, and the stock graph admits nothing")
        ids = None if ids is None else np.asarray(ids)
        # the graph's slot writes first: the observation models them
        writes = None if ids is None or prefill else self._graph_writes(ids, admitted, lane_rows, declined)
        seen = None if ids is None else self._observe(t, ids, lookups=not prefill, writes=writes)
        taken, taken_evict = (NO_JOBS, NO_JOBS) if writes is None else self._take_admissions(t, *writes[:2])
        publish, late = self._queue.publish(ready)
        if prefill:
            evict, upload = self._planner.plan_prompt(t, seen.ids)
        else:
            evict, upload = self._planner.plan(t, seen, upload_misses=self._eager is None, spent=taken)
        if taken_evict.size:
            evict = join_jobs([taken_evict, evict])
        self._queue.push(upload, late)
        # a decode boundary's uploads run beside the next graph, on the link its observation models
        # (a prompt's and the first boundary's fill the cache once: not the decode's traffic)
        self._beside = upload if seen is not None and not prefill else NO_JOBS
        if self._eager is not None:
            self._eager.hand_over(t)
        if seen is None:
            return StepPlan(t, None, np.zeros(self.n_layers, dtype=np.int64),
                            np.zeros(self.n_layers, dtype=np.int64), publish, evict, upload, taken)
        lane = seen.lane if self.miss_planner is not None and self.miss_planner.lane else None
        return StepPlan(t, seen.hit_mask, seen.hits, seen.misses, publish, evict, upload, taken, lane)

    def _observe(self, t, ids, lookups, writes=None) -> Observation:
        """Count the observed step (hits unless it made no lookups: a prompt) and hand it to the
        policy; with a miss planner, a decode graph's slot writes (_graph_writes) and the
        uploads that ran beside it are modelled too (Bookkeeping.model_graphs)."""
        if self.miss_planner is None:
            seen = self.bookkeeping.observe(ids, lookups)
        else:
            jobs, n_lane, declined = (NO_JOBS, 0, None) if writes is None else writes
            seen = self.bookkeeping.observe(ids, lookups, jobs, n_lane, self._beside, declined)
            if seen.graph_ms < 0 and lookups:  # several tokens' counts: the formula
                graph_ms = self.miss_planner.graph_ms(seen.hits, seen.lane, seen.misses)
                self.bookkeeping.link_update(graph_ms, seen.link_ms)
        self.policy.observe(t, ids, seen.hit_mask, self._state.used)
        return seen

    def _graph_writes(self, ids, reported, lane_rows, reported_declined):
        """Eager: the slot writes the observed graph made under the last handover (lane copies
        first), their number of lane copies and the uploads the margin declined per layer;
        None without a handover."""
        if self._eager is None or self._eager.handover is None:
            if lane_rows:
                raise ValueError("lane_rows needs eager admission and a handover with a lane")
            return None
        return self._eager.admitted(ids, reported, lane_rows, reported_declined)

    def _take_admissions(self, t, admitted, n_lane):
        """Eager: commit the graph's slot writes (_graph_writes), due now (lane copies first).
        Returns them and their victims."""
        if not admitted.size:
            return admitted, NO_JOBS
        evict = self._planner.commit(t, admitted, False)
        self._queue.add_due(admitted, n_lane)
        return admitted, evict

    @property
    def uploads_due(self) -> int:
        """How many uploads the next step() publishes (when they are complete)."""
        return self._queue.n_due

    # --- reporting ----------------------------------------------------------------------

    def stats(self, expert_bytes=None) -> dict:
        """The totals every report uses (live stats, replay results): "totals", the counters
        summed over layers; "hit_rate", hits / lookups as a FRACTION (None before any lookup);
        "layers", each counter per layer. With expert_bytes (per layer), totals also carry
        "upload_bytes", "miss_bytes", "lookup_bytes" and "prefill_upload_bytes" (exact:
        Python integers)."""
        report = super().stats()
        layers = {name: v.tolist() for name, v in self.counters.items()}
        if expert_bytes is not None:
            if len(expert_bytes) != self.n_layers:
                raise ValueError(f"expert_bytes has {len(expert_bytes)} layers, expected {self.n_layers}")
            for name, counts in (("upload_bytes", layers["uploads"]), ("miss_bytes", layers["misses"]),
                                 ("prefill_upload_bytes", layers["prefill_uploads"]),
                                 ("lookup_bytes", [h + m for h, m in zip(layers["hits"], layers["misses"])])):
                report["totals"][name] = sum(n * int(size) for n, size in zip(counts, expert_bytes))
        report["layers"] = layers
        return report
