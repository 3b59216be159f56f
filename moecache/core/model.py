"""What every cache model shares: the per-layer engine (live and replayed), the global byte
budget and upstream llama.cpp's cache each take one step of routing at a time, count what
happened by name, and report those counts the same way."""

from __future__ import annotations

import numpy as np


def hit_rate(hits, misses) -> float | None:
    """hits / lookups as a FRACTION; None before any lookup."""
    lookups = hits + misses
    return hits / lookups if lookups else None


class CacheModel:
    """The base of the cache models. A subclass sets `counters` (name -> a count, or an array
    of counts per layer; "hits" and "misses" at least) and `step_index`, and implements step()."""

    counters: dict
    step_index: int = 0

    def step(self, *args, **kwargs):
        raise NotImplementedError

    def totals(self) -> dict[str, int]:
        """Every counter summed over layers."""
        return {name: int(np.sum(value)) for name, value in self.counters.items()}

    def stats(self) -> dict:
        """{"steps", "hit_rate" (a fraction, None before any lookup), "totals"}."""
        totals = self.totals()
        return {"steps": self.step_index, "hit_rate": hit_rate(totals["hits"], totals["misses"]),
                "totals": totals}
