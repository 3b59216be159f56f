"""A live cache's decode-step boundary, through libllama's C API (cffi).

Before every ubatch libllama calls the step callback while no graph runs: hand the last
ubatch's selections to the engine (every token's), then apply its plan in one call: publish the
uploads that are due and complete, clear the evicted table entries and queue the new uploads
(libllama starts them after the callback returns, once the tables are written). An upload
still running when it is due stays unpublished and its slot untouchable until a later
boundary ("late"), so a slow upload never stalls decoding; LLAMA_MOE_CACHE_WAIT=1 waits for
it instead, which makes the hit count deterministic (what the offline replay reproduces).
Ubatches of up to LLAMA_MOE_CACHE_MAX_BATCH tokens that output every token (decode,
speculative verification) run the cached graph; prompts and larger ubatches run the stock
graph, which copies its selections out: the engine takes those as a prefill step (no lookups;
the prompt's most used experts are uploaded, counted apart).

Eager admission (LLAMA_MOE_CACHE_ADMISSION=eager): the boundary also hands libllama the
engine's Handover (moecache.core.admission), whose rule the CPU observers follow during the next graph
to start the uploads of its misses at once; the next boundary reads back which uploads they
started and gives them to the engine (with LLAMA_MOE_CACHE_WAIT=1 they must equal the
engine's model of them, or the cache freezes).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..core.admission import Admissions, admissions_with_lane
from ..core.engine import CacheEngine
from . import native


def file_changed() -> RuntimeError:
    return RuntimeError("the model file changed since it was loaded: slot uploads (RAM tier: reads) stopped, "
                        "every expert runs on the CPU (RAM tier: every decode fails)")


class Observed(NamedTuple):
    """The selections of the ubatch before a boundary (a tuple: made at every step)."""
    ids: np.ndarray    # (n_layers, n_tokens * n_used), token by token; -1 where a layer ran fewer tokens
    hits: np.ndarray   # the engine's hit mask of ids
    n_tokens: int
    prefill: bool      # the stock graph ran it (a prompt), not the cached one


class Boundary:
    """A cache's boundaries: the engine's steps, fed from and applied to libllama's buffers (of the
    context's cache of one tier)."""

    def __init__(self, ctx, engine: CacheEngine, *, n_layers: int, n_used: int, wait: bool, tier=native.DEVICE):
        self.lib, self.ffi = native.lib(), native.ffi
        self.ctx, self.engine, self.tier = ctx, engine, tier
        self.n_layers, self.n_used, self.wait = n_layers, n_used, wait
        self.wait_us = 0        # spent waiting for uploads (wait)
        self._observed = {}     # stock (bool) -> libllama's observed ids, mapped once
        self._shape = self.ffi.new("int32_t[2]")  # out-parameters (n_cols, stride), reused every step
        self._handover = self.ffi.new("struct llama_moe_cache_handover *")
        self._constant = None   # the handover's budget and lane table (the engine's, the same every step) as handed over
        self._declined_view = None  # libllama's per-layer declined uploads, mapped once

    def step(self) -> Observed | None:
        """The engine's step on what the last ubatch selected, applied in libllama; None when
        no ubatch ran since the last boundary. Raises RuntimeError when libllama refuses it."""
        engine = self.engine
        admitted, n_lane = self.admitted() if engine.admission == "eager" else (None, 0)
        declined = self._declined() if engine.miss_planner is not None else None
        ready = self._ready_uploads(admitted)
        ids, prefill = self._observed_ids(), False
        if ids is None:  # the last ubatch may have been a prompt
            ids = self._observed_ids(stock=True)
            prefill = ids is not None
        if admitted is not None and self.wait and not prefill:
            self._check_admitted(ids, admitted, declined)
        plan = engine.step(ids, ready, admitted, prefill=prefill, lane_rows=n_lane, declined=declined)
        self._apply(plan)
        if ids is None:
            return None
        return Observed(ids, plan.hit_mask, ids.shape[1] // self.n_used, prefill)

    def _ready_uploads(self, admitted) -> int | None:
        """How many of the uploads due are complete; None: all (waited for). An upload is due
        one step after it started: it had a whole token to finish."""
        if self.wait:
            self.wait_us += self.lib.llama_moe_cache_wait_uploads(self.ctx, self.tier)
            return None
        # the worker completes uploads in order: the first ones due are the ready ones
        started = self.engine.uploads_due + len(admitted if admitted is not None else ())
        return started - self.lib.llama_moe_cache_uploads_pending(self.ctx, self.tier)

    def _apply(self, plan) -> None:
        lib = self.lib
        status = lib.llama_moe_cache_apply(self.ctx, self.tier, *self._rows(plan.publish), *self._rows(plan.evict),
                                           *self._rows(plan.upload))
        if status == lib.LLAMA_MOE_CACHE_FILE_CHANGED:
            raise file_changed()
        if status != lib.LLAMA_MOE_CACHE_OK:
            raise RuntimeError(f"libllama refused the plan of step {plan.step} (publish "
                               f"{plan.publish.tolist()}, evict {plan.evict.tolist()}, upload "
                               f"{plan.upload.tolist()})")
        handover = self.engine.handover
        if handover is not None and self._hand_over(handover) != lib.LLAMA_MOE_CACHE_OK:
            raise RuntimeError(f"libllama refused the handover of step {plan.step}")

    def file_changed(self) -> bool:
        """Whether libllama found the model file changed (it stops the cache: uploads, and the RAM
        tier's reads, so that every decode fails): asked with an empty plan, which applies nothing
        and is refused then."""
        nothing = self._rows(())
        return self.lib.llama_moe_cache_apply(self.ctx, self.tier, *nothing, *nothing, *nothing) == \
            self.lib.LLAMA_MOE_CACHE_FILE_CHANGED

    def admitted(self) -> tuple[np.ndarray, int]:
        """(n, 3) int32 rows (layer, expert, slot) of the uploads libllama's observers started
        during the last cached graph, and how many of the first are the copy-on-miss lane's (each
        part in the order they started)."""
        ptr = self.lib.llama_moe_cache_admitted(self.ctx, self.tier, self._shape, self._shape + 1)
        n, n_lane = self._shape[0], self._shape[1]
        if n == 0:
            return np.empty((0, 3), dtype=np.int32), 0
        rows = np.empty((n, 3), dtype=np.int32)
        self.ffi.memmove(rows, ptr, 12 * n)
        return rows, n_lane

    def _declined(self) -> np.ndarray:
        """(n_layers,) int32, the uploads the miss planner's margin declined during the last cached
        graph: libllama's buffer, valid until the step returns (the engine adds it up at once)."""
        if self._declined_view is None:  # the buffer lives as long as the cache: map it once
            ptr = self.lib.llama_moe_cache_declined(self.ctx, self.tier)
            self._declined_view = np.frombuffer(self.ffi.buffer(ptr, 4 * self.n_layers), dtype=np.int32)
        return self._declined_view

    def _check_admitted(self, ids, admitted, declined) -> None:
        """With every upload waited for, what libllama admitted (and the uploads its margin
        declined) must be the engine's model of it (layer by layer; libllama's order follows
        the graph's, which groups layers otherwise when they sit on several devices)."""
        engine = self.engine
        if ids is None or engine.handover is None:
            none = np.zeros(self.n_layers, dtype=np.int64)
            modelled = Admissions(np.empty((0, 3), dtype=np.int32), none, none)
        else:
            modelled = admissions_with_lane(engine.handover, ids, engine.slot_expert, self.n_used)
        by_layer = admitted[np.argsort(admitted[:, 0], kind="stable")]
        if not np.array_equal(by_layer, modelled.jobs):
            if self.file_changed():  # why libllama stopped admitting
                raise file_changed()
            raise RuntimeError(f"libllama admitted {by_layer.tolist()}, the engine's model "
                               f"{modelled.jobs.tolist()}")
        if declined is not None and not np.array_equal(declined, modelled.declined):
            raise RuntimeError(f"libllama's margin declined {declined.tolist()} uploads per layer, the engine's "
                               f"model {modelled.declined.tolist()}")

    def _hand_over(self, handover) -> int:
        """The engine's Handover to libllama, for the next graph (one call; libllama copies it)."""
        arrays = (np.ascontiguousarray(handover.victims, dtype=np.int32),
                  np.ascontiguousarray(handover.victim_worth, dtype=np.float64),
                  np.ascontiguousarray(handover.worth, dtype=np.float64))
        h, cast = self._handover, self.ffi.from_buffer
        if self._constant is None or self._constant[0] is not handover.budget or \
                self._constant[1] is not handover.lane:  # converted once
            budget = cast("int32_t[]", np.ascontiguousarray(handover.budget, dtype=np.int32))
            lane = self.ffi.NULL if handover.lane is None else \
                cast("int32_t[]", np.ascontiguousarray(handover.lane, dtype=np.int32))
            self._constant = (handover.budget, handover.lane, budget, lane)  # keeps the converted tables alive
            h.budget, h.lane = budget, lane
        h.margin = handover.margin
        h.victims, h.victim_worth = cast("int32_t[]", arrays[0]), cast("double[]", arrays[1])
        h.worth = cast("double[]", arrays[2])
        return self.lib.llama_moe_cache_hand_over(self.ctx, self.tier, h)

    def _rows(self, jobs):
        """A job table as (pointer, row count) for libllama: (n, 3) int32, C order."""
        if not len(jobs):  # most tables of a boundary are empty
            return self.ffi.NULL, 0
        return self.ffi.from_buffer("int32_t[]", np.ascontiguousarray(jobs, dtype=np.int32)), len(jobs)

    def _observed_ids(self, stock=False):
        """(n_layers, n_tokens * n_used) ids of the last ubatch if it ran the cached graph (or,
        stock: the stock graph), token by token (-1 where a layer ran fewer tokens), or None."""
        shape = self._shape
        read = self.lib.llama_moe_cache_observed_stock if stock else self.lib.llama_moe_cache_observed
        ptr = read(self.ctx, self.tier, shape, shape + 1)
        if ptr == self.ffi.NULL:
            return None
        if stock not in self._observed:  # the buffer lives as long as the cache: map it once
            n = self.n_layers * shape[1]
            self._observed[stock] = np.frombuffer(self.ffi.buffer(ptr, 4 * n), dtype=np.int32).reshape(
                self.n_layers, shape[1])
        return self._observed[stock][:, :shape[0]].copy()
