"""Modelled expert time per decode token: a hit rate read as decode speed. MODELLED, never
measured; docs/policies.md states the formulas and where the default bandwidths come from.

Per decode token, from a replay's byte counts (GB = 1e9 bytes):

    stock --cpu-moe   every selected expert read on the host      lookup / host
    moecache          misses read on the host; the uploads read   max((miss + upload) / host,
                      host memory too (asynchronous, so they          upload / link)
                      only share its bandwidth), and the link
                      must carry them within the token
    upstream          misses copied synchronously over the link   upload / min(link, host)
                      before the GPU computes them; experts the       + host_read / host
                      cache bypasses are read on the host

Expert compute on the GPU is taken as free next to the link (a decode token's cached experts
are a few milliseconds of host reading, microseconds of GPU work), and upstream's per-layer
synchronisation latency is not charged (both favour the GPU-side caches, i.e. upstream).
"""

from __future__ import annotations

from dataclasses import dataclass

# Dual-channel DDR5-5600 desktop: 2 x 8 bytes x 5600 MT/s = 89.6 GB/s peak (JEDEC JESD79-5
# data rate); we assume two thirds of peak for a streaming read of large expert tensors.
DEFAULT_HOST_GBPS = 60.0
# PCIe 4.0 x16: 16 GT/s x 16 lanes x 128/130 = 31.5 GB/s per direction (PCI-SIG); we assume
# 80% of it for pinned host-to-device copies after packet overhead. PCIe 5.0 x16 doubles both
# (63.0 peak, 50 assumed).
DEFAULT_LINK_GBPS = 25.0
PCIE5_LINK_GBPS = 50.0


@dataclass(frozen=True)
class Bandwidth:
    host_gbps: float = DEFAULT_HOST_GBPS   # host memory read bandwidth for expert weights
    link_gbps: float = DEFAULT_LINK_GBPS   # host-to-device copy bandwidth

    def __post_init__(self):
        for name in ("host_gbps", "link_gbps"):
            value = getattr(self, name)
            if not value > 0 or value == float("inf"):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")

    def _ms(self, nbytes: float, gbps: float) -> float:
        return nbytes / (gbps * 1e6)  # bytes / (GB/s) -> ms

    def stock_ms(self, lookup_bytes: float) -> float:
        """llama.cpp --cpu-moe: every selected expert read from host memory."""
        return self._ms(lookup_bytes, self.host_gbps)

    def moecache_ms(self, miss_bytes: float, upload_bytes: float) -> float:
        """Misses computed on the host; uploads asynchronous, sharing host bandwidth, and the
        link must keep up with them (else they arrive late and the replayed hit rate is not
        the one reached)."""
        return max(self._ms(miss_bytes + upload_bytes, self.host_gbps),
                   self._ms(upload_bytes, self.link_gbps))

    def upstream_ms(self, upload_bytes: float, host_bytes: float = 0.0) -> float:
        """Upstream llama.cpp: misses copied synchronously (the slower of link and host memory
        sets the pace), computed on the GPU; bypassed experts read on the host."""
        return self._ms(upload_bytes, min(self.link_gbps, self.host_gbps)) \
            + self._ms(host_bytes, self.host_gbps)
