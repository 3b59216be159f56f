"""The package declares every third-party module it imports: `pip install .` (docs/guide.md, Install)
must be enough for run.py, which builds its default model with gguf."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# installed by docs/guide.md's first Install step (the patched wheel), not by pip install .
SEPARATELY_INSTALLED = {"llama_cpp"}


def _required_imports(path: Path) -> set[str]:
    """Top-level modules `path` imports, except those guarded by `except ImportError`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    optional = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                for h in node.handlers):
            optional.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    modules = set()
    for node in ast.walk(tree):
        if id(node) in optional:
            continue
        if isinstance(node, ast.Import):
            modules.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module.split(".")[0])
    return modules


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _declared() -> set[str]:
    """Dependencies and the extras of optional features (e.g. plot); not the test extra."""
    project = _pyproject()["project"]
    requirements = list(project["dependencies"])
    for extra, extra_requirements in project.get("optional-dependencies", {}).items():
        requirements += extra_requirements if extra != "test" else []
    return {re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower().replace("_", "-") for req in requirements}


def test_every_runtime_import_is_a_declared_dependency():
    declared = _declared()
    distributions = importlib.metadata.packages_distributions()
    missing = {}
    for path in sorted((REPO / "moecache").rglob("*.py")):
        for module in _required_imports(path):
            if module in sys.stdlib_module_names or module in SEPARATELY_INSTALLED or module == "moecache":
                continue
            names = {d.lower().replace("_", "-") for d in distributions.get(module, [module])}
            if not names & declared:
                missing.setdefault(module, []).append(str(path.relative_to(REPO)))
    assert not missing, f"imported but in neither pyproject.toml's dependencies nor a feature's extra: {missing}"


def test_every_package_is_installed_by_pip_install():
    """pip install . (not -e) copies only the packages pyproject.toml names."""
    setuptools = pytest.importorskip("setuptools")
    find = _pyproject()["tool"]["setuptools"]["packages"]["find"]
    packaged = set(setuptools.find_packages(str(REPO), include=find["include"]))
    present = {".".join(init.parent.relative_to(REPO).parts) for init in (REPO / "moecache").rglob("__init__.py")}
    assert present and present <= packaged, present - packaged
