"""cffi out-of-line ABI module for the moecache C API of the patched libllama.

Built by the package install (setup.py's cffi_modules) into moecache/_native.py; the library
itself is opened at run time, the one llama_cpp already loaded (see moecache/live/native.py).
The patch series' LLAMA_MOE_CACHE_VERSION (defined once, in the llama.h its patches write; never
in the C++ sources of native/llama/, which the build copies beside them) is declared to cffi as
well, so that the package knows the series it was built with."""

import re
from pathlib import Path

from cffi import FFI

here = Path(__file__).parent


def patch_series_version(patches: Path = here.parent / "patches", sources: Path = here / "llama") -> int:
    """LLAMA_MOE_CACHE_VERSION as the patches in patches/series define it: exactly once, counting
    the libllama sources of native/llama/ too, which the build copies beside the patched files."""
    added = re.compile(r"^\+\s*#\s*define\s+LLAMA_MOE_CACHE_VERSION\s+(\d+)\s*$", re.MULTILINE)
    plain = re.compile(r"^\s*#\s*define\s+LLAMA_MOE_CACHE_VERSION\s+(\d+)\s*$", re.MULTILINE)
    names = [line.strip() for line in (patches / "series").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    found = [int(v) for name in names for v in added.findall((patches / name).read_text())]
    found += [int(v) for path in sorted(sources.glob("*")) if path.is_file() for v in plain.findall(path.read_text())]
    if len(found) != 1:
        raise RuntimeError(f"{patches}: LLAMA_MOE_CACHE_VERSION is defined {len(found)} times, expected once")
    return found[0]


ffibuilder = FFI()
ffibuilder.cdef((here / "moecache_api.h").read_text()
                + f"\n#define LLAMA_MOE_CACHE_VERSION {patch_series_version()}\n")
ffibuilder.set_source("moecache._native", None)

if __name__ == "__main__":
    ffibuilder.compile()
