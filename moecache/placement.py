"""Placement for the expert cache: experts in host memory (llama.cpp's --cpu-moe), the rest on
the device (n_gpu_layers=-1). llama-cpp-python leaves tensor_buft_overrides unexposed, so the
override goes into the model parameters Llama starts from (llama_model_default_params): within a
block (experts_on_host) or, for zero-code activation, for the rest of the process
(place_experts_on_host). libllama itself reads no environment variable for this."""

from __future__ import annotations

import contextlib
import ctypes
import functools

import llama_cpp
import llama_cpp.llama_cpp as llama_cpp_lib

from . import ggml

# the pattern of llama.cpp's --cpu-moe
CPU_MOE_PATTERN = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"


class _BuftOverride(ctypes.Structure):
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def expert_overrides(pattern: str = CPU_MOE_PATTERN) -> ctypes.Array:
    """A NULL-terminated llama_model_tensor_buft_override array: tensors matching `pattern`
    (regex_search on the tensor name) go to the CPU buffer type."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"pattern must be a non-empty regex string, got {pattern!r}")
    return _overrides(pattern)


@functools.lru_cache(maxsize=None)  # one array per pattern, alive for the process: llama.cpp reads it while a model loads
def _overrides(pattern: str) -> ctypes.Array:
    return (_BuftOverride * 2)(_BuftOverride(pattern.encode(), ggml.cpu_buffer_type()), _BuftOverride(None, None))


def apply(params: llama_cpp_lib.llama_model_params, *, repack: bool = False) -> llama_cpp_lib.llama_model_params:
    """Put the experts of `params` in host memory. repack=False keeps them in plain (standard
    layout) buffers, which the cache needs; repack=True lets llama.cpp repack them for faster
    CPU kernels, as stock --cpu-moe does (the cache then skips those layers)."""
    if not isinstance(repack, bool):
        raise ValueError(f"repack must be True or False, got {repack!r}")
    params.tensor_buft_overrides = ctypes.cast(expert_overrides(), ctypes.c_void_p)
    params.use_extra_bufts = repack
    return params


@contextlib.contextmanager
def experts_on_host(*, repack: bool = False):
    """Within this block, llama_cpp.Llama(...) loads models with their experts in host memory:

        with moecache.experts_on_host():
            llm = llama_cpp.Llama(model_path, n_gpu_layers=-1)
    """
    stock = place_experts_on_host(repack=repack)
    try:
        yield
    finally:
        _set_default_params(stock)


def place_experts_on_host(*, repack: bool = False):
    """From now on llama_cpp.Llama(...) loads models with their experts in host memory (what
    LLAMA_MOE_CACHE_SLOTS does). Returns the default-params function it replaced."""
    if not isinstance(repack, bool):
        raise ValueError(f"repack must be True or False, got {repack!r}")
    stock = llama_cpp_lib.llama_model_default_params

    def default_params():
        return apply(stock(), repack=repack)

    _set_default_params(default_params)
    return stock


def _set_default_params(function) -> None:
    llama_cpp_lib.llama_model_default_params = function  # what Llama calls
    llama_cpp.llama_model_default_params = function
