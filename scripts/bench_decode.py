#!/usr/bin/env python3
"""Decode speed of a MoE model with the expert cache at several sizes, against stock placements.

    python scripts/bench_decode.py -m MODEL [-p PROMPT] [-n 32] [-r 3] [-t THREADS] [-ngl -1]
        [--slots 0,8,16,32,64] [--mib 1024,4096] [--policy default] [--inserts 2]
        [--plain] [--all-device] [--planner-off] [--md FILE] [--json FILE] [--png FILE]

Configurations, each in a freshly loaded model (the previous one freed first):
  stock         experts in host memory, the rest on the device, no cache: llama.cpp's
                --cpu-moe, whose loader repacks the host experts for its faster CPU kernels
                where it can; the K=0 baseline every ratio is against
  K=k           the stock placement plus a cache of k experts per layer (--slots, largest first;
                values above the model's expert count are skipped with a note), configured as
                LLAMA_MOE_CACHE_SLOTS=k alone: the miss planner on where it runs by default, its
                link and host rates measured at attach and printed in the notes
  MiB=n         the same with the cache sized by device memory (--mib, largest first): the
                largest K whose slots fit n MiB over all devices (LLAMA_MOE_CACHE_MIB=n)
  planner off K=k  (--planner-off) after each K=k, the same cache without the miss planner
                (LLAMA_MOE_CACHE_PLANNER=0: every miss on the CPU, every eager upload that beats
                its victim)
  all-device    (--all-device) n_gpu_layers=-1 without overrides, everything on the device;
                "did not fit" when loading fails
--plain loads the host experts of stock and cache rows alike in plain buffers
(LLAMA_MOE_CACHE_REPACK=0, the bit-identical mode); --link-gbps G has every cache row's planner
price uploads at G GB/s instead of the rate it measures (LLAMA_MOE_CACHE_LINK_GBPS). The device is the GPU when ggml has one, else a loopback RPC device (a CPU backend in a
subprocess: it checks the mechanism and costs, it is no faster than the CPU).

Per configuration: one untimed warm-up run, then -r timed runs; each run evaluates the prompt
and then -n greedy decode tokens, timed from the prompt's logits to the last token's.
Reported: decode tok/s (median, min, max over the runs), ratio to stock, prompt tok/s (the
prompt's evaluation up to its logits, median) and its ratio to stock, and for
cache rows the hit rate, uploads per token and the time in the cache's step callback per
token over the timed runs, and the device memory the cache took. The cache stays warm across runs, as in a server.

Like every script here it imports the installed moecache package (scripts/bootstrap.sh installs
it, editable, with the patched llama-cpp-python).
"""

from __future__ import annotations

import gc
import os
import platform
import shlex
import statistics
import sys

from moecache.util import OneLineParser, Progress, atomic_write, gbps_arg, int_arg, int_list_arg, write_json

PROG = "bench_decode.py"
DEFAULT_PROMPT = "Explain how a mixture-of-experts model decides which experts handle each token."
PLANNER_OFF = "planner off "  # the name prefix of the rows without the miss planner


class BenchError(ValueError):
    """A one-line error for the user (exit status 2)."""


def parser() -> OneLineParser:
    p = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True, help="GGUF file of a MoE model")
    p.add_argument("-p", "--prompt", default=DEFAULT_PROMPT)
    p.add_argument("-n", "--n-predict", type=int_arg(minimum=1), default=32, help="decode tokens per run (default 32)")
    p.add_argument("-r", "--repetitions", type=int_arg(minimum=1), default=3, help="timed runs per configuration (default 3)")
    p.add_argument("-t", "--threads", type=int_arg(minimum=1), default=None, help="CPU threads (default: llama.cpp's)")
    p.add_argument("-ngl", "--n-gpu-layers", type=int_arg(minimum=-1), default=-1,
                   help="layers on the device in the host-experts configurations (default -1: all)")
    p.add_argument("-c", "--ctx-size", type=int_arg(minimum=16), default=2048)
    p.add_argument("--seed", type=int_arg(minimum=0), default=0)
    p.add_argument("--slots", type=int_list_arg(minimum=0), default=[0, 8, 16, 32, 64],
                   help="cache sizes K, comma-separated (default 0,8,16,32,64; 0 is the stock row)")
    p.add_argument("--inserts", type=int_arg(minimum=1), default=2, help="uploads per layer per step (default 2)")
    p.add_argument("--policy", default="default", help="cache policy (default: the shipped default)")
    p.add_argument("--mib", type=int_list_arg(minimum=1), default=[],
                   help="cache sizes by device memory, MiB over all devices, comma-separated")
    p.add_argument("--plain", action="store_true",
                   help="host experts in plain buffers, not repacked (stock and cache rows alike)")
    p.add_argument("--all-device", action="store_true", help="also measure everything on the device")
    p.add_argument("--planner-off", action="store_true",
                   help="after each K=k, the same cache with the miss planner off (LLAMA_MOE_CACHE_PLANNER=0)")
    p.add_argument("--link-gbps", type=gbps_arg, default=None,
                   help="the cache rows' planner prices uploads at this host-to-device rate, GB/s "
                        "(LLAMA_MOE_CACHE_LINK_GBPS; default: measured at attach)")
    p.add_argument("--md", metavar="FILE", help="write the markdown table here")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON here")
    p.add_argument("--png", metavar="FILE", help="plot tok/s and hit rate against K (needs matplotlib)")
    return p


def main(argv=None) -> int:
    return parser().run(_bench, argv)


def _bench(args) -> int:
    _check_inputs(args)
    report = run(args, on_row=lambda partial: save(args, partial))
    save(args, report)
    print(markdown(report))
    if args.png:
        plot(report, args.png)
    return 0


def save(args, report):
    """Write the table and the JSON; called after every configuration too, so that a run stopped
    by a time limit leaves what it measured."""
    if args.md:
        atomic_write(args.md, markdown(report) + "\n")
    if args.json:
        write_json(args.json, report)


def _check_inputs(args):
    """Everything that can fail fast, before a model is loaded."""
    from moecache.live.config import CacheConfig, ConfigError

    if not os.path.isfile(args.model):
        raise BenchError(f"model file not found: {args.model}")
    try:
        CacheConfig(slots=1, inserts=args.inserts, policy=args.policy)
    except ConfigError as e:
        raise BenchError(str(e)) from None
    for path in (args.md, args.json, args.png):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise BenchError(f"cannot write {path}: no such directory")
    if args.png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise BenchError("--png needs matplotlib (pip install matplotlib)") from None


# --- measuring ---------------------------------------------------------------------------------

def run(args, on_row=None) -> dict:
    """All configurations; on_row(report so far) after each one."""
    # the benchmark attaches the cache itself: an inherited LLAMA_MOE_CACHE_SLOTS would put a
    # cache into the stock rows too
    for name in [n for n in os.environ if n.startswith("LLAMA_MOE_CACHE_")]:
        del os.environ[name]
    import llama_cpp  # noqa: F401  (after the environment is clean)

    from moecache.live import ggml

    if ggml.has_gpu():
        device = "GPU"
    else:
        from moecache.live.rpc import RpcDevice

        rpc = RpcDevice(threads=args.threads)  # noqa: F841  (serves until this process exits)
        device = "loopback RPC device (CPU backend; a mechanism check, not a speed claim)"

    configs = [("stock", 0)]
    # largest cache first: it is the row that matters most if a time limit stops the run
    configs += [(f"{variant}K={k}", k) for k in sorted(args.slots, reverse=True) if k > 0
                for variant in ("", PLANNER_OFF)[:1 + args.planner_off]]
    budgets = {f"MiB={n}": n for n in sorted(args.mib, reverse=True)}  # sized at attach
    configs += [(name, 0) for name in budgets]
    if args.all_device:
        configs.append(("all-device", 0))

    # a line per step when stderr is a log file: a run stopped by a time limit shows how far it got
    progress = Progress(len(configs) * (1 + args.repetitions), unit="run", log_lines=True)
    rows, notes, n_expert, prompt_tokens = [], [], None, None

    def report(done):
        ref = next((r for r in rows if r["config"] == "stock" and r["status"] == "ok"), None)
        for row in rows:
            ok = ref and row["status"] == "ok"
            row["ratio"] = row["tok_s_median"] / ref["tok_s_median"] if ok else None
            row["prompt_ratio"] = row["prompt_tok_s_median"] / ref["prompt_tok_s_median"] \
                if ok and row.get("prompt_tok_s_median") and ref.get("prompt_tok_s_median") else None
        pending = [name for name, _ in configs[done:]]
        return _report(args, device, rows, notes + ([f"still to run: {', '.join(pending)}"] if pending else []),
                       n_expert, prompt_tokens)

    for done, (name, slots) in enumerate(configs, 1):
        if n_expert is not None and slots > n_expert:
            notes.append(f"K={slots} skipped: the model has {n_expert} experts per layer")
            progress.advance(f"{name} skipped", 1 + args.repetitions)
            continue
        row, info = measure(args, name, slots, progress, mib=budgets.get(name),
                            planner_off=name.startswith(PLANNER_OFF))
        rows.append(row)
        if row.get("planner"):
            notes.append(f"{name}: {row['planner']}")
        if info:
            n_expert = n_expert or info["n_expert"]
            prompt_tokens = prompt_tokens or info["prompt_tokens"]
        if on_row:
            on_row(report(done))
    progress.close()
    return report(len(configs))


def _report(args, device, rows, notes, n_expert, prompt_tokens) -> dict:
    return {
        "model": os.path.abspath(args.model),
        "device": device,
        "cache_device": next((r["cache_device"] for r in rows if r.get("cache_device")), None),
        "n_expert": n_expert,
        "prompt_tokens": prompt_tokens,
        "n_predict": args.n_predict,
        "repetitions": args.repetitions,
        "threads": args.threads,
        "n_gpu_layers": args.n_gpu_layers,
        "policy": args.policy,
        "host_experts": "plain" if args.plain else "repacked where llama.cpp repacks",
        "inserts": args.inserts,
        "host": _host(),
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "rows": rows,
        "notes": notes,
    }


def measure(args, name, slots, progress, mib=None, planner_off=False):
    """One configuration: load, warm up, time; returns (row, model info or None). A cache of
    `slots` per layer, or of the largest K that `mib` MiB hold; planner_off: without the miss
    planner (LLAMA_MOE_CACHE_PLANNER=0), else as the default decides."""
    from moecache.live.activate import attach
    from moecache.live.config import ConfigError
    from moecache.live.probe import CacheUnavailable

    row = {"config": name, "slots": slots, "status": "ok", "tok_s_runs": [], "tok_s_median": None,
           "tok_s_min": None, "tok_s_max": None, "prompt_tok_s_runs": [], "prompt_tok_s_median": None,
           "hit_rate": None, "uploads_per_token": None,
           "step_us_per_token": None, "device_bytes": None, "cache_device": None, "mib": mib}
    llm = _load(args, name)
    if llm is None:  # all-device: the whole model did not fit the device
        row["status"] = "did not fit"
        progress.advance(f"{name} did not fit", 1 + args.repetitions)
        return row, None
    cache = None
    try:
        n_expert = int(next((v for k, v in llm.metadata.items() if k.endswith(".expert_count")), 0))
        if n_expert == 0:
            raise BenchError(f"{args.model} is not a MoE model (no expert_count)")
        prompt = llm.tokenize(args.prompt.encode())
        if len(prompt) + args.n_predict > args.ctx_size:
            raise BenchError(f"prompt ({len(prompt)} tokens) + -n {args.n_predict} exceed -c {args.ctx_size}")
        info = {"n_expert": n_expert, "prompt_tokens": len(prompt)}
        if slots or mib:
            try:
                cache = attach(llm, **({"mib": mib} if mib else {"slots": slots}), inserts=args.inserts,
                               policy=args.policy, link_gbps=args.link_gbps, **({"planner": 0} if planner_off else {}))
            except (CacheUnavailable, ConfigError) as e:  # ConfigError: a budget below one slot per layer
                row["status"] = f"no cache: {e}"
                progress.advance(f"{name} no cache", 1 + args.repetitions)
                return row, info
            row["slots"], row["device_bytes"] = cache.slots, cache.device_bytes
            row["cache_device"] = cache.layers[0].device
            row["planner"] = cache.planner.line() if cache.planner else None  # its rates, as attach printed them
        _time_runs(args, name, llm, prompt, cache, row, progress)
        return row, info
    finally:
        if cache is not None:
            cache.detach()  # a later context may reuse this one's address
        llm.close()
        del llm
        gc.collect()


def _load(args, name):
    """The model as the configuration runs it; None where all-device does not fit the device."""
    import llama_cpp

    from moecache.live.placement import experts_on_host

    common = dict(n_ctx=args.ctx_size, n_threads=args.threads, n_threads_batch=args.threads,
                  seed=args.seed, verbose=False)
    try:
        if name == "all-device":
            return llama_cpp.Llama(args.model, n_gpu_layers=-1, **common)
        with experts_on_host(repack=not args.plain):
            return llama_cpp.Llama(args.model, n_gpu_layers=args.n_gpu_layers, **common)
    except (ValueError, RuntimeError) as e:
        if name != "all-device":
            raise BenchError(f"{name}: could not load {args.model}: {e}") from None
        return None


def _time_runs(args, name, llm, prompt, cache, row, progress):
    """A warm-up, then the timed repetitions, into row: the speeds, and the cache's counts over them."""
    from moecache.live.decode import greedy

    greedy(llm, prompt, args.n_predict)  # warm-up: untimed
    progress.advance(f"{name} warm-up")
    before = _cache_counters(cache)
    for i in range(args.repetitions):
        run = greedy(llm, prompt, args.n_predict)
        row["tok_s_runs"].append(args.n_predict / run.seconds)
        row["prompt_tok_s_runs"].append(len(prompt) / run.prompt_seconds)
        progress.advance(f"{name} run {i + 1}/{args.repetitions}")
    runs = row["tok_s_runs"]
    row.update(tok_s_median=statistics.median(runs), tok_s_min=min(runs), tok_s_max=max(runs),
               prompt_tok_s_median=statistics.median(row["prompt_tok_s_runs"]))
    if cache is not None:
        delta = {k: v - before[k] for k, v in _cache_counters(cache).items()}
        lookups = delta["hits"] + delta["misses"]
        tokens = args.repetitions * args.n_predict
        row["hit_rate"] = delta["hits"] / lookups if lookups else None
        row["uploads_per_token"] = delta["uploads"] / tokens
        row["step_us_per_token"] = delta["step_ns"] / 1e3 / delta["steps"] if delta["steps"] else None
        if cache.failed:
            row["status"] = f"cache failed: {cache.failed}"


def _cache_counters(cache):
    if cache is None:
        return {}
    totals = cache.stats()["totals"]
    return {"hits": totals["hits"], "misses": totals["misses"], "uploads": totals["uploads"],
            "step_ns": cache.counts.step_ns, "steps": cache.counts.steps}


def _host():
    model = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                  if line.startswith("model name")), platform.processor() or "unknown CPU")
    return {"cpu": model, "cpus": os.cpu_count(), "python": platform.python_version()}


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


# --- reporting ---------------------------------------------------------------------------------

def _fmt(value, spec, missing="-"):
    return missing if value is None else format(value, spec)


def markdown(report) -> str:
    lines = [
        f"Model `{os.path.basename(report['model'])}` ({report['n_expert']} experts per layer), "
        f"device: {report['device']}" + (f", cache on {report['cache_device']}" if report["cache_device"] else ""),
        f"{report['prompt_tokens']} prompt tokens, {report['n_predict']} decode tokens per run, "
        f"median [min, max] of {report['repetitions']} runs after a warm-up; policy {report['policy']}, "
        f"{report['inserts']} inserts per layer per step; host experts "
        f"{report['host_experts']}; host: {report['host']['cpu']}, "
        f"{report['host']['cpus']} CPUs, threads {report['threads'] or 'default'}",
        f"Command: `{report['command']}`",
        "",
    ]
    lines += ["| config | decode tok/s | vs stock | prompt tok/s | vs stock | hit % | uploads/token | "
              "step us/token | cache MiB |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        if r["status"] != "ok" and r["tok_s_median"] is None:
            lines.append(f"| {r['config']} | {r['status']} | | | | | | | |")
            continue
        speed = f"{r['tok_s_median']:.2f} [{r['tok_s_min']:.2f}, {r['tok_s_max']:.2f}]"
        ratios = _fmt(r["ratio"], ".2f")
        hit = _fmt(None if r["hit_rate"] is None else 100 * r["hit_rate"], ".1f")
        mib = _fmt(None if r["device_bytes"] is None else r["device_bytes"] / 2**20, ".1f")
        status = "" if r["status"] == "ok" else f" ({r['status']})"
        if r.get("mib") and r["slots"]:
            status = f" (K={r['slots']})" + status
        prompt = f"{_fmt(r.get('prompt_tok_s_median'), '.1f')} | {_fmt(r.get('prompt_ratio'), '.2f')}"
        lines.append(f"| {r['config']}{status} | {speed} | {ratios} | {prompt} | {hit} | "
                     f"{_fmt(r['uploads_per_token'], '.1f')} | {_fmt(r['step_us_per_token'], '.0f')} | {mib} |")
    lines += [f"\nNote: {note}" for note in report["notes"]]
    return "\n".join(lines)


def plot(report, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in report["rows"] if r["tok_s_median"] is not None]
    curve = sorted((r for r in measured if r["config"] == "stock" or r["config"].startswith(("K=", "MiB="))),
                   key=lambda r: r["slots"])
    ks = [r["slots"] for r in curve]
    fig, speed_axis = plt.subplots(figsize=(7, 4))
    speed_axis.errorbar(ks, [r["tok_s_median"] for r in curve],
                        yerr=[[r["tok_s_median"] - r["tok_s_min"] for r in curve],
                              [r["tok_s_max"] - r["tok_s_median"] for r in curve]],
                        marker="o", color="tab:blue", capsize=3, label="decode tok/s")
    all_device = next((r for r in measured if r["config"] == "all-device"), None)
    if all_device:
        speed_axis.axhline(all_device["tok_s_median"], linestyle="--", color="gray", label="all-device")
    speed_axis.set_xlabel("cache slots per layer (K)")
    speed_axis.set_ylabel("decode tok/s")
    hit_axis = speed_axis.twinx()
    cached = [r for r in curve if r["hit_rate"] is not None]
    hit_axis.plot([r["slots"] for r in cached], [100 * r["hit_rate"] for r in cached],
                  marker="s", color="tab:orange", label="hit %")
    hit_axis.set_ylabel("hit %")
    hit_axis.set_ylim(0, 100)
    handles = speed_axis.get_legend_handles_labels()
    extra = hit_axis.get_legend_handles_labels()
    speed_axis.legend(handles[0] + extra[0], handles[1] + extra[1], loc="lower right", fontsize=8)
    speed_axis.set_title(f"{os.path.basename(report['model'])} on {report['device'].split(' (')[0]}", fontsize=9)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format=os.path.splitext(path)[1][1:] or "png"))
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
