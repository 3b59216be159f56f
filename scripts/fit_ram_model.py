"""The RAM tier's modelled decode against the benchmark's measurements (issue 38): fits the CPU's
work per MB the tier reads (python -m moecache.replay --read-cpu-ms-per-mb) and prints, per
measured configuration (both shapes, read-ahead on and off), the modelled and measured decode,
the residual, the wait for the disk and the bytes read, at the best disk rate each run measured
and at its O_DIRECT rate. The inputs and the fit: moecache.offline.calibration.

    python scripts/fit_ram_model.py        (a few seconds; imports moecache as found)
"""

from moecache.formats.traces import TRACES_DIR, read_trace
from moecache.offline.calibration import MEASURED, at_o_direct_rate, fit, host_gbps, recorded_read_ahead
from moecache.offline.replay import ram_tier_slots


def table(title, configs) -> None:
    c, rows = fit(configs)
    uncharged = {(r.measured.shape, r.mode): r for r in fit(configs, iterations=0)[1]}  # no CPU on a read
    print(f"\n{title}: the CPU's work on a read CALIBRATED at {c:.3f} ms per MB read")
    print("| configuration | read-ahead | measured ms/tok (tok/s) | modelled, no read CPU | residual | modelled, "
          "calibrated | residual | wait ms/tok modelled / measured | MB read/tok modelled / measured | "
          "precision % modelled / measured |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        m, bare = r.measured, uncharged[(r.measured.shape, r.mode)]
        live = recorded_read_ahead(read_trace(str(TRACES_DIR / m.trace)))[1] if r.mode == "on" else None
        print(f"| {m.shape} | {r.mode} | {r.measured_ms:.2f} ({m.tok_s[r.mode]:.2f}) | {bare.ms:.2f} | "
              f"{100 * bare.residual:+.1f}% | {r.ms:.2f} | {100 * r.residual:+.1f}% | {r.wait_ms:.1f} / "
              f"{m.wait_ms[r.mode]:.1f} | {r.read_mb:.1f} / {m.read_mb[r.mode]:.1f} | "
              f"{_pct(r.precision)} / {_pct(live)} |")


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
    main()
