"""A loopback ggml RPC device: a CPU backend served by a subprocess on 127.0.0.1 that llama.cpp
treats as a GPU. It is the test device on machines without one: with the experts in host memory
and everything else on it, the expert cache runs its real device path on CPU kernels.

    with RpcDevice() as dev:          # or start_rpc_device(); register before loading a model
        llm = Llama(path, n_gpu_layers=-1)

RpcDevice(memory_mib=N) makes it a device of N MiB, as a GPU is: it reports N MiB less what is
allocated on it as free memory, and an allocation that does not fit fails. memory_mib=0 makes a
device that reports no memory (as ggml devices may); the default reports the CPU's.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ..util import OneLineParser, int_arg, parse_int
from . import ggml

_registered: list["RpcDevice"] = []


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening_inode(port: int) -> int | None:
    """The socket inode of the TCP listener on 127.0.0.1:port (Linux's /proc/net/tcp), or None."""
    wanted = f"0100007F:{port:04X}"
    try:
        with open("/proc/net/tcp") as f:
            lines = f.readlines()[1:]
    except OSError as e:
        raise RuntimeError(f"the loopback RPC device needs Linux's /proc/net/tcp to check who listens "
                           f"on its port: {e.strerror}") from None
    for line in lines:
        fields = line.split()
        if fields[1] == wanted and fields[3] == "0A":  # local address, state LISTEN
            return int(fields[9])
    return None


def _owns_socket(pid: int, inode: int) -> bool:
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:  # exited meanwhile
        return False
    for fd in fds:
        try:
            if os.readlink(f"{fd_dir}/{fd}") == f"socket:[{inode}]":
                return True
        except OSError:
            continue
    return False


class RpcDevice:
    """Starts the server subprocess and registers it with this process's ggml. The server dies
    with this process; close() stops it earlier. A registered device cannot be unregistered from
    ggml: close() only once every model and context that use it are freed."""

    def __init__(self, *, threads: int | None = None, timeout: float = 30.0, memory_mib: int | None = None,
                 port: int | None = None):
        """port: where the server listens (default: a free one)."""
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads must be a positive integer, got {threads!r}")
        memory = [] if memory_mib is None else ["--memory-mib", str(parse_int(memory_mib, "memory_mib", minimum=0))]
        port = _free_port() if port is None else parse_int(port, "port", minimum=1, maximum=65535)
        self.endpoint = f"127.0.0.1:{port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moecache.live.rpc", "--serve", self.endpoint,
             "--lib-dir", str(ggml.lib_dir()), "--threads", str(threads or os.cpu_count() or 1), *memory],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
            # the server idles between graphs: spinning OpenMP threads would starve the client
            env={**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "passive")})
        try:
            self._wait_listening(timeout)
        except BaseException:
            self.close()
            raise
        reg = ggml.libggml_rpc().ggml_backend_rpc_add_server(self.endpoint.encode())
        if not reg:
            self.close()
            raise RuntimeError(f"ggml_backend_rpc_add_server({self.endpoint}) failed")
        ggml.libggml().ggml_backend_register(reg)
        _registered.append(self)

    def _wait_listening(self, timeout: float) -> None:
        """Until the server listens. ggml-rpc has no authentication and no timeout: whatever
        listens on the port gets the model's tensors, and a silent one hangs the client. So the
        listener must be the child started here; another process that took the port in the
        window between choosing it and the child binding it is an error, never registered."""
        port = int(self.endpoint.rsplit(":", 1)[1])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace").strip().splitlines()
                raise RuntimeError(f"RPC server exited with {self.process.returncode}: {err[-1] if err else ''}")
            inode = _listening_inode(port)
            if inode is not None:
                if not _owns_socket(self.process.pid, inode):
                    raise RuntimeError(f"another process listens on {self.endpoint}, not the RPC server "
                                       f"started here: not registering it")
                return
            time.sleep(0.05)
        raise TimeoutError(f"RPC server on {self.endpoint} did not listen within {timeout:.0f} s")

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        if self.process.stderr:
            self.process.stderr.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def start_rpc_device(**kwargs) -> RpcDevice:
    return RpcDevice(**kwargs)


def _serve(endpoint: str, lib_dir: Path, threads: int, memory_mib: int | None = None) -> None:
    # die with the parent, even if it is killed
    libc = ctypes.CDLL(None)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:
        return
    device = ggml.cpu_device(lib_dir)
    if memory_mib is not None:
        device = _SizedDevice(device, memory_mib << 20, lib_dir).address
    devices = (ctypes.c_void_p * 1)(device)
    ggml.libggml_rpc(lib_dir).ggml_backend_rpc_start_server(endpoint.encode(), None, threads, 1, devices)


# --- a CPU device with a memory size -------------------------------------------------------------
# The structs of ggml-backend-impl.h this needs (the vendored ggml's layout): the server asks its
# backend's device for the free memory and allocates from that device's buffer type, so the
# backend gets a copy of the CPU device whose memory, buffer type and buffers are ours.

_GetMemory = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t))
_InitBackend = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)
_GetBufferType = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
_AllocBuffer = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_FreeBuffer = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _Device(ctypes.Structure):  # struct ggml_backend_device
    _fields_ = [("get_name", ctypes.c_void_p), ("get_description", ctypes.c_void_p),
                ("get_memory", ctypes.c_void_p), ("get_type", ctypes.c_void_p),
                ("get_props", ctypes.c_void_p), ("init_backend", ctypes.c_void_p),
                ("get_buffer_type", ctypes.c_void_p), ("other_calls", ctypes.c_void_p * 8),
                ("reg", ctypes.c_void_p), ("context", ctypes.c_void_p)]


class _BufferType(ctypes.Structure):  # struct ggml_backend_buffer_type
    _fields_ = [("get_name", ctypes.c_void_p), ("alloc_buffer", ctypes.c_void_p),
                ("other_calls", ctypes.c_void_p * 4), ("device", ctypes.c_void_p),
                ("context", ctypes.c_void_p)]


class _Backend(ctypes.Structure):  # struct ggml_backend
    _fields_ = [("guid", ctypes.c_void_p), ("calls", ctypes.c_void_p * 16),
                ("device", ctypes.c_void_p), ("context", ctypes.c_void_p)]


class _SizedDevice:
    """The CPU device with `size` bytes of memory (0: reports none and has no limit)."""

    def __init__(self, cpu: int, size: int, lib_dir: Path):
        self.size, self.used, self.buffers = size, 0, {}  # buffer -> (its free call, bytes)
        self.cpu = _Device.from_address(cpu)
        self.cpu_buft = _BufferType.from_address(ggml.libggml_base(lib_dir).ggml_backend_dev_buffer_type(cpu))
        self.device = _Device.from_buffer_copy(self.cpu)
        self.buft = _BufferType.from_buffer_copy(self.cpu_buft)
        self.address = ctypes.addressof(self.device)
        self.callbacks = [_GetMemory(self._memory), _InitBackend(self._init_backend),
                          _GetBufferType(lambda dev: ctypes.addressof(self.buft)),
                          _AllocBuffer(self._alloc), _FreeBuffer(self._free)]  # kept alive
        as_address = lambda callback: ctypes.cast(callback, ctypes.c_void_p).value  # noqa: E731
        (self.device.get_memory, self.device.init_backend, self.device.get_buffer_type,
         self.buft.alloc_buffer, self._free_address) = map(as_address, self.callbacks)
        self.buft.device = self.address
        if ggml.device_name(self.address) != ggml.device_name(cpu):
            raise RuntimeError("ggml's device struct layout is not the one moecache.live.rpc knows")

    def _memory(self, dev, free, total):
        free[0], total[0] = max(0, self.size - self.used), self.size

    def _init_backend(self, dev, params):
        backend = _InitBackend(self.cpu.init_backend)(ctypes.addressof(self.cpu), params)
        if backend:
            fields = _Backend.from_address(backend)
            if fields.device != ctypes.addressof(self.cpu):  # an exception would not leave a callback
                print("moecache.live.rpc: ggml's backend struct layout is not the one it knows", file=sys.stderr)
                os._exit(3)
            fields.device = self.address
        return backend

    def _alloc(self, buft, size):
        if self.size and size > self.size - self.used:
            return None  # out of memory, as a GPU would be
        buffer = _AllocBuffer(self.cpu_buft.alloc_buffer)(ctypes.addressof(self.cpu_buft), size)
        if buffer:
            slot = ctypes.c_void_p.from_address(buffer)  # struct ggml_backend_buffer: free_buffer first
            self.buffers[buffer] = (slot.value, size)
            slot.value = self._free_address
            self.used += size
        return buffer

    def _free(self, buffer):
        free_buffer, size = self.buffers.pop(buffer)
        self.used -= size
        if free_buffer:
            _FreeBuffer(free_buffer)(buffer)


if __name__ == "__main__":
    parser = OneLineParser(description="serve this machine's CPU as a ggml RPC device")
    parser.add_argument("--serve", required=True, metavar="HOST:PORT")
    parser.add_argument("--lib-dir", required=True, type=Path)
    parser.add_argument("--threads", type=int_arg(minimum=1), default=os.cpu_count() or 1)
    parser.add_argument("--memory-mib", type=int_arg(minimum=0), default=None,
                        help="a device of this many MiB (0: one that reports no memory)")
    args = parser.parse_args()
    _serve(args.serve, args.lib_dir, args.threads, args.memory_mib)
