"""cffi API-mode extension moecache._core: the cache engine's per-step bookkeeping in C
(native/engine_core.c; moecache/engine.py's CacheEngine runs every step through it).

Built by the package install (setup.py's cffi_modules); `python native/build_core.py` builds it
in place, next to the sources of a checkout run with PYTHONPATH."""

from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
ffibuilder = FFI()
ffibuilder.cdef((HERE / "engine_core.h").read_text())
ffibuilder.set_source("moecache._core", '#include <stdint.h>\n#include "engine_core.h"',
                      sources=[str(HERE / "engine_core.c")], include_dirs=[str(HERE)],
                      extra_compile_args=["-O2", "-std=c99"])

if __name__ == "__main__":
    ffibuilder.compile(tmpdir=str(HERE.parent / "build" / "core"), target=str(HERE.parent / "moecache" / "_core.*"))
