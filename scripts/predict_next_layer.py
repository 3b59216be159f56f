#!/usr/bin/env python3
"""How well layer l's hidden state predicts the experts layer l+1 selects (issue 38): the "stale
gate", layer l+1's router applied to layer l's hidden state, against the previous token's choice.

    python scripts/predict_next_layer.py [-m MODEL] [-p PROMPT] [-n 64] [-t 2]

Decodes greedily on the CPU (stock llama.cpp, no cache) and reads, through llama.cpp's eval
callback, each decode token's per-layer tensors: the FFN's normed input (`ffn_norm`), the layer's
output (`l_out`) and the router's ranking (`ffn_moe_argsort`); gpt-oss names its normed FFN input
`attn_post_norm`. For every layer l+1 it ranks
layer l+1's experts by its router weights (and router bias, where the model has one) applied to
  input:   layer l's normed FFN input (what layer l's own router saw),
  output:  layer l's output, RMS-normed and scaled by layer l+1's ffn_norm weights (as layer
           l+1's FFN input would be without layer l+1's attention),
and, as the routing-only baseline, previous: layer l+1's selection in the previous token.
Printed: recall, the share of layer l+1's top-k experts found in each predictor's top k (its
average over decode tokens and layers, the worst and best layer), and the chance level k / n_expert.
A model whose router scores a probability bias (exp_probs_b) is refused: the selection is not
the top-k of the logits. Default model: smol-moe (SmolLM2's real residual stream, a random router).
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np

from moecache.util import OneLineParser, int_arg

PROG = "predict_next_layer.py"
PREDICTORS = ("input", "output", "previous")


def parser() -> OneLineParser:
    p = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", help="a GGUF MoE model (default: smol-moe, built if needed)")
    p.add_argument("-p", "--prompt", default="The three primary colors are", help="the prompt")
    p.add_argument("-n", "--n-predict", type=int_arg(minimum=2), default=64, help="decode tokens (default 64)")
    p.add_argument("-t", "--threads", type=int_arg(minimum=1), default=2, help="CPU threads (default 2)")
    return p


class Router:
    """Layer il's router from the GGUF: weights [n_expert, n_embd], bias, and the ffn_norm weights."""

    def __init__(self, tensors: dict, il: int):
        self.w = np.asarray(tensors[f"blk.{il}.ffn_gate_inp.weight"], dtype=np.float32)
        bias = tensors.get(f"blk.{il}.ffn_gate_inp.bias")
        self.b = None if bias is None else np.asarray(bias, dtype=np.float32)
        norm = tensors.get(f"blk.{il}.ffn_norm.weight", tensors.get(f"blk.{il}.post_attention_norm.weight"))
        self.norm = None if norm is None else np.asarray(norm, dtype=np.float32)

    def rank(self, x: np.ndarray, k: int) -> set:
        scores = self.w @ x + (0 if self.b is None else self.b)
        return set(np.argsort(-scores, kind="stable")[:k].tolist())


def routers_of(path: str, eps: float):
    from gguf import GGUFReader

    reader = GGUFReader(path)
    names = {t.name for t in reader.tensors}
    if any(name.endswith("exp_probs_b.bias") for name in names):
        raise SystemExit(f"{PROG}: error: {path}: its routers add a probability bias; the selection is not "
                         f"the top-k of the logits, which this script predicts")
    tensors = {t.name: t.data for t in reader.tensors if t.tensor_type.name == "F32"}
    layers = sorted({int(n.split(".")[1]) for n in tensors if n.endswith("ffn_gate_inp.weight")})
    return {il: Router(tensors, il) for il in layers}


class Recorder:
    """The eval callback: per decode token (a graph of one token; a tensor seen again starts the
    next), each layer's ffn_norm, l_out and argsort rows."""

    WANTED = ("ffn_norm", "attn_post_norm", "l_out", "ffn_moe_argsort")  # attn_post_norm: gpt-oss's ffn_norm

    def __init__(self, lib):
        import llama_cpp.llama_cpp as llama

        self.ggml = lib
        self.tokens: list[dict] = []
        self.current: dict = {}
        self.callback = llama.ggml_backend_sched_eval_callback(self._called)

    def _called(self, tensor, ask, _user_data):
        name = self.ggml.ggml_get_name(tensor).decode()
        stem, _, layer = name.rpartition("-")
        if stem not in self.WANTED or not layer.isdigit():
            return not ask  # not asked for; after computing a node, go on
        if ask:
            return True
        ne = (ctypes.c_int64 * 4).from_address(tensor + 16)  # ggml_tensor: type, buffer, ne[4]
        count = ne[0] * ne[1] * ne[2] * ne[3]
        dtype = np.int32 if stem == "ffn_moe_argsort" else np.float32
        data = np.empty(count, dtype=dtype)
        self.ggml.ggml_backend_tensor_get(tensor, data.ctypes.data, 0, data.nbytes)
        rows = data.reshape(-1, ne[0])
        if rows.shape[0] == 1:  # one token: a decode step
            key = ("ffn_norm" if stem == "attn_post_norm" else stem, int(layer))
            if key in self.current:
                self.tokens.append(self.current)
                self.current = {}
            self.current[key] = rows[0].copy()
        return True


def rms_norm(x, eps):
    return x / np.sqrt(np.mean(x * x) + eps)


def recall(recorded, routers, k: int, eps: float):
    """{predictor: (n_tokens_layers,) recall} over every decode token after the first and every
    layer pair (l, l+1) both with routers."""
    layers = sorted(routers)
    out = {name: [[] for _ in layers[1:]] for name in PREDICTORS}
    for prev, tok in zip(recorded, recorded[1:]):
        for j, (l, nxt) in enumerate(zip(layers, layers[1:])):
            actual = tok.get(("ffn_moe_argsort", nxt))
            x_in, x_out = tok.get(("ffn_norm", l)), tok.get(("l_out", l))
            before = prev.get(("ffn_moe_argsort", nxt))
            if actual is None or x_in is None or x_out is None or before is None:
                continue
            truth = set(actual[:k].tolist())
            router = routers[nxt]
            normed = rms_norm(x_out, eps) * (1 if router.norm is None else router.norm)
            guesses = {"input": router.rank(x_in, k), "output": router.rank(normed, k),
                       "previous": set(before[:k].tolist())}
            for name, guess in guesses.items():
                out[name][j].append(len(guess & truth) / k)
    return {name: [np.mean(v) if v else np.nan for v in per_layer] for name, per_layer in out.items()}


def measure(args) -> None:
    import llama_cpp

    from moecache.live import ggml
    from moecache.live.decode import greedy

    path = args.model
    if path is None:
        from moecache.models import smol_moe

        path = str(smol_moe())
    lib = ggml.libggml_base()
    lib.ggml_get_name.restype = ctypes.c_char_p
    lib.ggml_get_name.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    recorder = Recorder(lib)

    stock = llama_cpp.llama_context_default_params

    def with_callback():
        params = stock()
        params.cb_eval = recorder.callback
        return params

    llama_cpp.llama_cpp.llama_context_default_params = with_callback
    try:
        llm = llama_cpp.Llama(path, n_gpu_layers=0, n_ctx=512, n_threads=args.threads,
                              n_threads_batch=args.threads, verbose=False)
    finally:
        llama_cpp.llama_cpp.llama_context_default_params = stock
    meta = llm.metadata
    arch = meta["general.architecture"]
    n_expert, k = int(meta[f"{arch}.expert_count"]), int(meta[f"{arch}.expert_used_count"])
    eps = float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6))
    routers = routers_of(path, eps)

    run = greedy(llm, args.prompt.encode(), args.n_predict)
    recorder.tokens.append(recorder.current)
    result = recall(recorder.tokens, routers, k, eps)
    print(f"{PROG}: {path}: {arch}, {len(routers)} MoE layers of {n_expert} experts, top-{k}; "
          f"{len(run.tokens)} decode tokens; chance {k / n_expert:.1%}")
    print(f"{'predictor':>10}  {'recall':>7}  {'worst layer':>11}  {'best layer':>10}")
    for name, per_layer in result.items():
        v = np.array(per_layer)
        print(f"{name:>10}  {np.nanmean(v):7.1%}  {np.nanmin(v):11.1%}  {np.nanmax(v):10.1%}")
    llm.close()


if __name__ == "__main__":
    sys.exit(parser().run(measure))
