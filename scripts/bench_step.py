"""Time CacheEngine.step() on synthetic decode routing with locality.

    python scripts/bench_step.py [--layers 48 --experts 128 --top-k 8 --slots 64 --inserts 2
                                  --policy lru --admission boundary --steps 2000 --evict-mib 0
                                  --planner CLASS]
                                 [--replay RUNS [--trace FILE]]

--evict-mib N reads N MiB before each timed step, as a decode graph streaming the experts does
between two live steps: the step then runs with cold CPU caches.
--planner CLASS also times each eager row with the miss planner as it runs live
(LLAMA_MOE_CACHE_PLANNER=1: the copy-on-miss lane and the payback margin) at that hardware class's
rates (moecache.core.hardware.HARDWARE).
--replay RUNS times whole replays instead (moecache.offline.replay.simulate, the offline driver) and
prints the median replay throughput of RUNS runs in lookups/s; --trace replays that trace file
instead of the synthetic routing.
"""

import sys

import numpy as np

from moecache.formats.traces import RouteTrace, read_trace, synthetic_routing
from moecache.core.policies import POLICIES, resolve_policy
from moecache.offline.cli import admission_list_arg
from moecache.core.hardware import HARDWARE
from moecache.offline.replay import PerLayerReplay, simulate
from moecache.util import OneLineParser, int_arg


def main(argv=None) -> int:
    ap = OneLineParser(prog="bench_step.py", description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int_arg(minimum=1), default=48)
    ap.add_argument("--experts", type=int_arg(minimum=1), default=128)
    ap.add_argument("--top-k", type=int_arg(minimum=1), default=8)
    ap.add_argument("--slots", type=int_arg(minimum=1), default=64)
    ap.add_argument("--inserts", type=int_arg(minimum=1), default=2)
    ap.add_argument("--policy", default="lru", help="comma separated policy names")
    ap.add_argument("--admission", type=admission_list_arg, default=["boundary"],
                    help="comma separated admission timings (boundary, eager: the step then also "
                         "models the graph's admissions and computes the next handover)")
    ap.add_argument("--steps", type=int_arg(minimum=10), default=2000)
    ap.add_argument("--evict-mib", type=int_arg(minimum=0), default=0,
                    help="MiB read before each step to evict the CPU caches (0: warm loop)")
    ap.add_argument("--replay", type=int_arg(minimum=1), metavar="RUNS",
                    help="time RUNS whole replays and print their median lookups/s")
    ap.add_argument("--trace", help="with --replay: replay this trace file")
    ap.add_argument("--planner", choices=list(HARDWARE), metavar="CLASS",
                    help="also time the eager rows with the live miss planner at this class's rates")
    return ap.run(bench, argv)


def bench(args):
    if args.trace and not args.replay:
        raise ValueError("--trace needs --replay")
    if args.replay:
        return replay_throughput(args)
    streamed = np.ones(args.evict_mib << 17)  # float64: 2**17 per MiB

    trace = RouteTrace.from_routing(
        synthetic_routing(args.steps, args.layers, args.experts, args.top_k, seed=1), args.experts)
    print(f"{args.layers} layers x top-{args.top_k}, {args.experts} experts, K={args.slots}, "
          f"inserts={args.inserts}, {args.steps} steps"
          + (f", {args.evict_mib} MiB read before each step" if args.evict_mib else ""))
    for admission in args.admission:
        for name in args.policy.split(","):
            planners = [None]
            if args.planner and admission == "eager" and POLICIES[resolve_policy(name)].counts_uses:
                planners.append(HARDWARE[args.planner].rates)
            for rates in planners:
                replay = PerLayerReplay(name, args.slots, inserts=args.inserts, admission=admission, miss_plan=rates)
                result = simulate(trace, replay, step_times=True, before_step=streamed.sum)
                times = result.step_seconds[args.steps // 10:] * 1e6  # skip the cold-start fill
                label = admission + ("+planner" if rates else "")
                print(f"{name:>8} {label:>8}: step() median {np.median(times):6.1f} us  min "
                      f"{times.min():6.1f}  max {times.max():7.1f}  hit {100 * result.hit_rate:.1f}%"
                      + (f", {result.totals['lane_misses']} misses through the lane, "
                         f"{result.totals['declined']} uploads declined" if rates else ""))


def replay_throughput(args):
    if args.trace:
        trace = read_trace(args.trace)
        shape = f"{args.trace}: {trace.layers.size} layers x top-{trace.n_expert_used}, {trace.n_expert} experts"
    else:
        trace = RouteTrace.from_routing(
            synthetic_routing(args.steps, args.layers, args.experts, args.top_k, seed=1), args.experts)
        shape = f"synthetic {args.layers} layers x top-{args.top_k}, {args.experts} experts"
    if args.slots > trace.n_expert:
        raise ValueError(f"--slots {args.slots} exceeds the {trace.n_expert} experts")
    print(f"{shape}, {len(trace.ids)} steps, K={args.slots}, inserts={args.inserts}; median of {args.replay} replays")
    for admission in args.admission:
        for name in args.policy.split(","):
            results = [simulate(trace, PerLayerReplay(name, args.slots, inserts=args.inserts, admission=admission))
                       for _ in range(args.replay)]
            rates = [r.lookups_per_s for r in results]
            print(f"{name:>8} {admission:>8}: {np.median(rates) / 1e6:.2f} M lookups/s (min {min(rates) / 1e6:.2f}, "
                  f"max {max(rates) / 1e6:.2f}), {results[0].lookups / max(results[0].decode_steps, 1):.0f} lookups per decode step, "
                  f"hit {100 * results[0].hit_rate:.1f}%")


if __name__ == "__main__":
    sys.exit(main())
