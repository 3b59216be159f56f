"""Planning the expert cache: K (slots per cached layer) from LLAMA_MOE_CACHE_SLOTS, or the largest
uniform K that a memory budget holds (from a budget in MiB, or from the free memory the devices
report), and the plan that says where the memory goes. Planning allocates nothing: it works on
what moecache.live.probe found, and moecache.live.allocation allocates the plan.

A cached layer's slots live in the device buffer of its router, in banks: the layers of one
expert layout (the types and shapes of their banked tensors: the expert weights, and the biases
and per-expert scales that go with them, moecache.live.probe.BANKED_TENSORS) on one device share
a bank of each, [..., n_layers*K + 1] along its expert dimension, K slots each plus ONE all-zero
slot per bank that uncached experts are remapped to; and the device holds an I32 id -> slot table of all its cached
layers' experts. Each tensor is padded as that buffer type pads it. The bytes of
K are computed by ggml itself (ggml_backend_alloc_ctx_tensors_from_buft_size) from the expert
tensors' types and shapes in the model's GGUF; which layers are cached, and on which device,
libllama says of the probe's trial allocation of one slot per layer.

Budgets: LLAMA_MOE_CACHE_MIB=N splits N MiB over the devices holding cached layers in
proportion to their free memory (to the Llama's tensor_split where one is set; evenly, logged,
when a device does not report its memory); LLAMA_MOE_CACHE_MIB=auto (or SLOTS=auto) gives each
device its free memory less LLAMA_MOE_CACHE_RESERVE_MIB. Each device's share gives its layers the
largest K that fits; libllama takes one K for all layers (llama_moe_cache_init), so the smallest
device K is the cache's.

The offline replay sizes its per-layer model from a trace with the same rule
(moecache.core.banks.slots_for_budget).
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field

from ..core.banks import slots_for_budget
from . import ggml
from .config import ENV_PREFIX, CacheConfig, ConfigError
from .probe import CachedLayer, Devices, ModelFacts, cannot_size

log = logging.getLogger("moecache")

MIB = 1 << 20
GGML_TYPE_I32 = 26


# --- the plan ------------------------------------------------------------------------------------

@dataclass
class DevicePlan:
    device: str                     # the buffer type holding the slots, as libllama names it
    layers: list[int]               # model layers cached there
    free_before: int | None = None  # free bytes it reported before the cache (None: unreadable)
    budget: int | None = None       # its share of the budget in bytes (None: K was given)
    slots: int = 0                  # K it could hold within its share
    bytes: int | None = None        # what its slots take at the cache's K (None: unknown)
    free_after: int | None = None   # free bytes it reported with the cache allocated
    experts_cached: float | None = None  # share of the model's experts held there

    def free_reported(self) -> bool:
        return self.free_before is not None


@dataclass
class CachePlan:
    sized_by: str                   # the setting: LLAMA_MOE_CACHE_SLOTS=4, ..._MIB=64, ..._MIB=auto
    slots: int = 0                  # K, every cached layer
    n_layers: int = 0               # cached layers, once allocated; 0: none (reason)
    split: str | None = None        # how the budget was shared: free memory, tensor split, even
    reserve_bytes: int | None = None
    retried_from: int | None = None  # the K whose allocation failed
    bytes: int = 0                  # device bytes libllama allocated (llama_moe_cache_device_bytes)
    experts_cached: float | None = None
    devices: list[DevicePlan] = field(default_factory=list)  # SLOTS=K: known once allocated
    reason: str | None = None       # why the allocation left no cache

    def to_json(self) -> dict:
        return asdict(self)

    def lines(self) -> list[str]:
        """The plan as printed at attach."""
        def mib(n):
            return "?" if n is None else f"{n / MIB:.1f} MiB"

        share = "" if self.experts_cached is None else f", {100 * self.experts_cached:.1f}% of the model's experts"
        head = (f"moecache: plan for {self.sized_by}: {self.n_layers} layers x {self.slots} slots, "
                f"{mib(self.bytes)} on {len(self.devices)} device(s){share}")
        if self.split and len(self.devices) > 1:
            head += f", budget split by {self.split}"
        if self.reserve_bytes is not None:
            head += f", {mib(self.reserve_bytes)} reserve per device"
        if self.retried_from:
            head += f" (K={self.retried_from} failed to allocate)"
        out = [head]
        for d in self.devices:
            parts = [f"{len(d.layers)} layers", f"{mib(d.bytes)}"]
            if d.budget is not None:
                parts[-1] += f" of a {mib(d.budget)} share (K={d.slots} fits it)"
            if d.experts_cached is not None:
                parts.append(f"{100 * d.experts_cached:.1f}% of the experts")
            parts.append("free memory not reported" if d.free_after is None else f"{mib(d.free_after)} free left")
            out.append(f"moecache:   {d.device}: " + ", ".join(parts))
        return out


def device_plans(layers: list[CachedLayer], devices: Devices) -> list[DevicePlan]:
    """The cached layers grouped by the device holding their slots, in layer order."""
    plans: dict[str, DevicePlan] = {}
    for layer in layers:
        device = plans.setdefault(layer.device, DevicePlan(layer.device, [], devices.free.get(layer.device)))
        device.layers.append(layer.il)
    return sorted(plans.values(), key=lambda d: d.layers[0])


class SlotBytes:
    """Slot bytes of each device's cached layers, by ggml's own buffer arithmetic."""

    def __init__(self, devices: Devices, plans: list[DevicePlan], shapes, n_expert: int):
        self.n_expert = n_expert
        self.model_experts = len(shapes) * n_expert  # the experts of every layer with expert tensors
        self.groups = {}  # device -> (buffer type, {expert tensor signature: layer count})
        for d in plans:
            if d.device not in devices.by_buffer:
                raise ValueError(f"the slots' buffer {d.device} is no device's buffer type")
            signatures = {}
            for il in d.layers:
                if il not in shapes:
                    raise ValueError(f"layer {il}'s expert tensors are not in it")
                signature = tuple(shapes[il])
                signatures[signature] = signatures.get(signature, 0) + 1
            self.groups[d.device] = (devices.by_buffer[d.device][1], signatures)
        self._memo = {}

    def bytes(self, device: str, k: int) -> int:
        if (device, k) not in self._memo:
            buft, signatures = self.groups[device]
            tensors = [(GGML_TYPE_I32, 1, self.n_expert * sum(signatures.values()), 1)]
            for signature, count in sorted(signatures.items()):  # libllama's order of the banks
                tensors += [bank_tensor(part, count * k + 1) for part in signature]
            self._memo[device, k] = ggml.buffer_bytes(buft, tensors)
        return self._memo[device, k]


def bank_tensor(part: tuple[int, ...], n_slots: int) -> tuple[int, int, int, int]:
    """(ggml type, ne0, ne1, ne2) of the bank of n_slots slots of a banked tensor (type, ne...)."""
    ggml_type, *ne = part
    return (ggml_type, *(ne + [n_slots] + [1, 1])[:3])


def slot_bytes(facts: ModelFacts, plans: list[DevicePlan]) -> SlotBytes:
    """The slot bytes of plans' devices on facts' model. Raises ValueError saying why they
    cannot be known (no model file, or one without separate expert tensors)."""
    if not facts.shapes:
        raise ValueError(facts.shapes_problem)
    try:
        return SlotBytes(facts.devices, plans, facts.shapes, facts.n_expert)
    except ValueError as e:
        raise ValueError(cannot_size(facts.path, e)) from None


def plan_cache(config: CacheConfig, facts: ModelFacts, tensor_split=None) -> CachePlan:
    """The cache config asks for on facts' model: K, and for a budget each device's share and the
    K it fits. Raises ConfigError for a K or a budget the model cannot take."""
    if config.budget_mib is None:
        if config.slots > facts.n_expert:
            raise ConfigError(f"{ENV_PREFIX}SLOTS={config.slots} exceeds the {facts.n_expert} "
                              f"experts per layer of this model")
        return CachePlan(config.sized_by, slots=config.slots)
    planned = CachePlan(config.sized_by, devices=device_plans(facts.trial, facts.devices))
    try:
        sizer = slot_bytes(facts, planned.devices)
    except ValueError as e:
        raise ConfigError(f"{planned.sized_by}: {e}") from None
    planned.slots = _size(planned, sizer, config, tensor_split)
    return planned


def _size(plan: CachePlan, sizer: SlotBytes, config: CacheConfig, tensor_split) -> int:
    """Each device's budget and the K it fits; the cache's K (the smallest)."""
    sized_by, devs = plan.sized_by, plan.devices
    if config.budget_mib == "auto":
        plan.reserve_bytes = config.reserve_mib * MIB
        silent = [d.device for d in devs if not d.free_reported()]
        if silent:
            raise ConfigError(f"{sized_by}: {silent[0]} does not report its free memory; "
                              f"set {ENV_PREFIX}MIB=N")
        for d in devs:
            d.budget = max(0, d.free_before - plan.reserve_bytes)
        plan.split = "free memory"
    else:
        weights, plan.split = _split_weights(devs, tensor_split)
        total = config.budget_mib * MIB
        for d, weight in zip(devs, weights):
            d.budget = int(total * weight / sum(weights))
    for d in devs:
        d.slots = slots_for_budget(lambda k: sizer.bytes(d.device, k), d.budget, sizer.n_expert)
    k = min(d.slots for d in devs)
    if k == 0:
        raise ConfigError(_too_small(plan, sizer, config))
    if len({d.slots for d in devs}) > 1:
        log.info("moecache: the devices' shares fit K = %s; libllama takes one K for all layers: %d",
                 ", ".join(str(d.slots) for d in devs), k)
    return k


def _split_weights(devs: list[DevicePlan], tensor_split):
    if len(devs) == 1:
        return [1], None
    if tensor_split:
        order = [ggml.buffer_type_name(ggml.device_buffer_type(dev)) for dev in _model_devices()]
        weights = [float(tensor_split[order.index(d.device)]) if d.device in order
                   and order.index(d.device) < len(tensor_split) else 0.0 for d in devs]
        if sum(weights) > 0:
            return weights, "tensor split"
    silent = [d.device for d in devs if not d.free_reported()]
    if silent:
        log.warning("moecache: %s does not report its free memory: the budget splits evenly", silent[0])
        return [1] * len(devs), "even (a device's free memory is unknown)"
    return [d.free_before for d in devs], "free memory"


def _model_devices() -> list[int]:
    """The devices a model is split over, in llama_model_load's order (what tensor_split
    indexes): RPC devices, then the other GPUs, then integrated GPUs when there is no GPU."""
    devs = [dev for dev in ggml.devices() if ggml.device_type(dev) == ggml.GGML_BACKEND_DEVICE_TYPE_GPU]
    rpc = [dev for dev in devs if ggml.device_name(dev).startswith("RPC")]
    gpus = [dev for dev in devs if dev not in rpc]
    igpus = [] if gpus else [dev for dev in ggml.devices() if ggml.device_type(dev) == ggml.GGML_BACKEND_DEVICE_TYPE_IGPU]
    return rpc + gpus + igpus


def _too_small(plan: CachePlan, sizer: SlotBytes, config: CacheConfig) -> str:
    """The one-line error of a budget below one slot per cached layer, with the minimum."""
    one = {d.device: sizer.bytes(d.device, 1) for d in plan.devices}
    if config.budget_mib == "auto":
        d = next(d for d in plan.devices if d.slots == 0)
        return (f"{plan.sized_by}: {d.device} has {d.free_before / MIB:.1f} MiB free; keeping "
                f"{ENV_PREFIX}RESERVE_MIB={config.reserve_mib} of it leaves {d.budget / MIB:.1f} MiB, "
                f"below the {one[d.device] / MIB:.1f} MiB of one slot per cached layer")
    # each device's share must hold its layers at K = 1: the total that gives every one enough
    total = config.budget_mib * MIB
    need = max(one[d.device] * total / max(d.budget, 1) for d in plan.devices)
    return (f"{plan.sized_by} is below one slot per cached layer: this model needs at least "
            f"{math.ceil(need / MIB)} MiB ({sum(len(d.layers) for d in plan.devices)} cached layers)")
