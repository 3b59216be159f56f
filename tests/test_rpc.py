"""The loopback RPC device registers only the server it started (ggml-rpc has no authentication
and no timeout: another listener would get the model's tensors, a silent one hang the client)."""

from __future__ import annotations

import socket

import pytest

pytest.importorskip("llama_cpp")

from moecache.live.rpc import RpcDevice  # noqa: E402


def test_a_process_that_took_the_port_first_is_not_registered():
    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    squatter.setblocking(False)
    port = squatter.getsockname()[1]
    try:  # as if it had won the window between choosing the port and the server binding it
        with pytest.raises(RuntimeError, match=f"127.0.0.1:{port}"):
            RpcDevice(threads=1, port=port)
        with pytest.raises(BlockingIOError):
            squatter.accept()  # nothing connected to it
    finally:
        squatter.close()

