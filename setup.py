from pathlib import Path
import runpy

from setuptools import setup

# generate moecache/_native.py (the cffi declarations of the patched libllama's moecache API)
# here, so that regular and editable installs both get it
here = Path(__file__).parent
runpy.run_path(str(here / "native" / "build_ffi.py"))["ffibuilder"].compile(tmpdir=str(here))

# moecache._core, the engine's per-step bookkeeping in C (a compiler is needed, as for the
# wheel): in the package, and in place too, as moecache/_native.py above, for run.py in the checkout
runpy.run_path(str(here / "native" / "build_core.py"))["build_in_place"]()
setup(cffi_modules=["native/build_core.py:ffibuilder"])
