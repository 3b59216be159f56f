"""Every miss where it costs least (issue 22): one MoE layer's time in a decode token, and the
plan that follows from it, given the rates of the machine.

A layer's time (`Rates.layer_ms`), from the layer's input on the device to its output there:

    router    dense_bytes / device              attention and router on the device
    ids       ids_trip                          the router's ids reach the host (a sync)
    host      max(cpu / host, lane / link,      the CPU reads its misses while the DMA engine
                  (cpu + lane) / dram)          copies the lane's: each at its own rate, both
                                                sharing host memory
    device    (hits + lane) / device            experts computed from device memory
    join      join                              the CPU's partial result returns to the device

    layer = router + max(ids + host + join,                     (the CPU's branch)
                         [ids + host if waiting] + device)      (the device's branch)

"waiting": the device starts its experts only once the ids reached the host and the copies
landed: always for upstream llama.cpp's cache (it reads the ids back to plan its copies, then
computes every expert), for ours only when the lane copied something (the slots the device
reads must hold the copies); our hits alone start right after the router (the device table
remaps the ids on the device). The join is paid by every layer whose graph has a CPU node:
stock --cpu-moe and ours always, upstream only where it bypasses its cache. Expert counts
are in experts of the layer (expert_bytes each), rates in GB/s (1e9 bytes), latencies in us.

The plan (`MissPlanner`), per layer of a graph, once its ids are known:
- lane: of the misses that are neither held nor on their way, the number n that minimises
  layer_ms (ties: the fewer copies) go through the copy-on-miss lane, the most valuable first
  (the policy's admission worth); the CPU skips them. Each takes a victim slot when it passes
  the policy's admission test (worth above the victim's), else a scratch slot not kept.
- uploads: a miss left to the CPU is uploaded asynchronously only if it pays: its expected
  uses beyond the victim's (worth counted in uses, Policy.use_worth) times the time a miss
  costs (at `miss_gbps`, the rate the CPU and the lane serve misses together) must exceed
  the time its copy holds the link (at `upload_gbps`): PAYBACK = miss_gbps / upload_gbps
  uses. The handover's budget (INSERTS) caps the layer's slot writes, lane and uploads alike.

Without the lane (`lane=False`: libllama has none yet, so live every miss runs on the CPU) the
plan is the payback rule alone: eager admission's rule (worth > victim's) on a handover whose
worths are lowered by the margin (`shaped`). That is how the live planner acts, with no change
to libllama: the engine hands over the shaped worths (moecache.core.admission.EagerAdmission).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from .admission import Handover
from .state import NO_JOBS


@dataclass(frozen=True)
class Layout:
    """How one design runs a layer (see the module docstring)."""

    name: str
    device_waits: bool   # the device computes only after the ids' trip and the copies
    host_node: bool      # the graph always has a CPU node whose result returns (the join)


STOCK_LAYOUT = Layout("stock --cpu-moe", device_waits=False, host_node=True)
OUR_LAYOUT = Layout("moecache", device_waits=False, host_node=True)
UPSTREAM_LAYOUT = Layout("upstream llama.cpp", device_waits=True, host_node=False)


@dataclass(frozen=True)
class Rates:
    """The machine a layer's time depends on (GB/s are 1e9 bytes per second)."""

    host_gbps: float      # the CPU's expert kernels reading host memory
    link_gbps: float      # host-to-device copies
    dram_gbps: float      # host memory's total read rate, shared by the CPU and the DMA engine
    device_gbps: float    # the GPU's kernels reading device memory
    ids_trip_us: float    # a layer's router ids reach the host (device -> host copy and sync)
    join_us: float        # a CPU partial result returns to the device

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            low_ok = value >= 0 if f.name.endswith("_us") else value > 0
            if not (low_ok and math.isfinite(value)):
                raise ValueError(f"{f.name} must be a finite number {'>= 0' if f.name.endswith('_us') else '> 0'}, "
                                 f"got {value}")

    @staticmethod
    def _ms(nbytes: float, gbps: float) -> float:
        return nbytes / (gbps * 1e6)

    def host_ms(self, cpu_bytes: float, lane_bytes: float) -> float:
        """The CPU's reads and the lane's copies, side by side, sharing host memory."""
        return max(self._ms(cpu_bytes, self.host_gbps), self._ms(lane_bytes, self.link_gbps),
                   self._ms(cpu_bytes + lane_bytes, self.dram_gbps))

    def layer_ms(self, layout: Layout, expert_bytes: float, dense_bytes: float,
                 hits: int, lane: int, cpu: int) -> float:
        """One layer of one decode token (the module docstring's formula)."""
        window = self.ids_trip_us / 1e3 + self.host_ms(cpu * expert_bytes, lane * expert_bytes)
        host_end = window + self.join_us / 1e3 if layout.host_node or cpu else 0.0
        device_end = 0.0
        if hits or lane:
            start = window if layout.device_waits or lane else 0.0
            device_end = start + self._ms((hits + lane) * expert_bytes, self.device_gbps)
        return self._ms(dense_bytes, self.device_gbps) + max(host_end, device_end)

    @property
    def miss_gbps(self) -> float:
        """The rate misses are served at when the CPU and the lane share them."""
        return min(self.host_gbps + self.link_gbps, self.dram_gbps)

    @property
    def upload_gbps(self) -> float:
        return min(self.link_gbps, self.dram_gbps)

    @property
    def payback_uses(self) -> float:
        """Expected uses beyond its victim's an asynchronous upload must bring to pay back the
        link time it takes: each later hit saves one miss at miss_gbps."""
        return self.miss_gbps / self.upload_gbps

    def lane_split(self, expert_bytes: float, dense_bytes: float, hits: int, cpu_fixed: int,
                   movable: int) -> int:
        """How many of `movable` misses take the lane (the rest, and cpu_fixed, on the CPU):
        the fewest that minimise layer_ms."""
        times = [self.layer_ms(OUR_LAYOUT, expert_bytes, dense_bytes, hits, n, cpu_fixed + movable - n)
                 for n in range(movable + 1)]
        return int(np.argmin(times))  # the first minimum: the fewest copies


@dataclass
class MissPlan:
    """One graph's plan: the slot writes in the order they start ((n, 3) job rows of admission
    order, layer by layer, the lane's first), and per layer the misses through the lane and
    how many of the writes are lane copies kept in a slot."""

    jobs: np.ndarray
    lane: np.ndarray        # (L,)
    lane_kept: np.ndarray   # (L,)


class MissPlanner:
    """The plan of each graph under an eager handover (moecache.core.admission), from the rates
    and each layer's expert and dense bytes; lane=False: no copy-on-miss lane, every miss on
    the CPU and the payback rule alone (the live planner until libllama has the lane)."""

    def __init__(self, rates: Rates, expert_bytes, dense_bytes=None, *, lane: bool = True):
        self.rates, self.lane = rates, lane
        self.expert_bytes = np.asarray(expert_bytes, dtype=np.float64)
        self.dense_bytes = np.zeros_like(self.expert_bytes) if dense_bytes is None else \
            np.asarray(dense_bytes, dtype=np.float64)
        if self.dense_bytes.shape != self.expert_bytes.shape:
            raise ValueError("expert_bytes and dense_bytes need one value per layer each")
        self._splits: dict = {}  # (layer, hits, cpu_fixed, movable) -> lane count

    def margin(self, use_worth: float) -> float:
        """What an asynchronous upload's worth must beat its victim's by: PAYBACK uses."""
        return self.rates.payback_uses * use_worth

    def shaped(self, handover: Handover, use_worth: float) -> Handover:
        """The handover whose eager rule is the payback rule: every worth lowered by the margin."""
        return Handover(handover.victims, handover.victim_worth, handover.worth - self.margin(use_worth),
                        handover.budget)

    def _split(self, layer, hits, cpu_fixed, movable):
        if not self.lane:
            return 0
        key = (layer, hits, cpu_fixed, movable)
        if key not in self._splits:
            self._splits[key] = self.rates.lane_split(self.expert_bytes[layer], self.dense_bytes[layer],
                                                      hits, cpu_fixed, movable)
        return self._splits[key]

    def plan(self, handover: Handover, ids: np.ndarray, hit_mask: np.ndarray,
             slot_expert: np.ndarray, use_worth: float) -> MissPlan:
        """ids: the graph's (L, n) selections (router-rank order, -1 none), hit_mask like ids;
        slot_expert: the slots' experts when the handover was made (held or on their way);
        use_worth: the handover's worth units of one use (Policy.use_worth)."""
        if ids.shape[0] != self.expert_bytes.size:
            raise ValueError(f"ids have {ids.shape[0]} layers, the planner {self.expert_bytes.size}")
        margin = self.margin(use_worth)
        L = ids.shape[0]
        lane, kept, rows = np.zeros(L, dtype=np.int64), np.zeros(L, dtype=np.int64), []
        for layer in range(L):
            selected = dict.fromkeys(int(e) for e in ids[layer] if e >= 0)  # rank order, distinct
            hit = {int(e) for e, h in zip(ids[layer], hit_mask[layer]) if e >= 0 and h}
            held = set(slot_expert[layer].tolist())
            misses = [e for e in selected if e not in hit]
            candidates = [e for e in misses if e not in held]  # on their way: the CPU's
            if not misses:
                continue
            worth = handover.worth[layer]
            n = self._split(layer, len(hit), len(misses) - len(candidates), len(candidates))
            by_worth = sorted(candidates, key=lambda e: -worth[e])  # stable: rank breaks ties
            lane_set = by_worth[:n]
            order = lane_set + [e for e in candidates if e not in lane_set]
            victims = [(int(v), w) for v, w in zip(handover.victims[layer], handover.victim_worth[layer])
                       if v >= 0 and slot_expert[layer, v] not in selected]
            at, started = 0, 0
            for e in order:
                if started == handover.budget[layer] or at == len(victims):
                    break
                through_lane = e in lane_set
                if worth[e] - (0.0 if through_lane else margin) > victims[at][1]:
                    rows.append((layer, e, victims[at][0]))
                    kept[layer] += through_lane
                    at += 1
                    started += 1
            lane[layer] = n
        jobs = np.array(rows, dtype=np.int32).reshape(-1, 3) if rows else NO_JOBS
        return MissPlan(jobs, lane, kept)
