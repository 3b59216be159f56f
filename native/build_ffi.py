"""cffi out-of-line ABI module for the moecache C API of the patched libllama.

Built by the package install (setup.py's cffi_modules) into moecache/_native.py; the library
itself is opened at run time, the one llama_cpp already loaded (see moecache/native.py)."""

from pathlib import Path

from cffi import FFI

ffibuilder = FFI()
ffibuilder.cdef((Path(__file__).parent / "moecache_api.h").read_text())
ffibuilder.set_source("moecache._native", None)

if __name__ == "__main__":
    ffibuilder.compile()
