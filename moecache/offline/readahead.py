"""Reading ahead in the RAM tier's decode (issue 21, item 2), MODELLED: while layer l computes,
read the experts the next layer will likely miss, so the disk works while the CPU does.
`simulate(..., read_ahead=ReadAhead(...))` (per-layer model, the RAM tier's run) feeds it each
decode token with the engine's outcome; `python -m moecache.replay --ram-mib N --disk-gbps G
--expert-read-ahead PREDICTOR:R` prints it beside the tier without read-ahead.

Predictors (PREDICTORS) see routing only (the live tier's observer has no activations), and the
online ones only the past: scores(src layer, its selection in this token, dst layer) ranks the
dst layer's experts, learn(token) is called once a token's selections are all known, after
every prediction that token's layers made (so a prediction never sees its own answer).
- temporal: the dst layer's selection in the previous token, in router rank order.
- cooccur: how often each dst expert was selected in the same token as (or, for layer 0, in the
  token after) each of the src selection's experts, over all tokens seen (prompts included),
  summed as conditional frequencies. cooccur-decayed: the same, counts halved every 16 tokens.
  Cost: n_layers x n_expert^2 counts.
- frequency: the dst layer's decayed use count (half-life 16 tokens): the default policy's
  (heat's) estimate, of the experts it did not keep.
- oracle: the dst layer's actual selection, read from the future: an upper BOUND, not a
  predictor.
- router: what ships: the next layer's router applied to this layer's input, stood for by the
  dst layer's actual selection, each of its misses found with probability ROUTER_RECALL and in
  its place an expert the layer did not select (seeded; read, and wasted, when not kept); the
  next token's layer 0 from its token embeddings, the same way (ASSUMED: the recall measured is
  layers 1..'s), read from the next token's start (its graph applies the router there).
- none: reads nothing ahead (the tier as it runs, on this timeline).
Each reads ahead the R best-scored experts of the dst layer that are not kept in RAM (score > 0);
R "w" (window): as many as the disk can read before the dst layer's observer if the CPU's
compute does not change (the rest of this layer's experts and the dst layer's dense weights,
after what the disk has queued), at most n_used: a read-ahead that never delays a demand read.

Timing: one CPU and one disk, the disk serving its requests in order (a read started is not
cancelled). Per layer: its dense weights computed (dense bytes / host); at its observer, the
misses not read ahead are read (one request latency + bytes / disk, after whatever the disk has
queued, read-ahead included); the CPU computes the layer's experts kept in RAM meanwhile, as the
tier does, then waits for those reads and for the read-ahead batch that covered some of its
misses (a layer that needs nothing from the disk does not wait: optimistic, the tier's
read-ahead thread is joined anyway) and computes the misses (bytes / host); the next layer's
read-ahead is queued behind the layer's reads (latency + bytes / disk, the next layer's expert
size). The last layer reads ahead the next decode token's layer 0 (none before a prompt or at
the end; `router` from the token's end, where the next graph starts). The CPU's work on what a layer read and queued (Disk.read_cpu_ms: per
MB and per request, CALIBRATED: moecache.offline.calibration) follows the layer's experts, beside
no compute.
Uploads issued at a boundary are read after the token, the CPU waiting, as
moecache.offline.cost.Disk has it; without read-ahead the timeline is Disk.tier_token_ms
exactly (tested). A read-ahead holds at most R experts of one layer in RAM beyond the tier's K
until its layer runs.
"""

from __future__ import annotations

import numpy as np

from ..util import IntegerError, parse_int
from .cost import Disk

HALF_LIFE = 16.0  # tokens; the default policy's (Heat) half-life
# MEASURED, the live tier's (its traces in traces/, "the RAM tier's reads"): of layers 1..L-1's
# decode misses, the share it had read ahead, 94.4% on the Qwen3-30B-A3B shape and 96.5% on the
# gpt-oss-20b shape (tests/test_ram_model.py holds it to both)
ROUTER_RECALL = 0.95


class Predictor:
    """scores(src, selection, dst) -> (n_expert,) higher is likelier, <= 0 never read ahead;
    learn(rows): one token's selections per layer, after its predictions."""

    name = "?"
    reads_future = False
    next_token_at_start = False  # the next token's layer 0 is predicted when its graph starts, not before

    def bind(self, n_layers: int, n_expert: int) -> None:
        self.n_layers, self.n_expert = n_layers, n_expert

    def scores(self, src: int, selection: np.ndarray, dst: int, future: np.ndarray | None = None,
               kept: np.ndarray | None = None) -> np.ndarray:
        """future, kept: the dst layer's selection and its experts kept, for a predictor that reads the future."""
        raise NotImplementedError

    def learn(self, rows) -> None:
        pass


def _ranked(selection, n_expert) -> np.ndarray:
    """Scores n_used..1 for a selection in router rank order, 0 elsewhere."""
    score = np.zeros(n_expert)
    score[selection] = np.arange(len(selection), 0, -1)
    return score


class Temporal(Predictor):
    name = "temporal"

    def bind(self, n_layers, n_expert):
        super().bind(n_layers, n_expert)
        self.last = [np.empty(0, dtype=np.int64)] * n_layers

    def scores(self, src, selection, dst, future=None):
        return _ranked(self.last[dst], self.n_expert)

    def learn(self, rows):
        self.last = list(rows)


class Cooccur(Predictor):
    name = "cooccur"

    def __init__(self, half_life: float | None = None):
        self.decay = 1.0 if half_life is None else 0.5 ** (1.0 / half_life)

    def bind(self, n_layers, n_expert):
        super().bind(n_layers, n_expert)
        # counts[l, i, j]: tokens where expert i of layer l was followed by expert j of layer
        # l + 1 (the last layer: by layer 0 of the next token); seen[l, i]: tokens with i at l
        self.counts = np.zeros((n_layers, n_expert, n_expert))
        self.seen = np.zeros((n_layers, n_expert))
        self.previous_last = None

    def scores(self, src, selection, dst, future=None):
        seen = self.seen[src, selection]
        known = seen > 0
        return (self.counts[src, selection[known]] / seen[known, None]).sum(axis=0)

    def learn(self, rows):
        if self.decay != 1.0:
            self.counts *= self.decay
            self.seen *= self.decay
        L = self.n_layers
        for layer in range(L - 1):
            self._count(layer, rows[layer], rows[layer + 1])
        if self.previous_last is not None:
            self._count(L - 1, self.previous_last, rows[0])
        self.previous_last = rows[L - 1]

    def _count(self, layer, sources, targets):
        self.seen[layer, sources] += 1
        self.counts[layer, sources[:, None], targets[None, :]] += 1


class Frequency(Predictor):
    name = "frequency"

    def bind(self, n_layers, n_expert):
        super().bind(n_layers, n_expert)
        self.heat = np.zeros((n_layers, n_expert))
        self.decay = 0.5 ** (1.0 / HALF_LIFE)

    def scores(self, src, selection, dst, future=None):
        return self.heat[dst]

    def learn(self, rows):
        self.heat *= self.decay
        for layer, row in enumerate(rows):
            self.heat[layer, row] += 1


class Nothing(Predictor):
    name = "none"

    def scores(self, src, selection, dst, future=None):
        return np.zeros(self.n_expert)


class Oracle(Predictor):
    name = "oracle"
    reads_future = True

    def scores(self, src, selection, dst, future=None, kept=None):
        return _ranked(future, self.n_expert)


class Router(Predictor):
    name = "router"
    reads_future = True
    next_token_at_start = True

    def bind(self, n_layers, n_expert):
        super().bind(n_layers, n_expert)
        self.rng = np.random.default_rng(0)

    def scores(self, src, selection, dst, future=None, kept=None):
        lost = ~kept[future] & (self.rng.random(future.size) >= ROUTER_RECALL)  # misses not found
        predicted = future.copy()
        predicted[lost] = self.rng.choice(np.setdiff1d(np.arange(self.n_expert), future), size=int(lost.sum()),
                                          replace=False)
        return _ranked(predicted, self.n_expert)


PREDICTORS = {"none": Nothing, "temporal": Temporal, "cooccur": Cooccur,
              "cooccur-decayed": lambda: Cooccur(HALF_LIFE), "frequency": Frequency, "oracle": Oracle,
              "router": Router}


WINDOW = "w"  # R: what fits the compute window


def parse_spec(text: str) -> tuple[str, int | str]:
    """'PREDICTOR:R' -> (name, R >= 1 or WINDOW), 'none' -> ('none', 1); ValueError naming the problem."""
    name, sep, width = text.partition(":")
    if text == "none":
        return name, 1
    if name not in PREDICTORS or not sep:
        raise ValueError(f"{text!r}: expected PREDICTOR:R with PREDICTOR one of {', '.join(PREDICTORS)}")
    if width == WINDOW:
        return name, WINDOW
    try:
        return name, parse_int(width, "", minimum=1)
    except IntegerError as e:
        raise ValueError(f"{text!r}: R {e.detail}") from None


class ReadAhead:
    """The RAM tier's decode timeline with read-ahead (module docstring) and its counts."""

    def __init__(self, predictor: str, width: int | str, disk: Disk, host_gbps: float):
        if predictor not in PREDICTORS:
            raise ValueError(f"unknown read-ahead predictor {predictor!r}; valid: {', '.join(PREDICTORS)}")
        if width != WINDOW and not (isinstance(width, int) and width >= 1):
            raise ValueError(f"the read-ahead width must be an integer >= 1 or {WINDOW!r}, got {width!r}")
        self.name, self.width, self.disk, self.host_gbps = predictor, width, disk, host_gbps
        self.predictor = PREDICTORS[predictor]()
        self.seconds = 0.0   # the decode tokens' modelled time
        self.tokens = 0
        self.read_ahead = self.useful = self.misses = 0  # experts
        self.read_bytes = 0  # everything the decode read: misses not read ahead, read-ahead, boundary uploads
        self.waited = 0.0    # seconds the CPU waited for the disk
        self._held = None    # the last decode token, processed once the next step shows what follows it
        self._disk_free = 0.0  # when the disk has read everything queued
        self._pending = None   # (experts, when read) read ahead for the next layer to run

    def bind(self, expert_bytes, dense_bytes, n_expert: int, n_used: int) -> None:
        if hasattr(self, "expert_bytes"):
            raise ValueError("a ReadAhead times one replay: make a new one")
        self.expert_bytes = [int(b) for b in expert_bytes]
        self.dense_bytes = [int(b) for b in dense_bytes]
        self.n_used = n_used
        self.predictor.bind(len(self.expert_bytes), n_expert)

    @property
    def ms_per_token(self) -> float | None:
        return 1e3 * self.seconds / self.tokens if self.tokens else None

    @property
    def wait_ms_per_token(self) -> float | None:
        return 1e3 * self.waited / self.tokens if self.tokens else None

    @property
    def precision(self) -> float | None:
        return self.useful / self.read_ahead if self.read_ahead else None

    @property
    def recall(self) -> float | None:
        return self.useful / self.misses if self.misses else None

    def held_mib(self) -> float:
        """The most RAM a read-ahead holds beyond the tier's K: R (window: n_used) of the largest experts."""
        if self.name == "none":
            return 0.0
        return (self.n_used if self.width == WINDOW else self.width) * max(self.expert_bytes) / 2**20

    # the replay's calls
    def prompt(self, ids) -> None:
        """A prompt ubatch ((n_layers, n_tokens x n_used) ids, token by token): learnt from."""
        self._flush(None)
        ids = np.asarray(ids)
        for start in range(0, ids.shape[1], self.n_used):
            self.predictor.learn(_rows(ids[:, start:start + self.n_used]))

    def decode(self, ids, hit_mask, kept, boundary_uploads, spares=None) -> None:
        """One decode token: its (n_layers, n_used) ids, the engine's hit mask, which experts
        were kept in RAM while it ran ((n_layers, n_expert) bool) and the uploads its
        boundary issued per layer (those to read). spares: (n_layers, n_expert) bool, the
        experts in memory without a slot (moecache.offline.spares): a miss or a read-ahead of
        one reads nothing, and the read-ahead still picks it (the live tier's does)."""
        kept = np.array(kept, dtype=bool)
        token = (_rows(ids), _rows(ids, ~np.asarray(hit_mask)), kept, np.asarray(boundary_uploads),
                 np.zeros_like(kept) if spares is None else np.array(spares, dtype=bool))
        self._flush(token)
        self._held = token

    def finish(self) -> None:
        self._flush(None)

    def _flush(self, following) -> None:
        """Time the held token, with `following` (the next decode token or None) giving the
        last layer's read-ahead target and the oracle's answer for it."""
        if self._held is None:
            return
        rows, missed, kept, boundary, spares = self._held
        self._held = None
        L, host, disk = len(rows), self.host_gbps * 1e9, self.disk.gbps * 1e9
        latency = self.disk.read_us / 1e6
        clock, disk_free, pending = self.seconds, self._disk_free, self._pending
        for layer in range(L):
            size = self.expert_bytes[layer]
            clock += self.dense_bytes[layer] / host
            ahead, done = pending if pending is not None else (np.empty(0, dtype=np.int64), clock)
            covered = np.isin(missed[layer], ahead)
            self.useful += int(covered.sum())
            self.misses += missed[layer].size
            in_memory = spares[layer][missed[layer]]
            ready = done if (covered & ~in_memory).any() else clock
            demand = int((~covered & ~in_memory).sum())
            if demand:
                disk_free = max(disk_free, clock) + latency + demand * size / disk
                self.read_bytes += demand * size
                ready = max(ready, disk_free)
            n_memory = rows[layer].size - missed[layer].size + int(in_memory.sum())  # kept, and spares
            computed = clock + n_memory * size / host
            self.waited += max(0.0, ready - computed)
            end = max(computed, ready) + (rows[layer].size - n_memory) * size / host
            if layer + 1 < L:
                target, dst, future = layer + 1, (kept[layer + 1], spares[layer + 1]), rows[layer + 1]
            else:
                self.predictor.learn(rows)
                target = 0
                dst, future = (None, None) if following is None else ((following[2][0], following[4][0]), following[0][0])
            start = end if target == 0 and self.predictor.next_token_at_start else clock
            pending, disk_free, n_ahead = self._queue_ahead(layer, rows[layer], target, dst, future,
                                                            end, start, disk_free)
            # the CPU's work on what was read and queued
            clock = end + self.disk.read_cpu_ms(demand * size + n_ahead * self.expert_bytes[target],
                                                demand + n_ahead) / 1e3
        upload_bytes = sum(int(n) * b for n, b in zip(boundary.tolist(), self.expert_bytes))
        if upload_bytes:
            disk_free = max(disk_free, clock) + upload_bytes / disk
            self.read_bytes += upload_bytes
            self.waited += disk_free - clock
            clock = disk_free + self.disk.read_cpu_ms(upload_bytes, int(boundary.sum())) / 1e3
        self.seconds, self._disk_free, self._pending = clock, disk_free, pending
        self.tokens += 1

    def _queue_ahead(self, layer, selection, target, dst, future, end, clock, disk_free):
        """The read-ahead layer `layer` queues for `target` (dst: its (kept, spares); None: none),
        behind what the disk has queued: (pending (experts, when read) or None, disk_free, experts
        read)."""
        if dst is None:
            return None, disk_free, 0
        dst_kept, dst_spares = dst
        host, disk, latency = self.host_gbps * 1e9, self.disk.gbps * 1e9, self.disk.read_us / 1e6
        next_size = self.expert_bytes[target]
        width = self.width
        if width == WINDOW:  # until the next observer, after what the disk has queued
            room = end + self.dense_bytes[target] / host - max(disk_free, clock) - latency
            width = min(self.n_used, max(0, int(room * disk / next_size + 1e-9)))  # not lost to rounding
        scores = (self.predictor.scores(layer, selection, target, future, dst_kept) if self.predictor.reads_future
                  else self.predictor.scores(layer, selection, target))
        chosen = choose_reads(scores, dst_kept, width)
        if not chosen.size:
            return None, disk_free, 0
        self.read_ahead += chosen.size
        n_read = int((~dst_spares[chosen]).sum())
        if n_read:
            disk_free = max(disk_free, clock) + latency + n_read * next_size / disk
            self.read_bytes += n_read * next_size
        return (chosen, disk_free), disk_free, n_read


def _rows(ids, mask=None) -> list[np.ndarray]:
    """Per layer the selected experts (in router rank order; masked: those where mask is True)."""
    ids = np.asarray(ids)
    valid = ids >= 0
    if mask is not None:
        valid &= mask
    return [row[v].astype(np.int64) for row, v in zip(ids, valid)]


def choose_reads(scores, kept, width) -> np.ndarray:
    """The `width` best-scored experts not kept, score > 0; ties: the lower id."""
    candidates = np.flatnonzero((scores > 0) & ~kept)
    order = np.argsort(-scores[candidates], kind="stable")[:width]
    return candidates[order]
