"""The RAM tier's modelled decode (moecache.offline.readahead's timeline; without read-ahead it is
Disk.tier_token_ms) against the benchmark's measurements, and the one constant CALIBRATED to them:
the CPU's work per MB the tier reads (Disk.read_cpu_ms_per_mb: the page-cache insert, the mapping,
the unmap and the release of what it read, on the cores the compute uses), which the timeline
leaves out otherwise.

MEASURED inputs (MEASURED; docs/notes/ram-read-ahead.md, "On a quieter machine, the default
threads ...": scripts/bench_larger_than_ram.py -r 5 --read-ahead both, 2 cores), per shape: the
live tier's trace of the benchmark's model and prompt at the K its auto sizing took inside the
limit (traces/), the in-RAM tier's decode tok/s (the host rate is the one that reproduces it: the
trace's computed bytes per decode token over that time), the best disk rate the run measured
(the roofline's), and the limited tier's decode tok/s and the layers' wait per token (its stats)
with read-ahead (modelled by the `router` predictor, what ships, reading up to top-k) and without
(`none`).

fit() takes the constant that minimises the sum of the squared relative residuals of the modelled
ms per decode token over every configuration (Gauss-Newton on the timeline, which is linear in it
without read-ahead and close to linear with it), and returns each configuration's residual.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..core.policies import DEFAULT_POLICY
from ..formats.traces import DECODE, READS, TRACES_DIR, RouteTrace, read_trace
from .cost import DISK_READ_US, Disk
from .readahead import ReadAhead
from .replay import ram_tier_replay, ram_tier_slots, simulate

MODES = {"on": "router", "off": "none"}  # read-ahead: the predictor standing for it


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
             32.49, 1.13, 0.94, {"on": 20.82, "off": 18.62}, {"on": 5.9, "off": 12.7}, {"on": 26.4, "off": 25.6}),
    Measured("gpt-oss-20b shape, 2100 MB", "synth-gpt-oss-20b-L8.ram-tier-2100mb.route.csv", 1282,
             16.57, 1.08, 1.01, {"on": 9.82, "off": 6.65}, {"on": 21.5, "off": 59.6}, {"on": 98.8, "off": 94.2}),
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


def model(trace: RouteTrace, measured: Measured, host: float, mode: str, read_cpu_ms_per_mb: float) -> Modelled:
    """The limited tier's decode at the benchmark's K, one read-ahead mode, this CPU cost."""
    disk = Disk(measured.disk_gbps, DISK_READ_US, read_cpu_ms_per_mb)
    timeline = ReadAhead(MODES[mode], trace.n_expert_used, disk, host)
    simulate(trace, ram_tier_replay(DEFAULT_POLICY, ram_tier_slots(trace, measured.ram_mib), "eager", timeline))
    return Modelled(measured, mode, timeline.ms_per_token, timeline.wait_ms_per_token,
                    timeline.read_bytes / timeline.tokens / 1e6, timeline.precision)


def fit(configs=MEASURED, iterations: int = 8) -> tuple[float, list[Modelled]]:
    """(the calibrated ms of CPU per MB read, every configuration modelled with it); iterations=0:
    (0, the model without it)."""
    inputs = [(m, trace, host_gbps(trace, m)) for m in configs for trace in [read_trace(str(TRACES_DIR / m.trace))]]

    def run(c):
        return [model(trace, m, host, mode, c) for m, trace, host in inputs for mode in MODES]

    c, rows = 0.0, run(0.0)
    step = 1.0  # ms/MB: the first secant's other end
    for _ in range(iterations):
        moved = run(c + step)
        slopes = [(b.ms - a.ms) / step for a, b in zip(rows, moved)]
        # Gauss-Newton on the relative residuals r_i = ms_i / measured_i - 1
        gradient = sum(s / r.measured_ms * r.residual for s, r in zip(slopes, rows))
        curvature = sum((s / r.measured_ms) ** 2 for s, r in zip(slopes, rows))
        new = max(0.0, c - gradient / curvature)
        if abs(new - c) < 1e-6:
            break
        step, c = max(abs(new - c), 1e-3), new
        rows = run(c)
    return c, rows


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
