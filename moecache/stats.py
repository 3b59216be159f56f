"""`python -m moecache.stats FILE [--watch [SECONDS]]`: a cache's stats JSON (the file
LLAMA_MOE_CACHE_STATS names, which FLUSH_STEPS keeps current while the process runs) as a
per-layer table; --watch prints it again whenever the file changes."""

from __future__ import annotations

import json
import os
import sys
import time

from .util import OneLineParser, int_arg

PROG = "python -m moecache.stats"
COLUMNS = ("hits", "misses", "uploads", "evictions", "late", "prefill_uploads")
PLANNER_COLUMNS = ("lane_misses", "declined")  # with the miss planner (LLAMA_MOE_CACHE_PLANNER=1)


def load(path: str) -> dict:
    """The stats JSON at path; a ValueError naming the file for anything else."""
    try:
        with open(path, "rb") as f:
            stats = json.loads(f.read().decode("utf-8"))
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise ValueError(f"{path}: not a moecache stats file (not JSON)") from None
    if not isinstance(stats, dict) or not isinstance(stats.get("layers"), list) or "totals" not in stats:
        raise ValueError(f"{path}: not a moecache stats file (no layers and totals)")
    return stats


def _rate(row: dict) -> str:
    lookups = row.get("hits", 0) + row.get("misses", 0)
    return f"{100 * row['hits'] / lookups:.1f}%" if lookups else "-"


def table(stats: dict) -> str:
    """The summary line and one row per cached layer, then the totals."""
    summary = (f"policy {stats.get('policy')}, K={stats.get('slots')}, inserts {stats.get('inserts')}, "
               f"admission {stats.get('admission')}, {stats.get('device_bytes', 0) / (1 << 20):.1f} MiB; "
               f"{stats.get('decode_steps', 0)} decode steps ({stats.get('decode_tokens', 0)} tokens), "
               f"hit rate {_rate(stats['totals'])}, step {stats.get('step_us_mean') or 0:.0f} us mean")
    planner = stats.get("planner")
    if stats.get("failed"):
        summary += f"; FAILED: {stats['failed']}"
    if planner:
        summary += (f"\nmiss planner: link {planner['link_gbps']:.3g} GB/s ({planner['link_source']}), host "
                    f"{planner['host_gbps']:.3g} GB/s ({planner['host_source']}), dram {planner['dram_gbps']:.3g} "
                    f"GB/s ({planner['hardware']}'s): an upload pays back {planner['payback_uses']:.2f} uses; "
                    f"{(stats.get('link_bytes_per_token') or 0) / (1 << 20):.2f} MiB uploaded per decode token; "
                    f"lane misses: computed on the device through the copy-on-miss lane (counted in misses)")
    columns = COLUMNS + (PLANNER_COLUMNS if planner else ())
    names = [c.replace("_", " ") for c in columns]
    widths = [max(9, len(name) + 2) for name in names]
    header = f"{'layer':>6}{'hit rate':>10}" + "".join(f"{n:>{w}}" for n, w in zip(names, widths))

    def row(label, counts):
        return f"{label:>6}{_rate(counts):>10}" + "".join(f"{counts.get(c, 0):>{w}}" for c, w in zip(columns, widths))

    rows = [row(layer.get("layer", "?"), layer) for layer in stats["layers"]]
    return "\n".join([summary, header, *rows, row("all", stats["totals"])])


def watch(path: str, seconds: int) -> None:
    """Print the table whenever the file changes (it is replaced atomically: never half read)."""
    shown = None
    clear = "\033[H\033[J" if sys.stdout.isatty() else ""
    while True:
        try:
            stamp = os.stat(path).st_mtime_ns
        except FileNotFoundError:
            stamp = None
        if stamp is not None and stamp != shown:
            print(clear + table(load(path)), flush=True)
            shown = stamp
        time.sleep(seconds)


def main(argv=None) -> int:
    parser = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("file", help="a stats JSON (LLAMA_MOE_CACHE_STATS)")
    parser.add_argument("--watch", nargs="?", type=int_arg(minimum=1), const=2, metavar="SECONDS",
                        help="print again whenever the file changes, checking every SECONDS (default 2)")

    def show(args):
        if args.watch:
            watch(args.file, args.watch)
        else:
            print(table(load(args.file)))

    return parser.run(show, argv)


if __name__ == "__main__":
    raise SystemExit(main())
