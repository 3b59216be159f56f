"""Hardware classes (HARDWARE): named machines, each the Rates of moecache.core.missplan's layer
formula with the sources of every figure. The replay's cost model times a run on one
(moecache.offline.cost); the live miss planner takes the rates it does not measure from the
class whose link is nearest the one it measured (moecache.live.rates). docs/cost-model.md
("Modelled cost") states what only a GPU can confirm.

Every efficiency (the share of a peak rate a kernel or a copy reaches) is an ASSUMPTION, stated
once below and applied the same way to every class, until scripts/gpu_check.sh measures them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .missplan import Rates

# Assumptions (shares of peak rates), one per resource:
CPU_READ_EFFICIENCY = 2 / 3     # the CPU's quantized matvec kernels streaming expert weights
DRAM_EFFICIENCY = 0.8           # host memory serving the CPU and the DMA engine together
LINK_EFFICIENCY = 0.8           # pinned host-to-device copies, after packet overhead
GPU_READ_EFFICIENCY = 0.7       # the GPU's decode matvec kernels reading device memory


def ddr_peak_gbps(mt_per_s: float, channels: int = 2) -> float:
    """JEDEC data rate x 8 bytes per 64-bit channel (JESD79-4 DDR4, JESD79-5 DDR5)."""
    return channels * 8 * mt_per_s / 1e3


def pcie_peak_gbps(gt_per_s: float, lanes: int) -> float:
    """PCI-SIG: gen 3 and later encode 128b/130b; GB/s per direction."""
    return gt_per_s * lanes * 128 / 130 / 8


@dataclass(frozen=True)
class Hardware:
    """A named machine: its Rates, built from peak figures and the assumptions above."""

    name: str
    summary: str
    rates: Rates
    sources: str

    @classmethod
    def from_peaks(cls, name, summary, *, ddr_mt_s, pcie_gt_s, lanes, gpu_gbps, ids_trip_us, join_us,
                   sources):
        ddr = ddr_peak_gbps(ddr_mt_s)
        rates = Rates(host_gbps=CPU_READ_EFFICIENCY * ddr, link_gbps=LINK_EFFICIENCY * pcie_peak_gbps(pcie_gt_s, lanes),
                      dram_gbps=DRAM_EFFICIENCY * ddr, device_gbps=GPU_READ_EFFICIENCY * gpu_gbps,
                      ids_trip_us=ids_trip_us, join_us=join_us)
        return cls(name, summary, rates, sources)

    def override(self, **rates) -> "Hardware":
        """This class with some rates given explicitly (None: keep the class's)."""
        given = {k: v for k, v in rates.items() if v is not None}
        if not given:
            return self
        return Hardware(f"{self.name} with " + ", ".join(f"{k}={v:g}" for k, v in given.items()),
                        self.summary, replace(self.rates, **given), self.sources)

    def describe(self) -> str:
        r = self.rates
        return (f"{self.name}: host {r.host_gbps:.1f} GB/s (CPU), dram {r.dram_gbps:.1f} (CPU + DMA), "
                f"link {r.link_gbps:.1f}, device {r.device_gbps:.0f}, ids trip {r.ids_trip_us:g} us, "
                f"join {r.join_us:g} us")


# Synchronisation latencies: ASSUMPTIONS until measured (scripts/gpu_check.sh, issue 22): the
# ids' trip is a device-to-host copy of a few hundred bytes and a stream synchronisation (CUDA
# launch plus a PCIe round trip, about 10 us on a direct x16 link) and the host thread waking
# up; the join a small host-to-device copy the device's stream waits on. An eGPU enclosure
# adds a switch hop (and Thunderbolt's tunnelling): doubled.
HARDWARE = {h.name: h for h in (
    Hardware.from_peaks(
        "pcie3-x4-egpu", "PCIe 3.0 x4 eGPU (RTX 3060 Ti class), DDR4-3200 dual channel",
        ddr_mt_s=3200, pcie_gt_s=8, lanes=4, gpu_gbps=448, ids_trip_us=30, join_us=10,
        sources="DDR4-3200: 51.2 GB/s peak (JESD79-4); PCIe 3.0 x4: 3.94 GB/s per direction "
                "(PCI-SIG, 8 GT/s, 128b/130b); RTX 3060 Ti: 448 GB/s GDDR6 (NVIDIA); the user "
                "report of issue 22 (35 -> 1-8 tok/s with upstream's cache) is this machine"),
    Hardware.from_peaks(
        "pcie4-x16", "PCIe 4.0 x16 (RTX 4090 class), DDR5-5600 dual channel (today's default)",
        ddr_mt_s=5600, pcie_gt_s=16, lanes=16, gpu_gbps=1008, ids_trip_us=15, join_us=5,
        sources="DDR5-5600: 89.6 GB/s peak (JESD79-5); PCIe 4.0 x16: 31.5 GB/s per direction "
                "(PCI-SIG); RTX 4090: 1008 GB/s GDDR6X (NVIDIA), upstream's published 25.0 -> "
                "40.7 t/s card"),
    Hardware.from_peaks(
        "pcie5-x16", "PCIe 5.0 x16 (RTX 5090 class), DDR5-6400 dual channel",
        ddr_mt_s=6400, pcie_gt_s=32, lanes=16, gpu_gbps=1792, ids_trip_us=15, join_us=5,
        sources="DDR5-6400: 102.4 GB/s peak (JESD79-5); PCIe 5.0 x16: 63.0 GB/s per direction "
                "(PCI-SIG); RTX 5090: 1792 GB/s GDDR7 (NVIDIA), upstream's published 30.8 -> "
                "67.8 t/s card"),
)}
DEFAULT_HARDWARE = "pcie4-x16"


def nearest_link(link_gbps: float) -> Hardware:
    """The class whose link rate is nearest link_gbps (by ratio)."""
    return min(HARDWARE.values(), key=lambda h: abs(math.log(h.rates.link_gbps / link_gbps)))
