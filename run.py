#!/usr/bin/env python3
"""Generate with the MoE expert cache: `LLAMA_MOE_CACHE_SLOTS=K python run.py [-m MODEL] [-p PROMPT] [-n N]`.
See `python run.py --help`. On first use it installs the patched llama-cpp-python wheel and
moecache (scripts/bootstrap.sh) and builds the default model: the first `python3 run.py` took
10 min 58 s on a fresh 2-core machine without ccache (docs/build.md)."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.abspath(__file__))


def _installed() -> bool:
    probe = "import llama_cpp, moecache._native, moecache._core; assert '+moecache.' in llama_cpp.__version__"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_MOE_CACHE_")}
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True).returncode == 0


if __name__ == "__main__":
    if not _installed():
        print("run.py: installing the patched llama-cpp-python and moecache (scripts/bootstrap.sh)", file=sys.stderr)
        bootstrap = [os.path.join(REPO, "scripts", "bootstrap.sh")]
        if subprocess.run(bootstrap, env={**os.environ, "PYTHON": sys.executable}).returncode != 0:
            sys.exit("run.py: error: scripts/bootstrap.sh failed (see above)")
        os.execv(sys.executable, [sys.executable, *sys.argv])  # start again with the new packages
    from moecache.live.cli import main

    sys.exit(main())
