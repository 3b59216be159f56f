"""Candidate defaults against upstream b12191's ClassLRU, swept (issue 37;
docs/notes/upstream-comparison.md, "ClassLRU and the default"): each family of
moecache.offline.experiments.CLASSLRU_SEARCH at each of its settings, per layer, eager, prompt
warm, in the hit-rate cells of scripts/compare_upstream.py (both shipped traces and the synthetic
routings at K = 8, 16, 32; ClassLRU at the same device bytes, F = 0).

    python scripts/classlru_search.py   (3 minutes of CPU, 7 on 2 shared cores; imports the installed moecache)

Prints, per family, how many settings were run, how many are at least ClassLRU's in every cell, and
its best settings by their smallest margin (decode hit% points over ClassLRU), with their mean margin,
the cells behind and every cell's margin.

    python scripts/classlru_search.py --fitted-slots   (18 minutes of CPU)

Instead asks whether a K of its own for each layer would close the gap: for heat and for the
families' best, each cell's margin over ClassLRU at K slots per layer and with each layer's K fitted
to the trace itself at the same device bytes (moecache.offline.experiments.fitted_slots, an oracle:
a bound on any way of dividing the slots ahead of time), and whether a division learnt from one half
of the trace still pays in the other half.
"""

import sys

import numpy as np

from moecache.formats.traces import SHIPPED_TRACES, read_trace
from moecache.core.policies import make_policy
from moecache.offline.experiments import CLASSLRU_SEARCH, HeatSum, fit_slots, fitted_slots, hits_at, layer_hits
from moecache.offline.replay import PerLayerReplay, simulate
from moecache.util import OneLineParser

from compare_upstream import equal_bytes_cells, upstream

SHOWN = 3
FITTED = [  # (label, policy factory, inserts): heat and the families' best by the smallest margin
    ("heat (the default)", lambda: make_policy("heat"), 2),
    ("heat-sum 10+64 (1:2), unlimited inserts", HeatSum, None),
]


def main(args):
    cells = equal_bytes_cells([read_trace(str(p)) for p in SHIPPED_TRACES])
    classlru = {(label, k): upstream(trace, k).hit_rate for label, trace, k in cells}
    print("cells: " + ", ".join(f"{label.split(',')[0]} {k}" for label, _, k in cells))
    if args.fitted_slots:
        return fitted(cells, classlru)
    for family, settings in CLASSLRU_SEARCH:
        rows = []
        for label, factory, inserts in settings:
            margins = np.array([100 * (simulate(trace, PerLayerReplay(factory(), k, inserts=inserts, admission="eager",
                                                                      prefill="warm")).hit_rate - classlru[name, k])
                                for name, trace, k in cells])
            rows.append((margins.min(), label, margins))
        rows.sort(key=lambda row: -row[0])
        print(f"\n{family}: {len(rows)} settings, {sum(row[0] >= 0 for row in rows)} at least ClassLRU's in every cell")
        for low, label, margins in rows[:SHOWN]:
            print(f"  {label}: min {low:+.2f}, mean {margins.mean():+.2f}, {(margins < 0).sum()} cells behind | "
                  + " ".join(f"{m:+.1f}" for m in margins), flush=True)


def fitted(cells, classlru):
    for label, factory, inserts in FITTED:
        def replay_of(slots):
            return PerLayerReplay(factory(), slots, inserts=inserts, admission="eager", prefill="warm")
        print(f"\n{label}: decode hit% points over ClassLRU at K slots per layer -> with each layer's K fitted "
              f"to the trace (its range); in each half of the trace, points over K slots per layer with the "
              f"K fitted to that half, and to the other half")
        lows = []
        for name, trace, k in cells:
            uniform, best, slots = fitted_slots(trace, k, replay_of)
            lows.append(100 * (best - classlru[name, k]))
            own, other = half_gains(trace, k, replay_of)
            print(f"  {name.split(',')[0]} {k}: {100 * (uniform - classlru[name, k]):+.2f} -> {lows[-1]:+.2f} "
                  f"(K {slots.min()}..{slots.max()}); halves: {own:+.2f} its own, {other:+.2f} the other's",
                  flush=True)
        print(f"  fitted to the trace: min {min(lows):+.2f}, mean {np.mean(lows):+.2f}, "
              f"{sum(m < 0 for m in lows)} cells behind")


def half_gains(trace, k, replay_of):
    """Decode hit% points over K slots per layer in the trace's two halves (summed), each half
    with the Ks fitted to itself, and with those fitted to the other half."""
    parts = [layer_hits(half, k, replay_of) for half in halves(trace)]
    ks, lookups = parts[0][0], parts[0][2] + parts[1][2]
    fits = [fit_slots(ks, hits, k, trace.expert_bytes) for _, hits, _ in parts]
    def gain(chosen):
        return 100 * sum(hits_at(ks, hits, f) - hits_at(ks, hits, k)
                         for (_, hits, _), f in zip(parts, chosen)) / lookups
    return gain(fits), gain(fits[::-1])


def halves(trace):
    """The trace's steps in two, cut at the turn that starts nearest the middle (one turn: the middle)."""
    steps = np.arange(len(trace.step))
    starts = np.flatnonzero(np.diff(trace.turn)) + 1
    cut = starts[np.argmin(abs(starts - len(steps) / 2))] if starts.size else len(steps) // 2
    return trace.select(steps < cut), trace.select(steps >= cut)


if __name__ == "__main__":
    parser = OneLineParser(prog="classlru_search.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--fitted-slots", action="store_true",
                        help="each layer's K fitted to the trace (an oracle) instead of the families' sweep")
    sys.exit(parser.run(main))
