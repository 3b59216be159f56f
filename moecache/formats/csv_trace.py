"""The route_trace v1 CSV (BigMoeOnEdge's `--route-trace`), the interchange format, and its
reader (moecache.formats.trace_writer writes it).

Format (columns are read by name, so their order may change):

    # route_trace v1
    # model=... arch=... n_layer=48 n_expert=128 n_expert_used=6
    # layer=0 expert_bytes=3059712 dense_bytes=11953152      (one line per MoE layer)
    turn,phase,step,layer,slot,expert,weight,residency,expert_bytes[,dropped][,batch][,READS]

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
The optional READS columns (moecache.formats.traces.READS: read_ahead, read_ahead_used,
read_ahead_bytes, read_ahead_wasted_bytes, read_bytes; all or none, written by the live RAM tier's
traces) are what the tier read for a layer in a batch: summed over the batch's rows of the layer
(moecache's writer puts them on the first and writes 0 on the others), they are libllama's counters
of that layer over the batch (the bytes read on demand: read_bytes - read_ahead_bytes). The replay
does not use them.

Long recordings replay from its compact binary form (moecache.formats.binary_trace), which
read_trace tells from it by the first line.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass

import numpy as np

from ..util import IntegerError, parse_int, require_memory
from .traces import (DECODE, MAX_EXPERT_BYTES, MAX_EXPERTS, MAX_INDEX, MAX_LAYERS, MAX_LINE, MAX_READ, PREFILL,
                     READS, WINDOW_STEPS, RouteTrace, TraceError, TraceReader, register_reader)

MAGIC = "# route_trace v1"
REQUIRED_COLUMNS = ("turn", "phase", "step", "layer", "slot", "expert", "weight",
                    "residency", "expert_bytes")
OPTIONAL_COLUMNS = ("dropped", "batch") + READS
INT_COLUMNS = ("turn", "phase", "step", "layer", "slot", "expert", "residency")
BLOCK_CHARS = 1 << 22         # text read and parsed at a time: about 140,000 rows
_LONGEST_LINE = 1 << 26       # characters: far beyond a valid row (csv allows 131072 per field)
_EXACT_ROWS = 1 << 16         # rows the csv module's path converts to arrays at a time
# loadtxt's type of each column: the narrowest that holds every valid value (a value that
# overflows it sends the block to the exact path, which names it); the weight as float() reads it
_FAST_TYPES = {"turn": np.int32, "phase": np.int8, "step": np.int32, "layer": np.int16, "slot": np.int32,
               "expert": np.int32, "residency": np.int8, "expert_bytes": np.int64, "dropped": np.int8,
               "batch": np.int32, "weight": np.float64, **dict.fromkeys(READS, np.int64)}


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
    reads = [c for c in READS if c in header]
    if reads and len(reads) < len(READS):
        raise TraceError(f"{path}:{preamble.header_line}: header has {', '.join(reads)} without "
                         f"{', '.join(c for c in READS if c not in reads)} (the reads' columns come together)")
    return header


def read_route_trace(path: str) -> RouteTrace:
    """Read a route_trace v1 CSV a block of rows at a time into the trace's dense arrays: the
    memory it needs is theirs (_Grid), not the text's."""
    try:
        with open(path, "r", encoding="utf-8", newline="") as f:
            preamble = _read_preamble(path, f)
            header = _parse_header(path, preamble)
            grid = _Grid(path, preamble, "batch" in header, READS[0] in header)
            for first_line, columns in _row_pieces(path, f, header, preamble.header_line + 1):
                grid.add(first_line, columns)
    except OSError as e:
        raise TraceError(f"{path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not UTF-8 text") from None
    return grid.trace()


def _blocks(f):
    """The rest of f in blocks of whole lines, about BLOCK_CHARS each. Text of _LONGEST_LINE
    characters without a line end goes on as it is: no valid row is that long, and the csv
    module names the line."""
    rest = ""
    while text := f.read(BLOCK_CHARS):
        text = rest + text
        # after the last \n, else after a lone \r (csv's line end too) that a \n cannot follow
        cut = text.rfind("\n") + 1 or text.rfind("\r", 0, len(text) - 1) + 1
        if not cut and len(text) < _LONGEST_LINE:
            rest = text
            continue
        cut = cut or len(text)
        rest = text[cut:]
        yield text[:cut]
    if rest:
        yield rest


def _row_pieces(path, f, header, first_line):
    """(line of the first row, {column: values}) of the data rows, a block at a time. numpy's
    loadtxt parses a block of plain rows (parse_fast); a block it refuses, or might read
    otherwise than the csv module, goes through the csv module row by row (parse_exact), which
    reads as this reader always has and names the first bad field."""
    blank = None  # (line, fields) of a blank line: allowed only after the last row
    for text in _blocks(f):
        columns = None if blank else parse_fast(text, header)
        if columns is not None:
            yield first_line, columns
            first_line += len(columns["turn"])  # a row a line
        else:
            blank, lines = yield from parse_exact(path, text, first_line, header, blank)
            first_line += lines


def parse_fast(text, header):
    """The block's columns as loadtxt reads them (_FAST_TYPES), or None where its reading could
    differ from the csv module's: other than ASCII, a NUL, a CR outside CRLF, a line over csv's
    field limit, a blank line, a value loadtxt refuses or that overflows its column's type, a
    negative expert_bytes or a weight beyond float32 (for the exact path to name)."""
    if not text.isascii() or "\0" in text or ("\r" in text and text.count("\r") != text.count("\r\n")):
        return None
    data = text.encode("ascii")
    ends = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == ord("\n"))
    if np.diff(ends, prepend=-1, append=len(data)).max() > csv.field_size_limit():
        return None
    types = np.dtype([(name, _FAST_TYPES[name]) for name in header])
    try:
        rows = np.loadtxt(io.BytesIO(data), dtype=types, delimiter=",", comments=None, ndmin=1)
    except ValueError:
        return None
    weight = rows["weight"]
    if len(rows) != ends.size + (not data.endswith(b"\n")) or (rows["expert_bytes"] < 0).any() \
            or (np.isfinite(weight) & (np.abs(weight) > _FLOAT32_MAX)).any():
        return None
    return {name: np.ascontiguousarray(rows[name]) for name in header}


def parse_exact(path, text, first_line, header, blank):
    """The block through the csv module: yields (line, columns) of up to _EXACT_ROWS rows at a
    time; returns (the blank line after the last row, if any, and the lines read)."""
    n_cols = len(header)
    reader = csv.reader(io.StringIO(text, newline=""), quoting=csv.QUOTE_NONE)
    chunk, chunk_line = [], first_line
    for row in _rows_or_error(path, reader, first_line):
        lineno = first_line + reader.line_num - 1
        if len(row) <= 1 and not (row and row[0].strip()):
            if blank is None:
                blank = (lineno, len(row))
            continue
        if blank is not None:
            raise TraceError(f"{path}:{blank[0]}: expected {n_cols} fields, got {blank[1]}")
        if len(row) != n_cols:
            raise TraceError(f"{path}:{lineno}: expected {n_cols} fields, got {len(row)}")
        if not chunk:
            chunk_line = lineno
        chunk.append(row)
        if len(chunk) == _EXACT_ROWS:
            yield chunk_line, _convert(path, chunk, chunk_line, header)
            chunk = []
    if chunk:
        yield chunk_line, _convert(path, chunk, chunk_line, header)
    return blank, reader.line_num


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


def _converters(header):
    """(column, name, int or float) in the order a row's fields are checked."""
    names = INT_COLUMNS + ("expert_bytes",) + tuple(c for c in OPTIONAL_COLUMNS if c in header) + ("weight",)
    return [(header.index(name), name, float if name == "weight" else int) for name in names]


def _convert(path, chunk, first_line, header):
    """The rows' columns: int64, or float64 for the weight."""
    fields = list(zip(*chunk))
    converters = _converters(header)
    try:
        columns = {name: np.fromiter(map(convert, fields[c]), count=len(chunk),
                                     dtype=np.int64 if convert is int else np.float64)
                   for c, name, convert in converters}
    except (ValueError, OverflowError):
        _first_bad_field(path, chunk, first_line, converters)
        raise TraceError(f"{path}:{first_line}: rows that do not convert") from None
    negative = np.flatnonzero(columns["expert_bytes"] < 0)
    if negative.size:
        _first_bad_field(path, chunk[:negative[0] + 1], first_line, converters)
    weight = columns["weight"]
    too_big = np.flatnonzero(np.isfinite(weight) & (np.abs(weight) > _FLOAT32_MAX))  # stored as float32
    if too_big.size:
        r = int(too_big[0])
        raise TraceError(f"{path}:{first_line + r}: weight={chunk[r][header.index('weight')].strip()} "
                         f"is out of the float32 range")
    return columns


def _first_bad_field(path, chunk, first_line, converters):
    """Raise for the first bad field of these rows, in row order, then column order."""
    for r, row in enumerate(chunk):
        for c, name, convert in converters:
            try:
                value = convert(row[c])
            except ValueError:
                what = "a number" if convert is float else "an integer"
                raise TraceError(f"{path}:{first_line + r}: {name}={row[c].strip()!r} is not {what}") from None
            if convert is int and not -2**63 <= value < 2**63:
                raise TraceError(f"{path}:{first_line + r}: {name}={value} is out of range")
            if name == "expert_bytes" and value < 0:
                raise TraceError(f"{path}:{first_line + r}: negative expert_bytes")


def _check_rows(path, preamble, columns, first_line):
    """Every value in its range, naming the first row (by column) that is not."""
    turn, phase, step, layer, slot, expert, residency = (columns[name] for name in INT_COLUMNS)
    n_layer, n_expert, k = preamble.n_layer, preamble.n_expert, preamble.k

    def fail_at(mask, what):
        bad = np.flatnonzero(mask)
        if bad.size:
            r = int(bad[0])
            raise TraceError(f"{path}:{first_line + r}: {what(r)}")

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
    if "batch" in columns:
        batch = columns["batch"]
        fail_at((batch < 0) | (batch > MAX_INDEX), lambda r: f"batch={batch[r]} must be in [0, {MAX_INDEX}]")
    for name in READS:
        if name in columns:
            values = columns[name]
            fail_at((values < 0) | (values > MAX_READ), lambda r: f"{name}={values[r]} must be in [0, {MAX_READ}]")


# per (step, layer, rank) cell of a trace: dtype, the value of a cell without a row
_CELLS = {"ids": (np.int32, -1), "weights": (np.float32, 0), "residency": (np.int8, 0), "dropped": (bool, False)}
_CELL_COLUMNS = {"ids": "expert", "weights": "weight", "residency": "residency", "dropped": "dropped"}
# per step, in the order steps first appear: (turn << 31 | step), phase, batch, its first row
_STEP_FIELDS = {"key": np.int64, "phase": np.int8, "batch": np.int64, "first_row": np.int64}
_GRID_BYTES_PER_CELL = 16  # the cells' 10 bytes, and room for growing and checking them
_READS_BYTES = 8 * len(READS) * 5 // 4  # a step x layer's reads, and room for growing them


class _Grid:
    """The dense arrays of a trace being read, filled a piece of rows at a time (cells: those
    per step x layer, of each rank or of the reads). A step gets
    its index when it first appears (rows may come in any order; trace() sorts the steps), and
    the arrays grow by a quarter in place (ndarray.resize, a realloc): the memory is the final
    arrays' and at most a quarter more, whatever the text's size."""

    def __init__(self, path, preamble, recorded_batch, recorded_reads):
        self.path, self.preamble, self.recorded_batch = path, preamble, recorded_batch
        self.layers = np.array(sorted(preamble.layer_bytes), dtype=np.int64)
        self.layer_index = np.full(preamble.n_layer, -1, dtype=np.int64)
        self.layer_index[self.layers] = np.arange(self.layers.size)
        self.layer_seen = np.zeros(self.layers.size, dtype=bool)
        self.shape = (self.layers.size, preamble.k)
        self.cells = {name: np.full((0, *self.shape), absent, dtype) for name, (dtype, absent) in _CELLS.items()}
        if recorded_reads:  # per step x layer: the reads' columns summed over the layer's rows of the step
            self.cells["reads"] = np.zeros((0, self.layers.size, len(READS)), np.int64)
        self.steps = {name: np.zeros(0, dtype) for name, dtype in _STEP_FIELDS.items()}
        self.index_of = {}  # step key -> step index
        self.n_steps = self.n_rows = 0

    def add(self, first_line, columns) -> None:
        """A piece of rows (first_line: the line of its first row), checked, into the arrays."""
        _check_rows(self.path, self.preamble, columns, first_line)
        step = self._step_index(first_line, columns)
        layer = self.layer_index[columns["layer"]]
        cell = (step * self.shape[0] + layer) * self.shape[1] + columns["slot"]
        self._check_duplicates(first_line, columns, cell)
        for name, column in _CELL_COLUMNS.items():
            if column in columns:
                values = columns[column]
                self.cells[name].reshape(-1)[cell] = values != 0 if name == "dropped" else values
        if "reads" in self.cells:
            np.add.at(self.cells["reads"].reshape(-1, len(READS)), step * self.shape[0] + layer,
                      np.stack([columns[name] for name in READS], axis=1))
        self.layer_seen[layer] = True
        self.n_rows += len(cell)

    def _step_index(self, first_line, columns):
        """Each row's step index. A new step takes its phase and batch from its first row, and
        every row of a step must carry the same."""
        turn, step = columns["turn"], columns["step"]
        key = turn.astype(np.int64) << 31 | step
        first, inverse = _runs(key)
        index = np.array([self.index_of.get(k, -1) for k in key[first].tolist()], dtype=np.int64)
        new = index < 0
        for name, problem in (("phase", "mixes prefill and decode rows"), ("batch", "has rows of two batches")):
            if name in columns:
                values = columns[name]
                expected = values[first].astype(np.int64)
                expected[~new] = self.steps[name][index[~new]]
                mixed = np.flatnonzero(values != expected[inverse])
                if mixed.size:
                    r = int(mixed[0])
                    raise TraceError(f"{self.path}:{first_line + r}: step {step[r]} of turn {turn[r]} {problem}")
        index[new] = np.arange(self.n_steps, self.n_steps + new.sum())
        self._grow(self.n_steps + int(new.sum()))
        added = {"key": key[first[new]], "phase": columns["phase"][first[new]],
                 "batch": columns["batch"][first[new]] if "batch" in columns else -1,
                 "first_row": self.n_rows + first[new]}
        for name, values in added.items():
            self.steps[name][index[new]] = values
        self.index_of.update(zip(added["key"].tolist(), index[new].tolist()))
        self.n_steps += int(new.sum())
        return index[inverse]

    def _grow(self, n_steps):
        capacity = len(self.steps["key"])
        if n_steps <= capacity:
            return
        capacity = max(n_steps, capacity + capacity // 4)
        L, k = self.shape
        reads = _READS_BYTES * capacity * L if "reads" in self.cells else 0
        try:
            require_memory(_GRID_BYTES_PER_CELL * capacity * L * k + reads,
                           f"{capacity} steps x {L} layers x {k} ranks")
        except ValueError as e:
            raise TraceError(f"{self.path}: {e}") from None
        for name, array in [*self.cells.items(), *self.steps.items()]:
            before = len(array)
            array.resize((capacity, *array.shape[1:]), refcheck=False)  # zeros after `before`
            if name == "ids":
                array[before:] = -1

    def _check_duplicates(self, first_line, columns, cell):
        """No (step, layer, rank) cell given twice, in this piece or before it."""
        again = np.flatnonzero(self.cells["ids"].reshape(-1)[cell] >= 0)
        if not (cell[1:] > cell[:-1]).all():  # (rows in writing order need no sort)
            order = np.argsort(cell, kind="stable")
            again = np.concatenate((again, order[1:][cell[order[1:]] == cell[order[:-1]]]))
        if again.size:
            r = int(again.min())
            turn, step, layer, slot = (columns[name][r] for name in ("turn", "step", "layer", "slot"))
            raise TraceError(f"{self.path}:{first_line + r}: duplicate row for turn {turn} step {step} "
                             f"layer {layer} slot {slot}")

    def trace(self) -> RouteTrace:
        """The arrays in (turn, step) order, over the layers that have rows, once every row is
        in: the checks that need them all, then the RouteTrace."""
        preamble, n = self.preamble, self.n_steps
        if self.n_rows == 0:
            raise TraceError(f"{self.path}:{preamble.header_line}: no rows")
        for array in [*self.cells.values(), *self.steps.values()]:
            array.resize((n, *array.shape[1:]), refcheck=False)
        cells, steps = self.cells, self.steps
        order = np.argsort(steps["key"], kind="stable")
        if (order != np.arange(n)).any():
            cells, steps = ({name: a[order] for name, a in arrays.items()} for arrays in (cells, steps))
        if not self.layer_seen.all():
            cells = {name: a[:, self.layer_seen] for name, a in cells.items()}
        turn, step = steps["key"] >> 31, steps["key"] & MAX_INDEX
        batch = steps["batch"] if self.recorded_batch else np.full(n, -1, dtype=np.int64)
        layers = self.layers[self.layer_seen]
        _check_holes(self.path, cells["ids"], (steps["phase"] == DECODE) & ~_shares_batch(turn, batch),
                     preamble.header_line + 1 + steps["first_row"], turn, step, layers)
        sizes = [preamble.layer_bytes[int(l)] for l in layers]
        return RouteTrace(
            path=self.path, model=preamble.model["model"], arch=preamble.model["arch"],
            n_layer=preamble.n_layer, n_expert=preamble.n_expert, n_expert_used=preamble.k,
            layers=layers, expert_bytes=np.array([e for e, _ in sizes], dtype=np.int64),
            dense_bytes=np.array([d for _, d in sizes], dtype=np.int64),
            turn=turn, step=step, phase=steps["phase"], batch=batch, **cells)


def _runs(key):
    """(first position of each distinct key, each position's distinct key's number): by runs
    where the keys never decrease (a step's rows together, as writers write them), else sorted."""
    if (key[1:] >= key[:-1]).all():
        first = np.flatnonzero(np.diff(key, prepend=key[0] - 1))
        return first, np.repeat(np.arange(first.size), np.diff(first, append=key.size))
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    return first, inverse


def _check_holes(path, ids, needs_all_layers, line, turn, step, layers):
    """A step whose layers must all be there (needs_all_layers) has every rank of every layer;
    any step, all ranks of a layer or none. A window of steps at a time."""
    k = ids.shape[2]
    for start in range(0, len(ids), WINDOW_STEPS):
        window = slice(start, start + WINDOW_STEPS)
        # A layer may be absent from a prefill token as a whole (llama.cpp runs the last layer
        # only for the tokens whose logits are wanted); those cells read -1. Anything else is a hole.
        given = ids[window] >= 0
        partial = given.any(axis=2) & ~given.all(axis=2)
        partial |= ~given.any(axis=2) & needs_all_layers[window, None]
        if partial.any():
            s, li = (int(v[0]) for v in np.nonzero(partial))
            s += start
            raise TraceError(f"{path}:{line[s]}: turn {turn[s]} step {step[s]} lacks rows for "
                             f"layer {layers[li]} (a decode step needs all {k} ranks of every layer, "
                             f"a prefill step all or none)")


def _shares_batch(turn, batch):
    """True for the steps whose recorded batch (>= 0) holds another step of their turn."""
    key = turn * (int(batch.max(initial=0)) + 1) + batch
    _, inverse, counts = np.unique(key, return_inverse=True, return_counts=True)
    return (batch >= 0) & (counts[inverse] > 1)


register_reader(TraceReader("route_trace_v1", lambda first: first.decode("utf-8", "replace").strip() == MAGIC,
                            read_route_trace))
