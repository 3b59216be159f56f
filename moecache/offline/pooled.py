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
  last `window` graphs; a later layer that selects a resident evicted ahead in the same graph
  finds it unpublished and computes it on the CPU: a miss (`PooledEngine.clobbered`, moved from
  the engine's hits to its misses in `stats()`).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..core.banks import layers_by_size
from ..core.engine import CacheEngine
from ..core.policies import POLICIES, make_policy, resolve_policy
from ..formats.traces import RouteTrace
from . import steps
from .experiments import HeatSum, HeatSumAdmission
from .replay import PER_LAYER, PerLayerReplay, ReplayResult, simulate

VICTIM_RULES = ("oracle", "run", "ahead")


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
                   residency=merge(trace.residency), dropped=merge(trace.dropped)), n


def _place(groups, n_layers) -> np.ndarray:
    place = np.empty(n_layers, dtype=np.int64)
    for g in groups:
        place[g] = np.arange(len(g))
    return place


def pool_admissions(handover, ids, slot_expert, n_sub: int, inserts: int | None, rule: str,
                    recent: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """The slot writes of a graph that selects `ids` ((G, n_sub * k), each pool's layers side by
    side) under a pooled handover, layer by layer (the module docstring), and how many of them
    evicted a resident that a later layer of the graph selects ("ahead" only). recent: (G, m) the
    keys the last graphs selected ("ahead")."""
    if rule not in VICTIM_RULES:
        raise ValueError(f"rule must be one of {', '.join(VICTIM_RULES)}, got {rule!r}")
    G, width = ids.shape
    k, E = width // n_sub, handover.worth.shape[1] // n_sub
    jobs, clobbered = [], 0
    for g in range(G):
        listed = handover.victims[g] >= 0
        slots = handover.victims[g][listed].tolist()
        keep = handover.victim_worth[g][listed].tolist()
        key = [int(slot_expert[g, s]) for s in slots]
        taken = [False] * len(slots)
        row, worth = ids[g], handover.worth[g]
        held = set(slot_expert[g][slot_expert[g] >= 0].tolist())
        graph = set(row[row >= 0].tolist())
        used_recently = set() if recent is None else set(recent[g][recent[g] >= 0].tolist())
        run = set()  # the keys the layers run so far selected
        for i in range(n_sub):
            layer_ids = row[i * k:(i + 1) * k]
            run.update(layer_ids[layer_ids >= 0].tolist())
            cand = list(dict.fromkeys(e for e in layer_ids.tolist()
                                      if e >= 0 and e not in held and worth[e] > -np.inf))
            started = 0
            for e in cand:
                if inserts is not None and started == inserts:
                    break
                j = next((j for j in range(len(slots)) if not taken[j] and _may_take(key[j], i, E, rule, graph, run,
                                                                                      used_recently)), None)
                if j is None:
                    break
                if worth[e] > keep[j]:
                    jobs.append((g, e, slots[j]))
                    taken[j] = True
                    started += 1
                    clobbered += key[j] in graph  # ahead: a later layer reads it
    return np.array(jobs, dtype=np.int32).reshape(-1, 3), clobbered


def _may_take(key, layer, n_expert, rule, graph, run, used_recently) -> bool:
    """Whether layer `layer` of the graph may overwrite a slot holding `key` (-1: free)."""
    if key < 0:
        return True
    if rule == "oracle":
        return key not in graph
    if key in run:
        return False
    if rule == "run":
        return key // n_expert <= layer
    return key // n_expert <= layer or key not in used_recently


class PooledEngine(CacheEngine):
    """The engine over pooled_trace's layers: the graph's slot writes by pool_admissions, each
    layer's prompt experts its K most used, later uses of experts evicted ahead counted as
    misses (the module docstring)."""

    def __init__(self, n_groups, n_expert, n_slots, policy, *, n_sub: int, inserts: int | None = 2,
                 rule: str = "oracle", window: int = 1):
        super().__init__(n_groups, n_expert, n_slots, policy, inserts=None, offline=True, admission="eager")
        self.n_sub, self.layer_inserts, self.rule, self.window = n_sub, inserts, rule, window
        self.clobbered = 0
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
            admitted, clobbered = pool_admissions(self.handover, ids, self.slot_expert, self.n_sub,
                                                  self.layer_inserts, self.rule, recent)
            self.clobbered += clobbered
            self._recent = (self._recent + [ids])[-self.window:]
        return super().step(ids, ready, admitted, prefill, lane_rows, declined)

    def stats(self, expert_bytes=None) -> dict:
        stats = super().stats(expert_bytes)
        stats["totals"]["hits"] -= self.clobbered
        stats["totals"]["misses"] += self.clobbered
        return stats


def pooled_replay(trace: RouteTrace, policy, slots: int, *, inserts: int | None = 2, rule: str = "oracle",
                  window: int = 1) -> ReplayResult:
    """Decode hit rate and the rest of a replay of `trace` with one pool per group of the bytes
    of `slots` per layer (eager, the prompt warming the cache). policy: a Policy, or a registry
    name (belady reads the pooled trace's future)."""
    pooled, n_sub = pooled_trace(trace)
    if isinstance(policy, str):
        factory = POLICIES.get(resolve_policy(policy))
        reads_ahead = factory is not None and factory.offline_only
        policy = make_policy(policy, future=steps.future(pooled, PER_LAYER, "warm") if reads_ahead else None)
    engine = PooledEngine(pooled.layers.size, pooled.n_expert, slots * n_sub, policy, n_sub=n_sub,
                          inserts=inserts, rule=rule, window=window)
    return simulate(pooled, PerLayerReplay(engine, prefill="warm"))


CREDITED = "heat-sum 10+64 (1:2), admission test with 4 uses' credit, unlimited"
POOLED_RUNS = [  # (label, policy factory, inserts per layer, victim rule, window): scripts/compare_upstream.py
    ("heat, INSERTS 2", lambda: make_policy("heat"), 2, "oracle", 1),
    ("heat-sum 10+64 (1:2), INSERTS 2", HeatSum, 2, "oracle", 1),
    ("heat-sum 10+64 (1:2), unlimited inserts", HeatSum, None, "oracle", 1),
    (CREDITED, lambda: HeatSumAdmission(credit=4.0), None, "oracle", 1),
    ("belady, INSERTS 2", lambda: "belady", 2, "oracle", 1),
    ("belady, unlimited inserts", lambda: "belady", None, "oracle", 1),
    ("heat, INSERTS 2", lambda: make_policy("heat"), 2, "run", 1),
    ("heat-sum 10+64 (1:2), unlimited inserts", HeatSum, None, "run", 1),
    ("heat, INSERTS 2", lambda: make_policy("heat"), 2, "ahead", 8),
    ("heat-sum 10+64 (1:2), INSERTS 2", HeatSum, 2, "ahead", 8),
    ("heat-sum 10+64 (1:2), unlimited inserts", HeatSum, None, "ahead", 1),
    ("heat-sum 10+64 (1:2), unlimited inserts", HeatSum, None, "ahead", 8),
    (CREDITED, lambda: HeatSumAdmission(credit=4.0), None, "ahead", 8),
]
