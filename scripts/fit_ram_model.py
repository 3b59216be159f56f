"""The RAM tier's modelled decode against the benchmark's measurements (issue 38): fits the CPU's
work on what the tier reads, per request and per MB (python -m moecache.replay
--read-cpu-ms-per-request, --read-cpu-ms-per-mb), and prints, per measured configuration (both
shapes, read-ahead on and off), the modelled and measured decode and the residual without the
reads' CPU, with the per-MB constant alone (the model before) and with both, the wait for the disk
and the bytes read, at the best disk rate each run measured and at its O_DIRECT rate. The inputs
and the fit: moecache.offline.calibration.

    python scripts/fit_ram_model.py        (a few seconds; imports moecache as found)
"""

import sys

from moecache.formats.traces import TRACES_DIR, read_trace
from moecache.offline.calibration import MEASURED, ONE_TERM, at_o_direct_rate, fit, host_gbps, recorded_read_ahead
from moecache.offline.pagecache import PARTS
from moecache.offline.replay import ram_tier_slots
from moecache.util import OneLineParser


def table(title, configs) -> None:
    (costs, rows), (one, one_rows) = fit(configs), fit(configs, terms=ONE_TERM)
    fits = {"no read CPU": fit(configs, terms=())[1], "per MB alone": one_rows, "both": rows}
    print(f"\n{title}: the CPU's work on a read CALIBRATED at {costs['read_cpu_ms_per_request']:.3f} ms per request "
          f"({PARTS} an expert) + {costs['read_cpu_ms_per_mb']:.3f} ms per MB read (per MB alone: "
          f"{one['read_cpu_ms_per_mb']:.3f})")
    print("| configuration | read-ahead | measured ms/tok (tok/s) | "
          + " | ".join(f"modelled, {name} | residual" for name in fits)
          + " | wait ms/tok modelled / measured | MB read/tok modelled / measured | precision % modelled / measured |")
    print("|---|---|---:|" + "---:|---:|" * len(fits) + "---:|---:|---:|")
    for i, r in enumerate(rows):
        m = r.measured
        live = recorded_read_ahead(read_trace(str(TRACES_DIR / m.trace)))[1] if r.mode == "on" else None
        modelled = " | ".join(f"{f[i].ms:.2f} | {100 * f[i].residual:+.1f}%" for f in fits.values())
        print(f"| {m.shape} | {r.mode} | {r.measured_ms:.2f} ({m.tok_s[r.mode]:.2f}) | {modelled} | "
              f"{r.wait_ms:.1f} / {m.wait_ms[r.mode]:.1f} | {r.read_mb:.1f} / {m.read_mb[r.mode]:.1f} | "
              f"{_pct(r.precision)} / {_pct(live)} |")
    print("sum of the squared residuals: " + ", ".join(f"{name} {sum(r.residual ** 2 for r in f):.4f}"
                                                      for name, f in fits.items()))


def _pct(value):
    return "-" if value is None else f"{100 * value:.1f}"


def main() -> None:
    print("inputs (MEASURED: docs/notes/ram-read-ahead.md, \"On a quieter machine, the default threads ...\"):")
    for m in MEASURED:
        trace = read_trace(str(TRACES_DIR / m.trace))
        recall, precision = recorded_read_ahead(trace)
        print(f"- {m.shape}: traces/{m.trace}, K = {ram_tier_slots(trace, m.ram_mib)} (--ram-mib {m.ram_mib:g}), "
              f"in RAM {m.in_ram_tok_s} tok/s -> host {host_gbps(trace, m):.3f} GB/s, disk {m.disk_gbps} GB/s best "
              f"({m.o_direct_gbps} O_DIRECT); the live read-ahead's recall {100 * recall:.1f}%, "
              f"precision {100 * precision:.1f}%")
    table("At the best disk rate each run measured", MEASURED)
    table("At the O_DIRECT rate (2 MiB, 4 threads)", at_o_direct_rate())


if __name__ == "__main__":
    sys.exit(OneLineParser(prog="fit_ram_model.py", description=__doc__.split("\n\n")[0]).run(lambda _: main()))
