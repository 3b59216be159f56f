"""The RAM tier's modelled decode (moecache.offline.readahead's timeline; without read-ahead it is
Disk.tier_token_ms) against the benchmark's measurements, and the two constants CALIBRATED to
them: the CPU's work on what the tier reads (the page-cache insert, the mapping, the unmap and the
release, on the cores the compute uses), which the timeline leaves out otherwise, per request
(Disk.read_cpu_ms_per_request: one expert tensor's range, read, mapped and released on its own)
and per MB (Disk.read_cpu_ms_per_mb).

MEASURED inputs (MEASURED; docs/notes/ram-read-ahead.md, "The first layer read ahead from the
token embeddings, drops off the compute thread": scripts/bench_larger_than_ram.py -r 5
--read-ahead both, 2 cores, both shapes the same day), per shape: the
live tier's trace of the benchmark's model and prompt at the K its auto sizing took inside the
limit (traces/), the in-RAM tier's decode tok/s (the host rate is the one that reproduces it: the
trace's computed bytes per decode token over that time), the best disk rate the run measured
(the roofline's), and the limited tier's decode tok/s, the layers' wait and the MB read per token
(its stats) with read-ahead (modelled by the `router` predictor, what ships, reading up to top-k) and without
(`none`).

fit() takes the constants >= 0 that minimise the sum of the squared relative residuals of the
modelled ms per decode token over every configuration (Gauss-Newton on the timeline, which is
linear in them without read-ahead and close to linear with it), and returns each configuration's
residual; fit(terms=ONE_TERM) fits the per-MB constant alone, as the model did before.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import numpy as np

from ..core.policies import DEFAULT_POLICY
from ..formats.traces import DECODE, READS, TRACES_DIR, RouteTrace, read_trace
from .cost import DISK_READ_US, Disk
from .readahead import ReadAhead
from .replay import ram_tier_replay, ram_tier_slots, simulate

MODES = {"on": "router", "off": "none"}  # read-ahead: the predictor standing for it
# the CPU's work on the tier's reads, Disk's fields: per request (one expert tensor's range) and per MB
TERMS = ("read_cpu_ms_per_request", "read_cpu_ms_per_mb")
ONE_TERM = ("read_cpu_ms_per_mb",)  # the model before the per-request term


@dataclass(frozen=True)
class Measured:
    """One shape's benchmark run: its inputs and, per read-ahead mode, the measured decode."""

    shape: str
    trace: str            # under traces/: the live tier's routing at the benchmark's K
    ram_mib: float        # a budget whose K is the one the benchmark's auto sizing took
    in_ram_tok_s: float   # the tier with the model in RAM
    disk_gbps: float      # the best rate the run measured
    o_direct_gbps: float  # its O_DIRECT 2 MiB reads with 4 threads
    tok_s: dict           # "on"/"off" -> the limited tier's decode tok/s (median of 5)
    wait_ms: dict         # "on"/"off" -> the layers' wait for their reads per decode token (its stats)
    read_mb: dict         # "on"/"off" -> MB it read per decode token (its stats)


MEASURED = (
    Measured("Qwen3-30B-A3B shape, 1600 MB", "synth-qwen3-30b-a3b-L8.ram-tier-1600mb.route.csv", 972,
             41.56, 1.56, 1.23, {"on": 36.83, "off": 32.04}, {"on": 1.0, "off": 6.5}, {"on": 15.2, "off": 14.8}),
    Measured("gpt-oss-20b shape, 2100 MB", "synth-gpt-oss-20b-L8.ram-tier-2100mb.route.csv", 1282,
             20.77, 1.71, 1.56, {"on": 15.73, "off": 13.57}, {"on": 10.1, "off": 21.1}, {"on": 56.9, "off": 55.0}),
)


@dataclass(frozen=True)
class Modelled:
    """One configuration modelled: MODELLED ms, wait ms and MB read per decode token, and the
    read-ahead's precision (None without)."""

    measured: Measured
    mode: str
    ms: float
    wait_ms: float
    read_mb: float
    precision: float | None

    @property
    def measured_ms(self) -> float:
        return 1e3 / self.measured.tok_s[self.mode]

    @property
    def residual(self) -> float:
        """(modelled - measured) / measured."""
        return self.ms / self.measured_ms - 1


def host_gbps(trace: RouteTrace, measured: Measured) -> float:
    """The CPU's rate that makes the in-RAM tier's decode (every expert kept) take its measured time."""
    run = simulate(trace, ram_tier_replay(DEFAULT_POLICY, trace.n_expert, "eager"))
    return run.work.compute_bytes() / run.decode_tokens * measured.in_ram_tok_s / 1e9


def model(trace: RouteTrace, measured: Measured, host: float, mode: str, read_cpu: dict) -> Modelled:
    """The limited tier's decode at the benchmark's K, one read-ahead mode, these CPU costs of the
    reads (Disk's fields named in TERMS; one left out is 0)."""
    disk = Disk(measured.disk_gbps, DISK_READ_US, **read_cpu)
    timeline = ReadAhead(MODES[mode], trace.n_expert_used, disk, host)
    simulate(trace, ram_tier_replay(DEFAULT_POLICY, ram_tier_slots(trace, measured.ram_mib), "eager", timeline))
    return Modelled(measured, mode, timeline.ms_per_token, timeline.wait_ms_per_token,
                    timeline.read_bytes / timeline.tokens / 1e6, timeline.precision)


def fit(configs=MEASURED, terms=TERMS, iterations: int = 8) -> tuple[dict, list[Modelled]]:
    """({term: its calibrated value}, every configuration modelled with them); terms=(): ({}, the
    model without the reads' CPU)."""
    inputs = [(m, trace, host_gbps(trace, m)) for m in configs for trace in [read_trace(str(TRACES_DIR / m.trace))]]

    def run(costs):
        return [model(trace, m, host, mode, costs) for m, trace, host in inputs for mode in MODES]

    costs = dict.fromkeys(terms, 0.0)
    rows = run(costs)
    steps = dict.fromkeys(terms, 1.0)  # the first secants' other ends
    for _ in range(iterations if terms else 0):
        # Gauss-Newton on the relative residuals r_i = ms_i / measured_i - 1, each term's slopes a secant
        jacobian = np.column_stack([_slopes(rows, run(costs | {t: costs[t] + steps[t]}), steps[t]) for t in terms])
        target = jacobian @ np.array(list(costs.values())) - np.array([r.residual for r in rows])
        new = dict(zip(terms, map(float, nonnegative_least_squares(jacobian, target))))
        moved = {t: abs(new[t] - costs[t]) for t in terms}
        if max(moved.values()) < 1e-6:
            break
        steps, costs = {t: max(moved[t], 1e-3) for t in terms}, new
        rows = run(costs)
    return costs, rows


def _slopes(rows: list[Modelled], moved: list[Modelled], step: float) -> np.ndarray:
    """Each configuration's relative residual per unit of the term moved by step."""
    return np.array([(b.ms - a.ms) / step / a.measured_ms for a, b in zip(rows, moved)])


def nonnegative_least_squares(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The x >= 0 minimising |a x - b|: the best of the least-squares solutions over each subset
    of the columns, the others 0, that have no negative value (exact for the few terms here)."""
    n = a.shape[1]
    best, best_loss = np.zeros(n), float(b @ b)
    for free in itertools.chain.from_iterable(itertools.combinations(range(n), k) for k in range(1, n + 1)):
        x = np.zeros(n)
        x[list(free)] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
        loss = float(np.sum((a @ x - b) ** 2))
        if (x >= 0).all() and loss < best_loss:
            best, best_loss = x, loss
    return best


def at_o_direct_rate(configs=MEASURED) -> tuple[Measured, ...]:
    """The configurations with the disk at its O_DIRECT rate rather than the best measured."""
    return tuple(replace(m, disk_gbps=m.o_direct_gbps) for m in configs)


def recorded_read_ahead(trace: RouteTrace) -> tuple[float, float]:
    """The live tier's read-ahead in decode, from its trace's reads: (recall: of the misses of
    layers 1..L-1, the share it had read ahead; precision: of what it read ahead, the share its
    layer selected)."""
    if trace.reads is None:
        raise ValueError("the trace records no reads (the live RAM tier's traces do since libllama series 18)")
    decode = trace.phase == DECODE
    reads = {name: trace.reads[decode][..., i] for i, name in enumerate(READS)}
    missed = (trace.residency[decode] == 0) & (trace.ids[decode] >= 0)
    used = int(reads["read_ahead_used"].sum())  # layer 0 is never read ahead
    return used / int(missed[:, 1:].sum()), used / int(reads["read_ahead"].sum())
