"""Victim rules for one pool of slots per group of layers under our rules (issue 37;
docs/notes/upstream-comparison.md, "A pooled allocation, modelled"): each candidate of
moecache.offline.pooled.VICTIM_SEARCH in the hit-rate cells of scripts/compare_upstream.py (both
shipped traces and the synthetic routings at K = 8, 16, 32), decode hit% points over upstream
b12191's ClassLRU at the same device bytes (F = 0), eager, prompt warm. MODELLED.

    python scripts/pooled_victims.py [--sweep]   (about 5 minutes on 2 shared cores; imports moecache
                                                 as found; --sweep: DEFER_SWEEP's policies with defer, 2)

Prints one row per candidate: every cell's margin, the smallest, the mean, the cells behind, per
decode token the lookups of experts evicted ahead (a miss each), the layers a copy waited on
average for its victim's layer to run (defer), and the share of the pool's layers run when a
copy starts, on average. Rows whose victims say "a graph late" are worst cases: those copies
are published a boundary late (every other row counts every copy complete at the next boundary).
Then, on the shipped traces, decode hit% and MiB uploaded per decode token of the live default,
ClassLRU and two pooled candidates with defer (BYTES_ROWS).
"""

import sys
from pathlib import Path

import numpy as np

from moecache.formats.traces import SHIPPED_TRACES, read_trace
from moecache.offline.experiments import HeatSum, HeatSumAdmission
from moecache.offline.pooled import DEFER_SWEEP, VICTIM_SEARCH, Victims, pooled_replay
from moecache.offline.replay import MIB
from moecache.util import OneLineParser

from compare_upstream import SIZES, equal_bytes_cells, live_default, upstream

BYTES_ROWS = [  # (label, replay of (trace, K)): the bytes table
    ("live default (heat, K per layer)", live_default),
    ("ClassLRU (b12191, F = 0)", upstream),
    ("pooled heat-sum 10+64, unlimited, defer", lambda t, k: pooled_replay(t, HeatSum(), k, inserts=None,
                                                                            rule=Victims("defer"))),
    ("pooled heat-sum 8+64, 2 uses' credit, unlimited, defer",
     lambda t, k: pooled_replay(t, HeatSumAdmission((8, 64), (1.0, 2.0), credit=2.0), k, inserts=None,
                                rule=Victims("defer"))),
]


def main(candidates):
    cells = equal_bytes_cells([read_trace(str(p)) for p in SHIPPED_TRACES])
    classlru = {(label, k): upstream(trace, k).hit_rate for label, trace, k in cells}
    print("| policy | victims | " + " | ".join(f"{label.split(',')[0]} {k}" for label, _, k in cells)
          + " | min | mean | behind | evicted ahead, read /tok | copy waited, layers "
          "| copy start, share of layers run |")
    print("|---|---|" + "---:|" * (len(cells) + 6))
    for label, factory, inserts, victims in candidates:
        margins, clobbered, waited, started, copies, tokens = [], 0, 0, 0.0, 0, 0
        for name, trace, k in cells:
            tally = {}
            r = pooled_replay(trace, factory(), k, inserts=inserts, rule=victims, tally=tally)
            margins.append(100 * (r.hit_rate - classlru[name, k]))
            clobbered, tokens = clobbered + tally["clobbered"], tokens + r.decode_tokens
            waited, copies = waited + tally.get("waited", 0), copies + tally.get("copies", 0)
            started += tally.get("started", 0.0)
        margins = np.array(margins)
        print(f"| {label} | {victims.label} | " + " | ".join(f"{m:+.1f}" for m in margins)
              + f" | {margins.min():+.2f} | {margins.mean():+.2f} | {(margins < 0).sum()} | "
              f"{clobbered / tokens:.2f} | {waited / max(copies, 1):.2f} | {started / max(copies, 1):.2f} |",
              flush=True)


def bytes_table(traces):
    """Decode hit% and MiB uploaded per decode token on the shipped traces: what the link carries."""
    print("\nDecode hit%, MiB uploaded per decode token (every copy complete at the next boundary; MODELLED)\n")
    print("| trace | K | " + " | ".join(label for label, _ in BYTES_ROWS) + " |")
    print("|---|---:|" + "---:|" * len(BYTES_ROWS))
    for trace in traces:
        for k in SIZES:
            runs = [replay(trace, k) for _, replay in BYTES_ROWS]
            print(f"| {Path(trace.path).name.split('.')[0]} | {k} | " + " | ".join(
                f"{100 * r.hit_rate:.1f}, {r.upload_bytes_per_token / MIB:.0f}" for r in runs) + " |", flush=True)


def cli(argv=None) -> int:
    p = OneLineParser(prog="pooled_victims.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--sweep", action="store_true", help="the defer sweep only (DEFER_SWEEP)")
    return p.run(tables, argv)


def tables(args) -> None:
    if args.sweep:
        main(DEFER_SWEEP)
    else:
        main(VICTIM_SEARCH)
        bytes_table([read_trace(str(p)) for p in SHIPPED_TRACES])


if __name__ == "__main__":
    sys.exit(cli())
