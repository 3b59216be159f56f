#!/usr/bin/env python3
"""Exactness of the expert cache: greedy decoding with the cache must give the tokens of the
same placement without it (experts in host memory, the rest on the device).

    python scripts/check_exact.py -m MODEL [-n 128] [--slots 16] [-t THREADS] [--json FILE]

Prints whether the tokens are identical, the largest |logit difference| up to the first differing
token (0 when the cached experts run the same kernels as the host, as on the loopback RPC device;
a GPU's kernels round differently) and the stock run's smallest margin between its best and
second-best logit: tokens can only differ by rounding where a margin is below the difference.
Exit status 0 when the tokens match, 1 when they do not, 2 on bad input.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

PROMPT = b"Explain how a mixture-of-experts model decides which experts handle each token."


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        print(f"check_exact.py: error: {message}", file=sys.stderr)
        sys.exit(2)


def _greedy(llm, n):
    """n greedy tokens after PROMPT, and the logits each was picked from."""
    import llama_cpp
    import numpy as np

    n_vocab = llm.n_vocab()
    llm.reset()
    llm.eval(llm.tokenize(PROMPT))
    tokens, rows = [], []
    for _ in range(n):
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(n_vocab,)).copy()
        tokens.append(int(np.argmax(logits)))
        rows.append(logits)
        llm.eval([tokens[-1]])
    return tokens, np.stack(rows)


def main(argv=None) -> int:
    p = _Parser(prog="check_exact.py", description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True)
    p.add_argument("-n", "--n-predict", type=int, default=128)
    p.add_argument("--slots", type=int, default=16, help="cache slots per layer (default 16)")
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    if not os.path.isfile(args.model):
        p.error(f"model file not found: {args.model}")
    if args.n_predict < 1 or args.slots < 1 or (args.threads is not None and args.threads < 1):
        p.error("-n, --slots and -t must be >= 1")

    os.environ.pop("LLAMA_MOE_CACHE_SLOTS", None)  # the stock run must not get a cache
    import llama_cpp
    import numpy as np

    from moecache import ggml
    from moecache.activate import attach
    from moecache.placement import experts_on_host

    if not ggml.has_gpu():
        from moecache.rpc import RpcDevice

        rpc = RpcDevice(threads=args.threads)  # noqa: F841  (serves until this process exits)

    def load():
        with experts_on_host():
            return llama_cpp.Llama(args.model, n_gpu_layers=-1, n_ctx=512 + args.n_predict,
                                   n_threads=args.threads, n_threads_batch=args.threads, verbose=False)

    llm = load()
    stock_tokens, stock_logits = _greedy(llm, args.n_predict)
    llm.close()
    del llm
    gc.collect()

    llm = load()
    cache = attach(llm, slots=args.slots, policy="lru")
    tokens, logits = _greedy(llm, args.n_predict)
    stats = cache.stats()
    first_difference = next((i for i, (a, b) in enumerate(zip(tokens, stock_tokens)) if a != b), None)
    compared = slice(0, len(tokens) if first_difference is None else first_difference + 1)
    top2 = np.sort(stock_logits, axis=1)[:, -2:]
    result = {
        "model": os.path.abspath(args.model), "n_predict": args.n_predict, "slots": args.slots,
        "cache_device": cache.layers[0]["device"], "tokens_identical": tokens == stock_tokens,
        "first_difference": first_difference,
        "max_abs_logit_diff": float(abs(logits[compared] - stock_logits[compared]).max()),
        "min_top2_margin": float((top2[:, 1] - top2[:, 0]).min()),
        "hit_rate": stats["hit_rate"], "uploads": stats["totals"]["uploads"],
    }
    print(f"check_exact: {args.n_predict} greedy tokens, cache K={args.slots} on {result['cache_device']}: "
          f"tokens {'identical' if result['tokens_identical'] else 'DIFFER at %d' % result['first_difference']}, "
          f"max |logit difference| {result['max_abs_logit_diff']:.3g} (smallest stock top-2 margin "
          f"{result['min_top2_margin']:.3g}), "
          f"hit rate {100 * (stats['hit_rate'] or 0):.1f}%, {result['uploads']} uploads")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["tokens_identical"] else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo's moecache
    sys.exit(main())
