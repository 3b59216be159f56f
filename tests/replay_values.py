"""Every replay figure docs/policies.md states, as exact integers, for the stored-values test.

    PYTHONPATH=. python tests/replay_values.py           # compare with tests/replay_values.json
    PYTHONPATH=. python tests/replay_values.py --write   # (re)write it

Each entry is a run named by what it replays: trace or routing, model, policy, size, inserts;
its value [hits, lookups, hits incl. prefill, lookups incl. prefill, bytes uploaded (global:
read) for decode]. The table scripts' own policies (the popularity oracle, the issue-4
candidates) are included, so every figure of the doc is covered.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

from moecache.engine import CacheEngine
from moecache.policies import make_policy
from moecache.profile import UsageProfile
from moecache.replay import MIB, observations, replay_global, replay_per_layer
from moecache.traces import DECODE, SHIPPED_TRACES, read_trace, synthetic_routing

REPO = Path(__file__).resolve().parents[1]
STORED = Path(__file__).with_name("replay_values.json")
PER_LAYER = ["belady", "lru", "lfu", "gdsf", "random", "arc", "sieve", "heat"]
GLOBAL = ["lru", "lfu", "random", "belady", "layer", "layerlfu"]


def script(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def per_layer_value(r):
    return [r.hits_decode, r.lookups_decode, r.hits_all, r.lookups_all, r.upload_bytes]


def engine_value(obs, n_expert, slots, policy, inserts=2, preload=None, rates=None, expert_bytes=None):
    """An engine run over decode-only observations: every lookup is a decode lookup; bytes
    are those of the uploads after the first boundary (not the preload's), 1 per expert
    when expert_bytes is not given (synthetic routing)."""
    engine = CacheEngine(obs[0].shape[0], n_expert, slots, policy, inserts=inserts, offline=True)
    if preload is not None:
        engine.preload(preload, rates=rates)
    engine.step(None)
    warm = engine.counters["uploads"].copy()
    for ids in obs:
        engine.step(ids)
    total = engine.stats()["total"]
    lookups = total["hits"] + total["misses"]
    uploads = engine.counters["uploads"] - warm
    sizes = np.ones(len(uploads), dtype=np.int64) if expert_bytes is None else expert_bytes
    return [total["hits"], lookups, total["hits"], lookups, int(np.dot(uploads, sizes))]


def trace_values(trace, name, table, experiments):
    values = {}
    obs = observations(trace)
    k16 = trace.n_expert // 8
    runs = [(p, k16, i) for p in PER_LAYER for i in (2, None)]
    if name.startswith("qwen3"):  # the upload-traffic sweep
        runs += [(p, k, 2) for p in ("lru", "lfu", "gdsf", "arc", "belady", "heat")
                 for k in (4, 8, 32, 64, 96)]
    for policy, k, inserts in runs:
        r = replay_per_layer(trace, policy, k, inserts=inserts, obs=obs)
        values[f"{name} per-layer {policy} K={k} inserts={inserts}"] = per_layer_value(r)
    r = replay_per_layer(trace, "lru", k16, include_prefill=True)
    values[f"{name} per-layer lru K={k16} inserts=2 prefill"] = per_layer_value(r)
    r = replay_per_layer(trace, "random", k16, seed=7, obs=obs)
    values[f"{name} per-layer random K={k16} inserts=2 seed=7"] = per_layer_value(r)
    for inserts in (2, None):
        values[f"{name} per-layer popularity-oracle K={k16} inserts={inserts}"] = engine_value(
            obs[0], trace.n_expert, k16, table.PopularityOracle(obs[0]), inserts,
            expert_bytes=trace.expert_bytes)
    for candidate, factory in experiments.CANDIDATES.items():
        values[f"{name} per-layer candidate-{candidate} K={k16} inserts=2"] = engine_value(
            obs[0], trace.n_expert, k16, factory(), expert_bytes=trace.expert_bytes)

    decode = trace.ids[trace.phase == DECODE]
    half = len(decode) // 2
    halves = {"first": slice(0, half), "second": slice(half, None)}
    for replayed, source in (("second", "first"), ("first", "second")):
        ids = decode[halves[replayed]]
        profile = UsageProfile.from_ids(trace.model, trace.layers, trace.n_expert, decode[halves[source]])
        half_obs = (list(ids), [True] * len(ids))
        for policy in ("lru", "heat", "belady"):
            for warm in (False, True):
                r = replay_per_layer(trace, policy, k16, obs=half_obs, profile=profile if warm else None)
                label = f"warm <- {source}" if warm else "cold"
                values[f"{name} {replayed}-half per-layer {policy} K={k16} inserts=2 {label}"] = \
                    per_layer_value(r)
        values[f"{name} {replayed}-half per-layer heat K={k16} inserts=2 preloaded <- {source}"] = \
            engine_value(half_obs[0], trace.n_expert, k16, make_policy("heat"), preload=profile.top(k16),
                         expert_bytes=trace.expert_bytes)

    budgets = [500, 750, 780, 1000, 3000, 4000]
    working_set = trace.working_set_bytes() / MIB
    runs = [(p, b) for p in GLOBAL for b in budgets]
    runs += [("lru", f * working_set) for f in (0.25, 0.5, 0.9, 0.95, 2.0)] + [("belady", 0.5 * working_set)]
    for policy, budget in runs:
        r = replay_global(trace, policy, budget)
        values[f"{name} global {policy} MiB={budget:.6g}"] = per_layer_value(r)
    return values


def synthetic_values(table, experiments):
    values = {}
    for seed, (label, layers, experts, k, options) in enumerate(experiments.SYNTHETIC, start=3):
        routing = synthetic_routing(300, layers, experts, k, seed=seed, **options)
        obs = list(routing)
        slots = experts // 8
        name = f"synthetic {label} seed={seed}"
        values[f"{name} belady K={slots}"] = engine_value(obs, experts, slots, make_policy("belady", future=obs))
        for policy in ("lru", "lfu", "gdsf", "arc", "sieve", "heat"):
            values[f"{name} {policy} K={slots}"] = engine_value(obs, experts, slots, make_policy(policy))
        for candidate, factory in experiments.CANDIDATES.items():
            values[f"{name} candidate-{candidate} K={slots}"] = engine_value(obs, experts, slots, factory())
        if label not in {row[0] for row in table.SYNTHETIC}:
            continue
        for replayed, source in ((slice(150, None), slice(0, 150)), (slice(0, 150), slice(150, None))):
            part = list(routing[replayed])
            profile = UsageProfile.from_ids("synthetic", range(layers), experts, routing[source])
            span = f"{replayed.start or 0}-{(replayed.stop or 300) - 1}"
            for warm, kwargs in (("cold", {}), ("preloaded", {"preload": profile.top(slots)}),
                                 ("warm", {"preload": profile.top(slots), "rates": profile.rates(k)})):
                values[f"{name} steps {span} heat K={slots} {warm}"] = engine_value(
                    part, experts, slots, make_policy("heat"), **kwargs)
    return values


def compute() -> dict:
    table, experiments = script("replay_table"), script("policy_experiments")
    values = {}
    for path in SHIPPED_TRACES:
        values.update(trace_values(read_trace(str(path)), path.name.split(".")[0], table, experiments))
    values.update(synthetic_values(table, experiments))
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
