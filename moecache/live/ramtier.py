"""Planning the RAM tier (LLAMA_MOE_CACHE_RAM_MIB): K experts per MoE layer kept in host memory,
the others read from the model file when a ubatch selects them (llama_moe_cache_params.in_ram).

RAM_MIB=N keeps the largest K whose experts fit N MiB over all layers. RAM_MIB=auto takes what
the process may use (the memory still available to it, moecache.util.available_memory: its memory
cgroups' limits, MemAvailable and `ulimit -v`, the tightest, plus what the process holds now)
less what it holds now (its resident set: the weights that are not routed experts, the KV
cache, the interpreter), less one layer's reads for a full ubatch (a prompt's ubatch selects
most of a layer's experts, read for that layer and dropped after it) and a reserve of 5% of the
limit (at least 64 MiB). K never exceeds the experts a layer has: a model that fits keeps all of
them, read once. Before a model is loaded for the tier, check_room refuses one whose weights
outside the experts, KV cache and one expert per layer do not fit what is available (run.py):
the kernel would kill the process while it loads, with nothing said."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..core.banks import ram_slots
from ..util import available_memory
from . import native
from .config import ENV_PREFIX
from .probe import BANKED, CachedLayer, CacheUnavailable, cached_layers, gguf_header, split_files
from .sizing import MIB, CachePlan, DevicePlan

F16_BYTES = 2  # llama.cpp's KV cache type by default
N_UBATCH = 512  # llama.cpp's default n_ubatch (what a load assumes before its context says)


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


class TierReads:
    """The RAM tier's reads, from libllama's per-layer counters read at every step: per layer, and
    summed per phase, as the ubatch before the step was a prompt (more than one token) or decode,
    with the tokens of each phase (the tier's decode_tokens count a prompt's too: it looks them up)."""

    def __init__(self, n_layers: int):
        self.layers = [dict.fromkeys(native.READ_COUNTERS, 0) for _ in range(n_layers)]
        self.phases = {"decode": dict.fromkeys(native.READ_COUNTERS, 0),
                       "prompt": dict.fromkeys(native.READ_COUNTERS, 0)}
        self.tokens = {"decode": 0, "prompt": 0}

    def update(self, counters: list[dict], *, n_tokens: int, prompt: bool) -> list[dict]:
        """counters: libllama's now; returns each layer's reads since the last update."""
        name = "prompt" if prompt else "decode"
        phase = self.phases[name]
        self.tokens[name] += n_tokens
        since = []
        for now, layer in zip(counters, self.layers):
            since.append({key: value - layer[key] for key, value in now.items()})
            for key, value in since[-1].items():
                phase[key] += value
            layer.update(now)
        return since

    def to_json(self) -> dict:
        """Both phases with their tokens, and decode's per token: bytes read, bytes read ahead and
        not selected, ms waited; the share of the experts read ahead that their layer selected
        (precision)."""
        decode, n = self.phases["decode"], self.tokens["decode"]
        per_token = {"read_bytes_per_token": decode["read_bytes"] / n if n else None,
                     "wasted_bytes_per_token": decode["read_ahead_wasted_bytes"] / n if n else None,
                     "wait_ms_per_token": decode["read_wait_us"] / 1e3 / n if n else None,
                     "read_ahead_precision": decode["read_ahead_used"] / decode["read_ahead"]
                     if decode["read_ahead"] else None}
        return {"decode": dict(decode, tokens=n), "prompt": dict(self.phases["prompt"], tokens=self.tokens["prompt"]),
                "decode_per_token": per_token}


def open_ram_tier(ctx, config) -> tuple[RamPlan, list[CachedLayer]]:
    """The RAM tier of ctx, planned and initialised; raises CacheUnavailable when it cannot be."""
    if native.init(ctx, 1, in_ram=True) <= 0:
        raise CacheUnavailable("no MoE layer has its experts mapped from the model file: load the model with "
                               "moecache.experts_from_file() (LLAMA_MOE_CACHE_RAM_MIB does it for Llama)")
    layers = cached_layers(ctx, native.RAM)
    plan = plan_ram(config, layers, int(native.lib().llama_n_ubatch(ctx)))
    if native.init(ctx, plan.slots, in_ram=True, read_ahead=bool(config.read_ahead)) <= 0:
        raise CacheUnavailable(f"{plan.sized_by}: libllama refused {plan.slots} experts per layer (its log says why)")
    return plan, cached_layers(ctx, native.RAM)


def plan_ram(config, layers: list[CachedLayer], n_ubatch: int,
             available: tuple[int | None, str] | None = None) -> RamPlan:
    """K for the budget of config.ram_mib; raises CacheUnavailable below one expert per layer.
    available: (bytes, what limits them) for auto, default available_memory()."""
    expert_bytes = [layer.expert_bytes for layer in layers]
    per_k = sum(expert_bytes)  # one more expert kept in every layer
    n_expert = min(layer.n_expert for layer in layers)
    plan = RamPlan(f"{ENV_PREFIX}RAM_MIB={config.ram_mib}", n_layers=len(layers))
    if config.ram_mib == "auto":
        free, plan.limit_source = available or available_memory()
        if free is None:
            raise CacheUnavailable(f"{plan.sized_by}: no memory figure to size by (no /proc/meminfo): set a number")
        plan.held = resident_bytes()
        plan.limit = free + plan.held
        plan.transient = _transient(n_ubatch, [(layer.n_expert, layer.n_expert_used, layer.expert_bytes)
                                               for layer in layers])
        plan.reserve_bytes = reserve(plan.limit)
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


class WholeModelFits(CacheUnavailable):
    """The RAM tier was asked for a model that was loaded whole: every expert fits (fits_whole)."""


def fits_whole(path: str, ram_mib: int | str, available: tuple[int | None, str] | None = None) -> str | None:
    """Before `path` is loaded for the RAM tier: why it needs none (one line), where every expert
    fits RAM_MIB (=N: N MiB; auto: what the process may use, by check_room's rule with a KV cache of
    the model's whole training context). Stock loading then repacks the experts for the CPU's faster
    kernels, which the tier, computing them from the file's mapping, cannot. None: the tier is
    needed, or the file does not say (the tier's own sizing decides)."""
    try:
        facts = _gguf_facts(path)
    except CacheUnavailable:
        return None
    experts = sum(facts["expert_bytes"]) * facts["n_expert"]
    if ram_mib != "auto":
        if experts > ram_mib * MIB:
            return None
        return f"{ENV_PREFIX}RAM_MIB={ram_mib}: every expert of {path} fits ({experts / MIB:.0f} MiB)"
    free, source = available or available_memory()
    if free is None:
        return None
    n_ctx = facts["n_ctx_train"]
    need = _need(facts, n_ctx, N_UBATCH, free) + experts
    if need > free:
        return None
    return (f"{ENV_PREFIX}RAM_MIB=auto: all of {path} fits ({need / MIB:.0f} MiB with its {experts / MIB:.0f} MiB of "
            f"experts and a KV cache of {n_ctx} tokens, {free / MIB:.0f} MiB available, {source})")


def check_room(path: str, n_ctx: int, n_ubatch: int, available: tuple[int | None, str] | None = None) -> None:
    """Before `path` is loaded for the RAM tier alone at RAM_MIB=auto: CacheUnavailable, one
    line, when loading it would take what the process may use (available: (bytes, what limits
    them), default available_memory()), by plan_ram's rule with what loading holds estimated
    from the GGUF: the weights outside the routed experts and an F16 KV cache of n_ctx tokens
    (compute buffers are not counted: plan_ram, after the load, still refuses where they tip it)."""
    free, source = available or available_memory()
    if free is None:
        return
    facts = _gguf_facts(path)
    one_each = sum(facts["expert_bytes"])
    need = _need(facts, n_ctx, n_ubatch, free) + one_each
    if need > free:
        raise CacheUnavailable(
            f"{ENV_PREFIX}RAM_MIB=auto: {path} needs {need / MIB:.0f} MiB to load and keep one expert per layer "
            f"({facts['other_bytes'] / MIB:.0f} MiB of weights outside its experts, a KV cache of {n_ctx} tokens "
            f"{facts['kv_bytes_per_token'] * n_ctx / MIB:.0f} MiB, one expert per layer {one_each / MIB:.0f} MiB, "
            f"{_facts_transient(facts, n_ubatch) / MIB:.0f} MiB for one layer's reads, "
            f"{reserve(free) / MIB:.0f} MiB reserve), "
            f"{free / MIB:.0f} MiB available ({source})")


def _transient(n_ubatch: int, shapes) -> int:
    """One layer's reads for a full ubatch, the most of any layer: shapes are each layer's
    (n_expert, n_expert_used, bytes of one expert)."""
    return max(min(n_expert, n_ubatch * n_used) * size for n_expert, n_used, size in shapes)


def _facts_transient(facts: dict, n_ubatch: int) -> int:
    """_transient from the GGUF's facts (_gguf_facts)."""
    return _transient(n_ubatch, [(facts["n_expert"], facts["n_expert_used"], b) for b in facts["expert_bytes"]])


def _need(facts: dict, n_ctx: int, n_ubatch: int, free: int) -> int:
    """What loading for the tier takes before any expert is kept: the weights outside the routed
    experts, an F16 KV cache of n_ctx tokens, one layer's reads and the reserve."""
    return (facts["other_bytes"] + facts["kv_bytes_per_token"] * n_ctx + _facts_transient(facts, n_ubatch)
            + reserve(free))


def whole_model_loading(config) -> dict:
    """The RAM tier's loader settings for config (placement.experts_from_file's keywords): a model
    that needs no tier (fits_whole) loads as without it, its experts on the host for the device
    cache when there is one."""
    return {"fits": functools.partial(fits_whole, ram_mib=config.ram_mib),
            "device_repack": bool(config.repack) if config.device_cache else None}


def _gguf_facts(path: str) -> dict:
    """From the GGUF's header: the bytes of one expert in each layer with routed experts (the
    banked tensors), of every other tensor, an F16 KV cache's per token (0 where the metadata
    does not say), the experts per layer and per token."""
    banked: dict[int, int] = {}
    other, meta = 0, {}
    try:
        for part in split_files(path):
            found, tensors = gguf_header(part)
            meta.update({key.split(".", 1)[-1]: value for key, value in found.items()})
            for name, _, _, nbytes in tensors:
                match = BANKED.fullmatch(name)
                if match:
                    banked[int(match[1])] = banked.get(int(match[1]), 0) + nbytes
                else:
                    other += nbytes
    except (OSError, ValueError) as e:
        raise CacheUnavailable(f"{ENV_PREFIX}RAM_MIB=auto: {getattr(e, 'strerror', None) or e}") from None
    n_expert, n_used = meta.get("expert_count", 0), meta.get("expert_used_count", 0)
    if not banked or not n_expert or not n_used:
        raise CacheUnavailable(f"{ENV_PREFIX}RAM_MIB=auto: {path} has no routed experts (not a MoE model)")
    heads = meta.get("attention.head_count", 0)
    head_dim = meta.get("embedding_length", 0) // heads if heads else 0
    per_head = meta.get("attention.key_length", head_dim) + meta.get("attention.value_length", head_dim)
    kv = F16_BYTES * meta.get("block_count", 0) * meta.get("attention.head_count_kv", heads) * per_head
    return {"expert_bytes": [b // n_expert for _, b in sorted(banked.items())], "other_bytes": other,
            "kv_bytes_per_token": kv, "n_expert": n_expert, "n_expert_used": n_used,
            "n_ctx_train": meta.get("context_length", 0)}


def reserve(limit: int) -> int:
    """What the auto sizing leaves free of what the process may use."""
    return max(64 * MIB, limit // 20)


def resident_bytes() -> int:
    """This process's resident set (VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise CacheUnavailable("/proc/self/status has no VmRSS: the RAM tier cannot size itself (set RAM_MIB=N)")
