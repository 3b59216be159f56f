"""The pooled default in the time model (issue 37, step 5 of docs/notes/upstream-comparison.md, "A
pooled allocation: the design"): moecache.offline.pooltime's TimedPooledEngine, one pool per
group, the miss planner on the pool's victims, the lane restricted to slots safe now, and each
copy published when the link has carried it. MODELLED: no live code runs a pool; the shipped
default (K slots per layer) is unchanged.

    python scripts/pooled_time.py [grid|hits]   (both by default; about 2 + 5 minutes on 2 shared
                                                 cores; imports moecache as found)

grid: per shipped trace, K = 8, 16, 32 and hardware class, modelled ms per decode token of stock
--cpu-moe, upstream b12191 at its tuner's best F, the shipped zero configuration (K slots per
layer) and the pooled default (POOLED_DEFAULT) under each of TIMED_VARIANTS, with its decode
hit% and late uploads per decode token; then one line per variant,

    MODELLED pooled <variant>: geomean ours/min(stock,upstream) = X over N cells, M cells above 1.0

hits: the pooled default's decode hit% points over upstream b12191's ClassLRU (F = 0, at equal
bytes) in the 18 cells of the hit-rate table of scripts/compare_upstream.py, per hardware class
(the link's timing depends on it), without the planner (the table's convention) and with it
(what zero configuration would run). The synthetic routings have no model behind them: for the
timing they get Qwen3-30B-A3B's first layer's expert and dense bytes on every layer (their
ClassLRU figures are those of the table, at 1 MiB experts; a pool's slots do not depend on the
bytes).
"""

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from moecache.core.hardware import HARDWARE
from moecache.core.policies import make_policy
from moecache.formats.traces import SHIPPED_TRACES, read_trace
from moecache.offline.pooltime import POOLED_DEFAULT, TIMED_VARIANTS, timed_pooled_replay
from moecache.offline.replay import fastest, zero_configuration
from moecache.util import OneLineParser

from compare_upstream import SIZES, equal_bytes_cells, geomean_line, tuned_shares, upstream


def name_of(trace) -> str:
    return Path(trace.path).name.split(".")[0]


CONTROL = ("per layer (shipped: heat, INSERTS 2), link-timed, the same model",
           dict(inserts=2, per_layer=True, publication="layer"))


def timed_cell(trace, k, hw, best, options, policy=None):
    """(ratio to best, the cell's text: ratio, decode hit%, late uploads per decode token) of one
    timed replay (the pooled default unless `policy`)."""
    tally = {}
    r = timed_pooled_replay(trace, policy() if policy else POOLED_DEFAULT[1](), k, hw.rates, tally=tally, **options)
    ratio = r.modelled_ms(hw) / best
    return ratio, 100 * r.hit_rate, f"{ratio:.2f}, {100 * r.hit_rate:.1f}, {tally['late'] / r.decode_tokens:.2f}"


def grid(traces):
    """The grid's cells with the pooled default under each variant (module docstring)."""
    shares = tuned_shares(traces)
    print(f"\nThe pooled default in the grid (MODELLED): {POOLED_DEFAULT[0]}, the planner on; per cell ms per decode "
          "token of stock, upstream b12191 at its best F and the shipped zero configuration (ratio to min(stock, "
          "upstream)); per variant and for the control (the shipped policy, K per layer, timed as the pool): ratio, "
          "decode hit%, late uploads per decode token\n")
    labels = [CONTROL[0]] + [f"pooled: {v[0]}" for v in TIMED_VARIANTS]
    print("| trace | K | hardware | stock | upstream | per layer (shipped) | " + " | ".join(labels) + " |")
    print("|---|---:|---|---:|---:|---:|" + "---|" * len(labels))
    ratios = {label: [] for label in ["shipped"] + labels}
    hits_of = {label: [] for label in labels}
    for trace in traces:
        for k in SIZES:
            for hw in HARDWARE.values():
                up = fastest(shares[name_of(trace), k], hw)
                best = min(up.stock_ms(hw), up.modelled_ms(hw))
                ratios["shipped"].append(zero_configuration(trace, k, hw.rates).modelled_ms(hw) / best)
                runs = [(CONTROL[1], lambda: make_policy("heat"))] + \
                    [(dict(rule=victims, publication=publication, **options), None)
                     for _, victims, publication, options in TIMED_VARIANTS]
                row = []
                for label, (options, policy) in zip(labels, runs):
                    ratio, hit, text = timed_cell(trace, k, hw, best, options, policy)
                    ratios[label].append(ratio)
                    hits_of[label].append(hit)
                    row.append(text)
                print(f"| {name_of(trace)} | {k} | {hw.name} | {up.stock_ms(hw):.2f} | {up.modelled_ms(hw):.2f} "
                      f"(F {up.cpu_share:g}) | {ratios['shipped'][-1] * best:.2f} ({ratios['shipped'][-1]:.2f}) | "
                      + " | ".join(row) + " |", flush=True)
    print("\nshipped (K slots per layer, zero configuration): " + geomean_line(ratios.pop("shipped")))
    control = np.array(hits_of[CONTROL[0]])
    for label, values in ratios.items():
        gain = np.array(hits_of[label]) - control
        print(f"MODELLED {label}: " + geomean_line(values) + f", slowest {max(values):.2f}; decode hit% over the "
              f"control: least {gain.min():+.1f}, mean {gain.mean():+.2f}, {(gain < 0).sum()} cells behind")


def hit_cells(traces):
    """(label, trace for the timing, K, ClassLRU's decode hit rate) of the hit-rate table's cells."""
    qwen = next(t for t in traces if name_of(t).startswith("qwen3"))
    cells = []
    for label, trace, k in equal_bytes_cells(traces):
        classlru = upstream(trace, k).hit_rate
        if not any(trace is t for t in traces):  # a synthetic routing: Qwen3's first layer's bytes on every layer
            L = trace.layers.size
            trace = replace(trace, expert_bytes=np.full(L, qwen.expert_bytes[0]),
                            dense_bytes=np.full(L, qwen.dense_bytes[0]))
        cells.append((label, trace, k, classlru))
    return cells


def hits(traces):
    """The pooled default's margins over ClassLRU per variant, planner and hardware class."""
    cells = hit_cells(traces)
    label, factory = POOLED_DEFAULT
    print(f"\nThe pooled default's decode hit% points over ClassLRU (b12191, F = 0, equal bytes), {label}, "
          f"in the {len(cells)} cells of the hit-rate table, copies published by the link's timing "
          "(MODELLED): least (its cell), mean, cells behind\n")
    print("| victims, publication | planner | " + " | ".join(HARDWARE) + " |")
    print("|---|---|" + "---|" * len(HARDWARE))
    runs = [(f"control: {CONTROL[0]}", CONTROL[1], lambda: make_policy("heat"))]
    runs += [(v, dict(rule=victims, publication=publication, **options), factory)
             for v, victims, publication, options in TIMED_VARIANTS]
    for v, options, policy in runs:
        for planner in (False, True):
            if not planner and "busy_cap" in options:  # the busy share matters only to the planner
                continue
            row = []
            for hw in HARDWARE.values():
                margins = np.array([100 * (timed_pooled_replay(trace, policy(), k, hw.rates, planner=planner,
                                                               **options).hit_rate - classlru)
                                    for _, trace, k, classlru in cells])
                worst = int(np.argmin(margins))
                row.append(f"{margins.min():+.2f} ({cells[worst][0].split(',')[0]} {cells[worst][2]}), "
                           f"{margins.mean():+.2f}, {(margins < 0).sum()}")
            print(f"| {v} | {'on' if planner else 'off'} | " + " | ".join(row) + " |", flush=True)


PARTS = ("grid", "hits")


def main(argv=None) -> int:
    p = OneLineParser(prog="pooled_time.py", description=__doc__.split("\n\n")[0])
    p.add_argument("parts", nargs="*", metavar="PART", help="grid, hits or both (default: both, in that order)")
    return p.run(lambda args: run(args.parts or list(PARTS)), argv)


def run(parts):
    unknown = [part for part in parts if part not in PARTS]
    if unknown:
        raise ValueError(f"unknown part {unknown[0]!r} (grid, hits)")
    traces = [read_trace(str(p)) for p in SHIPPED_TRACES]
    if "grid" in parts:
        grid(traces)
    if "hits" in parts:
        hits(traces)


if __name__ == "__main__":
    sys.exit(main())
