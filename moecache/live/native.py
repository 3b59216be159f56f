"""The moecache C API of the patched libllama, opened through cffi (declarations: native/)."""

from __future__ import annotations

import functools

from .._native import ffi

# the patch series (patches/) this package was built with, as llama_moe_cache_version() reports it
PATCH_VERSION = str(ffi.integer_const("LLAMA_MOE_CACHE_VERSION"))

# a context's two caches, as the C API names them: slots on a device, and the RAM tier
DEVICE = ffi.integer_const("LLAMA_MOE_CACHE_TIER_DEVICE")
RAM = ffi.integer_const("LLAMA_MOE_CACHE_TIER_RAM")


class NotPatchedError(RuntimeError):
    """The loaded libllama is not the moecache-patched build this package needs."""


@functools.lru_cache(maxsize=None)
def lib():
    """The libllama that llama_cpp loaded (same file, so the same handle and backend registry)."""
    import llama_cpp.llama_cpp as llama_cpp_lib

    path = llama_cpp_lib._lib._name
    handle = ffi.dlopen(path)
    try:
        version = ffi.string(handle.llama_moe_cache_version()).decode()
    except (AttributeError, ffi.error):  # not declared / not in the library
        version = None
    if version != PATCH_VERSION:
        found = f"patch series {version}" if version else "no llama_moe_cache_version"
        raise NotPatchedError(f"{path} is not the moecache-patched libllama this package needs ({found}, "
                              f"expected {PATCH_VERSION}): install the wheel that scripts/build_wheel.sh builds")
    return handle


def patch_version() -> str:
    return ffi.string(lib().llama_moe_cache_version()).decode()


def init(ctx, slots: int, *, max_batch: int = 32, in_ram: bool = False, read_ahead: bool = True) -> int:
    """llama_moe_cache_init: allocate `slots` empty slots per cached layer for ubatches of up to
    max_batch tokens (in_ram: the RAM tier, which keeps `slots` experts per layer in host memory
    and observes every ubatch; read_ahead: it reads each layer's predicted experts while the layer
    before computes); the number of cached layers, 0 when none (libllama logs why).
    slots=0 releases the cache: the stock graph from the next decode on. Each tier has its own
    cache: this one replaces (or releases) only the cache of its tier."""
    params = lib().llama_moe_cache_default_params()
    params.n_slots = slots
    params.max_batch = max_batch
    params.in_ram = in_ram
    params.read_ahead = read_ahead
    return lib().llama_moe_cache_init(as_context(ctx), params)


def as_context(ctx) -> "ffi.CData":
    """A llama_context pointer from llama_cpp's ctypes handle, an int address or a cffi pointer."""
    if isinstance(ctx, ffi.CData):
        return ctx
    address = ctx if isinstance(ctx, int) else getattr(ctx, "value", None)
    if not address:
        raise ValueError(f"not a llama_context pointer: {ctx!r}")
    return ffi.cast("struct llama_context *", address)


def model_metadata(ctx, key: str) -> str | None:
    buf = ffi.new("char[]", 256)
    n = lib().llama_model_meta_val_str(lib().llama_get_model(ctx), key.encode(), buf, 256)
    # "replace": metadata need not be UTF-8, and a long value is cut at 255 bytes, maybe mid-character
    return ffi.string(buf).decode(errors="replace") if n >= 0 else None


READ_COUNTERS = {"read_bytes": "upload_bytes", "read_ahead": "read_ahead", "read_ahead_used": "read_ahead_used",
                 "read_ahead_bytes": "read_ahead_bytes", "read_ahead_wasted_bytes": "read_ahead_wasted_bytes",
                 "read_wait_us": "read_wait_us"}


def read_counters(ctx, tier: int, n_layers: int) -> list[dict]:
    """The RAM tier's reads, per cached layer, as libllama counts them (llama_moe_cache_counters):
    bytes read from the model file, experts read ahead, of them selected, their bytes, the bytes of
    those not selected, and the time the layer's matmuls waited for its reads."""
    counters = ffi.new("struct llama_moe_cache_counters *")
    out = []
    for i in range(n_layers):
        lib().llama_moe_cache_get_counters(ctx, tier, i, counters)
        out.append({name: getattr(counters, field) for name, field in READ_COUNTERS.items()})
    return out
