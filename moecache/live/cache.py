"""The live expert cache of one llama_context: policy and engine here, mechanism in libllama.

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

import atexit
import json
import logging
import os
import sys
import threading
import time

import numpy as np

from ..core.admission import admissions
from ..core.engine import COUNTERS, CacheEngine
from ..core.policies import make_policy
from ..core.profile import ProfileError, UsageProfile
from ..core.traces import DECODE, PREFILL, TraceWriter
from ..util import atomic_write
from . import native, sizing
from .config import CacheConfig, ConfigError

log = logging.getLogger("moecache")


class CacheUnavailable(RuntimeError):
    """This context gets no cache (the reason is the message); decoding stays stock."""


class LiveCache:
    def __init__(self, ctx, config: CacheConfig, *, model_name: str = "model", model_path: str | None = None,
                 tensor_split=None):
        if not config.enabled:
            raise ConfigError("LLAMA_MOE_CACHE_SLOTS is 0: the cache is off")
        self.config = config
        self.lib = native.lib()
        self.ctx = native.as_context(ctx)
        self.ffi = native.ffi

        arch = native.model_metadata(self.ctx, "general.architecture") or "unknown"
        n_expert_text = native.model_metadata(self.ctx, f"{arch}.expert_count")
        if not n_expert_text or int(n_expert_text) == 0:
            raise CacheUnavailable(f"model architecture '{arch}' has no experts")
        if config.budget_mib is None and config.slots > int(n_expert_text):
            raise ConfigError(f"LLAMA_MOE_CACHE_SLOTS={config.slots} exceeds the {n_expert_text} "
                              f"experts per layer of this model")

        # K from the setting: SLOTS=K, or the largest that a memory budget holds
        self.plan = sizing.allocate(self.ctx, config, n_expert=int(n_expert_text), model_path=model_path,
                                    tensor_split=tensor_split)
        n_layers, self.slots = self.plan.n_layers, self.plan.slots
        if n_layers <= 0:
            raise CacheUnavailable(self.plan.reason)
        try:
            self._setup(n_layers, arch, model_name)
        except BaseException:
            native.init(self.ctx, 0)  # release the slots: stock, not an idle split
            raise

        self.steps = 0
        self.decode_steps = 0   # steps that observed a cached ubatch
        self.decode_tokens = 0  # the tokens of those ubatches
        self.prefill_steps = 0  # steps that observed a stock ubatch (a prompt)
        self.prefill_tokens = 0
        self._trace_turn = 0    # a prompt after decoding starts a new turn of the trace
        self._trace_tokens = 0  # the trace's step numbers, over both phases
        self._trace_phase = None
        self.step_ns = 0
        self.step_ns_max = 0
        self.wait_us = 0
        self.failed = None
        self._observed = {}  # stock (bool) -> libllama's observed ids, mapped once
        self._shape = self.ffi.new("int32_t[2]")  # out-parameters (n_cols, stride), reused every step
        self._handover = self.ffi.new("struct llama_moe_cache_handover *")
        self._closed = False
        self._flusher = None  # the thread writing the last periodic snapshot
        self.detached = False
        self._callback = self.ffi.callback("llama_moe_cache_step_callback", self._on_step)
        self.lib.llama_moe_cache_set_step_callback(self.ctx, self._callback, self.ffi.NULL)
        atexit.register(self.close)
        for line in self.plan.lines():
            log.info("%s", line)
        log.info("moecache: policy %s, %d inserts/step, %s admission, slots filled from %s", config.policy,
                 config.inserts, config.admission,
                 "the model file (repacked host experts)" if self.layers[0]["from_file"] else "host memory")

    def _setup(self, n_layers: int, arch: str, model_name: str) -> None:
        """Layers, engine, warm start and trace of a freshly allocated cache."""
        config = self.config
        self.layers = [self._layer_info(i) for i in range(n_layers)]
        n_expert = self.layers[0]["n_expert"]
        if any(layer["n_expert"] != n_expert for layer in self.layers):
            raise CacheUnavailable("layers with different expert counts are not supported")
        self.n_used = max(layer["n_expert_used"] for layer in self.layers)
        self.device_bytes = int(self.lib.llama_moe_cache_device_bytes(self.ctx))

        self.engine = CacheEngine(n_layers, n_expert, self.slots, make_policy(config.policy),
                                  inserts=config.inserts, admission=config.admission)
        model_layers = [layer["il"] for layer in self.layers]
        if config.profile and os.path.exists(config.profile):
            try:
                profile = UsageProfile.load(config.profile, layers=model_layers, n_expert=n_expert)
            except ProfileError as e:
                raise ConfigError(f"LLAMA_MOE_CACHE_PROFILE: {e}") from None
            self.engine.preload(profile.top(self.slots), rates=profile.rates(self.n_used))
        self._profile_base = model_name
        self._profile_saved = np.zeros_like(self.engine.usage)  # usage already added to the file
        self._report_errors: set[str] = set()

        self.trace = None
        if config.trace:
            try:
                self.trace = TraceWriter(
                    config.trace, model=os.path.basename(model_name) or "model", arch=arch,
                    n_layer=max(model_layers) + 1, n_expert=n_expert, n_expert_used=self.n_used,
                    layers=[(layer["il"], layer["expert_bytes"], 0) for layer in self.layers])
            except (OSError, ValueError) as e:
                raise ConfigError(f"LLAMA_MOE_CACHE_TRACE={config.trace!r}: {getattr(e, 'strerror', None) or e}") from None

    def _layer_info(self, i: int) -> dict:
        info = self.ffi.new("struct llama_moe_cache_layer_info *")
        if not self.lib.llama_moe_cache_layer_info(self.ctx, i, info):
            raise CacheUnavailable(f"no info for cached layer {i}")
        return {"il": info.il, "n_expert": info.n_expert, "n_expert_used": info.n_expert_used,
                "expert_bytes": int(info.expert_bytes), "from_file": bool(info.from_file),
                "device": self.ffi.string(info.device).decode()}

    # --- the decode boundary (called by libllama) ---------------------------------------

    def _on_step(self, ctx, user_data):
        if self.failed:
            return
        try:
            t0 = time.perf_counter_ns()
            self._step()
            dt = time.perf_counter_ns() - t0
            self.step_ns += dt
            self.step_ns_max = max(self.step_ns_max, dt)
            if self.config.debug and self.steps % self.config.debug == 0:
                print(self.summary(), file=sys.stderr)
        except Exception as e:  # the graph must go on: freeze the cache as it is (still exact)
            self.failed = f"{type(e).__name__}: {e}"
            log.error("moecache: scheduler failed, cache frozen: %s", self.failed)

    def _step(self):
        lib, ctx, engine = self.lib, self.ctx, self.engine
        admitted = self.admitted() if engine.admission == "eager" else None
        # an upload is due one step after it started: it had a whole token to finish
        if self.config.wait:
            self.wait_us += lib.llama_moe_cache_wait_uploads(ctx)
            ready = None
        else:  # the worker completes uploads in order: the first ones due are the ready ones
            ready = engine.uploads_due + len(admitted if admitted is not None else ()) \
                - lib.llama_moe_cache_uploads_pending(ctx)
        ids, prefill = self._read_observed(), False
        if ids is None:  # the last ubatch may have been a prompt
            ids = self._read_observed(stock=True)
            prefill = ids is not None
        if admitted is not None and self.config.wait and not prefill:
            self._check_admitted(ids, admitted)
        plan = engine.step(ids, ready, admitted, prefill=prefill)
        status = lib.llama_moe_cache_apply(ctx, *self._rows(plan.publish), *self._rows(plan.evict),
                                           *self._rows(plan.upload))
        if status == lib.LLAMA_MOE_CACHE_FILE_CHANGED:
            raise RuntimeError("the model file changed since it was loaded: slot uploads stopped, "
                               "every expert runs on the CPU")
        if status != lib.LLAMA_MOE_CACHE_OK:
            raise RuntimeError(f"libllama refused the plan of step {plan.step} (publish "
                               f"{plan.publish.tolist()}, evict {plan.evict.tolist()}, upload "
                               f"{plan.upload.tolist()})")
        if engine.handover is not None and self._hand_over(engine.handover) != lib.LLAMA_MOE_CACHE_OK:
            raise RuntimeError(f"libllama refused the handover of step {plan.step}")
        self.steps += 1
        if ids is not None:
            n_tokens = ids.shape[1] // self.n_used
            if self.trace:
                self._write_trace(ids, plan.hit_mask.astype(np.int8), prefill)
            if prefill:
                self.prefill_steps += 1
                self.prefill_tokens += n_tokens
                return
            self.decode_steps += 1
            self.decode_tokens += n_tokens
            if self.config.flush_steps and self.decode_steps % self.config.flush_steps == 0:
                self._flush_in_background()

    def _write_trace(self, ids, residency, prefill):
        phase = PREFILL if prefill else DECODE
        if phase == PREFILL and self._trace_phase == DECODE:
            self._trace_turn += 1
        self._trace_phase = phase
        try:
            self.trace.write_step(self._trace_turn, phase, self._trace_tokens, ids, None, residency)
            self._trace_tokens += ids.shape[1] // self.n_used
        except (OSError, ValueError) as e:  # e.g. a full disk: the trace stops, the cache goes on
            log.error("moecache: error: LLAMA_MOE_CACHE_TRACE=%r: %s - trace stopped after %d steps",
                      self.config.trace, getattr(e, "strerror", None) or e, self.decode_steps)
            self.trace.close()
            self.trace = None

    def admitted(self):
        """(n, 3) int32 rows (layer, expert, slot) of the uploads libllama's observers started
        during the last cached graph, in the order they started."""
        ptr = self.lib.llama_moe_cache_admitted(self.ctx, self._shape)
        n = self._shape[0]
        if n == 0:
            return np.empty((0, 3), dtype=np.int32)
        return np.frombuffer(self.ffi.buffer(ptr, 12 * n), dtype=np.int32).reshape(n, 3).copy()

    def _check_admitted(self, ids, admitted):
        """With every upload waited for, what libllama admitted must be the engine's model of it
        (layer by layer; libllama's order follows the graph's, which groups layers otherwise
        when they sit on several devices)."""
        engine = self.engine
        if ids is None or engine.handover is None:
            modelled = np.empty((0, 3), dtype=np.int32)
        else:
            modelled = admissions(engine.handover, ids, engine.slot_expert)
        by_layer = admitted[np.argsort(admitted[:, 0], kind="stable")]
        if not np.array_equal(by_layer, modelled):
            raise RuntimeError(f"libllama admitted {by_layer.tolist()}, the engine's model "
                               f"{modelled.tolist()}")

    def _hand_over(self, handover):
        """The engine's Handover to libllama, for the next graph (one call; libllama copies it)."""
        arrays = (np.ascontiguousarray(handover.victims, dtype=np.int32),
                  np.ascontiguousarray(handover.victim_worth, dtype=np.float64),
                  np.ascontiguousarray(handover.worth, dtype=np.float64),
                  np.ascontiguousarray(handover.budget, dtype=np.int32))
        h, cast = self._handover, self.ffi.from_buffer
        h.victims, h.victim_worth = cast("int32_t[]", arrays[0]), cast("double[]", arrays[1])
        h.worth, h.budget = cast("double[]", arrays[2]), cast("int32_t[]", arrays[3])
        return self.lib.llama_moe_cache_hand_over(self.ctx, h)

    def _rows(self, jobs):
        """A job table as (pointer, row count) for libllama: (n, 3) int32, C order."""
        return self.ffi.from_buffer("int32_t[]", np.ascontiguousarray(jobs, dtype=np.int32)), len(jobs)

    def _read_observed(self, stock=False):
        """(n_layers, n_tokens * n_used) ids of the last ubatch if it ran the cached graph (or,
        stock: the stock graph), token by token (-1 where a layer ran fewer tokens), or None."""
        shape = self._shape
        read = self.lib.llama_moe_cache_observed_stock if stock else self.lib.llama_moe_cache_observed
        ptr = read(self.ctx, shape, shape + 1)
        if ptr == self.ffi.NULL:
            return None
        if stock not in self._observed:  # the buffer lives as long as the cache: map it once
            n = len(self.layers) * shape[1]
            self._observed[stock] = np.frombuffer(self.ffi.buffer(ptr, 4 * n), dtype=np.int32).reshape(
                len(self.layers), shape[1])
        return self._observed[stock][:, :shape[0]].copy()

    # --- reporting ------------------------------------------------------------------------

    def stats(self) -> dict:
        engine = self.engine.stats([layer["expert_bytes"] for layer in self.layers])
        counters = engine["layers"]
        return {
            "slots": self.slots,
            "inserts": self.config.inserts,
            "policy": self.config.policy,
            "admission": self.config.admission,
            "device_bytes": self.device_bytes,
            "steps": self.steps,
            "decode_steps": self.decode_steps,
            "decode_tokens": self.decode_tokens,
            "prefill_steps": self.prefill_steps,
            "prefill_tokens": self.prefill_tokens,
            "hit_rate": engine["hit_rate"],
            "totals": engine["totals"],
            "step_us_mean": self.step_ns / self.steps / 1e3 if self.steps else None,
            "step_us_max": self.step_ns_max / 1e3,
            "upload_wait_us": int(self.wait_us),
            "failed": self.failed,
            "layers": [{"layer": layer["il"], **{name: counters[name][i] for name in COUNTERS}}
                       for i, layer in enumerate(self.layers)],
            "plan": self.plan.to_json(),
        }

    def summary(self) -> str:
        s = self.stats()
        rate = "n/a" if s["hit_rate"] is None else f"{100 * s['hit_rate']:.1f}%"
        return (f"moecache: {s['decode_steps']} decode steps ({s['decode_tokens']} tokens), hit rate {rate}, "
                f"{s['totals']['uploads']} uploads ({s['totals']['late']} late), {s['totals']['evictions']} evictions, "
                f"step {s['step_us_mean'] or 0:.0f} us mean, upload wait {s['upload_wait_us'] / 1e3:.1f} ms")

    def close(self):
        """Write stats, trace and profile (once: when the context is freed, else at exit). The
        context may be gone: only Python state is read here."""
        if self._closed:
            return
        self._closed = True
        if self.config.debug:
            print(self.summary(), file=sys.stderr)
        if self._flusher is not None:
            self._flusher.join()  # its older snapshot must not land after the final one
        if self.trace:
            self.trace.close()
        self.write_reports()

    def write_reports(self):
        """Write the stats and add this run's new usage to the profile, each atomically and on
        its own (one that fails does not keep the other from being written)."""
        self._write_snapshot(self._snapshot())

    def _flush_in_background(self):
        """Every FLUSH_STEPS decode steps, so that a crash loses at most that many: the decode
        thread only takes a snapshot, a thread writes it (the writes wait for the disk, tens of
        ms). Skipped while the previous one still writes."""
        if self._flusher is not None and self._flusher.is_alive():
            return
        self._flusher = threading.Thread(target=self._write_snapshot, args=(self._snapshot(),),
                                         name="moecache-flush", daemon=True)
        self._flusher.start()

    def _snapshot(self):
        return (json.dumps(self.stats(), indent=1) if self.config.stats else None,
                self.engine.usage.copy() if self.config.profile else None)

    def _write_snapshot(self, snapshot) -> None:
        stats_text, usage = snapshot
        if stats_text is not None:
            self._report("STATS", lambda: atomic_write(self.config.stats, stats_text))
        if usage is not None:
            self._report("PROFILE", lambda: self._save_profile(usage))
        trace = self.trace  # the decode thread drops it if a write fails
        if trace:
            self._report("TRACE", trace.flush)

    def _report(self, name: str, write) -> None:
        try:
            write()
        except (OSError, ProfileError) as e:  # one line, never a traceback; once per problem
            message = (f"moecache: error: LLAMA_MOE_CACHE_{name}={getattr(self.config, name.lower())!r}: "
                       f"{getattr(e, 'strerror', None) or e} - not written")
            if message not in self._report_errors:
                self._report_errors.add(message)
                log.error("%s", message)

    def _save_profile(self, usage) -> None:
        new = usage - self._profile_saved  # what the file does not have yet
        if not new.any():
            return
        layers = [layer["il"] for layer in self.layers]
        profile = UsageProfile(self._profile_base, layers, new)
        if os.path.exists(self.config.profile):  # another run or context may have added to it
            profile = profile.merged(UsageProfile.load(self.config.profile, layers=layers,
                                                       n_expert=profile.n_expert))
        profile.save(self.config.profile)
        self._profile_saved = usage

    def detach(self):
        """Forget this cache without reporting; a new init of the same context replaces it."""
        self.detached = True
        self._closed = True
        atexit.unregister(self.close)

    def release(self):
        """Its context is being freed: report now, and let go of this cache."""
        self.close()
        self.detach()

    # --- testing ----------------------------------------------------------------------------

    def native_counters(self) -> list[dict]:
        """libllama's own per-layer counters (its CPU observer's view of hits and misses)."""
        out = []
        c = self.ffi.new("struct llama_moe_cache_counters *")
        for i in range(len(self.layers)):
            self.lib.llama_moe_cache_get_counters(self.ctx, i, c)
            out.append({"hits": c.hits, "misses": c.misses, "uploads": c.uploads,
                        "upload_bytes": c.upload_bytes})
        return out
