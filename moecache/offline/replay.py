"""The offline simulator: simulate() replays a routing trace through one cache model, and is
the one driver that every offline tool runs (the command line, moecache.offline.cli; the
scripts; the tests). The trace adapter (moecache.offline.steps) turns the trace into the
model's steps; simulate() builds the model (a moecache.core.model.CacheModel), feeds it the
steps, reads its own counters at the phase changes and tallies each decode layer pass for the
timeline cost model (moecache.offline.cost.WorkTally).

Three models (MODELS, each with its policy registry):

per-layer (size: K slots per layer): our live cache. It runs moecache.core.engine.CacheEngine
    itself, the code the live glue calls, at most `inserts` uploads per layer per step, with
    either admission timing: "boundary" uploads a miss at the next boundary (one-step
    publication delay, experts of the step just observed protected), "eager" while the graph
    that missed it runs (moecache.core.admission). prefill: "warm" (default) feeds each prompt
    ubatch (of 512 tokens, or as recorded) as a prefill step, as the live cache does
    (engine.step(ids, prefill=True): no lookups, up to K of the prompt's experts uploaded,
    counted apart); "off" feeds no prefill; "plain" feeds each turn's prompt as one batched
    observation of the cache, lookups and uploads counted as any other.
upstream (policies "upstream", tag b12191's ClassLRU, and "upstream-b11480", its plain LRU;
    size: a budget in MiB): upstream llama.cpp's own cache (moecache.offline.upstream), prompts
    in ubatches of 512 tokens, then one ubatch per decode token; cpu_share: b12191's
    --moe-cache-cpu-share F (tuned_upstream: each share its tuner picks from).
page-cache (policies "lru", "two-list"; size: a budget in MiB): stock mmap's page cache of a
    model larger than RAM (moecache.offline.pagecache): the file's 4 KiB pages under LRU or the
    kernel's two lists, with its mmap readahead (read_ahead_kb), every ubatch read through the
    mapping; the reference beside the
    RAM tier's model, which is the per-layer model sized by RAM_MIB's rule (ram_slots), eager
    admission with INSERTS = K and prefill "lookup" (every prompt ubatch looked up and its
    misses read, as the live tier runs it).
global (size: a budget in MiB): BigMoeOnEdge's route-replay model (moecache.offline.budget).
    One cache over (layer, expert) entries budgeted in bytes (expert sizes from the preamble),
    immediate admission, no insert limit; batches are one per layer for a turn's whole
    prefill, then one per layer per decode token; one lookup per distinct expert per batch;
    eviction after each batch, sparing the batch's own experts. Its cumulative hit rate
    includes prefill, as that project reports.

Rates are fractions (hit_rate 0.578), as in engine.stats() and the live stats, computed by
moecache.core.model.hit_rate. ReplayResult also gives MODELLED milliseconds per decode token
(moecache.offline.cost) on any hardware class, of the run and of stock --cpu-moe on its
routing, and (disk_ms) of the RAM tier's and the page cache's runs on the CPU over a disk. With
miss_plan (Rates; per-layer, eager admission) the engine plans each graph's misses at those
rates (moecache.core.missplan): the handover carries its rule, the copy-on-miss lane and the
paying uploads, as the live planner runs it (LLAMA_MOE_CACHE_PLANNER=1); with lane=False the
paying uploads alone (every miss on the CPU).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass

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
    slots: int | None           # per-layer K (upstream: the K whose device bytes it was given)
    budget_mib: float | None    # global, upstream and page-cache budget; per-layer: the budget its K fits
    inserts: int | None         # per-layer; None: unlimited (and for the other models)
    decode_tokens: int          # the trace's decode tokens: what a figure per token divides by
    decode_steps: int           # the decode steps the model took: per-layer and page-cache one per
                                # recorded ubatch (the live stats' decode_steps), else one per token
    totals: dict
    totals_all: dict
    seconds: float
    step_seconds: np.ndarray | None = None  # with simulate(step_times=True)
    admission: str | None = None            # per-layer: the engine's admission timing
    prefill: str | None = None              # per-layer: PREFILL_MODES
    turns: int = 0
    work: WorkTally | None = None           # decode layer passes (global: None)
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
        return self.totals["miss_bytes"] + self.work.boundary_upload_bytes, waits

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


def simulate(trace: RouteTrace, model: str, policy, size=None, *, inserts: int | None = 2,
             admission: str = "boundary", prefill: str | None = None,
             profile: UsageProfile | None = None, seed: int = 0, step_times: bool = False,
             before_step=None, miss_plan: Rates | None = None, lane: bool = True,
             read_ahead_kb: int | None = None, read_ahead: ReadAhead | None = None,
             cpu_share: float = 0.0) -> ReplayResult:
    """Replay `trace` (RouteTrace.from_routing makes one of bare routing) through one model.

    model: "per-layer" (size: K slots per layer), "global" (size: the budget in MiB),
    "upstream" (policy "upstream" or "upstream-b11480"; size: the budget in MiB, equal_bytes()
    for a K's; cpu_share: b12191's F) or
    "page-cache" (policy "lru" or "two-list"; size: the budget in MiB; read_ahead_kb: the
    device's).
    policy: a name of that model's registry ("default": DEFAULT_POLICY), a policy object of
    it, or (per-layer) a prepared CacheEngine not stepped yet, which brings its own size,
    inserts, admission and warm start. inserts, admission (admission.ADMISSIONS), prefill
    (PREFILL_MODES, default "warm"), profile (warm start as the live cache does it: the profile's top experts
    preloaded, its rates the policy's prior), miss_plan (Rates: the engine plans each graph's
    misses at them, moecache.core.missplan; eager admission; lane=False: without the copy-on-miss
    lane, the paying uploads alone): per-layer only. seed: the random
    policies'. step_times: keep each step's duration; before_step: called before each step (a
    benchmark evicting the CPU caches). read_ahead (per-layer; moecache.offline.readahead): times
    the decode with the RAM tier reading ahead, fed every token and the engine's outcome."""
    if read_ahead_kb is not None and model != PAGE_CACHE:
        raise ValueError("read_ahead_kb is a page-cache model option")
    if read_ahead is not None and model != PER_LAYER:
        raise ValueError("read_ahead (the RAM tier's decode read-ahead) is a per-layer model option")
    if cpu_share and model != UPSTREAM:
        raise ValueError("cpu_share (--moe-cache-cpu-share) is an upstream model option")
    if model == PER_LAYER:
        prefill = "warm" if prefill is None else prefill
        if prefill not in PREFILL_MODES:
            raise ValueError(f"prefill must be one of {', '.join(PREFILL_MODES)}, got {prefill!r}")
        cache, label, slots, inserts = _per_layer_cache(trace, policy, size, inserts, admission,
                                                        prefill, profile, seed, miss_plan, lane)
        segments = steps.segments(trace, PER_LAYER, prefill)
        totals = lambda: cache.stats(trace.expert_bytes)["totals"]  # noqa: E731
        budget, admission = None, cache.admission
        work = WorkTally(OUR_LAYOUT, trace.expert_bytes, trace.dense_bytes)

        def decode_step(ids):
            kept = None if read_ahead is None else cache.expert_slot >= 0  # what this graph finds in memory
            plan = cache.step(ids)
            _tally_plan(work, plan)
            if read_ahead is not None:
                read_ahead.decode(ids, plan.hit_mask, kept, np.bincount(plan.upload[:, 0], minlength=len(kept)))
        # (prefill step, decode step): a warm prompt is a prefill step, a plain one an observation
        step = (functools.partial(cache.step, prefill=True) if prefill == "warm" else cache.step, decode_step)
        if read_ahead is not None:
            read_ahead.bind(trace.expert_bytes, trace.dense_bytes, trace.n_expert, trace.n_expert_used)

            def prompt_step(ids, prompt=step[0]):
                read_ahead.prompt(ids)
                return prompt(ids)
            step = (prompt_step, decode_step)
    elif model == PAGE_CACHE:
        if prefill not in (None, "lookup") or profile is not None or admission != "boundary" or miss_plan is not None:
            raise ValueError("the page-cache model reads every ubatch through the mapping: it takes no prefill, "
                             "profile, admission or miss_plan")
        cache, label = _page_cache(trace, policy, size, read_ahead_kb)
        work = WorkTally(STOCK_LAYOUT, trace.expert_bytes, trace.dense_bytes)
        zeros = np.zeros(trace.layers.size, dtype=np.int64)

        def decode_step(ids):
            work.add_layers(zeros, zeros, cache.step(ids))
        step, segments, totals = (cache.step, decode_step), steps.segments(trace, PER_LAYER, "lookup"), cache.totals
        slots, inserts, budget, admission, prefill = None, None, size, None, "lookup"
    elif model in (GLOBAL, UPSTREAM):
        if prefill is not None or profile is not None or admission != "boundary" or miss_plan is not None:
            raise ValueError("prefill, profile, admission and miss_plan are per-layer model options")
        if model == GLOBAL:
            cache, label = _global_cache(trace, policy, size, seed)
            work, step = None, (cache.step, cache.step)
        else:
            cache, label = _upstream_cache(trace, policy, size, cpu_share)
            work = WorkTally(UPSTREAM_CPU_SHARE_LAYOUT if cpu_share else UPSTREAM_LAYOUT, trace.expert_bytes,
                             trace.dense_bytes)

            def decode_step(ubatch):
                work.add(*cache.step(ubatch))
            step = (cache.step, decode_step)
        segments = steps.segments(trace, model)
        totals = cache.totals
        slots, inserts, budget, admission = None, None, size, None
    else:
        raise ValueError(f"unknown model {model!r}; valid: {', '.join(MODELS)}")
    decode, final, seconds, times = _drive(step, totals, segments, step_times, before_step)
    if read_ahead is not None:
        read_ahead.finish()
    tokens = int((trace.phase == DECODE).sum())
    return ReplayResult(model, label, slots, budget, inserts, tokens,
                        steps.decode_steps(trace) if model in (PER_LAYER, PAGE_CACHE) else tokens,
                        decode, final, seconds, times, admission, prefill, len(steps.turns(trace)), work,
                        read_ahead=read_ahead, cpu_share=cpu_share if model == UPSTREAM else None)


def zero_configuration(trace: RouteTrace, slots: int, rates: Rates) -> ReplayResult:
    """What LLAMA_MOE_CACHE_SLOTS=K alone runs on a machine whose attach measured `rates`: the
    default policy at its live admission, INSERTS 2, the prompt warming the cache, and the miss
    planner where moecache.core.missplan.planner_by_default turns it on."""
    policy = POLICIES[resolve_policy("default")]
    admission = live_admission(policy)
    return simulate(trace, PER_LAYER, "default", slots, admission=admission, prefill="warm",
                    miss_plan=rates if planner_by_default(policy, admission) else None)


def _tally_plan(work: WorkTally, plan) -> None:
    """A decode boundary's StepPlan as the observed graph's layer passes: hits on the device,
    the lane's misses, the others on the CPU; every upload but the lane's copies is
    asynchronous."""
    L = len(plan.hits)
    lane = np.zeros(L, dtype=np.int64) if plan.lane is None else plan.lane
    work.add_layers(plan.hits, lane, plan.misses - lane)
    uploads = np.bincount(plan.admitted[:, 0], minlength=L) + np.bincount(plan.upload[:, 0], minlength=L)
    work.add_async(uploads - lane)
    work.add_boundary_uploads(np.bincount(plan.upload[:, 0], minlength=L))


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


def _per_layer_cache(trace, policy, slots, inserts, admission, prefill, profile, seed, miss_plan, lane):
    """(engine after its first boundary, label, K, inserts)."""
    if isinstance(policy, CacheEngine):
        if slots is not None or profile is not None or admission != "boundary" or policy.step_index \
                or miss_plan is not None:
            raise ValueError("a prepared engine brings its own size, admission, warm start and miss "
                             "planner, and must not have been stepped")
        engine = policy
        label = engine.policy.name
    else:
        if not isinstance(slots, (int, np.integer)) or not 1 <= slots <= trace.n_expert:
            raise ValueError(f"slots must be an integer in [1, n_expert={trace.n_expert}], got {slots!r}")
        L, E = trace.layers.size, trace.n_expert
        require_memory(ENGINE_BYTES_PER_ENTRY * L * E, f"{trace.path}: the cache engine's {L} layers x {E} experts")
        if isinstance(policy, str):
            label = policy if policy != "default" else f"default({resolve_policy(policy)})"
            reads_ahead = _reads_ahead(POLICIES, resolve_policy(policy))
            policy = make_policy(policy, future=steps.future(trace, PER_LAYER, prefill) if reads_ahead else None,
                                 seed=seed)
        elif isinstance(policy, Policy):
            label = policy.name
        else:
            raise ValueError(f"policy must be a name, a Policy or a CacheEngine, got {policy!r}")
        planner = None if miss_plan is None else MissPlanner(miss_plan, trace.expert_bytes, trace.dense_bytes,
                                                             n_used=trace.n_expert_used, lane=lane)
        engine = CacheEngine(L, E, int(slots), policy, inserts=inserts, offline=True,
                             admission=admission, miss_planner=planner)
        if profile is not None:
            engine.preload(profile.top(slots), rates=profile.rates(trace.n_expert_used))
    engine.step(None)
    return engine, label, engine.n_slots, engine.inserts


def _reads_ahead(registry, name) -> bool:
    """Whether the named policy reads the future (its NextUse, some 16 bytes a lookup, is built
    for it only); an unknown name is its factory's to refuse."""
    factory = registry.get(name)
    return factory is not None and factory.offline_only


def _budget_bytes(model, budget_mib):
    """The byte budget of the global and upstream models' size (MiB)."""
    if isinstance(budget_mib, bool) or not isinstance(budget_mib, (int, float, np.number)) \
            or not math.isfinite(budget_mib) or budget_mib <= 0:
        raise ValueError(f"the {model} model's size is a finite budget in MiB > 0, got {budget_mib!r}")
    return int(budget_mib * MIB)


def _global_cache(trace, policy, budget_mib, seed):
    budget = _budget_bytes(GLOBAL, budget_mib)
    if isinstance(policy, str):
        future = steps.future(trace, GLOBAL) if _reads_ahead(BUDGET_POLICIES, policy) else None
        label, policy = policy, make_budget_policy(policy, future=future, seed=seed)
    elif isinstance(policy, BudgetPolicy):
        label = policy.name
    else:
        raise ValueError(f"policy must be a name or a BudgetPolicy, got {policy!r}")
    return ByteBudgetCache(policy, budget, trace.expert_bytes, trace.n_expert), label


def _upstream_cache(trace, policy, budget_mib, cpu_share):
    if policy not in MODELS[UPSTREAM]:
        raise ValueError(f"unknown policy {policy!r} for the upstream model; valid: "
                         f"{', '.join(MODELS[UPSTREAM])}")
    return UpstreamCache(trace.expert_bytes, trace.n_expert, trace.n_expert_used, _budget_bytes(UPSTREAM, budget_mib),
                         pool=MODELS[UPSTREAM][policy], cpu_share=cpu_share), policy


def tuned_upstream(trace: RouteTrace, budget_mib: float, policy: str = "upstream") -> list[ReplayResult]:
    """The upstream model at each CPU share its tuner picks from (scripts/moe-cache-tune.py's);
    fastest() then gives its tuner's best on a hardware class."""
    return [simulate(trace, UPSTREAM, policy, budget_mib, cpu_share=share) for share in TUNER_SHARES]


def fastest(results, hardware: Hardware) -> ReplayResult:
    """The result with the fewest modelled milliseconds per decode token on `hardware` (the
    first of equals)."""
    return min(results, key=lambda r: r.modelled_ms(hardware))


def _page_cache(trace, policy, budget_mib, read_ahead_kb):
    if policy not in MODELS[PAGE_CACHE]:
        raise ValueError(f"unknown policy {policy!r} for the page-cache model; valid: {', '.join(MODELS[PAGE_CACHE])}")
    if isinstance(read_ahead_kb, bool) or not isinstance(read_ahead_kb, (int, np.integer)) or read_ahead_kb < 0:
        raise ValueError(f"the page-cache model needs read_ahead_kb, an integer >= 0, got {read_ahead_kb!r}")
    layout = ExpertLayout(trace.expert_bytes, trace.n_expert)
    pages = -(-layout.file_bytes // PAGE)
    require_memory(PAGE_TABLE_BYTES * pages, f"{trace.path}: the page cache model's {pages} pages")
    return PAGE_POLICIES[policy](layout, _budget_bytes(PAGE_CACHE, budget_mib), int(read_ahead_kb)), policy


def ram_tier_slots(trace: RouteTrace, ram_mib: float) -> int:
    """The RAM tier's K at RAM_MIB=ram_mib (moecache.live.ramtier's rule, banks.ram_slots)."""
    k = ram_slots(trace.expert_bytes, trace.n_expert, int(ram_mib * MIB))
    if k == 0:
        raise ValueError(f"--ram-mib {ram_mib:g} keeps fewer than one expert per layer, which takes "
                         f"{int(trace.expert_bytes.sum()) / MIB:.1f} MiB")
    return k


def per_layer_slots(trace: RouteTrace, budget_mib: float) -> int:
    """The per-layer model's K at a budget: the largest whose device bytes (equal_bytes) fit it."""
    k = slots_for_budget(lambda k: equal_bytes(trace.expert_bytes, k), int(budget_mib * MIB), trace.n_expert)
    if k == 0:
        raise ValueError(f"--budget-mib {budget_mib:g} is below one slot per layer for the per-layer "
                         f"model: this trace needs at least {math.ceil(equal_bytes(trace.expert_bytes, 1) / MIB)} MiB")
    return k
