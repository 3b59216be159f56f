"""Greedy decoding one token at a time, for the exactness checks and the benchmarks: the one
loop the tests and scripts/ share."""

from __future__ import annotations

import time
from typing import NamedTuple, Sequence

import numpy as np


class Greedy(NamedTuple):
    tokens: list[int]
    #: with keep_logits, (n + 1, n_vocab): row i is the distribution after the prompt and i
    #: generated tokens, the one token i was picked from (row n: after the last token)
    logits: np.ndarray | None
    #: from the prompt's logits to the last token's: n single-token decodes
    seconds: float
    #: from the reset context to the prompt's logits: the prompt's evaluation
    prompt_seconds: float


def greedy(llm, prompt: bytes | Sequence[int], n: int, *, keep_logits: bool = False) -> Greedy:
    """Reset llm (a llama_cpp.Llama), evaluate prompt (text, tokenized without special tokens'
    parsing, or token ids), then pick and evaluate n tokens by argmax, each alone. The time
    runs from the prompt's logits to the logits after the last token, the prompt's time up to
    its logits: reading logits waits for the graph (backends may compute asynchronously after
    llama_decode returns)."""
    import llama_cpp

    n_vocab = llm.n_vocab()

    def last_logits() -> np.ndarray:
        row = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(row, shape=(n_vocab,))

    llm.reset()
    prompt = llm.tokenize(prompt) if isinstance(prompt, bytes) else list(prompt)
    prompt_start = time.perf_counter()
    llm.eval(prompt)
    logits = last_logits()
    prompt_seconds = time.perf_counter() - prompt_start
    tokens, rows = [], [logits.copy()] if keep_logits else None
    start = time.perf_counter()
    for _ in range(n):
        tokens.append(int(np.argmax(logits)))
        llm.eval([tokens[-1]])
        logits = last_logits()
        if keep_logits:
            rows.append(logits.copy())
    seconds = time.perf_counter() - start
    return Greedy(tokens, np.stack(rows) if keep_logits else None, seconds, prompt_seconds)
