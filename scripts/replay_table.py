"""Measure the figures in docs/policies.md and print them as markdown.

    python scripts/replay_table.py [TRACE ...]   (default: the shared traces)

Per trace: every per-layer policy's decode hit% at K = n_expert/8 with INSERTS=2 and with
unlimited inserts, the share of the LRU->Belady gap the default closes, warm start (profile
of the first half of decode preloaded before replaying the second half, vs cold), and the
replay throughput; then the time of a 6 policies x 6 sizes sweep.
"""

import sys
import time
from pathlib import Path

from moecache.policies import DEFAULT_POLICY, POLICIES
from moecache.profile import UsageProfile
from moecache.replay import observations, replay_per_layer
from moecache.traces import DECODE, read_trace

SHARED = [Path("/work/shared/traces/qwen3-30b-a3b.route.csv"),
          Path("/work/shared/traces/gpt-oss-120b.route.csv")]


def gap_closed(policy, lru, belady):
    return 100.0 * (policy - lru) / (belady - lru) if belady > lru else float("nan")


def policy_table(trace, slots):
    obs = observations(trace)
    names = ["belady", *[n for n in POLICIES if n != "belady"]]
    hits = {(name, inserts): replay_per_layer(trace, name, slots, inserts=inserts, obs=obs).hit_pct_decode
            for name in names for inserts in (2, None)}
    print(f"\n{Path(trace.path).name}: K={slots} per layer ({trace.layers.size} layers x "
          f"{trace.n_expert} experts, top-{trace.n_expert_used}, {len(obs[0])} decode steps)\n")
    print("| policy | hit% INSERTS=2 | gap closed | hit% unlimited | gap closed |")
    print("|---|---:|---:|---:|---:|")
    for name in names:
        label = f"{name} (default)" if name == DEFAULT_POLICY else name
        cells = []
        for inserts in (2, None):
            h = hits[(name, inserts)]
            gap = gap_closed(h, hits[("lru", inserts)], hits[("belady", inserts)])
            cells += [f"{h:.1f}", "" if name in ("lru", "belady") else f"{gap:.0f}%"]
        print(f"| {label} | " + " | ".join(cells) + " |")


def warm_start_table(trace, slots):
    decode = trace.ids[trace.phase == DECODE]
    half = len(decode) // 2
    profile = UsageProfile.from_ids(trace.model, trace.layers, trace.n_expert, decode[:half])
    second = (list(decode[half:]), [True] * (len(decode) - half))
    print(f"\nwarm start, {Path(trace.path).name}, K={slots}, INSERTS=2: profile of decode steps "
          f"0..{half - 1}, replay of steps {half}..{len(decode) - 1}\n")
    print("| policy | cold hit% | warm hit% |")
    print("|---|---:|---:|")
    for name in ("lru", DEFAULT_POLICY):
        cold = replay_per_layer(trace, name, slots, obs=second).hit_pct_decode
        warm = replay_per_layer(trace, name, slots, obs=second, preload=profile.top(slots)).hit_pct_decode
        print(f"| {name} | {cold:.1f} | {warm:.1f} |")


def throughput(trace, slots, repeats=5):
    obs = observations(trace)
    best = max(replay_per_layer(trace, "lru", slots, obs=obs).lookups_per_s for _ in range(repeats))
    print(f"\nLRU replay throughput, {Path(trace.path).name}, K={slots}: "
          f"{best / 1e6:.2f} M lookups/s (best of {repeats})")


def sweep_time(trace):
    obs = observations(trace)
    names = ["lru", "lfu", "gdsf", "arc", "belady", DEFAULT_POLICY]
    sizes = [4, 8, 16, 32, 64, 96]
    start = time.perf_counter()
    for name in names:
        for k in sizes:
            replay_per_layer(trace, name, k, obs=obs)
    print(f"\nsweep {','.join(names)} x K={','.join(map(str, sizes))} over {Path(trace.path).name}: "
          f"{time.perf_counter() - start:.1f} s")


def main():
    paths = [Path(p) for p in sys.argv[1:]] or SHARED
    traces = [read_trace(str(p)) for p in paths]
    for trace in traces:
        policy_table(trace, trace.n_expert // 8)
    for trace in traces:
        warm_start_table(trace, trace.n_expert // 8)
    for trace in traces:
        throughput(trace, trace.n_expert // 8)
    sweep_time(traces[0])


if __name__ == "__main__":
    main()
