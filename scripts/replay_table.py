"""Measure the figures in docs/notes/policy-experiments.md and print them as markdown.

    python scripts/replay_table.py [TRACE ...]   (default: the shipped traces)

Per trace: every per-layer policy's decode hit% at K = n_expert/8 with INSERTS=2 and with
unlimited inserts, the share of the LRU->Belady gap the default closes, and a diagnostic
offline bound (a policy told each expert's total decode use count up front); the same on
synthetic locality routing; what predicts reuse (recency vs past use count); warm start (the profile of one half of decode
preloaded and given to the policy as its prior before replaying the other half, vs cold).
Replay throughput: scripts/bench_step.py --replay.
"""

import sys
from pathlib import Path

import numpy as np

from moecache.core.policies import DEFAULT_POLICY, POLICIES
from moecache.formats.profile import UsageProfile
from moecache.formats.traces import DECODE, SHIPPED_TRACES, RouteTrace, read_trace
from moecache.offline.experiments import PopularityOracle, preloaded_only, synthetic_routings
from moecache.offline.replay import PerLayerReplay, simulate
from moecache.util import OneLineParser


def hit_pct(trace, policy, slots, inserts=2, **options):
    return 100 * simulate(trace, PerLayerReplay(policy, slots, inserts=inserts, prefill="off", **options)).hit_rate


def preloaded_pct(trace, slots, profile):
    return 100 * preloaded_only(trace, DEFAULT_POLICY, slots, profile).hit_rate


def gap_closed(policy, lru, belady):
    return 100.0 * (policy - lru) / (belady - lru) if belady > lru else float("nan")


def policy_table(trace, slots):
    names = ["belady", *[n for n in POLICIES if n != "belady"]]
    hits = {(name, inserts): hit_pct(trace, name, slots, inserts) for name in names for inserts in (2, None)}
    print(f"\n{Path(trace.path).name}: K={slots} per layer ({trace.layers.size} layers x "
          f"{trace.n_expert} experts, top-{trace.n_expert_used}, {len(trace.decode_ids)} decode steps)\n")
    print("| policy | hit% INSERTS=2 | gap closed | hit% unlimited | gap closed |")
    print("|---|---:|---:|---:|---:|")
    for name in names:
        label = f"{name} (default)" if name == DEFAULT_POLICY else name
        cells = []
        for inserts in (2, None):
            h = hits[(name, inserts)]
            gap = gap_closed(h, hits[("lru", inserts)], hits[("belady", inserts)])
            cells += [f"{h:.1f}", "" if name in ("lru", "belady") else f"{gap:.0f}%"]
        print(f"| {label} | " + " | ".join(cells) + " |")
    cells = []
    for inserts in (2, None):
        h = hit_pct(trace, PopularityOracle(trace.decode_ids), slots, inserts)
        cells += [f"{h:.1f}", f"{gap_closed(h, hits[('lru', inserts)], hits[('belady', inserts)]):.0f}%"]
    print("| popularity oracle (diagnostic, offline) | " + " | ".join(cells) + " |")


def synthetic_table():
    names = ["lru", "lfu", "gdsf", "arc", "sieve", DEFAULT_POLICY]
    print("\nsynthetic locality routing (moecache.formats.traces.synthetic_routing, 300 steps, seeds 3..5), "
          "K = experts/8, INSERTS=2: hit% (gap closed)\n")
    print("| routing | belady | " + " | ".join(names) + " |")
    print("|---|---:|" + "---:|" * len(names))
    for label, _, routing, experts in synthetic_routings():
        trace = RouteTrace.from_routing(routing, experts)
        slots = experts // 8
        best = hit_pct(trace, "belady", slots)
        hits = {n: hit_pct(trace, n, slots) for n in names}
        cells = [f"{hits[n]:.1f}" + ("" if n == "lru" else f" ({gap_closed(hits[n], hits['lru'], best):.0f}%)")
                 for n in names]
        print(f"| {label} | {best:.1f} | " + " | ".join(cells) + " |")


def reuse_statistics(trace):
    """P(an expert is used at step t+d | used at t), and P(used at t+2 | used n times up to t)."""
    decode = trace.decode_ids
    steps, layers, _ = decode.shape
    used = np.zeros((steps, layers, trace.n_expert), dtype=bool)
    for t, ids in enumerate(decode):
        used[t, np.arange(layers)[:, None], ids] = True
    print(f"\nreuse, {Path(trace.path).name} (decode): chance level {trace.n_expert_used / trace.n_expert:.3f}")
    print("  P(used at t+d | used at t): " + ", ".join(
        f"d={d} {(used[:-d] & used[d:]).sum() / used[:-d].sum():.2f}" for d in (1, 2, 3, 5, 10)))
    seen = np.cumsum(used, axis=0)[:-2]
    cells = []
    for low, high in ((1, 1), (2, 3), (4, 7), (8, 15), (16, 31), (32, steps)):
        group = (seen >= low) & (seen <= high)
        if group.any():
            cells.append(f"{low}-{high}: {(group & used[2:]).sum() / group.sum():.2f}")
    print("  P(used at t+2 | used n times up to t): " + ", ".join(cells))


def warm_start_table(trace, slots):
    """Warm start as the live cache does it (preload + the policy's prior), from the profile
    of one half of decode into a replay of the other half, both ways round."""
    decode = np.flatnonzero(trace.phase == DECODE)
    half = len(decode) // 2
    print(f"\nwarm start, {Path(trace.path).name}, K={slots}, INSERTS=2: decode hit% of one half, "
          f"cold or warmed by the other half's profile (Belady warm: preloaded, it has no prior); "
          f"gap closed: LRU -> Belady, all cold or all warm\n")
    print(f"| replayed <- profile | lru cold | lru warm | {DEFAULT_POLICY} cold | {DEFAULT_POLICY} warm | "
          f"belady cold | belady warm | gap closed cold | gap closed warm | {DEFAULT_POLICY} preloaded only |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    halves = {"first": decode[:half], "second": decode[half:]}
    for replayed, source in (("second", "first"), ("first", "second")):
        part = trace.select(halves[replayed])
        profile = UsageProfile.from_ids(trace.model, trace.layers, trace.n_expert, trace.ids[halves[source]])
        hit = {(name, warm): hit_pct(part, name, slots, profile=profile if warm else None)
               for name in ("lru", DEFAULT_POLICY, "belady") for warm in (False, True)}
        closed = [gap_closed(hit[DEFAULT_POLICY, warm], hit["lru", warm], hit["belady", warm])
                  for warm in (False, True)]
        print(f"| {replayed} <- {source} | " + " | ".join(
            f"{hit[name, warm]:.1f}" for name in ("lru", DEFAULT_POLICY, "belady") for warm in (False, True))
            + f" | {closed[0]:.0f}% | {closed[1]:.0f}% | {preloaded_pct(part, slots, profile):.1f} |")


def synthetic_warm_start_table():
    """The default policy warmed by the profile of one half of synthetic routing (popularity
    drifts), with and without the prior."""
    print(f"\nwarm start on synthetic locality routing (as above), {DEFAULT_POLICY}, K = experts/8, "
          f"INSERTS=2: profile of steps 0-149 warming 150-299, and the reverse\n")
    print("| routing | replayed | cold | preloaded only | preloaded + prior |")
    print("|---|---|---:|---:|---:|")
    for label, _, routing, experts in synthetic_routings():
        slots = experts // 8
        for replayed, source in ((slice(150, None), slice(0, 150)), (slice(0, 150), slice(150, None))):
            part = RouteTrace.from_routing(routing[replayed], experts)
            profile = UsageProfile.from_ids("synthetic", range(routing.shape[1]), experts, routing[source])
            hit = [hit_pct(part, DEFAULT_POLICY, slots), preloaded_pct(part, slots, profile),
                   hit_pct(part, DEFAULT_POLICY, slots, profile=profile)]
            print(f"| {label} | {replayed.start or 0}-{(replayed.stop or 300) - 1} | "
                  + " | ".join(f"{h:.1f}" for h in hit) + " |")


def main(argv=None) -> int:
    p = OneLineParser(prog="replay_table.py", description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="*", metavar="TRACE", help="route traces (default: the shipped ones)")
    return p.run(lambda args: tables([Path(t) for t in args.traces] or list(SHIPPED_TRACES)), argv)


def tables(paths):
    traces = [read_trace(str(p)) for p in paths]
    for trace in traces:
        policy_table(trace, trace.n_expert // 8)
    synthetic_table()
    for trace in traces:
        reuse_statistics(trace)
    for trace in traces:
        warm_start_table(trace, trace.n_expert // 8)
    synthetic_warm_start_table()


if __name__ == "__main__":
    sys.exit(main())
