"""What a cache is sized from, read before it is planned: the model's architecture and expert
count, its expert tensors' types and shapes (from its GGUF), the devices' free memory and, for a
memory budget, which layers libllama caches and on which device.

libllama says which layers it caches only of a cache it has allocated: a budget is probed with a
trial allocation of one slot per layer, released before the probe returns."""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass

from . import ggml, native
from .config import CacheConfig

# the per-expert tensors libllama banks, in its order (llama_moe_banked in
# native/llama/llama-moe-layer.cpp): every tensor of the expert FFN but the down bias, which the
# graph adds after the merge
BANKED_TENSORS = ("ffn_up_exps.weight", "ffn_gate_exps.weight", "ffn_gate_up_exps.weight",
                  "ffn_down_exps.weight", "ffn_up_exps.bias", "ffn_gate_exps.bias",
                  "ffn_gate_up_exps.bias", "ffn_up_exps.scale", "ffn_gate_exps.scale",
                  "ffn_down_exps.scale")
BANKED = re.compile(r"blk\.(\d+)\.(%s)" % "|".join(re.escape(n) for n in BANKED_TENSORS))
NO_LAYERS = "libllama cached no layer (its log says why); decoding stays stock"


class CacheUnavailable(RuntimeError):
    """This context gets no cache (the reason is the message); decoding stays stock."""


@dataclass(frozen=True)
class CachedLayer:
    """A layer libllama caches, as llama_moe_cache_layer_info reports it."""
    il: int             # the model layer
    n_expert: int
    n_expert_used: int
    expert_bytes: int   # one expert's banked tensors (weights, biases, scales)
    from_file: bool     # its slots are read from the model file (repacked, or mapped and unread)
    device: str         # the buffer type holding its slots


def cached_layers(ctx, tier=native.DEVICE) -> list[CachedLayer]:
    """The layers of ctx's allocated cache of the tier, in libllama's order (none when it has no
    cache)."""
    lib, ffi = native.lib(), native.ffi
    info = ffi.new("struct llama_moe_cache_layer_info *")
    layers = []
    for i in range(lib.llama_moe_cache_n_layers(ctx, tier)):
        if not lib.llama_moe_cache_layer_info(ctx, tier, i, info):
            raise CacheUnavailable(f"no info for cached layer {i}")
        layers.append(CachedLayer(info.il, info.n_expert, info.n_expert_used, int(info.expert_bytes),
                                  bool(info.from_file), ffi.string(info.device).decode(errors="replace")))
    return layers


class Devices:
    """The non-CPU ggml devices by the name of their buffer type (what libllama's layer info
    names), with the free memory each reported when this was made."""

    def __init__(self):
        self.by_buffer = {}
        for dev in ggml.devices():
            if ggml.device_type(dev) != ggml.GGML_BACKEND_DEVICE_TYPE_CPU:
                buft = ggml.device_buffer_type(dev)
                self.by_buffer[ggml.buffer_type_name(buft)] = (dev, buft)
        self.free = {name: self._free(dev) for name, (dev, _) in self.by_buffer.items()}

    @staticmethod
    def _free(dev) -> int | None:
        free, total = ggml.device_memory(dev)
        return None if free == 0 and total == 0 else free

    def free_now(self, name: str) -> int | None:
        return self._free(self.by_buffer[name][0]) if name in self.by_buffer else None


@dataclass(frozen=True)
class ModelFacts:
    """What probe found: the cache's plan is made from these alone."""
    arch: str
    n_expert: int                    # experts per layer, from the model's metadata
    path: str | None                 # its GGUF, when known
    shapes: dict[int, tuple[tuple[int, ...], ...]]  # {model layer: its banked tensors}, see expert_shapes
    shapes_problem: str | None       # why shapes is empty
    devices: Devices                 # their free memory before the cache
    trial: list[CachedLayer] | None  # the layers a budget's trial allocation cached; None: SLOTS=K


def probe(ctx, config: CacheConfig, model_path: str | None) -> ModelFacts:
    """The facts config's cache of ctx is planned from; ctx is left without a cache. Raises
    CacheUnavailable for a model without experts, or one libllama caches no layer of."""
    arch = native.model_metadata(ctx, "general.architecture") or "unknown"
    n_expert = native.model_metadata(ctx, f"{arch}.expert_count")
    if not n_expert or int(n_expert) == 0:
        raise CacheUnavailable(f"model architecture '{arch}' has no experts")
    devices = Devices()  # before the trial, which takes some of their memory
    trial = _trial(ctx, config) if config.budget_mib is not None else None
    shapes, problem = _model_shapes(model_path)
    return ModelFacts(arch, int(n_expert), model_path, shapes, problem, devices, trial)


def _trial(ctx, config: CacheConfig) -> list[CachedLayer]:
    if native.init(ctx, 1, max_batch=config.max_batch) <= 0:
        raise CacheUnavailable(NO_LAYERS)
    try:
        return cached_layers(ctx)
    finally:
        native.init(ctx, 0)


def _model_shapes(path: str | None):
    """expert_shapes(path), and why it is empty."""
    if not path:
        return {}, "sizing by memory needs the model's GGUF file: attach a llama_cpp.Llama"
    try:
        shapes = expert_shapes(path)
    except Exception as e:  # noqa: BLE001 - gguf-py may not read what llama.cpp did (a newer type)
        return {}, cannot_size(path, e)
    return shapes, None if shapes else f"no routed expert tensors in {path}"


def cannot_size(path: str, error: Exception) -> str:
    return f"cannot size the cache from {path}: {type(error).__name__}: {error}"


# --- the model's file ----------------------------------------------------------------------------

_model_files: dict[int, str] = {}  # llama_model address -> the GGUF it was loaded from


def track_model_files() -> None:
    """Remember the file of every model llama_cpp loads from now on (libllama does not say which
    file a model came from; zero-code activation only sees the context)."""
    import llama_cpp
    import llama_cpp.llama_cpp as bindings

    if hasattr(bindings.llama_model_load_from_file, "stock"):
        return
    stock = bindings.llama_model_load_from_file

    def llama_model_load_from_file(path_model, params, /):
        model = stock(path_model, params)
        if model:
            _model_files[model] = path_model.decode(errors="surrogateescape")
        return model

    llama_model_load_from_file.stock = stock
    bindings.llama_model_load_from_file = llama_cpp.llama_model_load_from_file = llama_model_load_from_file


def model_file(ctx) -> str | None:
    """The GGUF of a context's model, when track_model_files saw it loaded."""
    model = native.lib().llama_get_model(native.as_context(ctx))
    return _model_files.get(int(native.ffi.cast("uintptr_t", model)))


def expert_shapes(path: str) -> dict[int, tuple[tuple[int, ...], ...]]:
    """{model layer: ((ggml type, ne...) of each banked tensor, in libllama's order)} for the
    layers with routed experts, read from the GGUF at path (and its other split files); the
    dimensions stop before the last one, which indexes the experts."""
    found: dict[int, dict[str, tuple[int, ...]]] = {}
    for part in split_files(path):
        for name, ggml_type, ne, _ in gguf_header(part)[1]:
            match = BANKED.fullmatch(name)
            if match:
                found.setdefault(int(match[1]), {})[match[2]] = (ggml_type, *ne[:-1])
    return {il: tuple(parts[name] for name in BANKED_TENSORS if name in parts)
            for il, parts in sorted(found.items())
            if "ffn_down_exps.weight" in parts
            and ("ffn_up_exps.weight" in parts or "ffn_gate_up_exps.weight" in parts)}


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def gguf_header(path: str) -> tuple[dict, list[tuple[str, int, tuple[int, ...], int]]]:
    """A GGUF's metadata (scalars and strings by key; arrays left out) and its tensors' (name,
    ggml type, ne, bytes), read from its header as a stream: in the memory of what it keeps
    (gguf's GGUFReader maps the file and makes objects of every field: a large vocabulary takes
    tens of MiB, more than a process sized to a tight memory limit has). ValueError for a file
    that is not a GGUF, OSError for one that cannot be read."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f:
        def read(fmt):
            size = struct.calcsize(fmt)
            data = f.read(size)
            if len(data) != size:
                raise ValueError(f"{path}: cut short in its GGUF header")
            return struct.unpack(fmt, data)[0]

        def string():
            return f.read(read("<Q")).decode("utf-8", "replace")

        def value(kind):
            if kind == _STRING:
                return string()
            if kind == _ARRAY:
                item, n = read("<I"), read("<Q")
                for _ in range(n):
                    value(item)
                return None
            if kind not in _SCALARS:
                raise ValueError(f"{path}: GGUF value type {kind} unknown")
            return read(_SCALARS[kind])

        if f.read(4) != b"GGUF" or read("<I") < 2:
            raise ValueError(f"{path}: not a GGUF file (version 2 or later)")
        n_tensors, n_kv = read("<Q"), read("<Q")
        meta = {}
        for _ in range(n_kv):
            key = string()
            found = value(read("<I"))
            if found is not None:
                meta[key] = found
        tensors = []
        for _ in range(n_tensors):
            name = string()
            ne = tuple(read("<Q") for _ in range(read("<I")))
            ggml_type = read("<I")
            read("<Q")  # the data's offset
            try:
                block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            except (ValueError, KeyError):
                raise ValueError(f"{path}: tensor {name} has a ggml type ({ggml_type}) gguf does not know") from None
            tensors.append((name, ggml_type, ne, math.prod(ne) // block * size))
    return meta, tensors


def split_files(path: str) -> list[str]:
    """path, or every file of a split GGUF (llama.cpp's NAME-00001-of-00003.gguf naming)."""
    match = re.fullmatch(r"(.*)-(\d{5})-of-(\d{5})\.gguf", path)
    if not match:
        return [path]
    return [f"{match[1]}-{i:05d}-of-{match[3]}.gguf" for i in range(1, int(match[3]) + 1)]
