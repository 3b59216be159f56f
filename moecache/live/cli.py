"""run.py: generate text with the expert cache on a MoE model, llama.cpp-style flags.

Experts stay in host memory, everything else goes to the device: the GPU when ggml has one,
else a loopback RPC device (a CPU backend in a subprocess, which exercises the real device path
but is no faster). Prints the text, the decode speed and the cache's hit rate."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from ..util import OneLineParser, gbps_arg, int_arg

GGML_MAX_N_THREADS = 512  # ggml.h: more threads overrun ggml's per-thread arrays (a segfault)


def parse_args(argv=None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    if args.no_chat and not args.prompt:
        p.error("argument -p/--prompt: empty, and --no-chat has no template: nothing to continue from")
    if args.slots is not None and args.cache_mib is not None:
        p.error("--slots and --cache-mib both size the cache: give one")
    return args


def parser() -> OneLineParser:
    """run.py's flags (docs/reference.md tabulates them, and tests/test_docs.py holds the table to them)."""
    p = OneLineParser(prog="run.py", description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", help="GGUF path (default: smol-moe, built on first use)")
    p.add_argument("-p", "--prompt", default="Explain how a mixture-of-experts model decides which experts handle each token.")
    p.add_argument("-n", "--n-predict", type=int_arg(minimum=1), default=128, help="tokens to generate (default 128)")
    p.add_argument("-ngl", "--n-gpu-layers", type=int_arg(), default=-1, help="layers on the device (default -1: all)")
    p.add_argument("-c", "--ctx-size", type=int_arg(minimum=1), default=2048)
    p.add_argument("-t", "--threads", type=int_arg(minimum=1, maximum=GGML_MAX_N_THREADS), default=None)
    p.add_argument("--seed", type=int_arg(minimum=0), default=0)
    p.add_argument("--slots", type=int_arg(minimum=0), default=None,
                   help="experts cached per layer (default LLAMA_MOE_CACHE_SLOTS or _MIB, else a quarter of the experts; 0 = off)")
    p.add_argument("--cache-mib", type=_mib_arg, default=None, metavar="N|auto",
                   help="size the cache by device memory instead: N MiB over all devices, or auto (their free "
                        "memory less LLAMA_MOE_CACHE_RESERVE_MIB)")
    p.add_argument("--ram-mib", type=_mib_arg, default=None, metavar="N|auto",
                   help="the RAM tier: keep N MiB of experts in memory, read the others from the model file "
                        "(for models larger than RAM); with --slots or --cache-mib it serves the device cache's "
                        "CPU half")
    p.add_argument("--inserts", type=int_arg(minimum=1), default=None, help="uploads per layer per step (default 2)")
    p.add_argument("--policy", default=None, help="cache policy (default: the shipped default)")
    p.add_argument("--planner", type=int_arg(minimum=0, maximum=1), default=None, metavar="0|1",
                   help="the miss planner: some misses through the copy-on-miss lane, an eager upload only "
                        "when it pays back its link time (LLAMA_MOE_CACHE_PLANNER; default: on wherever "
                        "it can run; 0: off)")
    p.add_argument("--link-gbps", type=gbps_arg, default=None,
                   help="the planner's host-to-device rate, GB/s (default: measured at attach)")
    p.add_argument("--host-gbps", type=gbps_arg, default=None,
                   help="the planner's host memory read rate, GB/s (default: measured at attach)")
    p.add_argument("--no-chat", action="store_true", help="raw completion instead of the chat template")
    return p


def _mib_arg(text: str):
    if text == "auto":
        return text
    try:
        return int_arg(minimum=0)(text)
    except argparse.ArgumentTypeError as e:
        if "not an integer" in str(e):
            raise argparse.ArgumentTypeError(f"{text!r} is neither a number of MiB nor auto") from None
        raise


_mib_arg.__name__ = "MiB or auto"


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return _run(args)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"run.py: error: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    from .config import CacheConfig

    # validate the cache settings before anything slow happens; the flags' sizes replace the variables'
    given = {"mib": args.cache_mib, "slots": args.slots, "ram_mib": args.ram_mib}
    sizing = {} if all(size is None for size in given.values()) else \
        {name: 0 if size is None else size for name, size in given.items()}
    config = CacheConfig.from_env(inserts=args.inserts, policy=args.policy, planner=args.planner,
                                  link_gbps=args.link_gbps, host_gbps=args.host_gbps, **sizing)
    model = _model_file(args.model)
    if config.ram_mib == "auto" and not config.device_cache:  # the weights load into this memory:
        from .ramtier import N_UBATCH, check_room                # the kernel would kill a load too large

        check_room(model, _n_ctx(args), N_UBATCH)
    if config.ram_tier:
        rest = "" if config.device_cache else ", the rest in memory"
        print(f"run.py: RAM tier: experts read from the model file as selected{rest}", file=sys.stderr)
    if config.device_cache or not config.ram_tier:
        print(f"run.py: experts in host memory, the rest on the {_device()}", file=sys.stderr)
    llm = load_model(model, args, config)
    n_expert = int(next((v for k, v in llm.metadata.items() if k.endswith(".expert_count")), 0))
    if n_expert == 0:
        raise ValueError(f"{model} is not a MoE model (no expert_count)")
    if not sizing and not config.enabled:  # no size given: a quarter of the experts
        config = dataclasses.replace(config, slots=max(1, n_expert // 4))
    cache = _attach_or_stock(llm, config) if config.enabled else None
    for tier in (cache, cache.below) if cache else ():
        for line in tier.lines() if tier else ():
            print(line, file=sys.stderr)

    try:
        n_tokens, decode = generate(llm, args)
    except RuntimeError as e:  # "llama_decode returned -3": the cache may know why
        why = cache.why_stopped() if cache else None
        raise RuntimeError(f"{e}: {why}" if why else e) from None
    print(f"run.py: {n_tokens} tokens decoded, decode {decode}", file=sys.stderr)
    if cache:
        print(cache.summary(), file=sys.stderr)
    elif not config.enabled:
        print("run.py: expert cache off (--slots 0 or --cache-mib 0)", file=sys.stderr)
    return 0


def _model_file(path: str | None) -> str:
    from ..models import smol_moe

    if path is None:
        return str(smol_moe())
    if not os.path.isfile(path):
        raise ValueError(f"model file not found: {path}")
    return path


def _device() -> str:
    """The device the model goes to: the GPU, else a loopback RPC device started here."""
    from . import ggml

    if ggml.has_gpu():
        return "GPU"
    from .rpc import RpcDevice

    rpc = RpcDevice()  # serves until this process exits
    return f"loopback RPC device {rpc.endpoint} (no GPU found: a CPU backend, exact but not faster)"


def load_model(model: str, args, config):
    """The model as run.py runs it: its experts where the cache reads them (the model file for
    the RAM tier, else host buffers, repacked or plain)."""
    import llama_cpp

    from .placement import experts_from_file, experts_on_host
    from .ramtier import N_UBATCH, whole_model_loading

    with experts_from_file(**whole_model_loading(config)) if config.ram_tier else \
            experts_on_host(repack=bool(config.repack)):
        return llama_cpp.Llama(model, n_gpu_layers=args.n_gpu_layers, n_ctx=_n_ctx(args), n_ubatch=N_UBATCH,
                               seed=args.seed, n_threads=args.threads, verbose=False)


def _n_ctx(args) -> int:
    """llama.cpp pads the context to a multiple of 256 while llama_cpp sizes its token buffer by
    the request: ask for the padded size, or a prompt longer than -c breaks that buffer."""
    return -(-args.ctx_size // 256) * 256


def generate(llm, args) -> tuple[int, str]:
    """Print the answer as it comes; the tokens decoded and the decode speed, by llama.cpp's own
    count and time of its single-token evaluations (as llama.cpp's "eval time"): the streamed
    text pieces are not tokens, a piece may wait for the next token's bytes (a model whose tokens
    are not whole UTF-8 characters streams them in bursts)."""
    import llama_cpp

    before = llama_cpp.llama_perf_context(llm.ctx)
    if args.no_chat:
        stream = llm.create_completion(args.prompt, max_tokens=args.n_predict, temperature=0.0, stream=True)
        pieces = (chunk["choices"][0]["text"] for chunk in stream)
    else:
        stream = llm.create_chat_completion([{"role": "user", "content": args.prompt}],
                                            max_tokens=args.n_predict, temperature=0.0, stream=True)
        pieces = (chunk["choices"][0]["delta"].get("content", "") for chunk in stream)
    try:
        for piece in pieces:
            print(piece, end="", flush=True)
    except ValueError as e:  # llama_cpp: "Requested tokens (N) exceed context window of M"
        if "context window" not in str(e):
            raise
        raise ValueError(f"argument -c/--ctx-size: {args.ctx_size} is too small for the prompt ({e})") from None
    print()
    after = llama_cpp.llama_perf_context(llm.ctx)
    n_tokens, ms = after.n_eval - before.n_eval, after.t_eval_ms - before.t_eval_ms
    return n_tokens, f"{n_tokens / ms * 1e3:.1f} tok/s" if n_tokens > 0 and ms > 0 else "n/a"


def _attach_or_stock(llm, config):
    """The cache, or None after one warning line when libllama cannot cache this model (e.g. an
    unsupported architecture): decoding then runs the stock graph. libllama says why in its
    log, which llama_cpp prints only when verbose: that line is the warning."""
    import contextlib
    import io
    import logging

    from .activate import attach
    from .probe import CacheUnavailable

    llama_log = logging.getLogger("llama-cpp-python")  # llama_cpp prints libllama's log to sys.stderr
    level, captured = llama_log.level, io.StringIO()
    llama_log.setLevel(logging.WARNING)
    try:
        with contextlib.redirect_stderr(captured):
            return attach(llm, config=config)
    except CacheUnavailable as e:
        why = [line.strip() for line in captured.getvalue().splitlines() if "expert cache disabled" in line]
        print(f"run.py: warning: no expert cache: {why[-1] if why else e}; decoding runs the stock graph",
              file=sys.stderr)
        return None
    finally:
        llama_log.setLevel(level)
