"""Routing traces: read and write the route_trace v1 CSV (BigMoeOnEdge's `--route-trace`).

Format (columns are read by name, so their order may change):

    # route_trace v1
    # model=... arch=... n_layer=48 n_expert=128 n_expert_used=6
    # layer=0 expert_bytes=3059712 dense_bytes=11953152      (one line per MoE layer)
    turn,phase,step,layer,slot,expert,weight,residency,expert_bytes[,dropped]

One row per (turn, step, layer, router rank). phase 0 is prefill, 1 decode; `slot` is the
router rank; `residency` is the recording engine's outcome (0 miss, 1 hit, 2 prefetched hit).

The `expert_bytes` COLUMN is the number of bytes that lookup read, not the expert's size: it
is 0 for a hit and, in prefill, for an expert already read earlier in the same batched pass
(in the shared traces every non-zero value equals the layer's preamble size). Expert sizes
therefore come from the preamble only, and a layer without a preamble line is an error.
The optional `dropped` column is parsed and kept; the replay models do not use it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

MAGIC = "# route_trace v1"
REQUIRED_COLUMNS = ("turn", "phase", "step", "layer", "slot", "expert", "weight",
                    "residency", "expert_bytes")
OPTIONAL_COLUMNS = ("dropped",)
PREFILL, DECODE = 0, 1

# The real traces the repository ships (traces/README.md: source, licence): the one place that
# knows where they are.
TRACES_DIR = Path(__file__).resolve().parents[1] / "traces"
SHIPPED_TRACES = (TRACES_DIR / "qwen3-30b-a3b.route.csv", TRACES_DIR / "gpt-oss-120b.route.csv")


class TraceError(ValueError):
    """Malformed trace; the message starts with `file:line:` when a line is to blame."""


@dataclass
class RouteTrace:
    """A parsed trace as dense arrays, one entry per step (token) in (turn, step) order.

    `layers` are the model's MoE layer numbers; array axis 1 indexes into it. A prefill token
    is one step here too (phase PREFILL); consumers decide how to batch prefill.
    """

    path: str
    model: str
    arch: str
    n_layer: int
    n_expert: int
    n_expert_used: int
    layers: np.ndarray          # (n_layers,) model layer numbers, ascending
    expert_bytes: np.ndarray    # (n_layers,) bytes of one expert of that layer
    dense_bytes: np.ndarray     # (n_layers,)
    turn: np.ndarray            # (n_steps,)
    step: np.ndarray            # (n_steps,)
    phase: np.ndarray           # (n_steps,) PREFILL or DECODE
    ids: np.ndarray             # (n_steps, n_layers, k) int32 expert ids by router rank, -1 = layer not run
    weights: np.ndarray         # (n_steps, n_layers, k) float32 router weights
    residency: np.ndarray       # (n_steps, n_layers, k) int8 recorded outcome
    dropped: np.ndarray         # (n_steps, n_layers, k) bool; all False if the column is absent

    @property
    def decode_ids(self) -> np.ndarray:
        return self.ids[self.phase == DECODE]

    def working_set_bytes(self) -> int:
        """Bytes one token touches: sum over layers of top-k x expert size."""
        return int(self.expert_bytes.sum()) * self.n_expert_used


# --- reading ---------------------------------------------------------------------------

def _parse_preamble_fields(path, lineno, text, wanted):
    fields = {}
    for item in text.split():
        key, sep, value = item.partition("=")
        if not sep:
            raise TraceError(f"{path}:{lineno}: expected key=value, got {item!r}")
        fields[key] = value
    missing = [k for k in wanted if k not in fields]
    if missing:
        raise TraceError(f"{path}:{lineno}: preamble lacks {', '.join(missing)}")
    return fields


def _int_field(path, lineno, fields, key, minimum):
    try:
        value = int(fields[key])
    except ValueError:
        raise TraceError(f"{path}:{lineno}: {key}={fields[key]!r} is not an integer") from None
    if value < minimum:
        raise TraceError(f"{path}:{lineno}: {key}={value} must be >= {minimum}")
    return value


def read_route_trace(path: str) -> RouteTrace:
    try:
        with open(path, "r", encoding="utf-8") as f:
            lines = f.read().split("\n")
    except OSError as e:
        raise TraceError(f"{path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not UTF-8 text") from None
    if not lines or lines[0].strip() != MAGIC:
        raise TraceError(f"{path}:1: not a route trace (first line must be {MAGIC!r})")

    model_fields = None
    layer_bytes: dict[int, tuple[int, int]] = {}
    header_line = None
    for i, line in enumerate(lines[1:], start=2):
        if not line.startswith("#"):
            header_line = i
            break
        body = line[1:].strip()
        if body.startswith("model="):
            model_fields = _parse_preamble_fields(
                path, i, body, ("model", "arch", "n_layer", "n_expert", "n_expert_used"))
        elif body.startswith("layer="):
            f = _parse_preamble_fields(path, i, body, ("layer", "expert_bytes"))
            layer = _int_field(path, i, f, "layer", 0)
            expert_bytes = _int_field(path, i, f, "expert_bytes", 1)
            dense = _int_field(path, i, f, "dense_bytes", 0) if "dense_bytes" in f else 0
            if layer in layer_bytes:
                raise TraceError(f"{path}:{i}: layer {layer} described twice")
            layer_bytes[layer] = (expert_bytes, dense)
    if model_fields is None:
        raise TraceError(f"{path}:2: preamble lacks the model= line")
    if header_line is None:
        raise TraceError(f"{path}:{len(lines)}: no column header")
    n_layer = _int_field(path, 2, model_fields, "n_layer", 1)
    n_expert = _int_field(path, 2, model_fields, "n_expert", 1)
    k = _int_field(path, 2, model_fields, "n_expert_used", 1)
    for layer in layer_bytes:
        if layer >= n_layer:
            raise TraceError(f"{path}: preamble layer {layer} >= n_layer={n_layer}")

    header = [c.strip() for c in lines[header_line - 1].split(",")]
    missing = [c for c in REQUIRED_COLUMNS if c not in header]
    if missing:
        raise TraceError(f"{path}:{header_line}: header lacks column(s) {', '.join(missing)}")
    unknown = [c for c in header if c not in REQUIRED_COLUMNS + OPTIONAL_COLUMNS]
    if unknown:
        raise TraceError(f"{path}:{header_line}: unknown column(s) {', '.join(unknown)}")
    col = {name: header.index(name) for name in header}
    n_cols = len(header)

    data = lines[header_line:]
    while data and not data[-1].strip():
        data.pop()
    rows = np.empty((len(data), 7), dtype=np.int64)  # turn phase step layer slot expert residency
    weight = np.empty(len(data), dtype=np.float32)
    dropped = np.zeros(len(data), dtype=bool)
    int_cols = [col[c] for c in ("turn", "phase", "step", "layer", "slot", "expert", "residency")]
    bytes_col, weight_col = col["expert_bytes"], col["weight"]
    dropped_col = col.get("dropped")
    for r, line in enumerate(data):
        lineno = header_line + 1 + r
        parts = line.split(",")
        if len(parts) != n_cols:
            raise TraceError(f"{path}:{lineno}: expected {n_cols} fields, got {len(parts)}")
        try:
            rows[r] = [int(parts[c]) for c in int_cols]
            if int(parts[bytes_col]) < 0:
                raise TraceError(f"{path}:{lineno}: negative expert_bytes")
            if dropped_col is not None:
                dropped[r] = int(parts[dropped_col]) != 0
        except ValueError as e:
            if isinstance(e, TraceError):
                raise
            bad = next(c for c in int_cols + [bytes_col] + ([dropped_col] if dropped_col is not None else [])
                       if not _is_int(parts[c]))
            raise TraceError(f"{path}:{lineno}: {header[bad]}={parts[bad].strip()!r} is not an integer") from None
        try:
            weight[r] = float(parts[weight_col])
        except ValueError:
            raise TraceError(f"{path}:{lineno}: weight={parts[weight_col].strip()!r} is not a number") from None

    turn, phase, step, layer, slot, expert, residency = rows.T

    def fail_at(mask, what):
        bad = np.flatnonzero(mask)
        if bad.size:
            r = int(bad[0])
            raise TraceError(f"{path}:{header_line + 1 + r}: {what(r)}")

    fail_at(turn < 0, lambda r: f"turn={turn[r]} is negative")
    fail_at((phase != PREFILL) & (phase != DECODE), lambda r: f"phase={phase[r]} is not 0 or 1")
    fail_at(step < 0, lambda r: f"step={step[r]} is negative")
    fail_at((layer < 0) | (layer >= n_layer), lambda r: f"layer={layer[r]} out of range [0, {n_layer})")
    known = np.zeros(n_layer, dtype=bool)
    known[list(layer_bytes)] = True
    fail_at(~known[np.clip(layer, 0, n_layer - 1)],
            lambda r: f"layer={layer[r]} has no expert_bytes in the preamble")
    fail_at((slot < 0) | (slot >= k), lambda r: f"slot={slot[r]} out of range [0, {k})")
    fail_at((expert < 0) | (expert >= n_expert), lambda r: f"expert={expert[r]} out of range [0, {n_expert})")
    fail_at((residency < 0) | (residency > 2), lambda r: f"residency={residency[r]} is not 0, 1 or 2")

    layers = np.array(sorted(set(layer.tolist())), dtype=np.int64)
    if layers.size == 0:
        raise TraceError(f"{path}:{header_line}: no rows")
    layer_index = np.full(n_layer, -1, dtype=np.int64)
    layer_index[layers] = np.arange(layers.size)
    n_layers = layers.size

    # Steps are identified by (turn, step); each must carry one phase and a full k x layers grid.
    step_key = turn * (int(step.max()) + 1) + step
    keys, first_row, step_of_row = np.unique(step_key, return_index=True, return_inverse=True)
    n_steps = keys.size
    step_phase = phase[first_row]
    fail_at(phase != step_phase[step_of_row],
            lambda r: f"step {step[r]} of turn {turn[r]} mixes prefill and decode rows")
    cell = (step_of_row * n_layers + layer_index[layer]) * k + slot
    order = np.argsort(cell, kind="stable")
    repeated = order[1:][cell[order[1:]] == cell[order[:-1]]]
    fail_at(np.isin(np.arange(len(data)), repeated[:1]),
            lambda r: f"duplicate row for turn {turn[r]} step {step[r]} layer {layer[r]} slot {slot[r]}")
    seen = np.zeros(n_steps * n_layers * k, dtype=bool)
    seen[cell] = True
    # A layer may be absent from a prefill token as a whole (llama.cpp runs the last layer only
    # for the tokens whose logits are wanted); those cells read -1. Anything else is a hole.
    groups = seen.reshape(n_steps, n_layers, k)
    partial = groups.any(axis=2) & ~groups.all(axis=2)
    partial |= ~groups.any(axis=2) & (step_phase == DECODE)[:, None]
    if partial.any():
        s, li = (int(v[0]) for v in np.nonzero(partial))
        r = int(first_row[s])
        raise TraceError(f"{path}:{header_line + 1 + r}: turn {turn[r]} step {step[r]} lacks rows for "
                         f"layer {layers[li]} (a decode step needs all {k} ranks of every layer, "
                         f"a prefill step all or none)")

    def grid(values, dtype, absent):
        out = np.full(n_steps * n_layers * k, absent, dtype=dtype)
        out[cell] = values
        return out.reshape(n_steps, n_layers, k)

    eb = np.array([layer_bytes[int(l)][0] for l in layers], dtype=np.int64)
    db = np.array([layer_bytes[int(l)][1] for l in layers], dtype=np.int64)
    return RouteTrace(
        path=path, model=model_fields["model"], arch=model_fields["arch"],
        n_layer=n_layer, n_expert=n_expert, n_expert_used=k,
        layers=layers, expert_bytes=eb, dense_bytes=db,
        turn=turn[first_row], step=step[first_row], phase=step_phase.astype(np.int8),
        ids=grid(expert, np.int32, -1), weights=grid(weight, np.float32, 0.0),
        residency=grid(residency, np.int8, 0), dropped=grid(dropped, bool, False))


def _is_int(text: str) -> bool:
    try:
        int(text)
        return True
    except ValueError:
        return False


# --- reader registry -------------------------------------------------------------------

@dataclass(frozen=True)
class TraceReader:
    name: str
    sniff: Callable[[str], bool]      # first line of the file -> is it this format?
    read: Callable[[str], RouteTrace]


READERS: dict[str, TraceReader] = {}


def register_reader(reader: TraceReader) -> None:
    READERS[reader.name] = reader


register_reader(TraceReader("route_trace_v1", lambda first: first.strip() == MAGIC, read_route_trace))


def read_trace(path: str, fmt: str | None = None) -> RouteTrace:
    """Read a trace, by explicit format name or by sniffing its first line."""
    if fmt is not None:
        if fmt not in READERS:
            raise TraceError(f"unknown trace format {fmt!r}; known: {', '.join(sorted(READERS))}")
        return READERS[fmt].read(path)
    try:
        with open(path, "r", encoding="utf-8") as f:
            first = f.readline()
    except OSError as e:
        raise TraceError(f"{path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not UTF-8 text") from None
    for reader in READERS.values():
        if reader.sniff(first):
            return reader.read(path)
    raise TraceError(f"{path}:1: unrecognised trace format (known: {', '.join(sorted(READERS))})")


# --- writing ---------------------------------------------------------------------------

class TraceWriter:
    """Write a route_trace v1 file incrementally, one step per write_step call.

    Each step goes out as ONE write(2) on an O_APPEND descriptor, so a process that dies
    leaves whole steps behind: the file is always a readable prefix of the run.
    `layers` are (model layer number, expert_bytes, dense_bytes) for each cached layer, in
    the order the rows of `ids` passed to write_step follow. Any model and arch name is
    accepted; the preamble records it as one word (see _preamble_word).
    """

    def __init__(self, path: str, *, model: str, arch: str, n_layer: int, n_expert: int,
                 n_expert_used: int, layers: Sequence[tuple[int, int, int]]):
        if not layers:
            raise ValueError("TraceWriter needs at least one layer")
        for layer, expert_bytes, _ in layers:
            if not 0 <= layer < n_layer or expert_bytes <= 0:
                raise ValueError(f"bad layer entry ({layer}, {expert_bytes}): layer must be in "
                                 f"[0, {n_layer}) and expert_bytes > 0")
        self.path = path
        self.n_expert = n_expert
        self.k = n_expert_used
        self.layers = np.array([l for l, _, _ in layers], dtype=np.int64)
        self.expert_bytes = np.array([b for _, b, _ in layers], dtype=np.int64)
        preamble = [MAGIC, f"# model={_preamble_word(model)} arch={_preamble_word(arch)} "
                           f"n_layer={n_layer} n_expert={n_expert} "
                           f"n_expert_used={n_expert_used}"]
        preamble += [f"# layer={l} expert_bytes={b} dense_bytes={d}" for l, b, d in layers]
        preamble.append(",".join(REQUIRED_COLUMNS))
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        self._write("\n".join(preamble) + "\n")

    def _write(self, text: str) -> None:
        data = text.encode()
        while data:
            data = data[os.write(self._fd, data):]

    def write_step(self, turn: int, phase: int, step: int, ids, weights, residency) -> None:
        """ids, residency: (n_layers, n_used) ints; weights: same shape or None (written as nan).
        n_used may be a multiple of k (several tokens); rank = position modulo k. A layer
        whose k ids for a token are all -1 did not run for it and gets no rows."""
        if self._fd is None:
            raise ValueError(f"{self.path}: TraceWriter is closed")
        ids = np.asarray(ids)
        residency = np.asarray(residency)
        if ids.ndim != 2 or ids.shape[0] != self.layers.size or ids.shape[1] % self.k:
            raise ValueError(f"ids shape {ids.shape} is not ({self.layers.size}, multiple of {self.k})")
        if residency.shape != ids.shape:
            raise ValueError(f"residency shape {residency.shape} != ids shape {ids.shape}")
        if ids.size and (ids.min() < -1 or ids.max() >= self.n_expert):
            raise ValueError(f"expert id out of range [-1, {self.n_expert})")
        groups = ids.reshape(ids.shape[0], -1, self.k) >= 0  # (layers, tokens, k)
        if (groups.any(axis=2) != groups.all(axis=2)).any():
            raise ValueError("a layer's token must have all k experts or none (-1)")
        weights = np.full(ids.shape, np.nan) if weights is None else np.asarray(weights)
        if weights.shape != ids.shape:
            raise ValueError(f"weights shape {weights.shape} != ids shape {ids.shape}")
        n_layers, n_used = ids.shape
        out = []
        for token in range(n_used // self.k):
            for li in range(n_layers):
                if not groups[li, token, 0]:  # layer not run for this token: no rows
                    continue
                layer, size = int(self.layers[li]), int(self.expert_bytes[li])
                for rank in range(self.k):
                    j = token * self.k + rank
                    res = int(residency[li, j])
                    out.append(f"{turn},{phase},{step + token},{layer},{rank},{int(ids[li, j])},"
                               f"{float(weights[li, j]):.6g},{res},{0 if res else size}\n")
        self._write("".join(out))

    def flush(self) -> None:
        """To the disk: the steps are in the file already (one write each), this survives a
        crash of the machine too."""
        fd = self._fd
        if fd is not None:
            os.fsync(fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _preamble_word(text: str) -> str:
    """`text` as one key=value word of the preamble: model names have spaces ("SmolLM2 135M
    Instruct"), the reader splits on whitespace; every other run of characters becomes '_'."""
    return re.sub(r"[^\w.+-]+", "_", str(text)).strip("_") or "unknown"


def synthetic_routing(n_steps: int, n_layers: int, n_expert: int, k: int, *, skew: float = 1.0,
                      stickiness: float = 1.5, drift: float = 0.05, seed: int = 0) -> np.ndarray:
    """Random routing with the locality real decode shows, as (n_steps, n_layers, k) int32.

    Each layer draws its top-k by Gumbel-top-k over log-popularities: a Zipf(skew) profile in
    a random order, random-walking by `drift` per step, plus `stickiness` for the experts the
    previous step chose (consecutive tokens share experts). skew=0, stickiness=0 is uniform.
    """
    rng = np.random.default_rng(seed)
    zipf = -skew * np.log(np.arange(1, n_expert + 1))
    log_pop = np.stack([rng.permutation(zipf) for _ in range(n_layers)])
    out = np.empty((n_steps, n_layers, k), dtype=np.int32)
    previous = np.zeros((n_layers, n_expert))
    rows = np.arange(n_layers)[:, None]
    for t in range(n_steps):
        log_pop += drift * rng.standard_normal(log_pop.shape)
        score = log_pop + previous + rng.gumbel(size=log_pop.shape)
        top = np.argpartition(-score, k - 1, axis=1)[:, :k]
        out[t] = np.take_along_axis(top, np.argsort(-score[rows, top], axis=1), axis=1)
        previous = np.zeros_like(previous)
        previous[rows, top] = stickiness
    return out
