"""Every replay figure docs/engine.md and docs/notes/ state, as exact integers, for the stored-values test.

    PYTHONPATH=. python tests/replay_values.py           # compare with tests/replay_values.json
    PYTHONPATH=. python tests/replay_values.py --write   # (re)write it

Each entry is a run named by what it replays: trace or routing, model, policy, size, inserts;
its value [hits, lookups, hits incl. prefill, lookups incl. prefill, bytes uploaded (global:
read) for decode] (synthetic routing: 1 byte per expert). The table scripts' own policies
(moecache.offline.experiments: the popularity oracle, the issue-4 candidates) are included,
so every figure of the doc is covered. The values were written by the replay code before
moecache.offline.replay.simulate existed; this file computes them with simulate.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from moecache.formats.profile import UsageProfile
from moecache.formats.traces import DECODE, SHIPPED_TRACES, RouteTrace, read_trace
from moecache.offline.experiments import (DEFAULT_CANDIDATES, SKEWED, SYNTHETIC, PopularityOracle,
                                          preloaded_only, synthetic_routings)
from moecache.offline.replay import MIB, GlobalReplay, PerLayerReplay, per_layer_slots, simulate

STORED = Path(__file__).with_name("replay_values.json")
PER_LAYER_POLICIES = ["belady", "lru", "lfu", "gdsf", "random", "arc", "sieve", "heat"]
GLOBAL_POLICIES = ["lru", "plain-lfu", "random", "belady", "layer-lru", "layer-plain-lfu"]
# the global policies' names when the values were stored (the keys of replay_values.json)
RECORDED_AS = {"plain-lfu": "lfu", "layer-lru": "layer", "layer-plain-lfu": "layerlfu"}


def value(r):
    decode, every = r.totals, r.totals_all
    return [decode["hits"], decode["hits"] + decode["misses"], every["hits"],
            every["hits"] + every["misses"], decode["upload_bytes"]]


def trace_values(trace, name):
    values = {}
    k16 = trace.n_expert // 8
    runs = [(p, k16, i) for p in PER_LAYER_POLICIES for i in (2, None)]
    if name.startswith("qwen3"):  # the upload-traffic sweep
        runs += [(p, k, 2) for p in ("lru", "lfu", "gdsf", "arc", "belady", "heat")
                 for k in (4, 8, 32, 64, 96)]
    for policy, k, inserts in runs:
        values[f"{name} per-layer {policy} K={k} inserts={inserts}"] = value(
            simulate(trace, PerLayerReplay(policy, k, inserts=inserts, prefill="off")))
    values[f"{name} per-layer lru K={k16} inserts=2 prefill"] = value(
        simulate(trace, PerLayerReplay("lru", k16, prefill="plain")))
    values[f"{name} per-layer random K={k16} inserts=2 seed=7"] = value(
        simulate(trace, PerLayerReplay("random", k16, seed=7, prefill="off")))
    for inserts in (2, None):
        values[f"{name} per-layer popularity-oracle K={k16} inserts={inserts}"] = value(
            simulate(trace, PerLayerReplay(PopularityOracle(trace.decode_ids), k16, inserts=inserts, prefill="off")))
    for candidate, factory in DEFAULT_CANDIDATES.items():
        values[f"{name} per-layer candidate-{candidate} K={k16} inserts=2"] = value(
            simulate(trace, PerLayerReplay(factory(), k16, prefill="off")))

    decode = np.flatnonzero(trace.phase == DECODE)
    half = len(decode) // 2
    halves = {"first": decode[:half], "second": decode[half:]}
    for replayed, source in (("second", "first"), ("first", "second")):
        part = trace.select(halves[replayed])
        profile = UsageProfile.from_ids(trace.model, trace.layers, trace.n_expert, trace.ids[halves[source]])
        for policy in ("lru", "heat", "belady"):
            for warm in (False, True):
                label = f"warm <- {source}" if warm else "cold"
                values[f"{name} {replayed}-half per-layer {policy} K={k16} inserts=2 {label}"] = value(
                    simulate(part, PerLayerReplay(policy, k16, profile=profile if warm else None, prefill="off")))
        values[f"{name} {replayed}-half per-layer heat K={k16} inserts=2 preloaded <- {source}"] = \
            value(preloaded_only(part, "heat", k16, profile))

    for budget in (1000, 2000, 3000, 4000):  # the per-layer model at a byte budget
        k = per_layer_slots(trace, budget)
        for policy in ("lru", "heat", "belady"):
            values[f"{name} per-layer {policy} MiB={budget} K={k} inserts=2"] = value(
                simulate(trace, PerLayerReplay(policy, k, prefill="off")))

    budgets = [500, 750, 780, 1000, 2000, 3000, 4000]
    working_set = trace.working_set_bytes() / MIB
    runs = [(p, b) for p in GLOBAL_POLICIES for b in budgets]
    runs += [("lru", f * working_set) for f in (0.25, 0.5, 0.9, 0.95, 2.0)] + [("belady", 0.5 * working_set)]
    for policy, budget in runs:
        label = RECORDED_AS.get(policy, policy)
        values[f"{name} global {label} MiB={budget:.6g}"] = value(simulate(trace, GlobalReplay(policy, budget)))
    return values


def synthetic_values():
    values = {}
    for label, seed, routing, experts in synthetic_routings([*SYNTHETIC, SKEWED]):
        trace = RouteTrace.from_routing(routing, experts)
        slots = experts // 8
        name = f"synthetic {label} seed={seed}"
        for policy in ("belady", "lru", "lfu", "gdsf", "arc", "sieve", "heat"):
            values[f"{name} {policy} K={slots}"] = value(simulate(trace, PerLayerReplay(policy, slots, prefill="off")))
        for candidate, factory in DEFAULT_CANDIDATES.items():
            values[f"{name} candidate-{candidate} K={slots}"] = value(
                simulate(trace, PerLayerReplay(factory(), slots, prefill="off")))
        if label == SKEWED[0]:  # the warm-start tables run the others only
            continue
        for replayed, source in ((slice(150, None), slice(0, 150)), (slice(0, 150), slice(150, None))):
            part = RouteTrace.from_routing(routing[replayed], experts)
            profile = UsageProfile.from_ids("synthetic", range(routing.shape[1]), experts, routing[source])
            span = f"{replayed.start or 0}-{(replayed.stop or 300) - 1}"
            values[f"{name} steps {span} heat K={slots} cold"] = value(
                simulate(part, PerLayerReplay("heat", slots, prefill="off")))
            values[f"{name} steps {span} heat K={slots} preloaded"] = value(preloaded_only(part, "heat", slots, profile))
            values[f"{name} steps {span} heat K={slots} warm"] = value(
                simulate(part, PerLayerReplay("heat", slots, profile=profile, prefill="off")))
    return values


def compute() -> dict:
    values = {}
    for path in SHIPPED_TRACES:
        values.update(trace_values(read_trace(str(path)), path.name.split(".")[0]))
    values.update(synthetic_values())
    return {key: [int(v) for v in value] for key, value in values.items()}


def main():
    values = compute()
    if sys.argv[1:] == ["--write"]:
        lines = [f"{json.dumps(key)}: {json.dumps(values[key])}" for key in sorted(values)]
        STORED.write_text("{\n" + ",\n".join(lines) + "\n}\n")
        print(f"wrote {len(values)} runs to {STORED.name}")
        return 0
    stored = json.loads(STORED.read_text())
    differ = sorted(k for k in stored.keys() | values.keys() if stored.get(k) != values.get(k))
    for key in differ:
        print(f"{key}: stored {stored.get(key)}, now {values.get(key)}")
    print(f"{len(values)} runs, {len(differ)} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
