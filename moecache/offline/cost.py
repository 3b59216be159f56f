"""Modelled milliseconds per decode token: a replay's routing read as decode time, one layer
at a time. MODELLED, never measured; docs/cost-model.md ("Modelled cost") states the formulas,
the hardware classes and what only a GPU can confirm.

The layer formula is moecache.core.missplan.Rates.layer_ms (the live planner's too): per
layer the router on the device, the ids' trip to the host, the CPU's misses and the lane's
copies sharing host memory, the device's experts, the CPU's result returning. Stock
--cpu-moe, upstream llama.cpp's cache and ours differ only in where each expert runs and in
their Layout (moecache.core.missplan). A replay tallies its decode layer passes (`WorkTally`);
a token is

    max(sum of its layers' times,
        (lane + async upload bytes) / link,             the link carries the asynchronous
        (cpu + lane + async upload bytes) / dram)       uploads in the time it is idle, host
                                                        memory serves them in its spare time

averaged over the run's decode tokens (the uploads are background work: they fit where the
link and host memory have room, over the run, not token by token).

Models larger than RAM (the RAM tier and stock mmap's page cache, CPU only) are timed by `Disk`.
Stock mmap's page cache (`Disk.token_ms`): a token is

    (computed bytes / host  +  waits x read_us  +  read bytes / disk) / tokens

every selected expert and each layer's dense bytes computed on the CPU at the host rate, each
fault waiting alone for one request's latency, and every byte read from the file (readahead
included) at the disk's rate for large requests: nothing overlaps, a fault stops the thread.
The RAM tier (`Disk.tier_token_ms`) reads a layer's misses at once at queue depth while the CPU
computes the layer's experts kept in memory, then computes the misses: per layer pass

    dense / host  +  max(kept / host, read_us + misses / disk)  +  misses / host

(no read, no wait, where the layer missed nothing), and the uploads issued at a boundary read
after the token at the disk's rate, the CPU waiting. Each read also costs the CPU (CALIBRATED, not
derived: the page-cache insert, the mapping, the unmap and the release of what it read, work on
the cores the compute uses) `read_cpu_ms_per_request` per request and `read_cpu_ms_per_mb` per MB,
added to its layer pass after the layer's experts, beside no compute:

    ...  +  read_cpu_per_request x PARTS x (misses + boundary uploads)
         +  read_cpu_per_mb x bytes of (misses + boundary uploads)

A request is one expert tensor's range, which the tier reads, maps and releases on its own
(readahead(2), MADV_POPULATE_READ, MADV_DONTNEED, POSIX_FADV_DONTNEED: llama-moe-file.cpp); it
reads an expert's weight tensors, not its biases. Every byte is charged, whatever its page: the
tier reads the whole huge pages inside a range as large folios, which halves the reader's own CPU
per MB, but most of what the reads cost the decode is not the reader's (a profile put the compute
thread's own kernels about 10% slower beside them), and on same-day runs of both shapes a charge
for the small pages alone left the gpt-oss shape's modelled decode 8% under the measured, where
one on every byte fitted both within 3% (docs/notes/ram-read-ahead.md, "The model refitted to the
build that ships").
A trace does not record how many requests there are: an expert is PARTS of them, the page-cache
model's layout (gate, up, down: both calibration shapes'; a model with fused gate_up has 2, and
is charged one request too many).
(moecache.offline.calibration fits both constants to the benchmark's measurements; 0 leaves
them out.)

The rates are a hardware class's (moecache.core.hardware.HARDWARE), whose figures and
assumptions are stated there.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from ..core.missplan import STOCK_LAYOUT, Layout, Rates
from .pagecache import PARTS


DISK_READ_US = 40.0  # ASSUMED: a 4 KiB read at queue depth 1 (measured 40 us on the benchmarks' virtual disk)


@dataclass(frozen=True)
class Disk:
    """The disk a model larger than RAM is read from: its rate for large requests (GB/s), the
    latency of one request (us; a 4 KiB read at queue depth 1 takes about that) and the CPU's
    work on what the RAM tier reads, ms per MB (10^6 bytes) and ms per request (module
    docstring)."""

    gbps: float
    read_us: float
    read_cpu_ms_per_mb: float = 0.0
    read_cpu_ms_per_request: float = 0.0

    def __post_init__(self):
        costs = (self.read_cpu_ms_per_mb, self.read_cpu_ms_per_request)
        if not (math.isfinite(self.gbps) and self.gbps > 0 and math.isfinite(self.read_us) and self.read_us >= 0
                and all(math.isfinite(c) and c >= 0 for c in costs)):
            raise ValueError(f"a disk needs a finite rate > 0, a latency >= 0 and CPU costs >= 0, got "
                             f"{self.gbps} GB/s, {self.read_us} us, {self.read_cpu_ms_per_mb} ms/MB, "
                             f"{self.read_cpu_ms_per_request} ms/request")

    def read_cpu_ms(self, n_bytes: float, n_experts: float) -> float:
        """The CPU's work on reading n_experts experts of n_bytes in all, ms (module docstring)."""
        return n_bytes * self.read_cpu_ms_per_mb / 1e6 + n_experts * PARTS * self.read_cpu_ms_per_request

    def describe(self) -> str:
        cpu = [f"{c:g} ms {unit}" for c, unit in ((self.read_cpu_ms_per_mb, "per MB"),
                                                  (self.read_cpu_ms_per_request, f"per request ({PARTS} an expert)"))
               if c]
        return f"disk {self.gbps:g} GB/s, {self.read_us:g} us a request" + (
            f", the tier's reads cost the CPU {' + '.join(cpu)}" if cpu else "")

    def token_ms(self, host_gbps: float, compute_bytes: float, read_bytes: float, waits: int, tokens: int) -> float:
        """Modelled milliseconds per token of stock mmap's page cache (module docstring)."""
        return (compute_bytes / (host_gbps * 1e6) + waits * self.read_us / 1e3
                + read_bytes / (self.gbps * 1e6)) / tokens

    def tier_token_ms(self, host_gbps: float, work: "WorkTally", tokens: int) -> float:
        """Modelled milliseconds per token of the RAM tier's layer passes (module docstring)."""
        host, disk = host_gbps * 1e6, self.gbps * 1e6  # bytes per ms
        uploads = work.boundary_upload_bytes
        total = uploads / disk + self.read_cpu_ms(uploads, int(work.boundary_uploads.sum()))
        for (layer, hits, lane, cpu), passes in work.passes.items():
            size, misses = work.expert_bytes[layer], lane + cpu
            read = self.read_us / 1e3 + misses * size / disk if misses else 0.0
            total += passes * (work.dense_bytes[layer] / host + max(hits * size / host, read)
                               + misses * size / host + self.read_cpu_ms(misses * size, misses))
        return total / tokens


class WorkTally:
    """A replay's decode layer passes for the timeline: how often each layer ran with how many
    experts computed on the device from slots (hits), copied through the lane, and on the CPU,
    and the bytes uploaded asynchronously. Counted by kind, so its size does not grow with the
    trace."""

    def __init__(self, layout: Layout, expert_bytes, dense_bytes=None):
        self.layout = layout
        self.expert_bytes = [int(b) for b in expert_bytes]
        self.dense_bytes = [0] * len(self.expert_bytes) if dense_bytes is None else [int(b) for b in dense_bytes]
        self.passes: Counter = Counter()  # (layer, hits, lane, cpu) -> layer passes
        self.async_uploads = np.zeros(len(self.expert_bytes), dtype=np.int64)  # per layer
        self.boundary_uploads = np.zeros(len(self.expert_bytes), dtype=np.int64)  # of those, issued at a boundary

    def add(self, layer: int, hits: int, lane: int, cpu: int) -> None:
        self.passes[(layer, hits, lane, cpu)] += 1

    def add_layers(self, hits, lane, cpu) -> None:
        """One pass of every layer: (L,) counts each."""
        self.passes.update(zip(range(len(self.expert_bytes)), np.asarray(hits).tolist(),
                               np.asarray(lane).tolist(), np.asarray(cpu).tolist()))

    def add_async(self, counts) -> None:
        """Asynchronous uploads: (L,) counts."""
        self.async_uploads += counts

    def add_boundary_uploads(self, counts) -> None:
        """Uploads issued at a boundary: (L,) counts (the RAM tier reads each from the file)."""
        self.boundary_uploads += counts

    @property
    def async_bytes(self) -> int:
        return self._bytes(self.async_uploads)

    @property
    def boundary_upload_bytes(self) -> int:
        return self._bytes(self.boundary_uploads)

    def _bytes(self, counts) -> int:
        """(L,) expert counts in bytes (exact: Python integers)."""
        return sum(n * size for n, size in zip(counts.tolist(), self.expert_bytes))

    def token_ms(self, rates: Rates, tokens: int) -> float:
        """Modelled milliseconds per decode token of the tallied work at these rates (module
        docstring)."""
        terms = self.breakdown(rates, tokens)
        return max(terms["layers"], terms["link"], terms["dram"])

    def breakdown(self, rates: Rates, tokens: int) -> dict[str, float]:
        """The terms of token_ms per decode token: "layers" (the sum of the layers' times), of
        which "router", "window" (the ids' trips and the host's reads and copies beside each
        other), "cpu reads" and "lane copies" (each alone), "joins" and "device" (the experts
        computed there); "link" and "dram", the run's bytes over them; and the experts per token
        on the device from slots ("hits"), through the lane ("lane") and on the CPU ("cpu")."""
        r = rates
        terms = dict.fromkeys(("layers", "router", "window", "cpu reads", "lane copies", "joins", "device",
                               "hits", "lane", "cpu"), 0.0)
        lane_bytes = cpu_bytes = 0.0
        for (layer, hits, lane, cpu), passes in self.passes.items():
            size, dense = self.expert_bytes[layer], self.dense_bytes[layer]
            terms["layers"] += passes * r.layer_ms(self.layout, size, dense, hits, lane, cpu)
            terms["router"] += passes * r.transfer_ms(dense, r.device_gbps)
            terms["window"] += passes * (r.ids_trip_us / 1e3 + r.host_ms(cpu * size, lane * size))
            terms["cpu reads"] += passes * r.transfer_ms(cpu * size, r.host_gbps)
            terms["lane copies"] += passes * r.transfer_ms(lane * size, r.link_gbps)
            terms["joins"] += passes * r.join_us / 1e3 * (self.layout.host_node or cpu > 0)
            terms["device"] += passes * r.transfer_ms((hits + lane) * size, r.device_gbps)
            for name, count in (("hits", hits), ("lane", lane), ("cpu", cpu)):
                terms[name] += passes * count
            lane_bytes += passes * lane * size
            cpu_bytes += passes * cpu * size
        terms["link"] = (lane_bytes + self.async_bytes) / (r.link_gbps * 1e6)
        terms["dram"] = (cpu_bytes + lane_bytes + self.async_bytes) / (r.dram_gbps * 1e6)
        return {name: float(value) / tokens for name, value in terms.items()}

    def compute_bytes(self) -> int:
        """The bytes every layer pass computes: its selected experts and its dense weights."""
        return sum(passes * ((hits + lane + cpu) * self.expert_bytes[layer] + self.dense_bytes[layer])
                   for (layer, hits, lane, cpu), passes in self.passes.items())

    def as_stock(self) -> "WorkTally":
        """The same layer passes run by stock --cpu-moe: every selected expert on the CPU."""
        stock = WorkTally(STOCK_LAYOUT, self.expert_bytes, self.dense_bytes)
        for (layer, hits, lane, cpu), passes in self.passes.items():
            stock.passes[(layer, 0, 0, hits + lane + cpu)] += passes
        return stock
