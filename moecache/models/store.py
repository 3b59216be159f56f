"""Where built models are kept, and the one way a model file is written: build_gguf writes a
GGUF with its build key atomically, or reuses the file that already has that key."""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
from pathlib import Path
from typing import Any, Callable, Iterable

from ..util import atomic_write, one_line, output_problem

#: metadata keys every built model carries right after general.architecture (read_fixture_key
#: reads only the head of the file)
KEY_FIXTURE_KEY = "moecache.fixture_key"
KEY_FIXTURE = "moecache.fixture"
#: seeds are numpy SeedSequence entries: unsigned 32-bit
MAX_SEED = 2**32 - 1


def cache_dir() -> Path:
    """Directory holding built models: models/ in moecache's cache, $MOECACHE_CACHE_DIR, else
    ${XDG_CACHE_HOME:-~/.cache}/moecache, the one scripts/build_wheel.sh builds in (created on
    demand by the builders)."""
    base = os.environ.get("MOECACHE_CACHE_DIR")
    if not base:
        base = os.path.join(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "moecache")
    return Path(base).expanduser() / "models"


def read_fixture_key(path: str | os.PathLike[str]) -> str | None:
    """The build key of a GGUF written by build_gguf, or None (another file, or unreadable).

    Only the first metadata entries are parsed (build_gguf writes the key first), so this is
    cheap even for large files."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return None
    try:
        if head[:4] != b"GGUF" or struct.unpack_from("<I", head, 4)[0] < 2:
            return None
        n_kv = struct.unpack_from("<Q", head, 16)[0]
        off = 24
        for _ in range(min(n_kv, 4)):
            (klen,) = struct.unpack_from("<Q", head, off)
            key = head[off + 8:off + 8 + klen].decode("utf-8")
            off += 8 + klen
            (vtype,) = struct.unpack_from("<I", head, off)
            if vtype != 8:  # only string values are expected up front
                return None
            (vlen,) = struct.unpack_from("<Q", head, off + 4)
            off += 12
            if off + vlen > len(head):
                return None
            value = head[off:off + vlen].decode("utf-8")
            off += vlen
            if key == KEY_FIXTURE_KEY:
                return value
    except (struct.error, UnicodeDecodeError):
        return None
    return None


def output_path(path: Any, default_name: str) -> Path:
    """path, or default_name in cache_dir() when path is None; checks that it can be written
    (ValueError naming the path otherwise), creating its parent directories."""
    if path is None:
        out = cache_dir() / default_name
    else:
        try:
            out = Path(os.fspath(path)).expanduser()
        except TypeError:
            raise ValueError(f"path must be a path or None, got {path!r}") from None
        if str(out) in ("", "."):
            raise ValueError("path must name a file, got an empty path")
    if out.is_dir():
        raise ValueError(f"output path {out} is a directory")
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create directory {parent}: {one_line(e.strerror or e)}") from None
    problem = output_problem(out)
    if problem:
        raise ValueError(f"cannot write {out}: {problem}")
    return out


#: fill(writer) adds the metadata after the build key and every tensor's info
#: (writer.add_tensor_info), then returns the tensors' data in the same order; a generator it
#: returns is consumed while the file is written, so large models are never all in memory
#: (fill itself must not be a generator function: the infos are needed first)
Fill = Callable[[Any], Iterable[Any]]


def build_gguf(path: Any, stem: str, key: str, fixture: str, arch: str, fill: Fill, *,
               size: int | None = None) -> Path:
    """Return the GGUF at path (default: cache_dir()/<stem>-<digest of key>.gguf), building it
    unless it already carries this build key. The file is written by fill (see Fill) after
    the two keys moecache.fixture_key = key and moecache.fixture = fixture, atomically: an
    interrupted build leaves no file. size: the bytes it will take, checked against the free
    disk space first."""
    out = output_path(path, f"{stem}-{hashlib.sha256(key.encode()).hexdigest()[:10]}.gguf")
    if out.is_file() and read_fixture_key(out) == key:
        return out
    if size is not None:
        free = shutil.disk_usage(out.parent).free
        if free < size * 1.01:
            raise ValueError(f"not enough disk space in {out.parent}: the model needs "
                             f"{size / 1e9:.1f} GB, {free / 1e9:.1f} GB free")

    def write(tmp: Path) -> None:
        import gguf  # deferred: only building needs it

        writer = gguf.GGUFWriter(tmp, arch)
        writer.add_string(KEY_FIXTURE_KEY, key)  # near the start: read_fixture_key relies on it
        writer.add_string(KEY_FIXTURE, fixture)
        try:
            tensors = fill(writer)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for data in tensors:
                writer.write_tensor_data(data)
        finally:
            writer.close()

    atomic_write(out, write)
    return out
