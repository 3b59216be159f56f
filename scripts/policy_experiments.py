"""Candidate default policies that were tried against `heat` and NOT shipped (issue 4).

    python scripts/policy_experiments.py   (15 s on a loaded 2-core machine; imports the installed
                                           moecache, as every script here)

Prints decode hit% at K = n_expert/8, INSERTS=2, with the share of the LRU->Belady gap
closed, on both shipped traces (plus uploads per layer per step) and on synthetic locality
routing. The candidates (moecache.offline.experiments.DEFAULT_CANDIDATES, described there)
live outside moecache.core.policies, so the negative results in docs/notes/policy-experiments.md stay
reproducible.
"""

import sys
from pathlib import Path

import numpy as np

from moecache.formats.traces import SHIPPED_TRACES, RouteTrace, read_trace
from moecache.offline.experiments import DEFAULT_CANDIDATES, SKEWED, SYNTHETIC, synthetic_routings
from moecache.offline.replay import PerLayerReplay, simulate
from moecache.util import OneLineParser


def run(trace, slots, policy):
    """Decode hit% and uploads per layer per step."""
    result = simulate(trace, PerLayerReplay(policy, slots, prefill="off"))
    return 100 * result.hit_rate, result.totals["uploads"] / (result.decode_tokens * trace.layers.size)


def row(label, trace, uploads):
    slots = trace.n_expert // 8
    lru = run(trace, slots, "lru")[0]
    best = run(trace, slots, "belady")[0]
    cells = []
    for factory in DEFAULT_CANDIDATES.values():
        hit, up = run(trace, slots, factory())
        cells.append(f"{hit:.1f} ({100 * (hit - lru) / (best - lru):.0f}%" + (f", {up:.2f} up)" if uploads else ")"))
    print(f"| {label} | {lru:.1f} | {best:.1f} | " + " | ".join(cells) + " |", flush=True)


def first_use_bound(path):
    """Share of decode lookups that no policy without prefetch can hit: an expert's first
    use, and a use right after a first use (its upload is not published yet)."""
    trace = read_trace(path)
    obs = trace.decode_ids
    T, L, _ = obs.shape
    used = np.zeros((T, L, trace.n_expert), dtype=bool)
    for t in range(T):
        used[t, np.arange(L)[:, None], obs[t]] = True
    first = (np.cumsum(used, axis=0) == 1) & used
    lost = first.sum() + (used[1:] & first[:-1]).sum()
    print(f"{Path(path).name}: {used.any(axis=0).sum(axis=1).mean():.1f} distinct experts per layer "
          f"in decode; first uses {100 * first.sum() / used.sum():.1f}% of lookups; hit% bound "
          f"without prefetch {100 - 100 * lost / used.sum():.1f}")


def main(argv=None) -> int:
    p = OneLineParser(prog="policy_experiments.py", description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="*", metavar="TRACE", help="route traces (default: the shipped ones)")
    return p.run(lambda args: experiments(args.traces or [str(t) for t in SHIPPED_TRACES]), argv)


def experiments(paths):
    for path in paths:
        first_use_bound(path)
    print("\ndecode hit% at K = n_expert/8, INSERTS=2 (gap closed[, uploads per layer per step])\n")
    print("| routing | lru | belady | " + " | ".join(DEFAULT_CANDIDATES) + " |")
    print("|---|---:|---:|" + "---:|" * len(DEFAULT_CANDIDATES))
    for path in paths:
        row(Path(path).name.split(".")[0], read_trace(path), True)
    for label, _, routing, experts in synthetic_routings([*SYNTHETIC, SKEWED]):
        row(label, RouteTrace.from_routing(routing, experts), False)


if __name__ == "__main__":
    sys.exit(main())
