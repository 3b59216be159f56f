"""cffi API-mode extension moecache._core: the cache engine's per-step bookkeeping in C
(native/engine_core.c; moecache/engine.py's CacheEngine runs every step through it).

Built by the package install (setup.py's cffi_modules, run from the project root, which wants
relative source paths); `python native/build_core.py` builds it in place, next to the sources
of a checkout run with PYTHONPATH."""

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

if __name__ == "__main__":
    # the suffix imports prefer, so that no other build of it next to it shadows this one
    builder(str(HERE)).compile(tmpdir=str(HERE.parent / "build" / "core"),
                               target=str(HERE.parent / "moecache" / f"_core{EXTENSION_SUFFIXES[0]}"))
