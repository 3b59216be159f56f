"""ctypes access to the ggml libraries that libllama itself uses (same files, same registry).

libllama names libggml.so.0 in its NEEDED entries; the wheel also ships libggml.so and the
versioned file as separate copies, and loading one of those would create a second backend
registry, so only the .so.0 names are opened here."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

GGML_BACKEND_DEVICE_TYPE_CPU = 0


@functools.lru_cache(maxsize=None)
def lib_dir() -> Path:
    import llama_cpp.llama_cpp as llama_cpp_lib

    return Path(llama_cpp_lib._lib._name).resolve().parent


@functools.lru_cache(maxsize=None)
def _open(name: str, directory: Path | None = None) -> ctypes.CDLL:
    path = (directory or lib_dir()) / name
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: is llama_cpp the moecache-patched build with GGML_RPC=ON?")
    return ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)


def libggml(directory: Path | None = None) -> ctypes.CDLL:
    lib = _open("libggml.so.0", directory)
    lib.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    lib.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    lib.ggml_backend_register.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_register.restype = None
    return lib


def libggml_base(directory: Path | None = None) -> ctypes.CDLL:
    lib = _open("libggml-base.so.0", directory)
    lib.ggml_backend_dev_buffer_type.restype = ctypes.c_void_p
    lib.ggml_backend_dev_buffer_type.argtypes = [ctypes.c_void_p]
    return lib


def libggml_cpu(directory: Path | None = None) -> ctypes.CDLL:
    return _open("libggml-cpu.so.0", directory)


def libggml_rpc(directory: Path | None = None) -> ctypes.CDLL:
    lib = _open("libggml-rpc.so.0", directory)
    lib.ggml_backend_rpc_add_server.restype = ctypes.c_void_p
    lib.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
    lib.ggml_backend_rpc_start_server.restype = None
    lib.ggml_backend_rpc_start_server.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                                                  ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)]
    return lib


def cpu_device(directory: Path | None = None) -> int:
    dev = libggml(directory).ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)
    if not dev:
        raise RuntimeError("ggml has no CPU device")
    return dev


def cpu_buffer_type() -> int:
    return libggml_base().ggml_backend_dev_buffer_type(cpu_device())


GGML_BACKEND_DEVICE_TYPE_GPU = 1


def has_gpu() -> bool:
    """Whether ggml has a GPU device (registered RPC devices count too)."""
    lib = libggml()
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    return any(lib.ggml_backend_dev_type(lib.ggml_backend_dev_get(i)) == GGML_BACKEND_DEVICE_TYPE_GPU
               for i in range(lib.ggml_backend_dev_count()))
