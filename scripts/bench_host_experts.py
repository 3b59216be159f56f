"""The host expert work of one MoE layer, cache on vs stock, through ggml's CPU backend.

    python scripts/bench_host_experts.py [--experts 128 --top-k 8 --embd 2048 --ff 768
                                          --tokens 1 --cached 0,4 --runs 7 --reps 20 --threads 2]

One MUL_MAT_ID over a Q4_0 expert tensor [embd, ff, experts] (the up projection of a
Qwen3-30B-A3B layer by default), held in llama.cpp's CPU repack buffer as stock --cpu-moe loads
it, evaluated on ggml's CPU backend in a graph of its own, so nothing else is timed:

  stock   ggml_mul_mat_id over the experts the cache missed (top-k minus the cached ones)
  cache   ggml_mul_mat_id_skip over all top-k experts, the cached ones marked in the skip table
          (their rows are written as zeros, not computed): the host half of the split graph

Both compute the same expert rows ("equal misses"); before timing, the script checks that they
do: the cache graph's rows of the missed experts equal stock's bit for bit and its cached rows
are zero (exit status 1 otherwise). Each run times --reps evaluations of each,
interleaved; the table gives the median over --runs runs of the per-evaluation time and of the
ratio cache / stock. The activations are random, the weights random Q4_0 blocks; the observer
(which the live cache hangs on the up projection to record the selected ids) is left out: it
copies top-k ids per token.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np

from moecache.live import ggml
from moecache.util import OneLineParser, int_arg, int_list_arg

GGML_TYPE_F32, GGML_TYPE_Q4_0, GGML_TYPE_I32 = 0, 2, 26
Q4_0_BLOCK, Q4_0_BLOCK_BYTES = 32, 18


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


def _api():
    """The ggml functions used here, typed."""
    base, cpu = ggml.libggml_base(), ggml.libggml_cpu()
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for lib, name, restype, argtypes in [
        (base, "ggml_tensor_overhead", ctypes.c_size_t, []),
        (base, "ggml_graph_overhead", ctypes.c_size_t, []),
        (base, "ggml_init", p, [_InitParams]),
        (base, "ggml_free", None, [p]),
        (base, "ggml_new_tensor_1d", p, [p, ctypes.c_int, i64]),
        (base, "ggml_new_tensor_2d", p, [p, ctypes.c_int, i64, i64]),
        (base, "ggml_new_tensor_3d", p, [p, ctypes.c_int, i64, i64, i64]),
        (base, "ggml_mul_mat_id", p, [p, p, p, p]),
        (base, "ggml_mul_mat_id_skip", p, [p, p, p, p, p, p, p]),
        (base, "ggml_new_graph", p, [p]),
        (base, "ggml_build_forward_expand", None, [p, p]),
        (base, "ggml_backend_alloc_ctx_tensors_from_buft", p, [p, p]),
        (base, "ggml_backend_buffer_free", None, [p]),
        (base, "ggml_backend_tensor_set", None, [p, p, ctypes.c_size_t, ctypes.c_size_t]),
        (base, "ggml_backend_tensor_get", None, [p, p, ctypes.c_size_t, ctypes.c_size_t]),
        (base, "ggml_backend_graph_compute", ctypes.c_int, [p, p]),
        (base, "ggml_backend_free", None, [p]),
        (base, "ggml_backend_buft_name", ctypes.c_char_p, [p]),
        (base, "ggml_backend_dev_backend_reg", p, [p]),
        (base, "ggml_backend_reg_get_proc_address", p, [p, ctypes.c_char_p]),
        (cpu, "ggml_backend_cpu_init", p, []),
        (cpu, "ggml_backend_cpu_set_n_threads", None, [p, ctypes.c_int]),
    ]:
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return base, cpu


def repack_buffer_type(base) -> int:
    """The CPU backend's CPU_REPACK buffer type (what --cpu-moe loads Q4_0 experts into)."""
    dev = ggml.cpu_device()
    get_extra = base.ggml_backend_reg_get_proc_address(base.ggml_backend_dev_backend_reg(dev),
                                                       b"ggml_backend_dev_get_extra_bufts")
    if not get_extra:
        raise RuntimeError("ggml's CPU backend has no extra buffer types")
    bufts = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(get_extra)(dev)
    i = 0
    while bufts[i]:
        if base.ggml_backend_buft_name(bufts[i]) == b"CPU_REPACK":
            return bufts[i]
        i += 1
    raise RuntimeError("this CPU gets no CPU_REPACK buffer type from ggml (Q4_0 is repacked on AVX2 and ARM)")


def random_q4_0(rng, n_rows: int, n_in: int) -> np.ndarray:
    blocks = np.empty((n_rows * n_in // Q4_0_BLOCK, Q4_0_BLOCK_BYTES), dtype=np.uint8)
    blocks[:, :2] = np.frombuffer(np.float16(0.05).tobytes(), dtype=np.uint8)
    blocks[:, 2:] = rng.integers(0, 256, size=(blocks.shape[0], 16), dtype=np.uint8)
    return blocks


def measure(args) -> list[dict]:
    base, cpu = _api()
    rng = np.random.default_rng(0)
    E, k, D, F, T = args.experts, args.top_k, args.embd, args.ff, args.tokens
    backend = cpu.ggml_backend_cpu_init()
    cpu.ggml_backend_cpu_set_n_threads(backend, args.threads)

    n_nodes = 16 + 8 * len(args.cached)
    weights_ctx = base.ggml_init(_InitParams(base.ggml_tensor_overhead() * 2, None, True))
    experts = base.ggml_new_tensor_3d(weights_ctx, GGML_TYPE_Q4_0, D, F, E)
    weights_buf = base.ggml_backend_alloc_ctx_tensors_from_buft(weights_ctx, repack_buffer_type(base))
    data = random_q4_0(rng, E * F, D)
    base.ggml_backend_tensor_set(experts, data.ctypes.data, 0, data.nbytes)  # repacked here

    ctx = base.ggml_init(_InitParams(base.ggml_tensor_overhead() * n_nodes + base.ggml_graph_overhead() * 2 * len(args.cached), None, True))
    x = base.ggml_new_tensor_3d(ctx, GGML_TYPE_F32, D, 1, T)
    ids = base.ggml_new_tensor_2d(ctx, GGML_TYPE_I32, k, T)
    skip = base.ggml_new_tensor_1d(ctx, GGML_TYPE_I32, E)
    cases = []
    for cached in args.cached:
        missed = base.ggml_new_tensor_2d(ctx, GGML_TYPE_I32, k - cached, T)
        cases.append((cached, missed, *_graphs(base, ctx, experts, x, missed, ids, skip)))
    buf = base.ggml_backend_alloc_ctx_tensors_from_buft(ctx, ggml.cpu_buffer_type())

    def set_tensor(tensor, array):
        array = np.ascontiguousarray(array)
        base.ggml_backend_tensor_set(tensor, array.ctypes.data, 0, array.nbytes)

    set_tensor(x, rng.standard_normal((T, D), dtype=np.float32))
    rows = []
    for cached, missed, stock, split, stock_out, split_out in cases:
        # every token selects the same `cached` experts, which the cache holds (skipped by the
        # split graph, absent from stock's ids), and k - cached others
        pool = rng.permutation(E)
        selected = np.stack([np.concatenate([pool[:cached], rng.choice(pool[cached:], k - cached, replace=False)])
                             for _ in range(T)]).astype(np.int32)
        table = np.zeros(E, dtype=np.int32)
        table[pool[:cached]] = 1
        set_tensor(ids, selected)
        set_tensor(skip, table)
        set_tensor(missed, selected[:, cached:])
        for graph in (stock, split):
            _compute(base, backend, graph)
        got = np.empty((T, k, F), dtype=np.float32)
        want = np.empty((T, k - cached, F), dtype=np.float32)
        base.ggml_backend_tensor_get(split_out, got.ctypes.data, 0, got.nbytes)
        base.ggml_backend_tensor_get(stock_out, want.ctypes.data, 0, want.nbytes)
        if not (np.array_equal(got[:, cached:], want) and not got[:, :cached].any()):
            raise RuntimeError(f"with {cached} cached: the skip graph's rows are not stock's missed rows and zeros")
        stock_t, cache_t = _times(base, backend, (stock, split), args.runs, args.reps)
        rows.append({"cached": cached, "stock_us": 1e6 * np.median(stock_t), "cache_us": 1e6 * np.median(cache_t),
                     "ratio": float(np.median(cache_t / stock_t))})
    base.ggml_backend_buffer_free(buf)
    base.ggml_backend_buffer_free(weights_buf)
    base.ggml_free(ctx)
    base.ggml_free(weights_ctx)
    base.ggml_backend_free(backend)
    return rows


def _graphs(base, ctx, experts, x, missed, ids, skip):
    """(the stock graph, the split graph, their outputs): stock computes the missed ids, the split
    graph all ids but the cached ones (skip)."""
    stock_out = base.ggml_mul_mat_id(ctx, experts, x, missed)            # [ff, k - cached, T]
    split_out = base.ggml_mul_mat_id_skip(ctx, experts, x, ids, skip, None, None)  # [ff, k, T]
    stock, split = base.ggml_new_graph(ctx), base.ggml_new_graph(ctx)
    base.ggml_build_forward_expand(stock, stock_out)
    base.ggml_build_forward_expand(split, split_out)
    return stock, split, stock_out, split_out


def _compute(base, backend, graph) -> None:
    if base.ggml_backend_graph_compute(backend, graph) != 0:
        raise RuntimeError("ggml_backend_graph_compute failed")


def _times(base, backend, graphs, runs: int, reps: int) -> list[np.ndarray]:
    """Each graph's seconds per compute in each of `runs` runs of `reps` computes, the graphs
    taking turns, after a run that warms up."""
    times = [[] for _ in graphs]
    for run in range(runs + 1):
        for graph, seconds in zip(graphs, times):
            start = time.perf_counter()
            for _ in range(reps):
                _compute(base, backend, graph)
            if run:
                seconds.append((time.perf_counter() - start) / reps)
    return [np.array(seconds) for seconds in times]


def main(argv=None) -> int:
    p = OneLineParser(prog="bench_host_experts.py", description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int_arg(minimum=2, maximum=1024), default=128)
    p.add_argument("--top-k", type=int_arg(minimum=1, maximum=64), default=8)
    p.add_argument("--embd", type=int_arg(minimum=32, maximum=16384), default=2048)
    p.add_argument("--ff", type=int_arg(minimum=8, maximum=65536), default=768)
    p.add_argument("--tokens", type=int_arg(minimum=1, maximum=512), default=1)
    p.add_argument("--cached", type=int_list_arg(minimum=0), default=[0, 4],
                   help="experts of each token's top-k in the cache (comma separated)")
    p.add_argument("--runs", type=int_arg(minimum=1), default=7)
    p.add_argument("--reps", type=int_arg(minimum=1), default=20)
    p.add_argument("--threads", type=int_arg(minimum=1, maximum=256), default=2)

    def run(args):
        if args.embd % Q4_0_BLOCK or args.ff % 8:
            raise ValueError(f"--embd must be a multiple of {Q4_0_BLOCK} and --ff of 8 (Q4_0, repacked 8 rows at a time)")
        if max(args.cached) >= args.top_k or args.top_k > args.experts:
            raise ValueError("--cached must be below --top-k, and --top-k at most --experts")
        rows = measure(args)
        print(f"MUL_MAT_ID of a Q4_0 [{args.embd}, {args.ff}, {args.experts}] tensor in CPU_REPACK, top-{args.top_k}, "
              f"{args.tokens} token(s), {args.threads} threads; median of {args.runs} runs x {args.reps} evaluations")
        print("| cached of top-k | stock us | cache us | cache / stock |")
        print("|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['cached']} | {r['stock_us']:.1f} | {r['cache_us']:.1f} | {r['ratio']:.3f} |")

    return p.run(run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
