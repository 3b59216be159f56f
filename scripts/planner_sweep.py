"""Whether the miss planner should depend on the rates: ours (the live default, eager, prompt warm)
with the planner against the same without it, MODELLED, on both shipped traces at K = 8, 16, 32,
over a sweep of rate sets beside the named hardware classes (docs/cost-model.md, "The planner by
default"; moecache.core.missplan.planner_by_default).

    python scripts/planner_sweep.py   (about 25 s on 2 cores; imports the installed moecache)

Prints the cells where the planner is slower, then, for thresholds on a static figure of the
rates and layer shapes (one token's upload time over its compute time), the geomean of the
planner's time ratio if it ran only above the threshold, its slowest cell, and the named classes'
cells the threshold would turn off.
"""

import itertools
import math
import sys
from pathlib import Path

import numpy as np

from moecache.core.hardware import HARDWARE, Hardware
from moecache.core.missplan import OUR_LAYOUT, Rates
from moecache.formats.traces import SHIPPED_TRACES, read_trace
from moecache.offline.replay import PerLayerReplay, simulate
from moecache.util import OneLineParser, Progress

SIZES = (8, 16, 32)
SWEEP = [Rates(host_gbps=host, link_gbps=link, dram_gbps=1.2 * host, device_gbps=device, ids_trip_us=trip,
               join_us=trip / 3)
         for link, host, device, trip in itertools.product((1, 3, 8, 25, 50, 100), (10, 30, 60, 120), (300, 1500),
                                                           (5, 30))]


def upload_share(trace, rates):
    """One expert per layer uploaded, over one token with half the selections hits, half on the
    CPU: how link-bound the layer shapes are at these rates."""
    n = trace.n_expert_used
    compute = np.sum(rates.layer_ms(OUR_LAYOUT, trace.expert_bytes.astype(float), trace.dense_bytes.astype(float),
                                    n / 2, 0, n / 2))
    return float(trace.expert_bytes.sum()) / (rates.link_gbps * 1e6) / float(compute)


def main():
    traces = [read_trace(str(p)) for p in SHIPPED_TRACES]
    classes = [(hw.name, hw.rates) for hw in HARDWARE.values()]
    rate_sets = classes + [(f"link {r.link_gbps:g}, host {r.host_gbps:g}, device {r.device_gbps:g}, trip {r.ids_trip_us:g}",
                            r) for r in SWEEP]
    cells = []  # (label, trace name, K, named class, ratio, upload share)
    with Progress(len(traces) * len(SIZES) * len(rate_sets)) as progress:
        for trace in traces:
            name = Path(trace.path).name.split(".")[0]
            for k in SIZES:
                without = simulate(trace, PerLayerReplay("default", k, admission="eager", prefill="warm"))
                for i, (label, rates) in enumerate(rate_sets):
                    hw = Hardware(label, "", rates, "")
                    ours = simulate(trace, PerLayerReplay("default", k, admission="eager", prefill="warm",
                                                          miss_plan=rates))
                    cells.append((label, name, k, i < len(classes), ours.modelled_ms(hw) / without.modelled_ms(hw),
                                  upload_share(trace, rates)))
                    progress.advance(f"{name} K={k}")
    slower = sorted((c for c in cells if c[4] > 1.0005), key=lambda c: -c[4])
    print(f"planner slower than without it in {len(slower)} of {len(cells)} cells "
          f"({sum(c[3] for c in slower)} of the named classes'):")
    for label, name, k, _, ratio, _ in slower:
        print(f"  {name} K={k}, {label}: {ratio:.3f}")
    print(f"fastest cell: {min(c[4] for c in cells):.3f}\n")
    print("| planner on where the upload share >= | geomean ours/without | slowest cell | named-class cells off |")
    print("|---:|---:|---:|---:|")
    for threshold in (0.0, 0.4, 0.8, 1.2, 1.6, 2.0):
        ratios = [c[4] if c[5] >= threshold else 1.0 for c in cells]
        off = sum(1 for c in cells if c[3] and c[5] < threshold)
        print(f"| {threshold:g} | {math.exp(np.mean(np.log(ratios))):.3f} | {max(ratios):.3f} | {off} |")


if __name__ == "__main__":
    sys.exit(OneLineParser(prog="planner_sweep.py", description=__doc__.split("\n\n")[0]).run(lambda _: main()))
