#!/usr/bin/env python3
"""Does the patched build cost anything with the cache off? Decode tok/s of the patched
libllama (LLAMA_MOE_CACHE_SLOTS unset) against an unpatched build of the same sdist, in one run:
the two alternate, each round in fresh subprocesses, and the medians are compared.

    python scripts/bench_inert.py --stock-lib DIR [-m MODEL] [-n 64] [-r 7] [-t 2] [-ngl 0]

DIR holds an unpatched libllama.so and its ggml libraries (e.g. a CMake build of the pristine
sdist: build/bin). The patched side is the installed llama_cpp's own library. Like every script
here it imports the installed moecache package (scripts/bootstrap.sh installs it, editable,
with the patched llama-cpp-python)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from moecache.util import OneLineParser, int_arg, write_json

# one measurement in a fresh process, whose llama_cpp loads the library LLAMA_CPP_LIB_PATH names
ONE_RUN = r"""
import json, sys
import llama_cpp
from moecache.live.decode import greedy
path, n, threads, ngl = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = llama_cpp.Llama(path, n_gpu_layers=ngl, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
greedy(llm, b"The three primary colors are", 1)  # warm-up, not timed
run = greedy(llm, b"The three primary colors are", n)
print(json.dumps({"tok_s": n / run.seconds, "lib": llama_cpp.llama_cpp._lib._name}))
"""


def one(model: str, n: int, threads: int, ngl: int, lib_dir: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_MOE_CACHE_")}
    env.pop("LLAMA_CPP_LIB_PATH", None)
    if lib_dir:
        env["LLAMA_CPP_LIB_PATH"] = lib_dir
    out = subprocess.run([sys.executable, "-c", ONE_RUN, model, str(n), str(threads), str(ngl)],
                         env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"run failed ({'stock' if lib_dir else 'patched'}): {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = OneLineParser(prog="bench_inert.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--stock-lib", required=True, help="directory with an unpatched libllama.so")
    p.add_argument("-m", "--model", help="GGUF (default: smol-moe)")
    p.add_argument("-n", type=int_arg(minimum=1), default=64, help="timed decode tokens per run")
    p.add_argument("-r", type=int_arg(minimum=1), default=7, help="rounds (each runs both builds once)")
    p.add_argument("-t", "--threads", type=int_arg(minimum=1), default=2)
    p.add_argument("-ngl", "--n-gpu-layers", type=int_arg(minimum=-1), default=0)
    p.add_argument("--json", help="write the results here")
    return p.run(_bench, argv)


def _bench(args) -> int:
    if not (Path(args.stock_lib) / "libllama.so").exists():
        raise ValueError(f"{args.stock_lib}/libllama.so not found")
    model = args.model
    if model is None:
        from moecache.models import smol_moe

        model = str(smol_moe())

    runs = {"stock": [], "patched": []}
    for i in range(args.r):
        for name, lib_dir in (("stock", args.stock_lib), ("patched", None)):
            runs[name].append(one(model, args.n, args.threads, args.n_gpu_layers, lib_dir)["tok_s"])
        print(f"round {i + 1}/{args.r}: stock {runs['stock'][-1]:.1f}, patched {runs['patched'][-1]:.1f} tok/s",
              file=sys.stderr)
    med = {name: statistics.median(v) for name, v in runs.items()}
    result = {"model": model, "n": args.n, "rounds": args.r, "threads": args.threads,
              "n_gpu_layers": args.n_gpu_layers, "tok_s": runs, "median": med,
              "patched_over_stock": med["patched"] / med["stock"]}
    print("| build | median tok/s | min | max |\n|---|---:|---:|---:|")
    for name, v in runs.items():
        print(f"| {name} | {med[name]:.1f} | {min(v):.1f} | {max(v):.1f} |")
    print(f"patched / stock = {result['patched_over_stock']:.3f}")
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
