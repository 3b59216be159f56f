"""Placement for the expert cache: experts in host memory (llama.cpp's --cpu-moe), the rest on
the device (n_gpu_layers=-1). llama-cpp-python leaves tensor_buft_overrides unexposed, so the
override goes into the model parameters Llama loads with (its llama_model_load_from_file call):
within a block (experts_on_host) or, for zero-code activation, for the rest of the process
(place_experts_on_host). libllama itself reads no environment variable for this.

By default the host experts are repacked for the CPU's faster kernels, as stock --cpu-moe does;
the cache then reads the bytes of its slots from the model file, the only place their standard
layout still is. repack=False keeps them in plain buffers (the cache copies them from RAM; the
bit-identical tests use it)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os

import llama_cpp
import llama_cpp.llama_cpp as llama_cpp_lib

from . import ggml

log = logging.getLogger("moecache")

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


def apply(params: llama_cpp_lib.llama_model_params, *, repack: bool = True) -> llama_cpp_lib.llama_model_params:
    """Put the experts of `params` in host memory, repacked (stock --cpu-moe) or in plain
    (standard layout) buffers."""
    _check_repack(repack)
    params.tensor_buft_overrides = ctypes.cast(expert_overrides(), ctypes.c_void_p)
    params.use_extra_bufts = repack
    return params


@contextlib.contextmanager
def experts_on_host(*, repack: bool = True):
    """Within this block, llama_cpp.Llama(...) loads models with their experts in host memory:

        with moecache.experts_on_host():
            llm = llama_cpp.Llama(model_path, n_gpu_layers=-1)
    """
    stock = place_experts_on_host(repack=repack)
    try:
        yield
    finally:
        _set_loader(stock)


def place_experts_on_host(*, repack: bool = True):
    """From now on llama_cpp.Llama(...) loads models with their experts in host memory (what
    LLAMA_MOE_CACHE_SLOTS does). Returns the loader function it replaced. A repacked model whose
    path is not a regular readable file (no source for the slots' bytes) is loaded with plain
    buffers instead, with one logged line."""
    _check_repack(repack)
    stock = llama_cpp_lib.llama_model_load_from_file

    def load(path_model, params):
        return stock(path_model, apply(params, repack=repack and _file_source(path_model)))

    _set_loader(load)
    return stock


def apply_from_file(params: llama_cpp_lib.llama_model_params) -> llama_cpp_lib.llama_model_params:
    """The RAM tier's placement: the experts in host memory in plain buffers (as apply, for a device
    cache over the tier), their weights mapped and unread (the tier reads the ones it needs),
    everything else read into memory up front (not mapped: memory pressure cannot evict it) and
    placed as the caller asked."""
    from .native import ffi
    apply(params, repack=False)
    params.lazy_mode = ffi.integer_const("LLAMA_LAZY_MODE_EXPERTS")
    params.load_mode = llama_cpp_lib.LLAMA_LOAD_MODE_NONE
    return params


# the models loaded whole although the RAM tier was asked for: their real path -> why (fits, below)
loaded_whole: dict[str, str] = {}


@contextlib.contextmanager
def experts_from_file(fits=None, device_repack: bool | None = None):
    """Within this block, llama_cpp.Llama(...) loads models for the RAM tier (attach(ram_mib=...)):
        with moecache.experts_from_file():
            llm = llama_cpp.Llama(model_path)
    fits, device_repack: as place_experts_in_file's."""
    stock = place_experts_in_file(fits, device_repack)
    try:
        yield
    finally:
        _set_loader(stock)


def place_experts_in_file(fits=None, device_repack: bool | None = None):
    """From now on llama_cpp.Llama(...) loads models for the RAM tier (what LLAMA_MOE_CACHE_RAM_MIB
    does). Returns the loader function it replaced. fits(path): None, or one line saying why the
    model needs no tier (ramtier.fits_whole): such a model loads as it would without the tier (its
    experts on the host for a device cache, repacked or not, where device_repack is not None), noted
    in loaded_whole (the cache says so at the context: llama_cpp silences a load that is not verbose)."""
    stock = llama_cpp_lib.llama_model_load_from_file

    def load(path_model, params):
        path = os.fsdecode(path_model)
        why = fits(path) if fits else None
        if why is None:
            return stock(path_model, apply_from_file(params))
        loaded_whole[os.path.realpath(path)] = why
        if device_repack is not None:
            params = apply(params, repack=device_repack and _file_source(path_model))
        return stock(path_model, params)

    _set_loader(load)
    return stock


def _file_source(path_model) -> bool:
    path = os.fsdecode(path_model)
    if os.path.isfile(path) and os.access(path, os.R_OK):
        return True
    log.warning("moecache: %s is not a readable file to read repacked experts back from: "
                "experts kept in plain buffers", path)
    return False


def _check_repack(repack) -> None:
    if not isinstance(repack, bool):
        raise ValueError(f"repack must be True or False, got {repack!r}")


def _set_loader(function) -> None:
    llama_cpp_lib.llama_model_load_from_file = function  # what Llama calls
    llama_cpp.llama_model_load_from_file = function
