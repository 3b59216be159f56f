"""A loopback ggml RPC device: a CPU backend served by a subprocess on 127.0.0.1 that llama.cpp
treats as a GPU. It is the test device on machines without one: with the experts in host memory
and everything else on it, the expert cache runs its real device path on CPU kernels.

    with RpcDevice() as dev:          # or start_rpc_device(); register before loading a model
        llm = Llama(path, n_gpu_layers=-1)
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

from . import ggml
from .util import OneLineParser, int_arg

_registered: list["RpcDevice"] = []


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RpcDevice:
    """Starts the server subprocess and registers it with this process's ggml. The server dies
    with this process; close() stops it earlier. A registered device cannot be unregistered from
    ggml: close() only once every model and context that use it are freed."""

    def __init__(self, *, threads: int | None = None, timeout: float = 30.0):
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads must be a positive integer, got {threads!r}")
        self.endpoint = f"127.0.0.1:{_free_port()}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moecache.rpc", "--serve", self.endpoint,
             "--lib-dir", str(ggml.lib_dir()), "--threads", str(threads or os.cpu_count() or 1)],
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
        host, port = self.endpoint.split(":")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace").strip().splitlines()
                raise RuntimeError(f"RPC server exited with {self.process.returncode}: {err[-1] if err else ''}")
            try:
                socket.create_connection((host, int(port)), timeout=0.2).close()
                return
            except OSError:
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


def _serve(endpoint: str, lib_dir: Path, threads: int) -> None:
    # die with the parent, even if it is killed
    libc = ctypes.CDLL(None)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:
        return
    devices = (ctypes.c_void_p * 1)(ggml.cpu_device(lib_dir))
    ggml.libggml_rpc(lib_dir).ggml_backend_rpc_start_server(endpoint.encode(), None, threads, 1, devices)


if __name__ == "__main__":
    parser = OneLineParser(description="serve this machine's CPU as a ggml RPC device")
    parser.add_argument("--serve", required=True, metavar="HOST:PORT")
    parser.add_argument("--lib-dir", required=True, type=Path)
    parser.add_argument("--threads", type=int_arg(minimum=1), default=os.cpu_count() or 1)
    args = parser.parse_args()
    _serve(args.serve, args.lib_dir, args.threads)
