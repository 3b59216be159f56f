"""llama-cpp-python's OpenAI-compatible server with the expert cache, GPU or not:

    LLAMA_MOE_CACHE_SLOTS=16 python -m moecache.serve --model model.gguf [llama_cpp.server flags]

The flags are those of `python -m llama_cpp.server` (--help lists them); --n_gpu_layers defaults
to -1 (all but the experts on the device). On a machine without a GPU the loopback RPC device
(moecache.live.rpc) is started and registered in this process first, so the layers go to it and the
zero-code activation (LLAMA_MOE_CACHE_SLOTS or _MIB) puts the cache on it: exact, not faster. The stock
server cannot do this itself: llama-cpp-python 0.3.36 accepts --rpc_servers but never passes it
on to llama.cpp."""

from __future__ import annotations

import os
import signal
import sys

from ..util import OneLineParser
from .config import CacheConfig, ConfigError

PROG = "python -m moecache.serve"


def _settings_error(error) -> str:
    """A pydantic ValidationError as one line naming the flags."""
    return "; ".join(("--" + ".".join(map(str, e["loc"])) + ": " if e["loc"] else "") + e["msg"]
                     for e in error.errors())


def _exit_on_sigterm(signum, frame):
    sys.exit(128 + signum)  # the status a shell reports for a process the signal ended


def _with_metrics(create_app):
    """llama_cpp.server's create_app, its app given GET /metrics: the expert caches' counters
    as Prometheus text (moecache.live.metrics)."""
    def create(**settings):
        from fastapi import Response
        from prometheus_client import CONTENT_TYPE_LATEST

        from .activate import live_caches
        from .metrics import exposition

        app = create_app(**settings)
        app.add_api_route("/metrics", lambda: Response(exposition(live_caches), media_type=CONTENT_TYPE_LATEST),
                          methods=["GET"], include_in_schema=False)
        return app

    return create


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        import llama_cpp.server.__main__ as server
        from llama_cpp.server.cli import add_args_from_model, parse_model_from_args
        from llama_cpp.server.settings import ModelSettings, ServerSettings, Settings
        import prometheus_client  # noqa: F401  (/metrics)
        from pydantic import ValidationError
    except ImportError as e:
        print(f"{PROG}: error: {e} (the server needs: pip install uvicorn fastapi pydantic-settings "
              f"sse-starlette 'starlette-context<0.4' prometheus_client)", file=sys.stderr)
        return 2

    # the stock server's flags, with one-line errors
    parser = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_args_from_model(parser, Settings)
    parser.add_argument("--config_file", type=str, help="Path to a config file to load.")

    def serve(args) -> None:
        server_argv = list(argv)
        if args.config_file is None:
            if args.n_gpu_layers is None:
                server_argv += ["--n_gpu_layers", "-1"]
            try:
                model = parse_model_from_args(ModelSettings, args)
                port = parse_model_from_args(ServerSettings, args).port
            except ValidationError as e:
                raise ValueError(_settings_error(e)) from None
            if not 0 < port < 65536:  # uvicorn would listen on another port
                raise ValueError(f"--port {port}: not a TCP port (1-65535)")
            if not os.path.isfile(model.model):
                raise ValueError(f"--model {model.model}: no such file")
        elif not os.path.isfile(args.config_file):
            raise ValueError(f"--config_file {args.config_file}: no such file")

        from . import ggml

        if not ggml.has_gpu():
            from .rpc import RpcDevice

            device = RpcDevice()  # noqa: F841  (serves until this process exits)
            print(f"{PROG}: no GPU: the layers go to the loopback RPC device {device.endpoint} "
                  f"(a CPU backend: exact, not faster)", file=sys.stderr)
        try:
            enabled = CacheConfig.from_env().enabled
        except ConfigError:  # the zero-code activation has logged it (one line)
            enabled = True
        if not enabled:
            print(f"{PROG}: neither LLAMA_MOE_CACHE_SLOTS nor LLAMA_MOE_CACHE_MIB is set: the expert cache is off",
                  file=sys.stderr)
        # uvicorn shuts down on SIGTERM (systemd's, docker's, Kubernetes' stop), then re-raises it
        # with this handler restored: exiting here, not by the signal, runs the exit handlers
        # that write the cache's final stats and profile
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        server.create_app = _with_metrics(server.create_app)
        sys.argv = [PROG, *server_argv]
        server.main()  # a model llama.cpp cannot load raises ValueError: one line, status 2

    return parser.run(serve, argv)

