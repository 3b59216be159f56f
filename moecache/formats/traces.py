"""Routing traces: RouteTrace, a trace as the replay and the live recorder see it (dense arrays,
one entry per step), and read_trace, which reads any trace format, told by its first line (the
reader registry): the route_trace v1 CSV, the interchange format (moecache.formats.csv_trace;
moecache.formats.trace_writer writes it as a run goes), and its compact binary form, which long
recordings replay from (moecache.formats.binary_trace).
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np

PREFILL, DECODE = 0, 1

# The RAM tier's reads of one layer in one batch (a ubatch), as a live trace of the tier records
# them (the stats' names, moecache.live.native.READ_COUNTERS): experts read ahead (predicted), of
# them selected, the bytes they took from the file, those of the ones not selected (wasted), and
# every byte read (read ahead or on demand)
READS = ("read_ahead", "read_ahead_used", "read_ahead_bytes", "read_ahead_wasted_bytes", "read_bytes")

# The real traces the repository ships (traces/README.md: source, licence): the one place that
# knows where they are.
TRACES_DIR = Path(__file__).resolve().parents[2] / "traces"
SHIPPED_TRACES = (TRACES_DIR / "qwen3-30b-a3b.route.csv", TRACES_DIR / "gpt-oss-120b.route.csv")


class TraceError(ValueError):
    """Malformed trace; the message starts with `file:line:` when a line is to blame."""


@dataclass(eq=False)  # compared (and hashed) by identity: the replay memoises per trace
class RouteTrace:
    """A parsed trace as dense arrays, one entry per step (token) in (turn, step) order.

    `layers` are the model's MoE layer numbers; array axis 1 indexes into it. A prefill token
    is one step here too (phase PREFILL); consumers decide how to batch prefill.
    """

    path: str
    model: str
    arch: str
    n_layer: int
    n_expert: int
    n_expert_used: int
    layers: np.ndarray          # (n_layers,) model layer numbers, ascending
    expert_bytes: np.ndarray    # (n_layers,) bytes of one expert of that layer
    dense_bytes: np.ndarray     # (n_layers,)
    turn: np.ndarray            # (n_steps,)
    step: np.ndarray            # (n_steps,)
    phase: np.ndarray           # (n_steps,) PREFILL or DECODE
    ids: np.ndarray             # (n_steps, n_layers, k) int32 expert ids by router rank, -1 = layer not run
    weights: np.ndarray         # (n_steps, n_layers, k) float32 router weights
    residency: np.ndarray       # (n_steps, n_layers, k) int8 recorded outcome
    dropped: np.ndarray         # (n_steps, n_layers, k) bool; all False if the column is absent
    batch: np.ndarray | None = None  # (n_steps,) the observation (ubatch) of each step; -1 (the
                                     # default) when not recorded: every step its own
    reads: np.ndarray | None = None  # (n_steps, n_layers, len(READS)) int64: the RAM tier's reads of
                                     # a layer in a batch, on the batch's first step that ran the
                                     # layer (0 on the others); None when not recorded
    pages: mmap.mmap | None = None   # the file the arrays map (moecache.formats.binary_trace), if any

    def __post_init__(self):
        if self.batch is None:
            self.batch = np.full(len(self.step), -1, dtype=np.int64)

    def drop_pages(self) -> None:
        """A mapped trace's pages leave this process (the kernel keeps them cached and maps
        them again when touched): what a replay calls as it walks the trace, so that its memory
        stays a window's, however long the trace. Nothing for arrays in memory."""
        if self.pages is not None and hasattr(mmap, "MADV_DONTNEED"):
            self.pages.madvise(mmap.MADV_DONTNEED)

    @property
    def decode_ids(self) -> np.ndarray:
        return self.ids[self.phase == DECODE]

    def working_set_bytes(self) -> int:
        """Bytes one token touches: sum over layers of top-k x expert size."""
        return int(self.expert_bytes.sum()) * self.n_expert_used

    def select(self, steps) -> "RouteTrace":
        """The trace of these steps only (an index or mask over steps, in trace order)."""
        per_step = ("turn", "step", "phase", "ids", "weights", "residency", "dropped", "batch", "reads")
        return replace(self, **{name: getattr(self, name)[steps] for name in per_step
                                if getattr(self, name) is not None})

    def layer(self, i: int) -> "RouteTrace":
        """The trace of its i-th MoE layer only (array axis 1)."""
        per_layer = ("layers", "expert_bytes", "dense_bytes")
        per_step = ("ids", "weights", "residency", "dropped", "reads")
        return replace(self, pages=None, **{name: getattr(self, name)[i:i + 1] for name in per_layer},
                       **{name: getattr(self, name)[:, i:i + 1] for name in per_step
                          if getattr(self, name) is not None})

    @classmethod
    def from_routing(cls, ids, n_expert: int, *, expert_bytes=None, name: str = "routing") -> "RouteTrace":
        """Decode routing (n_steps, n_layers, k), e.g. synthetic_routing(), as a one-turn trace
        of decode steps; expert_bytes per layer (default 1: byte figures count experts)."""
        ids = np.asarray(ids, dtype=np.int32)
        if ids.ndim != 3 or ids.shape[1] < 1 or ids.shape[2] < 1:
            raise ValueError(f"routing must be (n_steps, n_layers, k), got shape {ids.shape}")
        if ids.size and (ids.min() < -1 or ids.max() >= n_expert):
            raise ValueError(f"routing expert ids must be in [-1, {n_expert})")
        n_steps, n_layers, k = ids.shape
        sizes = np.ones(n_layers, dtype=np.int64) if expert_bytes is None else \
            np.asarray(expert_bytes, dtype=np.int64)
        return cls(path=name, model=name, arch=name, n_layer=n_layers, n_expert=n_expert,
                   n_expert_used=k, layers=np.arange(n_layers), expert_bytes=sizes,
                   dense_bytes=np.zeros(n_layers, dtype=np.int64),
                   turn=np.zeros(n_steps, dtype=np.int64), step=np.arange(n_steps),
                   phase=np.full(n_steps, DECODE, dtype=np.int8), ids=ids,
                   weights=np.zeros(ids.shape, dtype=np.float32),
                   residency=np.zeros(ids.shape, dtype=np.int8), dropped=np.zeros(ids.shape, dtype=bool))


# Bounds on what a trace may declare: far above any real model, low enough that the arrays
# sized by them fit in memory and every derived integer fits in int64.
MAX_LAYERS = 4096
MAX_EXPERTS = 65536
MAX_INDEX = 2**31 - 1          # turn, step and batch numbers
MAX_EXPERT_BYTES = 2**40
MAX_READ = 2**46               # each of READS in a row: a sum over any layer's ranks fits in int64
MAX_LINE = 1 << 16            # characters in a format's first line, and in a CSV preamble line
WINDOW_STEPS = 4096           # steps a check or a replay takes at a time (temporaries, mapped pages)


# --- reader registry -------------------------------------------------------------------

@dataclass(frozen=True)
class TraceReader:
    name: str
    sniff: Callable[[bytes], bool]    # first line of the file, without its line end -> is it this format?
    read: Callable[[str], RouteTrace]


READERS: dict[str, TraceReader] = {}


def register_reader(reader: TraceReader) -> None:
    READERS[reader.name] = reader


def read_trace(path: str, fmt: str | None = None) -> RouteTrace:
    """Read a trace, by explicit format name or by sniffing its first line."""
    if fmt is not None:
        if fmt not in READERS:
            raise TraceError(f"unknown trace format {fmt!r}; known: {', '.join(sorted(READERS))}")
        return READERS[fmt].read(path)
    try:
        with open(path, "rb") as f:
            first = (f.readline(MAX_LINE + 1).splitlines() or [b""])[0]  # \r, \n or \r\n, as text reads
    except OSError as e:
        raise TraceError(f"{path}: {e.strerror}") from None
    for reader in READERS.values():
        if reader.sniff(first):
            return reader.read(path)
    try:
        first.decode("utf-8")
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not UTF-8 text") from None
    raise TraceError(f"{path}:1: unrecognised trace format (known: {', '.join(sorted(READERS))})")


def synthetic_routing(n_steps: int, n_layers: int, n_expert: int, k: int, *, skew: float = 1.0,
                      stickiness: float = 1.5, drift: float = 0.05, seed: int = 0) -> np.ndarray:
    """Random routing with the locality real decode shows, as (n_steps, n_layers, k) int32.

    Each layer draws its top-k by Gumbel-top-k over log-popularities: a Zipf(skew) profile in
    a random order, random-walking by `drift` per step, plus `stickiness` for the experts the
    previous step chose (consecutive tokens share experts). skew=0, stickiness=0 is uniform.
    """
    rng = np.random.default_rng(seed)
    zipf = -skew * np.log(np.arange(1, n_expert + 1))
    log_pop = np.stack([rng.permutation(zipf) for _ in range(n_layers)])
    out = np.empty((n_steps, n_layers, k), dtype=np.int32)
    previous = np.zeros((n_layers, n_expert))
    rows = np.arange(n_layers)[:, None]
    for t in range(n_steps):
        log_pop += drift * rng.standard_normal(log_pop.shape)
        score = log_pop + previous + rng.gumbel(size=log_pop.shape)
        top = np.argpartition(-score, k - 1, axis=1)[:, :k]
        out[t] = np.take_along_axis(top, np.argsort(-score[rows, top], axis=1), axis=1)
        previous = np.zeros_like(previous)
        previous[rows, top] = stickiness
    return out


# Each format registers its reader; they import this module, so they come last.
from . import binary_trace, csv_trace  # noqa: E402,F401
