"""What a live cache reports: the counts of its decode-step boundaries (for its stats), the trace
of its routing (LLAMA_MOE_CACHE_TRACE), and its stats JSON (LLAMA_MOE_CACHE_STATS) and usage
profile (LLAMA_MOE_CACHE_PROFILE), written when it closes and every LLAMA_MOE_CACHE_FLUSH_STEPS
decode steps."""

from __future__ import annotations

import errno
import logging
import os
import threading
from dataclasses import dataclass
from collections.abc import Callable

import numpy as np

from ..core.engine import CacheEngine
from ..formats.profile import UsageProfile
from ..formats.trace_writer import TraceWriter
from ..formats.traces import DECODE, PREFILL, READS
from ..util import write_json
from .boundary import Observed
from .config import CacheConfig, ConfigError
from .probe import CachedLayer

log = logging.getLogger("moecache")


@dataclass
class StepCounts:
    steps: int = 0
    decode_steps: int = 0    # steps that observed a cached ubatch
    decode_tokens: int = 0   # the tokens of those ubatches
    prefill_steps: int = 0   # steps that observed a stock ubatch (a prompt)
    prefill_tokens: int = 0
    step_ns: int = 0         # time in the step callback, of the steps that did not fail
    step_ns_max: int = 0

    def add(self, observed: Observed) -> None:
        if observed.prefill:
            self.prefill_steps += 1
            self.prefill_tokens += observed.n_tokens
        else:
            self.decode_steps += 1
            self.decode_tokens += observed.n_tokens

    def timed(self, ns: int) -> None:
        self.step_ns += ns
        self.step_ns_max = max(self.step_ns_max, ns)


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO)  # the disk's, not the path's


class TraceRecorder:
    """The cache's routing as a route_trace v1 file: its step numbers count the tokens of both
    phases, and a prompt after decoding starts a new turn. A write that fails (e.g. a full disk)
    stops the trace, logged, not the cache. The RAM tier (ram_tier) looks every ubatch up, a
    prompt's too: its trace records a ubatch of more than one token as a prompt (libllama does
    not tell the step which tokens asked for outputs), so that a replay tells its prompts from
    its decode tokens (moecache.offline's RAM model feeds both to the engine alike); its rows
    carry what the tier read for each layer (the READS columns)."""

    def __init__(self, path: str, *, model_name: str, arch: str, layers: list[CachedLayer], n_used: int,
                 ram_tier: bool = False):
        try:
            self.writer = TraceWriter(
                path, model=os.path.basename(model_name) or "model", arch=arch,
                n_layer=max(layer.il for layer in layers) + 1, n_expert=layers[0].n_expert, n_expert_used=n_used,
                layers=[(layer.il, layer.expert_bytes, 0) for layer in layers], reads=ram_tier)
        except OSError as e:
            if e.errno not in _DISK_FULL:  # a bad path is the setting's fault
                raise ConfigError(f"LLAMA_MOE_CACHE_TRACE={path!r}: {e.strerror or e}") from None
            log.error("moecache: error: LLAMA_MOE_CACHE_TRACE=%r: %s - no trace, the cache runs",
                      path, e.strerror or e)
            self.writer = None
        except ValueError as e:
            raise ConfigError(f"LLAMA_MOE_CACHE_TRACE={path!r}: {e}") from None
        self.path, self.ram_tier = path, ram_tier
        self._turn = 0
        self._tokens = 0
        self._phase = None
        # the RAM tier's reads not written yet: of a layer that ran no token of its batch
        self._unwritten = np.zeros((len(layers), len(READS)), dtype=np.int64) if ram_tier else None

    def record(self, observed: Observed, decode_steps: int, reads: list[dict] | None = None) -> None:
        """One boundary's selections and their hits; decode_steps: the steps before it; reads:
        the RAM tier's, per layer (TierReads.update), written with the first batch that runs the layer."""
        if self.writer is None:
            return
        if reads is not None:
            self._unwritten += [[layer[name] for name in READS] for layer in reads]
            reads = np.where((observed.ids >= 0).any(axis=1)[:, None], self._unwritten, 0)
            self._unwritten -= reads
        prompt = observed.prefill or (self.ram_tier and observed.n_tokens > 1)
        phase = PREFILL if prompt else DECODE
        if phase == PREFILL and self._phase == DECODE:
            self._turn += 1
        self._phase = phase
        try:
            self.writer.write_step(self._turn, phase, self._tokens, observed.ids, None, observed.hits.astype(np.int8),
                                   reads)
            self._tokens += observed.n_tokens
        except (OSError, ValueError) as e:
            log.error("moecache: error: LLAMA_MOE_CACHE_TRACE=%r: %s - trace stopped after %d steps",
                      self.path, getattr(e, "strerror", None) or e, decode_steps)
            self.writer.close()
            self.writer = None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class Reports:
    """The stats JSON and the usage profile, each written atomically and on its own (one that
    fails does not keep the other from being written; its error is logged once), and the trace
    flushed to the disk. The profile file gets this run's new usage added to what it holds
    (another run or context may have added to it meanwhile)."""

    def __init__(self, config: CacheConfig, engine: CacheEngine, *, stats: Callable[[], dict],
                 layers: list[int], profile_name: str, trace: TraceRecorder | None):
        self.config = config
        self._engine, self._stats = engine, stats
        self._layers = layers
        self._profile_name = profile_name
        self._profile_saved = np.zeros_like(engine.usage)  # usage already added to the file
        self._trace = trace
        self._errors: set[str] = set()
        self._flusher = None  # the thread writing the last periodic snapshot

    def write(self) -> None:
        self._write(self._snapshot())

    def flush_in_background(self) -> None:
        """So that a crash loses at most FLUSH_STEPS decode steps: the decode thread only takes
        a snapshot, a thread writes it (the writes wait for the disk, tens of ms). Skipped
        while the previous one still writes."""
        if self._flusher is not None and self._flusher.is_alive():
            return
        self._flusher = threading.Thread(target=self._write, args=(self._snapshot(),),
                                         name="moecache-flush", daemon=True)
        self._flusher.start()

    def close(self) -> None:
        """The final reports, after the last periodic snapshot (which must not land after them)."""
        if self._flusher is not None:
            self._flusher.join()
        if self._trace:
            self._trace.close()
        self.write()

    def _snapshot(self):
        return (self._stats() if self.config.stats else None,
                self._engine.usage.copy() if self.config.profile else None)

    def _write(self, snapshot) -> None:
        stats, usage = snapshot
        if stats is not None:
            self._report("STATS", lambda: write_json(self.config.stats, stats))
        if usage is not None:
            self._report("PROFILE", lambda: self._save_profile(usage))
        writer = self._trace.writer if self._trace else None  # the decode thread drops it if a write fails
        if writer:
            self._report("TRACE", writer.flush)

    def _report(self, name: str, write) -> None:
        try:
            write()
        except (OSError, ValueError) as e:  # one line, never a traceback; once per problem
            message = (f"moecache: error: LLAMA_MOE_CACHE_{name}={getattr(self.config, name.lower())!r}: "
                       f"{getattr(e, 'strerror', None) or e} - not written")
            if message not in self._errors:
                self._errors.add(message)
                log.error("%s", message)

    def _save_profile(self, usage) -> None:
        new = usage - self._profile_saved  # what the file does not have yet
        if not new.any():
            return
        # another run or context may have added to the file: merged under its lock
        UsageProfile(self._profile_name, self._layers, new).add_to(self.config.profile)
        self._profile_saved = usage
