"""tiny_moe: a random, tiny MoE GGUF (a few layers, 8-16 experts, top-2, n_embd <= 128,
byte-level gpt2 BPE vocabulary) that builds in milliseconds, for fast tests, in any of the
architectures of ARCHS (GGUF architecture names, tensor names and hyperparameters as the
llama.cpp vendored in llama-cpp-python 0.3.36 loads them). Its vocabulary is also the synthetic
models' (moecache.models.synth)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import numpy as np

from ..util import parse_int
from .store import MAX_SEED, build_gguf

#: bump when the bytes written for the same arguments change; cached files are then rebuilt
VERSION = 1
EXPERT_TYPES = ("f32", "f16", "q8_0", "q4_0", "mxfp4")  # mxfp4: gpt-oss's own

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


class TinyModel:
    """What an architecture's builder writes a tiny model with: its shape, a seeded generator of
    random weights of sensible scale, and the GGUF writer (metadata and tensor infos go in
    first, in the order they are added; ``data`` keeps the tensors' bytes for after).

    Shapes are numpy order, the reverse of ggml's ne: an expert tensor ``ffn_up_exps`` of ggml
    shape [n_embd, n_ff, n_expert] is ``experts(name, n_expert, n_ff, n_embd)``."""

    def __init__(self, w, arch: str, *, n_layer: int, n_expert: int, n_expert_used: int, n_embd: int,
                 n_head: int, n_head_kv: int, n_ff: int, expert_type: str, context_length: int,
                 seed: int):
        import gguf

        self.w, self.arch = w, arch
        self.n_layer, self.n_expert, self.n_expert_used = n_layer, n_expert, n_expert_used
        self.n_embd, self.n_head, self.n_head_kv = n_embd, n_head, n_head_kv
        self.head_dim = n_embd // n_head
        self.n_ff = n_ff  # per expert
        self.expert_type, self.context_length = expert_type, context_length
        self.n_vocab = len(tiny_vocab()[0])
        self.rng = np.random.default_rng([seed, 0x7E57])
        self.data: list[np.ndarray] = []
        self._qtype = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
                       "mxfp4": gguf.GGMLQuantizationType.MXFP4}.get(expert_type)

    # --- metadata ---

    def kv(self, key: str, value) -> None:
        """The architecture's key `arch.key`: a bool, an int (uint32), a float (float32) or a
        list of them (an array, e.g. per layer). A key written before (one of moe_hparams'
        llama-style ones, e.g. MLA's key_length) takes the new value."""
        import gguf

        name = f"{self.arch}.{key}"
        self.w.kv_data[0].pop(name, None)  # the writer would keep both and warn
        if isinstance(value, bool):
            self.w.add_bool(name, value)
        elif isinstance(value, int):
            self.w.add_uint32(name, value)
        elif isinstance(value, float):
            self.w.add_float32(name, value)
        elif isinstance(value, str):
            self.w.add_string(name, value)
        else:
            values = list(value)
            kind = (gguf.GGUFValueType.BOOL if all(isinstance(v, bool) for v in values) else
                    gguf.GGUFValueType.INT32 if all(isinstance(v, int) for v in values) else
                    gguf.GGUFValueType.FLOAT32)
            self.w.add_key_value(name, values, gguf.GGUFValueType.ARRAY, sub_type=kind)

    def moe_hparams(self, *, n_ff: int | None = None) -> None:
        """The header every tiny model starts with: name, file type, the qwen3moe-style
        hyperparameters (feed_forward_length n_ff, default n_ff_exp * top-k) and, after
        them, what the caller adds."""
        import gguf

        ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
                 "mxfp4": gguf.LlamaFileType.MOSTLY_MXFP4_MOE}[self.expert_type]
        self.w.add_name(f"moecache tiny {self.arch}")
        self.w.add_file_type(int(ftype))
        add_moe_hparams(self.w, context_length=self.context_length, n_embd=self.n_embd,
                        n_layer=self.n_layer, n_ff=self.n_ff * self.n_expert_used if n_ff is None else n_ff,
                        n_ff_exp=self.n_ff, n_expert=self.n_expert, n_expert_used=self.n_expert_used,
                        n_head=self.n_head, n_head_kv=self.n_head_kv, head_dim=self.head_dim)

    # --- tensors ---

    def tensor(self, name: str, arr: np.ndarray, raw_dtype=None) -> None:
        arr = np.ascontiguousarray(arr)
        self.w.add_tensor_info(name, arr.shape, arr.dtype, arr.nbytes, raw_dtype=raw_dtype)
        self.data.append(arr)

    def normal(self, *shape: int, std: float) -> np.ndarray:
        return (self.rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def weight(self, name: str, *shape: int, std: float | None = None) -> None:
        """A random F32 matrix [n_out, n_in] (or any shape), std 1/sqrt(n_in) by default."""
        self.tensor(name, self.normal(*shape, std=1.0 / np.sqrt(shape[-1]) if std is None else std))

    def ones(self, name: str, *shape: int) -> None:
        self.tensor(name, np.ones(shape, dtype=np.float32))

    def zeros(self, name: str, *shape: int) -> None:
        self.tensor(name, np.zeros(shape, dtype=np.float32))

    def experts(self, name: str, *shape: int) -> None:
        """Expert weights [n_expert, n_out, n_in] in the model's expert type."""
        arr = self.normal(*shape, std=1.0 / np.sqrt(shape[-1]))
        if self._qtype is not None:
            import gguf

            self.tensor(name, gguf.quants.quantize(arr, self._qtype), raw_dtype=self._qtype)
        else:
            self.tensor(name, arr.astype(np.float16) if self.expert_type == "f16" else arr)

    # --- the parts most architectures share ---

    def head(self) -> None:
        """The vocabulary: the tokenizer's metadata (the last of it), the token embedding, the
        output norm and an untied output head: with tied embeddings a random model just repeats
        its input token; special tokens get zero output logits, so greedy decoding never stops
        on a random EOS."""
        add_tiny_tokenizer(self.w)
        _, types, _ = tiny_vocab()
        self.weight("token_embd.weight", self.n_vocab, self.n_embd, std=1.0)
        self.ones("output_norm.weight", self.n_embd)
        out_w = self.normal(self.n_vocab, self.n_embd, std=3.0 / np.sqrt(self.n_embd))
        out_w[[i for i, t in enumerate(types) if t != 1]] = 0.0
        self.tensor("output.weight", out_w)

    def attention(self, i: int, *, q_k_norms: bool = False) -> None:
        """Llama-style attention of layer i, with its input norm."""
        p, d = f"blk.{i}.", self.head_dim
        self.ones(p + "attn_norm.weight", self.n_embd)
        self.weight(p + "attn_q.weight", self.n_head * d, self.n_embd)
        self.weight(p + "attn_k.weight", self.n_head_kv * d, self.n_embd)
        self.weight(p + "attn_v.weight", self.n_head_kv * d, self.n_embd)
        self.weight(p + "attn_output.weight", self.n_embd, self.n_head * d)
        if q_k_norms:
            self.ones(p + "attn_q_norm.weight", d)
            self.ones(p + "attn_k_norm.weight", d)

    def moe_block(self, i: int, *, q_k_norms: bool = False) -> None:
        """Layer i as most MoE architectures have it: attention, FFN norm, router, experts."""
        self.attention(i, q_k_norms=q_k_norms)
        self.ones(f"blk.{i}.ffn_norm.weight", self.n_embd)
        self.router(i)
        self.routed_experts(i)

    def router(self, i: int) -> None:
        """The router: logits ~ N(0, 2^2) on a normalized hidden state."""
        self.weight(f"blk.{i}.ffn_gate_inp.weight", self.n_expert, self.n_embd,
                    std=2.0 / np.sqrt(self.n_embd))

    def routed_experts(self, i: int, *, gate_up: bool = False) -> None:
        """Layer i's experts: gate, up and down (or gate and up in one tensor)."""
        p, e, f, d = f"blk.{i}.", self.n_expert, self.n_ff, self.n_embd
        if gate_up:
            self.experts(p + "ffn_gate_up_exps.weight", e, 2 * f, d)
        else:
            self.experts(p + "ffn_gate_exps.weight", e, f, d)
            self.experts(p + "ffn_up_exps.weight", e, f, d)
        self.experts(p + "ffn_down_exps.weight", e, d, f)


#: GGUF architecture name -> the function that writes a tiny model of it (metadata, then tensors)
ARCHS: dict[str, Callable[[TinyModel], None]] = {}


def architecture(name: str):
    def register(build: Callable[[TinyModel], None]):
        ARCHS[name] = build
        return build
    return register


def tiny_moe(path: str | os.PathLike[str] | None = None, *, n_layer: int = 2, n_expert: int = 8,
             n_expert_used: int = 2, n_embd: int = 64, seed: int = 0, n_head: int = 4,
             n_head_kv: int = 2, n_ff_exp: int | None = None, expert_type: str = "f32",
             context_length: int = 4096, arch: str = "qwen3moe") -> Path:
    """Build (or reuse) a random tiny MoE GGUF of architecture ``arch`` (default qwen3moe; any
    of ARCHS) and return its path.

    Weights are random normals of sensible scale, so different tokens route to different
    experts and every expert differs. Non-expert weights and the router are F32; the experts
    are ``expert_type`` (``f32``, ``f16``, ``q8_0``, ``q4_0`` or ``mxfp4``, gpt-oss's; the quantized
    ones need n_embd and n_ff_exp to be multiples of 32). ``n_ff_exp`` defaults to ``n_embd``. On x86 CPUs
    llama.cpp repacks ``q4_0`` experts into its CPU_REPACK buffer type (e.g. q4_0_8x8), which
    makes that type the one to test code that must read experts in standard layout; smol-moe's
    Q4_1 experts are not repacked. Special tokens get zero output logits, so greedy decoding
    never ends on a random EOS and routing varies from step to step.
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
    if expert_type in ("q8_0", "q4_0", "mxfp4") and (n_embd % 32 or n_ff % 32):
        raise ValueError(f"expert_type {expert_type} needs n_embd ({n_embd}) and n_ff_exp "
                         f"({n_ff}) to be multiples of 32")
    context_length = parse_int(context_length, "context_length", minimum=8, maximum=1 << 20)
    seed = parse_int(seed, "seed", minimum=0, maximum=MAX_SEED)

    params = (f"L{n_layer}-E{n_expert}-k{n_expert_used}-d{n_embd}-h{n_head}x{n_head_kv}"
              f"-ff{n_ff}-{expert_type}-c{context_length}-s{seed}")
    if arch != "qwen3moe":  # qwen3moe names are unchanged
        params += f"-{arch}"

    def fill(w) -> list[np.ndarray]:
        model = TinyModel(w, arch, n_layer=n_layer, n_expert=n_expert, n_expert_used=n_expert_used,
                          n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff,
                          expert_type=expert_type, context_length=context_length, seed=seed)
        ARCHS[arch](model)
        return model.data

    return build_gguf(path, f"tiny-moe-{params}", f"tiny-moe:v{VERSION}:{params}", "tiny-moe",
                      arch, fill)


from . import archs  # noqa: E402,F401  (registers the architectures)
