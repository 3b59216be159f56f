"""The offline simulator: simulate() replays a routing trace through one cache model, and is
the one driver that every offline tool runs (the command line, moecache.offline.cli; the
scripts; the tests). The trace adapter (moecache.offline.steps) turns the trace into the
model's steps; simulate() builds the model (a moecache.core.model.CacheModel), feeds it the
steps, reads its own counters at the phase changes and tallies each decode layer pass for the
timeline cost model (moecache.offline.cost.WorkTally).

Four models (MODELS, each with its policy registry), each run by simulate(trace, replay) with
the replay that names it and its settings:

PerLayerReplay(policy, slots): our live cache, K slots per layer. It runs
    moecache.core.engine.CacheEngine itself, the code the live glue calls, at most `inserts`
    uploads per layer per step, with either admission timing: "boundary" uploads a miss at the
    next boundary (one-step publication delay, experts of the step just observed protected),
    "eager" while the graph that missed it runs (moecache.core.admission). prefill: "warm"
    (default) feeds each prompt ubatch (of 512 tokens, or as recorded) as a prefill step, as the
    live cache does (engine.step(ids, prefill=True): no lookups, up to K of the prompt's experts
    uploaded, counted apart); "off" feeds no prefill; "plain" feeds each turn's prompt as one
    batched observation of the cache, lookups and uploads counted as any other; "lookup" looks
    each prompt ubatch up as a decode step is (the RAM tier's).
UpstreamReplay(policy, budget_mib) (policies "upstream", tag b12191's ClassLRU, and
    "upstream-b11480", its plain LRU): upstream llama.cpp's own cache (moecache.offline.upstream),
    prompts in ubatches of 512 tokens, then one ubatch per decode token; cpu_share: b12191's
    --moe-cache-cpu-share F (tuned_upstream: each share its tuner picks from).
PageCacheReplay(policy, budget_mib, read_ahead_kb) (policies "lru", "two-list"): stock mmap's
    page cache of a model larger than RAM (moecache.offline.pagecache): the file's 4 KiB pages
    under LRU or the kernel's two lists, with its mmap readahead (the device's read_ahead_kb),
    every ubatch read through the mapping; the reference beside the RAM tier's model, which is
    the per-layer model sized by RAM_MIB's rule (ram_slots), eager admission with INSERTS = K
    and prefill "lookup" (every prompt ubatch looked up and its misses read, as the live tier
    runs it).
GlobalReplay(policy, budget_mib): BigMoeOnEdge's route-replay model (moecache.offline.budget).
    One cache over (layer, expert) entries budgeted in bytes (expert sizes from the preamble),
    immediate admission, no insert limit; batches are one per layer for a turn's whole
    prefill, then one per layer per decode token; one lookup per distinct expert per batch;
    eviction after each batch, sparing the batch's own experts. Its cumulative hit rate
    includes prefill, as that project reports.

Rates are fractions (hit_rate 0.578), as in engine.stats() and the live stats, computed by
moecache.core.model.hit_rate. ReplayResult also gives MODELLED milliseconds per decode token
(moecache.offline.cost) on any hardware class, of the run and of stock --cpu-moe on its
routing, and (disk_ms) of the RAM tier's and the page cache's runs on the CPU over a disk. With
miss_plan (Rates; PerLayerReplay, eager admission) the engine plans each graph's misses at those
rates (moecache.core.missplan): the handover carries its rule, the copy-on-miss lane and the
paying uploads, as the live planner runs it (LLAMA_MOE_CACHE_PLANNER=1); with lane=False the
paying uploads alone (every miss on the CPU).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterable

import numpy as np

from ..core.admission import live_admission
from ..core.banks import equal_bytes, ram_slots, slots_for_budget
from ..core.engine import CacheEngine
from ..core.hardware import Hardware
from ..core.missplan import (OUR_LAYOUT, STOCK_LAYOUT, UPSTREAM_CPU_SHARE_LAYOUT, UPSTREAM_LAYOUT, MissPlanner,
                             Rates, planner_by_default)
from ..core.model import hit_rate
from ..core.policies import POLICIES, Policy, make_policy, resolve_policy
from ..formats.profile import UsageProfile
from ..formats.traces import DECODE, RouteTrace
from ..util import require_memory
from . import steps
from .budget import BUDGET_POLICIES, BudgetPolicy, ByteBudgetCache, make_budget_policy
from .cost import Disk, WorkTally
from .pagecache import PAGE, PAGE_POLICIES, PAGE_TABLE_BYTES, ExpertLayout
from .readahead import ReadAhead
from .spares import Spares
from .steps import GLOBAL, PAGE_CACHE, PER_LAYER, PREFILL_MODES, UPSTREAM
from .upstream import TUNER_SHARES, UPSTREAM_POLICIES, UpstreamCache

MIB = 1 << 20
MODELS = {PER_LAYER: POLICIES, GLOBAL: BUDGET_POLICIES, UPSTREAM: UPSTREAM_POLICIES, PAGE_CACHE: PAGE_POLICIES}
ENGINE_BYTES_PER_ENTRY = 48  # the engine's and a policy's (layer, expert) tables, per entry


def policy_names(model: str) -> list[str]:
    """The names a model accepts: its registry's, and "default" for the per-layer model."""
    return (["default"] if model == PER_LAYER else []) + list(MODELS[model])


@dataclass
class ReplayResult:
    """One replay. totals: the decode observations' counters (CacheEngine.stats() names,
    upload_bytes included); totals_all: every observation's (prefill when fed, and the
    warm start's uploads; per-layer prefill="warm": prefill_upload_bytes). Rates are
    fractions, None without lookups."""

    model: str
    policy: str
    decode_tokens: int          # the trace's decode tokens: what a figure per token divides by
    decode_steps: int           # the decode steps the model took: per-layer and page-cache one per
                                # recorded ubatch (the live stats' decode_steps), else one per token
    totals: dict
    totals_all: dict
    seconds: float
    turns: int
    work: WorkTally | None                  # decode layer passes (global: None)
    step_seconds: np.ndarray | None = None  # with simulate(step_times=True)
    # the model's settings
    slots: int | None = None                # per-layer K (upstream: the K whose device bytes it was given)
    budget_mib: float | None = None         # global, upstream and page-cache budget; per-layer: the budget its K fits
    inserts: int | None = None              # per-layer; None: unlimited (and for the other models)
    admission: str | None = None            # per-layer: the engine's admission timing
    prefill: str | None = None              # per-layer: PREFILL_MODES
    ram_mib: float | None = None            # the RAM tier's and the page cache's budget (set by the caller)
    read_ahead: ReadAhead | None = None     # per-layer: the decode read-ahead's timeline and counts
    cpu_share: float | None = None          # upstream: --moe-cache-cpu-share F

    @property
    def hit_rate(self) -> float | None:
        return hit_rate(self.totals["hits"], self.totals["misses"])

    @property
    def hit_rate_all(self) -> float | None:
        return hit_rate(self.totals_all["hits"], self.totals_all["misses"])

    @property
    def lookups(self) -> int:
        return self.totals_all["hits"] + self.totals_all["misses"]

    @property
    def upload_bytes_per_token(self) -> float | None:
        return self.totals["upload_bytes"] / self.decode_tokens if self.decode_tokens else None

    @property
    def prefill_upload_bytes_per_turn(self) -> float | None:
        """Bytes the prompts' prefill steps uploaded (per-layer prefill="warm"), per turn."""
        return self.totals_all.get("prefill_upload_bytes", 0) / self.turns if self.turns else None

    @property
    def lookups_per_s(self) -> float:
        return self.lookups / self.seconds if self.seconds > 0 else float("inf")

    def modelled_ms(self, hardware: Hardware) -> float | None:
        """MODELLED milliseconds per decode token of this cache (moecache.offline.cost); None for
        the global model, whose cost is not modelled, or without decode tokens."""
        if self.work is None or not self.decode_tokens:
            return None
        return self.work.token_ms(hardware.rates, self.decode_tokens)

    def disk_reads(self) -> tuple[int, int]:
        """(bytes read from the model file, reads a layer waited for) in the decode tokens, of a
        RAM tier run (per-layer: every miss read, each layer's misses at once, and every
        upload issued at a boundary, a read too) or a page-cache run (its pages read, a wait
        per fault)."""
        if self.model == PAGE_CACHE:
            return self.totals["upload_bytes"], self.totals["faults"]
        if self.model != PER_LAYER:
            raise ValueError(f"the {self.model} model reads nothing from a disk")
        waits = sum(passes for (_, _, lane, cpu), passes in self.work.passes.items() if lane + cpu)
        read = self.totals["miss_bytes"] - self.totals.get("spare_miss_bytes", 0)
        return read + self.work.boundary_upload_bytes, waits

    def disk_ms(self, host_gbps: float, disk: Disk) -> float | None:
        """MODELLED milliseconds per decode token of a RAM tier or page-cache run, every expert
        computed on the CPU at host_gbps, its reads from `disk` (cost.Disk: the tier computes a
        layer's kept experts while its misses are read, a page fault waits); None without decode
        tokens."""
        if not self.decode_tokens:
            return None
        if self.model == PER_LAYER:
            return disk.tier_token_ms(host_gbps, self.work, self.decode_tokens)
        return disk.token_ms(host_gbps, self.work.compute_bytes(), *self.disk_reads(), self.decode_tokens)

    def stock_ms(self, hardware: Hardware) -> float | None:
        """MODELLED milliseconds per decode token of llama.cpp's stock --cpu-moe on the same
        routing (every selected expert on the CPU)."""
        if self.work is None or not self.decode_tokens:
            return None
        return self.work.as_stock().token_ms(hardware.rates, self.decode_tokens)


@dataclass
class _Run:
    """A model ready to replay: what the driver steps, and what the result reports of it."""

    label: str                                # the policy's name as the result shows it
    steps: tuple[Callable, Callable]          # (prompt step, decode step)
    segments: Iterable                        # moecache.offline.steps.segments of the model
    totals: Callable[[], dict]                # the model's own counters, now
    work: WorkTally | None                    # decode layer passes (global: None)
    settings: dict                            # the ReplayResult fields the model's settings give
    finish: Callable[[], None] = lambda: None


@dataclass(frozen=True)
class PerLayerReplay:
    """The per-layer model (module docstring). policy: a name of POLICIES ("default":
    DEFAULT_POLICY), a Policy, or a prepared CacheEngine not stepped yet, which brings its own
    slots, inserts, admission, warm start and miss planner. profile: a warm start as the live
    cache does it (the profile's top experts preloaded, its rates the policy's prior). miss_plan:
    the engine plans each graph's misses at these Rates (moecache.core.missplan; eager
    admission); lane=False: without the copy-on-miss lane, the paying uploads alone. read_ahead
    (moecache.offline.readahead): times the decode with the RAM tier reading ahead, fed every
    token and the engine's outcome. seed: the random policy's."""

    model: ClassVar[str] = PER_LAYER
    policy: str | Policy | CacheEngine
    slots: int | None = None
    inserts: int | None = 2
    admission: str = "boundary"
    prefill: str = "warm"
    profile: UsageProfile | None = None
    miss_plan: Rates | None = None
    lane: bool = True
    read_ahead: ReadAhead | None = None
    spares: bool = False
    seed: int = 0

    def start(self, trace: RouteTrace) -> _Run:
        if self.prefill not in PREFILL_MODES:
            raise ValueError(f"prefill must be one of {', '.join(PREFILL_MODES)}, got {self.prefill!r}")
        engine, label = self._engine(trace)
        work = WorkTally(OUR_LAYOUT, trace.expert_bytes, trace.dense_bytes)
        read_ahead = self.read_ahead
        spares = Spares(trace.expert_bytes, trace.n_expert, trace.n_expert_used,
                        whole_prompts=read_ahead is None or read_ahead.name == "none") if self.spares else None
        spare_reads = {"spare_miss_bytes": 0}  # the misses' bytes found among the spares, not read
        sizes = np.asarray(trace.expert_bytes, dtype=np.int64)

        def step_with_spares(ids, **flags):
            """engine.step, and the misses and boundary uploads that found their expert among the
            spares: (plan, (like ids) bool, (L,) counts)."""
            plan = engine.step(ids, **flags)
            if spares is None or plan.hit_mask is None:
                return plan, None, None
            found = spares.found(ids, plan.hit_mask)
            spare_reads["spare_miss_bytes"] += int(found.sum(axis=1) @ sizes)
            ids = np.asarray(ids)
            spares.retire(ids, plan.hit_mask, np.concatenate([plan.admitted, plan.upload]), plan.evict,
                          engine.expert_slot >= 0)
            return plan, found, spares.found_uploads(plan.upload)

        def decode_step(ids):
            kept = None if read_ahead is None else engine.expert_slot >= 0  # what this graph finds in memory
            in_memory = None if read_ahead is None or spares is None else spares.in_memory()
            plan, found, found_uploads = step_with_spares(ids)
            _tally_plan(work, plan, found, found_uploads)
            if read_ahead is not None:
                uploads = np.bincount(plan.upload[:, 0], minlength=len(kept))
                read_ahead.decode(ids, plan.hit_mask, kept, uploads if found_uploads is None else uploads - found_uploads,
                                  in_memory)

        # a warm prompt is a prefill step, a plain one an observation
        if self.prefill == "warm":
            prompt_step = functools.partial(engine.step, prefill=True)
        else:
            def prompt_step(ids):
                return step_with_spares(ids)[0]
        if read_ahead is not None:
            read_ahead.bind(trace.expert_bytes, trace.dense_bytes, trace.n_expert, trace.n_expert_used)
            prompt_step = _reading_prompts(read_ahead, prompt_step)
        settings = {"slots": engine.n_slots, "inserts": engine.inserts, "admission": engine.admission,
                    "prefill": self.prefill, "read_ahead": read_ahead}
        return _Run(label, (prompt_step, decode_step), steps.segments(trace, PER_LAYER, self.prefill),
                    lambda: engine.stats(trace.expert_bytes)["totals"] | spare_reads, work, settings,
                    read_ahead.finish if read_ahead is not None else lambda: None)

    def _engine(self, trace):
        """(the engine after its first boundary, the policy's label)."""
        if isinstance(self.policy, CacheEngine):
            engine = self.policy
            if self.slots is not None or self.profile is not None or self.admission != "boundary" \
                    or engine.step_index or self.miss_plan is not None:
                raise ValueError("a prepared engine brings its own size, admission, warm start and miss "
                                 "planner, and must not have been stepped")
            engine.step(None)
            return engine, engine.policy.name
        slots = self.slots
        if not isinstance(slots, (int, np.integer)) or not 1 <= slots <= trace.n_expert:
            raise ValueError(f"slots must be an integer in [1, n_expert={trace.n_expert}], got {slots!r}")
        L, E = trace.layers.size, trace.n_expert
        require_memory(ENGINE_BYTES_PER_ENTRY * L * E, f"{trace.path}: the cache engine's {L} layers x {E} experts")
        policy, label = self._policy(trace)
        planner = None if self.miss_plan is None else MissPlanner(
            self.miss_plan, trace.expert_bytes, trace.dense_bytes, n_used=trace.n_expert_used, lane=self.lane)
        engine = CacheEngine(L, E, int(slots), policy, inserts=self.inserts, offline=True,
                             admission=self.admission, miss_planner=planner, n_used=trace.n_expert_used)
        if self.profile is not None:
            engine.preload(self.profile.top(slots), rates=self.profile.rates(trace.n_expert_used))
        engine.step(None)
        return engine, label

    def _policy(self, trace):
        """(the Policy, its label)."""
        if isinstance(self.policy, Policy):
            return self.policy, self.policy.name
        if not isinstance(self.policy, str):
            raise ValueError(f"policy must be a name, a Policy or a CacheEngine, got {self.policy!r}")
        name = resolve_policy(self.policy)
        future = steps.future(trace, PER_LAYER, self.prefill) if _reads_ahead(POLICIES, name) else None
        label = self.policy if self.policy != "default" else f"default({name})"
        return make_policy(self.policy, future=future, seed=self.seed), label


def _reading_prompts(read_ahead: ReadAhead, prompt_step):
    """The prompt step, with the read-ahead fed each prompt first."""
    def step(ids):
        read_ahead.prompt(ids)
        return prompt_step(ids)
    return step


@dataclass(frozen=True)
class GlobalReplay:
    """The global byte-budget model (module docstring): policy a name of BUDGET_POLICIES or a
    BudgetPolicy; seed: the random policy's."""

    model: ClassVar[str] = GLOBAL
    policy: str | BudgetPolicy
    budget_mib: float
    seed: int = 0

    def start(self, trace: RouteTrace) -> _Run:
        budget = _budget_bytes(GLOBAL, self.budget_mib)
        if isinstance(self.policy, str):
            future = steps.future(trace, GLOBAL) if _reads_ahead(BUDGET_POLICIES, self.policy) else None
            label, policy = self.policy, make_budget_policy(self.policy, future=future, seed=self.seed)
        elif isinstance(self.policy, BudgetPolicy):
            label, policy = self.policy.name, self.policy
        else:
            raise ValueError(f"policy must be a name or a BudgetPolicy, got {self.policy!r}")
        cache = ByteBudgetCache(policy, budget, trace.expert_bytes, trace.n_expert)
        return _Run(label, (cache.step, cache.step), steps.segments(trace, GLOBAL), cache.totals, None,
                    {"budget_mib": self.budget_mib})


@dataclass(frozen=True)
class UpstreamReplay:
    """Upstream llama.cpp's cache (module docstring) by version (UPSTREAM_POLICIES), under a
    budget in MiB (equal_bytes() gives a K's); cpu_share: b12191's --moe-cache-cpu-share F."""

    model: ClassVar[str] = UPSTREAM
    policy: str
    budget_mib: float
    cpu_share: float = 0.0

    def start(self, trace: RouteTrace) -> _Run:
        if self.policy not in MODELS[UPSTREAM]:
            raise ValueError(f"unknown policy {self.policy!r} for the upstream model; valid: "
                             f"{', '.join(MODELS[UPSTREAM])}")
        cache = UpstreamCache(trace.expert_bytes, trace.n_expert, trace.n_expert_used,
                              _budget_bytes(UPSTREAM, self.budget_mib), pool=MODELS[UPSTREAM][self.policy],
                              cpu_share=self.cpu_share)
        work = WorkTally(UPSTREAM_CPU_SHARE_LAYOUT if self.cpu_share else UPSTREAM_LAYOUT, trace.expert_bytes,
                         trace.dense_bytes)

        def decode_step(ubatch):
            work.add(*cache.step(ubatch))
        return _Run(self.policy, (cache.step, decode_step), steps.segments(trace, UPSTREAM), cache.totals, work,
                    {"budget_mib": self.budget_mib, "cpu_share": self.cpu_share})


@dataclass(frozen=True)
class PageCacheReplay:
    """Stock mmap's page cache (module docstring) under a reclaim policy (PAGE_POLICIES), a
    budget in MiB and the device's read_ahead_kb."""

    model: ClassVar[str] = PAGE_CACHE
    policy: str
    budget_mib: float
    read_ahead_kb: int

    def start(self, trace: RouteTrace) -> _Run:
        if self.policy not in MODELS[PAGE_CACHE]:
            raise ValueError(f"unknown policy {self.policy!r} for the page-cache model; valid: "
                             f"{', '.join(MODELS[PAGE_CACHE])}")
        read_ahead_kb = self.read_ahead_kb
        if isinstance(read_ahead_kb, bool) or not isinstance(read_ahead_kb, (int, np.integer)) or read_ahead_kb < 0:
            raise ValueError(f"the page-cache model needs read_ahead_kb, an integer >= 0, got {read_ahead_kb!r}")
        layout = ExpertLayout(trace.expert_bytes, trace.n_expert)
        pages = -(-layout.file_bytes // PAGE)
        require_memory(PAGE_TABLE_BYTES * pages, f"{trace.path}: the page cache model's {pages} pages")
        cache = PAGE_POLICIES[self.policy](layout, _budget_bytes(PAGE_CACHE, self.budget_mib), int(read_ahead_kb))
        work = WorkTally(STOCK_LAYOUT, trace.expert_bytes, trace.dense_bytes)
        no_device = np.zeros(trace.layers.size, dtype=np.int64)

        def decode_step(ids):
            work.add_layers(no_device, no_device, cache.step(ids))
        return _Run(self.policy, (cache.step, decode_step), steps.segments(trace, PER_LAYER, "lookup"),
                    cache.totals, work, {"budget_mib": self.budget_mib, "prefill": "lookup"})


def simulate(trace: RouteTrace, replay, *, step_times: bool = False, before_step=None) -> ReplayResult:
    """Replay `trace` (RouteTrace.from_routing makes one of bare routing) through the model
    `replay` names with its settings: a PerLayerReplay, GlobalReplay, UpstreamReplay or
    PageCacheReplay. step_times: keep each step's duration; before_step: called before each
    step (a benchmark evicting the CPU caches)."""
    run = replay.start(trace)
    decode, final, seconds, times = _drive(run.steps, run.totals, run.segments, step_times, before_step)
    run.finish()
    tokens = int((trace.phase == DECODE).sum())
    # the per-layer and page-cache models step once per recorded ubatch, the others per token
    decode_steps = steps.decode_steps(trace) if replay.model in (PER_LAYER, PAGE_CACHE) else tokens
    return ReplayResult(replay.model, run.label, tokens, decode_steps, decode, final, seconds,
                        len(steps.turns(trace)), run.work, times, **run.settings)


def zero_configuration(trace: RouteTrace, slots: int, rates: Rates) -> ReplayResult:
    """What LLAMA_MOE_CACHE_SLOTS=K alone runs on a machine whose attach measured `rates`: the
    default policy at its live admission, INSERTS 2, the prompt warming the cache, and the miss
    planner where moecache.core.missplan.planner_by_default turns it on."""
    policy = POLICIES[resolve_policy("default")]
    admission = live_admission(policy)
    return simulate(trace, PerLayerReplay("default", slots, admission=admission, prefill="warm",
                                          miss_plan=rates if planner_by_default(policy, admission) else None))


def _tally_plan(work: WorkTally, plan, found=None, found_uploads=None) -> None:
    """A decode boundary's StepPlan as the observed graph's layer passes: hits on the device,
    the lane's misses, the others on the CPU; every upload but the lane's copies is
    asynchronous. The RAM tier's spares (found, found_uploads: Spares'): a miss found in memory
    runs as a hit does, and a boundary upload found there reads nothing."""
    L = len(plan.hits)
    lane = np.zeros(L, dtype=np.int64) if plan.lane is None else plan.lane
    in_memory = 0 if found is None else found.sum(axis=1)
    work.add_layers(plan.hits + in_memory, lane, plan.misses - lane - in_memory)
    uploads = np.bincount(plan.admitted[:, 0], minlength=L) + np.bincount(plan.upload[:, 0], minlength=L)
    work.add_async(uploads - lane)
    work.add_boundary_uploads(np.bincount(plan.upload[:, 0], minlength=L) - (0 if found_uploads is None else found_uploads))


def _drive(step_of, totals, segments, step_times, before_step):
    """Step through the segments, with step_of[is_decode]; the decode totals are the sum of the
    decode segments' differences of totals(), the cache's own counters."""
    times = [] if step_times else None
    decode = None
    start = time.perf_counter()
    before = totals()
    for is_decode, items in segments:
        step = step_of[is_decode]
        if times is None and before_step is None:
            for item in items:
                step(item)
        else:
            for item in items:
                if before_step is not None:
                    before_step()
                t0 = time.perf_counter()
                step(item)
                if times is not None:
                    times.append(time.perf_counter() - t0)
        after = totals()
        if is_decode:
            delta = {name: after[name] - before[name] for name in after}
            decode = delta if decode is None else {name: decode[name] + delta[name] for name in delta}
        before = after
    seconds = time.perf_counter() - start
    if decode is None:
        decode = dict.fromkeys(before, 0)
    return decode, before, seconds, None if times is None else np.array(times)


def _reads_ahead(registry, name) -> bool:
    """Whether the named policy reads the future (its NextUse, some 16 bytes a lookup, is built
    for it only); an unknown name is its factory's to refuse."""
    factory = registry.get(name)
    return factory is not None and factory.offline_only


def _budget_bytes(model, budget_mib):
    """The byte budget of a model sized in MiB."""
    if isinstance(budget_mib, bool) or not isinstance(budget_mib, (int, float, np.number)) \
            or not math.isfinite(budget_mib) or budget_mib <= 0:
        raise ValueError(f"the {model} model's size is a finite budget in MiB > 0, got {budget_mib!r}")
    return int(budget_mib * MIB)


def tuned_upstream(trace: RouteTrace, budget_mib: float, policy: str = "upstream") -> list[ReplayResult]:
    """The upstream model at each CPU share its tuner picks from (scripts/moe-cache-tune.py's);
    fastest() then gives its tuner's best on a hardware class."""
    return [simulate(trace, UpstreamReplay(policy, budget_mib, cpu_share=share)) for share in TUNER_SHARES]


def fastest(results, hardware: Hardware) -> ReplayResult:
    """The result with the fewest modelled milliseconds per decode token on `hardware` (the
    first of equals)."""
    return min(results, key=lambda r: r.modelled_ms(hardware))


def ram_tier_slots(trace: RouteTrace, ram_mib: float) -> int:
    """The RAM tier's K at RAM_MIB=ram_mib (moecache.live.ramtier's rule, banks.ram_slots)."""
    k = ram_slots(trace.expert_bytes, trace.n_expert, int(ram_mib * MIB))
    if k == 0:
        raise ValueError(f"--ram-mib {ram_mib:g} keeps fewer than one expert per layer, which takes "
                         f"{int(trace.expert_bytes.sum()) / MIB:.1f} MiB")
    return k


def ram_tier_replay(policy: str, slots: int, admission: str, read_ahead: ReadAhead | None = None,
                    seed: int = 0) -> PerLayerReplay:
    """The RAM tier as the live one runs: K kept per layer, INSERTS = K, every prompt ubatch
    looked up (its misses read), the experts it read and did not keep spares while its room
    allows (moecache.offline.spares)."""
    return PerLayerReplay(policy, slots, inserts=slots, admission=admission, prefill="lookup", seed=seed,
                          read_ahead=read_ahead, spares=True)


def per_layer_slots(trace: RouteTrace, budget_mib: float) -> int:
    """The per-layer model's K at a budget: the largest whose device bytes (equal_bytes) fit it."""
    k = slots_for_budget(lambda k: equal_bytes(trace.expert_bytes, k), int(budget_mib * MIB), trace.n_expert)
    if k == 0:
        raise ValueError(f"--budget-mib {budget_mib:g} is below one slot per layer for the per-layer "
                         f"model: this trace needs at least {math.ceil(equal_bytes(trace.expert_bytes, 1) / MIB)} MiB")
    return k
