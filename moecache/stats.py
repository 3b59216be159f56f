"""`python -m moecache.stats FILE [--watch [SECONDS]]`: a cache's stats JSON (the file
LLAMA_MOE_CACHE_STATS names, which FLUSH_STEPS keeps current while the process runs) as a
per-layer table for each tier (the device cache and, under it or alone, the RAM tier, with its
reads of the model file); --watch
prints it again whenever the file changes."""

from __future__ import annotations

import json
import os
import stat
import sys
import time

from .util import OneLineParser, int_arg

PROG = "python -m moecache.stats"
COLUMNS = ("hits", "misses", "uploads", "evictions", "late", "prefill_uploads")
PLANNER_COLUMNS = ("lane_misses", "declined")  # with the miss planner (LLAMA_MOE_CACHE_PLANNER=1)
TIERS = {"device": "device cache", "RAM": "RAM tier"}
MAX_BYTES = 64 << 20  # a stats file of 4096 layers is about 1 MiB
MAX_WATCH = 86400     # seconds between checks of --watch: a day


def load(path: str) -> dict:
    """The stats JSON at path, its shape checked; a ValueError naming the file for anything
    else: not a regular file (a FIFO would wait for a writer), larger than MAX_BYTES (read
    whole, it would take the memory), not JSON, or not the fields the table reads."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path}: not a regular file")
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise ValueError(f"{path}: larger than a stats file ({MAX_BYTES >> 20} MiB at most)")
    try:
        stats = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise ValueError(f"{path}: not a moecache stats file (not JSON)") from None
    problem = _shape(stats)
    if problem:
        raise ValueError(f"{path}: not a moecache stats file ({problem})")
    return stats


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _shape(stats, where: str = "") -> str | None:
    """What in a tier's stats (and its RAM tier's) the table cannot read, or None."""
    if not isinstance(stats, dict) or not isinstance(stats.get("layers"), list) or \
            not isinstance(stats.get("totals"), dict):
        return f"{where[:-1]} has no layers and totals" if where else "no layers and totals"
    rows = [(f"{where}layers[{i}]", row) for i, row in enumerate(stats["layers"])] + [(f"{where}totals",
                                                                                       stats["totals"])]
    for name, row in rows:
        if not isinstance(row, dict):
            return f"{name} is not an object"
        bad = next((column for column in ("layer", *COLUMNS, *PLANNER_COLUMNS)
                    if column in row and not _count(row[column])), None)
        if bad:
            return f"{name}.{bad} is not a count"
    bad = next((key for key in ("slots", "inserts", "decode_steps", "decode_tokens")
                if stats.get(key) is not None and not _count(stats[key])), None) or \
        next((key for key in ("device_bytes", "step_us_mean", "link_bytes_per_token")
              if stats.get(key) is not None and not _number(stats[key])), None)
    if bad:
        return f"{where}{bad} is not a number"
    if stats.get("tier", "device") not in TIERS:
        return f"{where}tier is not one of {', '.join(TIERS)}"
    planner = stats.get("planner")
    if planner is not None:
        if not isinstance(planner, dict) or not all(_number(planner.get(f"{rate}_gbps")) for rate in
                                                    ("link", "host", "dram")) \
                or not _number(planner.get("payback_uses")) \
                or not all(isinstance(planner.get(key), str) for key in ("link_source", "host_source", "hardware")):
            return f"{where}planner lacks its rates, sources or payback"
    if stats.get("ram_tier") is not None:
        return _shape(stats["ram_tier"], "ram_tier.")
    return None


def _rate(row: dict) -> str:
    lookups = row.get("hits", 0) + row.get("misses", 0)
    return f"{100 * row.get('hits', 0) / lookups:.1f}%" if lookups else "-"


def table(stats: dict) -> str:
    """Each tier's summary line and one row per cached layer, then its totals."""
    return "\n\n".join(_tier_table(tier) for tier in [stats, *([stats["ram_tier"]] if stats.get("ram_tier") else [])])


def _tier_table(stats: dict) -> str:
    summary = (f"{TIERS[stats.get('tier', 'device')]}: policy {stats.get('policy')}, K={stats.get('slots')}, "
               f"inserts {stats.get('inserts')}, admission {stats.get('admission')}, "
               f"{(stats.get('device_bytes') or 0) / (1 << 20):.1f} MiB; "
               f"{stats.get('decode_steps') or 0} decode steps ({stats.get('decode_tokens') or 0} tokens), "
               f"hit rate {_rate(stats['totals'])}, step {stats.get('step_us_mean') or 0:.0f} us mean")
    planner = stats.get("planner")
    if stats.get("failed"):
        summary += f"; FAILED: {stats['failed']}"
    if stats.get("reads"):
        summary += "\n" + _reads_line(stats["reads"])
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


def _reads_line(reads: dict) -> str:
    """The RAM tier's reads of the model file: decode's per token, and the prompt's."""
    per_token, prompt = reads.get("decode_per_token") or {}, reads.get("prompt") or {}
    precision = per_token.get("read_ahead_precision")
    ahead = "no read-ahead" if precision is None else \
        (f"{100 * precision:.1f}% of the experts read ahead selected, "
         f"{(per_token.get('wasted_bytes_per_token') or 0) / (1 << 20):.2f} MiB read ahead and not selected")
    return (f"reads: decode {(per_token.get('read_bytes_per_token') or 0) / (1 << 20):.2f} MiB per token, "
            f"{ahead}, waited {per_token.get('wait_ms_per_token') or 0:.2f} ms per token; "
            f"prompt {(prompt.get('read_bytes') or 0) / (1 << 20):.1f} MiB")


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
    parser.add_argument("--watch", nargs="?", type=int_arg(minimum=1, maximum=MAX_WATCH), const=2, metavar="SECONDS",
                        help=f"print again whenever the file changes, checking every SECONDS (default 2, at most "
                             f"{MAX_WATCH})")

    def show(args):
        if args.watch:
            watch(args.file, args.watch)
        else:
            print(table(load(args.file)))

    return parser.run(show, argv)


if __name__ == "__main__":
    raise SystemExit(main())
