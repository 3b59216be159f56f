"""tiny_moe: a random, tiny qwen3moe GGUF (a few layers, 8-16 experts, top-2, n_embd <= 128,
byte-level gpt2 BPE vocabulary) that builds in milliseconds, for fast tests. Its vocabulary is
also the synthetic models' (moecache.models.synth)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..util import parse_int
from .store import MAX_SEED, build_gguf

#: bump when the bytes written for the same arguments change; cached files are then rebuilt
VERSION = 1
EXPERT_TYPES = ("f32", "f16", "q8_0", "q4_0")
#: architectures tiny_moe can write; granitemoe is one the expert cache refuses
ARCHS = ("qwen3moe", "granitemoe")

# merges of the tiny vocabulary, in rank order; each result is also a token
_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"),
           ("o", "n"), ("Ġ", "s"), ("r", "e"), ("a", "t")]
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode map (what byte-level BPE vocabularies store)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of the tiny byte-level BPE vocabulary."""
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    merges = []
    for a, b in _MERGES:
        merges.append(f"{a} {b}")
        tokens.append(a + b)
    types = [1] * len(tokens)  # NORMAL
    tokens += _SPECIALS
    types += [3] * len(_SPECIALS)  # CONTROL
    return tokens, types, merges


def add_tiny_tokenizer(w) -> None:
    """Write tiny_vocab into a GGUFWriter as a gpt2-style tokenizer; <|endoftext|> is bos, eos
    and pad."""
    tokens, types, merges = tiny_vocab()
    eot = tokens.index("<|endoftext|>")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(eot)
    w.add_eos_token_id(eot)
    w.add_pad_token_id(eot)
    w.add_add_bos_token(False)


def add_moe_hparams(w, *, context_length: int, n_embd: int, n_layer: int, n_ff: int, n_ff_exp: int,
                    n_expert: int, n_expert_used: int, n_head: int, n_head_kv: int,
                    head_dim: int) -> None:
    """The hyperparameters of a qwen3moe-style MoE (rope base 1e6, RMS norm eps 1e-6) into a
    GGUFWriter, in the order the tiny and the synthetic builders write them."""
    for setter, value in ((w.add_context_length, context_length), (w.add_embedding_length, n_embd),
                          (w.add_block_count, n_layer), (w.add_feed_forward_length, n_ff),
                          (w.add_expert_feed_forward_length, n_ff_exp), (w.add_expert_count, n_expert),
                          (w.add_expert_used_count, n_expert_used), (w.add_head_count, n_head),
                          (w.add_head_count_kv, n_head_kv), (w.add_key_length, head_dim),
                          (w.add_value_length, head_dim), (w.add_rope_dimension_count, head_dim),
                          (w.add_rope_freq_base, 1_000_000.0), (w.add_layer_norm_rms_eps, 1e-6)):
        setter(value)


def tiny_moe(path: str | os.PathLike[str] | None = None, *, n_layer: int = 2, n_expert: int = 8,
             n_expert_used: int = 2, n_embd: int = 64, seed: int = 0, n_head: int = 4,
             n_head_kv: int = 2, n_ff_exp: int | None = None, expert_type: str = "f32",
             context_length: int = 4096, arch: str = "qwen3moe") -> Path:
    """Build (or reuse) a random tiny qwen3moe GGUF and return its path.

    Weights are random normals of sensible scale, so different tokens route to different
    experts and every expert differs. Non-expert weights and the router are F32; the experts
    are ``expert_type`` (``f32``, ``f16``, ``q8_0`` or ``q4_0``; the quantized ones need n_embd
    and n_ff_exp to be multiples of 32). ``n_ff_exp`` defaults to ``n_embd``. On x86 CPUs
    llama.cpp repacks ``q4_0`` experts into its CPU_REPACK buffer type (e.g. q4_0_8x8), which
    makes that type the one to test code that must read experts in standard layout; smol-moe's
    Q4_1 experts are not repacked. Special tokens get zero output logits, so greedy decoding
    never ends on a random EOS and routing varies from step to step.

    ``arch="granitemoe"`` writes the same kind of model under llama.cpp's ``granitemoe``
    architecture (llama-style attention without q/k norms, ``granitemoe.logit_scale`` = 1),
    which the expert cache does not support: for testing that it is refused.
    """
    if not isinstance(arch, str) or arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    n_layer = parse_int(n_layer, "n_layer", minimum=1, maximum=64)
    n_expert = parse_int(n_expert, "n_expert", minimum=2, maximum=256)
    n_expert_used = parse_int(n_expert_used, "n_expert_used", minimum=1, maximum=n_expert)
    n_embd = parse_int(n_embd, "n_embd", minimum=8, maximum=4096)
    n_head = parse_int(n_head, "n_head", minimum=1, maximum=256)
    n_head_kv = parse_int(n_head_kv, "n_head_kv", minimum=1, maximum=n_head)
    if n_embd % n_head:
        raise ValueError(f"n_embd ({n_embd}) must be a multiple of n_head ({n_head})")
    head_dim = n_embd // n_head
    if head_dim % 2:
        raise ValueError(f"head dimension n_embd/n_head ({head_dim}) must be even for rope")
    if n_head % n_head_kv:
        raise ValueError(f"n_head ({n_head}) must be a multiple of n_head_kv ({n_head_kv})")
    n_ff = n_embd if n_ff_exp is None else parse_int(n_ff_exp, "n_ff_exp", minimum=1, maximum=16384)
    if not isinstance(expert_type, str) or expert_type.lower() not in EXPERT_TYPES:
        raise ValueError(f"expert_type must be one of {', '.join(EXPERT_TYPES)}, "
                         f"got {expert_type!r}")
    expert_type = expert_type.lower()
    if expert_type in ("q8_0", "q4_0") and (n_embd % 32 or n_ff % 32):
        raise ValueError(f"expert_type {expert_type} needs n_embd ({n_embd}) and n_ff_exp "
                         f"({n_ff}) to be multiples of 32")
    context_length = parse_int(context_length, "context_length", minimum=8, maximum=1 << 20)
    seed = parse_int(seed, "seed", minimum=0, maximum=MAX_SEED)

    params = (f"L{n_layer}-E{n_expert}-k{n_expert_used}-d{n_embd}-h{n_head}x{n_head_kv}"
              f"-ff{n_ff}-{expert_type}-c{context_length}-s{seed}")
    if arch != "qwen3moe":  # qwen3moe names are unchanged
        params += f"-{arch}"

    def fill(w) -> list[np.ndarray]:
        return _fill(w, n_layer=n_layer, n_expert=n_expert, n_expert_used=n_expert_used,
                     n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff,
                     expert_type=expert_type, context_length=context_length, seed=seed, arch=arch)

    return build_gguf(path, f"tiny-moe-{params}", f"tiny-moe:v{VERSION}:{params}", "tiny-moe",
                      arch, fill)


def _fill(w, *, n_layer: int, n_expert: int, n_expert_used: int, n_embd: int, n_head: int,
          n_head_kv: int, n_ff: int, expert_type: str, context_length: int, seed: int,
          arch: str) -> list[np.ndarray]:
    import gguf

    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
             "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[expert_type]
    w.add_name(f"moecache tiny {arch}")
    w.add_file_type(int(ftype))
    # granitemoe's loader sizes the experts by feed_forward_length
    add_moe_hparams(w, context_length=context_length, n_embd=n_embd, n_layer=n_layer,
                    n_ff=n_ff if arch == "granitemoe" else n_ff * n_expert_used, n_ff_exp=n_ff,
                    n_expert=n_expert, n_expert_used=n_expert_used, n_head=n_head,
                    n_head_kv=n_head_kv, head_dim=n_embd // n_head)
    if arch == "granitemoe":
        w.add_logit_scale(1.0)  # required; the other granite scales are optional
    add_tiny_tokenizer(w)
    return _add_tensors(w, n_layer=n_layer, n_expert=n_expert, n_embd=n_embd, n_head=n_head,
                        n_head_kv=n_head_kv, n_ff=n_ff, expert_type=expert_type, seed=seed,
                        q_k_norms=arch == "qwen3moe")


def _add_tensors(w, *, n_layer: int, n_expert: int, n_embd: int, n_head: int, n_head_kv: int,
                 n_ff: int, expert_type: str, seed: int, q_k_norms: bool) -> list[np.ndarray]:
    """Random weights of sensible scale: every tensor's info into w; returns their data."""
    import gguf

    head_dim = n_embd // n_head
    tokens, types, _ = tiny_vocab()
    n_vocab = len(tokens)
    rng = np.random.default_rng([seed, 0x7E57])

    def normal(*shape: int, std: float) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    qtype = {"f32": None, "f16": None, "q8_0": gguf.GGMLQuantizationType.Q8_0,
             "q4_0": gguf.GGMLQuantizationType.Q4_0}[expert_type]
    data: list[np.ndarray] = []

    def add(name: str, arr: np.ndarray, raw_dtype=None) -> None:
        arr = np.ascontiguousarray(arr)
        w.add_tensor_info(name, arr.shape, arr.dtype, arr.nbytes, raw_dtype=raw_dtype)
        data.append(arr)

    def add_expert(name: str, arr: np.ndarray) -> None:
        if qtype is not None:
            add(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            add(name, arr.astype(np.float16) if expert_type == "f16" else arr)

    ones = np.ones
    add("token_embd.weight", normal(n_vocab, n_embd, std=1.0))
    add("output_norm.weight", ones(n_embd, dtype=np.float32))
    # untied output head: with tied embeddings a random model just repeats its input token
    # (special tokens get zero logits, so greedy decoding never stops on a random EOS)
    out_w = normal(n_vocab, n_embd, std=3.0 / np.sqrt(n_embd))
    out_w[[i for i, t in enumerate(types) if t != 1]] = 0.0
    add("output.weight", out_w)
    s_in = 1.0 / np.sqrt(n_embd)
    for i in range(n_layer):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", ones(n_embd, dtype=np.float32))
        add(p + "attn_q.weight", normal(n_head * head_dim, n_embd, std=s_in))
        add(p + "attn_k.weight", normal(n_head_kv * head_dim, n_embd, std=s_in))
        add(p + "attn_v.weight", normal(n_head_kv * head_dim, n_embd, std=s_in))
        add(p + "attn_output.weight", normal(n_embd, n_head * head_dim,
                                             std=1.0 / np.sqrt(n_head * head_dim)))
        if q_k_norms:
            add(p + "attn_q_norm.weight", ones(head_dim, dtype=np.float32))
            add(p + "attn_k_norm.weight", ones(head_dim, dtype=np.float32))
        add(p + "ffn_norm.weight", ones(n_embd, dtype=np.float32))
        # router: logits ~ N(0, 2^2) on a normalized hidden state
        add(p + "ffn_gate_inp.weight", normal(n_expert, n_embd, std=2.0 * s_in))
        add_expert(p + "ffn_gate_exps.weight", normal(n_expert, n_ff, n_embd, std=s_in))
        add_expert(p + "ffn_up_exps.weight", normal(n_expert, n_ff, n_embd, std=s_in))
        add_expert(p + "ffn_down_exps.weight", normal(n_expert, n_embd, n_ff,
                                                      std=1.0 / np.sqrt(n_ff)))
    return data
