"""The live expert cache of one llama_context: policy and engine here, mechanism in libllama.

A LiveCache is made on slots already allocated (moecache.live.activate: probe, plan, allocate)
and composes the engine, the decode-step boundary that libllama calls before every ubatch
(moecache.live.boundary) and what it reports (moecache.live.reports). A context with both tiers
has two: the device cache's, which reports for both, and the RAM tier's under it."""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import sys
import time

from ..core.engine import CacheEngine
from ..core.missplan import MissPlanner
from ..core.policies import make_policy
from ..formats.profile import ProfileError, UsageProfile
from . import native
from .boundary import Boundary, file_changed
from .config import CacheConfig, ConfigError
from .probe import CachedLayer, CacheUnavailable
from .ramtier import TierReads
from .rates import PlannerRates
from .reports import Reports, StepCounts, TraceRecorder
from .sizing import CachePlan

log = logging.getLogger("moecache")


class LiveCache:
    """A context's cache: decodes through its slots from the step callback on, reports when
    its context is freed (or at exit)."""

    def __init__(self, ctx, config: CacheConfig, plan: CachePlan, layers: list[CachedLayer], *, arch: str,
                 model_name: str = "model", tier=native.DEVICE, below: "LiveCache | None" = None,
                 above: int | None = None, planner: PlannerRates | None = None):
        """The cache of ctx's tier on its allocated slots (plan, layers: as allocated). below: the
        RAM tier's cache under this device cache; above: the slots per layer of the device cache
        over this RAM tier (it warms up with the profile's experts after the device's, and reports
        through the device cache: stats, trace and profile are the device cache's); planner: the
        miss planner's rates (LLAMA_MOE_CACHE_PLANNER=1)."""
        self.config, self.plan, self.layers, self.planner = config, plan, layers, planner
        self.tier, self.below, self.above = tier, below, above
        self.lib, self.ffi = native.lib(), native.ffi
        self.ctx = ctx
        self.slots = plan.slots
        self.n_used = max(layer.n_expert_used for layer in layers)
        self.device_bytes = plan.bytes
        self.engine = _engine(config, layers, self.slots, self.n_used, planner, ram=tier == native.RAM,
                              above=above or 0)
        if above is not None:
            config = dataclasses.replace(config, stats=None, trace=None, profile=None, debug=0)
        self._trace = TraceRecorder(config.trace, model_name=model_name, arch=arch, layers=layers,
                                    n_used=self.n_used, ram_tier=tier == native.RAM) if config.trace else None
        self.boundary = Boundary(ctx, self.engine, n_layers=len(layers), n_used=self.n_used, wait=bool(config.wait),
                                 tier=tier)
        self.counts = StepCounts()
        self.reads = TierReads(len(layers)) if tier == native.RAM else None
        self.failed = None
        self.reports = Reports(config, self.engine, stats=self.stats, layers=[layer.il for layer in layers],
                               profile_name=model_name, trace=self._trace)
        self._closed = False
        self.detached = False
        self._callback = self.ffi.callback("llama_moe_cache_step_callback", self._on_step)
        self.lib.llama_moe_cache_set_step_callback(ctx, tier, self._callback, self.ffi.NULL)
        atexit.register(self.close)
        for line in self.lines():
            log.info("%s", line)
        filled = ("the model file (RAM tier)" if tier == native.RAM else
                  "the model file" if layers[0].from_file else "host memory")
        log.info("moecache: policy %s, %d inserts/step, %s admission, slots filled from %s", config.policy,
                 self.engine.inserts, config.admission, filled)

    def lines(self) -> list[str]:
        """The plan, and the miss planner's rates, as printed at attach."""
        return self.plan.lines() + ([self.planner.line()] if self.planner else [])

    @property
    def trace(self):
        """The TraceWriter of LLAMA_MOE_CACHE_TRACE; None when off, or stopped by a failed write."""
        return self._trace.writer if self._trace else None

    # --- the decode boundary (called by libllama) ---------------------------------------

    def _on_step(self, ctx, user_data):
        if self.failed:
            return
        try:
            t0 = time.perf_counter_ns()
            self._step()
            self.counts.timed(time.perf_counter_ns() - t0)
            if self.config.debug and self.above is None and self.counts.steps % self.config.debug == 0:
                print(self.summary(), file=sys.stderr)
        except Exception as e:  # the graph must go on: freeze the cache as it is (still exact)
            self.failed = f"{type(e).__name__}: {e}"
            log.error("moecache: scheduler failed, cache frozen: %s", self.failed)

    def _step(self):
        observed = self.boundary.step()
        self.counts.steps += 1
        if observed is None:
            return
        reads = self.reads.update(native.read_counters(self.ctx, self.tier, len(self.layers)),
                                  n_tokens=observed.n_tokens, prompt=observed.prefill or observed.n_tokens > 1) \
            if self.reads else None
        if self._trace:
            self._trace.record(observed, self.counts.decode_steps, reads)
        self.counts.add(observed)
        flush = self.config.flush_steps
        if not observed.prefill and flush and self.above is None and self.counts.decode_steps % flush == 0:
            self.reports.flush_in_background()

    def why_stopped(self) -> str | None:
        """Why this cache or the RAM tier under it stopped, in a line, or None: its failure, else
        libllama's word, asked now (a changed model file fails the RAM tier's decodes in
        libllama, before a step of this cache sees it). Call between decodes."""
        for cache in (self, self.below):
            if cache is None or cache.detached:
                continue
            if cache.failed is None and cache.boundary.file_changed():
                cache.failed = f"RuntimeError: {file_changed()}"
            if cache.failed:
                return f"the {'RAM tier' if cache.tier == native.RAM else 'device cache'} stopped: {cache.failed}"
        return None

    def admitted(self):
        """(n, 3) int32 rows (layer, expert, slot) of the slot writes libllama's observers started
        during the last cached graph (eager admission), and how many of the first are lane copies
        (moecache.live.boundary.Boundary.admitted)."""
        return self.boundary.admitted()

    # --- reporting ------------------------------------------------------------------------

    def stats(self) -> dict:
        engine = self.engine.stats([layer.expert_bytes for layer in self.layers])
        counters, counts = engine["layers"], self.counts
        return {
            "tier": "RAM" if self.tier == native.RAM else "device",
            "slots": self.slots,
            "inserts": self.config.inserts,
            "policy": self.config.policy,
            "admission": self.config.admission,
            "device_bytes": self.device_bytes,
            "steps": counts.steps,
            "decode_steps": counts.decode_steps,
            "decode_tokens": counts.decode_tokens,
            "prefill_steps": counts.prefill_steps,
            "prefill_tokens": counts.prefill_tokens,
            "hit_rate": engine["hit_rate"],
            "totals": engine["totals"],
            # the decode's uploads (the prompts' apart): what the link carried per decode token
            "link_bytes_per_token": engine["totals"]["upload_bytes"] / counts.decode_tokens
            if counts.decode_tokens else None,
            "planner": self.planner.to_json() if self.planner else None,
            "step_us_mean": counts.step_ns / counts.steps / 1e3 if counts.steps else None,
            "step_us_max": counts.step_ns_max / 1e3,
            "upload_wait_us": int(self.boundary.wait_us),
            "failed": self.failed,
            "layers": [{"layer": layer.il, **{name: values[i] for name, values in counters.items()},
                        **(self.reads.layers[i] if self.reads else {})} for i, layer in enumerate(self.layers)],
            # the RAM tier's reads of the model file: per phase, and decode's per token
            **({"reads": self.reads.to_json()} if self.reads else {}),
            "plan": self.plan.to_json(),
            # the RAM tier under this device cache: its lookups are this cache's misses (a file
            # read is its miss)
            **({"ram_tier": self.below.stats()} if self.below else {}),
        }

    def summary(self) -> str:
        s = self.stats()
        line = (f"moecache: {s['decode_steps']} decode steps ({s['decode_tokens']} tokens), hit rate {_rate(s)}, "
                f"{s['totals']['uploads']} uploads ({s['totals']['late']} late), {s['totals']['evictions']} evictions, "
                f"step {s['step_us_mean'] or 0:.0f} us mean, upload wait {s['upload_wait_us'] / 1e3:.1f} ms"
                + (f", {s['totals']['lane_misses']} misses through the lane, {s['totals']['declined']} uploads "
                   f"declined by the planner" if s["planner"] else ""))
        if self.below:
            ram = s["ram_tier"]
            line += (f"; RAM tier: hit rate {_rate(ram)} of the lookups the device did not serve, "
                     f"{ram['totals']['misses']} misses")
        return line

    def close(self):
        """Write stats, trace and profile (once: when the context is freed, else at exit). The
        context may be gone: only Python state is read here."""
        if self._closed:
            return
        self._closed = True
        if self.below:
            self.below.close()
        if self.config.debug and self.above is None:
            print(self.summary(), file=sys.stderr)
        self.reports.close()

    def detach(self):
        """Forget this cache without reporting; a new init of the same context replaces it."""
        self.detached = True
        self._closed = True
        atexit.unregister(self.close)
        if self.below:
            self.below.detach()

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
            self.lib.llama_moe_cache_get_counters(self.ctx, self.tier, i, c)
            out.append({"hits": c.hits, "misses": c.misses, "lane": c.lane, "uploads": c.uploads,
                        "upload_bytes": c.upload_bytes, "read_ahead": c.read_ahead, "read_ahead_used": c.read_ahead_used,
                        "read_ahead_bytes": c.read_ahead_bytes, "read_ahead_wasted_bytes": c.read_ahead_wasted_bytes,
                        "read_wait_us": c.read_wait_us})
        return out


def _rate(stats: dict) -> str:
    return "n/a" if stats["hit_rate"] is None else f"{100 * stats['hit_rate']:.1f}%"


def _engine(config: CacheConfig, layers: list[CachedLayer], slots: int, n_used: int,
            planner: PlannerRates | None, *, ram: bool, above: int) -> CacheEngine:
    """The engine of the cached layers, warm started from the usage profile when there is one
    (with the experts after the `above` most used: those a device cache above holds)."""
    n_expert = layers[0].n_expert
    if any(layer.n_expert != n_expert for layer in layers):
        raise CacheUnavailable("layers with different expert counts are not supported")
    # the RAM tier reads every miss anyway: each may take a slot, if the policy says it is worth more
    inserts = slots if ram else config.inserts
    miss_planner = MissPlanner(planner.rates, [layer.expert_bytes for layer in layers], n_used=n_used) \
        if planner else None
    engine = CacheEngine(len(layers), n_expert, slots, make_policy(config.policy),
                         inserts=inserts, admission=config.admission, miss_planner=miss_planner, n_used=n_used)
    if config.profile and os.path.exists(config.profile):
        try:
            profile = UsageProfile.load(config.profile, layers=[layer.il for layer in layers], n_expert=n_expert)
        except ProfileError as e:
            raise ConfigError(f"LLAMA_MOE_CACHE_PROFILE: {e}") from None
        engine.preload([top[above:] for top in profile.top(above + slots)], rates=profile.rates(n_used))
    return engine
