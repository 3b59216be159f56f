#!/usr/bin/env python3
"""A MoE model larger than memory: stock llama.cpp decode and prompt speed with the model file in
RAM and inside a memory cgroup smaller than the file, beside the disk's own bandwidth.

    python scripts/bench_larger_than_ram.py [-m MODEL | [--synth PRESET] --layers 8] [--limit-mb 1600] [-p PROMPT]
        [-n 16] [-r 3] [-t THREADS] [-c 2048] [--ram-mib N|auto] [--cgroup-root DIR]
        [--disk-mib 512] [--disk-threads 4] [--no-disk | --disk-only] [--md FILE] [--json FILE]

The model (default: `python -m moecache.models synth qwen3-30b-a3b --layers 8`, 2.8 GB; --synth names
another preset of moecache.models synth, e.g. gpt-oss-20b or qwen3-next-80b-a3b) loads as
a user whose model does not fit must load it: stock llama-cpp-python, mmap, no repacking
(use_extra_bufts=False: repacking copies every tensor into anonymous memory), CPU only.
Configurations, each run a fresh process that loads the model, evaluates the prompt and decodes
-n greedy tokens (moecache.live.decode.greedy); -r rounds, each running every configuration once:
  stock, in RAM     the file read into the page cache first; no cgroup
  stock, N MB       the file evicted from the page cache first (POSIX_FADV_DONTNEED, checked
                    with mincore); the process joins a new memory cgroup limited to N MB
                    (v1 memory.limit_in_bytes, or v2 memory.max) before the model loads
  tier, ...         the same two with LLAMA_MOE_CACHE_RAM_MIB set (--ram-mib, default auto; 0:
                    no tier rows): the RAM tier, the model loaded as that variable loads it
  tier, no read-ahead, N MB   with --read-ahead both: the limited tier run again with
                    LLAMA_MOE_CACHE_READ_AHEAD=0 (each layer reads its misses at its own router)
Where no memory cgroup can be made (not root, no memory controller, --cgroup-root missing) the
script says so and stops: it never reports an unlimited run as limited. The cgroups it makes
(one per limited run, under --cgroup-root: default this process's own memory cgroup) are
removed when the run ends, also on errors and Ctrl-C.

Reported per configuration: decode and prompt tok/s (median [min, max] over the rounds), the
share of the file in the page cache at the start, the cgroup's peak usage (the highest of the
runs) and the page cache it held at the end, the process's peak RSS and its anonymous memory
after decoding, the bytes its page faults read from storage per decode token (/proc/self/io),
whether the greedy tokens equal the first in-RAM run's, and the 1-minute load average at the
start of the runs (medians); for the tier's limited rows, from its stats (LLAMA_MOE_CACHE_STATS),
per decode token: the bytes it read, of them read ahead and not selected, the time the layers
waited for their reads, and the share of the experts read ahead that their layer selected; and,
token by token, a least-squares fit of a decode token's time to the bytes it read (ms per MB read,
the CPU's work on a read included, and ms at no read), and the mean time of each request's first
two decode tokens and of the others. Pages other processes cached first
(the Python and llama.cpp libraries) count in RSS but not in the cgroup. The disk (unless --no-disk): O_DIRECT reads of
the model file, sequential 2 MiB requests at queue depth 1 and with --disk-threads threads, and
4 KiB requests at random offsets at queue depth 1; then requests of one expert's tensor at random
offsets by two paths, the tier's (the page cache, a mapping, then unmapped and released) and
O_DIRECT into one buffer used again: GB/s and the CPU time per MB read of each; with them an I/O bound for the limited run:
the experts that fit in the limit beside everything else stay resident, and each token reads
the rest of its experts once at the best sequential bandwidth. And for each limited tier row its
roofline, the fastest a limited decode can be: max(the in-RAM tier row's decode time per token,
the row's own disk bytes per decode token at the best disk rate measured), and the share of it
the row's decode reached, and its tokens after each request's first two.

Like every script here it imports the installed moecache package (scripts/bootstrap.sh installs
it, editable, with the patched llama-cpp-python).
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from moecache.util import OneLineParser, Progress, atomic_write, int_arg, write_json

PROG = "bench_larger_than_ram.py"
DEFAULT_PROMPT = "Explain how a mixture-of-experts model decides which experts handle each token."
SYNTH_PRESET = "qwen3-30b-a3b"
TIER_VARIABLE = "LLAMA_MOE_CACHE_RAM_MIB"
CHILD = "--child-run"  # first argument of the per-run child process (not a user flag)
MB = 10**6
MIB = 2**20
LARGER_THAN_LIMIT = 1.75  # the issue's minimum ratio of model size to memory limit
CACHED_ENOUGH = 0.99  # in RAM: at least this share of the file's pages in the page cache
EVICTED_ENOUGH = 0.01  # limited: at most this share left after eviction
RANDOM_READ_SECONDS = 2.0
READ_PATH_REQUESTS = 400  # expert-sized requests per read path and measurement (half each)
MADV_POPULATE_READ = 22   # Linux 5.14 (the mmap module does not name it)
READ_KEYS = ("read_bytes_per_token", "wasted_bytes_per_token", "wait_ms_per_token", "read_ahead_precision")
TOKEN_KEYS = ("decode_ms_per_read_mb", "decode_ms_at_no_read", "decode_ms_first", "decode_ms_later")
# the decode tokens right after a prompt, timed apart from the others: the first touch of the memory its
# reads land in can cost a VM far more than a later token pays (docs/notes/ram-read-ahead.md)
FIRST_TOKENS = 2


class BenchError(ValueError):
    """A one-line error for the user (exit status 2)."""


class CgroupUnavailable(RuntimeError):
    """No memory cgroup can be made here: the limited runs cannot be measured (exit status 1)."""


def ram_mib_arg(text: str) -> str:
    """--ram-mib: 'auto' or a non-negative integer, kept as text (it becomes an environment
    variable); 0 turns the tier rows off."""
    if text == "auto":
        return text
    return str(int_arg(minimum=0)(text))


def parser() -> OneLineParser:
    p = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", help=f"GGUF file of a MoE model (default: the synthetic {SYNTH_PRESET}, "
                                         "built or found in the model cache)")
    p.add_argument("--synth", default=SYNTH_PRESET, metavar="PRESET",
                   help=f"the synthetic model's preset when -m is not given (default {SYNTH_PRESET}; see "
                        "python -m moecache.models synth --help)")
    p.add_argument("--layers", type=int_arg(minimum=1), default=8,
                   help="layers of the synthetic model when -m is not given (default 8: 2.8 GB for qwen3-30b-a3b)")
    p.add_argument("--limit-mb", type=int_arg(minimum=0), default=1600,
                   help="memory limit of the limited runs, MB of 10^6 bytes (default 1600; 0: no limited "
                        "rows, the in-RAM rows alone)")
    p.add_argument("-p", "--prompt", default=DEFAULT_PROMPT)
    p.add_argument("-n", "--n-predict", type=int_arg(minimum=1), default=16, help="decode tokens per run (default 16)")
    p.add_argument("--requests", type=int_arg(minimum=1), default=1,
                   help="requests per run, one after the other in its process, each a prompt longer than the "
                        "one before (the prompt repeated once more) and -n greedy tokens (default 1)")
    p.add_argument("-r", "--repetitions", type=int_arg(minimum=1), default=3,
                   help="rounds, each running every configuration once (default 3)")
    p.add_argument("-t", "--threads", type=int_arg(minimum=1), default=None, help="CPU threads (default: llama.cpp's)")
    p.add_argument("-c", "--ctx-size", type=int_arg(minimum=16), default=2048)
    p.add_argument("--seed", type=int_arg(minimum=0), default=0)
    p.add_argument("--ram-mib", type=ram_mib_arg, default="auto",
                   help=f"the tier rows' {TIER_VARIABLE} (default auto; 0: no tier rows)")
    p.add_argument("--read-ahead", choices=("on", "off", "both"), default="on",
                   help="the tier rows' LLAMA_MOE_CACHE_READ_AHEAD: on (the default), off, or both (a limited "
                        "tier row without it beside the one with it)")
    p.add_argument("--cgroup-root", help="make the memory cgroups under this directory "
                                         "(default: this process's own memory cgroup)")
    p.add_argument("--run-timeout", type=int_arg(minimum=1), default=1800,
                   help="seconds one run may take before it is killed (default 1800)")
    p.add_argument("--disk-mib", type=int_arg(minimum=2), default=512,
                   help="MiB read per sequential disk measurement (default 512)")
    p.add_argument("--disk-threads", type=int_arg(minimum=2), default=4,
                   help="threads of the parallel sequential measurement (default 4)")
    disk = p.add_mutually_exclusive_group()
    disk.add_argument("--no-disk", action="store_true", help="skip the disk measurement and the I/O bound")
    disk.add_argument("--disk-only", action="store_true", help="measure only the disk")
    p.add_argument("--md", metavar="FILE", help="write the report (markdown) here")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON here")
    return p


def main(argv=None) -> int:
    return parser().run(_bench, argv)


def _bench(args) -> int:
    _check_outputs(args)
    # a plain kill must still run the finally blocks that remove the cgroups
    signal.signal(signal.SIGTERM, _interrupt)
    model = _model_path(args)
    report = {"model": os.path.basename(model), "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
              "facts": model_facts(model), "limit_mb": args.limit_mb, "n_predict": args.n_predict, "requests": args.requests,
              "repetitions": args.repetitions, "threads": args.threads, "ctx_size": args.ctx_size,
              "host": _host(), "notes": [], "disk": None, "rows": [], "paired": {}, "bound": None, "roofline": {}, "cgroup": None}
    root = None
    if not args.disk_only:
        if args.limit_mb:
            root = args.cgroup_root or own_memory_cgroup()
            report["cgroup"] = probe_cgroup(root)  # raises CgroupUnavailable: stop before measuring anything
        else:
            report["notes"].append("no limited rows (--limit-mb 0)")
        if args.ram_mib == "0":
            report["notes"].append("no tier rows (--ram-mib 0)")
    if not args.no_disk:
        report["disk"] = measure_disk(model, args.disk_mib * MIB, args.disk_threads, report["facts"]["part_bytes"])
    if not args.disk_only:
        ratio = report["facts"]["file_bytes"] / (args.limit_mb * MB) if args.limit_mb else None
        if ratio is not None and ratio < LARGER_THAN_LIMIT:
            report["notes"].append(f"the model is {ratio:.2f}x the limit, under the {LARGER_THAN_LIMIT}x "
                                   "of a larger-than-RAM run")
        report["rows"] = measure_configs(args, model, root, tier=args.ram_mib != "0",
                                         on_round=lambda rows: save(args, {**report, "rows": rows}))
        report["paired"] = paired_ratios(report["rows"])
        report["bound"] = io_bound(report)
        report["roofline"] = rooflines(report)
    save(args, report)
    print(markdown(report))
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _check_outputs(args):
    for path in (args.md, args.json):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise BenchError(f"cannot write {path}: no such directory")
    if args.model and not os.path.isfile(args.model):
        raise BenchError(f"model file not found: {args.model}")


def _model_path(args) -> str:
    if args.model:
        return os.path.abspath(args.model)
    from moecache.models import synth_moe
    from moecache.models.synth import PRESETS

    if args.synth not in PRESETS:
        raise BenchError(f"unknown --synth preset {args.synth!r} (choose from {', '.join(PRESETS)})")
    return str(synth_moe(args.synth, n_layer=args.layers))


def save(args, report):
    """Write the JSON and the markdown; after every round too, so that a stopped run leaves what
    it measured."""
    if args.json:
        write_json(args.json, report)
    if args.md:
        atomic_write(args.md, markdown(report) + "\n")


def model_facts(path: str) -> dict:
    """Sizes from the GGUF's tensor table: routed experts (the *_exps tensors) against the rest."""
    import gguf

    reader = gguf.GGUFReader(path)
    try:
        expert_bytes = other_bytes = 0
        moe_layers = set()
        exps_bytes = []
        for tensor in reader.tensors:
            if re.search(r"\.ffn_\w+_exps\.", tensor.name):
                expert_bytes += int(tensor.n_bytes)
                exps_bytes.append(int(tensor.n_bytes))
                moe_layers.add(tensor.name.split(".")[1])
            else:
                other_bytes += int(tensor.n_bytes)
        counts = {key.rsplit(".", 1)[1]: int(field.parts[field.data[0]][0]) for key, field in reader.fields.items()
                  if key.endswith((".expert_count", ".expert_used_count"))}
    finally:
        del reader  # its memory map would keep the file's header pages cached
    if not expert_bytes or set(counts) != {"expert_count", "expert_used_count"}:
        raise BenchError(f"{path} is not a MoE model (no routed expert tensors or expert counts)")
    return {"file_bytes": os.path.getsize(path), "expert_bytes": expert_bytes, "other_bytes": other_bytes,
            "moe_layers": len(moe_layers), "n_expert": counts["expert_count"],
            "n_expert_used": counts["expert_used_count"],
            # one expert's bytes of its largest tensor (a weight, not a bias): one request of the tier
            "part_bytes": max(exps_bytes) // counts["expert_count"]}


# --- the page cache ----------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.readahead.argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_size_t]


def cached_share(path: str) -> float:
    """Share of the file's pages in the page cache (mincore over a mapping that faults nothing)."""
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        try:
            vector = (ctypes.c_ubyte * pages)()
            if _libc.mincore(address, size, vector) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
        finally:
            _libc.munmap(address, size)
    finally:
        os.close(fd)
    return 1 - bytes(vector).count(0) / pages


def evict(path: str) -> float:
    """Drop the file from the page cache; returns the share still cached (pages some other
    process maps stay)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages (a model just written) cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return cached_share(path)


def cache_whole_file(path: str) -> float:
    """Read the file through the page cache unless it is there already; returns the share cached."""
    if cached_share(path) < CACHED_ENOUGH:
        buffer = bytearray(16 * MIB)
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass
    return cached_share(path)


# --- memory cgroups ----------------------------------------------------------------------------

def own_memory_cgroup() -> str:
    """The directory of this process's memory cgroup: v1 (a 'memory' hierarchy) or v2."""
    with open("/proc/self/cgroup") as f:
        lines = [line.rstrip("\n").split(":", 2) for line in f]
    for _, controllers, path in lines:
        if "memory" in controllers.split(","):
            return "/sys/fs/cgroup/memory" + path
    for hierarchy, controllers, path in lines:
        if hierarchy == "0" and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
            return "/sys/fs/cgroup" + path
    raise CgroupUnavailable("cannot make a memory cgroup: this process is in no memory cgroup hierarchy")


class MemoryCgroup:
    """A new child memory cgroup of root with a limit (v1 or v2, whichever root is); remove() it."""

    def __init__(self, root: str, limit_bytes: int | None):
        self.path = tempfile.mkdtemp(prefix="moecache-bench-", dir=root)  # a unique name
        try:
            if os.path.exists(os.path.join(self.path, "memory.limit_in_bytes")):
                self.version = 1
                self.limit_file, self.procs = "memory.limit_in_bytes", "cgroup.procs"
            elif os.path.exists(os.path.join(self.path, "memory.max")):
                self.version = 2
                self.limit_file, self.procs = "memory.max", "cgroup.procs"
            else:
                raise CgroupUnavailable(f"cannot make a memory cgroup under {root}: the new cgroup has no "
                                        "memory controller (v2: not in the parent's cgroup.subtree_control)")
            if limit_bytes is not None:
                self._write(self.limit_file, str(limit_bytes))
                set_to = self._read(self.limit_file).strip()
                if set_to == "max" or int(set_to) > limit_bytes:
                    raise CgroupUnavailable(f"cannot make a memory cgroup: {self.limit_file} reads {set_to} "
                                            f"after writing {limit_bytes}")
        except BaseException:
            self.remove()
            raise

    def _read(self, name: str) -> str:
        with open(os.path.join(self.path, name)) as f:
            return f.read()

    def _write(self, name: str, text: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(text)

    def relative_path(self, root: str) -> str:
        return os.path.relpath(self.path, root)

    def stats(self) -> dict:
        """Peak usage, the page cache it holds, how often the limit was hit, OOM kills."""
        stat = dict(line.split() for line in self._read("memory.stat").splitlines() if len(line.split()) == 2)
        if self.version == 1:
            oom = dict(line.split() for line in self._read("memory.oom_control").splitlines())
            return {"peak_bytes": int(self._read("memory.max_usage_in_bytes")),
                    "page_cache_bytes": int(stat["total_cache"]), "limit_hits": int(self._read("memory.failcnt")),
                    "oom_kills": int(oom.get("oom_kill", 0))}
        events = dict(line.split() for line in self._read("memory.events").splitlines())
        peak = self._read("memory.peak") if os.path.exists(os.path.join(self.path, "memory.peak")) else None
        return {"peak_bytes": int(peak) if peak else None, "page_cache_bytes": int(stat["file"]),
                "limit_hits": int(events["max"]), "oom_kills": int(events.get("oom_kill", 0))}

    def remove(self) -> None:
        # the last task may take a moment to leave after its exit
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError as e:
                error = e
                time.sleep(0.1)
        raise RuntimeError(f"could not remove the cgroup {self.path}: {error}; remove it with rmdir")


def probe_cgroup(root: str) -> dict:
    """Make and remove a limited cgroup under root; CgroupUnavailable (one line) if that fails."""
    if not os.path.isdir(root):
        raise CgroupUnavailable(f"cannot make a memory cgroup: no cgroup directory {root}")
    try:
        cgroup = MemoryCgroup(root, 64 * MIB)
    except OSError as e:
        raise CgroupUnavailable(f"cannot make a memory cgroup under {root}: {e.strerror or e}"
                                + (" (not root?)" if e.errno in (13, 1) else "")) from None
    cgroup.remove()
    return {"version": cgroup.version, "limit_file": cgroup.limit_file}


# --- the runs ----------------------------------------------------------------------------------

KINDS = {"stock": "stock", "tier": "tier", "tier-noahead": "tier, no read-ahead"}  # kind -> its rows' label


def measure_configs(args, model: str, cgroup_root: str | None, *, tier: bool, on_round=None) -> list[dict]:
    placements = ("ram", "limited") if args.limit_mb else ("ram",)
    configs = [(kind, placement) for placement in placements for kind in (("stock", "tier") if tier else ("stock",))]
    if tier and args.limit_mb and args.read_ahead == "both":
        configs.append(("tier-noahead", "limited"))  # in RAM nothing is read
    runs = {config: [] for config in configs}
    progress = Progress(len(configs) * args.repetitions, unit="run", log_lines=True)
    with tempfile.TemporaryDirectory(prefix="moecache-bench-") as scratch:
        for round_ in range(args.repetitions):
            for kind, placement in round_order(configs, round_):
                run = one_run(args, model, cgroup_root, scratch, kind=kind, placement=placement)
                runs[(kind, placement)].append(run)
                progress.advance(f"{kind} {placement} run {round_ + 1}: {run['status']}")
            if on_round:
                on_round(summarize(args, runs))
    progress.close()
    return summarize(args, runs)


def round_order(configs: list[tuple[str, str]], round_: int) -> list[tuple[str, str]]:
    """A round's configurations: the in-RAM runs first, the first of them after the last limited
    run of the round before, every other round in the reverse order (each kind first as often as
    the other). An in-RAM run after stock's limited run decoded about 4% slower than one after the
    tier's: with the two in-RAM rows loading the same way, the order before printed 0.949x and
    0.964x, and 1.012x with no limited run at all."""
    in_ram = [c for c in configs if c[1] == "ram"]
    return (in_ram if round_ % 2 == 0 else in_ram[::-1]) + [c for c in configs if c[1] != "ram"]


def one_run(args, model: str, cgroup_root: str, scratch: str, *, kind: str, placement: str) -> dict:
    """One fresh process: load, prompt, -n greedy tokens. limited: in a new cgroup, file evicted."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_MOE_CACHE_")}
    result_file, stats_file = os.path.join(scratch, "run.json"), os.path.join(scratch, "stats.json")
    if kind != "stock":
        env[TIER_VARIABLE] = args.ram_mib
        env["LLAMA_MOE_CACHE_READ_AHEAD"] = "0" if kind == "tier-noahead" or args.read_ahead == "off" else "1"
        env["LLAMA_MOE_CACHE_STATS"] = stats_file
        if os.path.exists(stats_file):
            os.unlink(stats_file)
    spec = {"model": model, "prompt": args.prompt, "n_predict": args.n_predict, "requests": args.requests,
            "threads": args.threads,
            "ctx_size": args.ctx_size, "seed": args.seed, "result": result_file, "procs": None, "cgroup": None}
    cgroup = None
    if placement == "ram":
        cached = cache_whole_file(model)
    else:
        cached = evict(model)
        if cached > EVICTED_ENOUGH:
            raise RuntimeError(f"{100 * cached:.1f}% of {model} stays in the page cache after eviction "
                               "(mapped by another process?): a limited run would not be limited")
    try:
        if placement == "limited":
            cgroup = MemoryCgroup(cgroup_root, args.limit_mb * MB)
            spec["procs"] = os.path.join(cgroup.path, cgroup.procs)
            spec["cgroup"] = cgroup.relative_path(cgroup_root)
        # other jobs on the cores slow two spinning llama.cpp threads a lot: say how busy it was
        load_average = os.getloadavg()[0]
        try:
            done = subprocess.run([sys.executable, os.path.abspath(__file__), CHILD, json.dumps(spec)],
                                  env=env, capture_output=True, text=True, timeout=args.run_timeout)
            status = child_status(done)
        except subprocess.TimeoutExpired:
            status = f"killed after --run-timeout {args.run_timeout} s"
        run = {"status": status, "cached_at_start": cached, "load_average": load_average}
        if cgroup is not None:
            run.update(cgroup.stats())
            if run["oom_kills"] and status != "ok":
                run["status"] = f"killed by the memory cgroup (out of memory; {status})"
        if status == "ok":
            with open(result_file) as f:
                run.update(json.load(f))
            run.update(_tier_reads(stats_file) if kind != "stock" else {})
        return run
    finally:
        if cgroup is not None:
            cgroup.remove()


def _tier_reads(stats_file: str) -> dict:
    """From the tier's stats, its decode's reads per token (None where it wrote none)."""
    try:
        with open(stats_file) as f:
            reads = json.load(f).get("reads") or {}
    except (OSError, ValueError):
        return {}
    return {key: (reads.get("decode_per_token") or {}).get(key) for key in READ_KEYS}


def child_status(done: subprocess.CompletedProcess) -> str:
    """'ok', or the child's last line of stderr; a moecache error line (the tier not active)
    makes a run fail too: a tier row must not be a stock run under another name."""
    lines = done.stderr.strip().splitlines()
    library_error = next((line for line in lines if re.match(r"moecache: (error|no expert cache)", line)), None)
    if done.returncode == 0 and library_error is None:
        return "ok"
    if done.returncode < 0:
        return f"killed by signal {signal.Signals(-done.returncode).name}"
    return f"failed: {library_error or (lines[-1] if lines else f'exit status {done.returncode}')}"


def child(spec_json: str) -> int:
    """One run, in its own process: join the cgroup first (everything the model maps is then
    charged to it), then load and decode; the result goes to spec['result']."""
    spec = json.loads(spec_json)
    if spec["procs"]:
        with open(spec["procs"], "w") as f:
            f.write(str(os.getpid()))
        with open("/proc/self/cgroup") as f:
            joined = [line for line in f if line.rstrip("\n").endswith("/" + spec["cgroup"])]
        if not joined:
            print(f"{PROG}: error: the run did not join the cgroup {spec['cgroup']}", file=sys.stderr)
            return 1
    import llama_cpp
    import llama_cpp.llama_cpp as bindings

    stock_params = bindings.llama_model_default_params

    def no_repacking():
        params = stock_params()
        params.use_extra_bufts = False
        return params

    bindings.llama_model_default_params = no_repacking
    read_before = _io_read_bytes()
    start = time.perf_counter()
    llm = llama_cpp.Llama(spec["model"], n_gpu_layers=0, use_mmap=True, n_ctx=spec["ctx_size"],
                          n_threads=spec["threads"], n_threads_batch=spec["threads"], seed=spec["seed"],
                          verbose=False)
    load_seconds = time.perf_counter() - start
    read_loaded = _io_read_bytes()
    prompts = [llm.tokenize(" ".join([spec["prompt"]] * (i + 1)).encode()) for i in range(spec["requests"])]
    if len(prompts[0]) < 2 or len(prompts[-1]) + spec["n_predict"] > spec["ctx_size"]:
        print(f"{PROG}: error: the prompt ({len(prompts[0])} tokens) must have 2 tokens or more, and the longest "
              f"request's ({len(prompts[-1])} tokens) with -n {spec['n_predict']} fit -c {spec['ctx_size']}",
              file=sys.stderr)
        return 1
    result = run_requests(llm, prompts, spec["n_predict"])
    memory = _proc_status()
    result.update({"load_s": load_seconds, "read_bytes_load": read_loaded - read_before, "peak_rss_bytes": memory["VmHWM"],
                   "anon_bytes": memory["RssAnon"], "file_rss_bytes": memory["RssFile"],
                   "file_huge_bytes": _file_huge_bytes()})
    llm.close()
    write_json(spec["result"], result)
    return 0


def run_requests(llm, prompts: list[list[int]], n_predict: int) -> dict:
    """Each prompt, then n_predict greedy tokens, one request after the other: the rates over all of
    them and each one's, the disk's reads in prompts and per decode token, and the decode tokens'
    time fitted against their reads."""
    from moecache.live.decode import greedy

    tokens = TokenReads(llm)
    runs, read_prompts, read_decodes, starts = [], 0, 0, []
    for prompt in prompts:
        starts.append(len(tokens.ms))
        read_request = _io_read_bytes()
        tokens.first_read = None
        runs.append(greedy(llm, prompt, n_predict))
        read_prompts += tokens.first_read - read_request
        read_decodes += _io_read_bytes() - tokens.first_read
    n_decoded = n_predict * len(runs)
    return {"tokens": [t for run in runs for t in run.tokens], "prompt_tokens": sum(map(len, prompts)),
            "prompt_tok_s": sum(map(len, prompts)) / sum(run.prompt_seconds for run in runs),
            "decode_tok_s": n_decoded / sum(run.seconds for run in runs),
            "requests": [{"prompt_tokens": len(prompt), "prompt_tok_s": len(prompt) / run.prompt_seconds,
                          "decode_tok_s": n_predict / run.seconds} for prompt, run in zip(prompts, runs)],
            "read_bytes_prompt": read_prompts, "decode_read_bytes_per_token": read_decodes / n_decoded,
            **token_time_fit(tokens.ms, tokens.read_bytes), **token_phases(tokens.ms, starts)}


class TokenReads:
    """llm.eval noting each single-token evaluation's time and disk reads (llama_decode on the CPU
    returns once the graph ran); the prompt's reads end where the first one starts."""

    def __init__(self, llm):
        self.first_read = None
        self.ms, self.read_bytes = [], []
        self.evaluate = llm.eval
        llm.eval = self.eval

    def eval(self, tokens):
        if len(tokens) != 1:
            return self.evaluate(tokens)
        read_before, start = _io_read_bytes(), time.perf_counter()
        if self.first_read is None:
            self.first_read = read_before
        self.evaluate(tokens)
        self.ms.append((time.perf_counter() - start) * 1e3)
        self.read_bytes.append(_io_read_bytes() - read_before)


def token_time_fit(token_ms: list[float], token_read_bytes: list[int]) -> dict:
    """A decode token's time against the bytes it read, fitted by least squares over the run's
    tokens: ms per MB read (what a read costs the token, the CPU's work on it included, beside
    the wait) and ms at no read. None where the tokens' reads do not vary (a run in RAM)."""
    mb = [n / MB for n in token_read_bytes]
    if len(mb) < 3 or statistics.pvariance(mb) == 0:
        return {"decode_ms_per_read_mb": None, "decode_ms_at_no_read": None}
    slope, intercept = statistics.linear_regression(mb, token_ms)
    return {"decode_ms_per_read_mb": slope, "decode_ms_at_no_read": intercept}


def token_phases(token_ms: list[float], starts: list[int]) -> dict:
    """The mean time of each request's first FIRST_TOKENS decode tokens (starts: where each request's
    tokens begin in token_ms) and of the others; None for a phase without a token."""
    first = {i for start in starts for i in range(start, start + FIRST_TOKENS)}
    phases = ([ms for i, ms in enumerate(token_ms) if i in first], [ms for i, ms in enumerate(token_ms) if i not in first])
    return {key: statistics.fmean(ms) if ms else None for key, ms in zip(("decode_ms_first", "decode_ms_later"), phases)}


def _io_read_bytes() -> int:
    """Bytes this process made the kernel read from storage (page faults on the model included)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def _proc_status() -> dict:
    with open("/proc/self/status") as f:
        return {key: int(value.split()[0]) * 1024 for key, value in (line.split(":", 1) for line in f)
                if key in ("VmHWM", "RssAnon", "RssFile")}


def _file_huge_bytes() -> int:
    """Bytes of files this process maps in whole huge pages (FilePmdMapped: the RAM tier's reads of
    the huge pages inside its experts, where the kernel maps large folios so)."""
    with open("/proc/self/smaps_rollup") as f:
        return next((int(line.split()[1]) * 1024 for line in f if line.startswith("FilePmdMapped:")), 0)


def summarize(args, runs: dict) -> list[dict]:
    """A row per configuration: medians over its successful runs; tokens against the first
    successful in-RAM stock run's."""
    reference = next((r["tokens"] for r in runs.get(("stock", "ram"), []) if r["status"] == "ok"), None)
    rows = []
    for (kind, placement), config_runs in runs.items():
        ok = [r for r in config_runs if r["status"] == "ok"]
        row = {"config": f"{KINDS[kind]}, " + ("in RAM" if placement == "ram" else f"{args.limit_mb} MB"),
               "kind": kind, "placement": placement, "runs": config_runs, "ok_runs": len(ok),
               "failures": sorted({r["status"] for r in config_runs if r["status"] != "ok"})}
        for key in ("decode_tok_s", "prompt_tok_s", "cached_at_start", "page_cache_bytes", "peak_rss_bytes",
                    "anon_bytes", "file_huge_bytes", "decode_read_bytes_per_token", "load_s", "load_average", *READ_KEYS,
                    *TOKEN_KEYS):
            values = [r[key] for r in ok if r.get(key) is not None]
            row[key] = statistics.median(values) if values else None
            if key in ("decode_tok_s", "prompt_tok_s"):
                row[key + "_range"] = [min(values), max(values)] if values else None
        # the highest peak of the runs: the one the limit must hold
        peaks = [r["peak_bytes"] for r in ok if r.get("peak_bytes") is not None]
        row["peak_bytes"] = max(peaks) if peaks else None
        hits = [r["limit_hits"] for r in ok if r.get("limit_hits") is not None]
        row["limit_hits"] = max(hits) if hits else None
        row["requests"] = [{key: statistics.median(r["requests"][i][key] for r in ok)
                            for key in ("prompt_tokens", "prompt_tok_s", "decode_tok_s")}
                           for i in range(len(ok[0]["requests"]))] if ok and "requests" in ok[0] else None
        row["tokens_match"] = None if reference is None or not ok else all(r["tokens"] == reference for r in ok)
        row["peak_within_limit"] = None if row["peak_bytes"] is None else row["peak_bytes"] <= args.limit_mb * MB
        rows.append(row)
    return rows


def paired_ratios(rows: list[dict]) -> dict:
    """Tier over stock run by run, per placement: the runs of one round ran minutes apart at
    most, so a slower machine (other jobs, thermal) cancels in their ratio; {placement:
    {"rounds": n, "decode_tok_s": [median, min, max], "prompt_tok_s": [...]}} over the rounds
    where both ran."""
    runs = {(r["kind"], r["placement"]): r["runs"] for r in rows}
    ratios = {}
    for name, (base, placement) in PAIRS.items():
        pairs = [(stock, tier) for stock, tier in zip(runs.get((base, placement), []), runs.get(("tier", placement), []))
                 if stock["status"] == tier["status"] == "ok"]
        if pairs:
            ratios[name] = {"rounds": len(pairs)}
            for key in ("decode_tok_s", "prompt_tok_s"):
                values = [tier[key] / stock[key] for stock, tier in pairs]
                ratios[name][key] = [statistics.median(values), min(values), max(values)]
    return ratios


# the tier's rows over: name -> (the other row's kind, placement)
PAIRS = {"ram": ("stock", "ram"), "limited": ("stock", "limited"), "read_ahead": ("tier-noahead", "limited")}


# --- the disk ----------------------------------------------------------------------------------

def measure_disk(path: str, total_bytes: int, threads: int, part_bytes: int) -> dict | None:
    """O_DIRECT reads of the file (the page cache bypassed): sequential 2 MiB requests at queue
    depth 1 and with `threads` threads, 4 KiB at random offsets at queue depth 1; GB/s. Then what
    reading one expert part (part_bytes) costs the CPU by each path (read_path_costs). None where
    the filesystem has no O_DIRECT (tmpfs)."""
    size = os.path.getsize(path)
    request = 2 * MIB
    usable = size // request * request
    if usable < 2 * request:
        raise BenchError(f"{path} is too small to measure the disk with 2 MiB reads")
    total_bytes = min(total_bytes // request * request, usable // 2)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        print(f"disk: no O_DIRECT on the filesystem of {path} ({e.strerror}): no disk figures", file=sys.stderr)
        return None
    try:
        # two regions of the file, so that the second measurement reads nothing the first read
        # (a virtual disk's host cache would flatter it)
        qd1 = _sequential(fd, range(0, total_bytes, request), request, 1)
        parallel = _sequential(fd, range(total_bytes, 2 * total_bytes, request), request, threads)
        random_read = _random_reads(fd, size // mmap.PAGESIZE, mmap.PAGESIZE)
        paths = read_path_costs(path, fd, part_bytes)
    except OSError as e:
        print(f"disk: O_DIRECT reads of {path} failed ({e.strerror}): no disk figures", file=sys.stderr)
        return None
    finally:
        os.close(fd)
    return {"request_bytes": request, "bytes_per_measurement": total_bytes, "threads": threads,
            "sequential_qd1_gbps": qd1, "sequential_threads_gbps": parallel,
            "random_4k_qd1_gbps": random_read["gbps"], "random_4k_qd1_us": random_read["us"],
            "random_4k_reads": random_read["reads"], "read_paths": paths}


def read_path_costs(path: str, direct_fd: int, part_bytes: int) -> dict:
    """Requests of one expert part's bytes at random page offsets, one at a time (the file
    evicted first), by two paths: `page_cache`, as the RAM tier reads an expert it does not keep
    (readahead(2) into the page cache, MADV_POPULATE_READ through a mapping, then unmapped with
    MADV_DONTNEED and released with POSIX_FADV_DONTNEED), and `direct`, O_DIRECT into one buffer
    used again for every request. GB/s and this process's CPU time (user + system) per MB read:
    the CPU a decode token spends on its reads, on the cores its matmuls run on."""
    n_pages = -(-part_bytes // mmap.PAGESIZE)
    span = n_pages * mmap.PAGESIZE
    size = os.path.getsize(path)
    if size < 4 * span:
        raise BenchError(f"{path} is too small to measure reads of {part_bytes} bytes")
    slots = range(0, size - span, span)  # requests that share no page
    offsets = random.Random(1).sample(slots, min(READ_PATH_REQUESTS, len(slots)))
    evict(path)
    fd = os.open(path, os.O_RDONLY)
    mapping = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    buffer = mmap.mmap(-1, span)  # page-aligned, as O_DIRECT needs
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # as the tier opens the file: no readahead of its own
        half = len(offsets) // 2  # each path reads its own offsets: nothing the other left cached
        return {"request_bytes": span,
                "page_cache": _timed_reads(offsets[:half], span, lambda o: _read_mapped(fd, mapping, o, span)),
                "direct": _timed_reads(offsets[half:], span, lambda o: os.preadv(direct_fd, [buffer], o))}
    finally:
        buffer.close()
        mapping.close()
        os.close(fd)


def _read_mapped(fd: int, mapping: mmap.mmap, offset: int, span: int) -> None:
    if _libc.readahead(fd, offset, span) != 0:
        raise OSError(ctypes.get_errno(), "readahead")
    mapping.madvise(MADV_POPULATE_READ, offset, span)
    mapping.madvise(mmap.MADV_DONTNEED, offset, span)
    os.posix_fadvise(fd, offset, span, os.POSIX_FADV_DONTNEED)


def _timed_reads(offsets: list[int], span: int, read) -> dict:
    cpu, start = time.process_time(), time.perf_counter()
    for offset in offsets:
        read(offset)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    n_bytes = len(offsets) * span
    return {"requests": len(offsets), "gbps": n_bytes / seconds / 1e9, "cpu_ms_per_mb": cpu_seconds * 1e3 / (n_bytes / MB)}


def _sequential(fd: int, offsets: range, request: int, threads: int) -> float:
    """GB/s reading `offsets` in order, each thread taking the next request (queue depth = threads)."""
    next_offset = iter(offsets)
    lock = threading.Lock()
    errors = []

    def reader():
        buffer = mmap.mmap(-1, request)  # page-aligned, as O_DIRECT needs
        try:
            while True:
                with lock:
                    offset = next(next_offset, None)
                if offset is None:
                    return
                if os.preadv(fd, [buffer], offset) != request:
                    raise OSError(5, "short read")
        except OSError as e:
            errors.append(e)
        finally:
            buffer.close()

    workers = [threading.Thread(target=reader) for _ in range(threads)]
    start = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    seconds = time.perf_counter() - start
    if errors:
        raise errors[0]
    return len(offsets) * request / seconds / 1e9


def _random_reads(fd: int, pages: int, request: int) -> dict:
    """One 4 KiB read at a time at random page offsets, for RANDOM_READ_SECONDS."""
    buffer = mmap.mmap(-1, request)
    rng = random.Random(0)
    reads = 0
    start = time.perf_counter()
    try:
        while time.perf_counter() - start < RANDOM_READ_SECONDS:
            os.preadv(fd, [buffer], rng.randrange(pages - 1) * request)
            reads += 1
    finally:
        buffer.close()
    seconds = time.perf_counter() - start
    return {"gbps": reads * request / seconds / 1e9, "us": seconds / reads * 1e6, "reads": reads}


def io_bound(report: dict) -> dict | None:
    """What the disk allows the limited runs, at the run's best disk rate (`disk_rate`).
    Decode: the experts that fit in the limit beside the rest of the model and the stock run's
    anonymous memory are resident, each token reads the rest of its experts once (a hit rate
    equal to the resident share, as with uniform routing). Prompt: the run is a fresh process
    holding no expert, so its prompt reads every expert the prompt selects; no design beats the
    in-RAM stock prompt (`prompt_ceiling_tok_s`), and each limited row's prompt is set beside the
    time its own reads (median `read_bytes_prompt`) take at that bandwidth alone."""
    disk = report["disk"]
    rows = {(r["kind"], r["placement"]): r for r in report["rows"]}
    limited = rows.get(("stock", "limited"))
    if not disk or not limited or limited["anon_bytes"] is None:
        return None
    facts = report["facts"]
    gbps, gbps_from = disk_rate(report)
    room = report["limit_mb"] * MB - facts["other_bytes"] - limited["anon_bytes"]
    resident = min(max(room / facts["expert_bytes"], 0.0), 1.0)
    per_expert = facts["expert_bytes"] / (facts["moe_layers"] * facts["n_expert"])
    token_bytes = facts["moe_layers"] * facts["n_expert_used"] * per_expert
    miss_bytes = (1 - resident) * token_bytes
    prompt_reads = {}
    for kind in ("stock", "tier"):
        row = rows.get((kind, "limited"))
        ok = [r for r in row["runs"] if r["status"] == "ok"] if row else []
        if ok:
            read = statistics.median(r["read_bytes_prompt"] for r in ok)
            prompt_reads[kind] = {"bytes": read, "tok_s": ok[0]["prompt_tokens"] * gbps * 1e9 / read if read else None}
    in_ram = rows.get(("stock", "ram"))
    return {"gbps": gbps, "gbps_from": gbps_from, "resident_share": resident, "expert_bytes_per_token": token_bytes,
            "read_bytes_per_token": miss_bytes,
            "decode_tok_s": gbps * 1e9 / miss_bytes if miss_bytes else None,
            "prompt_ceiling_tok_s": in_ram["prompt_tok_s"] if in_ram else None, "prompt_reads": prompt_reads}


def best_disk_gbps(disk: dict | None) -> float | None:
    """The best rate the disk measurement reached (GB/s), None without one."""
    return max(disk["sequential_qd1_gbps"], disk["sequential_threads_gbps"]) if disk else None


def best_run_gbps(rows: list[dict]) -> tuple[float, str] | None:
    """The best rate a limited run's own disk reads reached (GB/s; its prompt's bytes over the
    prompt's time, or its decode's): the disk did at least that, so a roofline from a slower
    O_DIRECT measurement would not bound the run. With the config and phase that reached it."""
    best = None
    for row in rows:
        for run in row.get("runs", []):
            if row["placement"] != "limited" or run["status"] != "ok":
                continue
            rates = {"prompt": _share(run["read_bytes_prompt"] * run["prompt_tok_s"], run["prompt_tokens"]),
                     "decode": run["decode_read_bytes_per_token"] * run["decode_tok_s"]}
            for phase, rate in rates.items():
                if rate and (best is None or rate / 1e9 > best[0]):
                    best = (rate / 1e9, f"{row['config']}'s {phase}")
    return best


def disk_rate(report: dict) -> tuple[float | None, str]:
    """The run's best disk rate (GB/s) and what measured it: the disk measurement's, or a limited
    run's own reads' where they went faster; None without a disk measurement."""
    gbps, run_best = best_disk_gbps(report["disk"]), best_run_gbps(report["rows"])
    if gbps and run_best and run_best[0] > gbps:
        return run_best
    return gbps, "the disk measurement"


def rooflines(report: dict) -> dict:
    """Per limited tier row: the fastest its decode can be, max(the in-RAM tier row's time per
    decode token, its own disk bytes per decode token at the best disk rate of this run), and the
    share of it the row reached: {config: {"tok_s", "share", "ram_ms", "read_ms", "gbps", "gbps_from",
    "read_bytes_per_token"}}. The best disk rate: the disk measurement's, or a limited run's own
    reads' where they went faster. Empty without a disk measurement or an in-RAM tier row."""
    gbps, gbps_from = disk_rate(report)
    rows = {(r["kind"], r["placement"]): r for r in report["rows"]}
    out = {}
    for (kind, placement), row in rows.items():
        in_ram = rows.get((kind, "ram"))
        if not kind.startswith("tier") or placement != "limited" or not gbps or not in_ram:
            continue
        if not in_ram["decode_tok_s"] or row["decode_read_bytes_per_token"] is None:
            continue
        ram_ms = 1e3 / in_ram["decode_tok_s"]
        read_ms = row["decode_read_bytes_per_token"] / (gbps * 1e9) * 1e3
        tok_s = 1e3 / max(ram_ms, read_ms)
        later = row.get("decode_ms_later")
        out[row["config"]] = {"tok_s": tok_s, "share": _share(row["decode_tok_s"], tok_s),
                              "later_share": _share(1e3 / later, tok_s) if later else None, "ram_ms": ram_ms,
                              "read_ms": read_ms, "gbps": gbps, "gbps_from": gbps_from,
                              "read_bytes_per_token": row["decode_read_bytes_per_token"]}
    return out


def _roofline_lines(report: dict) -> list[str]:
    return [f"Roofline of {config}: max(in-RAM tier {r['ram_ms']:.1f} ms, {r['read_bytes_per_token'] / MB:.1f} MB "
            f"read per token at {r['gbps']:.2f} GB/s {r['read_ms']:.1f} ms) per token = {r['tok_s']:.1f} tok/s "
            f"(the best disk rate of this run: {r['gbps_from']}); "
            f"the decode reached {_fmt(r['share'], '.0%')} of it"
            + ("" if r.get("later_share") is None else
               f" (its tokens after each request's first {FIRST_TOKENS}: {_fmt(r['later_share'], '.0%')})")
            for config, r in report.get("roofline", {}).items()]


def _host() -> dict:
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown CPU")
    except OSError:
        cpu = "unknown CPU"
    return {"cpu": cpu, "cpus": os.cpu_count(), "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")}


# --- reporting ---------------------------------------------------------------------------------

def _fmt(value, spec, scale=1.0, missing="-"):
    return missing if value is None else format(value / scale, spec)


def markdown(report: dict) -> str:
    facts = report["facts"]
    lines = [
        f"Model `{report['model']}`: {facts['file_bytes'] / 1e9:.2f} GB, of it {facts['expert_bytes'] / 1e9:.2f} GB "
        f"routed experts ({facts['moe_layers']} MoE layers x {facts['n_expert']} experts, top-{facts['n_expert_used']}); "
        f"host: {report['host']['cpu']}, {report['host']['cpus']} CPUs, {report['host']['ram_bytes'] / 2**30:.0f} GiB RAM",
        f"Command: `{report['command']}`",
    ]
    if report["rows"]:
        cgroup = report["cgroup"]
        prompt_tokens = next((r["runs"][0].get("prompt_tokens") for r in report["rows"] if r["ok_runs"]), None)
        requests = next((r["requests"] for r in report["rows"] if r.get("requests")), None)
        asked = (f"{len(requests)} requests a run, one after the other in its process (prompts of "
                 f"{', '.join(format(q['prompt_tokens'], '.0f') for q in requests)} tokens), {report['n_predict']} greedy "
                 "decode tokens each" if requests and len(requests) > 1 else
                 f"{prompt_tokens} prompt tokens, {report['n_predict']} greedy decode tokens per run")
        limited = (f"Limited runs: memory cgroup v{cgroup['version']} ({cgroup['limit_file']} = {report['limit_mb']} MB, "
                   f"the model {facts['file_bytes'] / (report['limit_mb'] * MB):.2f}x the limit), the file evicted "
                   "from the page cache before each" if cgroup else "No limited runs")
        lines += [
            f"Stock llama-cpp-python, mmap, no repacking, CPU only, threads {report['threads'] or 'default'}, "
            f"n_ctx {report['ctx_size']}.",
            f"{limited}; {asked}, each run a fresh process; median [min, max] of {report['repetitions']} runs "
            "per configuration, interleaved (every other round the in-RAM runs in the reverse order)",
            "",
            "| config | decode tok/s | prompt tok/s | file cached at start | peak cgroup MB | page cache MB "
            "| peak RSS MB | anon MB | disk reads MB/token | greedy tokens | load average |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
        ]
        lines += [_table_row(r) for r in report["rows"]]
        lines += [""] + _reads_lines(report["rows"]) + _requests_lines(report["rows"])
        for placement, ratio in report.get("paired", {}).items():
            decode, prompt = ratio["decode_tok_s"], ratio["prompt_tok_s"]
            where = {"ram": "Tier over stock in RAM", "limited": f"Tier over stock at {report['limit_mb']} MB",
                     "read_ahead": f"Read-ahead on over off at {report['limit_mb']} MB"}[placement]
            lines.append(f"{where}, run by run (each round's pair), median [min, max] of "
                         f"{ratio['rounds']}: decode {decode[0]:.3f}x [{decode[1]:.3f}, {decode[2]:.3f}], "
                         f"prompt {prompt[0]:.3f}x [{prompt[1]:.3f}, {prompt[2]:.3f}]")
    disk = report["disk"]
    if disk:
        lines.append(f"Disk (O_DIRECT reads of the model file, {disk['bytes_per_measurement'] / MIB:.0f} MiB each "
                     f"sequential measurement): sequential 2 MiB requests {disk['sequential_qd1_gbps']:.2f} GB/s at "
                     f"queue depth 1, {disk['sequential_threads_gbps']:.2f} GB/s with {disk['threads']} threads; "
                     f"4 KiB random reads at queue depth 1 {disk['random_4k_qd1_gbps']:.3f} GB/s "
                     f"({disk['random_4k_qd1_us']:.0f} us each)")
        paths = disk["read_paths"]
        lines.append(f"Reads of {paths['request_bytes'] / MB:.2f} MB (one expert's largest tensor) at random offsets, one at a time: "
                     f"through the page cache and a mapping, as the tier reads, {paths['page_cache']['gbps']:.2f} GB/s, "
                     f"{paths['page_cache']['cpu_ms_per_mb']:.3f} ms of CPU per MB; O_DIRECT into one buffer used again, "
                     f"{paths['direct']['gbps']:.2f} GB/s, {paths['direct']['cpu_ms_per_mb']:.3f} ms of CPU per MB")
    lines += _roofline_lines(report)
    if report["bound"]:
        lines += _bound_lines(report)
    lines += [f"Note: {note}" for note in report["notes"]]
    return "\n".join(lines)


def _reads_lines(rows: list[dict]) -> list[str]:
    """The limited tier rows' reads, from their stats (medians)."""
    out = []
    for r in rows:
        if r["kind"] == "stock" or r["placement"] != "limited" or r.get("read_bytes_per_token") is None:
            continue
        precision = r.get("read_ahead_precision")
        out.append(f"Reads of {r['config']}, per decode token (the tier's stats): {r['read_bytes_per_token'] / MB:.1f} MB "
                   f"read, of it {(r.get('wasted_bytes_per_token') or 0) / MB:.1f} MB read ahead and not selected; "
                   f"the layers waited {r.get('wait_ms_per_token') or 0:.1f} ms for their reads; "
                   f"{'no read-ahead' if precision is None else f'{precision:.0%} of the experts read ahead selected'}; "
                   f"at the end, {(r.get('file_huge_bytes') or 0) / MB:.0f} MB of the model mapped in huge pages")
        if r.get("decode_ms_per_read_mb") is not None:
            out.append(f"Decode of {r['config']}, token by token (least squares, median of the runs): "
                       f"{r['decode_ms_per_read_mb']:.2f} ms per MB read, {r['decode_ms_at_no_read']:.1f} ms at no read"
                       + ("" if r.get("decode_ms_first") is None or r.get("decode_ms_later") is None else
                          f"; each request's first {FIRST_TOKENS} tokens {r['decode_ms_first']:.1f} ms each, "
                          f"the others {r['decode_ms_later']:.1f} ms"))
    return out


def _requests_lines(rows: list[dict]) -> list[str]:
    """Each row's requests one by one (medians of the runs), where a run made several, and how often
    a limited run's cgroup hit its limit (the most of the runs)."""
    out = []
    for r in rows:
        if not r.get("requests") or len(r["requests"]) < 2:
            continue
        per_request = ", ".join(f"{q['decode_tok_s']:.2f}" for q in r["requests"])
        prompts = ", ".join(f"{q['prompt_tok_s']:.2f}" for q in r["requests"])
        hits = "" if r.get("limit_hits") is None else f"; the cgroup hit its limit {r['limit_hits']} times"
        out.append(f"Requests of {r['config']}, one by one: decode {per_request} tok/s, prompt {prompts} tok/s{hits}")
    return out


def _table_row(r: dict) -> str:
    """One configuration's row of the runs' table."""
    failed = f" ({len(r['runs']) - r['ok_runs']} failed: {'; '.join(r['failures'])})" if r["failures"] else ""
    if not r["ok_runs"]:
        return f"| {r['config']}{failed} | - | - | | | | | | | | |"
    speeds = [f"{r[k]:.2f} [{r[k + '_range'][0]:.2f}, {r[k + '_range'][1]:.2f}]"
              for k in ("decode_tok_s", "prompt_tok_s")]
    tokens = "reference" if r["kind"] == "stock" and r["placement"] == "ram" else \
        {True: "identical", False: "DIFFER", None: "-"}[r["tokens_match"]]
    peak = _fmt(r["peak_bytes"], ".0f", MB)
    if r["peak_within_limit"] is False:
        peak += " (over the limit)"
    return (f"| {r['config']}{failed} | {speeds[0]} | {speeds[1]} | {_fmt(r['cached_at_start'], '.0%')} "
            f"| {peak} | {_fmt(r['page_cache_bytes'], '.0f', MB)} | {_fmt(r['peak_rss_bytes'], '.0f', MB)} "
            f"| {_fmt(r['anon_bytes'], '.0f', MB)} | {_fmt(r['decode_read_bytes_per_token'], '.0f', MB)} | {tokens} "
            f"| {_fmt(r['load_average'], '.1f')} |")


def _bound_lines(report: dict) -> list[str]:
    """The limited run's I/O bound: its decode's, and its prompts' beside stock's."""
    bound = report["bound"]
    stock = next(r for r in report["rows"] if r["kind"] == "stock" and r["placement"] == "limited")
    decode = (
        f"Uniform-routing estimate of the {report['limit_mb']} MB run's decode (not a bound: a policy beats "
        f"it where routing is local): {bound['resident_share']:.0%} of the experts fit "
        f"beside the rest of the model and the run's anonymous memory; each token's experts are "
        f"{bound['expert_bytes_per_token'] / MB:.0f} MB, the non-resident share of them "
        f"{bound['read_bytes_per_token'] / MB:.0f} MB, read once at {bound['gbps']:.2f} GB/s (the best disk rate "
        f"of this run: {bound['gbps_from']}): "
        f"{_fmt(bound['decode_tok_s'], '.1f')} tok/s; stock reaches "
        f"{_fmt(_share(stock['decode_tok_s'], bound['decode_tok_s']), '.0%')} of it. Stock read "
        f"{_fmt(stock['decode_read_bytes_per_token'], '.0f', MB)} MB per decode token: at {bound['gbps']:.2f} GB/s "
        f"alone {_fmt(_share(bound['gbps'] * 1e9, stock['decode_read_bytes_per_token']), '.2f')} tok/s")
    rows = {r["kind"]: r for r in report["rows"] if r["placement"] == "limited"}
    reads = "; ".join(
        f"{kind} read {read['bytes'] / 1e9:.2f} GB in its prompt, at {bound['gbps']:.2f} GB/s alone "
        f"{_fmt(read['tok_s'], '.1f')} tok/s, and ran at {_fmt(_share(rows[kind]['prompt_tok_s'], read['tok_s']), '.0%')} "
        f"of that" for kind, read in bound["prompt_reads"].items())
    ceiling = bound["prompt_ceiling_tok_s"]
    prompts = (
        f"The {report['limit_mb']} MB runs' prompts (a fresh process: every expert the prompt selects is read): "
        f"{reads}. No design's limited prompt beats stock's in RAM ({_fmt(ceiling, '.2f')} tok/s, "
        f"{_fmt(_share(ceiling, stock['prompt_tok_s']), '.2f')}x the limited stock's)")
    return [decode, prompts]


def _share(value, of):
    return value / of if value is not None and of else None


if __name__ == "__main__":
    sys.exit(child(sys.argv[2]) if sys.argv[1:2] == [CHILD] else main())
