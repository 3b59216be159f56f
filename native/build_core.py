"""cffi API-mode extension moecache._core: the cache engine's per-step bookkeeping in C
(native/engine_core.c; moecache/engine.py's CacheEngine runs every step through it).

Built by the package install (setup.py's cffi_modules, run from the project root, which wants
relative source paths), and in place next to the package's sources (setup.py, or `python
native/build_core.py`): a checkout's own moecache/ comes first on sys.path when run.py or
a PYTHONPATH run imports it."""

from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent


def builder(native_dir: str) -> FFI:
    ffi = FFI()
    ffi.cdef((HERE / "engine_core.h").read_text())
    ffi.set_source("moecache._core", '#include <stdint.h>\n#include "engine_core.h"',
                   sources=[f"{native_dir}/engine_core.c"], include_dirs=[native_dir],
                   extra_compile_args=["-O2", "-std=c99"])
    return ffi


ffibuilder = builder("native")

def build_in_place() -> None:
    """moecache/_core.<suffix> next to the package's sources, under the suffix imports prefer,
    so that no other build of it there shadows this one."""
    builder(str(HERE)).compile(tmpdir=str(HERE.parent / "build" / "core"),
                               target=str(HERE.parent / "moecache" / f"_core{EXTENSION_SUFFIXES[0]}"))


if __name__ == "__main__":
    build_in_place()
