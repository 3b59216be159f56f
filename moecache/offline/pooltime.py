"""The pooled default in the time model (issue 37, step 5 of docs/notes/upstream-comparison.md, "A
pooled allocation: the design"): one pool of slots per group of layers (moecache.offline.pooled)
with the miss planner and the link's timing of every copy. MODELLED: no live code runs a pool.

What is modelled, per decode graph (one recorded ubatch), on one hardware class's Rates:

- The layers' times: Rates.layer_ms of each real layer's hits, lane copies and misses on the
  CPU (moecache.core.missplan), in layer order; a layer's observer runs once its ids reached the
  host (its start + the router + the ids' trip). Our graph never waits for an upload.
- The planner on the pool: an upload must beat its victim by the payback margin (PAYBACK uses
  x busy ** BUSY_POWER, busy the decayed share of the graphs' time the link carried their
  copies, as the engine's C observation keeps it), a lane copy by the margin less the lane's
  credit; the lane table per real layer (MissPlanner.lane_table). A lane copy takes only a slot
  safe now: empty, or a resident of a layer already run that no layer run so far selected
  (moecache.offline.pooled.PoolPlan); otherwise the candidate is handled as any other miss.
- The link (`LinkClock`): one host-to-device queue. A lane copy holds it in its layer's window
  (its layer's time counts it, as layer_ms does) and goes first; the asynchronous copies are
  carried in the order their observers started them (across groups, by time), each starting
  when its observer runs (a deferred copy: at its victim's layer's observer) or when the link
  is free, at min(link, dram) GB/s, in the link's time not taken by lane copies. A copy
  started late in a graph, or queued behind others, completes later; the queue carries over
  from graph to graph.
- Publication (`PUBLICATIONS`): "boundary", a copy is published at the first boundary after it
  completes (the engine's late uploads: in flight and unevictable until then, its expert a
  miss); "layer", also at its expert's layer in a later graph (the observer writes the entries
  of uploads complete since, as the lane does with ggml_backend_tensor_set): a copy complete
  before its layer's observer in graph t + 1 is as good as published at boundary t + 1 (that
  layer is the only one that reads it); that observer's time is estimated from the graph just
  run (the next graph's layer times are not known until it runs); "all": every copy complete at
  the next boundary (moecache.offline.pooled's assumption), the planner and times as above.
- The token's time: moecache.offline.cost's timeline over the real layers' passes
  (WorkTally: max of the layers' sum, the link's and host memory's bytes over the run), as
  the grid of scripts/compare_upstream.py times every design.

Not modelled: the DMA engine sharing host memory with the CPU's reads while a copy runs (a copy
runs at min(link, dram) whatever the CPU reads), a copy's own latency or launch, the worker
thread, the prompt's time (a prompt boundary completes every copy in flight), the lane copy's
wait for the link if an asynchronous copy holds it (the lane goes first), and the next graph's
layer times in the "layer" rule (the last graph's are used).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..core.banks import layers_by_size
from ..core.engine import _UploadQueue
from ..core.missplan import BUSY_DECAY, OUR_LAYOUT, MissPlanner, Rates
from ..formats.traces import RouteTrace
from .cost import WorkTally
from .experiments import HeatSumAdmission
from .pooled import PoolPlan, PooledEngine, Victims, pooled_trace
from .replay import PerLayerReplay, ReplayResult, simulate

PUBLICATIONS = ("all", "boundary", "layer")


def carry(begin: float, duration: float, lanes) -> float:
    """When a copy of `duration` ms that may start at `begin` is done, the link being taken by
    the lane copies' windows `lanes` ((start, end) sorted by start) whenever they run."""
    t, left = begin, duration
    for a, b in lanes:
        if b <= t:
            continue
        if a >= t + left:
            break
        left -= max(0.0, a - t)
        t = b
    return t + left


class LinkClock:
    """The decode graphs' timeline and the copies on the link (the module docstring). Times in
    ms from the first graph; rows are (group, key, slot) job rows; a row's real layer is
    groups[group][key // n_expert]."""

    def __init__(self, rates: Rates, expert_bytes, dense_bytes, groups: np.ndarray, n_expert: int,
                 publication: str = "layer"):
        if publication not in PUBLICATIONS:
            raise ValueError(f"publication must be one of {', '.join(PUBLICATIONS)}, got {publication!r}")
        self.rates, self.groups, self.n_expert, self.publication = rates, groups, n_expert, publication
        self.expert_bytes = np.asarray(expert_bytes, dtype=np.float64)
        self.dense_bytes = np.asarray(dense_bytes, dtype=np.float64)
        self.now = 0.0    # the boundary just reached: the end of the last graph
        self.free = 0.0   # when the link has carried every asynchronous copy started so far
        self.done: dict = {}  # (group, slot) -> (done, real layer) of the copies not published yet
        self.offset = np.zeros(self.expert_bytes.size)  # each layer's observer in the last graph, from its start
        self.flushing = False  # a prompt boundary: every copy complete

    def layer_of(self, row) -> int:
        return int(self.groups[row[0]][row[1] // self.n_expert])

    def graph(self, hits, lane, cpu, rows, at, is_lane) -> tuple[float, float]:
        """One decode graph: (L,) hits, lane copies and CPU misses per real layer; its slot writes
        `rows`, the real layer whose observer started each (`at`) and which are lane copies.
        Returns the graph's time and the link time its copies took (ms)."""
        r = self.rates
        times = r.layer_ms(OUR_LAYOUT, self.expert_bytes, self.dense_bytes, hits, lane, cpu)
        start = self.now + np.concatenate(([0.0], np.cumsum(times)[:-1]))
        observer = start + self.dense_bytes / (r.device_gbps * 1e6) + r.ids_trip_us / 1e3
        lane_ms = np.asarray(lane) * self.expert_bytes / (r.link_gbps * 1e6)
        windows = [(observer[layer], observer[layer] + lane_ms[layer]) for layer in np.flatnonzero(lane_ms)]
        link_ms = float(lane_ms.sum())
        for n in sorted(range(len(rows)), key=lambda n: observer[at[n]]):  # stable: a layer's in start order
            layer = self.layer_of(rows[n])
            if is_lane[n]:
                done = observer[at[n]] + lane_ms[at[n]]
            else:
                copy_ms = self.expert_bytes[layer] / (min(r.link_gbps, r.dram_gbps) * 1e6)
                self.free = done = carry(max(observer[at[n]], self.free), copy_ms, windows)
                link_ms += self.expert_bytes[layer] / (r.link_gbps * 1e6)
            self.done[int(rows[n][0]), int(rows[n][2])] = (done, layer)
        self.offset = observer - self.now
        self.now += float(times.sum())
        return float(times.sum()), link_ms

    def ready(self, row) -> bool:
        """Whether a due row is published at the boundary just reached (module docstring); a
        published row leaves the clock."""
        key = int(row[0]), int(row[2])
        if key not in self.done:  # not a decode graph's copy (a prompt's upload): complete
            return True
        done, layer = self.done[key]
        limit = self.now + (self.offset[layer] if self.publication == "layer" else 0.0)
        if self.flushing or self.publication == "all" or done <= limit:
            del self.done[key]
            return True
        return False

    def flush(self) -> None:
        """A prompt ran: every copy in flight is complete by its end."""
        self.flushing, self.now = True, max(self.now, self.free)
        self.free = self.now


class _TimedQueue(_UploadQueue):
    """The engine's upload queue, publishing the due uploads the clock says are complete."""

    def __init__(self, core, clock: LinkClock):
        super().__init__(core, 1)
        self._clock = clock

    def publish(self, ready):
        due = self._due[0]
        if len(due):
            mask = np.array([self._clock.ready(row) for row in due.tolist()], dtype=bool)
            self._due[0] = np.concatenate((due[mask], due[~mask]))
            ready = int(mask.sum())
        return super().publish(ready)


class TimedPooledEngine(PooledEngine):
    """PooledEngine with the miss planner (planner=False: without) and the link's timing of its
    copies (the module docstring); `work` tallies the real layers' decode passes."""

    def __init__(self, trace: RouteTrace, slots: int, policy, rates: Rates, *, rule=Victims("defer"),
                 publication: str = "layer", planner: bool = True, inserts: int | None = None,
                 busy_cap: float | None = 1.0):
        pooled, n_sub = pooled_trace(trace)
        super().__init__(pooled.layers.size, pooled.n_expert, slots * n_sub, policy, n_sub=n_sub,
                         inserts=inserts, rule=rule)
        self.groups = np.array(list(layers_by_size(trace.expert_bytes).values()))
        self.E = trace.n_expert
        self.clock = LinkClock(rates, trace.expert_bytes, trace.dense_bytes, self.groups, trace.n_expert, publication)
        self._queue = _TimedQueue(self.bookkeeping, self.clock)
        self.work = WorkTally(OUR_LAYOUT, trace.expert_bytes, trace.dense_bytes)
        self.planner = MissPlanner(rates, trace.expert_bytes, trace.dense_bytes, n_used=trace.n_expert_used) \
            if planner else None
        self.lanes = None if self.planner is None else \
            self.planner.lane_table(trace.n_expert, trace.n_expert_used)[self.groups]
        self.link = {"link_ms": 0.0, "graph_ms": 0.0, "busy": 1.0}  # mc_link's decayed averages
        self.terms = (0.0, 0.0)  # the next graph's margin and lane credit
        self.lane_misses = 0
        self.busy_cap = busy_cap  # mc_link caps busy at 1; None: the link's backlog raises the margin further

    def graph_plan(self) -> PoolPlan | None:
        return PoolPlan(*self.terms, self.lanes)  # without a planner: no margin, no lane

    def graph_walked(self, ids, admitted) -> None:
        hits, lane, cpu = self._layer_counts(ids, admitted)
        rows = self.graph_rows
        at = [int(self.groups[g][i]) for g, i in zip(admitted[:, 0].tolist(), rows["at"])]
        graph_ms, link_ms = self.clock.graph(hits, lane, cpu, admitted.tolist(), at, rows["lane"])
        self.work.add_layers(hits, lane, cpu)
        layers = [self.clock.layer_of(row) for row in admitted.tolist()]
        self.work.add_async(np.bincount(layers, minlength=hits.size).astype(np.int64) - lane)
        self.lane_misses += int(lane.sum())
        d, link = BUSY_DECAY, self.link
        link["link_ms"] = d * link["link_ms"] + (1 - d) * link_ms
        link["graph_ms"] = d * link["graph_ms"] + (1 - d) * graph_ms
        busy = 1.0 if link["graph_ms"] == 0 else link["link_ms"] / link["graph_ms"]
        link["busy"] = busy if self.busy_cap is None else min(self.busy_cap, busy)

    def _layer_counts(self, ids, admitted):
        """(L,) hits, lane copies and CPU misses per real layer of the graph that selected `ids`
        (the experts published before it; one evicted ahead that a later layer reads, a CPU miss)."""
        L, k = self.groups.size, ids.shape[1] // self.n_sub
        hits, lookups, lane = (np.zeros(L, dtype=np.int64) for _ in range(3))
        for g, row in enumerate(ids):
            found = (row >= 0) & (self.expert_slot[g][np.maximum(row, 0)] >= 0)
            hits[self.groups[g]] += found.reshape(self.n_sub, k).sum(axis=1)
            lookups[self.groups[g]] += (row >= 0).reshape(self.n_sub, k).sum(axis=1)
            for key in [key for gg, key in self.graph_rows["read_ahead"] if gg == g]:
                hits[self.groups[g][key // self.E]] -= int((row == key).sum())
        for row, is_lane in zip(admitted.tolist(), self.graph_rows["lane"]):
            lane[self.clock.layer_of(row)] += is_lane
        return hits, lane, lookups - hits - lane

    def step(self, ids=None, ready=None, admitted=None, prefill=False, lane_rows=0, declined=None):
        if prefill:
            self.clock.flush()
        plan = super().step(ids, ready, admitted, prefill, lane_rows, declined)
        self.clock.flushing = False
        if self.planner is not None:  # worth_if_used counts the use in the next graph (EagerAdmission.hand_over)
            use = self.policy.use_worth(self.step_index)
            self.terms = (self.planner.margin(use, self.link["busy"]), self.planner.lane_credit * use)
        return plan


def timed_pooled_replay(trace: RouteTrace, policy, slots: int, rates: Rates, *, rule=Victims("defer"),
                        publication: str = "layer", planner: bool = True, inserts: int | None = None,
                        tally: dict | None = None, busy_cap: float | None = 1.0,
                        per_layer: bool = False) -> ReplayResult:
    """A replay of `trace` by TimedPooledEngine (the pool of `slots` per layer's bytes, eager, the
    prompt warming the cache), its result timed on the real layers' passes. tally: gets the
    engine's (copies, layers waited, late uploads, lane copies, uploads the margin declined).
    per_layer: every layer its own pool (its expert bytes made distinct by a few bytes): K
    slots per layer, as shipped, under the same timing (the control)."""
    if per_layer:
        trace = replace(trace, expert_bytes=np.asarray(trace.expert_bytes) + np.arange(trace.layers.size))
    engine = TimedPooledEngine(trace, slots, policy, rates, rule=rule, publication=publication, planner=planner,
                               inserts=inserts, busy_cap=busy_cap)
    pooled, _ = pooled_trace(trace)
    result = simulate(pooled, PerLayerReplay(engine, prefill="warm"))
    if tally is not None:
        tally.update(engine.tally, clobbered=engine.clobbered, late=result.totals.get("late", 0),
                     lane_misses=engine.lane_misses)
    return replace(result, work=engine.work)


POOLED_DEFAULT = ("heat-sum 8+64 (1:2), admission test with 2 uses' credit, unlimited",
                  lambda: HeatSumAdmission((8, 64), (1.0, 2.0), credit=2.0))
UNCAPPED = {"busy_cap": None}  # the planner's busy share not capped at 1: a backlog raises the margin further
TIMED_VARIANTS = [  # (label, Victims, publication, timed_pooled_replay's options): scripts/pooled_time.py
    ("defer, every copy at the next boundary (untimed)", Victims("defer"), "all", {}),
    ("defer, published at the boundary", Victims("defer"), "boundary", {}),
    ("defer, published at its layer", Victims("defer"), "layer", {}),
    ("defer 8, else ahead 8, published at the boundary", Victims("defer", 8, reach=8), "boundary", {}),
    ("defer 8, else ahead 8, published at its layer", Victims("defer", 8, reach=8), "layer", {}),
    ("defer, published at the boundary, busy uncapped", Victims("defer"), "boundary", UNCAPPED),
    ("defer, published at its layer, busy uncapped", Victims("defer"), "layer", UNCAPPED),
    ("defer 8, else ahead 8, published at its layer, busy uncapped", Victims("defer", 8, reach=8), "layer", UNCAPPED),
    ("defer, published at its layer, busy uncapped, INSERTS 2", Victims("defer"), "layer", {**UNCAPPED, "inserts": 2}),
]
