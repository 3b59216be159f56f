"""moecache: a per-layer GPU cache of MoE experts for llama.cpp.

    with moecache.experts_on_host():
        llm = llama_cpp.Llama(path, n_gpu_layers=-1)
    cache = moecache.attach(llm, slots=16)
"""

_EXPORTS = {
    "attach": "moecache.live.activate",
    "experts_on_host": "moecache.live.placement",
    "experts_from_file": "moecache.live.placement",
    "CacheConfig": "moecache.live.config",
    "ConfigError": "moecache.live.config",
    "RpcDevice": "moecache.live.rpc",
}


def __getattr__(name):
    # lazy: importing the package must not load llama_cpp (the RPC server subprocess imports it)
    if name not in _EXPORTS:
        raise AttributeError(f"module 'moecache' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)


__all__ = list(_EXPORTS)
