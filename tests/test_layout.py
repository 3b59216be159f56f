"""The package's import rules: the core imports neither wing, the offline wing never imports the
live glue or libllama, and model building is tooling that the wings do not need."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "moecache"
FORBIDDEN = {
    "core": ("moecache.live", "moecache.offline", "moecache.models", "moecache._native", "llama_cpp"),
    "offline": ("moecache.live", "moecache._native", "llama_cpp"),
}


def imports_of(path: Path) -> set[str]:
    """Every module path.py imports, absolute (relative imports resolved), at any depth in it."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module.removesuffix(".__init__")
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def violations(wing: str) -> list[str]:
    bad = []
    for path in sorted((PACKAGE / wing).rglob("*.py")):
        for name in sorted(imports_of(path)):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[wing]):
                bad.append(f"{path.relative_to(PACKAGE.parent)} imports {name}")
    return bad


@pytest.mark.parametrize("wing", sorted(FORBIDDEN))
def test_a_wing_imports_only_what_its_rules_allow(wing):
    assert violations(wing) == []


def test_the_rule_checker_sees_relative_imports(tmp_path, monkeypatch):
    # the test must be able to fail: a core module reaching into the live wing is caught
    fake = tmp_path / "moecache"
    (fake / "core").mkdir(parents=True)
    (fake / "core" / "bad.py").write_text("from ..live import sizing\nfrom ..util import parse_int\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert violations("core") == ["moecache/core/bad.py imports moecache.live",
                                  "moecache/core/bad.py imports moecache.live.sizing"]


def test_the_offline_replay_runs_without_libllama():
    # at run time too: replaying a trace loads neither llama_cpp nor the live wing
    code = ("import sys, moecache.replay, moecache.offline.replay; "
            "loaded = [m for m in sys.modules if m.startswith(('llama_cpp', 'moecache.live', 'moecache._native'))]; "
            "print(loaded); assert not loaded")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stdout + done.stderr
