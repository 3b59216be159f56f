"""The compact binary form of a route trace, which a long recording is replayed from.

The route_trace v1 CSV stays the interchange format (moecache.formats.csv_trace); `python -m
moecache.replay TRACE --convert OUT` writes this form of it, and read_trace reads either (the
reader registry tells them by their first line). The file holds RouteTrace's arrays as they are
in memory, so reading maps it (mmap) instead of parsing it, and a replay, which touches a
window of steps at a time and then drops its pages (RouteTrace.drop_pages), needs the same
memory for a trace of any length.

Layout, little-endian:

    route_trace binary v1\\n
    {header}\\n   one line of JSON: model, arch, n_layer, n_expert, n_expert_used; layers,
                 expert_bytes, dense_bytes (one entry per MoE layer, layers ascending);
                 n_steps; crc32 (each array's CRC-32)
    %08x\\n       the CRC-32 of the JSON line (without its line end), in hex
    the ARRAYS, in that order, each from the next multiple of 64 bytes (zeros between), the
    last ending the file: per step turn, step (int64), phase (int8), batch (int64, -1: not
    recorded); per step x layer x rank ids (int32, -1: layer not run), weights (float32),
    residency (int8), dropped (bool, one byte 0 or 1); then, where the header's crc32 names it
    (a live RAM tier's trace), per step x layer x READS reads (int64).

Opening checks the header, the file's size, each array's CRC-32 and the value ranges the
replay relies on, a window at a time: a damaged, truncated or foreign file is one TraceError
line naming it, never a wrong figure.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import zlib

import numpy as np

from ..util import IntegerError, atomic_write, parse_int
from .traces import (DECODE, MAX_EXPERT_BYTES, MAX_EXPERTS, MAX_INDEX, MAX_LAYERS, MAX_READ, READS, WINDOW_STEPS,
                     RouteTrace, TraceError, TraceReader, register_reader)

MAGIC = b"route_trace binary v1"
ALIGN = 64
MAX_HEADER = 1 << 20  # bytes of the JSON line: layers, expert_bytes, dense_bytes of 4096 layers fit
# (name, dtype, per step or per cell) in file order; the dtypes are RouteTrace's
ARRAYS = (("turn", "<i8", "step"), ("step", "<i8", "step"), ("phase", "i1", "step"), ("batch", "<i8", "step"),
          ("ids", "<i4", "cell"), ("weights", "<f4", "cell"), ("residency", "i1", "cell"), ("dropped", "?", "cell"))
READS_ARRAY = ("reads", "<i8", "reads")  # after them, in a trace that has it
# the values each array may hold, as (minimum, maximum); the weights any
RANGES = {"turn": (0, MAX_INDEX), "step": (0, MAX_INDEX), "phase": (0, DECODE), "batch": (-1, MAX_INDEX),
          "residency": (0, 2), "reads": (0, MAX_READ * MAX_EXPERTS)}


def _arrays(reads: bool) -> tuple:
    """The arrays of a file, with the reads or without."""
    return ARRAYS + ((READS_ARRAY,) if reads else ())


def write_binary_trace(trace: RouteTrace, path) -> int:
    """Write `trace` in the binary form to path, atomically (readers see the old file or the
    whole new one; a device or a FIFO is written through, util.atomic_write); returns its size."""
    shape = trace.ids.shape
    arrays = {name: np.ascontiguousarray(getattr(trace, name), dtype=dtype)
              for name, dtype, _ in _arrays(trace.reads is not None)}
    header = {"model": trace.model, "arch": trace.arch, "n_layer": int(trace.n_layer),
              "n_expert": int(trace.n_expert), "n_expert_used": int(trace.n_expert_used),
              "layers": trace.layers.tolist(), "expert_bytes": trace.expert_bytes.tolist(),
              "dense_bytes": trace.dense_bytes.tolist(), "n_steps": shape[0],
              "crc32": {name: zlib.crc32(array) for name, array in arrays.items()}}
    text = json.dumps(header).encode("ascii")
    head = b"%s\n%s\n%08x\n" % (MAGIC, text, zlib.crc32(text))

    layout, size = _layout(len(head), *shape, reads=trace.reads is not None)

    def write(tmp):
        with open(tmp, "wb") as f:  # a pipe cannot tell() where it is: the layout says
            f.write(head)
            end = len(head)
            for name, _, _, offset in layout:
                f.write(bytes(offset - end))
                f.write(arrays[name].data.cast("B"))
                end = offset + arrays[name].nbytes
    atomic_write(path, write)
    return size


def _layout(start, n_steps, n_layers, k, *, reads):
    """[(name, dtype, shape, offset)] of the arrays after a header ending at `start`, and the
    file's size."""
    layout, offset = [], start
    for name, dtype, per in _arrays(reads):
        shape = {"step": (n_steps,), "cell": (n_steps, n_layers, k), "reads": (n_steps, n_layers, len(READS))}[per]
        offset = -(-offset // ALIGN) * ALIGN
        layout.append((name, np.dtype(dtype), shape, offset))
        offset += np.dtype(dtype).itemsize * math.prod(shape)
    return layout, offset


def read_binary_trace(path: str) -> RouteTrace:
    """Map a binary trace and check it (the module docstring); its arrays are views of the file."""
    try:
        with open(path, "rb") as f:
            header, start = _read_header(path, f)
            layout, size = _layout(start, header["n_steps"], len(header["layers"]), header["n_expert_used"],
                                   reads="reads" in header["crc32"])
            found = os.fstat(f.fileno()).st_size
            if found != size:
                raise TraceError(f"{path}: {found} bytes where its header describes {size}: truncated or damaged")
            pages = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise TraceError(f"{path}: {e.strerror}") from None
    arrays = {name: np.frombuffer(pages, dtype, math.prod(shape), offset).reshape(shape)
              for name, dtype, shape, offset in layout}
    trace = RouteTrace(path=path, model=header["model"], arch=header["arch"], n_layer=header["n_layer"],
                       n_expert=header["n_expert"], n_expert_used=header["n_expert_used"],
                       layers=np.array(header["layers"], dtype=np.int64),
                       expert_bytes=np.array(header["expert_bytes"], dtype=np.int64),
                       dense_bytes=np.array(header["dense_bytes"], dtype=np.int64), pages=pages, **arrays)
    _check_arrays(trace, header["crc32"])
    return trace


def _read_header(path, f):
    """The header's fields, checked, and where it ends."""
    if f.readline(len(MAGIC) + 1) != MAGIC + b"\n":
        raise TraceError(f"{path}: not a binary route trace (first line must be {MAGIC.decode()!r})")
    line, crc = f.readline(MAX_HEADER + 1), f.readline(10)
    if not line.endswith(b"\n") or crc != b"%08x\n" % zlib.crc32(line[:-1]):
        raise TraceError(f"{path}: the header (at most {MAX_HEADER} bytes) fails its CRC-32: damaged")
    try:
        header = json.loads(line)
    except (ValueError, RecursionError):  # also a UnicodeDecodeError; nesting past the interpreter's stack
        header = None
    if not isinstance(header, dict):
        raise TraceError(f"{path}: the header is not a JSON object")
    try:
        _check_header(header)
    except (IntegerError, ValueError) as e:
        raise TraceError(f"{path}: header: {e}") from None
    return header, f.tell()


def _check_header(header) -> None:
    """The header's fields, made ints where they are: ValueError naming the first that is
    missing or out of range."""
    for key in ("model", "arch"):
        if not isinstance(header.get(key), str):
            raise ValueError(f"{key} must be a string")
    for key, maximum in (("n_layer", MAX_LAYERS), ("n_expert", MAX_EXPERTS), ("n_expert_used", "n_expert"),
                         ("n_steps", None)):
        header[key] = parse_int(header.get(key), key, minimum=1, maximum=header.get(maximum, maximum))
    layers = header.get("layers")
    if not isinstance(layers, list) or not layers:
        raise ValueError("layers must be a list of MoE layer numbers")
    for key, minimum, maximum in (("layers", 0, header["n_layer"] - 1), ("expert_bytes", 1, MAX_EXPERT_BYTES),
                                  ("dense_bytes", 0, MAX_EXPERT_BYTES)):
        values = header.get(key)
        if not isinstance(values, list) or len(values) != len(layers):
            raise ValueError(f"{key} must be a list of one value per layer ({len(layers)})")
        header[key] = [parse_int(value, key, minimum=minimum, maximum=maximum) for value in values]
    if any(a >= b for a, b in zip(header["layers"], header["layers"][1:])):
        raise ValueError("layers must be ascending")
    crc = header.get("crc32")
    if not isinstance(crc, dict) or sorted(crc) != sorted(name for name, _, _ in _arrays("reads" in crc)):
        raise ValueError(f"crc32 must give each of {', '.join(name for name, _, _ in ARRAYS)}, "
                         f"and reads if it has them")
    for name, value in crc.items():
        crc[name] = parse_int(value, f"crc32 {name}", minimum=0, maximum=2**32 - 1)


def _check_arrays(trace, crc32) -> None:
    """Each array's CRC-32 and values (RANGES; ids in [-1, n_expert)), a window of steps at a
    time, the pages read dropped behind; steps in (turn, step) order."""
    ranges = {**RANGES, "ids": (-1, trace.n_expert - 1), "dropped": (0, 1)}
    for name, _, _ in _arrays(trace.reads is not None):
        array, crc = getattr(trace, name), 0
        for start in range(0, len(array), WINDOW_STEPS):
            window = array[start:start + WINDOW_STEPS]
            crc = zlib.crc32(window, crc)
            if name in ranges:
                low, high = ranges[name]
                values = window.view(np.uint8) if name == "dropped" else window
                if values.min() < low or values.max() > high:
                    raise TraceError(f"{trace.path}: {name} holds values outside [{low}, {high}]: damaged")
            trace.drop_pages()
        if crc != crc32[name]:
            raise TraceError(f"{trace.path}: {name} fails its CRC-32: the file is damaged")
    key = trace.turn << 31 | trace.step
    if (key[1:] <= key[:-1]).any():
        raise TraceError(f"{trace.path}: steps out of (turn, step) order: damaged")


register_reader(TraceReader("route_trace_binary_v1", lambda first: first == MAGIC, read_binary_trace))
