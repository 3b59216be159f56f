"""Replay a routing trace through cache models, offline: simulate() is the one driver that
the command line, the scripts and the tests run.

    python -m moecache.replay TRACE [--slots 8,16,32,64] [--policies lru,belady,default]
                              [--inserts 2] [--admission boundary,eager] [--prefill warm]
                              [--budget-mib 3000,4000]
                              [--host-gbps 60] [--link-gbps 25] [--csv FILE] [--plot PNG]

Three models (MODELS, each with its policy registry):

per-layer (--slots, and --budget-mib at the largest K whose slots fit it: K per layer plus one
    zero slot per bank of equal expert sizes, as LLAMA_MOE_CACHE_MIB sizes the live cache:
    moecache.live.sizing): our live
    cache. K slots per layer, at most --inserts uploads per layer
    per step. It runs moecache.core.engine.CacheEngine itself, the code the live glue calls, with
    either admission timing (--admission): "boundary" uploads a miss at the next boundary
    (one-step publication delay, experts of the step just observed protected), "eager" while
    the graph that missed it runs (moecache.core.admission). --prefill: "warm" (default) feeds each
    prompt ubatch (of 512 tokens, or as recorded) as a prefill step, as the live cache does
    (engine.step(ids, prefill=True): no lookups, up to K of the prompt's experts uploaded,
    counted apart); "off" feeds no prefill; "plain" feeds each turn's prompt as one batched
    observation of the cache, lookups and uploads counted as any other.
upstream (policy name "upstream", at the device bytes of each --slots K and at each
    --budget-mib): upstream llama.cpp's own cache (moecache.offline.upstream), prompts in ubatches of
    512 tokens, then one ubatch per decode token.
global (--budget-mib): BigMoeOnEdge's route-replay model (moecache.offline.budget). One cache over
    (layer, expert) entries budgeted in bytes (expert sizes from the preamble), immediate
    admission, no insert limit; batches are one per layer for a turn's whole prefill, then one
    per layer per decode token; one lookup per distinct expert per batch; eviction after each
    batch, sparing the batch's own experts. Its cumulative hit rate includes prefill, as that
    project reports.

Rates are fractions (hit_rate 0.578) in results and CSV, as in engine.stats() and the live
stats; the printed tables show them as percent (hit% 57.8). Every table also shows MODELLED
expert milliseconds per decode token (moecache.offline.cost, from --host-gbps and --link-gbps).
"""

from __future__ import annotations

import argparse
import csv
import functools
import math
import os
import time
import weakref
from dataclasses import dataclass

import numpy as np

from ..core.admission import ADMISSIONS
from ..core.banks import equal_bytes, slots_for_budget
from ..core.engine import CacheEngine
from ..core.policies import DEFAULT_POLICY, POLICIES, Policy, make_policy, resolve_policy
from ..core.profile import UsageProfile
from ..core.traces import DECODE, PREFILL, RouteTrace, read_trace, require_memory
from ..util import OneLineParser, Progress, atomic_write, int_arg, int_list_arg
from .budget import BUDGET_POLICIES, BudgetPolicy, ByteBudgetCache, make_budget_policy
from .cost import DEFAULT_HOST_GBPS, DEFAULT_LINK_GBPS, Bandwidth
from .upstream import DEFAULT_UBATCH, UpstreamCache

MIB = 1 << 20
PER_LAYER, GLOBAL, UPSTREAM = "per-layer", "global", "upstream"
PREFILL_MODES = ("warm", "off", "plain")  # the per-layer model's prompts (see the module docstring)
MODELS = {PER_LAYER: POLICIES, GLOBAL: BUDGET_POLICIES, UPSTREAM: {"upstream": UpstreamCache}}
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
    budget_mib: float | None    # global and upstream budget; per-layer: the budget its K fits
    inserts: int | None         # per-layer; None: unlimited (and for the other models)
    decode_steps: int
    totals: dict
    totals_all: dict
    seconds: float
    step_seconds: np.ndarray | None = None  # with simulate(step_times=True)
    admission: str | None = None            # per-layer: the engine's admission timing
    prefill: str | None = None              # per-layer: PREFILL_MODES
    turns: int = 0

    @property
    def hit_rate(self) -> float | None:
        return _rate(self.totals)

    @property
    def hit_rate_all(self) -> float | None:
        return _rate(self.totals_all)

    @property
    def lookups(self) -> int:
        return self.totals_all["hits"] + self.totals_all["misses"]

    @property
    def upload_bytes_per_token(self) -> float | None:
        return self.totals["upload_bytes"] / self.decode_steps if self.decode_steps else None

    @property
    def prefill_upload_bytes_per_turn(self) -> float | None:
        """Bytes the prompts' prefill steps uploaded (per-layer prefill="warm"), per turn."""
        return self.totals_all.get("prefill_upload_bytes", 0) / self.turns if self.turns else None

    @property
    def lookups_per_s(self) -> float:
        return self.lookups / self.seconds if self.seconds > 0 else float("inf")

    def modelled_ms(self, bandwidth: Bandwidth) -> float | None:
        """MODELLED expert milliseconds per decode token of this cache (moecache.offline.cost); None
        for the global model, whose cost is not modelled, or without decode tokens."""
        if self.model == GLOBAL or not self.decode_steps:
            return None
        miss, upload = (self.totals[name] / self.decode_steps for name in ("miss_bytes", "upload_bytes"))
        if self.model == UPSTREAM:
            return bandwidth.upstream_ms(upload, host_bytes=miss - upload)
        return bandwidth.moecache_ms(miss, upload)

    def stock_ms(self, bandwidth: Bandwidth) -> float | None:
        """MODELLED expert milliseconds per decode token of llama.cpp's stock --cpu-moe on the
        same routing (every lookup read on the host)."""
        if self.model == GLOBAL or not self.decode_steps:
            return None
        return bandwidth.stock_ms(self.totals["lookup_bytes"] / self.decode_steps)


def _rate(totals):
    lookups = totals["hits"] + totals["misses"]
    return totals["hits"] / lookups if lookups else None


# --- the driver --------------------------------------------------------------------------

def simulate(trace: RouteTrace, model: str, policy, size=None, *, inserts: int | None = 2,
             admission: str = "boundary", prefill: str | None = None,
             profile: UsageProfile | None = None, seed: int = 0, step_times: bool = False,
             before_step=None) -> ReplayResult:
    """Replay `trace` (RouteTrace.from_routing makes one of bare routing) through one model.

    model: "per-layer" (size: K slots per layer), "global" (size: the budget in MiB) or
    "upstream" (policy "upstream"; size: the budget in MiB, equal_bytes() for a K's).
    policy: a name of that model's registry ("default": DEFAULT_POLICY), a policy object of
    it, or (per-layer) a prepared CacheEngine not stepped yet, which brings its own size,
    inserts, admission and warm start. inserts, admission (admission.ADMISSIONS), prefill
    (PREFILL_MODES, default "warm"), profile (warm start as the live cache does it: the profile's top experts
    preloaded, its rates the policy's prior): per-layer only. seed: the random policies'. step_times: keep each step's duration;
    before_step: called before each step (a benchmark evicting the CPU caches)."""
    if model == PER_LAYER:
        prefill = "warm" if prefill is None else prefill
        if prefill not in PREFILL_MODES:
            raise ValueError(f"prefill must be one of {', '.join(PREFILL_MODES)}, got {prefill!r}")
        cache, label, slots, inserts = _per_layer_cache(trace, policy, size, inserts, admission,
                                                        prefill, profile, seed)
        segments = _segments(trace, PER_LAYER, prefill)
        totals = lambda: cache.stats(trace.expert_bytes)["totals"]  # noqa: E731
        budget, admission = None, cache.admission
        # (prefill step, decode step): a warm prompt is a prefill step, a plain one an observation
        steps = (functools.partial(cache.step, prefill=True) if prefill == "warm" else cache.step, cache.step)
    elif model in (GLOBAL, UPSTREAM):
        if prefill is not None or profile is not None or admission != "boundary":
            raise ValueError("prefill, profile and admission are per-layer model options")
        if model == GLOBAL:
            cache, label = _global_cache(trace, policy, size, seed)
        else:
            cache, label = _upstream_cache(trace, policy, size)
        segments = _segments(trace, model)
        totals = lambda: cache.stats()["totals"]  # noqa: E731
        slots, inserts, budget, admission = None, None, size, None
        steps = (cache.step, cache.step)
    else:
        raise ValueError(f"unknown model {model!r}; valid: {', '.join(MODELS)}")
    decode, final, seconds, times = _drive(steps, totals, segments, step_times, before_step)
    return ReplayResult(model, label, slots, budget, inserts, int((trace.phase == DECODE).sum()),
                        decode, final, seconds, times, admission, prefill, len(_turns(trace)))


def _drive(steps, totals, segments, step_times, before_step):
    """Step through the segments, with steps[is_decode]; the decode totals are the sum of the
    decode segments' differences of totals(), the cache's own counters."""
    times = [] if step_times else None
    decode = None
    start = time.perf_counter()
    before = totals()
    for is_decode, items in segments:
        step = steps[is_decode]
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


def _per_layer_cache(trace, policy, slots, inserts, admission, prefill, profile, seed):
    """(engine after its first boundary, label, K, inserts)."""
    if isinstance(policy, CacheEngine):
        if slots is not None or profile is not None or admission != "boundary" or policy.step_index:
            raise ValueError("a prepared engine brings its own size, admission and warm start, "
                             "and must not have been stepped")
        engine = policy
        label = engine.policy.name
    else:
        if not isinstance(slots, (int, np.integer)) or not 1 <= slots <= trace.n_expert:
            raise ValueError(f"slots must be an integer in [1, n_expert={trace.n_expert}], got {slots!r}")
        L, E = trace.layers.size, trace.n_expert
        require_memory(ENGINE_BYTES_PER_ENTRY * L * E, f"the cache engine's {L} layers x {E} experts")
        if isinstance(policy, str):
            label = policy if policy != "default" else f"default({resolve_policy(policy)})"
            policy = make_policy(policy, future=step_inputs(trace, PER_LAYER, prefill), seed=seed)
        elif isinstance(policy, Policy):
            label = policy.name
        else:
            raise ValueError(f"policy must be a name, a Policy or a CacheEngine, got {policy!r}")
        engine = CacheEngine(L, E, int(slots), policy, inserts=inserts, offline=True,
                             admission=admission)
        if profile is not None:
            engine.preload(profile.top(slots), rates=profile.rates(trace.n_expert_used))
    engine.step(None)
    return engine, label, engine.n_slots, engine.inserts


def _global_cache(trace, policy, budget_mib, seed):
    if isinstance(budget_mib, bool) or not isinstance(budget_mib, (int, float, np.number)) \
            or not math.isfinite(budget_mib) or budget_mib <= 0:
        raise ValueError(f"the global model's size is a finite budget in MiB > 0, got {budget_mib!r}")
    if isinstance(policy, str):
        label, policy = policy, make_budget_policy(policy, seed=seed)
    elif isinstance(policy, BudgetPolicy):
        label = policy.name
    else:
        raise ValueError(f"policy must be a name or a BudgetPolicy, got {policy!r}")
    cache = ByteBudgetCache(policy, int(budget_mib * MIB), trace.expert_bytes, trace.n_expert,
                            step_inputs(trace, GLOBAL))
    return cache, label


def per_layer_slots(trace: RouteTrace, budget_mib: float) -> int:
    """The per-layer model's K at a budget: the largest whose device bytes (equal_bytes) fit it."""
    k = slots_for_budget(lambda k: equal_bytes(trace.expert_bytes, k), int(budget_mib * MIB), trace.n_expert)
    if k == 0:
        raise ValueError(f"--budget-mib {budget_mib:g} is below one slot per layer for the per-layer "
                         f"model: this trace needs at least {math.ceil(equal_bytes(trace.expert_bytes, 1) / MIB)} MiB")
    return k


def _upstream_cache(trace, policy, budget_mib):
    if policy not in MODELS[UPSTREAM]:
        raise ValueError(f"unknown policy {policy!r} for the upstream model; valid: "
                         f"{', '.join(MODELS[UPSTREAM])}")
    if isinstance(budget_mib, bool) or not isinstance(budget_mib, (int, float, np.number)) \
            or not math.isfinite(budget_mib) or budget_mib <= 0:
        raise ValueError(f"the upstream model's size is a finite budget in MiB > 0, got {budget_mib!r}")
    return UpstreamCache(trace.expert_bytes, trace.n_expert, trace.n_expert_used,
                         int(budget_mib * MIB)), policy


# --- a trace as each model's steps --------------------------------------------------------

_prepared: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # trace -> {key: steps}


def _memo(trace, key, build):
    """Sweeps replay one trace many times: its steps are prepared once."""
    memo = _prepared.setdefault(trace, {})
    if key not in memo:
        memo[key] = build()
    return memo[key]


def _segments(trace, model, prefill=None):
    """[(is_decode, [step input, ...])], adjacent steps of one phase together."""
    build = {PER_LAYER: lambda: _observations(trace, prefill),
             GLOBAL: lambda: _batches(trace), UPSTREAM: lambda: _ubatches(trace)}[model]
    return _memo(trace, (model, prefill), build)


def step_inputs(trace, model, prefill=None):
    """Every step input of a model, in order: what the offline policies read ahead."""
    segments = _segments(trace, model, prefill)
    return _memo(trace, ("step_inputs", model, prefill),
                 lambda: [item for _, items in segments for item in items])


def _turns(trace):
    """Each turn's step range (steps are in (turn, step) order)."""
    bounds = [0, *(np.flatnonzero(np.diff(trace.turn)) + 1).tolist(), len(trace.turn)]
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def _merged(segments):
    out = []
    for is_decode, items in segments:
        if items and out and out[-1][0] == is_decode:
            out[-1][1].extend(items)
        elif items:
            out.append((is_decode, list(items)))
    return out


def _observations(trace, prefill):
    """The per-layer model's steps: (n_layers, n) ids, what the live cache would observe, in
    order. The decode tokens of one recorded batch (a multi-token ubatch) are one observation;
    a turn's prompt is one ("plain"), or one per recorded batch, else per ubatch of
    DEFAULT_UBATCH tokens, as llama.cpp splits it ("warm"), or none ("off")."""
    segments = []
    for turn in _turns(trace):
        ids, phase = trace.ids[turn], trace.phase[turn]
        prompt = phase == PREFILL
        if prefill == "plain" and prompt.any():
            segments.append((False, [_together(ids[prompt])]))
        elif prefill == "warm" and prompt.any():
            batch = trace.batch[turn][prompt]
            if (batch < 0).all():
                batch = np.arange(prompt.sum()) // DEFAULT_UBATCH
            starts = np.flatnonzero(np.diff(batch)) + 1
            segments.append((False, [_together(part) for part in np.split(ids[prompt], starts)]))
        decode = phase == DECODE
        segments.append((True, _by_batch(ids[decode], trace.batch[turn][decode])))
    return _merged(segments)


def _together(ids):
    """Steps (n, L, k) as one observation (L, n * k), token by token."""
    return np.ascontiguousarray(ids.transpose(1, 0, 2)).reshape(ids.shape[1], -1)


def _by_batch(ids, batch):
    """Steps (n, L, k) as observations: consecutive steps of one recorded batch together."""
    if len(ids) == 0 or (batch < 0).all():
        return list(ids)
    starts = np.flatnonzero((np.diff(batch) != 0) | (batch[1:] < 0)) + 1
    return [group[0] if len(group) == 1 else _together(group) for group in np.split(ids, starts)]


def _batches(trace):
    """The global model's steps: (layer index, keys) with keys layer * n_expert + expert, in
    the order that engine's load_layer calls run."""
    base = np.arange(trace.layers.size)[:, None] * trace.n_expert
    segments = []
    for turn in _turns(trace):
        ids, phase = trace.ids[turn], trace.phase[turn]
        prefill = ids[phase == PREFILL]  # (tokens, L, k)
        batches = []
        for li in range(trace.layers.size):
            ids_li = prefill[:, li, :].ravel()  # token-major: the prompt tail's experts end hottest
            ids_li = ids_li[ids_li >= 0]
            if ids_li.size:
                batches.append((li, (ids_li + base[li, 0]).tolist()))
        segments.append((False, batches))
        decode = ids[phase == DECODE]
        keys = np.where(decode >= 0, decode + base, -1).tolist()  # (steps, L, k)
        if (decode < 0).any():  # bare routing: a layer without a selection looks nothing up
            keys = [[[key for key in row if key >= 0] for row in rows] for rows in keys]
        segments.append((True, [(li, row) for rows in keys for li, row in enumerate(rows) if row]))
    return _merged(segments)


def _ubatches(trace, n_ubatch=DEFAULT_UBATCH):
    """The upstream model's steps: (layer index, expert ids, n_tokens) per layer of each
    ubatch: a turn's prompt in ubatches of n_ubatch tokens, then each decode token alone."""
    segments = []
    for turn in _turns(trace):
        ids, phase = trace.ids[turn], trace.phase[turn]
        prefill = ids[phase == PREFILL]  # (tokens, L, k)
        steps = []
        for start in range(0, len(prefill), n_ubatch):
            ubatch = prefill[start:start + n_ubatch]
            steps += [(li, ubatch[:, li, :].ravel().tolist(), len(ubatch)) for li in range(trace.layers.size)]
        segments.append((False, steps))
        segments.append((True, [(li, row, 1) for rows in ids[phase == DECODE].tolist()
                                for li, row in enumerate(rows)]))
    return _merged(segments)


# --- command line ----------------------------------------------------------------------

def _budgets_arg(text):
    """--budget-mib: comma-separated finite numbers > 0."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: budgets must be finite numbers > 0")
    return values


def _inserts_arg(text):
    """--inserts: an integer >= 1, or 'unlimited' (None)."""
    return None if text == "unlimited" else int_arg(minimum=1)(text)


def _gbps_arg(text):
    """--host-gbps, --link-gbps: one finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: a bandwidth must be a finite number of GB/s > 0")
    return value


def admission_list_arg(text):
    """--admission: comma-separated admission.ADMISSIONS names."""
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in ADMISSIONS]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"{text!r}: each must be one of {', '.join(ADMISSIONS)}")
    return values


_budgets_arg.__name__, _inserts_arg.__name__ = "budget list", "inserts"
_gbps_arg.__name__, admission_list_arg.__name__ = "bandwidth", "admission list"


def parser() -> OneLineParser:
    ap = OneLineParser(prog="python -m moecache.replay",
                       description="Replay a routing trace through cache policies.")
    ap.add_argument("trace")
    ap.add_argument("--slots", type=int_list_arg(minimum=1),
                    help="per-layer cache sizes K, comma separated (default 8,16,32,64 unless "
                         "--budget-mib is given)")
    ap.add_argument("--policies", default="lru,belady,default",
                    help=f"comma separated; per-layer (--slots, --budget-mib): default ({DEFAULT_POLICY}), "
                         f"{', '.join(POLICIES)}; global (--budget-mib): {', '.join(BUDGET_POLICIES)}; both: "
                         f"upstream (llama.cpp's own cache, at each K's device bytes and each budget)")
    ap.add_argument("--inserts", type=_inserts_arg, default=2,
                    help="uploads per layer per step, or 'unlimited'")
    ap.add_argument("--admission", type=admission_list_arg, default=["boundary"],
                    help=f"per-layer admission timings, comma separated: {', '.join(ADMISSIONS)} "
                         f"(default boundary)")
    ap.add_argument("--budget-mib", type=_budgets_arg, default=[],
                    help="byte budgets, comma separated: the global model's (BigMoeOnEdge), and the "
                         "per-layer model at the largest K that fits")
    ap.add_argument("--prefill", choices=PREFILL_MODES, default="warm",
                    help="per-layer model: each prompt ubatch as a prefill step that uploads its most "
                         "used experts, as the live cache does (warm, the default); no prefill (off); "
                         "each turn's prompt as one batched observation (plain)")
    ap.add_argument("--preload-profile", metavar="JSON",
                    help="per-layer model: warm start from a saved usage profile")
    ap.add_argument("--host-gbps", type=_gbps_arg, default=DEFAULT_HOST_GBPS,
                    help="host memory read bandwidth for experts, GB/s, for the MODELLED ms/token "
                         f"(default {DEFAULT_HOST_GBPS:g}: a dual-channel DDR5 desktop)")
    ap.add_argument("--link-gbps", type=_gbps_arg, default=DEFAULT_LINK_GBPS,
                    help="host-to-device copy bandwidth, GB/s, for the MODELLED ms/token "
                         f"(default {DEFAULT_LINK_GBPS:g}: PCIe 4.0 x16)")
    ap.add_argument("--seed", type=int_arg(minimum=0), default=0, help="seed of the random policies")
    ap.add_argument("--csv", help="also write the results here")
    ap.add_argument("--plot", help="also plot hit%% vs cache size here (needs matplotlib)")
    return ap


def check_args(args) -> None:
    """What the flags say together, and where the outputs go: a ValueError (one line, exit 2)
    before any replay runs."""
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not args.policies:
        raise ValueError("--policies is empty")
    if args.slots is None:
        args.slots = [] if args.budget_mib else [8, 16, 32, 64]
    # A name runs in every requested model that has it; one that no requested model has is
    # rejected, never tabulated under a policy that did not run.
    models = ([("--slots", policy_names(PER_LAYER) + policy_names(UPSTREAM))] if args.slots else []) + \
             ([("--budget-mib", list(dict.fromkeys(policy_names(PER_LAYER) + policy_names(GLOBAL)
                                                    + policy_names(UPSTREAM))))] if args.budget_mib else [])
    unknown = [p for p in args.policies if not any(p in names for _, names in models)]
    if unknown:
        valid = "; ".join(f"{flag}: {', '.join(names)}" for flag, names in models)
        raise ValueError(f"unknown policy {', '.join(unknown)} for "
                         f"{' and '.join(f for f, _ in models)}; valid {valid}")
    args.bandwidth = Bandwidth(args.host_gbps, args.link_gbps)
    for flag, path in (("--csv", args.csv), ("--plot", args.plot)):
        if path:
            _check_output(path, flag)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib (pip install matplotlib)") from None


def _check_output(path, flag):
    """An output file must be writable where it is named."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or path.endswith(os.sep):
        raise ValueError(f"{flag} {path}: is a directory, expected a file name")
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"{flag} {path}: not writable")


def load_inputs(args):
    """The trace and the warm-start profile (or None), checked against the options."""
    trace = read_trace(args.trace)
    if args.slots and max(args.slots) > trace.n_expert:
        raise ValueError(f"--slots {max(args.slots)} exceeds n_expert={trace.n_expert}")
    per_layer = any(p in policy_names(PER_LAYER) for p in args.policies)
    args.budget_slots = {b: per_layer_slots(trace, b) for b in args.budget_mib} if per_layer else {}
    profile = None
    if args.preload_profile:
        profile = UsageProfile.load(args.preload_profile, layers=trace.layers.tolist(),
                                    n_expert=trace.n_expert)
    return trace, profile


def run(args, trace, profile) -> list[ReplayResult]:
    """Every requested run; the per-layer model runs at each K, then at the K of each
    --budget-mib; the upstream model at each K's device bytes (equal_bytes), then at each
    --budget-mib."""
    def equal(k):
        return equal_bytes(trace.expert_bytes, k) / MIB
    # (model, policy, size, options, what the result stands against: the K of an upstream run,
    # the budget of a per-layer run sized by one)
    per_layer = [(p, {"inserts": args.inserts, "prefill": args.prefill, "profile": profile,
                      "admission": a}) for p in args.policies if p in policy_names(PER_LAYER) for a in args.admission]
    runs = [(PER_LAYER, p, k, options, {}) for p, options in per_layer for k in args.slots] + \
           [(PER_LAYER, p, args.budget_slots[b], options, {"budget_mib": b}) for p, options in per_layer
            for b in args.budget_mib] + \
           [(UPSTREAM, p, equal(k), {}, {"slots": k}) for p in args.policies if p in policy_names(UPSTREAM)
            for k in args.slots] + \
           [(model, p, b, {}, {}) for model in (GLOBAL, UPSTREAM) for p in args.policies
            if p in policy_names(model) for b in args.budget_mib]
    results = []
    with Progress(len(runs)) as progress:
        for model, policy, size, options, against in runs:
            result = simulate(trace, model, policy, size, seed=args.seed, **options)
            for name, value in against.items():
                setattr(result, name, value)
            results.append(result)
            progress.advance(f"{policy} {size:g}")
    return results


def _pct(rate):
    return "-" if rate is None else f"{100 * rate:.1f}"


def _ms(value):
    return "-" if value is None else f"{value:.2f}"


def print_tables(args, trace, results) -> None:
    n_prefill = int((trace.phase == PREFILL).sum())
    n_decode = int((trace.phase == DECODE).sum())
    print(f"{args.trace}: {trace.arch}, {trace.layers.size} MoE layers x {trace.n_expert} experts, "
          f"top-{trace.n_expert_used}; {n_prefill} prefill + {n_decode} decode tokens; one token's "
          f"working set {trace.working_set_bytes() / MIB:.0f} MiB")
    bandwidth = args.bandwidth
    stock = next((r.stock_ms(bandwidth) for r in results if r.stock_ms(bandwidth) is not None), None)
    if stock is not None:
        print(f"ms/tok: MODELLED expert milliseconds per decode token (moecache.offline.cost), host "
              f"{bandwidth.host_gbps:g} GB/s, link {bandwidth.link_gbps:g} GB/s; stock --cpu-moe "
              f"{stock:.2f}")
    for model in MODELS:
        rows = [r for r in results if r.model == model]
        if not rows:
            continue
        if model == PER_LAYER:
            print(f"\nper-layer cache: K slots per layer, inserts={'unlimited' if args.inserts is None else args.inserts}, "
                  f"prefill {args.prefill}"
                  f"{', warm start from ' + args.preload_profile if args.preload_profile else ''}")
            # MiB: the device bytes of the K slots (equal_bytes); budget: the --budget-mib they fit
            head = f"{'policy':<16}{'admission':>10}{'K':>6}{'MiB':>8}" + (f"{'budget':>8}" if args.budget_mib else "")
        elif model == GLOBAL:
            print("\nglobal cache (BigMoeOnEdge model): one byte budget over all layers, immediate admission")
            head = f"{'policy':<16}{'MiB':>6}"
        else:
            print(f"\nupstream llama.cpp cache (--moe-cache-mib): one LRU per group of layers, every miss "
                  f"copied synchronously; K: at the device bytes of K per-layer slots")
            head = f"{'policy':<16}{'K':>6}{'MiB':>8}"
        warm = model == PER_LAYER and args.prefill == "warm"  # prompt uploads, counted apart
        print(f"{head}{'hit% dec':>10}{'hit% cum':>10}{'MiB up/tok':>12}" + (f"{'MiB pre/turn':>14}" if warm else "")
              + f"{'ms/tok':>8}{'Mlookup/s':>11}")
        for r in rows:
            if model == PER_LAYER:
                label = f"{r.policy:<16}{r.admission:>10}{r.slots:>6}{equal_bytes(trace.expert_bytes, r.slots) / MIB:>8.0f}"
                if args.budget_mib:
                    label += f"{'-' if r.budget_mib is None else format(r.budget_mib, 'g'):>8}"
            elif model == GLOBAL:
                label = f"{r.policy:<16}{r.budget_mib:>6g}"
            else:
                label = f"{r.policy:<16}{'-' if r.slots is None else r.slots:>6}{r.budget_mib:>8.0f}"
            per_token = "-" if r.upload_bytes_per_token is None else f"{r.upload_bytes_per_token / MIB:.1f}"
            per_turn = "-" if r.prefill_upload_bytes_per_turn is None else f"{r.prefill_upload_bytes_per_turn / MIB:.1f}"
            print(f"{label}{_pct(r.hit_rate):>10}{_pct(r.hit_rate_all):>10}{per_token:>12}"
                  + (f"{per_turn:>14}" if warm else "")
                  + f"{_ms(r.modelled_ms(bandwidth)):>8}{r.lookups_per_s / 1e6:>11.2f}")


CSV_COLUMNS = ("model", "policy", "slots", "budget_mib", "inserts", "admission", "decode_steps",
               "hits", "misses", "uploads", "upload_bytes", "hit_rate", "hits_all", "misses_all",
               "hit_rate_all", "upload_bytes_per_token", "modelled_ms_per_token", "seconds", "prefill",
               "prefill_upload_bytes")


def write_csv(path, results, bandwidth: Bandwidth) -> None:
    """One row per run; rates are fractions, empty where a run had no lookups; the modelled
    milliseconds per decode token use `bandwidth`."""
    atomic_write(path, lambda tmp: _write_rows(tmp, results, bandwidth))


def _write_rows(path, results, bandwidth):
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, CSV_COLUMNS)
        writer.writeheader()
        for r in results:
            writer.writerow({
                "model": r.model, "policy": r.policy, "slots": r.slots, "budget_mib": r.budget_mib,
                "inserts": ("unlimited" if r.inserts is None else r.inserts) if r.model == PER_LAYER else None,
                "admission": r.admission, "decode_steps": r.decode_steps,
                **{name: r.totals[name] for name in ("hits", "misses", "uploads", "upload_bytes")},
                "hit_rate": None if r.hit_rate is None else f"{r.hit_rate:.6f}",
                "hits_all": r.totals_all["hits"], "misses_all": r.totals_all["misses"],
                "hit_rate_all": None if r.hit_rate_all is None else f"{r.hit_rate_all:.6f}",
                "upload_bytes_per_token": None if r.upload_bytes_per_token is None
                else f"{r.upload_bytes_per_token:.0f}",
                "modelled_ms_per_token": _ms(r.modelled_ms(bandwidth)).replace("-", ""),
                "seconds": f"{r.seconds:.4f}", "prefill": r.prefill,
                "prefill_upload_bytes": r.totals_all.get("prefill_upload_bytes") if r.model == PER_LAYER else None})


def plot(path, trace, results) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in MODELS if any(r.model == m for r in results)]
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for policy, admission in dict.fromkeys((r.policy, r.admission) for r in results if r.model == model):
            rows = [r for r in results if r.model == model and r.policy == policy
                    and r.admission == admission and r.hit_rate is not None]
            xs = [r.slots if model == PER_LAYER else r.budget_mib for r in rows]
            ax.plot(xs, [100 * r.hit_rate for r in rows], marker="o",
                    label=policy if admission in (None, "boundary") else f"{policy} {admission}",
                    linestyle="--" if policy == "belady" else "-")
        ax.set_xlabel("slots per layer (K)" if model == PER_LAYER else "budget (MiB)")
        ax.set_ylabel("decode hit %")
        ax.set_title(f"{trace.arch}: {model} cache")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format=os.path.splitext(path)[1][1:] or "png"))


def replay(args) -> None:
    """The command: check, load, run, print, write."""
    check_args(args)
    trace, profile = load_inputs(args)
    results = run(args, trace, profile)
    print_tables(args, trace, results)
    outputs = [(flag, path, write) for flag, path, write in (
        ("--csv", args.csv, lambda p: write_csv(p, results, args.bandwidth)),
        ("--plot", args.plot, lambda p: plot(p, trace, results))) if path]
    if outputs:
        print()
    for flag, path, write in outputs:
        try:
            write(path)
        except OSError as e:
            raise ValueError(f"{flag} {path}: {e.strerror}") from None
        print(f"wrote {path}")


def main(argv=None) -> int:
    return parser().run(replay, argv)

