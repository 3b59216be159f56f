"""cffi out-of-line ABI module for the moecache C API of the patched libllama.

Built by the package install (setup.py's cffi_modules) into moecache/_native.py; the library
itself is opened at run time, the one llama_cpp already loaded (see moecache/live/native.py).
The patch series' LLAMA_MOE_CACHE_VERSION (defined once, in the llama.h its patches write) is
declared to cffi as well, so that the package knows the series it was built with."""

import re
from pathlib import Path

from cffi import FFI

here = Path(__file__).parent


def patch_series_version(patches: Path = here.parent / "patches") -> int:
    """LLAMA_MOE_CACHE_VERSION as the patches in patches/series define it (exactly once)."""
    define = re.compile(r"^\+\s*#define LLAMA_MOE_CACHE_VERSION (\d+)\s*$", re.MULTILINE)
    names = [line.strip() for line in (patches / "series").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    found = [int(v) for name in names for v in define.findall((patches / name).read_text())]
    if len(found) != 1:
        raise RuntimeError(f"{patches}: LLAMA_MOE_CACHE_VERSION is defined {len(found)} times, expected once")
    return found[0]


ffibuilder = FFI()
ffibuilder.cdef((here / "moecache_api.h").read_text()
                + f"\n#define LLAMA_MOE_CACHE_VERSION {patch_series_version()}\n")
ffibuilder.set_source("moecache._native", None)

if __name__ == "__main__":
    ffibuilder.compile()
