"""Write a route_trace v1 CSV (moecache.formats.csv_trace) as a run goes: the live cache's
routing trace."""

from __future__ import annotations

import errno
import os
import re
from typing import Sequence

import numpy as np

from .csv_trace import MAGIC, REQUIRED_COLUMNS
from .traces import MAX_READ, READS


class TraceWriter:
    """Write a route_trace v1 file incrementally, one step per write_step call.

    Each step goes out as ONE write(2) on an O_APPEND descriptor, so a process that dies
    leaves whole steps behind: the file is always a readable prefix of the run.
    `layers` are (model layer number, expert_bytes, dense_bytes) for each cached layer, in
    the order the rows of `ids` passed to write_step follow. Any model and arch name is
    accepted; the preamble records it as one word (see _preamble_word). reads: the file has
    the READS columns, and every write_step gives them.
    """

    def __init__(self, path: str, *, model: str, arch: str, n_layer: int, n_expert: int,
                 n_expert_used: int, layers: Sequence[tuple[int, int, int]], reads: bool = False):
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
        self.reads = reads
        preamble.append(",".join(REQUIRED_COLUMNS + ("batch",) + (READS if reads else ())))
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

    def write_step(self, turn: int, phase: int, step: int, ids, weights, residency, reads=None) -> None:
        """ids, residency: (n_layers, n_used) ints; weights: same shape or None (written as nan).
        n_used may be a multiple of k (several tokens, steps step, step + 1, ...); rank =
        position modulo k. A layer whose k ids for a token are all -1 did not run for it and
        gets no rows. Each call is one batch (one observation of the cache). reads: (n_layers,
        len(READS)) ints, each layer's on its first row (0 on the others): a writer with reads
        needs them, and a layer with no rows must have read nothing."""
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
        first_rows, other_rows = self._reads(reads, groups)
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
                               f"{float(weights[li, j]):.6g},{res},{0 if res else size},{self._batch}"
                               f"{first_rows.pop(li, other_rows)}\n")
        self._write("".join(out))
        self._batch += 1

    def _reads(self, reads, groups) -> tuple[dict, str]:
        """The text that ends a row: ({layer index: its reads, for its first row}, for the others)."""
        if not self.reads:
            if reads is not None:
                raise ValueError("reads given to a TraceWriter without the reads' columns")
            return {}, ""
        reads = np.asarray(reads)
        if reads.shape != (self.layers.size, len(READS)) or (reads < 0).any() or (reads > MAX_READ).any():
            raise ValueError(f"reads must be ({self.layers.size}, {len(READS)}) counts in [0, {MAX_READ}], "
                             f"got shape {reads.shape}")
        ran = groups.any(axis=(1, 2))
        if reads[~ran].any():
            raise ValueError(f"reads for layer(s) {self.layers[~ran & reads.any(axis=1)].tolist()} with no rows")
        return {li: "," + ",".join(map(str, row)) for li, row in enumerate(reads.tolist())}, ",0" * len(READS)

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
