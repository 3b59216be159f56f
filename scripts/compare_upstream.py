"""Eager admission against upstream llama.cpp's own cache at equal device bytes, and every miss
where it costs least: the tables of docs/policies.md ("Eager admission, upstream llama.cpp's
cache and modelled cost").

    python scripts/compare_upstream.py [TRACE ...]   (default: the shipped traces; imports the
                                                     installed moecache, as every script here)

Per trace and K = 8, 16, 32: decode hit%, MiB uploaded per decode token and MODELLED
milliseconds per decode token (moecache.offline.cost's per-layer timeline, on the hardware
classes pcie4-x16 and pcie5-x16) for today's default (heat, boundary admission, prompts not fed), heat
and LRU with eager admission, the live default (heat, eager, the cache warmed from each prompt),
and the upstream model given the same device bytes (moecache.offline.upstream). Then the issue's K=16
targets (the live default against upstream and today's default, with the bytes the prompts
uploaded), the eager-timing policy candidates tried against heat,
on the traces and on the synthetic routing of the other tables, and hits against bytes
at K=16: admission rules that upload less, and the offline optimum. The candidates live in
moecache.offline.experiments, outside moecache.core.policies.

Last, issue 22's grid: per trace, K and hardware class (moecache.offline.cost.HARDWARE),
modelled ms per decode token of stock --cpu-moe, upstream at the same device bytes and the live
default with the miss planner at that class's rates as LLAMA_MOE_CACHE_PLANNER=1 runs it (the
handover's rule: the copy-on-miss lane and the payback margin, moecache.core.missplan), then the
live default without the planner; it ends with the line

    geomean ours/min(stock,upstream) = 0.xx over N cells, M cells above 1.0
"""

import math
import sys
from pathlib import Path

import numpy as np

from moecache.core.banks import equal_bytes
from moecache.core.model import hit_rate
from moecache.core.policies import make_policy
from moecache.core.traces import DECODE, SHIPPED_TRACES, RouteTrace, read_trace
from moecache.offline.cost import HARDWARE
from moecache.offline.experiments import HeatMargin, HeatOracleAdmission, HeatSeenBefore, synthetic_routings
from moecache.offline.replay import MIB, PER_LAYER, UPSTREAM, simulate
from moecache.offline.steps import future

LINKS = [(name, HARDWARE[name]) for name in ("pcie4-x16", "pcie5-x16")]
ROWS = [  # (label, policy, admission, prefill)
    ("heat, boundary (today's default)", "heat", "boundary", "off"),
    ("heat, eager", "heat", "eager", "off"),
    ("lru, eager", "lru", "eager", "off"),
    ("heat, eager, prompt warm (live default)", "heat", "eager", "warm"),
]
DEFAULT, LIVE = ROWS[0][0], ROWS[3][0]


CANDIDATES = [  # (label, policy factory, inserts, admission)
    ("today's default: heat, boundary", lambda: make_policy("heat"), 2, "boundary"),
    ("lru, eager", lambda: make_policy("lru"), 2, "eager"),
    ("heat, eager (half-life 16)", lambda: make_policy("heat"), 2, "eager"),
    ("heat, eager, unlimited inserts", lambda: make_policy("heat"), None, "eager"),
    ("heat, eager, half-life 8", lambda: make_policy("heat", half_life=8), 2, "eager"),
    ("heat, eager, half-life 32", lambda: make_policy("heat", half_life=32), 2, "eager"),
    ("lfu, eager (no admission test)", lambda: make_policy("lfu"), 2, "eager"),
    ("heat, eager, seen before", HeatSeenBefore, 2, "eager"),
    ("heat, eager, stale worth (admit())", lambda: HeatMargin(1.0), 2, "eager"),
]


FRONTIER = [  # (label, policy factory(trace's steps), inserts): eager, prompt warm, K=16
    ("heat (the live default)", lambda steps: make_policy("heat"), 2),
    ("heat, margin 0.25", lambda steps: HeatMargin(0.25), 2),
    ("heat, margin 0.5", lambda steps: HeatMargin(0.5), 2),
    ("heat, margin 0.75", lambda steps: HeatMargin(0.75), 2),
    ("heat, stale worth (margin 1)", lambda steps: HeatMargin(1.0), 2),
    ("heat, seen before 0.05", lambda steps: HeatSeenBefore(0.05), 2),
    ("heat, seen before 0.3", lambda steps: HeatSeenBefore(0.3), 2),
    ("heat, seen before 0.5", lambda steps: HeatSeenBefore(0.5), 2),
    ("heat, half-life 32", lambda steps: make_policy("heat", half_life=32), 2),
    ("heat, half-life 64", lambda steps: make_policy("heat", half_life=64), 2),
    ("heat, INSERTS=1", lambda steps: make_policy("heat"), 1),
    ("heat, admitting only what returns within 8 steps (offline)", lambda steps: HeatOracleAdmission(steps, 8), 2),
    ("belady (offline: knows the future)", lambda steps: "belady", 2),
]


def upstream(trace, k):
    return simulate(trace, UPSTREAM, "upstream", equal_bytes(trace.expert_bytes, k) / MIB)


def cells(result):
    ms = " | ".join(f"{result.modelled_ms(bw):.2f}" for _, bw in LINKS)
    return f"{100 * result.hit_rate:.1f} | {result.upload_bytes_per_token / MIB:.1f} | {ms}"


def comparison_table(trace):
    runs = {}
    print(f"\n{Path(trace.path).name}\n")
    print("| K | cache | decode hit% | MiB up/token | " + " | ".join(f"ms/token, {name}" for name, _ in LINKS) + " |")
    print("|---:|---|---:|---:|---:|---:|")
    for k in (8, 16, 32):
        for label, policy, admission, prefill in ROWS:
            runs[k, label] = simulate(trace, PER_LAYER, policy, k, admission=admission, prefill=prefill)
            print(f"| {k} | {label} | {cells(runs[k, label])} |")
        runs[k, "upstream"] = upstream(trace, k)
        print(f"| {k} | upstream llama.cpp, same bytes ({runs[k, 'upstream'].budget_mib:.0f} MiB) | "
              f"{cells(runs[k, 'upstream'])} |")
    print("\nstock --cpu-moe (every selected expert on the CPU): " + ", ".join(
        f"{runs[8, 'upstream'].stock_ms(hw):.2f} ({name})" for name, hw in LINKS) + " modelled ms/token")
    return runs


def targets(all_runs):
    """The issue's K=16 criteria, from the comparison tables' runs."""
    print("\nK=16 targets (decode hit% points; upload bytes per token):\n")
    gains_up, gains_default = [], []
    for name, runs in all_runs.items():
        live, default, up = runs[16, LIVE], runs[16, DEFAULT], runs[16, "upstream"]
        gains_up.append(100 * (live.hit_rate - up.hit_rate))
        gains_default.append(100 * (live.hit_rate - default.hit_rate))
        up_prompt = (up.totals_all["upload_bytes"] - up.totals["upload_bytes"]) / up.turns / MIB
        print(f"- {name}: live default {100 * live.hit_rate:.1f} vs upstream {100 * up.hit_rate:.1f} "
              f"({gains_up[-1]:+.1f}), uploading {live.upload_bytes_per_token / up.upload_bytes_per_token:.0%} "
              f"of its bytes per decode token (prompts: {live.prefill_upload_bytes_per_turn / MIB:.0f} vs "
              f"{up_prompt:.0f} MiB per turn); vs today's default {100 * default.hit_rate:.1f} "
              f"({gains_default[-1]:+.1f})")
    print(f"- mean: {np.mean(gains_up):+.1f} over upstream, {np.mean(gains_default):+.1f} over today's default")


def candidate_table(traces):
    print("\nCandidates: decode hit% at K = n_expert/8, INSERTS=2 unless said (on the real traces: "
          "MiB up/token, modelled ms/token on " + " / ".join(name for name, _ in LINKS) + ")\n")
    routings = [(Path(t.path).name.split(".")[0], t) for t in traces]
    routings += [(label, RouteTrace.from_routing(routing, experts))
                 for label, _, routing, experts in synthetic_routings()]
    print("| candidate | " + " | ".join(label for label, _ in routings) + " |")
    print("|---|" + "---:|" * len(routings))
    for label, factory, inserts, admission in CANDIDATES:
        row = []
        for i, (name, trace) in enumerate(routings):
            r = simulate(trace, PER_LAYER, factory(), trace.n_expert // 8, inserts=inserts, admission=admission, prefill="off")
            ms = " / ".join(f"{r.modelled_ms(bw):.2f}" for _, bw in LINKS)
            row.append(f"{100 * r.hit_rate:.1f}" + (f" ({r.upload_bytes_per_token / MIB:.0f}, {ms})"
                                                     if i < len(traces) else ""))
        print(f"| {label} | " + " | ".join(row) + " |")
    row = []
    for _, trace in routings[:len(traces)]:
        r = upstream(trace, trace.n_expert // 8)
        ms = " / ".join(f"{r.modelled_ms(bw):.2f}" for _, bw in LINKS)
        row.append(f"{100 * r.hit_rate:.1f} ({r.upload_bytes_per_token / MIB:.0f}, {ms})")
    print("| upstream, same bytes | " + " | ".join(row) + " |" + " |" * (len(routings) - len(traces)))


def frontier(traces):
    """Hits against bytes at K=16: admission rules that upload less, against the issue's target
    (+3 points over upstream on average, at most half its bytes per decode token on each)."""
    print("\nHits against bytes, K=16, eager, prompt warm: decode hit% (points over upstream), "
          "upload bytes per decode token as a share of upstream's\n")
    ups = [upstream(t, 16) for t in traces]
    print("| admission | " + " | ".join(Path(t.path).name.split(".")[0] for t in traces)
          + " | mean points | most bytes |")
    print("|---|" + "---:|" * (len(traces) + 2))
    for label, factory, inserts in FRONTIER:
        gains, shares, row = [], [], []
        for trace, up in zip(traces, ups):
            policy = factory(future(trace, PER_LAYER, "warm"))
            r = simulate(trace, PER_LAYER, policy, 16, inserts=inserts, admission="eager", prefill="warm")
            gains.append(100 * (r.hit_rate - up.hit_rate))
            shares.append(r.upload_bytes_per_token / up.upload_bytes_per_token)
            row.append(f"{100 * r.hit_rate:.1f} ({gains[-1]:+.1f}), {shares[-1]:.0%}")
        print(f"| {label} | " + " | ".join(row) + f" | {np.mean(gains):+.1f} | {max(shares):.0%} |")
    print()
    for trace in traces:
        prompt, decode = trace.ids[trace.phase != DECODE], trace.ids[trace.phase == DECODE]
        print(f"{Path(trace.path).name}: 16 experts per layer kept from the start, no decode upload: the "
              f"prompt's most used hit {static_hit_rate(prompt, decode, trace.n_expert, 16):.1%} of the "
              f"decode lookups, the decode's own most used {static_hit_rate(decode, decode, trace.n_expert, 16):.1%}")


def static_hit_rate(chosen_from, lookups, n_expert, k):
    """Hit rate of `lookups` ((steps, layers, n) ids) on a fixed cache of the k experts per layer
    used most in `chosen_from` (ties: the lower id)."""
    hits = 0
    for layer in range(lookups.shape[1]):
        ids = chosen_from[:, layer].ravel()
        top = np.argsort(-np.bincount(ids[ids >= 0], minlength=n_expert), kind="stable")[:k]
        hits += np.isin(lookups[:, layer], top).sum()
    return hit_rate(hits, (lookups >= 0).sum() - hits)


def timeline_grid(traces, sizes=(8, 16, 32)):
    """Issue 22's cells: ours (the live default with the miss planner at each class's rates)
    against the faster of stock and upstream at the same device bytes."""
    print("\nEvery miss where it costs least (issue 22): MODELLED ms per decode token, per-layer "
          "timeline (moecache.offline.cost) on each hardware class:\n")
    for hw in HARDWARE.values():
        print(f"- {hw.describe()}. {hw.summary}; {hw.sources}")
    print("\nours: the live default (heat, eager, prompt warm) with the miss planner at the class's rates, "
          "as LLAMA_MOE_CACHE_PLANNER=1 runs it: the copy-on-miss lane and uploads that pay (decode hit%, "
          "lane misses and MiB uploaded per decode token, lane copies included); without: the live default "
          "without the planner\n")
    print("| trace | K | hardware | stock | upstream | ours | hit%, lane/tok, MiB up/tok | without | ours / min |")
    print("|---|---:|---|---:|---:|---:|---|---:|---:|")
    ratios = []
    for trace in traces:
        name = Path(trace.path).name.split(".")[0]
        for k in sizes:
            up = upstream(trace, k)
            plain = simulate(trace, PER_LAYER, "default", k, admission="eager", prefill="warm")
            for hw in HARDWARE.values():
                ours = simulate(trace, PER_LAYER, "default", k, admission="eager", prefill="warm",
                                miss_plan=hw.rates)
                stock, upstream_ms, ours_ms = up.stock_ms(hw), up.modelled_ms(hw), ours.modelled_ms(hw)
                ratios.append(ours_ms / min(stock, upstream_ms))
                lane = ours.totals["lane_misses"] / ours.decode_tokens
                print(f"| {name} | {k} | {hw.name} | {stock:.2f} | {upstream_ms:.2f} | {ours_ms:.2f} | "
                      f"{100 * ours.hit_rate:.1f}, {lane:.1f}, {ours.upload_bytes_per_token / MIB:.0f} | "
                      f"{plain.modelled_ms(hw):.2f} | {ratios[-1]:.2f} |")
    geomean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    print(f"\ngeomean ours/min(stock,upstream) = {geomean:.2f} over {len(ratios)} cells, "
          f"{sum(r > 1.0 for r in ratios)} cells above 1.0")


def main():
    traces = [read_trace(p) for p in (sys.argv[1:] or [str(p) for p in SHIPPED_TRACES])]
    all_runs = {Path(t.path).name: comparison_table(t) for t in traces}
    targets(all_runs)
    candidate_table(traces)
    frontier(traces)
    timeline_grid(traces)


if __name__ == "__main__":
    main()
