"""Candidate default policies that were tried against `heat` and NOT shipped (issue 4).

    python scripts/policy_experiments.py   (15 s on a loaded 2-core machine; imports the installed
                                           moecache, as every script here)

Prints decode hit% at K = n_expert/8, INSERTS=2, with the share of the LRU->Belady gap
closed, on both shipped traces (plus uploads per layer per step) and on synthetic locality
routing. The candidates are kept here, outside moecache.core.policies, so the negative results in
docs/policies.md stay reproducible:

- markov-same / markov-prev: heat plus a co-activation term learned online: P(expert b is
  used in layer l two steps later | expert a used now in layer l) (same layer), or in layer
  l-1 now (the previous layer: consecutive layers' routing is correlated).
- near-use: a table learned online, shared by all layers, of P(used within the next 8 steps)
  for each (log2 use count, log2 steps since last use) state; priority = admission = that.
- value: the same states, learning the expected discounted future uses (half-life 8, 16
  steps ahead) instead.
- hl-mix: the mean of normalized heats with half-lives 4, 16, 64.
- hl-select: per layer, the half-life (4, 16, 64) whose normalized heat put the most mass
  on the experts actually used two steps later (ARC-like adaptation of recency/frequency).
- prefetch: heat plus predict() = the hottest non-resident experts (uses the INSERTS budget
  misses leave; admitted only over a colder victim).
"""

import sys
from pathlib import Path

import numpy as np

from moecache.core.policies import DecayedLfu, Policy, make_policy
from moecache.core.traces import SHIPPED_TRACES, RouteTrace, read_trace, synthetic_routing
from moecache.offline.replay import PER_LAYER, simulate

SYNTHETIC = [  # (label, layers, experts, top-k, options); seeds 3.. as in replay_table.py
    ("8 of 128, sticky", 24, 128, 8, {}),
    ("2 of 64", 24, 64, 2, {"stickiness": 1.0}),
    ("4 of 64, fast drift", 24, 64, 4, {"skew": 0.5, "stickiness": 2.5, "drift": 0.2}),
    ("2 of 128, skew 1.2", 36, 128, 2, {"skew": 1.2}),
]


def log_bucket(x, n):
    """0 -> 0, 1 -> 1, 2-3 -> 2, 4-7 -> 3, ..., capped at n - 1."""
    return np.where(x < 1, 0, np.minimum(np.floor(np.log2(np.maximum(x, 1))) + 1, n - 1)).astype(np.int64)


class ScoreTable(Policy):
    """Base: a full (L, E) score matrix recomputed at each observation."""
    admits = True

    def bind(self, n_layers, n_expert, n_slots):
        super().bind(n_layers, n_expert, n_slots)
        self.S = np.zeros((n_layers, n_expert))

    def priority(self, step, keys):
        return self.S.take(keys)

    def admit(self, step, keys):
        return self.S.take(keys)


class HeatMarkov(ScoreTable):
    def __init__(self, weight=0.5, shift=0, lag=2, half_life=16.0):
        self.weight, self.shift, self.lag, self.g = weight, shift, lag, 2 ** (-1 / half_life)

    def bind(self, n_layers, n_expert, n_slots):
        super().bind(n_layers, n_expert, n_slots)
        self.heat = np.zeros((n_layers, n_expert))
        self.M = np.zeros((n_layers, n_expert, n_expert))
        self.n = np.zeros((n_layers, n_expert))
        self.hist = []

    def observe(self, step, ids, hit_mask, used):
        u = used.astype(float)
        self.heat = self.heat * self.g + u
        self.hist.append(u)
        if len(self.hist) > self.lag:
            src = np.roll(self.hist.pop(0), self.shift, axis=0)  # src[l] = layer l - shift
            self.M += src[:, :, None] * u[:, None, :]
            self.n += src
        P = self.M / np.maximum(self.n, 1)[:, :, None]
        markov = np.einsum("la,lab->lb", np.roll(u, self.shift, axis=0), P)
        self.S = self.heat * (1 - self.g) + self.weight * markov  # both: expected uses per step


class StateTable(ScoreTable):
    """(log2 count, log2 age) states shared by all layers; learns a target per state."""

    def __init__(self, horizon=8, discount_half_life=None, n_count=8, n_age=7, half_life=16.0):
        self.H, self.nc, self.na = horizon, n_count, n_age
        self.g = 2 ** (-1 / half_life)
        self.w = None if discount_half_life is None else 2 ** (-np.arange(horizon) / discount_half_life)

    def bind(self, n_layers, n_expert, n_slots):
        super().bind(n_layers, n_expert, n_slots)
        self.count = np.zeros((n_layers, n_expert))
        self.heat = np.zeros((n_layers, n_expert))
        self.last = np.full((n_layers, n_expert), -10 ** 6)
        self.t, self.states, self.useds = 0, [], []
        self.n = np.zeros(self.nc * self.na)
        self.v = np.zeros(self.nc * self.na)

    def observe(self, step, ids, hit_mask, used):
        self.t += 1
        self.count += used
        self.heat = self.heat * self.g + used
        self.last[used] = self.t
        self.useds.append(used)
        if len(self.useds) > self.H:
            state = self.states.pop(0).ravel()
            if self.w is None:  # used within the next H steps
                target = np.any(self.useds[1:1 + self.H], axis=0)
            else:               # discounted uses over the next H steps
                target = sum(w * u for w, u in zip(self.w, self.useds[1:1 + self.H]))
            self.useds.pop(0)
            self.n += np.bincount(state, minlength=self.n.size)
            self.v += np.bincount(state, weights=target.ravel(), minlength=self.n.size)
        state = log_bucket(self.count, self.nc) * self.na + log_bucket((self.t - self.last).astype(float), self.na)
        self.states.append(state)
        mean = (self.v.sum() + 1e-3) / (self.n.sum() + 1)
        value = (self.v + mean) / (self.n + 1)
        self.S = value[state] + 1e-3 * mean * self.heat / (1 + self.heat)  # heat breaks ties


class HeatMix(ScoreTable):
    def __init__(self, half_lives=(4, 16, 64), select=False, score_half_life=32.0, lag=2):
        self.g = np.array([2 ** (-1 / h) for h in half_lives])
        self.select, self.sg, self.lag = select, 2 ** (-1 / score_half_life), lag

    def bind(self, n_layers, n_expert, n_slots):
        super().bind(n_layers, n_expert, n_slots)
        self.heat = np.zeros((len(self.g), n_layers, n_expert))
        self.score = np.zeros((len(self.g), n_layers))
        self.hist = []

    def observe(self, step, ids, hit_mask, used):
        if len(self.hist) >= self.lag:
            self.score = self.score * self.sg + (self.hist.pop(0) * used[None]).sum(axis=2)
        self.heat = self.heat * self.g[:, None, None] + used[None]
        norm = self.heat / np.maximum(self.heat.sum(axis=2, keepdims=True), 1e-12)
        self.hist.append(norm)
        self.S = norm[self.score.argmax(axis=0), np.arange(self.n_layers)] if self.select else norm.mean(axis=0)


class HeatPrefetch(DecayedLfu):
    name = "heat-prefetch"
    admits = predicts = True

    def __init__(self, width=2):
        super().__init__(16.0)
        self.width = width

    def bind(self, n_layers, n_expert, n_slots):
        super().bind(n_layers, n_expert, n_slots)
        self.resident = np.zeros((n_layers, n_expert), dtype=bool)

    def admit(self, step, keys):
        return self.scaled.take(keys)

    def inserted(self, step, layers, experts, prefetch):
        self.resident[layers, experts] = True

    def evicted(self, step, layers, experts):
        self.resident[layers, experts] = False

    def predict(self, step):
        score = np.where(self.resident, -np.inf, self.scaled)
        top = np.argsort(-score, axis=1)[:, :self.width]
        return np.where(np.take_along_axis(score, top, axis=1) > 0, top, -1)


CANDIDATES = {
    "heat": lambda: make_policy("heat"),
    "markov-same": lambda: HeatMarkov(0.5, shift=0),
    "markov-prev": lambda: HeatMarkov(0.5, shift=1),
    "near-use": lambda: StateTable(horizon=8),
    "value": lambda: StateTable(horizon=16, discount_half_life=8.0),
    "hl-mix": lambda: HeatMix(),
    "hl-select": lambda: HeatMix(select=True),
    "prefetch": lambda: HeatPrefetch(),
}


def run(trace, slots, policy):
    """Decode hit% and uploads per layer per step."""
    result = simulate(trace, PER_LAYER, policy, slots, prefill="off")
    return 100 * result.hit_rate, result.totals["uploads"] / (result.decode_steps * trace.layers.size)


def row(label, trace, uploads):
    slots = trace.n_expert // 8
    lru = run(trace, slots, "lru")[0]
    best = run(trace, slots, "belady")[0]
    cells = []
    for name, factory in CANDIDATES.items():
        hit, up = run(trace, slots, factory())
        cells.append(f"{hit:.1f} ({100 * (hit - lru) / (best - lru):.0f}%" + (f", {up:.2f} up)" if uploads else ")"))
    print(f"| {label} | {lru:.1f} | {best:.1f} | " + " | ".join(cells) + " |", flush=True)


def first_use_bound(path):
    """Share of decode lookups that no policy without prefetch can hit: an expert's first
    use, and a use right after a first use (its upload is not published yet)."""
    trace = read_trace(path)
    obs = trace.decode_ids
    T, L, _ = obs.shape
    used = np.zeros((T, L, trace.n_expert), dtype=bool)
    for t in range(T):
        used[t, np.arange(L)[:, None], obs[t]] = True
    first = (np.cumsum(used, axis=0) == 1) & used
    lost = first.sum() + (used[1:] & first[:-1]).sum()
    print(f"{Path(path).name}: {used.any(axis=0).sum(axis=1).mean():.1f} distinct experts per layer "
          f"in decode; first uses {100 * first.sum() / used.sum():.1f}% of lookups; hit% bound "
          f"without prefetch {100 - 100 * lost / used.sum():.1f}")


def main():
    paths = sys.argv[1:] or [str(p) for p in SHIPPED_TRACES]
    for path in paths:
        first_use_bound(path)
    print("\ndecode hit% at K = n_expert/8, INSERTS=2 (gap closed[, uploads per layer per step])\n")
    print("| routing | lru | belady | " + " | ".join(CANDIDATES) + " |")
    print("|---|---:|---:|" + "---:|" * len(CANDIDATES))
    for path in paths:
        row(Path(path).name.split(".")[0], read_trace(path), True)
    for seed, (label, layers, experts, k, options) in enumerate(SYNTHETIC, start=3):
        routing = synthetic_routing(300, layers, experts, k, seed=seed, **options)
        row(label, RouteTrace.from_routing(routing, experts), False)


if __name__ == "__main__":
    main()
