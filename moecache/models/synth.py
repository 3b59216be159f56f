"""Shape-realistic MoE GGUFs with random weights, for benchmarks at real model sizes.

A synthetic model has the tensor shapes, types and therefore the bytes per token of a real MoE
model, so decode speed, expert sizes and cache traffic are those of the real thing; its
weights are random, so its text is not. Presets (experts Q4_0; architecture ``qwen3moe`` unless
said):

* ``qwen3-30b-a3b``: Qwen3-30B-A3B: 48 layers, 128 experts, top-8, n_embd 2048, expert ff 768,
  32 query / 4 KV heads of dim 128. About 17 GB.
* ``moe-512x10``: the 512-expert, top-10 regime of llama.cpp PR 27861, with the MoE shape of
  Qwen3-Next-80B-A3B: 48 layers, 512 experts, top-10, n_embd 2048, expert ff 512, 16 query /
  2 KV heads of dim 256. Qwen3-Next's hybrid linear attention and shared expert are left out
  (full attention, routed experts only), so this is its expert traffic, not its attention.
  About 44 GB.
* ``gpt-oss-20b``: gpt-oss-20b as architecture ``gpt-oss`` (SwiGLU-OAI experts with biases, a
  router bias, attention sinks and biases, every other layer windowed): 24 layers, 32 experts,
  top-4, n_embd 2880, expert ff 2880, 64 query / 8 KV heads of dim 64. Its real experts are
  MXFP4 (4.25 bits a weight), these Q4_0 (4.5). About 11 GB.
* ``qwen3-next-80b-a3b``: Qwen3-Next-80B-A3B as architecture ``qwen3next``: the moe-512x10 shape
  with its real layer structure (3 gated delta net layers to 1 gated full attention layer, a
  sigmoid-gated shared expert of one expert's width) and the experts' gate and up fused in one
  tensor (``ffn_gate_up_exps``). About 45 GB.

Every shape field can be overridden (``--layers N`` etc.) to shrink a preset for CPU tests.
The vocabulary is the tiny model's byte-level one (269 tokens): tokenizing works, the
vocabulary-sized tensors are tiny.

Routing locality (``--locality S``, 0 <= S <= 0.95). Quantized weights are random Q4_0 blocks
(random nibbles, one fp16 scale per tensor chosen for unit gain), so every layer only adds
noise; the token embedding is made large enough (element RMS 10 * sqrt(n_layer)) that the
hidden state every router sees is, in direction, the embedding of the current token plus a
small perturbation. Routing then follows the embedding geometry, which is built so that
greedy decoding walks a fixed cycle through the vocabulary and consecutive tokens on it have
similar embeddings:

    embedding(t) = sqrt(S/2) * u + sqrt(S/2) * c(position of t on the cycle) + sqrt(1-S) * z_t

with u a fixed direction (it gives every router a static expert popularity), c a smooth
closed curve on the unit sphere of a few Fourier modes (the popular subset drifts slowly as
decoding walks the cycle) and z_t a random direction of the token's own (per-token churn).
The output head reads only the z part and maps z_t to the cycle successor of t, so greedy
decoding follows the cycle whatever S is. Routers are random Gaussian matrices. S = 0 is
purely random routing: each token picks experts independently, and a per-layer cache of K
slots hits about K / n_expert of lookups. docs/notes/benchmark-logs.md ("Routing locality of the
synthetic models") has the measured hit rates.

Built and cached like every model of moecache.models; on the command line
``python -m moecache.models synth PRESET [--layers N] ...``.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ..util import parse_int
from .store import MAX_SEED, build_gguf
from .tiny import add_moe_hparams, add_tiny_tokenizer, tiny_vocab

__all__ = ["DEFAULT_LOCALITY", "MAX_LOCALITY", "PRESETS", "Shape", "file_bytes", "synth_moe"]

#: bump when the bytes written for the same arguments change; cached files are then rebuilt
VERSION = 1

#: the architectures a synthetic model can have (Shape.arch): the per-layer tensors of each
ARCHS = ("qwen3moe", "gpt-oss", "qwen3next")
MAX_LOCALITY = 0.95   # above this the per-token part is too small for greedy to follow the cycle
DEFAULT_LOCALITY = 0.6
CURVE_MODES = 3       # Fourier modes of the drifting curve: how fast the popular subset moves
Q4_0_BLOCK = 32
Q4_0_BLOCK_BYTES = 18  # fp16 scale + 16 bytes of nibbles
# RMS of a random Q4_0 value (uniform nibble q in 0..15, value d * (q - 8)) in units of d
Q4_0_STD = math.sqrt((16 ** 2 - 1) / 12 + 0.25)


@dataclasses.dataclass(frozen=True)
class Shape:
    n_layer: int
    n_expert: int
    n_expert_used: int
    n_embd: int
    n_ff_exp: int        # per expert
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int            # the dense FFN width the real model declares (metadata only)
    context_length: int = 4096
    arch: str = "qwen3moe"  # one of ARCHS

    def __post_init__(self):
        parse_int(self.n_layer, "n_layer", minimum=1, maximum=512)
        parse_int(self.n_expert, "n_expert", minimum=2, maximum=4096)
        parse_int(self.n_expert_used, "n_expert_used", minimum=1, maximum=self.n_expert)
        parse_int(self.n_head, "n_head", minimum=1, maximum=1024)
        parse_int(self.n_head_kv, "n_head_kv", minimum=1, maximum=self.n_head)
        if self.n_head % self.n_head_kv:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_head_kv ({self.n_head_kv})")
        parse_int(self.head_dim, "head_dim", minimum=2, maximum=1024)
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rope, got {self.head_dim}")
        parse_int(self.n_ff, "n_ff", minimum=1, maximum=1 << 20)
        parse_int(self.context_length, "context_length", minimum=8, maximum=1 << 20)
        for name in ("n_embd", "n_ff_exp"):
            value = parse_int(getattr(self, name), name, minimum=Q4_0_BLOCK, maximum=1 << 16)
            if value % Q4_0_BLOCK:
                raise ValueError(f"{name} must be a multiple of {Q4_0_BLOCK} (Q4_0 rows), got {value}")
        if (self.n_head * self.head_dim) % Q4_0_BLOCK:
            raise ValueError(f"n_head * head_dim must be a multiple of {Q4_0_BLOCK} (Q4_0 rows), "
                             f"got {self.n_head * self.head_dim}")
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        if self.n_embd < 2 * CURVE_MODES + 2:
            raise ValueError(f"n_embd must be >= {2 * CURVE_MODES + 2} for the routing geometry")


PRESETS = {
    "qwen3-30b-a3b": Shape(n_layer=48, n_expert=128, n_expert_used=8, n_embd=2048, n_ff_exp=768,
                           n_head=32, n_head_kv=4, head_dim=128, n_ff=6144),
    "moe-512x10": Shape(n_layer=48, n_expert=512, n_expert_used=10, n_embd=2048, n_ff_exp=512,
                        n_head=16, n_head_kv=2, head_dim=256, n_ff=5120),
    "gpt-oss-20b": Shape(n_layer=24, n_expert=32, n_expert_used=4, n_embd=2880, n_ff_exp=2880,
                         n_head=64, n_head_kv=8, head_dim=64, n_ff=2880, arch="gpt-oss"),
    "qwen3-next-80b-a3b": Shape(n_layer=48, n_expert=512, n_expert_used=10, n_embd=2048, n_ff_exp=512,
                                n_head=16, n_head_kv=2, head_dim=256, n_ff=5120, arch="qwen3next"),
}

# CLI flag -> Shape field
SHAPE_FLAGS = {"layers": "n_layer", "experts": "n_expert", "top_k": "n_expert_used",
               "embd": "n_embd", "expert_ff": "n_ff_exp"}


def _q4_0_bytes(n_rows: int, n_in: int) -> int:
    return n_rows * n_in // Q4_0_BLOCK * Q4_0_BLOCK_BYTES


Plan = list[tuple[str, str, tuple[int, ...], int]]

# gpt-oss's sliding window; Qwen3-Next: one full attention layer after 3 linear ones, and its
# gated delta net's conv kernel
GPT_OSS_SLIDING_WINDOW = 128
QWEN3NEXT_FULL_ATTENTION_INTERVAL = 4
QWEN3NEXT_CONV_KERNEL = 4


def _tensor_plan(shape: Shape, n_vocab: int) -> Plan:
    """(name, kind, logical shape ne0-last, input width) of every tensor, in file order.
    kind: "f32" or "q4_0"; the shapes are numpy order (rows..., ne0). F32 tensors are filled by
    their name (_f32_job): norms ones, biases and sinks zeros, routers random."""
    s = shape
    plan = [("token_embd.weight", "f32", (n_vocab, s.n_embd), s.n_embd),
            ("output_norm.weight", "f32", (s.n_embd,), 0),
            ("output.weight", "f32", (n_vocab, s.n_embd), s.n_embd)]
    for i in range(s.n_layer):
        plan += _LAYER_PLANS[s.arch](s, f"blk.{i}.", i)
    return plan


def _matrix(name: str, n_out: int, n_in: int) -> tuple[str, str, tuple[int, ...], int]:
    return (name, "q4_0", (n_out, n_in), n_in)


def _f32(name: str, *dims: int) -> tuple[str, str, tuple[int, ...], int]:
    return (name, "f32", dims, dims[-1])


def _attention(s: Shape, p: str, *, q_rows: int | None = None) -> Plan:
    q_dim, kv_dim = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    return [_matrix(p + "attn_q.weight", q_rows or q_dim, s.n_embd),
            _matrix(p + "attn_k.weight", kv_dim, s.n_embd),
            _matrix(p + "attn_v.weight", kv_dim, s.n_embd),
            _matrix(p + "attn_output.weight", s.n_embd, q_dim)]


def _experts(s: Shape, p: str, *, gate_up: bool = False) -> Plan:
    e, f, d = s.n_expert, s.n_ff_exp, s.n_embd
    up = ([(p + "ffn_gate_up_exps.weight", "q4_0", (e, 2 * f, d), d)] if gate_up else
          [(p + "ffn_gate_exps.weight", "q4_0", (e, f, d), d), (p + "ffn_up_exps.weight", "q4_0", (e, f, d), d)])
    return [_f32(p + "ffn_gate_inp.weight", e, d), *up, (p + "ffn_down_exps.weight", "q4_0", (e, d, f), f)]


def _qwen3moe_layer(s: Shape, p: str, i: int) -> Plan:
    return [_f32(p + "attn_norm.weight", s.n_embd), *_attention(s, p),
            _f32(p + "attn_q_norm.weight", s.head_dim), _f32(p + "attn_k_norm.weight", s.head_dim),
            _f32(p + "ffn_norm.weight", s.n_embd), *_experts(s, p)]


def _gpt_oss_layer(s: Shape, p: str, i: int) -> Plan:
    """gpt-oss: attention with biases and sinks; experts (and router) with biases."""
    q_dim, kv_dim = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    return [_f32(p + "attn_norm.weight", s.n_embd), *_attention(s, p),
            _f32(p + "attn_q.bias", q_dim), _f32(p + "attn_k.bias", kv_dim), _f32(p + "attn_v.bias", kv_dim),
            _f32(p + "attn_output.bias", s.n_embd), _f32(p + "attn_sinks.weight", s.n_head),
            _f32(p + "post_attention_norm.weight", s.n_embd), *_experts(s, p),
            _f32(p + "ffn_gate_inp.bias", s.n_expert), _f32(p + "ffn_gate_exps.bias", s.n_expert, s.n_ff_exp),
            _f32(p + "ffn_up_exps.bias", s.n_expert, s.n_ff_exp), _f32(p + "ffn_down_exps.bias", s.n_expert, s.n_embd)]


def _qwen3next_dims(s: Shape) -> tuple[int, int, int]:
    """Qwen3-Next's gated delta net: (key heads, value heads, head state) from the attention
    shape, as in the real model (16 key and 32 value heads of 128 beside 16 query heads of 256)."""
    return s.n_head, 2 * s.n_head, s.head_dim // 2


def _qwen3next_layer(s: Shape, p: str, i: int) -> Plan:
    """Qwen3-Next: gated delta net (linear attention) or gated full attention, fused gate_up
    experts and a sigmoid-gated shared expert."""
    d = s.n_embd
    if (i + 1) % QWEN3NEXT_FULL_ATTENTION_INTERVAL:
        k_heads, v_heads, state = _qwen3next_dims(s)
        conv = 2 * k_heads * state + v_heads * state
        mixer = [_matrix(p + "attn_qkv.weight", conv, d), _matrix(p + "attn_gate.weight", v_heads * state, d),
                 _f32(p + "ssm_conv1d.weight", conv, QWEN3NEXT_CONV_KERNEL), _f32(p + "ssm_dt.bias", v_heads),
                 _f32(p + "ssm_a", v_heads), _matrix(p + "ssm_ba.weight", 2 * v_heads, d),
                 _f32(p + "ssm_norm.weight", state), _matrix(p + "ssm_out.weight", d, v_heads * state)]
    else:  # the query projection also yields a per-head output gate
        mixer = [*_attention(s, p, q_rows=2 * s.n_head * s.head_dim),
                 _f32(p + "attn_q_norm.weight", s.head_dim), _f32(p + "attn_k_norm.weight", s.head_dim)]
    return [_f32(p + "attn_norm.weight", d), _f32(p + "post_attention_norm.weight", d), *mixer,
            *_experts(s, p, gate_up=True), _f32(p + "ffn_gate_inp_shexp.weight", d),
            _matrix(p + "ffn_gate_shexp.weight", s.n_ff_exp, d), _matrix(p + "ffn_up_shexp.weight", s.n_ff_exp, d),
            _matrix(p + "ffn_down_shexp.weight", d, s.n_ff_exp)]


_LAYER_PLANS = {"qwen3moe": _qwen3moe_layer, "gpt-oss": _gpt_oss_layer, "qwen3next": _qwen3next_layer}


def _arch_hparams(w, s: Shape) -> None:
    """The architecture's own keys, after the shared ones."""
    if s.arch == "gpt-oss":
        w.add_sliding_window(GPT_OSS_SLIDING_WINDOW)
    elif s.arch == "qwen3next":
        k_heads, v_heads, state = _qwen3next_dims(s)
        w.add_expert_shared_feed_forward_length(s.n_ff_exp)
        w.add_ssm_conv_kernel(QWEN3NEXT_CONV_KERNEL)
        w.add_ssm_state_size(state)
        w.add_ssm_group_count(k_heads)
        w.add_ssm_time_step_rank(v_heads)
        w.add_ssm_inner_size(v_heads * state)
        w.add_uint32(f"{s.arch}.full_attention_interval", QWEN3NEXT_FULL_ATTENTION_INTERVAL)


def _nbytes(kind: str, dims: tuple[int, ...]) -> int:
    n = math.prod(dims)
    return 4 * n if kind == "f32" else n // Q4_0_BLOCK * Q4_0_BLOCK_BYTES


def file_bytes(shape: Shape) -> int:
    """Tensor bytes of a synthetic model of this shape (the file adds metadata and padding)."""
    n_vocab = len(tiny_vocab()[0])
    return sum(_nbytes(kind, dims) for _, kind, dims, _ in _tensor_plan(shape, n_vocab))


def _check_locality(locality: Any) -> float:
    if isinstance(locality, bool) or not isinstance(locality, (int, float, np.floating, np.integer)):
        raise ValueError(f"locality must be a number, got {locality!r}")
    locality = float(locality)
    if not 0.0 <= locality <= MAX_LOCALITY:
        raise ValueError(f"locality must be in [0, {MAX_LOCALITY}], got {locality}")
    return locality


def synth_moe(preset: str, path: str | os.PathLike[str] | None = None, *,
              locality: float = DEFAULT_LOCALITY, seed: int = 0, threads: int | None = None,
              **shape_overrides: int) -> Path:
    """Build (or reuse) a synthetic MoE GGUF of `preset` (a key of PRESETS) and return its path.
    shape_overrides replace Shape fields (n_layer=4 shrinks the model for CPU tests). threads:
    parallel random-number generators (default: all cores); the bytes do not depend on it."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (choose from {', '.join(PRESETS)})")
    unknown = sorted(set(shape_overrides) - {f.name for f in dataclasses.fields(Shape)})
    if unknown:
        raise ValueError(f"unknown shape field {unknown[0]!r}")
    shape = dataclasses.replace(PRESETS[preset], **shape_overrides)
    locality = _check_locality(locality)
    seed = parse_int(seed, "seed", minimum=0, maximum=MAX_SEED)
    threads = parse_int(threads if threads is not None else (os.cpu_count() or 1), "threads",
                        minimum=1, maximum=1024)

    params = "-".join(f"{f.name}{getattr(shape, f.name)}" for f in dataclasses.fields(Shape)
                      if f.name != "arch" or shape.arch != "qwen3moe")  # qwen3moe keys are unchanged
    stem = (f"synth-{preset}-L{shape.n_layer}-E{shape.n_expert}-k{shape.n_expert_used}"
            f"-loc{locality:g}-s{seed}")

    def fill(w):
        return _fill(w, preset, shape, locality=locality, seed=seed, threads=threads)

    return build_gguf(path, stem, f"synth:v{VERSION}:{preset}:{params}:loc{locality:g}:s{seed}",
                      "synth", shape.arch, fill, size=file_bytes(shape))


# --------------------------------------------------------------------------------------------
# the routing geometry


def _token_directions(rng: np.random.Generator, n_vocab: int, cycle: np.ndarray, n_embd: int,
                      locality: float) -> tuple[np.ndarray, np.ndarray]:
    """Unit embedding directions [n_vocab, n_embd] and the per-token parts z [n_vocab, n_embd]
    (see the module docstring). cycle: the normal tokens in greedy decoding order."""
    basis, _ = np.linalg.qr(rng.standard_normal((n_embd, 1 + 2 * CURVE_MODES)))
    static, curve_basis = basis[:, 0], basis[:, 1:]
    z = rng.standard_normal((n_vocab, n_embd))
    z -= (z @ basis) @ basis.T  # the per-token part lives off the shared subspace
    z /= np.linalg.norm(z, axis=1, keepdims=True)

    position = np.zeros(n_vocab)
    position[cycle] = np.arange(len(cycle)) / len(cycle)
    phases = rng.uniform(0, 2 * np.pi, CURVE_MODES)
    angle = 2 * np.pi * np.arange(1, CURVE_MODES + 1) * position[:, None] + phases
    curve = np.concatenate([np.cos(angle), np.sin(angle)], axis=1) @ curve_basis.T / math.sqrt(CURVE_MODES)

    shared = math.sqrt(locality / 2)
    directions = shared * static + shared * curve + math.sqrt(1 - locality) * z
    return directions, z


# --------------------------------------------------------------------------------------------
# writing


def random_q4_0(seed_seq: Sequence[int], dims: tuple[int, ...], n_in: int) -> np.ndarray:
    """Random Q4_0 bytes for a tensor of logical shape dims (ne0 = n_in last): uniform nibbles
    and a scale of unit gain (output RMS ~ input RMS) with a random sign per block. The sign
    matters: uniform nibbles have mean -0.5 * scale, and that bias would add a component along
    the all-ones vector to every output, which grows from layer to layer and swamps the rest."""
    rows = math.prod(dims[:-1])
    n_bytes = _q4_0_bytes(rows, n_in)
    words = np.random.default_rng(list(seed_seq)).bit_generator.random_raw((n_bytes + 7) // 8)
    blocks = words.view(np.uint8)[:n_bytes].reshape(-1, Q4_0_BLOCK_BYTES)
    scale = np.float16(1.0 / (Q4_0_STD * math.sqrt(n_in)))
    low, high = np.frombuffer(scale.tobytes(), dtype=np.uint8)  # little-endian fp16, sign bit 0
    blocks[:, 0] = low
    blocks[:, 1] = (blocks[:, 1] & 0x80) | high  # keep the random byte's top bit as the sign
    return blocks.reshape(dims[:-1] + (n_in // Q4_0_BLOCK * Q4_0_BLOCK_BYTES,))


def _fill(w, preset: str, shape: Shape, *, locality: float, seed: int, threads: int):
    import gguf

    s = shape
    w.add_string("moecache.synth.preset", preset)
    w.add_float32("moecache.synth.locality", locality)
    w.add_name(f"moecache synth {preset}")
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_0))
    add_moe_hparams(w, context_length=s.context_length, n_embd=s.n_embd, n_layer=s.n_layer,
                    n_ff=s.n_ff, n_ff_exp=s.n_ff_exp, n_expert=s.n_expert,
                    n_expert_used=s.n_expert_used, n_head=s.n_head, n_head_kv=s.n_head_kv,
                    head_dim=s.head_dim)
    _arch_hparams(w, s)
    add_tiny_tokenizer(w)
    return _generate(_tensor_jobs(w, s, _embeddings(s, locality, seed), seed), threads)


def _embeddings(shape: Shape, locality: float, seed: int) -> dict[str, np.ndarray]:
    """The token embedding and the output head of the routing geometry."""
    tokens, types, _ = tiny_vocab()
    n_vocab = len(tokens)
    normal = np.flatnonzero(np.asarray(types) == 1)
    rng = np.random.default_rng([seed, 0x5E7, 0])
    cycle = rng.permutation(normal)
    directions, z = _token_directions(rng, n_vocab, cycle, shape.n_embd, locality)
    # large embeddings: the layers' unit-gain noise stays ~10% of the residual stream
    embd_rms = 10.0 * math.sqrt(shape.n_layer)
    token_embd = (directions * embd_rms * math.sqrt(shape.n_embd)).astype(np.float32)
    # output head: logit(j) = <z of j's cycle predecessor, hidden>, so greedy follows the cycle;
    # special tokens get zero logits and are never picked
    output = np.zeros((n_vocab, shape.n_embd), dtype=np.float32)
    output[np.roll(cycle, -1)] = z[cycle] * (8.0 / math.sqrt(shape.n_embd))
    return {"token_embd.weight": token_embd, "output.weight": output}


def _tensor_jobs(w, shape: Shape, dense: dict[str, np.ndarray],
                 seed: int) -> list[Callable[[], np.ndarray]]:
    """Every tensor's info into w; returns a function per tensor that makes its data."""
    import gguf

    Q4_0 = gguf.GGMLQuantizationType.Q4_0
    jobs: list[Callable[[], np.ndarray]] = []
    for index, (name, kind, dims, n_in) in enumerate(_tensor_plan(shape, len(tiny_vocab()[0]))):
        if kind == "q4_0":
            byte_dims = dims[:-1] + (n_in // Q4_0_BLOCK * Q4_0_BLOCK_BYTES,)
            w.add_tensor_info(name, byte_dims, np.dtype(np.uint8), _nbytes(kind, dims), raw_dtype=Q4_0)
            jobs.append(lambda i=index, d=dims, n=n_in: random_q4_0((seed, 0x5E7, 1, i), d, n))
        else:
            w.add_tensor_info(name, dims, np.dtype(np.float32), _nbytes(kind, dims))
            jobs.append(_f32_job(name, dims, dense, (seed, 0x5E7, 2, index)))
    return jobs


# F32 tensors drawn at random (the rest are norms of ones, or zero biases and sinks)
_RANDOM_F32 = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")


def _f32_job(name: str, dims: tuple[int, ...], dense: dict[str, np.ndarray],
             seed_seq: tuple[int, ...]) -> Callable[[], np.ndarray]:
    if name in dense:
        return lambda: dense[name]
    if name.endswith(_RANDOM_F32):
        # e.g. a random router: top-k depends only on the direction of the hidden state
        return lambda: (np.random.default_rng(list(seed_seq)).standard_normal(dims, dtype=np.float32)
                        / np.float32(math.sqrt(dims[-1])))
    if name.endswith((".bias", "attn_sinks.weight")):
        return lambda: np.zeros(dims, dtype=np.float32)
    if name.endswith("ssm_a"):  # the gated delta net's decay rate, -A: a moderate forgetting
        return lambda: np.full(dims, -1.0, dtype=np.float32)
    return lambda: np.ones(dims, dtype=np.float32)  # norms


def _generate(jobs: list[Callable[[], np.ndarray]], threads: int):
    """The jobs' arrays in order, generated ahead on `threads` threads (numpy's generators
    release the GIL)."""
    with ThreadPoolExecutor(max_workers=threads) as pool:
        pending: collections.deque = collections.deque()
        for job in jobs:
            pending.append(pool.submit(job))
            if len(pending) > threads:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
