"""The cache engine's state: what each slot holds, which experts are published, in flight,
pinned or prefetched, and the counters. native/engine_core.c reads and writes these arrays in
place (moecache.core.bookkeeping hands it their addresses); Python sets the pins and moves a
prompt's uploads to their own counter, and otherwise only reads them.

Job tables, the unit of every upload decision, are (n, 3) int32 arrays of (layer, expert,
slot) rows."""

from __future__ import annotations

import numpy as np

from .bookkeeping import COUNTERS, NO_JOBS

NO_LAYERS = np.empty(0, dtype=np.int64)


def join_jobs(parts) -> np.ndarray:
    """One job table of these, in order (a part that is the only non-empty one comes back as it
    is: most boundaries join an empty table to another)."""
    parts = [part for part in parts if len(part)]
    if not parts:
        return NO_JOBS
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


class EngineState:
    """The tables of an (n_layers, n_expert, n_slots) cache, keys = layer * n_expert + expert."""

    def __init__(self, n_layers: int, n_expert: int, n_slots: int):
        L, E, K = n_layers, n_expert, n_slots
        self.slot_expert = np.full((L, K), -1, dtype=np.int32)  # held or being loaded, -1 empty
        self.expert_slot = np.full((L, E), -1, dtype=np.int32)  # published only
        self.assigned = np.full((L, E), -1, dtype=np.int32)     # published or in flight
        self.in_flight = np.zeros((L, K), dtype=bool)
        self.late = np.zeros((L, K), dtype=bool)                # the upload in flight was counted late
        self.prefetched = np.zeros((L, E), dtype=bool)          # prefetched, not used yet
        self.pinned = np.zeros((L, E), dtype=bool)
        self.used = np.zeros((L, E), dtype=bool)  # the last observation's experts, a new table each step
        self.usage = np.zeros((L, E), dtype=np.int64)  # steps each expert was used in, prompts not
        self.counts = np.zeros((len(COUNTERS), L), dtype=np.int64)
        self.counters = dict(zip(COUNTERS, self.counts))
        self.key_base = np.arange(L)[:, None] * E

    def keys(self, experts: np.ndarray) -> np.ndarray:
        """The keys of per-layer expert ids ((L, n); junk where an id is -1)."""
        return experts + self.key_base
