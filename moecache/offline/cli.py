"""`python -m moecache.replay`: the replay's command line, tables, CSV and plot; every run goes
through moecache.offline.replay.simulate (the models are described there).

    python -m moecache.replay TRACE [--slots 8,16,32,64] [--policies lru,belady,default]
                              [--inserts 2] [--admission boundary,eager] [--prefill warm]
                              [--budget-mib 3000,4000]
                              [--hardware pcie4-x16] [--host-gbps G] [--link-gbps G]
                              [--dram-gbps G] [--device-gbps G] [--ids-trip-us U] [--join-us U]
                              [--planner] [--cpu-share 0,0.9|tuned] [--csv FILE] [--plot PNG]
    python -m moecache.replay TRACE --ram-mib 932[,1351] --disk-gbps G [--disk-read-us U]
                              [--read-cpu-ms-per-mb C] [--read-cpu-ms-per-request R] [--read-ahead-kb KB]
                              [--host-gbps G] [--policies default]
                              [--expert-read-ahead none,cooccur:1,oracle:2]
    python -m moecache.replay TRACE --convert OUT

--slots sizes the per-layer model (K per layer) and the upstream model (at the device bytes of
each K); --budget-mib sizes the global and the upstream models, and the per-layer model at
the largest K whose slots fit it: K per layer plus one zero slot per bank of equal expert
sizes, as LLAMA_MOE_CACHE_MIB sizes the live cache (moecache.live.sizing). A policy name runs
in every requested model whose registry has it. The upstream model runs llama.cpp's cache by
version: upstream (tag b12191: ClassLRU, at each --cpu-share F; "tuned": the shares its tuner
picks from) or upstream-b11480 (its plain LRU).

--ram-mib models a model larger than RAM, on the CPU: the RAM tier (LLAMA_MOE_CACHE_RAM_MIB=N,
moecache.live.ramtier) at the K whose experts fit N MiB over the layers, eager admission with
INSERTS = K, every prompt ubatch looked up as the live tier does (the per-layer engine, prefill
"lookup"), beside stock mmap's page cache of the same N MiB (moecache.offline.pagecache: LRU, and
the kernel's two lists, over 4 KiB pages with mmap readahead at --read-ahead-kb). Each prints its
decode hit rate, the bytes it reads from the file per decode token and MODELLED milliseconds per
decode token (moecache.offline.cost.Disk) at --host-gbps (the CPU's rate over the experts, default
--hardware's) and the disk's --disk-gbps and --disk-read-us. --expert-read-ahead PREDICTOR:R
adds the RAM tier run again reading ahead, during each layer's compute, the R experts the
predictor expects the next layer to miss (moecache.offline.readahead: its precision, recall and
MODELLED ms per decode token on a timeline where the disk overlaps the CPU).

--convert writes the trace's compact binary form (moecache.formats.binary_trace), which any
replay reads in place of the CSV: mapped, not parsed, so a long recording replays in a
fraction of the time, in memory that does not grow with its length.

Rates are fractions (hit_rate 0.578) in results and CSV; the printed tables show them as
percent (hit% 57.8). Every table also shows MODELLED milliseconds per decode token
(moecache.offline.cost's per-layer timeline) on --hardware, a named class, with any of its
rates and latencies given explicitly; --planner runs the per-layer model with the miss planner
at those rates, as the live cache runs it (LLAMA_MOE_CACHE_PLANNER=1; moecache.core.missplan:
the copy-on-miss lane, uploads only when they pay).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys

from ..core.admission import ADMISSIONS, live_admission
from ..core.banks import equal_bytes
from ..core.hardware import DEFAULT_HARDWARE, HARDWARE
from ..core.missplan import MissPlanner
from ..core.policies import DEFAULT_POLICY, POLICIES, resolve_policy
from ..formats.binary_trace import write_binary_trace
from ..formats.profile import UsageProfile
from ..formats.traces import DECODE, PREFILL, read_trace
from ..util import OneLineParser, Progress, atomic_write, gbps_arg, int_arg, int_list_arg, output_problem
from .budget import BUDGET_POLICIES
from .cost import DISK_READ_US, Disk
from .readahead import PREDICTORS, ReadAhead, parse_spec
from .steps import decode_steps
from .replay import (GLOBAL, MIB, MODELS, PAGE_CACHE, PER_LAYER, PREFILL_MODES, UPSTREAM, GlobalReplay,
                     PageCacheReplay, PerLayerReplay, ReplayResult, UpstreamReplay, per_layer_slots, policy_names,
                     ram_tier_replay, ram_tier_slots, simulate)
from .upstream import TUNER_SHARES, UPSTREAM_TAGS


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


def _shares_arg(text):
    """--cpu-share: comma-separated numbers in [0, 1), or 'tuned' (the upstream tuner's)."""
    if text == "tuned":
        return list(TUNER_SHARES)
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not values or not all(0 <= v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: shares must be numbers in [0, 1), or 'tuned'")
    return list(dict.fromkeys(values))


def _nonnegative_arg(what, unit):
    """A flag of one finite number >= 0 of `unit`, `what` naming it in the error."""
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (math.isfinite(value) and value >= 0):
            raise argparse.ArgumentTypeError(f"{text!r}: {what} must be a finite number of {unit} >= 0")
        return value
    parse.__name__ = what
    return parse


_us_arg = _nonnegative_arg("a latency", "us")  # --ids-trip-us, --join-us, --disk-read-us


def _read_ahead_arg(text):
    """--expert-read-ahead: comma-separated PREDICTOR:R."""
    try:
        specs = [parse_spec(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not specs:
        raise argparse.ArgumentTypeError(f"{text!r}: give PREDICTOR:R, comma separated")
    return list(dict.fromkeys(specs))


def admission_list_arg(text):
    """--admission: comma-separated admission.ADMISSIONS names."""
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in ADMISSIONS]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"{text!r}: each must be one of {', '.join(ADMISSIONS)}")
    return values


_budgets_arg.__name__, _inserts_arg.__name__, _shares_arg.__name__ = "budget list", "inserts", "share list"
admission_list_arg.__name__ = "admission list"
_read_ahead_arg.__name__ = "read-ahead list"
RATE_FLAGS = ("host_gbps", "link_gbps", "dram_gbps", "device_gbps", "ids_trip_us", "join_us")
READ_AHEAD_KB = 128  # the kernel's default read_ahead_kb (VM_READAHEAD_PAGES)


def parser() -> OneLineParser:
    ap = OneLineParser(prog="python -m moecache.replay",
                       description="Replay a routing trace through cache policies.")
    ap.add_argument("trace")
    _add_cache_flags(ap)
    _add_ram_flags(ap)
    _add_cost_flags(ap)
    ap.add_argument("--seed", type=int_arg(minimum=0), default=0, help="seed of the random policies")
    ap.add_argument("--csv", help="also write the results here")
    ap.add_argument("--plot", help="also plot hit%% vs cache size here (needs matplotlib)")
    ap.add_argument("--convert", metavar="OUT",
                    help="write the trace in its compact binary form (route_trace binary v1) to OUT and "
                         "replay nothing: replays of OUT read it in a fraction of the time and memory")
    return ap


def _add_cache_flags(ap) -> None:
    """The cache models' sizes, policies and per-layer settings."""
    ap.add_argument("--slots", type=int_list_arg(minimum=1),
                    help="per-layer cache sizes K, comma separated (default 8,16,32,64 unless "
                         "--budget-mib is given)")
    ap.add_argument("--policies", default="lru,belady,default",
                    help=f"comma separated; per-layer (--slots, --budget-mib): default ({DEFAULT_POLICY}), "
                         f"{', '.join(POLICIES)}; global (--budget-mib): {', '.join(BUDGET_POLICIES)}; both: "
                         f"{', '.join(MODELS[UPSTREAM])} (llama.cpp's own cache at tags "
                         f"{', '.join(UPSTREAM_TAGS.values())}, at each K's device bytes and each budget)")
    ap.add_argument("--inserts", type=_inserts_arg, default=2,
                    help="uploads per layer per step, or 'unlimited'")
    ap.add_argument("--admission", type=admission_list_arg,
                    help=f"per-layer admission timings, comma separated: {', '.join(ADMISSIONS)} "
                         f"(default: the live cache's, eager, or boundary for a policy that picks its "
                         f"victims itself: arc, sieve)")
    ap.add_argument("--budget-mib", type=_budgets_arg, default=[],
                    help="byte budgets, comma separated: the global model's (BigMoeOnEdge), and the "
                         "per-layer model at the largest K that fits")
    ap.add_argument("--prefill", choices=PREFILL_MODES, default="warm",
                    help="per-layer model: each prompt ubatch as a prefill step that uploads its most "
                         "used experts, as the live cache does (warm, the default); no prefill (off); "
                         "each turn's prompt as one batched observation (plain); each prompt ubatch "
                         "looked up as a decode step is (lookup: the RAM tier's, which --ram-mib uses)")
    ap.add_argument("--preload-profile", metavar="JSON",
                    help="per-layer model: warm start from a saved usage profile")


def _add_ram_flags(ap) -> None:
    """The models of a model larger than RAM and the disk they read."""
    ap.add_argument("--ram-mib", type=_budgets_arg, default=[],
                    help="RAM budgets in MiB, comma separated: the RAM tier (RAM_MIB's K, eager, INSERTS = K) "
                         "and stock mmap's page cache, on the CPU, timed over --disk-gbps")
    ap.add_argument("--disk-gbps", type=gbps_arg, help="with --ram-mib: the disk's read rate for large requests, GB/s")
    ap.add_argument("--disk-read-us", type=_us_arg,
                    help=f"with --ram-mib: one read request's latency, us (default {DISK_READ_US:g}, ASSUMED: "
                         f"a 4 KiB read at queue depth 1 on the benchmarks' disk)")
    ap.add_argument("--read-cpu-ms-per-mb", type=_nonnegative_arg("a CPU cost", "ms per MB"),
                    help="with --ram-mib: the CPU's work per MB the RAM tier reads (page-cache insert, mapping, "
                         "unmapping, release), ms, beside no compute (default 0; CALIBRATED on the benchmarks' "
                         "2-core machine: moecache.offline.calibration)")
    ap.add_argument("--read-cpu-ms-per-request", type=_nonnegative_arg("a CPU cost", "ms per request"),
                    help="with --ram-mib: the CPU's work per request the RAM tier reads (one expert tensor's range: "
                         "its syscalls, mapping and release), ms, beside --read-cpu-ms-per-mb's (default 0; "
                         "CALIBRATED with it: moecache.offline.calibration)")
    ap.add_argument("--read-ahead-kb", type=int_arg(minimum=0),
                    help=f"with --ram-mib: the disk's read_ahead_kb (/sys/block/DEV/queue/read_ahead_kb; default "
                         f"{READ_AHEAD_KB}, the kernel's), which llama.cpp's mapping doubles")
    ap.add_argument("--expert-read-ahead", type=_read_ahead_arg, default=[], metavar="PREDICTOR:R[,...]",
                    help=f"with --ram-mib: also run the RAM tier reading ahead in decode, PREDICTOR:R, comma "
                         f"separated: R experts the next layer will likely miss, read while this one computes, "
                         f"predicted by {', '.join(PREDICTORS)} (oracle reads the future: a bound)")


def _add_cost_flags(ap) -> None:
    """The machine of the modelled time, the miss planner at its rates, upstream's CPU share."""
    ap.add_argument("--hardware", choices=list(HARDWARE), default=DEFAULT_HARDWARE,
                    help="the machine of the MODELLED ms/token, a named class (moecache.core.hardware): "
                         + "; ".join(f"{h.name}: {h.summary}" for h in HARDWARE.values()))
    for flag, what in (("--host-gbps", "the CPU's read rate of host memory for experts, GB/s"),
                       ("--link-gbps", "host-to-device copy rate, GB/s"),
                       ("--dram-gbps", "host memory's read rate shared by the CPU and the DMA engine, GB/s"),
                       ("--device-gbps", "the GPU's read rate of device memory, GB/s")):
        ap.add_argument(flag, type=gbps_arg, help=f"{what} (default: --hardware's)")
    ap.add_argument("--ids-trip-us", type=_us_arg,
                    help="a layer's router ids reaching the host, us (default: --hardware's)")
    ap.add_argument("--join-us", type=_us_arg,
                    help="a CPU partial result returning to the device, us (default: --hardware's)")
    ap.add_argument("--planner", action="store_true",
                    help="per-layer model: plan each graph's misses at the hardware's rates, as the live "
                         "planner does (LLAMA_MOE_CACHE_PLANNER=1: the copy-on-miss lane, uploads only "
                         "when they pay; eager admission and a policy that counts uses: heat, lfu)")
    ap.add_argument("--cpu-share", type=_shares_arg, default=[0.0],
                    help="upstream (b12191): --moe-cache-cpu-share F, the share of the misses its full cache "
                         "computes on the CPU, comma separated, or 'tuned': "
                         + ", ".join(f"{v:g}" for v in TUNER_SHARES) + ", its tuner's (default 0)")


def check_args(args) -> None:
    """What the flags say together, and where the outputs go: a ValueError (one line, exit 2)
    before any replay runs."""
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not args.policies:
        raise ValueError("--policies is empty")
    _check_ram_args(args)
    if args.slots is None:
        args.slots = [] if args.budget_mib or args.ram_mib else [8, 16, 32, 64]
    if args.plot and not (args.slots or args.budget_mib):
        raise ValueError("--plot draws the cache models' hit rates by size: give --slots or --budget-mib")
    # A name runs in every requested model that has it; one that no requested model has is
    # rejected, never tabulated under a policy that did not run.
    models = ([("--slots", policy_names(PER_LAYER) + policy_names(UPSTREAM))] if args.slots else []) + \
             ([("--budget-mib", list(dict.fromkeys(policy_names(PER_LAYER) + policy_names(GLOBAL)
                                                    + policy_names(UPSTREAM))))] if args.budget_mib else []) + \
             ([("--ram-mib", policy_names(PER_LAYER))] if args.ram_mib else [])
    unknown = [p for p in args.policies if not any(p in names for _, names in models)]
    if unknown:
        valid = "; ".join(f"{flag}: {', '.join(names)}" for flag, names in models)
        raise ValueError(f"unknown policy {', '.join(unknown)} for "
                         f"{' and '.join(f for f, _ in models)}; valid {valid}")
    if args.cpu_share != [0.0] and "upstream" not in args.policies:
        raise ValueError("--cpu-share is b12191's: give --policies upstream")
    args.hardware = HARDWARE[args.hardware].override(**{name: getattr(args, name) for name in RATE_FLAGS})
    if args.planner:
        _check_planner(args)
    for flag, path in (("--csv", args.csv), ("--plot", args.plot)):
        if path:
            _check_output(path, flag)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib (pip install matplotlib)") from None


def _check_ram_args(args):
    """--ram-mib and the disk's flags go together."""
    disk_flags = [flag for flag, value in (("--disk-gbps", args.disk_gbps), ("--disk-read-us", args.disk_read_us),
                                           ("--read-cpu-ms-per-mb", args.read_cpu_ms_per_mb),
                                           ("--read-cpu-ms-per-request", args.read_cpu_ms_per_request),
                                           ("--read-ahead-kb", args.read_ahead_kb),
                                           ("--expert-read-ahead", args.expert_read_ahead or None))
                  if value is not None]
    if not args.ram_mib:
        if disk_flags:
            raise ValueError(f"{', '.join(disk_flags)} time the --ram-mib models: give --ram-mib too")
        return
    if args.disk_gbps is None:
        raise ValueError("--ram-mib needs --disk-gbps, the disk's read rate (GB/s) its reads are timed at")
    args.disk = Disk(args.disk_gbps, DISK_READ_US if args.disk_read_us is None else args.disk_read_us,
                     args.read_cpu_ms_per_mb or 0.0, args.read_cpu_ms_per_request or 0.0)
    if args.read_ahead_kb is None:
        args.read_ahead_kb = READ_AHEAD_KB


def _check_planner(args):
    """--planner plans the graph's own copies: eager admission, policies that count uses."""
    if args.admission and args.admission != ["eager"]:
        raise ValueError("--planner needs --admission eager")
    refused = [p for p in args.policies if p in policy_names(PER_LAYER)
               and not POLICIES[resolve_policy(p)].counts_uses]
    if refused or not any(p in policy_names(PER_LAYER) for p in args.policies):
        raise ValueError("--planner needs per-layer policies whose worth counts uses (default, heat, lfu)"
                         + (f"; not {', '.join(refused)}" if refused else ""))


def _check_output(path, flag):
    """An output file must be writable where it is named."""
    problem = output_problem(path)
    if problem:
        raise ValueError(f"{flag} {path}: {problem}")


def load_inputs(args):
    """The trace and the warm-start profile (or None), checked against the options."""
    trace = read_trace(args.trace)
    if args.slots and max(args.slots) > trace.n_expert:
        raise ValueError(f"--slots {max(args.slots)} exceeds n_expert={trace.n_expert}")
    per_layer = any(p in policy_names(PER_LAYER) for p in args.policies)
    args.budget_slots = {b: per_layer_slots(trace, b) for b in args.budget_mib} if per_layer else {}
    args.ram_slots = {b: ram_tier_slots(trace, b) for b in args.ram_mib}
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

    def per_layer(policy, admission, k):
        return PerLayerReplay(policy, k, inserts=args.inserts, admission=admission, prefill=args.prefill,
                              profile=profile, seed=args.seed, miss_plan=args.hardware.rates if args.planner else None)

    def read_aheads():  # the RAM tier without, then with each --expert-read-ahead (new ones each run)
        return [None] + [ReadAhead(name, width, args.disk, args.hardware.rates.host_gbps)
                         for name, width in args.expert_read_ahead]

    timings = [(p, a) for p in args.policies if p in policy_names(PER_LAYER)
               for a in args.admission or [live_admission(POLICIES[resolve_policy(p)])]]
    upstream = [p for p in args.policies if p in policy_names(UPSTREAM)]
    # (replay, what the result stands against: the K of an upstream run, the budget of a
    # per-layer run sized by one, the RAM budget of the RAM tier's and the page cache's)
    runs = [(per_layer(p, a, k), {}) for p, a in timings for k in args.slots] + \
           [(per_layer(p, a, args.budget_slots[b]), {"budget_mib": b}) for p, a in timings for b in args.budget_mib] + \
           [(UpstreamReplay(p, equal(k), share), {"slots": k}) for p in upstream for k in args.slots
            for share in _shares(p, args)] + \
           [(GlobalReplay(p, b, seed=args.seed), {}) for p in args.policies if p in policy_names(GLOBAL)
            for b in args.budget_mib] + \
           [(UpstreamReplay(p, b, share), {}) for p in upstream for b in args.budget_mib for share in _shares(p, args)] + \
           [(ram_tier_replay(p, args.ram_slots[b], a, read_ahead, args.seed), {"ram_mib": b}) for p, a in timings for b in args.ram_mib
            for read_ahead in read_aheads()] + \
           [(PageCacheReplay(p, b, args.read_ahead_kb), {"ram_mib": b})
            for p in policy_names(PAGE_CACHE) for b in args.ram_mib]
    results = []
    with Progress(len(runs)) as progress:
        for replay, against in runs:
            result = simulate(trace, replay)
            progress.advance(f"{result.policy} {result.slots or result.budget_mib:g}")
            for name, value in against.items():
                setattr(result, name, value)
            results.append(result)
    return results


def _shares(policy, args) -> list[float]:
    """The upstream runs' CPU shares: each --cpu-share for a version that has one."""
    return args.cpu_share if MODELS[UPSTREAM][policy].takes_cpu_share else [0.0]


def _pct(rate):
    return "-" if rate is None else f"{100 * rate:.1f}"


def _ms(value):
    return "-" if value is None else f"{value:.2f}"


def _planner_terms(hardware, trace) -> str:
    """The planner's terms at a class's rates: what an upload pays back, what a lane copy is
    credited (moecache.core.missplan)."""
    planner = MissPlanner(hardware.rates, trace.expert_bytes, trace.dense_bytes, n_used=trace.n_expert_used)
    return (f", miss planner at {hardware.name}'s rates (an upload pays back {hardware.rates.payback_uses:.2f} uses "
            f"as far as the link is busy; a lane copy is credited {planner.lane_credit:.2f})")


def print_tables(args, trace, results) -> None:
    n_prefill = int((trace.phase == PREFILL).sum())
    n_decode = int((trace.phase == DECODE).sum())
    n_steps = decode_steps(trace)  # the live stats' count: a recorded multi-token ubatch is one step
    print(f"{args.trace}: {trace.arch}, {trace.layers.size} MoE layers x {trace.n_expert} experts, "
          f"top-{trace.n_expert_used}; {n_prefill} prefill + {n_decode} decode tokens"
          f"{'' if n_steps == n_decode else f' in {n_steps} decode steps'}; one token's "
          f"working set {trace.working_set_bytes() / MIB:.0f} MiB")
    hardware = args.hardware
    stock = next((r.stock_ms(hardware) for r in results
                  if r.ram_mib is None and r.stock_ms(hardware) is not None), None)
    if stock is not None:
        print(f"ms/tok: MODELLED milliseconds per decode token (moecache.offline.cost), {hardware.describe()}; "
              f"stock --cpu-moe {stock:.2f}")
    for model in (PER_LAYER, GLOBAL, UPSTREAM):
        rows = [r for r in results if r.model == model and r.ram_mib is None]
        if not rows:
            continue
        if model == PER_LAYER:
            print(f"\nper-layer cache: K slots per layer, inserts={'unlimited' if args.inserts is None else args.inserts}, "
                  f"prefill {args.prefill}"
                  f"{', warm start from ' + args.preload_profile if args.preload_profile else ''}"
                  f"{_planner_terms(hardware, trace) if args.planner else ''}")
            # MiB: the device bytes of the K slots (equal_bytes); budget: the --budget-mib they fit
            head = f"{'policy':<16}{'admission':>10}{'K':>6}{'MiB':>8}" + (f"{'budget':>8}" if args.budget_mib else "")
        elif model == GLOBAL:
            print("\nglobal cache (BigMoeOnEdge model): one byte budget over all layers, immediate admission")
            head = f"{'policy':<16}{'MiB':>6}"
        else:
            print("\nupstream llama.cpp cache (--moe-cache-mib), one pool per group of layers, misses copied "
                  f"synchronously: upstream = tag {UPSTREAM_TAGS['upstream']} (ClassLRU; F: its "
                  f"--moe-cache-cpu-share), upstream-b11480 = tag {UPSTREAM_TAGS['upstream-b11480']} (one LRU); "
                  "K: at the device bytes of K per-layer slots")
            head = f"{'policy':<16}{'K':>6}{'MiB':>8}{'F':>6}"
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
                label = f"{r.policy:<16}{'-' if r.slots is None else r.slots:>6}{r.budget_mib:>8.0f}{r.cpu_share:>6g}"
            per_token = "-" if r.upload_bytes_per_token is None else f"{r.upload_bytes_per_token / MIB:.1f}"
            per_turn = "-" if r.prefill_upload_bytes_per_turn is None else f"{r.prefill_upload_bytes_per_turn / MIB:.1f}"
            print(f"{label}{_pct(r.hit_rate):>10}{_pct(r.hit_rate_all):>10}{per_token:>12}"
                  + (f"{per_turn:>14}" if warm else "")
                  + f"{_ms(r.modelled_ms(hardware)):>8}{r.lookups_per_s / 1e6:>11.2f}")


def print_ram_table(args, trace, results) -> None:
    """The --ram-mib runs: the RAM tier and stock mmap's page cache, timed on the CPU over the disk."""
    rows = [r for r in results if r.ram_mib is not None and r.read_ahead is None]
    if not rows:
        return
    host = args.hardware.rates.host_gbps
    print(f"\nlarger than RAM, CPU only: the RAM tier (LLAMA_MOE_CACHE_RAM_MIB: K experts per layer kept, eager "
          f"admission, INSERTS = K, prompts looked up, what it read and kept in no slot spare within one layer's reads "
          f"for a full ubatch) and stock mmap's page cache (4 KiB pages, read_ahead_kb "
          f"{args.read_ahead_kb}, doubled by llama.cpp's mapping, a window at most half the budget)\n"
          f"ms/tok: MODELLED per decode token (moecache.offline.cost.Disk): mmap (computed bytes / host + waits x read "
          f"latency + bytes read / disk), the tier per layer (dense / host + max(kept / host, read latency + misses / "
          f"disk) + misses / host, a miss found among the spares as kept): host {host:.2f} GB/s, "
          f"{args.disk.describe()}; hit%: decode lookups whose expert was in a slot (mmap: read without a page fault)")
    print(f"{'model':<12}{'policy':<16}{'admission':>10}{'RAM MiB':>9}{'K':>5}{'hit% dec':>10}{'MB read/tok':>13}"
          f"{'waits/tok':>11}{'ms/tok':>10}{'tok/s':>8}")
    for r in rows:
        read, waits = r.disk_reads()
        ms = r.disk_ms(host, args.disk)
        tier = r.model == PER_LAYER
        print(f"{'RAM tier' if tier else 'mmap':<12}{r.policy:<16}{r.admission or '-':>10}{r.ram_mib:>9g}"
              f"{r.slots if tier else '-':>5}{_pct(r.hit_rate):>10}"
              f"{'-' if not r.decode_tokens else format(read / r.decode_tokens / 1e6, '.1f'):>13}"
              f"{'-' if not r.decode_tokens else format(waits / r.decode_tokens, '.1f'):>11}"
              f"{_ms(ms):>10}{'-' if not ms else format(1e3 / ms, '.2f'):>8}")
    print_read_ahead_table(args, results)


def print_read_ahead_table(args, results) -> None:
    """The --expert-read-ahead runs beside the tier's run without read-ahead."""
    rows = [r for r in results if r.read_ahead is not None]
    if not rows:
        return
    plain = {(r.policy, r.admission, r.ram_mib): r.disk_ms(args.hardware.rates.host_gbps, args.disk)
             for r in results if r.model == PER_LAYER and r.ram_mib is not None and r.read_ahead is None}
    print("\nthe RAM tier reading ahead in decode (moecache.offline.readahead): while a layer computes, the R experts "
          "the predictor expects the next layer to miss are read; ahead/tok: experts read ahead per token; precision: "
          "of those, the share the next layer then missed; recall: the share of misses read ahead; held MiB: RAM "
          "beyond K; ms/tok: MODELLED, the disk overlapping the CPU, in request order; gain: against the tier "
          "without read-ahead above")
    print(f"{'policy':<16}{'RAM MiB':>9}{'K':>5}{'predictor':>17}{'R':>4}{'ahead/tok':>11}{'prec%':>7}{'recall%':>9}"
          f"{'MB read/tok':>13}{'held MiB':>10}{'ms/tok':>9}{'gain%':>7}")
    for r in rows:
        ra = r.read_ahead
        ms, before = ra.ms_per_token, plain.get((r.policy, r.admission, r.ram_mib))
        gain = "-" if not ms or not before else f"{round(100 * (before - ms) / before, 1) + 0.0:.1f}"  # no -0.0
        print(f"{r.policy:<16}{r.ram_mib:>9g}{r.slots:>5}{ra.name:>17}{ra.width:>4}"
              f"{'-' if not ra.tokens else format(ra.read_ahead / ra.tokens, '.2f'):>11}"
              f"{_pct(ra.precision):>7}{_pct(ra.recall):>9}"
              f"{'-' if not ra.tokens else format(ra.read_bytes / ra.tokens / 1e6, '.1f'):>13}"
              f"{ra.held_mib():>10.1f}{_ms(ms):>9}{gain:>7}")


def modelled_ms(args, r) -> float | None:
    """A run's MODELLED ms per decode token: on the CPU over the disk (--ram-mib; reading ahead: its
    timeline), else on --hardware."""
    if r.read_ahead is not None:
        return r.read_ahead.ms_per_token
    return r.modelled_ms(args.hardware) if r.ram_mib is None else r.disk_ms(args.hardware.rates.host_gbps, args.disk)


CSV_COLUMNS = ("model", "policy", "slots", "budget_mib", "inserts", "admission", "decode_steps", "decode_tokens",
               "hits", "misses", "uploads", "upload_bytes", "hit_rate", "hits_all", "misses_all",
               "hit_rate_all", "upload_bytes_per_token", "modelled_ms_per_token", "seconds", "prefill",
               "prefill_upload_bytes", "ram_mib", "disk_read_bytes_per_token", "read_ahead", "cpu_share")


def write_csv(path, results, args) -> None:
    """One row per run; rates are fractions, empty where a run had no lookups; the modelled
    milliseconds per decode token are on --hardware, or (--ram-mib) on the CPU over the disk."""
    atomic_write(path, lambda tmp: _write_rows(tmp, results, args))


def _write_rows(path, results, args):
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, CSV_COLUMNS)
        writer.writeheader()
        for r in results:
            writer.writerow({
                "model": r.model, "policy": r.policy, "slots": r.slots, "budget_mib": r.budget_mib,
                "cpu_share": r.cpu_share,
                "inserts": ("unlimited" if r.inserts is None else r.inserts) if r.model == PER_LAYER else None,
                "admission": r.admission, "decode_steps": r.decode_steps, "decode_tokens": r.decode_tokens,
                **{name: r.totals[name] for name in ("hits", "misses", "uploads", "upload_bytes")},
                "hit_rate": None if r.hit_rate is None else f"{r.hit_rate:.6f}",
                "hits_all": r.totals_all["hits"], "misses_all": r.totals_all["misses"],
                "hit_rate_all": None if r.hit_rate_all is None else f"{r.hit_rate_all:.6f}",
                "upload_bytes_per_token": None if r.upload_bytes_per_token is None
                else f"{r.upload_bytes_per_token:.0f}",
                "modelled_ms_per_token": _ms(modelled_ms(args, r)).replace("-", ""),
                "seconds": f"{r.seconds:.4f}", "prefill": r.prefill,
                "prefill_upload_bytes": r.totals_all.get("prefill_upload_bytes") if r.model == PER_LAYER else None,
                "ram_mib": r.ram_mib, "disk_read_bytes_per_token": _disk_read_per_token(r),
                "read_ahead": None if r.read_ahead is None else f"{r.read_ahead.name}:{r.read_ahead.width}"})


def _disk_read_per_token(r):
    """Bytes a --ram-mib run read from the file per decode token (reading ahead: its reads too)."""
    if r.ram_mib is None or not r.decode_tokens:
        return None
    read = r.disk_reads()[0] if r.read_ahead is None else r.read_ahead.read_bytes
    return f"{read / r.decode_tokens:.0f}"


def plot(path, trace, results) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in results if r.ram_mib is None]  # the --ram-mib runs are a table's
    models = [m for m in MODELS if any(r.model == m for r in results)]
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for policy, admission, share in dict.fromkeys((r.policy, r.admission, r.cpu_share) for r in results
                                                      if r.model == model):
            rows = [r for r in results if r.model == model and r.policy == policy
                    and r.admission == admission and r.cpu_share == share and r.hit_rate is not None]
            xs = [r.slots if model == PER_LAYER else r.budget_mib for r in rows]
            label = policy if admission in (None, "boundary") else f"{policy} {admission}"
            ax.plot(xs, [100 * r.hit_rate for r in rows], marker="o",
                    label=f"{label} F={share:g}" if share else label,
                    linestyle="--" if policy == "belady" else "-")
        ax.set_xlabel("slots per layer (K)" if model == PER_LAYER else "budget (MiB)")
        ax.set_ylabel("decode hit %")
        ax.set_title(f"{trace.arch}: {model} cache")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format=os.path.splitext(path)[1][1:] or "png"))


def convert(args) -> None:
    """--convert: the trace in its binary form (moecache.formats.binary_trace), nothing replayed."""
    defaults = vars(parser().parse_args([args.trace]))
    given = [f"--{name.replace('_', '-')}" for name, value in vars(args).items()
             if name not in ("trace", "convert") and value != defaults[name]]
    if given:
        raise ValueError(f"--convert replays nothing: drop {', '.join(given)}")
    _check_output(args.convert, "--convert")
    if os.path.exists(args.convert) and os.path.samefile(args.convert, args.trace):
        raise ValueError(f"--convert {args.convert}: is the trace itself")
    trace = read_trace(args.trace)
    try:
        size = write_binary_trace(trace, args.convert)
    except OSError as e:
        raise ValueError(f"--convert {args.convert}: {e.strerror}") from None
    print(f"wrote {args.convert}: {len(trace.step)} steps x {trace.layers.size} MoE layers x top-"
          f"{trace.n_expert_used}, {size / MIB:.1f} MiB", file=_status(args.convert))


def _status(path):
    """Where the line saying an output was written goes: stdout, unless the output was written
    through a device or a FIFO (--convert /dev/stdout | ...): then stderr, out of its stream."""
    return sys.stdout if os.path.isfile(path) else sys.stderr


def replay(args) -> None:
    """The command: convert, or check, load, run, print, write."""
    if args.convert:
        return convert(args)
    check_args(args)
    trace, profile = load_inputs(args)
    try:
        results = run(args, trace, profile)
    except MemoryError as e:  # past every check of the memory the models take
        raise ValueError(f"{args.trace}: out of memory replaying it ({e or 'MemoryError'})") from None
    print_tables(args, trace, results)
    print_ram_table(args, trace, results)
    outputs = [(flag, path, write) for flag, path, write in (
        ("--csv", args.csv, lambda p: write_csv(p, results, args)),
        ("--plot", args.plot, lambda p: plot(p, trace, results))) if path]
    if outputs:
        print(flush=True)  # before an output written through to stdout
    for flag, path, write in outputs:
        try:
            write(path)
        except OSError as e:
            raise ValueError(f"{flag} {path}: {e.strerror}") from None
        print(f"wrote {path}", file=_status(path))


def main(argv=None) -> int:
    return parser().run(replay, argv)
