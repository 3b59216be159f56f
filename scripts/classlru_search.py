"""Candidate defaults against upstream b12191's ClassLRU, swept (issue 37;
docs/notes/upstream-comparison.md, "ClassLRU and the default"): each family of
moecache.offline.experiments.CLASSLRU_SEARCH at each of its settings, per layer, eager, prompt
warm, in the hit-rate cells of scripts/compare_upstream.py (both shipped traces and the synthetic
routings at K = 8, 16, 32; ClassLRU at the same device bytes, F = 0).

    python scripts/classlru_search.py   (3 minutes of CPU, 7 on 2 shared cores; imports the installed moecache)

Prints, per family, how many settings were run, how many are at least ClassLRU's in every cell, and
its best settings by their smallest margin (decode hit% points over ClassLRU), with their mean margin,
the cells behind and every cell's margin.
"""

import sys

import numpy as np

from moecache.formats.traces import SHIPPED_TRACES, read_trace
from moecache.offline.experiments import CLASSLRU_SEARCH
from moecache.offline.replay import PerLayerReplay, simulate
from moecache.util import OneLineParser

from compare_upstream import equal_bytes_cells, upstream

SHOWN = 3


def main():
    cells = equal_bytes_cells([read_trace(str(p)) for p in SHIPPED_TRACES])
    classlru = {(label, k): upstream(trace, k).hit_rate for label, trace, k in cells}
    print("cells: " + ", ".join(f"{label.split(',')[0]} {k}" for label, _, k in cells))
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


if __name__ == "__main__":
    sys.exit(OneLineParser(prog="classlru_search.py", description=__doc__.split("\n\n")[0]).run(lambda _: main()))
