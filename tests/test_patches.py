"""The patch series (patches/) as the moecache package reads it: its version is written once, in
the llama.h of the series, and the cffi module and the loaded libllama both report that one."""

from __future__ import annotations

import runpy
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
build_ffi = runpy.run_path(str(REPO / "native" / "build_ffi.py"))


def test_the_series_defines_its_version_once_and_the_package_was_built_with_it():
    from moecache._native import ffi
    from moecache.live import native

    version = build_ffi["patch_series_version"]()
    assert version >= 9
    assert ffi.integer_const("LLAMA_MOE_CACHE_VERSION") == version
    assert native.PATCH_VERSION == str(version)


def test_a_second_definition_of_the_version_is_refused(tmp_path):
    patches = tmp_path / "patches"
    shutil.copytree(REPO / "patches", patches)
    extra = patches / "0099-bump.patch"
    extra.write_text("+    #define LLAMA_MOE_CACHE_VERSION 10\n")
    (patches / "series").write_text((patches / "series").read_text() + extra.name + "\n")
    with pytest.raises(RuntimeError, match="defined 2 times"):
        build_ffi["patch_series_version"](patches)
