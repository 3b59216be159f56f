"""Bank arithmetic: the device bytes of a per-layer cache of K slots, and the K a budget buys.
The live sizing and the offline models share these rules."""

from __future__ import annotations


def slots_for_budget(bytes_of, budget: int, n_expert: int) -> int:
    """The largest K in [1, n_expert] with bytes_of(K) <= budget (bytes_of grows with K); 0 when
    not even K = 1 fits."""
    if bytes_of(1) > budget:
        return 0
    low, high = 1, n_expert  # bytes_of(low) fits
    while low < high:
        mid = (low + high + 1) // 2
        if bytes_of(mid) <= budget:
            low = mid
        else:
            high = mid - 1
    return low


def ram_slots(expert_bytes, n_expert: int, budget: int) -> int:
    """The RAM tier's K (LLAMA_MOE_CACHE_RAM_MIB): the most experts per layer whose bytes over all
    layers fit `budget`, at most n_expert; 0 below one per layer."""
    per_k = sum(int(b) for b in expert_bytes)
    return slots_for_budget(lambda k: k * per_k, budget, n_expert)


def layers_by_size(expert_bytes) -> dict[int, list[int]]:
    """The layers of each expert size (in bytes), in layer order: a bank's, or a group's, layers."""
    members: dict[int, list[int]] = {}
    for layer, size in enumerate(expert_bytes):
        members.setdefault(int(size), []).append(layer)
    return members


def equal_bytes(expert_bytes, slots_per_layer: int) -> int:
    """Device bytes of moecache's per-layer cache at K slots: a bank per expert layout (layers of
    equal expert_bytes, the grouping this model uses too) of n_layers * K slots plus one all-zero
    slot that uncached experts are remapped to; the budget the upstream model gets for an
    equal-memory comparison."""
    return sum(size * (len(layers) * slots_per_layer + 1) for size, layers in layers_by_size(expert_bytes).items())
