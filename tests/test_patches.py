"""The patch series (patches/) as the moecache package reads it: its version is written once, in
the llama.h of the series, and the cffi module and the loaded libllama both report that one. The
series keeps only the hooks into llama.cpp's and ggml's own files; the cache's C++ is in
native/llama/, which the build copies beside them, and the sizes of both stay within their rules
(scripts/check_native_size.py)."""

from __future__ import annotations

import re
import runpy
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
NATIVE = REPO / "native" / "llama"
build_ffi = runpy.run_path(str(REPO / "native" / "build_ffi.py"))
sizes = runpy.run_path(str(REPO / "scripts" / "check_native_size.py"))


def test_the_series_defines_its_version_once_and_the_package_was_built_with_it():
    from moecache.live import native

    version = build_ffi["patch_series_version"]()
    assert version >= 9
    assert native.ffi.integer_const("LLAMA_MOE_CACHE_VERSION") == version
    assert native.PATCH_VERSION == str(version)


def test_a_second_definition_of_the_version_is_refused(tmp_path):
    patches = tmp_path / "patches"
    shutil.copytree(REPO / "patches", patches)
    extra = patches / "0099-bump.patch"
    extra.write_text("+    #define LLAMA_MOE_CACHE_VERSION 10\n")
    (patches / "series").write_text((patches / "series").read_text() + extra.name + "\n")
    with pytest.raises(RuntimeError, match="defined 2 times"):
        build_ffi["patch_series_version"](patches)


def test_a_definition_of_the_version_in_the_native_sources_is_a_second_one(tmp_path):
    sources = tmp_path / "llama"
    shutil.copytree(NATIVE, sources)
    (sources / "llama-moe-version.h").write_text("#pragma once\n#define LLAMA_MOE_CACHE_VERSION 17\n")
    with pytest.raises(RuntimeError, match="defined 2 times"):
        build_ffi["patch_series_version"](REPO / "patches", sources)


def _series():
    return [REPO / "patches" / line.strip() for line in (REPO / "patches" / "series").read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def test_the_series_adds_the_native_sources_to_libllama_and_no_source_of_its_own():
    """Every .cpp of native/llama/ is in the CMake list a patch adds to src/CMakeLists.txt (and only
    those), and no patch creates a file: the cache's C++ is in real files, copied by the build."""
    listed = set()
    for patch in _series():
        text = patch.read_text()
        assert "new file mode" not in text, f"{patch.name} creates a file: keep it in native/llama/"
        listed |= set(re.findall(r"^\+\s+(llama-moe-[\w-]+\.cpp)\s*$", text, re.MULTILINE))
    assert listed == {p.name for p in NATIVE.glob("*.cpp")}


def test_the_sizes_of_the_added_cpp_keep_their_rules():
    """No function the series adds (native/llama/ and the patches' hunks) over 80 lines, no class
    over 20 data members, no patch adding more than 400 lines."""
    f = sizes["figures"]()
    too_long = [(d.name, d.where, d.size) for d in f["functions"] if d.size > sizes["MAX_FUNCTION_LINES"]]
    too_large = [(d.name, d.where, d.size) for d in f["classes"] if d.size > sizes["MAX_DATA_MEMBERS"]]
    too_big = [(name, n) for n, name in f["patches"] if n > sizes["MAX_PATCH_ADDED"]]
    assert not too_long and not too_large and not too_big, (too_long, too_large, too_big)
    # the measures see what they must: the device tier's constructor, the layer struct, build_moe_experts
    names = {d.name for d in f["functions"]}
    assert {"llama_moe_device::llama_moe_device", "llm_graph_context::build_moe_experts",
            "ggml_mul_mat_id_skip", "llama_moe_admission::admit"} <= names
    assert {"llama_moe_cache_layer", "llm_moe_experts", "llama_moe_upload_worker"} <= {d.name for d in f["classes"]}


def test_the_size_checker_measures_functions_classes_and_hunks(tmp_path):
    body = "\n".join(f"    x += {i};" for i in range(85))
    text = f"""// a comment {{ with a brace
struct counted {{
    int a = 0, b = 1;            // two
    std::atomic<bool> c{{false}};  // three
    static int d;                 // not per instance
    struct nested {{ int e; }};   // a type, not a member
    void f() const {{ return; }}
    std::function<bool(int)> g;   // four
}};

static int
long_one(int x,
         int y) {{
{body}
    if (y) {{ return x; }}
    return "}}" [0];
}}
"""
    defs = {(d.kind, d.name): d for d in sizes["definitions"](text, "t.cpp")}
    assert defs["class", "counted"].size == 4 and defs["class", "nested"].size == 1
    assert defs["function", "long_one"].size == 85 + 6 and defs["function", "long_one"].line == 11
    patch = tmp_path / "0001-x.patch"
    patch.write_text("description\n\ndiff --git a/f.cpp b/f.cpp\n--- a/f.cpp\n+++ b/f.cpp\n@@ -1,2 +1,6 @@\n int keep;\n"
                     "+static int added(int x) {\n+    return x;\n+}\n+\n int keep2;\n")
    (found,) = sizes["patch_definitions"](patch)
    assert (found.name, found.size, found.line) == ("added", 3, 2)
    assert sizes["added_lines"](patch) == 4
