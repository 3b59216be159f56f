"""The device cache's decode on a GPU against one line, and what the planner's margin would buy
through it.

MEASURED inputs (docs/benchmarks.md, "On a GPU: one H200, the first GPU check":
scripts/bench_decode.py -n 128 -r 5 -t 16 --slots 0,8,16,32,64 --planner-off on the full
qwen3-30b-a3b synthetic model), per cache row: decode tok/s (median of 5), decode hit rate and
uploads per token. fit() takes the least-squares line

    ms per decode token = fixed + host x miss rate + per_upload x uploads per token

over those rows (host: the CPU's expert reads of a token with every lookup a miss; per_upload:
what one upload costs the decode, which the time model of moecache.offline.cost leaves out where
the link is idle). planned_at() replays a recorded trace as LLAMA_MOE_CACHE_SLOTS=K runs it
(replay.zero_configuration) with the planner at another link rate, which moves its payback
margin, and puts the replay's hit rate and uploads through the line: MODELLED, an extrapolation
below the uploads per token the rows measured (8 to 41).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..core.hardware import HARDWARE
from ..formats.traces import RouteTrace
from .replay import zero_configuration


@dataclass(frozen=True)
class GpuRow:
    config: str
    tok_s: float
    hit_rate: float
    uploads_per_token: float

    @property
    def ms(self) -> float:
        return 1000 / self.tok_s


H200_STOCK_TOK_S = 36.17
H200_ROWS = (
    GpuRow("K=64", 62.06, 0.9068, 8.31), GpuRow("planner off K=64", 38.34, 0.9129, 28.30),
    GpuRow("K=32", 45.41, 0.7128, 13.54), GpuRow("planner off K=32", 28.51, 0.7467, 41.16),
    GpuRow("K=16", 39.45, 0.5558, 17.18), GpuRow("planner off K=16", 30.14, 0.5685, 31.74),
    GpuRow("K=8", 33.20, 0.3786, 17.98), GpuRow("planner off K=8", 33.02, 0.3794, 21.04),
)
# the rates the planner measured at attach in those runs (medians of the rows' notes)
H200_RATES = replace(HARDWARE["pcie4-x16"].rates, link_gbps=10.5, host_gbps=69, dram_gbps=71.7, ids_trip_us=14)


@dataclass(frozen=True)
class Line:
    fixed_ms: float
    host_ms: float
    per_upload_ms: float

    def ms(self, hit_rate: float, uploads_per_token: float) -> float:
        return self.fixed_ms + self.host_ms * (1 - hit_rate) + self.per_upload_ms * uploads_per_token


def fit(rows=H200_ROWS) -> tuple[Line, list[float]]:
    """The least-squares line over rows, and each row's relative residual (modelled / measured - 1)."""
    a = np.array([[1.0, 1 - r.hit_rate, r.uploads_per_token] for r in rows])
    line = Line(*np.linalg.lstsq(a, np.array([r.ms for r in rows]), rcond=None)[0])
    return line, [line.ms(r.hit_rate, r.uploads_per_token) / r.ms - 1 for r in rows]


def planned_at(trace: RouteTrace, slots: int, link_gbps: float, rates=H200_RATES) -> tuple[float, float]:
    """The decode hit rate and uploads per token of the shipped default at K=slots, its planner
    pricing uploads at link_gbps."""
    result = zero_configuration(trace, slots, replace(rates, link_gbps=link_gbps))
    return result.hit_rate, result.totals["uploads"] / result.decode_tokens
