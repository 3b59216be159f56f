#!/usr/bin/env python3
"""Exactness of the expert cache: greedy decoding with the cache must give the tokens of the
same placement without it (experts in host memory, the rest on the device).

    python scripts/check_exact.py -m MODEL [-n 128] [--slots 16] [-t THREADS] [--json FILE]

Prints whether the tokens are identical, the largest |logit difference| up to the first differing
token (0 when the cached experts run the same kernels as the host, as on the loopback RPC device;
a GPU's kernels round differently) and the stock run's smallest margin between its best and
second-best logit: tokens can only differ by rounding where a margin is below the difference.
Exit status 0 when the tokens match, 1 when they do not, 2 on bad input.

Like every script here it imports the installed moecache package (scripts/bootstrap.sh installs
it, editable, with the patched llama-cpp-python).
"""

from __future__ import annotations

import gc
import os
import sys

from moecache.util import OneLineParser, int_arg, write_json

PROMPT = b"Explain how a mixture-of-experts model decides which experts handle each token."


def main(argv=None) -> int:
    p = OneLineParser(prog="check_exact.py", description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True)
    p.add_argument("-n", "--n-predict", type=int_arg(minimum=1), default=128)
    p.add_argument("--slots", type=int_arg(minimum=1), default=16, help="cache slots per layer (default 16)")
    p.add_argument("-t", "--threads", type=int_arg(minimum=1), default=None)
    p.add_argument("--json", metavar="FILE")
    return p.run(_check, argv)


def _check(args) -> int:
    if not os.path.isfile(args.model):
        raise ValueError(f"model file not found: {args.model}")

    os.environ.pop("LLAMA_MOE_CACHE_SLOTS", None)  # the stock run must not get a cache
    import llama_cpp
    import numpy as np

    from moecache.live import ggml
    from moecache.live.activate import attach
    from moecache.live.decode import greedy
    from moecache.live.placement import experts_on_host

    if not ggml.has_gpu():
        from moecache.live.rpc import RpcDevice

        rpc = RpcDevice(threads=args.threads)  # noqa: F841  (serves until this process exits)

    def load():
        with experts_on_host():
            return llama_cpp.Llama(args.model, n_gpu_layers=-1, n_ctx=512 + args.n_predict,
                                   n_threads=args.threads, n_threads_batch=args.threads, verbose=False)

    llm = load()
    stock = greedy(llm, PROMPT, args.n_predict, keep_logits=True)
    llm.close()
    del llm
    gc.collect()

    llm = load()
    cache = attach(llm, slots=args.slots, policy="lru")
    cached = greedy(llm, PROMPT, args.n_predict, keep_logits=True)
    stats = cache.stats()
    first_difference = next((i for i, (a, b) in enumerate(zip(cached.tokens, stock.tokens)) if a != b), None)
    # the rows each token was picked from, up to the first differing token
    compared = slice(0, args.n_predict if first_difference is None else first_difference + 1)
    top2 = np.sort(stock.logits[:args.n_predict], axis=1)[:, -2:]
    result = {
        "model": os.path.abspath(args.model), "n_predict": args.n_predict, "slots": args.slots,
        "cache_device": cache.layers[0].device, "tokens_identical": cached.tokens == stock.tokens,
        "first_difference": first_difference,
        "max_abs_logit_diff": float(abs(cached.logits[compared] - stock.logits[compared]).max()),
        "min_top2_margin": float((top2[:, 1] - top2[:, 0]).min()),
        "hit_rate": stats["hit_rate"], "uploads": stats["totals"]["uploads"],
    }
    print(f"check_exact: {args.n_predict} greedy tokens, cache K={args.slots} on {result['cache_device']}: "
          f"tokens {'identical' if result['tokens_identical'] else 'DIFFER at %d' % result['first_difference']}, "
          f"max |logit difference| {result['max_abs_logit_diff']:.3g} (smallest stock top-2 margin "
          f"{result['min_top2_margin']:.3g}), "
          f"hit rate {100 * (stats['hit_rate'] or 0):.1f}%, {result['uploads']} uploads")
    if args.json:
        write_json(args.json, result)
    return 0 if result["tokens_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
