"""Replay a routing trace through cache models, offline.

    python -m moecache.replay TRACE [--slots 8,16,32,64] [--policies lru,belady,default]
                              [--inserts 2] [--budget-mib 3000,4000] [--csv FILE] [--plot PNG]

Two models:

per-layer (--slots): our live cache. K slots per layer, at most --inserts uploads per layer
    per step, one-step publication delay, experts of the step just observed protected. It
    runs moecache.engine.CacheEngine itself, the code the live glue calls. Prefill is NOT fed
    by default, as live prefill graphs are stock and do not feed the policy
    (--include-prefill feeds each turn's prefill as one batched observation).
global (--budget-mib): BigMoeOnEdge's route-replay model. One cache over (layer, expert)
    entries budgeted in bytes (expert sizes from the preamble), immediate admission, no insert
    limit; batches are one per layer for a turn's whole prefill, then one per layer per decode
    token; one lookup per distinct expert per batch; eviction after each batch, sparing the
    batch's own experts. Its cumulative hit% includes prefill, as that project reports.
"""

from __future__ import annotations

import argparse
import heapq
import random
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .engine import CacheEngine
from .policies import DEFAULT_POLICY, POLICIES, make_policy
from .profile import ProfileError, UsageProfile
from .traces import DECODE, PREFILL, RouteTrace, TraceError, read_trace

MIB = 1 << 20
GLOBAL_POLICIES = ("lru", "lfu", "random", "belady", "layer", "layerlfu")


@dataclass
class ReplayResult:
    model: str                  # "per-layer" or "global"
    policy: str
    slots: int | None           # per-layer K
    budget_mib: float | None    # global budget
    inserts: int | None
    hits_decode: int
    lookups_decode: int
    hits_all: int
    lookups_all: int
    upload_bytes: int           # uploaded (global: read) for decode tokens
    decode_tokens: int
    seconds: float

    @property
    def hit_pct_decode(self) -> float:
        return 100.0 * self.hits_decode / self.lookups_decode if self.lookups_decode else 0.0

    @property
    def hit_pct_cum(self) -> float:
        return 100.0 * self.hits_all / self.lookups_all if self.lookups_all else 0.0

    @property
    def upload_bytes_per_token(self) -> float:
        return self.upload_bytes / self.decode_tokens if self.decode_tokens else 0.0

    @property
    def lookups_per_s(self) -> float:
        return self.lookups_all / self.seconds if self.seconds > 0 else float("inf")


# --- per-layer model (the engine) ------------------------------------------------------

def observations(trace: RouteTrace, include_prefill: bool = False):
    """What the live cache would observe, in order: a list of (n_layers, n) id arrays and a
    parallel list of is-decode flags. A turn's prefill is one batched observation."""
    obs, is_decode = [], []
    for turn in np.unique(trace.turn):
        in_turn = trace.turn == turn
        if include_prefill:
            prefill = trace.ids[in_turn & (trace.phase == PREFILL)]
            if prefill.size:
                obs.append(np.ascontiguousarray(prefill.transpose(1, 0, 2)).reshape(prefill.shape[1], -1))
                is_decode.append(False)
        decode = trace.ids[in_turn & (trace.phase == DECODE)]
        obs.extend(decode)
        is_decode.extend([True] * len(decode))
    return obs, is_decode


def replay_per_layer(trace: RouteTrace, policy: str, slots: int, *, inserts: int | None = 2,
                     include_prefill: bool = False, profile: UsageProfile | None = None,
                     seed: int = 0, obs=None) -> ReplayResult:
    """Replay through CacheEngine. profile: warm start as the live cache does it (its top
    experts uploaded at the first boundary, its rates as the policy's prior). obs: a
    precomputed observations() result to share across runs."""
    obs, is_decode = obs if obs is not None else observations(trace, include_prefill)
    engine = CacheEngine(trace.layers.size, trace.n_expert, slots, _make(policy, obs, seed),
                         inserts=inserts, offline=True)
    if profile is not None:
        engine.preload(profile.top(slots), rates=profile.rates(trace.n_expert_used))
    start = time.perf_counter()
    engine.step(None)
    warm_uploads = engine.counters["uploads"].copy()  # the preload's: not a decode token's
    # the engine's counters total every step; only the few prefill steps are tallied here
    hits_prefill = lookups_prefill = 0
    uploads_prefill = np.zeros_like(warm_uploads)
    for ids, decode in zip(obs, is_decode):
        plan = engine.step(ids)
        if not decode:
            hits_prefill += int(plan.hits.sum())
            lookups_prefill += int(plan.hits.sum() + plan.misses.sum())
            uploads_prefill += np.bincount(plan.upload[:, 0], minlength=uploads_prefill.size)
    seconds = time.perf_counter() - start
    hits_all = int(engine.counters["hits"].sum())
    lookups_all = hits_all + int(engine.counters["misses"].sum())
    decode_uploads = engine.counters["uploads"] - warm_uploads - uploads_prefill
    return ReplayResult("per-layer", policy, slots, None, inserts, hits_all - hits_prefill,
                        lookups_all - lookups_prefill, hits_all, lookups_all,
                        int(np.dot(decode_uploads, trace.expert_bytes)), int(sum(is_decode)), seconds)


def _make(policy, obs, seed):
    if policy == "belady":
        return make_policy("belady", future=obs)
    if policy == "random":
        return make_policy("random", seed=seed)
    return make_policy(policy)


# --- global byte-budget model (BigMoeOnEdge's) -----------------------------------------

def global_batches(trace: RouteTrace):
    """[(layer index, expert ids, is_decode)] in the order that engine's load_layer calls run."""
    batches = []
    for turn in np.unique(trace.turn):
        in_turn = trace.turn == turn
        prefill = trace.ids[in_turn & (trace.phase == PREFILL)]  # (tokens, L, k)
        for li in range(trace.layers.size):
            ids = prefill[:, li, :].ravel()  # token-major: the prompt tail's experts end hottest
            ids = ids[ids >= 0]
            if ids.size:
                batches.append((li, ids.tolist(), False))
        for step_ids in trace.ids[in_turn & (trace.phase == DECODE)]:
            batches.extend((li, row, True) for li, row in enumerate(step_ids.tolist()))
    return batches


class _ByteBudgetCache:
    """Resident (layer, expert) keys under a byte budget. Partitioned policies (layer,
    layerlfu) give each layer an equal share and evict only within the staging layer."""

    def __init__(self, policy, budget_bytes, expert_bytes, n_expert, n_layers, batches, seed):
        self.policy = policy
        self.partitioned = policy in ("layer", "layerlfu")
        self.budget = budget_bytes // n_layers if self.partitioned else budget_bytes
        self.expert_bytes = [int(b) for b in expert_bytes]
        self.n_expert = n_expert
        n_parts = n_layers if self.partitioned else 1
        self.used_bytes = [0] * n_parts
        self.resident = {}          # key -> admission sequence
        self.recency = [OrderedDict() for _ in range(n_parts)]  # lru/layer: oldest first
        self.heaps = [[] for _ in range(n_parts)]               # lfu/belady: lazy entries
        self.freq, self.last = {}, {}
        self.current_next = {}      # belady: key -> next batch using it, as of its last touch
        self.clock = self.admitted = 0
        self.rng = random.Random(seed)
        self.members = []           # random: resident keys
        self.member_pos = {}
        self.next_use = self._next_uses(batches) if policy == "belady" else None

    def _next_uses(self, batches):
        """For each batch, {key: index of the next batch using key (inf if none)}."""
        upcoming, table = {}, [None] * len(batches)
        for b in range(len(batches) - 1, -1, -1):
            layer, ids, _ = batches[b]
            keys = {layer * self.n_expert + e for e in ids}
            table[b] = {key: upcoming.get(key, float("inf")) for key in keys}
            for key in keys:
                upcoming[key] = b
        return table

    def run_batch(self, b, layer, ids):
        """Returns (lookups, hits, bytes read)."""
        part = layer if self.partitioned else 0
        recency = self.recency[part]
        touched = {}
        hits = read = 0
        for e in ids:
            key = layer * self.n_expert + e
            self.clock += 1
            if key not in touched:
                touched[key] = True
                if key in self.resident:
                    hits += 1
                else:
                    size = self.expert_bytes[layer]
                    self.used_bytes[part] += size
                    read += size
                    self.resident[key] = self.admitted
                    self.admitted += 1
                    if self.policy == "random":
                        self.member_pos[key] = len(self.members)
                        self.members.append(key)
                self.freq[key] = self.freq.get(key, 0) + 1
            self.last[key] = self.clock
            if self.policy in ("lru", "layer"):
                recency[key] = None
                recency.move_to_end(key)
        if self.policy in ("lfu", "layerlfu"):
            for key in touched:
                heapq.heappush(self.heaps[part], (self.freq[key], self.last[key], key))
        elif self.policy == "belady":
            upcoming = self.next_use[b]
            for key in touched:
                self.current_next[key] = upcoming[key]
                heapq.heappush(self.heaps[part], (-upcoming[key], self.resident[key], key))
        self._evict(part, touched)
        return len(touched), hits, read

    def _evict(self, part, touched):
        spared = []
        while self.used_bytes[part] > self.budget:
            victim = self._victim(part, touched, spared)
            if victim is None:
                break
            self._drop(part, victim)
        for entry in spared:
            heapq.heappush(self.heaps[part], entry)

    def _victim(self, part, touched, spared):
        if self.policy in ("lru", "layer"):
            for key in self.recency[part]:  # the batch's own keys sit at the young end
                if key not in touched:
                    return key
            return None
        if self.policy == "random":
            if len(touched) * 2 < len(self.members):  # mostly untouched: rejection sampling
                while True:
                    key = self.members[self.rng.randrange(len(self.members))]
                    if key not in touched:
                        return key
            candidates = [key for key in self.members if key not in touched]
            return self.rng.choice(candidates) if candidates else None
        heap = self.heaps[part]
        while heap:
            entry = heapq.heappop(heap)
            key = entry[2]
            if key not in self.resident:
                continue
            if self.policy == "belady":
                if -entry[0] != self.current_next[key] or entry[1] != self.resident[key]:
                    continue
            elif entry[:2] != (self.freq[key], self.last[key]):
                continue
            if key in touched:
                spared.append(entry)
                continue
            return key
        return None

    def _drop(self, part, key):
        layer = key // self.n_expert
        self.used_bytes[part] -= self.expert_bytes[layer]
        del self.resident[key]
        if self.policy in ("lru", "layer"):
            del self.recency[part][key]
        elif self.policy == "random":
            pos = self.member_pos.pop(key)
            last = self.members.pop()
            if last != key:
                self.members[pos] = last
                self.member_pos[last] = pos


def replay_global(trace: RouteTrace, policy: str, budget_mib: float, *, seed: int = 0,
                  batches=None) -> ReplayResult:
    if policy not in GLOBAL_POLICIES:
        raise ValueError(f"unknown policy {policy!r} for --budget-mib; valid: {', '.join(GLOBAL_POLICIES)}")
    batches = batches if batches is not None else global_batches(trace)
    cache = _ByteBudgetCache(policy, int(budget_mib * MIB), trace.expert_bytes, trace.n_expert,
                             trace.layers.size, batches, seed)
    hits_decode = lookups_decode = hits_all = lookups_all = read = 0
    start = time.perf_counter()
    for b, (layer, ids, decode) in enumerate(batches):
        looked, hits, bytes_read = cache.run_batch(b, layer, ids)
        lookups_all += looked
        hits_all += hits
        if decode:
            lookups_decode += looked
            hits_decode += hits
            read += bytes_read
    seconds = time.perf_counter() - start
    return ReplayResult("global", policy, None, budget_mib, None, hits_decode, lookups_decode,
                        hits_all, lookups_all, read, int((trace.phase == DECODE).sum()), seconds)


# --- command line ----------------------------------------------------------------------

class _Progress:
    """tqdm on stderr when installed, else a plain bar; silent when stderr is not a tty."""

    def __init__(self, total):
        self.total, self.done, self.bar = total, 0, None
        self.enabled = sys.stderr.isatty() and total > 1
        if self.enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, file=sys.stderr, leave=False, unit="run")
            except ImportError:
                pass

    def advance(self, label):
        self.done += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(label)
            self.bar.update()
        else:
            filled = 30 * self.done // self.total
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} {label:<24}")
            sys.stderr.flush()

    def close(self):
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            sys.stderr.write("\r" + " " * 70 + "\r")


def _int_list(text, name, minimum):
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--{name} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < minimum:
        raise ValueError(f"--{name} values must be >= {minimum}, got {text!r}")
    return values


def _float_list(text, name):
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--{name} must be comma-separated numbers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise ValueError(f"--{name} values must be > 0, got {text!r}")
    return values


def _fail(message):
    print(f"replay: {message}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moecache.replay",
                                 description="Replay a routing trace through cache policies.")
    ap.add_argument("trace")
    ap.add_argument("--slots", help="per-layer cache sizes K, comma separated (default 8,16,32,64 "
                                    "unless --budget-mib is given)")
    ap.add_argument("--policies", default="lru,belady,default",
                    help=f"comma separated; per-layer: default ({DEFAULT_POLICY}), "
                         f"{', '.join(POLICIES)}; --budget-mib: {', '.join(GLOBAL_POLICIES)}")
    ap.add_argument("--inserts", default="2", help="uploads per layer per step, or 'unlimited'")
    ap.add_argument("--budget-mib", help="global byte budgets (BigMoeOnEdge model), comma separated")
    ap.add_argument("--include-prefill", action="store_true",
                    help="per-layer model: feed each turn's prefill as one batched observation")
    ap.add_argument("--preload-profile", metavar="JSON",
                    help="per-layer model: warm start from a saved usage profile")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random policy")
    ap.add_argument("--csv", help="also write the results here")
    ap.add_argument("--plot", help="also plot hit%% vs cache size here (needs matplotlib)")
    args = ap.parse_args(argv)

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        return _fail("--policies is empty")
    try:
        slots = _int_list(args.slots, "slots", 1) if args.slots else ([] if args.budget_mib else [8, 16, 32, 64])
        budgets = _float_list(args.budget_mib, "budget-mib") if args.budget_mib else []
        inserts = None if args.inserts == "unlimited" else _int_list(args.inserts, "inserts", 1)[0]
    except ValueError as e:
        return _fail(str(e))
    # A name runs in every requested model that has it; one that no requested model has is
    # rejected, never tabulated under a policy that did not run.
    per_layer_names = ["default", *POLICIES]
    models = ([("--slots", per_layer_names)] if slots else []) + \
             ([("--budget-mib", list(GLOBAL_POLICIES))] if budgets else [])
    unknown = [p for p in policies if not any(p in names for _, names in models)]
    if unknown:
        valid = "; ".join(f"{flag}: {', '.join(names)}" for flag, names in models)
        return _fail(f"unknown policy {', '.join(unknown)} for {' and '.join(f for f, _ in models)}; valid {valid}")
    if args.plot:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return _fail("--plot needs matplotlib (pip install matplotlib)")

    try:
        trace = read_trace(args.trace)
    except TraceError as e:
        return _fail(str(e))
    if slots and max(slots) > trace.n_expert:
        return _fail(f"--slots {max(slots)} exceeds n_expert={trace.n_expert}")
    profile = None
    if args.preload_profile:
        try:
            profile = UsageProfile.load(args.preload_profile, layers=trace.layers.tolist(),
                                        n_expert=trace.n_expert)
        except ProfileError as e:
            return _fail(str(e))

    n_prefill = int((trace.phase == PREFILL).sum())
    n_decode = int((trace.phase == DECODE).sum())
    print(f"{args.trace}: {trace.arch}, {trace.layers.size} MoE layers x {trace.n_expert} experts, "
          f"top-{trace.n_expert_used}; {n_prefill} prefill + {n_decode} decode tokens; one token's "
          f"working set {trace.working_set_bytes() / MIB:.0f} MiB")

    runs = [("per-layer", p, k) for p in policies if p in per_layer_names for k in slots] + \
           [("global", p, b) for p in policies if p in GLOBAL_POLICIES for b in budgets]
    progress = _Progress(len(runs))
    results = []
    obs = observations(trace, args.include_prefill) if slots else None
    batches = global_batches(trace) if budgets else None
    for model, policy, size in runs:
        name = DEFAULT_POLICY if policy == "default" else policy
        if model == "per-layer":
            result = replay_per_layer(trace, name, size, inserts=inserts, profile=profile,
                                      seed=args.seed, obs=obs)
        else:
            result = replay_global(trace, name, size, seed=args.seed, batches=batches)
        result.policy = policy if policy != "default" else f"default({name})"
        results.append(result)
        progress.advance(f"{policy} {size}")
    progress.close()

    for model in ("per-layer", "global"):
        rows = [r for r in results if r.model == model]
        if not rows:
            continue
        if model == "per-layer":
            print(f"\nper-layer cache: K slots per layer, inserts={'unlimited' if inserts is None else inserts}, "
                  f"publication delay 1 step, prefill {'fed' if args.include_prefill else 'not fed'}"
                  f"{', warm start from ' + args.preload_profile if args.preload_profile else ''}")
            head = f"{'policy':<16}{'K':>6}"
        else:
            print("\nglobal cache (BigMoeOnEdge model): one byte budget over all layers, immediate admission")
            head = f"{'policy':<16}{'MiB':>6}"
        print(f"{head}{'hit% dec':>10}{'hit% cum':>10}{'MiB up/tok':>12}{'Mlookup/s':>11}")
        for r in rows:
            size = r.slots if model == "per-layer" else f"{r.budget_mib:g}"
            print(f"{r.policy:<16}{size:>6}{r.hit_pct_decode:>10.1f}{r.hit_pct_cum:>10.1f}"
                  f"{r.upload_bytes_per_token / MIB:>12.1f}{r.lookups_per_s / 1e6:>11.2f}")

    if args.csv:
        with open(args.csv, "w", encoding="utf-8") as f:
            f.write("model,policy,slots,budget_mib,inserts,hit_pct_decode,hit_pct_cum,"
                    "upload_bytes_per_token,lookups,seconds\n")
            for r in results:
                f.write(f"{r.model},{r.policy},{r.slots if r.slots is not None else ''},"
                        f"{r.budget_mib if r.budget_mib is not None else ''},"
                        f"{'' if r.model == 'global' else ('unlimited' if r.inserts is None else r.inserts)},"
                        f"{r.hit_pct_decode:.3f},{r.hit_pct_cum:.3f},{r.upload_bytes_per_token:.0f},"
                        f"{r.lookups_all},{r.seconds:.4f}\n")
        print(f"\nwrote {args.csv}")
    if args.plot:
        models = [m for m in ("per-layer", "global") if any(r.model == m for r in results)]
        fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
        for ax, model in zip(axes[0], models):
            for policy in dict.fromkeys(r.policy for r in results if r.model == model):
                rows = [r for r in results if r.model == model and r.policy == policy]
                xs = [r.slots if model == "per-layer" else r.budget_mib for r in rows]
                ax.plot(xs, [r.hit_pct_decode for r in rows], marker="o", label=policy,
                        linestyle="--" if policy == "belady" else "-")
            ax.set_xlabel("slots per layer (K)" if model == "per-layer" else "budget (MiB)")
            ax.set_ylabel("decode hit %")
            ax.set_title(f"{trace.arch}: {model} cache")
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
