"""Planning the RAM tier (LLAMA_MOE_CACHE_RAM_MIB): K experts per MoE layer kept in host memory,
the others read from the model file when a ubatch selects them (llama_moe_cache_params.in_ram).

RAM_MIB=N keeps the largest K whose experts fit N MiB over all layers. RAM_MIB=auto takes what
the process may use (its memory cgroup's limit where one is set, else MemAvailable plus what the
process holds now) less what it holds now (its resident set: the weights that are not routed
experts, the KV cache, the interpreter), less one layer's reads for a full ubatch (a prompt's
ubatch selects most of a layer's experts, read for that layer and dropped after it) and a
reserve of 5% of the limit (at least 64 MiB). K never exceeds the experts a layer has: a model
that fits keeps all of them, read once."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..core.banks import ram_slots
from . import native
from .config import ENV_PREFIX
from .probe import CachedLayer, CacheUnavailable, cached_layers
from .sizing import MIB, CachePlan, DevicePlan

UNLIMITED = 1 << 60  # cgroup v1 reports no limit as about 2^63


@dataclass
class RamPlan(CachePlan):
    limit: int | None = None        # auto: what the process may use, bytes
    limit_source: str | None = None
    held: int | None = None         # auto: its resident set when planned
    transient: int | None = None    # auto: one layer's reads for a full ubatch

    def lines(self) -> list[str]:
        share = f", {100 * self.experts_cached:.1f}% of the model's experts" if self.experts_cached is not None else ""
        out = [f"moecache: plan for {self.sized_by}: RAM tier, {self.n_layers} layers x {self.slots} experts kept in "
               f"memory, {self.bytes / MIB:.1f} MiB{share}; the others are read from the model file"]
        if self.limit is not None:
            out.append(f"moecache:   {self.limit / MIB:.0f} MiB may be used ({self.limit_source}), {self.held / MIB:.0f} "
                       f"MiB held, {self.transient / MIB:.0f} MiB for one layer's reads, "
                       f"{self.reserve_bytes / MIB:.0f} MiB reserve")
        return out


def open_ram_tier(ctx, config) -> tuple[RamPlan, list[CachedLayer]]:
    """The RAM tier of ctx, planned and initialised; raises CacheUnavailable when it cannot be."""
    if native.init(ctx, 1, in_ram=True) <= 0:
        raise CacheUnavailable("no MoE layer has its experts mapped from the model file: load the model with "
                               "moecache.experts_from_file() (LLAMA_MOE_CACHE_RAM_MIB does it for Llama)")
    layers = cached_layers(ctx, native.RAM)
    plan = plan_ram(config, layers, int(native.lib().llama_n_ubatch(ctx)))
    if native.init(ctx, plan.slots, in_ram=True) <= 0:
        raise CacheUnavailable(f"{plan.sized_by}: libllama refused {plan.slots} experts per layer (its log says why)")
    return plan, cached_layers(ctx, native.RAM)


def plan_ram(config, layers: list[CachedLayer], n_ubatch: int) -> RamPlan:
    """K for the budget of config.ram_mib; raises CacheUnavailable below one expert per layer."""
    expert_bytes = [layer.expert_bytes for layer in layers]
    per_k = sum(expert_bytes)  # one more expert kept in every layer
    n_expert = min(layer.n_expert for layer in layers)
    plan = RamPlan(f"{ENV_PREFIX}RAM_MIB={config.ram_mib}", n_layers=len(layers))
    if config.ram_mib == "auto":
        plan.limit, plan.limit_source = memory_limit()
        plan.held = resident_bytes()
        plan.transient = max(min(layer.n_expert, n_ubatch * layer.n_expert_used) * layer.expert_bytes
                             for layer in layers)
        plan.reserve_bytes = max(64 * MIB, plan.limit // 20)
        budget = plan.limit - plan.held - plan.transient - plan.reserve_bytes
    else:
        budget = config.ram_mib * MIB
    k = ram_slots(expert_bytes, n_expert, budget)  # the offline replay's rule too
    if k < 1:
        detail = "" if plan.limit is None else " (" + plan.lines()[1].removeprefix("moecache:   ") + ")"
        raise CacheUnavailable(f"{plan.sized_by}: {max(0, budget) / MIB:.0f} MiB keep fewer than one expert per "
                               f"layer, which takes {per_k / MIB:.1f} MiB{detail}")
    plan.slots, plan.bytes, plan.experts_cached = k, k * per_k, k / n_expert
    plan.devices = [DevicePlan("RAM", [layer.il for layer in layers], budget=budget, slots=k, bytes=k * per_k,
                               experts_cached=k / n_expert)]
    return plan


def memory_limit() -> tuple[int, str]:
    """What this process may use, in bytes, and where that figure comes from: the tightest memory
    cgroup limit over its cgroup and their parents (v2 memory.max, v1 memory.limit_in_bytes),
    else MemAvailable plus what it holds now."""
    limits = [(value, f"cgroup {path}") for path, value in _cgroup_limits() if value < UNLIMITED]
    if limits:
        return min(limits)
    return _meminfo("MemAvailable") + resident_bytes(), "MemAvailable"


def resident_bytes() -> int:
    """This process's resident set (VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise CacheUnavailable("/proc/self/status has no VmRSS: the RAM tier cannot size itself (set RAM_MIB=N)")


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise CacheUnavailable(f"/proc/meminfo has no {key}: the RAM tier cannot size itself (set RAM_MIB=N)")


def _cgroup_limits():
    """(file, limit) of every memory limit that applies to this process."""
    try:
        with open("/proc/self/cgroup") as f:
            entries = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return
    for _, controllers, path in entries:
        if controllers == "":  # v2: one hierarchy
            root, name = "/sys/fs/cgroup", "memory.max"
        elif "memory" in controllers.split(","):
            root, name = "/sys/fs/cgroup/memory", "memory.limit_in_bytes"
        else:
            continue
        while True:
            file = os.path.join(root + path.rstrip("/"), name)
            try:
                with open(file) as f:
                    text = f.read().strip()
            except OSError:
                text = None
            if text and text != "max":
                yield file, int(text)
            if path in ("", "/"):
                break
            path = os.path.dirname(path.rstrip("/"))
