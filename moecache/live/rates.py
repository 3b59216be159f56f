"""The live miss planner's rates (issue 22; moecache.core.missplan): the link's and the host's,
given (LLAMA_MOE_CACHE_LINK_GBPS, LLAMA_MOE_CACHE_HOST_GBPS) or measured at attach, the others
from the hardware class whose link is nearest (moecache.core.hardware.HARDWARE).

With them the planner sets, per layer, how many of a graph's misses take the copy-on-miss lane
(copied at once and computed on the device; Rates.lane_split over the layer's time) and what the
other eager uploads must pay back: a worth above the victim's by PAYBACK = min(host + link,
dram) / min(link, dram) uses (moecache.core.missplan.Rates.payback_uses).

What is measured, and its limits:
- link: COPIES timed uploads of one cached expert's bytes (the first cached layer's) into a buffer
  made on the slots' device, from one thread, as libllama's upload worker makes them: where the
  layer's slots are read from the model file (repacked experts), the expert read from the file
  into the staging memory (the device's pinned host memory where it has any) and copied from
  there by ggml_backend_tensor_set; else copied from pageable host memory. The median upload.
  On one H200 each upload cost the decode about what the whole upload takes, not the copy alone
  (docs/benchmarks.md, "On a GPU: one H200, the first GPU check"). Not in it: uploads running
  beside the CPU's reads (the model's dram term). With it, printed for calibration and not
  planned with: the copies alone from pageable memory and from the device's pinned host memory
  (where it has any), and a layer's ids' trip (IDS_BYTES read back from the device).
- host: a timed read, by every core at once, of up to HOST_READ_BYTES of the first cached
  layer's expert bytes, copied from the model file into memory: host memory's read rate as the
  CPU's expert kernels could see it at best (they also dequantize and multiply: an upper bound
  of their rate); bytes that fit the CPU's caches (a small model) measure the caches.
- dram (host memory's rate shared by the CPU and the DMA engine) is the class's whose link is
  nearest the copies' rate (the copies alone where link is the uploads read from a file), at
  least the measured host rate; device, ids trip and join are that class's.
Not refreshed from the live step's timings: the engine's model of libllama's admissions must
not depend on timing noise (LLAMA_MOE_CACHE_WAIT=1 checks them equal, and a replay at the
stats' rates reproduces them).
"""

from __future__ import annotations

import ctypes
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace

import numpy as np

from ..core.hardware import nearest_link
from ..core.missplan import Rates
from . import ggml
from .config import ENV_PREFIX, CacheConfig, ConfigError
from .probe import BANKED_TENSORS, CachedLayer, Devices, split_files

COPIES = 5                   # timed link copies (after one that warms the buffer)
HOST_READ_BYTES = 128 << 20  # larger than the CPU's caches on most machines
HOST_READS = 3               # timed reads of those bytes: the fastest counts (the least disturbed)


@dataclass(frozen=True)
class PlannerRates:
    """The rates the live planner uses, and where each came from."""

    rates: Rates
    hardware: str       # the class the other rates come from
    link_source: str
    host_source: str
    # measured with the link, printed for calibration and not planned with (None: not measured):
    # the same copies from pinned memory (None too where the device has no pinned host memory),
    # and a layer's ids' trip back to the host (the class's ids_trip_us is what the plan uses)
    link_pinned_gbps: float | None = None
    ids_trip_measured_us: float | None = None
    link_copy_gbps: float | None = None  # the copies alone from pageable memory, where link is the uploads'

    @property
    def payback_uses(self) -> float:
        return self.rates.payback_uses

    def line(self) -> str:
        r = self.rates
        return (f"moecache: miss planner: link {r.link_gbps:.3g} GB/s ({self.link_source}), host "
                f"{r.host_gbps:.3g} GB/s ({self.host_source}), dram {r.dram_gbps:.3g} GB/s ({self.hardware}'s, "
                f"the class nearest the link); an eager upload must pay back {r.payback_uses:.2f} uses"
                + ("" if self.ids_trip_measured_us is None else
                   "; measured, not planned with: "
                   + ("" if self.link_copy_gbps is None else f"copies alone {self.link_copy_gbps:.3g} GB/s, ")
                   + f"pinned copies {_shown(self.link_pinned_gbps)} GB/s, ids trip "
                   f"{self.ids_trip_measured_us:.0f} us (the class's {r.ids_trip_us:.0f} us)"))

    def to_json(self) -> dict:
        return {**asdict(self.rates), "payback_uses": self.payback_uses, "hardware": self.hardware,
                "link_source": self.link_source, "host_source": self.host_source,
                "link_pinned_gbps": self.link_pinned_gbps, "ids_trip_measured_us": self.ids_trip_measured_us,
                "link_copy_gbps": self.link_copy_gbps}


def _shown(gbps: float | None) -> str:
    return "n/a" if gbps is None else f"{gbps:.3g}"


def planner_rates(config: CacheConfig, layers: list[CachedLayer], model_path: str | None) -> PlannerRates:
    """The planner's rates for a cache of these layers: config's, or measured (module docstring)."""
    layer = layers[0]
    data, what, tensors = None, f"layer {layer.il}'s experts", []
    if not (config.link_gbps and config.host_gbps):
        tensors = _banked_tensors(model_path, layer)
        data = _layer_bytes(tensors, HOST_READ_BYTES)
        if data is None:
            data, what = np.zeros(layer.expert_bytes, dtype=np.uint8), "no model file: a buffer of one expert's size"
    measured = {}
    if config.link_gbps:
        link, link_source = config.link_gbps, f"{ENV_PREFIX}LINK_GBPS"
    else:
        with _expert_reader(tensors[0] if layer.from_file and tensors else None) as read_into:
            link, measured = _link_gbps(layer, np.resize(data, layer.expert_bytes), read_into)
        how = (f"uploads of {layer.expert_bytes} bytes ({what}) to {layer.device}, each read from the model file, "
               "then copied") if read_into else f"copies of {layer.expert_bytes} bytes ({what}) to {layer.device}"
        link_source = f"measured: median of {COPIES} {how}"
    if config.host_gbps:
        host, host_source = config.host_gbps, f"{ENV_PREFIX}HOST_GBPS"
    else:
        threads = os.cpu_count() or 1
        host = _read_gbps(data, threads)
        host_source = f"measured: {data.nbytes} bytes ({what}) read by {threads} threads"
    # the class of the machine's link: the copies' rate (uploads read from a file are slower than the link)
    nearest = nearest_link(measured.get("link_copy_gbps") or link)
    rates = replace(nearest.rates, link_gbps=link, host_gbps=host, dram_gbps=max(nearest.rates.dram_gbps, host))
    return PlannerRates(rates, nearest.name, link_source, host_source, **measured)


def _banked_tensors(path: str | None, layer: CachedLayer) -> list[tuple[str, int, int]]:
    """(file, offset, bytes) of each of the layer's banked expert tensors in the model's files;
    none without a readable file."""
    if not path:
        return []
    try:
        import gguf

        names = {f"blk.{layer.il}.{name}" for name in BANKED_TENSORS}
        return [(part, int(t.data_offset), int(t.n_bytes))
                for part in split_files(path) for t in gguf.GGUFReader(part).tensors if t.name in names]
    except Exception:  # noqa: BLE001 - gguf-py may not read what llama.cpp did (a newer type)
        return []


def _layer_bytes(tensors: list[tuple[str, int, int]], limit: int) -> np.ndarray | None:
    """Up to `limit` bytes of those tensors, copied from the model file into memory; None
    without any."""
    chunks, total = [], 0
    try:
        for part, offset, n_bytes in tensors:
            if total < limit:
                chunks.append(np.array(np.memmap(part, dtype=np.uint8, mode="r", offset=offset,
                                                 shape=(min(n_bytes, limit - total),))))
                total += chunks[-1].size
    except (OSError, ValueError):  # a file cut short since it was read
        return None
    return np.concatenate(chunks) if chunks else None


@contextmanager
def _expert_reader(tensor: tuple[str, int, int] | None):
    """read_into(address, size) for ggml.link_timings: size bytes of the tensor, from its first
    expert on, read from the model file into memory at address, as the upload worker reads them
    (one pread; libllama reads each part's share); None without a tensor or a readable file."""
    try:
        fd = os.open(tensor[0], os.O_RDONLY) if tensor else None
    except OSError:
        fd = None
    if fd is None:
        yield None
        return
    offset = tensor[1]

    def read_into(address: int, size: int) -> None:
        os.preadv(fd, [memoryview((ctypes.c_char * size).from_address(address)).cast("B")], offset)

    try:
        yield read_into
    finally:
        os.close(fd)


def _link_gbps(layer: CachedLayer, expert: np.ndarray, read_into=None) -> tuple[float, dict]:
    """The uploads' rate (with read_into: each read from the model file, then copied; else the
    copies from pageable memory), and what else the timings measured (PlannerRates'
    link_pinned_gbps, ids_trip_measured_us, link_copy_gbps). Each median leaves the first
    (warming) transfer out."""
    devices = Devices()
    if layer.device not in devices.by_buffer:
        raise ConfigError(f"the miss planner cannot time a copy to {layer.device} (not a ggml device): "
                          f"give {ENV_PREFIX}LINK_GBPS")
    timings = ggml.link_timings(*devices.by_buffer[layer.device], expert, COPIES + 1, read_into)

    def gbps(seconds):
        return expert.nbytes / max(statistics.median(seconds[1:]), 1e-9) / 1e9

    measured = {"link_pinned_gbps": gbps(timings.pinned) if timings.pinned else None,
                "ids_trip_measured_us": statistics.median(timings.ids_trip[1:]) * 1e6}
    if timings.upload is None:
        return gbps(timings.pageable), measured
    return gbps(timings.upload), {**measured, "link_copy_gbps": gbps(timings.pageable)}


def _read_gbps(data: np.ndarray, threads: int) -> float:
    words = data[:data.size // 8 * 8].view(np.uint64)
    chunks = np.array_split(words, threads)
    seconds = []
    with ThreadPoolExecutor(threads) as pool:  # numpy's reductions let go of the GIL
        for _ in range(HOST_READS + 1):  # the first touches the pages: not counted
            t0 = time.perf_counter()
            list(pool.map(np.add.reduce, chunks))
            seconds.append(time.perf_counter() - t0)
    return words.nbytes / max(min(seconds[1:]), 1e-9) / 1e9
