"""ctypes access to the ggml libraries that libllama itself uses (same files, same registry).

libllama names libggml.so.0 in its NEEDED entries; the wheel also ships libggml.so and the
versioned file as separate copies, and loading one of those would create a second backend
registry, so only the .so.0 names are opened here."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
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
GGML_BACKEND_DEVICE_TYPE_IGPU = 2


def has_gpu() -> bool:
    """Whether ggml has a GPU device (registered RPC devices count too)."""
    return any(device_type(dev) == GGML_BACKEND_DEVICE_TYPE_GPU for dev in devices())


@functools.lru_cache(maxsize=None)
def _api() -> ctypes.CDLL:
    """libggml-base with the signatures of the device, buffer type and tensor calls used here
    (the registry's own calls, ggml_backend_dev_count/get, are in libggml)."""
    lib = libggml_base()
    for name, restype, argtypes in (
            ("ggml_backend_dev_name", ctypes.c_char_p, [ctypes.c_void_p]),
            ("ggml_backend_dev_type", ctypes.c_int, [ctypes.c_void_p]),
            ("ggml_backend_dev_memory", None, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                                ctypes.POINTER(ctypes.c_size_t)]),
            ("ggml_backend_buft_name", ctypes.c_char_p, [ctypes.c_void_p]),
            ("ggml_backend_buft_get_alignment", ctypes.c_size_t, [ctypes.c_void_p]),
            ("ggml_tensor_overhead", ctypes.c_size_t, []),
            ("ggml_init", ctypes.c_void_p, [_InitParams]),
            ("ggml_free", None, [ctypes.c_void_p]),
            ("ggml_new_tensor_3d", ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64,
                                                     ctypes.c_int64, ctypes.c_int64]),
            ("ggml_backend_alloc_ctx_tensors_from_buft_size", ctypes.c_size_t, [ctypes.c_void_p, ctypes.c_void_p])):
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    registry = libggml()
    registry.ggml_backend_dev_count.restype = ctypes.c_size_t
    registry.ggml_backend_dev_get.restype = ctypes.c_void_p
    registry.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    return lib


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


def devices() -> list[int]:
    """Every device ggml has registered, in registry order."""
    _api()
    registry = libggml()
    return [registry.ggml_backend_dev_get(i) for i in range(registry.ggml_backend_dev_count())]


def device_type(dev: int) -> int:
    return _api().ggml_backend_dev_type(dev)


def device_name(dev: int) -> str:
    return _api().ggml_backend_dev_name(dev).decode(errors="replace")


def device_memory(dev: int) -> tuple[int, int]:
    """(free, total) bytes as the device reports them; (0, 0): it reports nothing."""
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    _api().ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
    return free.value, total.value


def device_buffer_type(dev: int) -> int:
    return libggml_base().ggml_backend_dev_buffer_type(dev)


def buffer_type_name(buft: int) -> str:
    return _api().ggml_backend_buft_name(buft).decode(errors="replace")


def buffer_type_alignment(buft: int) -> int:
    return _api().ggml_backend_buft_get_alignment(buft)


def buffer_bytes(buft: int, tensors) -> int:
    """The size of the buffer(s) ggml_backend_alloc_ctx_tensors_from_buft would allocate in
    `buft` for tensors [(ggml type, ne0, ne1, ne2), ...] created in this order: each tensor's
    alloc size in that buffer type, padded to its alignment (ggml's own computation)."""
    tensors = list(tensors)
    api = _api()
    ctx = api.ggml_init(_InitParams(api.ggml_tensor_overhead() * max(1, len(tensors)), None, True))
    if not ctx:
        raise MemoryError("ggml_init failed")
    try:
        for ggml_type, ne0, ne1, ne2 in tensors:
            if not api.ggml_new_tensor_3d(ctx, ggml_type, ne0, ne1, ne2):
                raise ValueError(f"ggml cannot make a tensor of type {ggml_type} [{ne0}, {ne1}, {ne2}]")
        return api.ggml_backend_alloc_ctx_tensors_from_buft_size(ctx, buft) if tensors else 0
    finally:
        api.ggml_free(ctx)


GGML_TYPE_I8 = 24


@dataclass
class LinkTimings:
    """Seconds of each timed transfer between host memory and a device buffer (link_timings)."""

    pageable: list[float]        # the expert's bytes from pageable host memory
    pinned: list[float] | None   # the same from the device's host buffer type (pinned), None: it has none
    ids_trip: list[float]        # IDS_BYTES back from the device: a layer's router ids reaching the host
    upload: list[float] | None   # read_into's read into the staging memory, then the copy from it


IDS_BYTES = 8 * 4  # a decode token's top-8 expert ids, int32


def _buffer_api():
    """ggml with the buffer and tensor calls link_timings makes declared."""
    api = _api()
    for name, restype, argtypes in (
            ("ggml_backend_buft_alloc_buffer", ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t]),
            ("ggml_backend_buffer_get_base", ctypes.c_void_p, [ctypes.c_void_p]),
            ("ggml_backend_buffer_free", None, [ctypes.c_void_p]),
            ("ggml_backend_dev_host_buffer_type", ctypes.c_void_p, [ctypes.c_void_p]),
            ("ggml_new_tensor_1d", ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]),
            ("ggml_backend_tensor_alloc", ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]),
            ("ggml_backend_tensor_set", None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]),
            ("ggml_backend_tensor_get", None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t])):
        function = getattr(api, name)
        function.restype, function.argtypes = restype, argtypes
    return api


def link_timings(dev: int, buft: int, data, copies: int, read_into=None) -> LinkTimings:
    """`copies` timed ggml_backend_tensor_set calls (libllama's upload call, synchronous) of the
    bytes of `data` (a contiguous numpy array in host memory) into a buffer of type buft on
    device dev, made for them and freed after; as many from a copy of data in the device's host
    buffer type when it has one (pinned memory on CUDA); as many ggml_backend_tensor_get calls of
    IDS_BYTES from that buffer; and with read_into(address, size), as many uploads as libllama's
    worker makes them for experts it reads from a model file: read_into fills its staging memory
    (the device's host buffer type where it has one, else pageable memory), then the copy."""
    import time

    import numpy as np

    api = _buffer_api()
    size = data.nbytes
    ctx = api.ggml_init(_InitParams(api.ggml_tensor_overhead(), None, True))
    if not ctx:
        raise MemoryError("ggml_init failed")
    buffers = []

    def timed(call) -> list[float]:
        seconds = []
        for _ in range(copies):
            t0 = time.perf_counter()
            call()
            seconds.append(time.perf_counter() - t0)
        return seconds

    try:
        tensor = api.ggml_new_tensor_1d(ctx, GGML_TYPE_I8, max(size, IDS_BYTES))
        buffers.append(api.ggml_backend_buft_alloc_buffer(buft, max(size, IDS_BYTES)))
        if not tensor or not buffers[-1]:
            raise MemoryError(f"cannot allocate {size} bytes in {buffer_type_name(buft)}")
        if api.ggml_backend_tensor_alloc(buffers[-1], tensor, api.ggml_backend_buffer_get_base(buffers[-1])) != 0:
            raise MemoryError(f"cannot place a tensor of {size} bytes in {buffer_type_name(buft)}")
        pageable = timed(lambda: api.ggml_backend_tensor_set(tensor, data.ctypes.data, 0, size))
        pinned, staging = None, data.ctypes.data
        host_buft = api.ggml_backend_dev_host_buffer_type(dev)
        if host_buft:
            buffers.append(api.ggml_backend_buft_alloc_buffer(host_buft, size))
            if buffers[-1]:
                staging = source = api.ggml_backend_buffer_get_base(buffers[-1])
                ctypes.memmove(source, data.ctypes.data, size)
                pinned = timed(lambda: api.ggml_backend_tensor_set(tensor, source, 0, size))
        ids = np.empty(IDS_BYTES, dtype=np.uint8)
        ids_trip = timed(lambda: api.ggml_backend_tensor_get(tensor, ids.ctypes.data, 0, IDS_BYTES))
        upload = None
        if read_into is not None:
            upload = timed(lambda: (read_into(staging, size), api.ggml_backend_tensor_set(tensor, staging, 0, size)))
        return LinkTimings(pageable, pinned, ids_trip, upload)
    finally:
        for buffer in buffers:
            if buffer:
                api.ggml_backend_buffer_free(buffer)
        api.ggml_free(ctx)
