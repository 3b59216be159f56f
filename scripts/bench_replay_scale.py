"""Replay at the scale of real recordings: wall time, peak RSS and lookups/s of whole commands.

    python scripts/bench_replay_scale.py [--tokens 200000] [--slots 16] [--policy default]
                                         [--admission eager|boundary] [--before REV]

Generates a synthetic route_trace CSV of --tokens decode tokens of a 48-layer, 128-expert,
top-8 model (synthetic_routing through TraceWriter, as LLAMA_MOE_CACHE_TRACE writes it) in a
temporary folder, deleted at the end, then runs each command in its own process and reads its
wall time, CPU time (user + system: what other work on the machine does not inflate) and peak
RSS (os.wait4's ru_maxrss; this script stays small, so the figure is the command's own): the replay of the CSV at K=--slots with one policy, --convert to the binary
form, and the replay of the binary form, with the replay's own admission unless --admission
names one. --before REV also runs both replays with the code of REV (git archive of this
checkout's history, its C core built there), e.g. 578d740, the reader before it streamed (which
reads no binary form: its row says so). lookups/s divides the replay's lookups by the whole command's
wall time, reading included. The replays must count the same hits (exit 1 otherwise).
"""

import csv
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import moecache
from moecache.core.admission import ADMISSIONS
from moecache.util import OneLineParser, int_arg

REPO = Path(__file__).resolve().parents[1]
PACKAGE_ROOT = Path(moecache.__file__).resolve().parents[1]  # the moecache the commands run
LAYERS, EXPERTS, TOP_K = 48, 128, 8
EXPERT_BYTES = 3059712  # a Qwen3-30B-A3B expert at Q4_K_M

GENERATE = """
import sys
import numpy as np
from moecache.formats.trace_writer import TraceWriter
from moecache.formats.traces import DECODE, synthetic_routing
path, (tokens, layers, experts, k, size) = sys.argv[1], map(int, sys.argv[2:])
unrecorded = np.zeros((layers, k), dtype=np.int8)
with TraceWriter(path, model="synthetic", arch="qwen3moe", n_layer=layers, n_expert=experts,
                 n_expert_used=k, layers=[(layer, size, 0) for layer in range(layers)]) as writer:
    for step, ids in enumerate(synthetic_routing(tokens, layers, experts, k, seed=1)):
        writer.write_step(0, DECODE, step, ids, None, unrecorded)
"""


def main(argv=None) -> int:
    ap = OneLineParser(prog="bench_replay_scale.py", description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int_arg(minimum=1), default=200_000)
    ap.add_argument("--slots", type=int_arg(minimum=1, maximum=EXPERTS), default=16)
    ap.add_argument("--policy", default="default", help="the one policy replayed")
    ap.add_argument("--admission", choices=ADMISSIONS,
                    help="the replays' admission timing (default: the replay's, the live cache's)")
    ap.add_argument("--before", metavar="REV", help="also replay the CSV with the code of this revision")
    return ap.run(bench, argv)


def bench(args):
    with tempfile.TemporaryDirectory(prefix="bench_replay_scale.") as folder:
        tmp = Path(folder)
        before = checkout(args.before, tmp / "before") if args.before else None
        trace, converted = tmp / "trace.route.csv", tmp / "trace.route.bin"
        started = time.perf_counter()
        run_checked([sys.executable, "-c", GENERATE, trace, args.tokens, LAYERS, EXPERTS, TOP_K, EXPERT_BYTES],
                    tmp, "generating the trace")
        print(f"{args.tokens} tokens x {LAYERS} layers x top-{TOP_K} of {EXPERTS} experts: "
              f"{trace.stat().st_size / 2**30:.2f} GiB of CSV, generated in {time.perf_counter() - started:.0f} s")
        replay = ["--slots", str(args.slots), "--policies", args.policy, "--csv", "result.csv"]
        replay += ["--admission", args.admission] if args.admission else []
        runs = [("CSV", [trace.name, *replay], PACKAGE_ROOT),
                ("convert", [trace.name, "--convert", converted.name], PACKAGE_ROOT),
                ("binary", [converted.name, *replay], PACKAGE_ROOT)]
        if before:  # after the conversion, which the binary replay needs
            runs[1:1] = [(f"CSV before ({args.before})", [trace.name, *replay], before)]
            runs.append((f"binary before ({args.before})", [converted.name, *replay], before))
        rows = [measure(label, argv, tmp, code) for label, argv, code in runs]
        print_table(rows)
    hits = {row["hits"] for row in rows if row["hits"] is not None}
    if len(hits) > 1:
        raise RuntimeError(f"the replays counted different hits: {sorted(hits)}")


def checkout(rev, dest):
    """The tree of `rev` from this checkout's history, with its C core built in place."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], capture_output=True)
    if archive.returncode:
        raise ValueError(f"--before {rev}: {archive.stderr.decode().strip()}")
    dest.mkdir()
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    run_checked([sys.executable, "native/build_core.py"], dest, f"building the C core of {rev}")
    return dest


def run_checked(argv, cwd, what):
    done = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(PACKAGE_ROOT)})
    if done.returncode:
        lines = (done.stderr or done.stdout).strip().splitlines()
        raise RuntimeError(f"{what} failed: {lines[-1] if lines else f'exit status {done.returncode}'}")


def measure(label, argv, tmp, code):
    """Run `python -m moecache.replay ARGV` with the moecache under `code`, in its own process:
    {label, command, status, seconds, peak RSS in bytes, lookups and hits (replays)}."""
    result = tmp / "result.csv"
    result.unlink(missing_ok=True)
    command = [sys.executable, "-m", "moecache.replay", *argv]
    with tempfile.TemporaryFile("w+") as out:
        started = time.perf_counter()
        proc = subprocess.Popen(command, cwd=tmp, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(code)})
        _, status, usage = os.wait4(proc.pid, 0)  # its rusage alone (Popen.wait would drop it)
        seconds = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        lines = out.read().strip().splitlines()
    row = {"label": label, "command": "python -m moecache.replay " + " ".join(argv), "seconds": seconds,
           "cpu": usage.ru_utime + usage.ru_stime, "peak": usage.ru_maxrss * 1024, "lookups": None, "hits": None,
           "status": "ok" if proc.returncode == 0 else
           f"exit {proc.returncode}: {lines[-1] if lines else 'no output'}"}
    if proc.returncode == 0 and result.exists():
        replayed = next(csv.DictReader(result.open()))
        row["lookups"] = int(replayed["hits_all"]) + int(replayed["misses_all"])
        row["hits"] = int(replayed["hits_all"])
    return row


def print_table(rows):
    print("\n| path | wall s | CPU s | peak RSS MiB | M lookups/s, whole command | hits | status |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for row in rows:
        rate = "-" if row["lookups"] is None else f"{row['lookups'] / row['seconds'] / 1e6:.2f}"
        print(f"| {row['label']} | {row['seconds']:.1f} | {row['cpu']:.1f} | {row['peak'] / 2**20:.0f} | {rate} | "
              f"{'-' if row['hits'] is None else row['hits']} | {row['status']} |")
    print()
    for row in rows:
        print(f"{row['label']}: {row['command']}")
    lookups = next((row["lookups"] for row in rows if row["lookups"]), None)
    if lookups:
        print(f"each replay: {lookups} lookups")


if __name__ == "__main__":
    raise SystemExit(main())
