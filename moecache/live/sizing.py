"""Sizing the expert cache by memory: from a budget in MiB, or from the free memory the devices
report, to the largest uniform K (slots per cached layer) that fits, and the plan that says
where the memory went.

A cached layer's slots live in the device buffer of its router, in banks: the layers of one
expert layout (the up, gate and down experts' types and shapes) on one device share up, gate and
down bank tensors [ne0, ne1, n_layers*K + 1], K slots each plus ONE all-zero slot per bank that
uncached experts are remapped to; and the device holds an I32 id -> slot table of all its cached
layers' experts. Each tensor is padded as that buffer type pads it. The bytes of
K are computed by ggml itself (ggml_backend_alloc_ctx_tensors_from_buft_size) from the expert
tensors' types and shapes in the model's GGUF; which layers are cached, and on which device,
libllama says after a trial allocation of one slot per layer.

Budgets: LLAMA_MOE_CACHE_MIB=N splits N MiB over the devices holding cached layers in
proportion to their free memory (to the Llama's tensor_split where one is set; evenly, logged,
when a device does not report its memory); LLAMA_MOE_CACHE_MIB=auto (or SLOTS=auto) gives each
device its free memory less LLAMA_MOE_CACHE_RESERVE_MIB. Each device's share gives its layers the
largest K that fits; libllama takes one K for all layers (llama_moe_cache_init), so the smallest
device K is the cache's. An allocation that fails is retried once at the largest K that fits the
free memory less the reserve, logged.

The offline replay sizes its per-layer model from a trace with the same rule (slots_for_budget).
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import asdict, dataclass, field

from ..core.banks import slots_for_budget
from . import ggml
from .config import ENV_PREFIX, CacheConfig, ConfigError

log = logging.getLogger("moecache")

MIB = 1 << 20
GGML_TYPE_I32 = 26
EXPERT_TENSORS = ("ffn_up_exps", "ffn_gate_exps", "ffn_down_exps")  # the order libllama allocates


def _native():
    """moecache.live.native, imported when first needed: the offline replay uses this module's rule
    without libllama's cffi module."""
    from . import native

    return native


# --- the model's expert tensors ------------------------------------------------------------------

_model_files: dict[int, str] = {}  # llama_model address -> the GGUF it was loaded from


def track_model_files() -> None:
    """Remember the file of every model llama_cpp loads from now on (libllama does not say which
    file a model came from; zero-code activation only sees the context)."""
    import llama_cpp
    import llama_cpp.llama_cpp as bindings

    if hasattr(bindings.llama_model_load_from_file, "stock"):
        return
    stock = bindings.llama_model_load_from_file

    def llama_model_load_from_file(path_model, params, /):
        model = stock(path_model, params)
        if model:
            _model_files[model] = path_model.decode(errors="surrogateescape")
        return model

    llama_model_load_from_file.stock = stock
    bindings.llama_model_load_from_file = llama_cpp.llama_model_load_from_file = llama_model_load_from_file


def model_file(ctx) -> str | None:
    """The GGUF of a context's model, when track_model_files saw it loaded."""
    native = _native()
    model = native.lib().llama_get_model(native.as_context(ctx))
    return _model_files.get(int(native.ffi.cast("uintptr_t", model)))


def expert_shapes(path: str) -> dict[int, list[tuple[int, int, int]]]:
    """{model layer: [(ggml type, ne0, ne1) of up, gate, down]} for the layers with separate
    expert tensors, read from the GGUF at path (and its other split files)."""
    import gguf

    pattern = re.compile(r"blk\.(\d+)\.(%s)\.weight" % "|".join(EXPERT_TENSORS))
    found: dict[int, dict[str, tuple[int, int, int]]] = {}
    for part in _split_files(path):
        for tensor in gguf.GGUFReader(part).tensors:
            match = pattern.fullmatch(tensor.name)
            if match:
                ne = [int(n) for n in tensor.shape]
                found.setdefault(int(match[1]), {})[match[2]] = (int(tensor.tensor_type), ne[0], ne[1])
    return {il: [parts[name] for name in EXPERT_TENSORS]
            for il, parts in sorted(found.items()) if len(parts) == len(EXPERT_TENSORS)}


def _split_files(path: str) -> list[str]:
    """path, or every file of a split GGUF (llama.cpp's NAME-00001-of-00003.gguf naming)."""
    match = re.fullmatch(r"(.*)-(\d{5})-of-(\d{5})\.gguf", path)
    if not match:
        return [path]
    return [f"{match[1]}-{i:05d}-of-{match[3]}.gguf" for i in range(1, int(match[3]) + 1)]


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
    n_layers: int = 0               # cached layers; 0: libllama cached none (reason)
    split: str | None = None        # how the budget was shared: free memory, tensor split, even
    reserve_bytes: int | None = None
    retried_from: int | None = None  # the K whose allocation failed
    bytes: int = 0                  # device bytes libllama allocated (llama_moe_cache_device_bytes)
    experts_cached: float | None = None
    devices: list[DevicePlan] = field(default_factory=list)
    reason: str | None = None

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


class _Devices:
    """The non-CPU ggml devices by the name of their buffer type (what libllama's layer info
    names), with the free memory each reported when this was made."""

    def __init__(self):
        self.by_buffer = {}
        for dev in ggml.devices():
            if ggml.device_type(dev) != ggml.GGML_BACKEND_DEVICE_TYPE_CPU:
                buft = ggml.device_buffer_type(dev)
                self.by_buffer[ggml.buffer_type_name(buft)] = (dev, buft)
        self.free = {name: self._free(dev) for name, (dev, _) in self.by_buffer.items()}

    @staticmethod
    def _free(dev) -> int | None:
        free, total = ggml.device_memory(dev)
        return None if free == 0 and total == 0 else free

    def free_now(self, name: str) -> int | None:
        return self._free(self.by_buffer[name][0]) if name in self.by_buffer else None


class _Sizer:
    """Slot bytes of each device's cached layers, by ggml's own buffer arithmetic."""

    def __init__(self, devices: _Devices, plans: list[DevicePlan], shapes, n_expert: int):
        self.n_expert = n_expert
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
                tensors += [(t, ne0, ne1, count * k + 1) for t, ne0, ne1 in signature]
            self._memo[device, k] = ggml.buffer_bytes(buft, tensors)
        return self._memo[device, k]


def allocate(ctx, config: CacheConfig, *, n_expert: int, model_path: str | None = None,
             tensor_split=None) -> CachePlan:
    """Allocate the cache of ctx as config sizes it and return the plan (n_layers 0: libllama
    cached nothing, plan.reason says why). Raises ConfigError for a budget that cannot hold one
    slot per cached layer, or that cannot be computed."""
    native = _native()
    plan = CachePlan(config.sized_by)
    devices = _Devices()  # their free memory before the cache
    budgeted = config.budget_mib is not None
    k = 1 if budgeted else config.slots  # a budget is sized on a trial allocation of one slot
    n_layers = native.init(ctx, k, max_batch=config.max_batch)
    if n_layers <= 0:
        plan.reason = "libllama cached no layer (its log says why); decoding stays stock"
        return plan
    plan.devices = _device_plans(ctx, n_layers, devices)
    try:
        shapes = expert_shapes(model_path) if model_path else None
        sizer = _Sizer(devices, plan.devices, shapes, n_expert) if shapes else None
    except Exception as e:  # noqa: BLE001 - gguf-py may not read what llama.cpp did (a newer type)
        shapes = sizer = None
        problem = f"cannot size the cache from {model_path}: {type(e).__name__}: {e}"
    else:
        problem = (f"no separate up, gate and down expert tensors in {model_path}" if model_path else
                   "sizing by memory needs the model's GGUF file: attach a llama_cpp.Llama")
    if budgeted:
        try:
            if sizer is None:
                raise ConfigError(f"{plan.sized_by}: {problem}")
            k = _size(plan, sizer, config, tensor_split)
        except ConfigError:
            native.init(ctx, 0)
            raise
        n_layers = native.init(ctx, k, max_batch=config.max_batch)
        if n_layers <= 0:
            n_layers, k = _retry(ctx, plan, sizer, devices, config, k)
            if n_layers <= 0:
                return plan
    plan.slots, plan.n_layers = k, n_layers
    _describe(ctx, plan, sizer, devices, shapes, n_expert)
    return plan


def _device_plans(ctx, n_layers: int, devices: _Devices) -> list[DevicePlan]:
    native = _native()
    info = native.ffi.new("struct llama_moe_cache_layer_info *")
    plans: dict[str, DevicePlan] = {}
    for i in range(n_layers):
        if native.lib().llama_moe_cache_layer_info(ctx, i, info):
            name = native.ffi.string(info.device).decode(errors="replace")
            plans.setdefault(name, DevicePlan(name, [], devices.free.get(name))).layers.append(info.il)
    return sorted(plans.values(), key=lambda d: d.layers[0])


def _size(plan: CachePlan, sizer: _Sizer, config: CacheConfig, tensor_split) -> int:
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


def _too_small(plan: CachePlan, sizer: _Sizer, config: CacheConfig) -> str:
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


def _retry(ctx, plan: CachePlan, sizer: _Sizer, devices: _Devices, config: CacheConfig, failed: int):
    """After a failed allocation of K = failed: once, the largest smaller K that fits every
    device's free memory less the reserve."""
    reserve = config.reserve_mib * MIB
    fits = []
    for d in plan.devices:
        free = devices.free_now(d.device)
        if free is None:
            plan.reason = (f"{plan.sized_by}: allocating {failed} slots per layer failed and "
                           f"{d.device} does not report its free memory to retry with")
            return 0, 0
        fits.append(slots_for_budget(lambda k: sizer.bytes(d.device, k), max(0, free - reserve), failed - 1))
    k = min(fits) if failed > 1 else 0
    if k == 0:
        plan.reason = (f"{plan.sized_by}: allocating {failed} slots per layer failed and not one "
                       f"slot per layer fits the free memory less {ENV_PREFIX}RESERVE_MIB={config.reserve_mib}")
        return 0, 0
    log.warning("moecache: %s: allocating %d slots per layer failed; retrying at %d, the largest "
                "that fits the free memory less %sRESERVE_MIB=%d", plan.sized_by, failed, k, ENV_PREFIX,
                config.reserve_mib)
    plan.retried_from = failed
    n_layers = _native().init(ctx, k, max_batch=config.max_batch)
    if n_layers <= 0:
        plan.reason = f"{plan.sized_by}: the retry at {k} slots per layer failed too (libllama's log says why)"
    return n_layers, k


def _describe(ctx, plan: CachePlan, sizer: _Sizer | None, devices: _Devices, shapes, n_expert: int) -> None:
    """Bytes, share of the experts and free memory left, per device, once allocated."""
    plan.bytes = int(_native().lib().llama_moe_cache_device_bytes(ctx))
    model_experts = len(shapes) * n_expert if shapes else None
    for d in plan.devices:
        if sizer is not None:
            d.bytes = sizer.bytes(d.device, plan.slots)
        elif len(plan.devices) == 1:
            d.bytes = plan.bytes
        d.free_after = devices.free_now(d.device)
        if model_experts:
            d.experts_cached = len(d.layers) * plan.slots / model_experts
    if model_experts:
        plan.experts_cached = plan.n_layers * plan.slots / model_experts
    predicted = [d.bytes for d in plan.devices]
    if None not in predicted and sum(predicted) != plan.bytes:
        log.warning("moecache: the plan predicted %d device bytes, libllama allocated %d", sum(predicted), plan.bytes)
