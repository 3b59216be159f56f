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
stock --cpu-moe and ours always, upstream where it bypasses its cache or (b12191) with a CPU
share. Expert counts
are in experts of the layer (expert_bytes each), rates in GB/s (1e9 bytes), latencies in us.

The plan (`MissPlanner`) is a rule the handover carries (moecache.core.admission states it; libllama
runs it, native/engine_core.c's mc_admit models it): per layer of a graph, once its ids are known,
- lane: of the m candidates (misses neither held nor on their way, worth above -inf),
  lane[l, m] go through the copy-on-miss lane, the most valuable first (the policy's admission
  worth). lane[l, m] is the number n that minimises layer_ms with m - n misses on the CPU and the
  layer's other n_used - m selections hits (ties: the fewer copies; `lane_table`). A lane copy
  takes a victim slot when it passes the policy's admission test (worth above the victim's) and
  is kept there; one that fails it is computed on the CPU: there are no scratch slots.
- uploads: a candidate outside the lane is uploaded asynchronously only if it pays: its expected
  uses beyond the victim's (worth counted in uses, Policy.use_worth) times the time a miss
  costs (at `miss_gbps`, the rate the CPU and the lane serve misses together) must exceed
  the time its copy holds the link (at `upload_gbps`): PAYBACK = miss_gbps / upload_gbps
  uses, as far as the link is busy: the handover's `margin` is PAYBACK x busy ** BUSY_POWER,
  busy the link's share of the recent decode graphs' modelled time: the link time of each
  graph's slot writes (lane copies among them) and of the boundary's uploads that ran beside
  it, against the graph's layer_ms, decayed averages the engine's C observation keeps
  (Bookkeeping.model_graphs; the same in a live run and its replay). An upload into an idle
  link costs nothing; near saturation it costs its full link time. The handover's budget
  (INSERTS) caps the layer's slot writes, lane copies and uploads alike.
- a lane copy holds the link as an upload does, so it owes the same margin, and it pays part of
  it back in its own graph: it serves the miss there, on the device, instead of the CPU. Its
  credit is the most one copy shortens a layer of one decode token (lane_table's splits: per
  copy, layer_ms without the copies less with them), in the same unit, misses at miss_gbps
  (`lane_credit`; where the CPU bounds the layer, one CPU read of the expert: miss_gbps /
  host_gbps uses). A lane copy must beat its victim by margin - credit (less than nothing: a
  credit), an upload by the margin. libllama's rule has a lane copy beat its victim's worth as
  handed over and an upload beat it by the handover's margin, so the handover carries the
  victims' worths lowered by credit - margin and the margin credit (`terms`); where the lane
  table makes no copy, the worths as they are and the margin.

Without the lane (`lane=False`) the handover carries the margin alone: every miss on the CPU,
the payback rule for the uploads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np


# the payback margin scales with the link's busy share: averaged over the last ~1 / (1 - BUSY_DECAY)
# decode graphs, raised to BUSY_POWER (chosen on the shipped traces' modelled grid,
# docs/cost-model.md, "Modelled cost": 4 and 8 did best, 1 left uploads that would have paid undone)
BUSY_DECAY = 0.9
BUSY_POWER = 4


@dataclass(frozen=True)
class Layout:
    """How one design runs a layer (see the module docstring)."""

    name: str
    device_waits: bool   # the device computes only after the ids' trip and the copies
    host_node: bool      # the graph always has a CPU node whose result returns (the join)


STOCK_LAYOUT = Layout("stock --cpu-moe", device_waits=False, host_node=True)
OUR_LAYOUT = Layout("moecache", device_waits=False, host_node=True)
UPSTREAM_LAYOUT = Layout("upstream llama.cpp", device_waits=True, host_node=False)
# b12191's --moe-cache-cpu-share F > 0: its graph computes a share of the misses on the CPU
UPSTREAM_CPU_SHARE_LAYOUT = Layout("upstream llama.cpp, CPU share", device_waits=True, host_node=True)


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
    def transfer_ms(nbytes: float, gbps: float) -> float:
        """Milliseconds to move nbytes at gbps."""
        return nbytes / (gbps * 1e6)

    def host_ms(self, cpu_bytes, lane_bytes):
        """The CPU's reads and the lane's copies, side by side, sharing host memory."""
        return np.maximum(np.maximum(self.transfer_ms(cpu_bytes, self.host_gbps),
                                     self.transfer_ms(lane_bytes, self.link_gbps)),
                          self.transfer_ms(cpu_bytes + lane_bytes, self.dram_gbps))

    def layer_ms(self, layout: Layout, expert_bytes, dense_bytes, hits, lane, cpu):
        """One layer of one decode token (the module docstring's formula); numbers, or arrays
        of layers (or of choices) alike."""
        hits, lane, cpu = np.asarray(hits), np.asarray(lane), np.asarray(cpu)
        window = self.ids_trip_us / 1e3 + self.host_ms(cpu * expert_bytes, lane * expert_bytes)
        host_end = np.where(layout.host_node | (cpu > 0), window + self.join_us / 1e3, 0.0)
        start = np.where(layout.device_waits | (lane > 0), window, 0.0)
        device_end = np.where(hits + lane > 0,
                              start + self.transfer_ms((hits + lane) * expert_bytes, self.device_gbps), 0.0)
        return self.transfer_ms(dense_bytes, self.device_gbps) + np.maximum(host_end, device_end)

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
        n = np.arange(movable + 1)
        times = self.layer_ms(OUR_LAYOUT, expert_bytes, dense_bytes, hits, n, cpu_fixed + movable - n)
        return int(np.argmin(times))  # the first minimum: the fewest copies


class MissPlanner:
    """The lane table and the payback margin each eager handover carries (moecache.core.admission),
    from the rates, each layer's expert and dense bytes and the experts a token selects (n_used);
    lane=False: no copy-on-miss lane, every miss on the CPU and the payback rule alone."""

    def __init__(self, rates: Rates, expert_bytes, dense_bytes=None, *, n_used: int | None = None,
                 lane: bool = True):
        self.rates, self.lane, self.n_used = rates, lane, n_used
        self.expert_bytes = np.asarray(expert_bytes, dtype=np.float64)
        self.dense_bytes = np.zeros_like(self.expert_bytes) if dense_bytes is None else \
            np.asarray(dense_bytes, dtype=np.float64)
        if self.dense_bytes.shape != self.expert_bytes.shape:
            raise ValueError("expert_bytes and dense_bytes need one value per layer each")
        if lane and (isinstance(n_used, bool) or not isinstance(n_used, (int, np.integer)) or n_used < 1):
            raise ValueError(f"the lane's planner needs n_used, the experts a token selects (>= 1), got {n_used!r}")
        self._tables: dict = {}  # (n_expert, n_used) -> lane table
        self._payback_uses = rates.payback_uses  # the rates are fixed: once, not at every step
        self.lane_credit = self._lane_credit() if lane else 0.0
        # layer_ms of one decode token's counts (each below n_used + 1), by layer size: [group, hits, lane, cpu];
        # the engine's C observation sums it per graph (Bookkeeping.model_graphs): in numpy that cost a
        # tenth of a live step
        sizes, group = np.unique(np.stack([self.expert_bytes, self.dense_bytes]), axis=1, return_inverse=True)
        counts = np.arange((n_used or 0) + 1)
        self.token_table = np.ascontiguousarray(self.rates.layer_ms(
            OUR_LAYOUT, sizes[0][:, None, None, None], sizes[1][:, None, None, None],
            counts[None, :, None, None], counts[None, None, :, None], counts[None, None, None, :]))
        self.layer_group = np.ascontiguousarray(group.reshape(-1), dtype=np.int64)

    def graph_ms(self, hits, lane, misses) -> float:
        """The modelled time of a decode graph with these per-layer hits, misses and lane copies
        (among the misses), by the formula (the engine's observation sums token_table for one
        token's counts)."""
        hits, lane, misses = np.asarray(hits), np.asarray(lane), np.asarray(misses)
        return float(np.sum(self.rates.layer_ms(OUR_LAYOUT, self.expert_bytes, self.dense_bytes, hits, lane,
                                                misses - lane)))

    def margin(self, use_worth: float, busy: float) -> float:
        """What an asynchronous upload's worth must beat its victim's by: PAYBACK uses, as far
        as the link is busy (busy ** BUSY_POWER: an upload into an idle link costs nothing)."""
        return self._payback_uses * use_worth * busy ** BUSY_POWER

    def _lane_credit(self) -> float:
        """The most one lane copy shortens a layer of one decode token (m of its n_used selections
        missed, the lane's split of them), in misses at miss_gbps; 0 where the lane copies nothing."""
        credit = 0.0
        for size, dense in set(zip(self.expert_bytes.tolist(), self.dense_bytes.tolist())):
            for m in range(1, self.n_used + 1):
                hits = self.n_used - m
                n = self.rates.lane_split(size, dense, hits=hits, cpu_fixed=0, movable=m)
                if n:
                    saved = self.rates.layer_ms(OUR_LAYOUT, size, dense, hits, 0, m) - \
                        self.rates.layer_ms(OUR_LAYOUT, size, dense, hits, n, m - n)
                    credit = max(credit, float(saved) / n / self.rates.transfer_ms(size, self.rates.miss_gbps))
        return credit

    def terms(self, use_worth: float, busy: float) -> tuple[float, float]:
        """(margin, lowered): what the handover's margin is and what the victims' worths are
        lowered by, so that under libllama's rule an upload beats its victim by margin(use_worth,
        busy) and a lane copy by that less lane_credit uses (the module docstring)."""
        margin = self.margin(use_worth, busy)
        if not self.lane_credit:
            return margin, 0.0
        credit = self.lane_credit * use_worth
        return credit, credit - margin

    def lane_table(self, n_expert: int, n_used: int) -> np.ndarray:
        """(L, E + 1) int32: lane[l, m], how many of m candidates of layer l take the lane, the
        layer's other n_used - m selections hits (read-only; layers of equal bytes share rows)."""
        key = (n_expert, n_used)
        if key not in self._tables:
            rows: dict = {}
            table = np.empty((self.expert_bytes.size, n_expert + 1), dtype=np.int32)
            for layer, sizes in enumerate(zip(self.expert_bytes, self.dense_bytes)):
                if sizes not in rows:
                    rows[sizes] = [self.rates.lane_split(*sizes, hits=max(n_used - m, 0), cpu_fixed=0, movable=m)
                                   for m in range(n_expert + 1)]
                table[layer] = rows[sizes]
            table.flags.writeable = False
            self._tables[key] = table
        return self._tables[key]


def planner_by_default(policy, admission: str) -> bool:
    """Whether a context that sets no LLAMA_MOE_CACHE_PLANNER runs the miss planner: wherever it
    can run, eager admission with a policy whose worth counts uses (policy.counts_uses: heat,
    lfu), at any rates.

    Contract (for the live config, which calls it once per context): policy is the context's
    Policy class or object, admission its resolved timing ("eager" or "boundary"). True: build
    the engine with MissPlanner at the rates attach measured (or LLAMA_MOE_CACHE_LINK_GBPS /
    _HOST_GBPS), exactly as LLAMA_MOE_CACHE_PLANNER=1 does; False: no planner. An explicit
    LLAMA_MOE_CACHE_PLANNER=0 or 1 overrides it. The replay's moecache.offline.replay.
    zero_configuration runs the same rule.

    Why the rates and the layer shapes do not enter (MODELLED, docs/cost-model.md, "The planner by
    default"): over scripts/compare_upstream.py's grid (both shipped traces, K = 8, 16, 32, each
    hardware class) the planner is never slower than the same context without it (0.20 to 0.998
    of its time). Over scripts/planner_sweep.py's 96 more rate sets it was slower in 20 of 594
    cells, by 3.8% at most (its margin declined uploads that would have paid), and no threshold
    on a static figure of the rates and shapes kept those off without turning off grid cells
    that it speeds up."""
    return admission == "eager" and bool(policy.counts_uses)
