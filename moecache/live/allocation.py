"""Allocating a planned cache in libllama, once: K slots per cached layer (llama_moe_cache_init).
A budget's allocation that fails is retried once at the largest K that fits the free memory
less LLAMA_MOE_CACHE_RESERVE_MIB, logged. The allocated plan says what each device holds."""

from __future__ import annotations

import logging
from dataclasses import replace

from ..core.banks import slots_for_budget
from . import native
from .config import ENV_PREFIX, CacheConfig
from .probe import NO_LAYERS, CachedLayer, ModelFacts, cached_layers
from .sizing import MIB, CachePlan, SlotBytes, device_plans, slot_bytes

log = logging.getLogger("moecache")


def allocate(ctx, config: CacheConfig, plan: CachePlan, facts: ModelFacts) -> tuple[CachePlan, list[CachedLayer]]:
    """The plan as allocated in ctx, and the layers cached; no layers when nothing was
    allocated (the plan's reason says why)."""
    if native.init(ctx, plan.slots, max_batch=config.max_batch) > 0:
        return _allocated(ctx, plan, facts)
    if config.budget_mib is None:  # K was given: no smaller K to retry with
        return replace(plan, reason=NO_LAYERS), []
    return _retry(ctx, config, plan, facts)


def _retry(ctx, config: CacheConfig, plan: CachePlan, facts: ModelFacts):
    """After a failed allocation of the plan's K: once, the largest smaller K that fits every
    device's free memory less the reserve."""
    failed, reserve = plan.slots, config.reserve_mib * MIB
    sizer = slot_bytes(facts, plan.devices)  # the plan sized these devices: it is known
    fits = []
    for d in plan.devices:
        free = facts.devices.free_now(d.device)
        if free is None:
            return replace(plan, reason=f"{plan.sized_by}: allocating {failed} slots per layer failed and "
                                        f"{d.device} does not report its free memory to retry with"), []
        fits.append(slots_for_budget(lambda k: sizer.bytes(d.device, k), max(0, free - reserve), failed - 1))
    k = min(fits) if failed > 1 else 0
    if k == 0:
        return replace(plan, reason=f"{plan.sized_by}: allocating {failed} slots per layer failed and not one "
                                    f"slot per layer fits the free memory less {ENV_PREFIX}RESERVE_MIB="
                                    f"{config.reserve_mib}"), []
    log.warning("moecache: %s: allocating %d slots per layer failed; retrying at %d, the largest "
                "that fits the free memory less %sRESERVE_MIB=%d", plan.sized_by, failed, k, ENV_PREFIX,
                config.reserve_mib)
    retried = replace(plan, slots=k, retried_from=failed)
    if native.init(ctx, k, max_batch=config.max_batch) <= 0:
        return replace(retried, reason=f"{plan.sized_by}: the retry at {k} slots per layer failed too "
                                       f"(libllama's log says why)"), []
    return _allocated(ctx, retried, facts)


def _allocated(ctx, plan: CachePlan, facts: ModelFacts):
    """The plan with what libllama allocated: per device its bytes, share of the model's experts
    and the free memory left."""
    layers = cached_layers(ctx)
    devices = plan.devices or device_plans(layers, facts.devices)  # SLOTS=K: only known now
    try:
        sizer = slot_bytes(facts, devices)
    except ValueError:  # SLOTS=K needs no sizes: without them some figures stay unknown
        sizer = None
    allocated = int(native.lib().llama_moe_cache_device_bytes(ctx, native.DEVICE))
    devices = [_allocated_device(d, plan.slots, sizer, allocated if len(devices) == 1 else None, facts)
               for d in devices]
    experts_cached = len(layers) * plan.slots / sizer.model_experts if sizer else None
    predicted = [d.bytes for d in devices]
    if None not in predicted and sum(predicted) != allocated:
        log.warning("moecache: the plan predicted %d device bytes, libllama allocated %d", sum(predicted), allocated)
    return replace(plan, n_layers=len(layers), bytes=allocated, experts_cached=experts_cached,
                   devices=devices), layers


def _allocated_device(d, k: int, sizer: SlotBytes | None, allocated: int | None, facts: ModelFacts):
    """d once K = k is allocated; allocated: the cache's bytes when d is its only device."""
    return replace(d, bytes=sizer.bytes(d.device, k) if sizer else allocated,
                   free_after=facts.devices.free_now(d.device),
                   experts_cached=len(d.layers) * k / sizer.model_experts if sizer else None)
