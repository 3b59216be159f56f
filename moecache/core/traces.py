"""Routing traces: read and write the route_trace v1 CSV (BigMoeOnEdge's `--route-trace`).

Format (columns are read by name, so their order may change):

    # route_trace v1
    # model=... arch=... n_layer=48 n_expert=128 n_expert_used=6
    # layer=0 expert_bytes=3059712 dense_bytes=11953152      (one line per MoE layer)
    turn,phase,step,layer,slot,expert,weight,residency,expert_bytes[,dropped][,batch]

One row per (turn, step, layer, router rank). phase 0 is prefill, 1 decode; `slot` is the
router rank; `residency` is the recording engine's outcome (0 miss, 1 hit, 2 prefetched hit).

The `expert_bytes` COLUMN is the number of bytes that lookup read, not the expert's size: it
is 0 for a hit and, in prefill, for an expert already read earlier in the same batched pass
(in the shared traces every non-zero value equals the layer's preamble size). Expert sizes
therefore come from the preamble only, and a layer without a preamble line is an error.
The optional `dropped` column is parsed and kept; the replay models do not use it.
The optional `batch` column (written by moecache's live traces) numbers the observations: the
tokens of one batch were evaluated in one ubatch (a multi-token decode, e.g. a speculative
verification, or a prompt's ubatch), between the same two cache steps, and the per-layer replay
observes them together. Such a token may lack a layer as a whole (llama.cpp runs the last layer only for the
tokens whose logits are wanted). Without the column every decode token is its own observation.
"""

from __future__ import annotations

import csv
import errno
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..util import IntegerError, parse_int

MAGIC = "# route_trace v1"
REQUIRED_COLUMNS = ("turn", "phase", "step", "layer", "slot", "expert", "weight",
                    "residency", "expert_bytes")
OPTIONAL_COLUMNS = ("dropped", "batch")
PREFILL, DECODE = 0, 1

# The real traces the repository ships (traces/README.md: source, licence): the one place that
# knows where they are.
TRACES_DIR = Path(__file__).resolve().parents[2] / "traces"
SHIPPED_TRACES = (TRACES_DIR / "qwen3-30b-a3b.route.csv", TRACES_DIR / "gpt-oss-120b.route.csv")


class TraceError(ValueError):
    """Malformed trace; the message starts with `file:line:` when a line is to blame."""


@dataclass(eq=False)  # compared (and hashed) by identity: the replay memoises per trace
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
    batch: np.ndarray | None = None  # (n_steps,) the observation (ubatch) of each step; -1 (the
                                     # default) when not recorded: every step its own

    def __post_init__(self):
        if self.batch is None:
            self.batch = np.full(len(self.step), -1, dtype=np.int64)

    @property
    def decode_ids(self) -> np.ndarray:
        return self.ids[self.phase == DECODE]

    def working_set_bytes(self) -> int:
        """Bytes one token touches: sum over layers of top-k x expert size."""
        return int(self.expert_bytes.sum()) * self.n_expert_used

    def select(self, steps) -> "RouteTrace":
        """The trace of these steps only (an index or mask over steps, in trace order)."""
        per_step = ("turn", "step", "phase", "ids", "weights", "residency", "dropped", "batch")
        return replace(self, **{name: getattr(self, name)[steps] for name in per_step})

    @classmethod
    def from_routing(cls, ids, n_expert: int, *, expert_bytes=None, name: str = "routing") -> "RouteTrace":
        """Decode routing (n_steps, n_layers, k), e.g. synthetic_routing(), as a one-turn trace
        of decode steps; expert_bytes per layer (default 1: byte figures count experts)."""
        ids = np.asarray(ids, dtype=np.int32)
        if ids.ndim != 3 or ids.shape[1] < 1 or ids.shape[2] < 1:
            raise ValueError(f"routing must be (n_steps, n_layers, k), got shape {ids.shape}")
        if ids.size and (ids.min() < -1 or ids.max() >= n_expert):
            raise ValueError(f"routing expert ids must be in [-1, {n_expert})")
        n_steps, n_layers, k = ids.shape
        sizes = np.ones(n_layers, dtype=np.int64) if expert_bytes is None else \
            np.asarray(expert_bytes, dtype=np.int64)
        return cls(path=name, model=name, arch=name, n_layer=n_layers, n_expert=n_expert,
                   n_expert_used=k, layers=np.arange(n_layers), expert_bytes=sizes,
                   dense_bytes=np.zeros(n_layers, dtype=np.int64),
                   turn=np.zeros(n_steps, dtype=np.int64), step=np.arange(n_steps),
                   phase=np.full(n_steps, DECODE, dtype=np.int8), ids=ids,
                   weights=np.zeros(ids.shape, dtype=np.float32),
                   residency=np.zeros(ids.shape, dtype=np.int8), dropped=np.zeros(ids.shape, dtype=bool))


# --- reading ---------------------------------------------------------------------------

# Bounds on what a trace may declare: far above any real model, low enough that the arrays
# sized by them fit in memory and every derived integer fits in int64.
MAX_LAYERS = 4096
MAX_EXPERTS = 65536
MAX_INDEX = 2**31 - 1          # turn, step and batch numbers
MAX_EXPERT_BYTES = 2**40
MAX_LINE = 1 << 16            # characters in a preamble line (a row field has csv's own limit)
INT_COLUMNS = ("turn", "phase", "step", "layer", "slot", "expert", "residency")
_CHUNK = 1 << 16               # rows converted to arrays at a time


def available_memory() -> int | None:
    """Bytes of memory available now (Linux MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def require_memory(nbytes: int, what: str) -> None:
    """ValueError naming `what` when nbytes exceed the memory available, before allocating."""
    available = available_memory()
    if available is not None and nbytes > available:
        raise ValueError(f"{what} need {_size(nbytes)}, {_size(available)} available")


def _size(nbytes):
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


@dataclass
class _Preamble:
    model: dict                # the model= line's fields
    model_line: int
    layer_bytes: dict          # layer -> (expert_bytes, dense_bytes)
    header_line: int           # line number of the column header
    header: str                # that line, unparsed
    n_layer: int
    n_expert: int
    k: int


def _parse_fields(path, lineno, text, wanted):
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


def _int_field(path, lineno, fields, key, minimum, maximum, context=""):
    try:
        return parse_int(fields[key], key, minimum=minimum, maximum=maximum)
    except IntegerError as e:
        raise TraceError(f"{path}:{lineno}: {e}{context}") from None


def _bounded_line(path, lineno, f) -> str:
    """The next line, refused past MAX_LINE characters: a corrupt file's one huge line must
    not be read into memory whole."""
    line = f.readline(MAX_LINE + 1)
    if len(line) > MAX_LINE:
        raise TraceError(f"{path}:{lineno}: line longer than {MAX_LINE} characters")
    return line


def _read_preamble(path, f) -> _Preamble:
    """The magic line, the # lines and the column header line (not parsed) of an open trace."""
    if f.readline().strip() != MAGIC:
        raise TraceError(f"{path}:1: not a route trace (first line must be {MAGIC!r})")
    model, model_line, layer_bytes = None, 2, {}
    lineno = 1
    for line in iter(lambda: _bounded_line(path, lineno + 1, f), ""):
        lineno += 1
        if not line.startswith("#"):
            break
        body = line[1:].strip()
        if body.startswith("model="):
            model = _parse_fields(path, lineno, body, ("model", "arch", "n_layer", "n_expert", "n_expert_used"))
            model_line = lineno
        elif body.startswith("layer="):
            fields = _parse_fields(path, lineno, body, ("layer", "expert_bytes"))
            layer = _int_field(path, lineno, fields, "layer", 0, MAX_LAYERS - 1)
            expert_bytes = _int_field(path, lineno, fields, "expert_bytes", 1, MAX_EXPERT_BYTES)
            dense = (_int_field(path, lineno, fields, "dense_bytes", 0, MAX_EXPERT_BYTES)
                     if "dense_bytes" in fields else 0)
            if layer in layer_bytes:
                raise TraceError(f"{path}:{lineno}: layer {layer} described twice")
            layer_bytes[layer] = (expert_bytes, dense)
    else:
        line = None
    if model is None:
        raise TraceError(f"{path}:2: preamble lacks the model= line")
    if line is None:
        raise TraceError(f"{path}:{lineno + 1}: no column header")
    n_layer = _int_field(path, model_line, model, "n_layer", 1, MAX_LAYERS)
    n_expert = _int_field(path, model_line, model, "n_expert", 1, MAX_EXPERTS)
    k = _int_field(path, model_line, model, "n_expert_used", 1, n_expert, f" (n_expert={n_expert})")
    for layer in layer_bytes:
        if layer >= n_layer:
            raise TraceError(f"{path}: preamble layer {layer} >= n_layer={n_layer}")
    return _Preamble(model, model_line, layer_bytes, lineno, line, n_layer, n_expert, k)


def _parse_header(path, preamble):
    header = [c.strip() for c in next(csv.reader([preamble.header], quoting=csv.QUOTE_NONE))]
    missing = [c for c in REQUIRED_COLUMNS if c not in header]
    if missing:
        raise TraceError(f"{path}:{preamble.header_line}: header lacks column(s) {', '.join(missing)}")
    unknown = [c for c in header if c not in REQUIRED_COLUMNS + OPTIONAL_COLUMNS]
    if unknown:
        raise TraceError(f"{path}:{preamble.header_line}: unknown column(s) {', '.join(unknown)}")
    return header


def _read_rows(path, f, header, first_line):
    """The data rows as (n, 7) int64 INT_COLUMNS, float32 weights and {optional column: int64
    values} for those present. Rows are converted a chunk at a time; a chunk that does not
    convert is scanned row by row for the first bad field, so the error names it."""
    col = {name: header.index(name) for name in header}
    n_cols = len(header)
    optional = [name for name in OPTIONAL_COLUMNS if name in col]
    converters = [(col[name], int) for name in INT_COLUMNS + ("expert_bytes",) + tuple(optional)]
    converters.append((col["weight"], float))
    parts, chunk, chunk_line, blank_line = [], [], 0, None
    reader = csv.reader(f, quoting=csv.QUOTE_NONE)
    for row in _rows_or_error(path, reader, first_line):
        lineno = first_line + reader.line_num - 1
        if len(row) <= 1 and not (row and row[0].strip()):  # blank: allowed only after the last row
            if blank_line is None:
                blank_line, blank_fields = lineno, len(row)
            continue
        if blank_line is not None:
            raise TraceError(f"{path}:{blank_line}: expected {n_cols} fields, got {blank_fields}")
        if len(row) != n_cols:
            raise TraceError(f"{path}:{lineno}: expected {n_cols} fields, got {len(row)}")
        if not chunk:
            chunk_line = lineno
        chunk.append(row)
        if len(chunk) == _CHUNK:
            parts.append(_convert(path, chunk, chunk_line, header, converters))
            chunk = []
    if chunk:
        parts.append(_convert(path, chunk, chunk_line, header, converters))
    if not parts:
        return np.empty((0, 7), dtype=np.int64), np.empty(0, np.float32), {}
    columns = [np.concatenate(c) for c in zip(*parts)]
    rows = np.stack(columns[:7], axis=1)
    return rows, columns[-1].astype(np.float32), dict(zip(optional, columns[8:-1]))


def _rows_or_error(path, reader, first_line):
    """reader's rows; csv's own errors (e.g. a field over its size limit) as TraceErrors
    naming the line."""
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            raise TraceError(f"{path}:{first_line + reader.line_num - 1}: {e}") from None
        yield row


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _convert(path, chunk, first_line, header, converters):
    """One array per converter's column (int64, or float64 for the weight)."""
    fields = list(zip(*chunk))
    try:
        out = [np.fromiter(map(convert, fields[c]), dtype=np.int64 if convert is int else np.float64,
                           count=len(chunk)) for c, convert in converters]
    except (ValueError, OverflowError):
        _first_bad_field(path, chunk, first_line, header, converters)
        raise TraceError(f"{path}:{first_line}: rows that do not convert") from None
    negative = np.flatnonzero(out[7] < 0)  # expert_bytes
    if negative.size:
        _first_bad_field(path, chunk[:negative[0] + 1], first_line, header, converters)
    weight = out[-1]
    too_big = np.flatnonzero(np.isfinite(weight) & (np.abs(weight) > _FLOAT32_MAX))  # stored as float32
    if too_big.size:
        r = int(too_big[0])
        raise TraceError(f"{path}:{first_line + r}: weight={chunk[r][converters[-1][0]].strip()} "
                         f"is out of the float32 range")
    return out


def _first_bad_field(path, chunk, first_line, header, converters):
    """Raise for the first bad field of these rows, in row order, then column order."""
    for r, row in enumerate(chunk):
        for c, convert in converters:
            name = header[c]
            try:
                value = convert(row[c])
            except ValueError:
                what = "a number" if convert is float else "an integer"
                raise TraceError(f"{path}:{first_line + r}: {name}={row[c].strip()!r} is not {what}") from None
            if convert is int and not -2**63 <= value < 2**63:
                raise TraceError(f"{path}:{first_line + r}: {name}={value} is out of range")
            if name == "expert_bytes" and value < 0:
                raise TraceError(f"{path}:{first_line + r}: negative expert_bytes")


def read_route_trace(path: str) -> RouteTrace:
    try:
        with open(path, "r", encoding="utf-8", newline="") as f:
            preamble = _read_preamble(path, f)
            header = _parse_header(path, preamble)
            rows, weight, optional = _read_rows(path, f, header, preamble.header_line + 1)
    except OSError as e:
        raise TraceError(f"{path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not UTF-8 text") from None
    if len(rows) == 0:
        raise TraceError(f"{path}:{preamble.header_line}: no rows")
    _check_rows(path, preamble, rows)
    dropped = optional["dropped"] != 0 if "dropped" in optional else np.zeros(len(rows), dtype=bool)
    batch = optional.get("batch")
    if batch is not None and ((batch < 0) | (batch > MAX_INDEX)).any():
        r = int(np.flatnonzero((batch < 0) | (batch > MAX_INDEX))[0])
        raise TraceError(f"{path}:{preamble.header_line + 1 + r}: batch={batch[r]} must be in [0, {MAX_INDEX}]")
    return _to_trace(path, preamble, rows, weight, dropped, batch)


def _check_rows(path, preamble, rows):
    """Every value in its range, naming the first row (by column) that is not."""
    turn, phase, step, layer, slot, expert, residency = rows.T
    n_layer, n_expert, k = preamble.n_layer, preamble.n_expert, preamble.k

    def fail_at(mask, what):
        bad = np.flatnonzero(mask)
        if bad.size:
            r = int(bad[0])
            raise TraceError(f"{path}:{preamble.header_line + 1 + r}: {what(r)}")

    fail_at(turn < 0, lambda r: f"turn={turn[r]} is negative")
    fail_at(turn > MAX_INDEX, lambda r: f"turn={turn[r]} must be <= {MAX_INDEX}")
    fail_at((phase != PREFILL) & (phase != DECODE), lambda r: f"phase={phase[r]} is not 0 or 1")
    fail_at(step < 0, lambda r: f"step={step[r]} is negative")
    fail_at(step > MAX_INDEX, lambda r: f"step={step[r]} must be <= {MAX_INDEX}")
    fail_at((layer < 0) | (layer >= n_layer), lambda r: f"layer={layer[r]} out of range [0, {n_layer})")
    known = np.zeros(n_layer, dtype=bool)
    known[list(preamble.layer_bytes)] = True
    fail_at(~known[np.clip(layer, 0, n_layer - 1)],
            lambda r: f"layer={layer[r]} has no expert_bytes in the preamble")
    fail_at((slot < 0) | (slot >= k), lambda r: f"slot={slot[r]} out of range [0, {k})")
    fail_at((expert < 0) | (expert >= n_expert), lambda r: f"expert={expert[r]} out of range [0, {n_expert})")
    fail_at((residency < 0) | (residency > 2), lambda r: f"residency={residency[r]} is not 0, 1 or 2")


def _to_trace(path, preamble, rows, weight, dropped, batch) -> RouteTrace:
    """Steps are identified by (turn, step); each must carry one phase (and batch) and a full
    k x layers grid (see the module docstring for prefill and batches)."""
    turn, phase, step, layer, slot, expert, residency = rows.T
    k, first_data_line = preamble.k, preamble.header_line + 1
    layers = np.unique(layer)
    layer_index = np.full(preamble.n_layer, -1, dtype=np.int64)
    layer_index[layers] = np.arange(layers.size)
    n_layers = layers.size

    step_key = turn * (int(step.max()) + 1) + step
    keys, first_row, step_of_row = np.unique(step_key, return_index=True, return_inverse=True)
    n_steps = keys.size

    def per_step(values, problem):
        """The value of each step, which every row of the step must carry."""
        of_step = values[first_row]
        mixed = np.flatnonzero(values != of_step[step_of_row])
        if mixed.size:
            r = int(mixed[0])
            raise TraceError(f"{path}:{first_data_line + r}: step {step[r]} of turn {turn[r]} {problem}")
        return of_step

    step_phase = per_step(phase, "mixes prefill and decode rows")
    step_batch = np.full(n_steps, -1, dtype=np.int64) if batch is None else per_step(batch, "has rows of two batches")
    cells = n_steps * n_layers * k
    try:
        require_memory(16 * cells, f"{n_steps} steps x {n_layers} layers x {k} ranks")
    except ValueError as e:
        raise TraceError(f"{path}: {e}") from None
    cell = (step_of_row * n_layers + layer_index[layer]) * k + slot
    _check_cells(path, first_data_line, rows, cell, (n_steps, n_layers, k), first_row,
                 (step_phase == DECODE) & ~_shares_batch(turn[first_row], step_batch), layers)

    def grid(values, dtype, absent):
        out = np.full(cells, absent, dtype=dtype)
        out[cell] = values
        return out.reshape(n_steps, n_layers, k)

    sizes = [preamble.layer_bytes[int(l)] for l in layers]
    return RouteTrace(
        path=path, model=preamble.model["model"], arch=preamble.model["arch"],
        n_layer=preamble.n_layer, n_expert=preamble.n_expert, n_expert_used=k,
        layers=layers, expert_bytes=np.array([e for e, _ in sizes], dtype=np.int64),
        dense_bytes=np.array([d for _, d in sizes], dtype=np.int64),
        turn=turn[first_row], step=step[first_row], phase=step_phase.astype(np.int8),
        ids=grid(expert, np.int32, -1), weights=grid(weight, np.float32, 0.0),
        residency=grid(residency, np.int8, 0), dropped=grid(dropped, bool, False), batch=step_batch)


def _check_cells(path, first_data_line, rows, cell, shape, first_row, needs_all_layers, layers):
    """Each (step, layer, rank) cell given once, and no holes: a step whose layers must all be
    there (needs_all_layers) has every rank of every layer; any step, all ranks or none of one."""
    turn, _, step, layer, slot = rows.T[:5]
    n_steps, n_layers, k = shape
    order = np.argsort(cell, kind="stable")
    repeated = order[1:][cell[order[1:]] == cell[order[:-1]]]
    if repeated.size:
        r = int(repeated[0])
        raise TraceError(f"{path}:{first_data_line + r}: duplicate row for turn {turn[r]} step "
                         f"{step[r]} layer {layer[r]} slot {slot[r]}")
    seen = np.zeros(n_steps * n_layers * k, dtype=bool)
    seen[cell] = True
    # A layer may be absent from a prefill token as a whole (llama.cpp runs the last layer only
    # for the tokens whose logits are wanted); those cells read -1. Anything else is a hole.
    groups = seen.reshape(shape)
    partial = groups.any(axis=2) & ~groups.all(axis=2)
    partial |= ~groups.any(axis=2) & needs_all_layers[:, None]
    if partial.any():
        s, li = (int(v[0]) for v in np.nonzero(partial))
        r = int(first_row[s])
        raise TraceError(f"{path}:{first_data_line + r}: turn {turn[r]} step {step[r]} lacks rows for "
                         f"layer {layers[li]} (a decode step needs all {k} ranks of every layer, "
                         f"a prefill step all or none)")


def _shares_batch(turn, batch):
    """True for the steps whose recorded batch (>= 0) holds another step of their turn."""
    key = turn * (int(batch.max(initial=0)) + 1) + batch
    _, inverse, counts = np.unique(key, return_inverse=True, return_counts=True)
    return (batch >= 0) & (counts[inverse] > 1)


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
        preamble.append(",".join(REQUIRED_COLUMNS + ("batch",)))
        self._batch = 0
        self._size = 0  # bytes of the whole steps written
        try:  # O_NOFOLLOW: a symlink planted at the path must not get its target truncated
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_NOFOLLOW, 0o666)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise OSError(e.errno, "is a symbolic link; give the trace's own path", path) from None
            raise
        try:
            self._write("\n".join(preamble) + "\n")
        except OSError:
            self.close()
            raise

    def _write(self, text: str) -> None:
        """All of text, or nothing: a write that fails part way (a full disk) is cut back off,
        so the file stays whole steps."""
        data = text.encode()
        size = len(data)
        try:
            while data:
                data = data[os.write(self._fd, data):]
        except OSError:
            os.ftruncate(self._fd, self._size)
            raise
        self._size += size

    def write_step(self, turn: int, phase: int, step: int, ids, weights, residency) -> None:
        """ids, residency: (n_layers, n_used) ints; weights: same shape or None (written as nan).
        n_used may be a multiple of k (several tokens, steps step, step + 1, ...); rank =
        position modulo k. A layer whose k ids for a token are all -1 did not run for it and
        gets no rows. Each call is one batch (one observation of the cache)."""
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
                               f"{float(weights[li, j]):.6g},{res},{0 if res else size},{self._batch}\n")
        self._write("".join(out))
        self._batch += 1

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
