"""One pool of slots per group of layers under our cache's rules, modelled offline (issue 37): is
a pooled allocation what gives upstream's ClassLRU its lead? Not a live model: libllama gives
each layer K slots of its group's bank (docs/notes/upstream-comparison.md, "A pooled allocation: the design").

The pool of a group (the layers of one expert size, as upstream groups them) is one engine
"layer" whose experts are the group's (layer, expert) keys, layer i's expert e at i * n_expert +
e, and whose slots are the group's n_layers * K: the same device bytes as K slots per layer
(`pooled_trace`). The engine (`PooledEngine`, a CacheEngine) then runs its rules unchanged:
publication one boundary late, eager admission (the policy's worths and the pool's victims in
its priority order, handed over at each boundary), the prompt warming the cache, each layer's
prompt experts, its K most used, as today. What the merged layer cannot express is the graph's
order of layers, so the graph's slot writes are computed here (`pool_admissions`) and handed to
the engine as libllama's reported ones: the layers in order, each walking its distinct misses in
rank order, at most `inserts` slot writes per layer (INSERTS per layer, as live), each taking the
pool's next victim it may take when its worth beats the victim's (strictly; no lane, no margin:
the hit rates are the policy's).

Which victims a layer may take is the pool's open question: its copy overwrites the victim's
slot while the graph runs, so no later layer of that graph may read it. VICTIM_RULES:

- "oracle": any resident that no layer of the graph selects (the graph's later selections are
  not known when a layer's ids are: a bound, not a mechanism).
- "run": residents of the layers already run in the graph (this one's included) that they did
  not select: safe, but early layers can only evict their own and the layers before them.
- "ahead": any resident not selected by the layers run so far and not used by its layer in the
  last `window` graphs (or, with `below`, whose worth is under that share of the worth of an
  expert used in every graph); a later layer that selects a resident evicted ahead in the same
  graph finds it unpublished and computes it on the CPU: a miss (`PooledEngine.clobbered`, moved
  from the engine's hits to its misses in `stats()`). `readmit`: that layer copies it back (a
  lane copy, still a miss, as upstream's synchronous copies are); `reserve`: a layer not yet run
  keeps at least that many residents.
- "defer": the oracle's victims, realizably: a miss takes the next victim in the pool's order
  that no layer run so far selects; if the victim's layer has not run yet the copy waits for
  it (a reservation): when that layer has run without selecting the victim the copy starts,
  else the miss takes the next victim it may take then. With `reach`, a copy waits at most that
  many layers; beyond, the victim must be marked as ahead's are and is taken at once.
- "run-first": the run rule's victims first, ahead's only when none is left.

The slot writes are then the engine's eager admissions of the graph, published at the next
boundary like any eager upload, whatever layer started them (the hit rates do not see that a
deferred copy starts later; `pool_admissions`' tally counts how much later). With a `PoolPlan`
the walk follows the miss planner's rule too (its margin, a lane restricted to slots safe now):
moecache.offline.pooltime times the copies on the link and publishes them when they are done.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

from ..core.banks import layers_by_size
from ..core.engine import CacheEngine
from ..core.policies import POLICIES, make_policy, resolve_policy
from ..formats.traces import RouteTrace
from . import steps
from .experiments import HeatSum, HeatSumAdmission
from .replay import PER_LAYER, PerLayerReplay, ReplayResult, simulate

VICTIM_RULES = ("oracle", "run", "ahead", "defer", "run-first")


def pooled_trace(trace: RouteTrace) -> tuple[RouteTrace, int]:
    """The trace with one layer per group of equal expert size (its layers' selections side by
    side, layer i's expert e as i * n_expert + e), and the layers per group (equal in every
    group: the engine has one K)."""
    groups = list(layers_by_size(trace.expert_bytes).values())
    n = len(groups[0])
    if any(len(g) != n for g in groups):
        raise ValueError(f"pooled_trace needs groups of equal layer counts, got {[len(g) for g in groups]}")
    E = trace.n_expert
    # every layer's place in its group: pooled layer g's i-th layer is groups[g][i]
    shifted = np.where(trace.ids >= 0, trace.ids + _place(groups, trace.layers.size)[None, :, None] * E, -1)

    def merge(a):
        return np.stack([np.concatenate([a[:, layer] for layer in g], axis=1) for g in groups], axis=1)
    return replace(trace, n_layer=len(groups), n_expert=n * E, n_expert_used=n * trace.n_expert_used,
                   layers=np.arange(len(groups)),
                   expert_bytes=np.array([trace.expert_bytes[g[0]] for g in groups]),
                   dense_bytes=np.array([sum(int(trace.dense_bytes[layer]) for layer in g) for g in groups]),
                   ids=merge(shifted).astype(np.int32), weights=merge(trace.weights),
                   residency=merge(trace.residency), dropped=merge(trace.dropped),
                   reads=None if trace.reads is None else np.stack([trace.reads[:, g].sum(axis=1) for g in groups],
                                                                   axis=1)), n


def _place(groups, n_layers) -> np.ndarray:
    place = np.empty(n_layers, dtype=np.int64)
    for g in groups:
        place[g] = np.arange(len(g))
    return place


@dataclass(frozen=True)
class Victims:
    """A victim rule (VICTIM_RULES) and its settings (the module docstring)."""

    rule: str = "oracle"
    window: int = 1              # ahead: a resident its layer used in the last `window` graphs is spared
    below: float | None = None   # ahead: instead of the window, taken ahead only if its worth is below this
    reserve: int = 0             # ahead: a layer not yet run keeps at least this many residents
    readmit: bool = False        # ahead: a later layer re-uploads an expert evicted ahead (a lane copy: a miss)
    reach: int | None = None     # defer: a copy waits for a victim's layer at most this many layers ahead;
    #                              beyond, it takes a victim marked as ahead's are, at once
    late: bool = False           # defer: a copy that waited is published a boundary late (a worst case)
    late_after: float | None = None  # any rule: a copy started after this share of the pool's layers ran, too

    def __post_init__(self):
        if self.rule not in VICTIM_RULES:
            raise ValueError(f"rule must be one of {', '.join(VICTIM_RULES)}, got {self.rule!r}")

    @property
    def label(self) -> str:
        mark = f"worth < {self.below:g}" if self.below is not None else f"{self.window}"
        extra = (f", reserve {self.reserve}" if self.reserve else "") + (", readmit" if self.readmit else "")
        late = ", copies that waited a graph late" if self.late else ""
        if self.late_after is not None:
            late += f", copies started after {self.late_after:g} of the layers a graph late"
        if self.rule == "defer":
            return ("defer" if self.reach is None else f"defer {self.reach}, else ahead {mark}{extra}") + late
        if self.rule not in ("ahead", "run-first"):
            return self.rule + late
        return f"{self.rule} {mark}{extra}{late}"


class PoolPlan(NamedTuple):
    """The miss planner's rule over a pool's graph (moecache.offline.pooltime): an upload must beat
    its victim by `margin`, a lane copy by margin - credit; lane: (G, n_sub, E + 1) of m
    candidates of a pool's layer, how many take the lane (None: no lane). A lane copy takes
    only a slot safe now (empty, or a resident of a layer already run that it did not select);
    a lane candidate with no such slot, or that does not beat it, is handled as any other miss."""

    margin: float
    credit: float
    lane: np.ndarray | None


def pool_admissions(handover, ids, slot_expert, n_sub: int, inserts: int | None, rule,
                    recent: np.ndarray | None = None, tally: dict | None = None,
                    plan: PoolPlan | None = None) -> tuple[np.ndarray, int]:
    """The slot writes of a graph that selects `ids` ((G, n_sub * k), each pool's layers side by
    side) under a pooled handover, layer by layer (the module docstring), and how many of them
    evicted a resident that a later layer of the graph selects ("ahead" only). rule: a Victims or
    a rule's name; recent: (G, m) the keys the last graphs selected ("ahead"); tally: adds the
    copies ("copies"), the layers they waited for their victim's layer in all ("waited") and the
    shares of the pool's layers run when they started, summed ("started"), and whether each copy
    waited ("waits") and the share of the pool's layers run when it started ("starts"), lists
    aligned with the rows; with a plan also "at" (the pool layer whose observer started each
    row's copy), "lane" (whether it is a lane copy), "read_ahead" ((group, key) of each expert
    evicted ahead that a later layer reads) and "declined" (uploads the margin declined)."""
    victims = rule if isinstance(rule, Victims) else Victims(rule)
    jobs, clobbered = [], 0
    for g in range(ids.shape[0]):
        walk = _PoolWalk(handover, g, ids[g], slot_expert[g], n_sub, inserts, victims,
                         None if recent is None else recent[g], plan)
        for i in range(n_sub):
            walk.layer(i)
        jobs += walk.jobs
        clobbered += walk.clobbered
        if tally is not None:
            planned = (("at", walk.at), ("lane", walk.lane), ("read_ahead", [(g, key) for key in walk.read_ahead]),
                       ("declined", walk.declined)) if plan is not None else ()
            for name, value in (("copies", len(walk.jobs)), ("waited", walk.waited), ("started", sum(walk.starts)),
                                ("waits", walk.waits), ("starts", walk.starts), *planned):
                tally[name] = tally.get(name, type(value)()) + value
    return np.array(jobs, dtype=np.int32).reshape(-1, 3), clobbered


class _PoolWalk:
    """One pool's graph, layer by layer: which misses take which victims under a Victims rule."""

    def __init__(self, handover, g, row, slot_expert, n_sub, inserts, victims, recent, plan=None):
        self.k, self.E = row.size // n_sub, handover.worth.shape[1] // n_sub
        listed = handover.victims[g] >= 0
        self.slots = handover.victims[g][listed].tolist()
        self.keep = handover.victim_worth[g][listed].tolist()
        self.key = [int(slot_expert[s]) for s in self.slots]
        self.taken = [False] * len(self.slots)
        self.g, self.row, self.worth, self.inserts, self.v = g, row, handover.worth[g], inserts, victims
        self.held = set(slot_expert[slot_expert >= 0].tolist())
        self.graph = set(row[row >= 0].tolist())
        self.recent = set() if recent is None else set(recent[recent >= 0].tolist())
        self.owned = np.bincount([key // self.E for key in self.key if key >= 0], minlength=n_sub)
        self.run, self.gone = set(), {}  # keys the layers run so far selected; keys evicted ahead: their worth
        finite = self.worth[self.worth > -np.inf]
        self.admits_all = finite.size > 0 and bool(np.isposinf(finite).all())  # the policy has no admission test
        self.reserved, self.waiting = {}, []  # defer: victim index -> miss; misses whose victim fell through
        self.jobs, self.waits, self.clobbered, self.waited = [], [], 0, 0  # waited: layers the copies waited
        self.starts, self.n_sub = [], n_sub  # each row's share of the pool's layers run when its copy started
        self.at, self.lane, self.read_ahead, self.declined = [], [], [], 0  # each row's layer and lane flag
        self.margin = 0.0 if plan is None else plan.margin
        self.credit = 0.0 if plan is None else plan.credit
        self.lanes = None if plan is None or plan.lane is None else plan.lane[g]

    def layer(self, i: int) -> None:
        ids = self.row[i * self.k:(i + 1) * self.k]
        self.run.update(ids[ids >= 0].tolist())
        for j in [j for j in self.reserved if self.key[j] // self.E == i]:  # defer: the victim's layer ran
            e, origin = self.reserved.pop(j)
            if self.key[j] in self.run:
                self.waiting.append((e, origin))
            else:
                self._start(e, j, i, origin)
        again, self.waiting = self.waiting, []
        for e, origin in again:
            self._place(e, i, origin)
        fresh = list(dict.fromkeys(e for e in ids.tolist() if e >= 0 and self._worth(e) > -np.inf
                                   and (e not in self.held or (self.v.readmit and e in self.gone))))
        lset = self._lane_set(fresh, i)
        started = 0
        for e in lset + [e for e in fresh if e not in lset]:
            if self.inserts is not None and started == self.inserts:
                break
            if e in lset and self._lane_copy(e, i):
                started += 1
                continue
            placed = self._place(e, i)
            if placed is None:
                break
            started += placed

    def _lane_set(self, fresh: list, i: int) -> list:
        """The candidates of layer i that take the lane: the plan's count of them, the most
        valuable first (rank breaks ties)."""
        if self.lanes is None or not fresh:
            return []
        n = int(self.lanes[i][min(len(fresh), self.lanes.shape[1] - 1)])
        return sorted(fresh, key=lambda e: -self._worth(e))[:n]

    def _lane_copy(self, e: int, i: int) -> bool:
        """Layer i copies its miss e through the lane into the first slot safe now, if e beats
        its resident by margin - credit; False: e is handled as any other miss."""
        j = next((j for j in range(len(self.slots)) if not self.taken[j] and self._safe(j, i)), None)
        if j is None or not self._worth(e) > self.keep[j] + self.margin - self.credit:
            return False
        self.taken[j] = True
        if self.key[j] >= 0:
            self.owned[self.key[j] // self.E] -= 1
        self._start(e, j, i, i, lane=True)
        return True

    def _place(self, e: int, i: int, origin: int | None = None) -> bool | None:
        """Layer i's miss e (of layer `origin`, i by default) takes its victim, if one may be
        taken and its worth beats it (True), or none (None: no victim left)."""
        origin = i if origin is None else origin
        j = self._victim(i)
        if j is None:
            return None
        if not self._worth(e) > self.keep[j] + self.margin:
            self.declined += self._worth(e) > self.keep[j]
            return False
        self.taken[j] = True
        key = self.key[j]
        if key >= 0:
            self.owned[key // self.E] -= 1
        if self._waits(key, i):
            self.reserved[j] = (e, origin)  # the copy waits for the victim's layer
            return True
        self._start(e, j, i, origin)
        if key >= 0 and key // self.E > i:
            self.gone[key] = self.keep[j]
            if key in self.graph:  # a later layer reads it
                self.clobbered += 1
                self.read_ahead.append(key)
        return True

    def _start(self, e: int, j: int, i: int, origin: int, lane: bool = False) -> None:
        """Layer i starts the copy of layer `origin`'s miss e into victim j's slot."""
        self.jobs.append((self.g, e, self.slots[j]))
        self.at.append(i)
        self.lane.append(lane)
        self.waits.append(i > origin)
        self.starts.append((i + 1) / self.n_sub)
        self.waited += i - origin

    def _worth(self, e: int) -> float:
        """A miss's worth; an expert evicted ahead that its layer reads again (readmit) is worth
        what it kept as a resident, or a victim, if the policy admits every miss."""
        if e in self.gone and self.v.readmit:
            return np.inf if self.admits_all else self.gone[e]
        return self.worth[e]

    def _victim(self, i: int) -> int | None:
        free = [j for j in range(len(self.slots)) if not self.taken[j]]
        if self.v.rule == "run-first":
            first = next((j for j in free if self._safe(j, i)), None)
            return first if first is not None else next((j for j in free if self._ahead(j)), None)
        return next((j for j in free if self._may_take(j, i)), None)

    def _safe(self, j: int, i: int) -> bool:
        """A slot no layer run so far selects, empty or of a layer already run."""
        key = self.key[j]
        return key < 0 or (key // self.E <= i and key not in self.run)

    def _ahead(self, j: int) -> bool:
        """Whether a later layer's resident is marked to be taken ahead (and its layer keeps enough)."""
        key, v = self.key[j], self.v
        marked = self.keep[j] < v.below if v.below is not None else key not in self.recent
        return marked and key not in self.run and self.owned[key // self.E] > v.reserve

    def _may_take(self, j: int, i: int) -> bool:
        """Whether layer i may overwrite (or, deferring, reserve) victim j's slot."""
        key, rule = self.key[j], self.v.rule
        if key < 0:
            return True
        if rule == "oracle":
            return key not in self.graph
        if key in self.run:
            return False
        if key // self.E <= i or self._waits(key, i):
            return True
        return rule in ("ahead", "defer") and self._ahead(j)

    def _waits(self, key: int, i: int) -> bool:
        """defer: whether layer i's copy into `key`'s slot waits for the key's layer to run."""
        ahead = key // self.E - i
        return self.v.rule == "defer" and ahead > 0 and (self.v.reach is None or ahead <= self.v.reach)


class PooledEngine(CacheEngine):
    """The engine over pooled_trace's layers: the graph's slot writes by pool_admissions, each
    layer's prompt experts its K most used, later uses of experts evicted ahead counted as
    misses (the module docstring)."""

    def __init__(self, n_groups, n_expert, n_slots, policy, *, n_sub: int, inserts: int | None = 2,
                 rule="oracle", window: int = 1):
        super().__init__(n_groups, n_expert, n_slots, policy, inserts=None, offline=True, admission="eager")
        victims = rule if isinstance(rule, Victims) else Victims(rule, window)
        if victims.below is not None:  # a share of the worth of an expert used in every graph
            every = np.ravel(policy.score(np.ones((len(policy.decay), 1, 1))))[0]
            victims = replace(victims, below=victims.below * float(every))
        self.n_sub, self.layer_inserts, self.victims, self.window = n_sub, inserts, victims, victims.window
        self.clobbered, self.tally = 0, {}
        self._recent: list[np.ndarray] = []
        plan_prompt = self._planner.plan_prompt

        def each_layers_top(t, ids):  # each layer's K most used prompt experts, as today
            return plan_prompt(t, np.where(self._each_layers_top(ids), ids, -1))
        self._planner.plan_prompt = each_layers_top

    def _each_layers_top(self, ids) -> np.ndarray:
        K, E = self.n_slots // self.n_sub, self.n_expert // self.n_sub
        chosen = np.zeros(ids.shape, dtype=bool)
        for g, row in enumerate(ids):
            uses = np.bincount(row[row >= 0], minlength=self.n_expert).reshape(self.n_sub, E)
            top = np.argsort(-uses, axis=1, kind="stable")[:, :K]
            keys = (top + np.arange(self.n_sub)[:, None] * E)[np.take_along_axis(uses, top, axis=1) > 0]
            chosen[g] = np.isin(row, keys)
        return chosen

    def step(self, ids=None, ready=None, admitted=None, prefill=False, lane_rows=0, declined=None):
        if ids is not None and not prefill and self.handover is not None:
            ids = np.asarray(ids)
            recent = np.concatenate(self._recent, axis=1) if self._recent else None
            tally = {}
            admitted, clobbered = pool_admissions(self.handover, ids, self.slot_expert, self.n_sub,
                                                  self.layer_inserts, self.victims, recent, tally, self.graph_plan())
            late = self._late(np.array(tally.pop("waits"), dtype=bool), np.array(tally.pop("starts")))
            self.graph_rows = {name: tally.pop(name, []) for name in ("at", "lane", "read_ahead")}  # the last graph's
            for name, value in tally.items():
                self.tally[name] = self.tally.get(name, 0) + value
            self.clobbered += clobbered
            self._recent = (self._recent + [ids])[-self.window:]
            self.graph_walked(ids, admitted)
            if late.any():  # the late copies last, not ready at the boundary
                admitted = np.concatenate((admitted[~late], admitted[late]))
                ready = self._queue.n_due + int((~late).sum())
        return super().step(ids, ready, admitted, prefill, lane_rows, declined)

    def graph_walked(self, ids, admitted) -> None:
        """Called with a decode graph's ids and slot writes (graph_rows: each row's layer, lane
        flag; the experts evicted ahead that it reads) before the boundary publishes anything."""

    def graph_plan(self) -> PoolPlan | None:
        """The miss planner's rule for the graph about to be walked (none here: the hit rates are
        the policy's; moecache.offline.pooltime adds it)."""
        return None

    def _late(self, waits, starts) -> np.ndarray:
        """Which of a graph's copies the victim rule's worst cases make a graph late."""
        late = waits & self.victims.late
        return late | (starts > self.victims.late_after) if self.victims.late_after is not None else late

    def stats(self, expert_bytes=None) -> dict:
        stats = super().stats(expert_bytes)
        stats["totals"]["hits"] -= self.clobbered
        stats["totals"]["misses"] += self.clobbered
        return stats


def pooled_replay(trace: RouteTrace, policy, slots: int, *, inserts: int | None = 2, rule="oracle",
                  window: int = 1, tally: dict | None = None) -> ReplayResult:
    """Decode hit rate and the rest of a replay of `trace` with one pool per group of the bytes
    of `slots` per layer (eager, the prompt warming the cache). policy: a Policy, or a registry
    name (belady reads the pooled trace's future); rule: a Victims or a rule's name (with
    `window`); tally: gets the decode graphs' copies, the layers they waited and the lookups
    of experts evicted ahead ("clobbered")."""
    pooled, n_sub = pooled_trace(trace)
    if isinstance(policy, str):
        factory = POLICIES.get(resolve_policy(policy))
        reads_ahead = factory is not None and factory.offline_only
        policy = make_policy(policy, future=steps.future(pooled, PER_LAYER, "warm") if reads_ahead else None)
    engine = PooledEngine(pooled.layers.size, pooled.n_expert, slots * n_sub, policy, n_sub=n_sub,
                          inserts=inserts, rule=rule, window=window)
    result = simulate(pooled, PerLayerReplay(engine, prefill="warm"))
    if tally is not None:
        tally.update(engine.tally, clobbered=engine.clobbered)
    return result


CREDITED = "heat-sum 10+64 (1:2), admission test with 4 uses' credit, unlimited"
CREDITED_2 = "heat-sum 8+64 (1:2), admission test with 2 uses' credit, unlimited"
POOLED_RUNS = [  # (label, policy factory, inserts per layer, Victims): scripts/compare_upstream.py
    ("heat, INSERTS 2", lambda: make_policy("heat"), 2, Victims("oracle")),
    ("heat-sum 10+64 (1:2), INSERTS 2", HeatSum, 2, Victims("oracle")),
    ("heat-sum 10+64 (1:2), unlimited inserts", HeatSum, None, Victims("oracle")),
    (CREDITED, lambda: HeatSumAdmission(credit=4.0), None, Victims("oracle")),
    ("belady, INSERTS 2", lambda: "belady", 2, Victims("oracle")),
    ("belady, unlimited inserts", lambda: "belady", None, Victims("oracle")),
    ("heat, INSERTS 2", lambda: make_policy("heat"), 2, Victims("run")),
    ("heat-sum 10+64 (1:2), unlimited inserts", HeatSum, None, Victims("run")),
    ("heat, INSERTS 2", lambda: make_policy("heat"), 2, Victims("ahead", 8)),
    ("heat-sum 10+64 (1:2), INSERTS 2", HeatSum, 2, Victims("ahead", 8)),
    ("heat-sum 10+64 (1:2), unlimited inserts", HeatSum, None, Victims("ahead", 1)),
    ("heat-sum 10+64 (1:2), unlimited inserts", HeatSum, None, Victims("ahead", 8)),
    (CREDITED, lambda: HeatSumAdmission(credit=4.0), None, Victims("ahead", 8)),
    ("heat-sum 10+64 (1:2), unlimited inserts", HeatSum, None, Victims("defer")),
    (CREDITED, lambda: HeatSumAdmission(credit=4.0), None, Victims("defer")),
    (CREDITED_2, lambda: HeatSumAdmission((8, 64), (1.0, 2.0), credit=2.0), None, Victims("defer")),
]


HEAT_SUM = "heat-sum 10+64 (1:2), unlimited inserts"
VICTIM_SEARCH = [  # (label, policy factory, inserts per layer, Victims): scripts/pooled_victims.py
    (HEAT_SUM, HeatSum, None, Victims("oracle")),
    (HEAT_SUM, HeatSum, None, Victims("run")),
    (HEAT_SUM, HeatSum, None, Victims("ahead", 8)),
    *[(HEAT_SUM, HeatSum, None, Victims("ahead", w)) for w in (16, 32)],
    *[(HEAT_SUM, HeatSum, None, Victims("ahead", below=b)) for b in (0.01, 0.03, 0.1, 0.3)],
    *[(HEAT_SUM, HeatSum, None, Victims("ahead", w, readmit=True)) for w in (1, 8, 16)],
    *[(HEAT_SUM, HeatSum, None, Victims("ahead", 8, reserve=m)) for m in (2, 4, 6)],
    (HEAT_SUM, HeatSum, None, Victims("run-first", 8)),
    (HEAT_SUM, HeatSum, None, Victims("run-first", below=0.03)),
    (HEAT_SUM, HeatSum, None, Victims("defer")),
    *[(HEAT_SUM, HeatSum, None, Victims("defer", 8, reach=d)) for d in (1, 2, 4, 8)],
    (HEAT_SUM, HeatSum, None, Victims("defer", 8, reach=4, readmit=True)),
    ("heat-sum 10+64 (1:2), INSERTS 2", HeatSum, 2, Victims("defer")),
    (CREDITED, lambda: HeatSumAdmission(credit=4.0), None, Victims("defer")),
    ("heat, INSERTS 2", lambda: make_policy("heat"), 2, Victims("defer")),
    *[(f"heat-sum 10+64 (1:2), admission test with {c} uses' credit, unlimited",
       lambda c=c: HeatSumAdmission(credit=float(c)), None, Victims("defer")) for c in (0, 1, 2, 3)],
    (CREDITED_2, lambda: HeatSumAdmission((8, 64), (1.0, 2.0), credit=2.0), None, Victims("defer")),
    (CREDITED, lambda: HeatSumAdmission(credit=4.0), None, Victims("defer", 8, reach=8)),
    (CREDITED_2, lambda: HeatSumAdmission((8, 64), (1.0, 2.0), credit=2.0), None, Victims("defer", 8, reach=8)),
    (HEAT_SUM, HeatSum, None, Victims("defer", late=True)),
    (HEAT_SUM, HeatSum, None, Victims("defer", 8, reach=8, late=True)),
    (CREDITED_2, lambda: HeatSumAdmission((8, 64), (1.0, 2.0), credit=2.0), None, Victims("defer", late=True)),
    (CREDITED_2, lambda: HeatSumAdmission((8, 64), (1.0, 2.0), credit=2.0), None,
     Victims("defer", 8, reach=8, late=True)),
    *[(HEAT_SUM, HeatSum, None, Victims(rule, 8, late_after=after)) for after in (0.75, 0.5)
      for rule in ("oracle", "ahead", "defer")],
    *[(CREDITED_2, lambda: HeatSumAdmission((8, 64), (1.0, 2.0), credit=2.0), None, Victims(rule, 8, late_after=0.75))
      for rule in ("ahead", "defer")],
    ("belady, unlimited inserts", lambda: "belady", None, Victims("defer")),
]
DEFER_SWEEP = [  # (label, policy factory, inserts, Victims): scripts/pooled_victims.py --sweep
    *[(f"heat-sum {a}+{b} (1:2), admission test with {c} uses' credit, unlimited",
       lambda a=a, b=b, c=c: HeatSumAdmission((a, b), (1.0, 2.0), credit=float(c)), None, Victims("defer"))
      for a, b in ((8, 64), (10, 64), (16, 64), (8, 128)) for c in (2, 3, 4)],
    *[(f"heat-sum {a}+{b} (1:{w:g}), unlimited inserts", lambda a=a, b=b, w=w: HeatSum((a, b), (1.0, w)), None,
       Victims("defer")) for a, b, w in ((8, 64, 2.0), (16, 64, 0.5), (10, 128, 2.0), (10, 64, 4.0))],
]
