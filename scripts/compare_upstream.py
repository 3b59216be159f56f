"""Ours against upstream llama.cpp's own MoE cache at equal device bytes: the tables of
docs/notes/upstream-comparison.md and the grid of docs/cost-model.md ("Modelled cost").

    python scripts/compare_upstream.py [TRACE ...]   (default: the shipped traces; imports the
                                                     installed moecache, as every script here)

upstream is llama.cpp at tag b12191 (ClassLRU, and --moe-cache-cpu-share F), upstream-b11480 its
plain LRU before, both as moecache.offline.upstream models them; each gets the device bytes of
our K slots per layer (moecache.core.banks.equal_bytes).

1. Per trace and K = 8, 16, 32: decode hit%, MiB uploaded per decode token and MODELLED
   milliseconds per decode token (moecache.offline.cost, on pcie4-x16 and pcie5-x16) of
   today's default timing (heat, boundary admission, prompts not fed), heat and LRU with eager
   admission, the live default (heat, eager, the cache warmed from each prompt), and both
   upstream versions (F = 0).
2. The K=16 targets of issue 11 (the live default against upstream), the eager-timing policy
   candidates tried against heat, and hits against bytes at K=16.
3. Hit rates at equal bytes (issue 37): the default, ClassLRU, the b11480 LRU and Belady (in our
   cache's rules, and over one pool), per trace and K and on the synthetic routings; then each
   candidate default's margin over ClassLRU in the same cells
   (moecache.offline.experiments.CLASSLRU_CANDIDATES), the same over one pool of slots per group
   of layers (moecache.offline.pooled), and each candidate in the grid below in place of the
   default.
4. The grid: per trace, K and hardware class (moecache.core.hardware.HARDWARE), modelled ms per
   decode token of stock --cpu-moe, upstream b12191 at the best F its tuner picks from on that
   class (scripts/moe-cache-tune.py's shares), and ours with zero configuration (what
   LLAMA_MOE_CACHE_SLOTS=K alone runs: moecache.offline.replay.zero_configuration, the miss
   planner where moecache.core.missplan.planner_by_default turns it on, at the class's rates),
   the slowest cell's time term by term (moecache.offline.cost.WorkTally.breakdown); it ends with
   the line

    geomean ours/min(stock,upstream) = 0.xx over N cells, M cells above 1.0
"""

import math
import sys
from pathlib import Path

import numpy as np

from moecache.core.banks import equal_bytes
from moecache.core.hardware import HARDWARE
from moecache.core.missplan import planner_by_default
from moecache.core.model import hit_rate
from moecache.core.policies import make_policy
from moecache.formats.traces import DECODE, SHIPPED_TRACES, RouteTrace, read_trace
from moecache.offline.experiments import (CLASSLRU_CANDIDATES, HeatMargin, HeatOracleAdmission, HeatSeenBefore,
                                          synthetic_routings, synthetic_traces)
from moecache.offline.pooled import POOLED_RUNS, pooled_replay
from moecache.offline.replay import (MIB, PER_LAYER, GlobalReplay, PerLayerReplay, UpstreamReplay, fastest, simulate,
                                     tuned_upstream, zero_configuration)
from moecache.offline.steps import future
from moecache.offline.upstream import UPSTREAM_TAGS
from moecache.util import OneLineParser

LINKS = [(name, HARDWARE[name]) for name in ("pcie4-x16", "pcie5-x16")]
ROWS = [  # (label, policy, admission, prefill)
    ("heat, boundary (today's default)", "heat", "boundary", "off"),
    ("heat, eager", "heat", "eager", "off"),
    ("lru, eager", "lru", "eager", "off"),
    ("heat, eager, prompt warm (live default)", "heat", "eager", "warm"),
]
DEFAULT, LIVE = ROWS[0][0], ROWS[3][0]
VERSIONS = [(policy, f"upstream {tag}" + (" (ClassLRU)" if policy == "upstream" else " (LRU)"))
            for policy, tag in UPSTREAM_TAGS.items()]


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
SIZES = (8, 16, 32)


def upstream(trace, k, policy="upstream"):
    """An upstream version at the device bytes of K slots per layer, no CPU share."""
    return simulate(trace, UpstreamReplay(policy, equal_bytes(trace.expert_bytes, k) / MIB))


def live_default(trace, k, **options):
    return simulate(trace, PerLayerReplay("default", k, admission="eager", prefill="warm", **options))


def cells(result):
    ms = " | ".join(f"{result.modelled_ms(bw):.2f}" for _, bw in LINKS)
    return f"{100 * result.hit_rate:.1f} | {result.upload_bytes_per_token / MIB:.1f} | {ms}"


def comparison_table(trace):
    runs = {}
    print(f"\n{Path(trace.path).name}\n")
    print("| K | cache | decode hit% | MiB up/token | " + " | ".join(f"ms/token, {name}" for name, _ in LINKS) + " |")
    print("|---:|---|---:|---:|---:|---:|")
    for k in SIZES:
        for label, policy, admission, prefill in ROWS:
            runs[k, label] = simulate(trace, PerLayerReplay(policy, k, admission=admission, prefill=prefill))
            print(f"| {k} | {label} | {cells(runs[k, label])} |")
        for policy, label in VERSIONS:
            runs[k, policy] = upstream(trace, k, policy)
            print(f"| {k} | {label}, same bytes ({runs[k, policy].budget_mib:.0f} MiB) | {cells(runs[k, policy])} |")
    print("\nstock --cpu-moe (every selected expert on the CPU): " + ", ".join(
        f"{runs[8, 'upstream'].stock_ms(hw):.2f} ({name})" for name, hw in LINKS) + " modelled ms/token")
    return runs


def targets(all_runs):
    """Issue 11's K=16 criteria, from the comparison tables' runs, against both versions."""
    print("\nK=16 targets (decode hit% points; upload bytes per token):\n")
    for name, runs in all_runs.items():
        live, default = runs[16, LIVE], runs[16, DEFAULT]
        for policy, label in VERSIONS:
            up = runs[16, policy]
            up_prompt = (up.totals_all["upload_bytes"] - up.totals["upload_bytes"]) / up.turns / MIB
            print(f"- {name}: live default {100 * live.hit_rate:.1f} vs {label} {100 * up.hit_rate:.1f} "
                  f"({100 * (live.hit_rate - up.hit_rate):+.1f}), uploading "
                  f"{live.upload_bytes_per_token / up.upload_bytes_per_token:.0%} of its bytes per decode token "
                  f"(prompts: {live.prefill_upload_bytes_per_turn / MIB:.0f} vs {up_prompt:.0f} MiB per turn)")
        print(f"- {name}: live default vs today's default {100 * default.hit_rate:.1f} "
              f"({100 * (live.hit_rate - default.hit_rate):+.1f})")


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
            r = simulate(trace, PerLayerReplay(factory(), trace.n_expert // 8, inserts=inserts, admission=admission,
                                               prefill="off"))
            ms = " / ".join(f"{r.modelled_ms(bw):.2f}" for _, bw in LINKS)
            row.append(f"{100 * r.hit_rate:.1f}" + (f" ({r.upload_bytes_per_token / MIB:.0f}, {ms})"
                                                     if i < len(traces) else ""))
        print(f"| {label} | " + " | ".join(row) + " |")
    for policy, version in VERSIONS:
        row = []
        for _, trace in routings[:len(traces)]:
            r = upstream(trace, trace.n_expert // 8, policy)
            ms = " / ".join(f"{r.modelled_ms(bw):.2f}" for _, bw in LINKS)
            row.append(f"{100 * r.hit_rate:.1f} ({r.upload_bytes_per_token / MIB:.0f}, {ms})")
        print(f"| {version}, same bytes | " + " | ".join(row) + " |" + " |" * (len(routings) - len(traces)))


def frontier(traces):
    """Hits against bytes at K=16: admission rules that upload less, against upstream b12191 at
    the same bytes (issue 11's target: +3 points on average, at most half its bytes on each)."""
    print("\nHits against bytes, K=16, eager, prompt warm: decode hit% (points over upstream b12191), "
          "upload bytes per decode token as a share of upstream b12191's\n")
    ups = [upstream(t, 16) for t in traces]
    print("| admission | " + " | ".join(Path(t.path).name.split(".")[0] for t in traces)
          + " | mean points | most bytes |")
    print("|---|" + "---:|" * (len(traces) + 2))
    for label, factory, inserts in FRONTIER:
        gains, shares, row = [], [], []
        for trace, up in zip(traces, ups):
            policy = factory(future(trace, PER_LAYER, "warm"))
            r = simulate(trace, PerLayerReplay(policy, 16, inserts=inserts, admission="eager", prefill="warm"))
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


def equal_bytes_cells(traces):
    """(label, trace, K) of the hit-rate tables: the traces, then the synthetic routings."""
    named = [(Path(t.path).name.split(".")[0], t) for t in traces] + list(synthetic_traces())
    return [(label, trace, k) for label, trace in named for k in SIZES]


def hit_rate_table(cells):
    """Decode hit% at equal device bytes; returns ClassLRU's per cell."""
    print("\nHit rates at equal bytes (issue 37): decode hit% of the default (heat, eager, prompt warm, "
          "INSERTS 2; without the planner, which trades hits for link time), upstream b12191's ClassLRU "
          "and b11480's LRU at the same device bytes (F = 0), and Belady: in our cache's rules (the "
          "default's K slots per layer, eager, INSERTS 2) and over one pool of the same bytes (the "
          "global model: any layer's expert in any slot, every miss admitted at once). Synthetic: "
          "moecache.offline.experiments.synthetic_traces, 300 decode steps, 1 MiB experts\n")
    print("| routing | K | default | ClassLRU (b12191) | LRU (b11480) | default - ClassLRU | "
          "Belady, our rules | Belady, one pool |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    classlru = {}
    for label, trace, k in cells:
        mib = equal_bytes(trace.expert_bytes, k) / MIB
        ours = live_default(trace, k).hit_rate
        classlru[label, k] = upstream(trace, k).hit_rate
        lru = upstream(trace, k, "upstream-b11480").hit_rate
        belady = simulate(trace, PerLayerReplay("belady", k, admission="eager", prefill="warm")).hit_rate
        pool = simulate(trace, GlobalReplay("belady", mib)).hit_rate
        print(f"| {label} | {k} | {100 * ours:.1f} | {100 * classlru[label, k]:.1f} | {100 * lru:.1f} | "
              f"{100 * (ours - classlru[label, k]):+.1f} | {100 * belady:.1f} | {100 * pool:.1f} |", flush=True)
    return classlru


def candidate_margins(cells, classlru):
    """Each candidate default's decode hit% minus ClassLRU's, cell by cell (eager, prompt warm)."""
    print("\nCandidate defaults against ClassLRU (issue 37): decode hit% points over upstream b12191's "
          "ClassLRU at equal bytes, eager, prompt warm (moecache.offline.experiments.CLASSLRU_CANDIDATES)\n")
    print("| candidate | " + " | ".join(f"{label.split(',')[0]} {k}" for label, _, k in cells) + " | min | mean |")
    print("|---|" + "---:|" * (len(cells) + 2))
    for label, factory, inserts in CLASSLRU_CANDIDATES:
        margins = [100 * (simulate(trace, PerLayerReplay(factory(), k, inserts=inserts, admission="eager",
                                                         prefill="warm")).hit_rate - classlru[name, k])
                   for name, trace, k in cells]
        print(f"| {label} | " + " | ".join(f"{m:+.1f}" for m in margins)
              + f" | {min(margins):+.2f} | {np.mean(margins):+.2f} |", flush=True)


def pooled_margins(cells, classlru):
    """Policies over one pool of slots per group under our rules (moecache.offline.pooled), decode
    hit% points over ClassLRU, cell by cell, under each victim rule."""
    print("\nOne pool per group under our rules (issue 37; moecache.offline.pooled.POOLED_RUNS): decode hit% "
          "points over upstream b12191's ClassLRU at equal bytes, eager, prompt warm, INSERTS per layer; victims: "
          "oracle = any resident the graph does not select, run = of the layers already run, ahead W = not "
          "selected by the layers run nor used by its layer in the last W graphs (a later use in the graph a "
          "miss), defer = oracle's, a copy into a later layer's slot starting once that layer has run without "
          "selecting it. MODELLED\n")
    print("| policy | victims | " + " | ".join(f"{label.split(',')[0]} {k}" for label, _, k in cells)
          + " | min | mean | behind |")
    print("|---|---|" + "---:|" * (len(cells) + 3))
    for label, factory, inserts, victims in POOLED_RUNS:
        margins = np.array([100 * (pooled_replay(trace, factory(), k, inserts=inserts, rule=victims)
                                   .hit_rate - classlru[name, k]) for name, trace, k in cells])
        print(f"| {label} | {victims.label} | " + " | ".join(f"{m:+.1f}" for m in margins)
              + f" | {margins.min():+.2f} | {margins.mean():+.2f} | {(margins < 0).sum()} |", flush=True)


def tuned_shares(traces, sizes=SIZES):
    """Upstream b12191 at the same device bytes at each share its tuner picks from, by (trace
    name, K)."""
    return {(Path(t.path).name.split(".")[0], k): tuned_upstream(t, equal_bytes(t.expert_bytes, k) / MIB)
            for t in traces for k in sizes}


def timeline_grid(traces, sizes=SIZES, shares=None):
    """Ours with zero configuration against the faster of stock and upstream b12191 at its
    tuner's best CPU share (shares: tuned_shares()'s), at the same device bytes, on every
    hardware class."""
    shares = tuned_shares(traces, sizes) if shares is None else shares
    print("\nThe grid: MODELLED ms per decode token, per-layer timeline (moecache.offline.cost) on each "
          "hardware class:\n")
    for hw in HARDWARE.values():
        print(f"- {hw.describe()}. {hw.summary}; {hw.sources}")
    print(f"\nupstream: llama.cpp tag {UPSTREAM_TAGS['upstream']} (ClassLRU), at the same device bytes, at the "
          "--moe-cache-cpu-share F its tuner picks on the class (F: the fastest of scripts/moe-cache-tune.py's "
          "shares); ours: zero configuration, what LLAMA_MOE_CACHE_SLOTS=K alone runs (heat, eager, prompt warm, "
          "the miss planner on by default: moecache.core.missplan.planner_by_default) at the class's rates "
          "(decode hit%, lane misses and MiB uploaded per decode token, lane copies included); without: the "
          "same without the planner\n")
    print("| trace | K | hardware | stock | upstream | F | ours | hit%, lane/tok, MiB up/tok | without | ours / min |")
    print("|---|---:|---|---:|---:|---:|---:|---|---:|---:|")
    ratios, slowest = [], None
    for trace in traces:
        name = Path(trace.path).name.split(".")[0]
        for k in sizes:
            plain = live_default(trace, k)
            for hw in HARDWARE.values():
                up, ours = fastest(shares[name, k], hw), zero_configuration(trace, k, hw.rates)
                stock, upstream_ms, ours_ms = up.stock_ms(hw), up.modelled_ms(hw), ours.modelled_ms(hw)
                ratios.append(ours_ms / min(stock, upstream_ms))
                if slowest is None or ratios[-1] > slowest[0]:
                    slowest = (ratios[-1], f"{name} K={k} on {hw.name}", hw, ours, up)
                lane = ours.totals["lane_misses"] / ours.decode_tokens
                print(f"| {name} | {k} | {hw.name} | {stock:.2f} | {upstream_ms:.2f} | {up.cpu_share:g} | "
                      f"{ours_ms:.2f} | {100 * ours.hit_rate:.1f}, {lane:.1f}, {ours.upload_bytes_per_token / MIB:.0f} | "
                      f"{plain.modelled_ms(hw):.2f} | {ratios[-1]:.2f} |", flush=True)
    breakdown(*slowest[1:])
    print("\n" + geomean_line(ratios))


def breakdown(cell, hw, ours, up):
    """A cell's modelled time per decode token, term by term (moecache.offline.cost.WorkTally.breakdown)."""
    terms = [r.work.breakdown(hw.rates, r.decode_tokens) for r in (ours, up)]
    print(f"\nThe slowest cell, {cell}, per decode token (ms; experts per token; MODELLED): ours, and upstream at "
          f"F = {up.cpu_share:g} (its copies are its lane)\n")
    print("| term | ours | upstream |")
    print("|---|---:|---:|")
    for name in terms[0]:
        print(f"| {name} | {terms[0][name]:.2f} | {terms[1][name]:.2f} |")


def geomean_line(ratios):
    geomean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    return (f"geomean ours/min(stock,upstream) = {geomean:.2f} over {len(ratios)} cells, "
            f"{sum(r > 1.0 for r in ratios)} cells above 1.0")


def candidate_grid(traces, shares):
    """Each candidate default in the grid in place of heat, with the miss planner where
    planner_by_default turns it on: its geomean line and its slowest cell's ratio."""
    print("\nCandidate defaults in the grid (the same cells, each candidate in place of heat, eager, prompt warm, "
          "the planner where moecache.core.missplan.planner_by_default turns it on): MODELLED\n")
    print("| candidate | planner | geomean ours/min | cells above 1.0 | slowest cell |")
    print("|---|---|---:|---:|---:|")
    for label, factory, inserts in CLASSLRU_CANDIDATES:
        planned = planner_by_default(factory(), "eager")
        ratios = []
        for trace in traces:
            name = Path(trace.path).name.split(".")[0]
            for k in SIZES:
                for hw in HARDWARE.values():
                    up = fastest(shares[name, k], hw)
                    r = simulate(trace, PerLayerReplay(factory(), k, inserts=inserts, admission="eager", prefill="warm",
                                                       miss_plan=hw.rates if planned else None))
                    ratios.append(r.modelled_ms(hw) / min(up.stock_ms(hw), up.modelled_ms(hw)))
        geomean = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        print(f"| {label} | {'on' if planned else 'off'} | {geomean:.2f} | {sum(x > 1.0 for x in ratios)} | "
              f"{max(ratios):.2f} |", flush=True)


def main(argv=None) -> int:
    p = OneLineParser(prog="compare_upstream.py", description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="*", metavar="TRACE", help="route traces (default: the shipped ones)")
    return p.run(lambda args: compare([read_trace(t) for t in args.traces or map(str, SHIPPED_TRACES)]), argv)


def compare(traces):
    print(f"upstream: llama.cpp tag {UPSTREAM_TAGS['upstream']} (ClassLRU, PR 31233; --moe-cache-cpu-share) "
          f"as moecache.offline.upstream models it; upstream-b11480: its LRU of tag "
          f"{UPSTREAM_TAGS['upstream-b11480']}")
    all_runs = {Path(t.path).name: comparison_table(t) for t in traces}
    targets(all_runs)
    candidate_table(traces)
    frontier(traces)
    cells = equal_bytes_cells(traces)
    classlru = hit_rate_table(cells)
    candidate_margins(cells, classlru)
    pooled_margins(cells, classlru)
    shares = tuned_shares(traces)
    candidate_grid(traces, shares)
    timeline_grid(traces, shares=shares)


if __name__ == "__main__":
    sys.exit(main())
