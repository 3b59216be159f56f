"""scripts/bench_decode.py end to end on the tiny fixture (loopback RPC device), its bad-flag
handling, and scripts/gpu_check.sh's argument handling."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "scripts", "bench_decode.py")
GPU_CHECK = os.path.join(REPO, "scripts", "gpu_check.sh")


def _run(argv, timeout=120):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_MOE_CACHE_")}
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def test_bench_decode_end_to_end(tmp_path, tiny_path):
    pytest.importorskip("llama_cpp")
    md, js = tmp_path / "bench.md", tmp_path / "bench.json"
    run = _run([sys.executable, BENCH, "-m", tiny_path, "-n", "4", "-r", "2", "-t", "2",
                "--slots", "0,2,4,9", "--policy", "lru", "--md", str(md), "--json", str(js)])
    assert run.returncode == 0, run.stderr
    report = json.loads(js.read_text())
    assert "RPC" in report["device"] and report["n_expert"] == 8
    rows = {r["config"]: r for r in report["rows"]}
    assert list(rows) == ["stock", "K=2", "K=4"]
    assert report["notes"] == ["K=9 skipped: the model has 8 experts per layer"]
    for row in rows.values():
        assert row["status"] == "ok" and len(row["tok_s_runs"]) == 2
        assert row["tok_s_min"] <= row["tok_s_median"] <= row["tok_s_max"]
    assert rows["stock"]["ratio"] == 1.0 and rows["stock"]["hit_rate"] is None
    for k in (2, 4):
        row = rows[f"K={k}"]
        assert 0.0 <= row["hit_rate"] <= 1.0 and row["device_bytes"] > 0 and row["step_us_per_token"] > 0
    assert rows["K=4"]["device_bytes"] > rows["K=2"]["device_bytes"]
    table = md.read_text()
    assert "| K=2 |" in table and "loopback RPC device" in table and "Note: K=9 skipped" in table
    assert table.strip() in run.stdout


@pytest.mark.parametrize("argv,message", [
    ([], "the following arguments are required: -m/--model"),
    (["-m", "/nonexistent.gguf"], "model file not found: /nonexistent.gguf"),
    (["-m", "{tiny}", "-n", "0"], "argument -n/--n-predict: must be >= 1, got 0"),
    (["-m", "{tiny}", "--slots", "4,x"], "argument --slots: not a comma-separated list of integers"),
    (["-m", "{tiny}", "--policy", "belady"], "only runs in offline replay"),
    (["-m", "{tiny}", "--json", "/nonexistent/dir/x.json"], "cannot write /nonexistent/dir/x.json"),
])
def test_bench_decode_bad_flags_exit_2_with_one_line(tiny_path, argv, message):
    run = _run([sys.executable, BENCH, *[a.format(tiny=tiny_path) for a in argv]])
    assert run.returncode == 2
    assert run.stderr.startswith("bench_decode.py: error: ") and message in run.stderr
    assert run.stderr.count("\n") == 1 and run.stdout == ""


def test_gpu_check_help():
    run = _run(["bash", GPU_CHECK, "--help"])
    assert run.returncode == 0
    assert "--cpu-rehearsal" in run.stdout and "--wheel PATH" in run.stdout


@pytest.mark.parametrize("argv,message", [
    (["--bogus"], "unknown argument '--bogus' (see --help)"),
    (["--wheel"], "--wheel needs a path"),
    (["--wheel", "/nonexistent.whl"], "wheel not found: /nonexistent.whl"),
])
def test_gpu_check_bad_flags_exit_2(argv, message):
    run = _run(["bash", GPU_CHECK, *argv])
    assert run.returncode == 2
    assert run.stderr.strip() == f"gpu_check: error: {message}"


def test_gpu_bundle_holds_the_patched_source_and_the_missing_wheels(tmp_path):
    import tarfile

    bundle = tmp_path / "bundle"
    run = _run([os.path.join(REPO, "scripts", "gpu_bundle.sh"), str(bundle)], timeout=300)
    assert run.returncode == 0, run.stderr
    with tarfile.open(bundle / "src.tar.gz") as tar:
        names = set(tar.getnames())
        init = tar.extractfile("./llama_cpp/__init__.py").read().decode()
    assert "./vendor/llama.cpp/src/llama-moe-cache.cpp" in names
    assert not any(n.startswith(("./.git/", "./vendor/llama.cpp/models/")) for n in names)
    assert "+moecache." in init and "moecache.activate" in init
    wheels = sorted(p.name.split("-")[0] for p in (bundle / "wheels").iterdir())
    assert wheels == ["cffi", "diskcache", "gguf", "pycparser"]
    assert os.path.getsize(bundle / "src.tar.gz") < 32 << 20  # carried with the repo: 64 MiB a call
