"""Attach the expert cache to llama.cpp contexts: explicitly (attach) or, with
LLAMA_MOE_CACHE_SLOTS set, to every new context, whose models then load with their experts in
host memory (install, called by the patched llama_cpp)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import sys

from . import native, placement, ramtier, sizing
from .allocation import allocate
from .cache import LiveCache
from .config import CacheConfig, ConfigError
from .probe import CacheUnavailable, model_file, probe, track_model_files
from .rates import planner_rates

log = logging.getLogger("moecache")

_caches: list[LiveCache] = []   # the caches of live contexts: keeps them (and their callbacks) alive
context_callback = None        # the callback install() registered with libllama, kept alive; None before


def live_caches() -> list[LiveCache]:
    """The caches of the live contexts, oldest first."""
    return list(_caches)


def _setup_logging(debug: bool) -> None:
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(logging.INFO if debug else logging.WARNING)


def context_of(target):
    """The llama_context of a llama_cpp.Llama, or target itself (a context pointer)."""
    internal = getattr(target, "_ctx", None)
    return internal.ctx if internal is not None else target


def attach(target, *, config: CacheConfig | None = None, **overrides) -> LiveCache:
    """Give a llama_cpp.Llama (or a llama_context pointer) an expert cache. Configuration comes
    from LLAMA_MOE_CACHE_* with keyword arguments (slots=, mib=, inserts=, policy=, ...) winning,
    or is config= as given. Raises ConfigError for bad values, CacheUnavailable when the model
    cannot be cached."""
    if config is None:
        config = CacheConfig.from_env(**overrides)
    elif overrides:
        raise TypeError("attach() takes a config or settings as keywords, not both")
    _setup_logging(config.debug > 0)
    ctx = native.as_context(context_of(target))
    existing = next((c for c in reversed(_caches) if c.ctx == ctx and not c.detached), None)
    # a context freed and another allocated at its address has no native cache yet
    if existing is not None and existing.config == config and \
            native.lib().llama_moe_cache_n_layers(ctx, existing.tier) > 0:
        return existing  # e.g. attached already by LLAMA_MOE_CACHE_SLOTS
    path = getattr(target, "model_path", None) or model_file(ctx)
    name = path or native.model_metadata(ctx, "general.name") or "model"
    return _register(_open_cache(ctx, config, model_name=name, model_path=path,
                                 tensor_split=getattr(target, "tensor_split", None)))


def _open_cache(ctx, config: CacheConfig, *, model_name: str, model_path: str | None,
                tensor_split=None) -> LiveCache:
    """Probe the model, plan the cache (K), allocate it once, then the cache on it. With both
    tiers the RAM tier is planned first (its budget leaves out nothing the device holds), then
    the device cache over it."""
    if not config.enabled:
        raise ConfigError("LLAMA_MOE_CACHE_SLOTS is 0: the cache is off")
    config = _own_report_files(ctx, config)
    try:
        # the new cache replaces what the context had, in both tiers (with their step callbacks)
        _release(ctx)
        whole = config.ram_tier and model_path and placement.loaded_whole.get(os.path.realpath(model_path))
        if whole and not config.device_cache:
            raise ramtier.WholeModelFits(f"{whole}: no RAM tier, the model was loaded as without it")
        if whole:
            log.warning("moecache: %s: no RAM tier, the device cache alone", whole)
        ram = ramtier.open_ram_tier(ctx, config) if config.ram_tier and not whole else None
        if not config.device_cache:
            plan, layers = ram
            return LiveCache(ctx, config, plan, layers, arch=native.model_metadata(ctx, "general.architecture") or "?",
                             model_name=model_name, tier=native.RAM)
        facts = probe(ctx, config, model_path)
        plan = sizing.plan_cache(config, facts, tensor_split)
        plan, layers = allocate(ctx, config, plan, facts)
        if not layers:
            raise CacheUnavailable(plan.reason)
        below = ram and LiveCache(ctx, config, *ram, arch=facts.arch, model_name=model_name, tier=native.RAM,
                                  above=plan.slots)
        planner = planner_rates(config, layers, model_path) if config.planner else None
        return LiveCache(ctx, config, plan, layers, arch=facts.arch, model_name=model_name, below=below,
                         planner=planner)
    except BaseException:
        _release(ctx)  # stock, not an idle split
        raise


def _release(ctx) -> None:
    """Release the caches of both tiers of ctx (those it has)."""
    for tier in (native.DEVICE, native.RAM):
        if native.lib().llama_moe_cache_n_layers(ctx, tier) > 0:
            native.init(ctx, 0, in_ram=tier == native.RAM)


def _own_report_files(ctx, config: CacheConfig) -> CacheConfig:
    """config with a STATS and a TRACE file of this context's own: where another live context of
    this process writes the same file, this one writes NAME.1.EXT (.2, ...) instead, said in one
    line; two writers would leave the last one's stats and an unreadable trace. (PROFILE is
    shared on purpose: the counts are merged under a lock.)"""
    changes = {}
    for name in ("stats", "trace"):
        path = getattr(config, name)
        taken = {os.path.realpath(getattr(c.config, name)) for c in _caches
                 if c.ctx != ctx and not c.detached and getattr(c.config, name)}
        if not path or os.path.realpath(path) not in taken:
            continue
        stem, ext = os.path.splitext(path)
        own = next(f"{stem}.{n}{ext}" for n in itertools.count(1) if os.path.realpath(f"{stem}.{n}{ext}") not in taken)
        log.warning("moecache: LLAMA_MOE_CACHE_%s=%r is another context's in this process: this context "
                    "writes %r", name.upper(), path, own)
        changes[name] = own
    return dataclasses.replace(config, **changes) if changes else config


def _register(cache: LiveCache) -> LiveCache:
    # its init replaced whatever cache this context had: older ones are stale
    for old in _caches:
        if old.ctx == cache.ctx and not old.detached:
            old.detach()
    _caches[:] = [c for c in _caches if not c.detached]
    _caches.append(cache)
    _release_caches_on_free()
    return cache


def _release_caches_on_free() -> None:
    """Wrap llama_cpp's llama_free (which Llama.close and its finalizer call) so that a freed
    context's cache writes its report and is forgotten: a process that keeps creating
    contexts does not keep every cache. libllama has no free callback to hook instead."""
    import llama_cpp
    import llama_cpp.llama_cpp as bindings

    if hasattr(bindings.llama_free, "stock"):
        return
    stock = bindings.llama_free

    def llama_free(ctx, /):
        if ctx:
            ptr = native.as_context(ctx)
            for cache in [c for c in _caches if c.ctx == ptr]:
                cache.release()
                _caches.remove(cache)
        return stock(ctx)

    llama_free.stock = stock
    bindings.llama_free = llama_cpp.llama_free = llama_free


def install() -> bool:
    """Zero-code activation from the environment; never raises: bad input is logged in one line
    and decoding stays stock."""
    global context_callback
    try:
        config = CacheConfig.from_env()
    except ConfigError as e:
        _setup_logging(False)
        log.error("moecache: error: %s - expert cache disabled", e)
        return False
    _setup_logging(config.debug > 0)
    if not config.enabled or context_callback is not None:
        return context_callback is not None
    try:
        lib = native.lib()
    except native.NotPatchedError as e:
        log.error("moecache: error: %s - expert cache disabled", e)
        return False

    def on_context(ctx, user_data):
        try:
            cache = _open_cache(native.as_context(ctx), config, model_path=model_file(ctx),
                                model_name=native.model_metadata(ctx, "general.name") or "model")
        except ramtier.WholeModelFits as e:
            log.warning("moecache: %s", e)
        except (ConfigError, CacheUnavailable) as e:
            log.warning("moecache: no expert cache for this context: %s", e)
        except Exception as e:  # never break context creation
            log.error("moecache: error: %s: %s - no expert cache for this context", type(e).__name__, e)
        else:
            _register(cache)

    track_model_files()  # sizing by memory reads the model's expert shapes from its file
    context_callback = native.ffi.callback("llama_moe_cache_context_callback", on_context)
    lib.llama_moe_cache_set_context_callback(context_callback, native.ffi.NULL)
    if config.ram_tier:
        placement.place_experts_in_file(**ramtier.whole_model_loading(config))
    else:
        placement.place_experts_on_host(repack=bool(config.repack))
    return True
