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
    assert list(rows) == ["stock", "K=4", "K=2"]  # the largest cache first
    assert report["notes"] == ["K=9 skipped: the model has 8 experts per layer"]
    for row in rows.values():
        assert row["status"] == "ok" and len(row["tok_s_runs"]) == 2
        assert row["tok_s_min"] <= row["tok_s_median"] <= row["tok_s_max"]
    assert rows["stock"]["ratio"] == 1.0 and rows["stock"]["hit_rate"] is None
    assert rows["stock"]["prompt_ratio"] == 1.0
    for row in rows.values():  # the prompt is timed in every run, to its logits
        assert len(row["prompt_tok_s_runs"]) == 2 and row["prompt_tok_s_median"] > 0 and row["prompt_ratio"] > 0
    for k in (2, 4):
        row = rows[f"K={k}"]
        assert 0.0 <= row["hit_rate"] <= 1.0 and row["device_bytes"] > 0 and row["step_us_per_token"] > 0
    assert rows["K=4"]["device_bytes"] > rows["K=2"]["device_bytes"]
    table = md.read_text()
    assert "| K=2 |" in table and "loopback RPC device" in table and "Note: K=9 skipped" in table
    assert table.strip() in run.stdout


def test_bench_decode_runs_the_default_with_its_planner_then_each_cache_without_it(tmp_path, tiny_path):
    pytest.importorskip("llama_cpp")
    js = tmp_path / "bench.json"
    run = _run([sys.executable, BENCH, "-m", tiny_path, "-n", "4", "-r", "1", "-t", "2",
                "--slots", "0,2", "--planner-off", "--json", str(js)])
    assert run.returncode == 0, run.stderr
    report = json.loads(js.read_text())
    assert [r["config"] for r in report["rows"]] == ["stock", "K=2", "planner off K=2"]
    # the default runs the planner at the rates attach measured; the other row has none
    assert report["rows"][2]["planner"] is None and report["rows"][2]["status"] == "ok"
    assert report["notes"] == [f"K=2: {report['rows'][1]['planner']}"]
    assert report["notes"][0].startswith("K=2: moecache: miss planner: link ")
    assert "measured: median of 5 copies" in report["notes"][0] and "Note: K=2:" in run.stdout


def test_bench_decode_saves_after_every_configuration(tmp_path, tiny_path, monkeypatch):
    """A run stopped by a time limit leaves the configurations it measured, marked as partial."""
    import importlib.util

    pytest.importorskip("llama_cpp")
    spec = importlib.util.spec_from_file_location("bench_decode", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from moecache.live import ggml

    monkeypatch.setattr(ggml, "has_gpu", lambda: True)  # no RPC server: measure is replaced too
    measured = []

    def fake_measure(args, name, slots, progress, mib=None, planner_off=False):
        measured.append(name)
        row = {"config": name, "slots": slots, "status": "ok", "tok_s_runs": [10.0 * len(measured)],
               "tok_s_median": 10.0 * len(measured), "tok_s_min": 10.0 * len(measured),
               "tok_s_max": 10.0 * len(measured), "hit_rate": None, "uploads_per_token": None,
               "step_us_per_token": None, "device_bytes": None, "cache_device": None}
        return row, {"n_expert": 8, "prompt_tokens": 5}

    monkeypatch.setattr(bench, "measure", fake_measure)
    js = tmp_path / "bench.json"
    args = bench.parser().parse_args(["-m", tiny_path, "--slots", "0,2,4", "--json", str(js)])
    saved = []
    bench.run(args, on_row=lambda report: (bench.save(args, report), saved.append(json.loads(js.read_text()))))
    assert [len(s["rows"]) for s in saved] == [1, 2, 3]
    assert [s["notes"] for s in saved] == [["still to run: K=4, K=2"], ["still to run: K=2"], []]
    rows = saved[-1]["rows"]
    assert [r["config"] for r in rows] == ["stock", "K=4", "K=2"]
    assert [r["ratio"] for r in rows] == [1.0, 2.0, 3.0]
    assert "| K=2 | 30.00 [30.00, 30.00] | 3.00 | - |" in bench.markdown(saved[-1])


@pytest.mark.parametrize("argv,message", [
    ([], "the following arguments are required: -m/--model"),
    (["-m", "/nonexistent.gguf"], "model file not found: /nonexistent.gguf"),
    (["-m", "{tiny}", "-n", "0"], "argument -n/--n-predict: 0 must be >= 1"),
    (["-m", "{tiny}", "--slots", "4,x"], "argument --slots: 'x' is not an integer"),
    (["-m", "{tiny}", "--slots", ""], "argument --slots: '' is not a comma-separated list of integers"),
    (["-m", "{tiny}", "--policy", "belady"], "only runs in offline replay"),
    (["-m", "{tiny}", "--json", "/nonexistent/dir/x.json"], "cannot write /nonexistent/dir/x.json"),
])
def test_bench_decode_bad_flags_exit_2_with_one_line(tiny_path, argv, message):
    run = _run([sys.executable, BENCH, *[a.format(tiny=tiny_path) for a in argv]])
    assert run.returncode == 2
    assert run.stderr.startswith("bench_decode.py: error: ") and message in run.stderr
    assert run.stderr.count("\n") == 1 and run.stdout == ""


HOST_EXPERTS = os.path.join(REPO, "scripts", "bench_host_experts.py")


def test_bench_host_experts_checks_the_repacked_skip_and_prints_ratios():
    """The split graph's host MUL_MAT_ID in CPU_REPACK: missed rows bit-equal to stock's, cached
    rows zero (the script exits 1 otherwise), then the timing table."""
    pytest.importorskip("llama_cpp")
    run = _run([sys.executable, HOST_EXPERTS, "--experts", "16", "--embd", "256", "--ff", "128",
                "--top-k", "4", "--cached", "0,2", "--tokens", "3", "--runs", "2", "--reps", "2"])
    assert run.returncode == 0, run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split("|")[1].strip() for row in rows] == ["0", "2"]
    assert all(float(row.split("|")[4]) > 0 for row in rows)


def test_gpu_check_help():
    run = _run(["bash", GPU_CHECK, "--help"])
    assert run.returncode == 0
    assert "--cpu-rehearsal" in run.stdout and "--wheel PATH" in run.stdout


@pytest.mark.parametrize("argv,message", [
    (["--bogus"], "unknown argument '--bogus' (see --help)"),
    (["--wheel"], "--wheel needs a path"),
    (["--wheel", "/nonexistent.whl"], "wheel not found: /nonexistent.whl"),
    (["--limit", "fast=3"], "--limit needs PHASE=SECONDS, PHASE one of build, install, model, exact, bench, planner, margin"),
    (["--limit", "model=1.5"], "--limit needs PHASE=SECONDS, PHASE one of build, install, model, exact, bench, planner, margin"),
    (["--results"], "--results needs a directory"),
])
def test_gpu_check_bad_flags_exit_2(argv, message):
    run = _run(["bash", GPU_CHECK, *argv])
    assert run.returncode == 2
    assert run.stderr.strip() == f"gpu_check: error: {message}"


@pytest.mark.parametrize("argv,message", [
    (["--bogus"], "unknown argument '--bogus' (see --help)"),
    (["--max-mib", "x"], "--max-mib needs a number of MiB"),
])
def test_gpu_bundle_bad_flag_exits_2_with_one_line(argv, message):
    run = _run(["bash", os.path.join(REPO, "scripts", "gpu_bundle.sh"), *argv])
    assert run.returncode == 2
    assert run.stderr.strip() == f"gpu_bundle: error: {message}"


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
    assert "+moecache." in init and "moecache.live.activate" in init
    wheels = sorted(p.name.split("-")[0] for p in (bundle / "wheels").iterdir())
    assert wheels == ["cffi", "diskcache", "gguf", "pycparser"]
    assert os.path.getsize(bundle / "src.tar.gz") < 32 << 20  # small enough to copy around


@pytest.mark.parametrize("toolkit_has_it,pip_layout,expected", [
    (True, None, "toolkit"),
    (False, "cu13", "pip"),
    (False, None, "none"),
    (False, "cublas", "none"),  # CUDA 12's layout does not serve nvcc 13
])
def test_cuda_env_finds_cublas_beside_nvcc_or_in_the_pip_package(tmp_path, toolkit_has_it, pip_layout, expected):
    top = tmp_path / "cuda"
    (top / "bin").mkdir(parents=True)
    (top / "include").mkdir()
    nvcc = top / "bin" / "nvcc"  # answers --dryrun (on stderr) and --version as nvcc 13.0 does
    nvcc.write_text(f'#!/bin/sh\necho "#$ TOP={top}/bin/.." >&2\necho "Cuda compilation tools, release 13.0, V13.0.88"\n')
    nvcc.chmod(0o755)
    if toolkit_has_it:
        (top / "include" / "cublas_v2.h").touch()
    site = tmp_path / "site"
    if pip_layout:
        (site / "nvidia" / pip_layout / "include").mkdir(parents=True)
        (site / "nvidia" / pip_layout / "include" / "cublas_v2.h").touch()
    python = tmp_path / "python"  # without site-packages: an installed nvidia-cublas must not answer
    python.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    python.chmod(0o755)
    env = dict(os.environ, PATH=f"{top / 'bin'}:{os.environ['PATH']}", PYTHONPATH=str(site), PYTHON=str(python))
    run = subprocess.run(["bash", "-c", 'source scripts/cuda_env.sh; cuda_find_cublas; echo "$?|$CUDA_TOP|$CUBLAS_HOME"'],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    rc, cuda_top, cublas_home = run.stdout.strip().split("|")
    assert cuda_top == str(top)
    assert (rc, cublas_home) == {"toolkit": ("0", ""), "pip": ("0", str(site / "nvidia" / "cu13")),
                                 "none": ("1", "")}[expected]


BENCH_STEP = os.path.join(REPO, "scripts", "bench_step.py")


def test_bench_step_replay_throughput_reports_lookups_per_second():
    run = _run([sys.executable, BENCH_STEP, "--replay", "2", "--layers", "2", "--experts", "8", "--top-k", "2",
                "--slots", "2", "--steps", "50", "--policy", "default,lru"])
    assert run.returncode == 0, run.stderr
    rows = [line for line in run.stdout.splitlines() if "M lookups/s" in line]
    assert len(rows) == 2 and all("4 lookups per decode step" in row for row in rows), run.stdout


REPLAY_SCALE = os.path.join(REPO, "scripts", "bench_replay_scale.py")


def test_bench_replay_scale_times_each_reading_path_and_checks_their_hits():
    run = _run([sys.executable, REPLAY_SCALE, "--tokens", "300", "--slots", "8", "--policy", "lru"], timeout=300)
    assert run.returncode == 0, run.stderr
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]]
            for line in run.stdout.splitlines() if line.startswith("| ") and not line.startswith("| path")}
    assert list(rows) == ["CSV", "convert", "binary"]
    for wall, cpu, peak, *_, status in rows.values():
        assert status == "ok" and float(wall) > 0 and float(cpu) > 0 and int(peak) > 0
    assert rows["CSV"][4] == rows["binary"][4] != "-" and rows["convert"][3:5] == ["-", "-"]
    assert f"each replay: {300 * 48 * 8} lookups" in run.stdout


@pytest.mark.parametrize("script, argv, message", [
    (HOST_EXPERTS, ["--cached", "8"], "--cached must be below --top-k"),
    (HOST_EXPERTS, ["--embd", "100"], "--embd must be a multiple of 32"),
    (HOST_EXPERTS, ["--runs", "0"], "argument --runs: 0 must be >= 1"),
    (BENCH_STEP, ["--trace", "x.csv"], "--trace needs --replay"),
    (BENCH_STEP, ["--replay", "1", "--experts", "4", "--top-k", "1", "--slots", "8"], "--slots 8 exceeds the 4 experts"),
    (REPLAY_SCALE, ["--tokens", "0"], "argument --tokens: 0 must be >= 1"),
    (REPLAY_SCALE, ["--slots", "129"], "argument --slots: 129 must be in [1, 128]"),
    (REPLAY_SCALE, ["--before", "no-such-revision"], "--before no-such-revision: fatal: not a valid object name"),
], ids=lambda value: os.path.basename(value) if isinstance(value, str) and value.endswith(".py") else None)
def test_bench_scripts_bad_flags_exit_2_with_one_line(script, argv, message):
    run = _run([sys.executable, script, *argv])
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1 and message in run.stderr, run.stderr


def test_predict_next_layer_measures_each_predictor_against_the_real_router(tmp_path):
    """scripts/predict_next_layer.py on a synthetic model whose hidden state is nearly its token's
    embedding at every layer: the next router on this layer's state finds almost every expert,
    the previous token's choice far fewer."""
    pytest.importorskip("llama_cpp")
    from moecache.models import synth

    path = synth.synth_moe("qwen3-30b-a3b", n_layer=4, n_expert=32, n_embd=64, n_ff_exp=32, n_head=2, n_head_kv=1,
                           head_dim=32)
    run = _run([sys.executable, os.path.join(REPO, "scripts", "predict_next_layer.py"), "-m", str(path), "-n", "16"])
    assert run.returncode == 0, run.stderr
    rows = {line.split()[0]: float(line.split()[1].rstrip("%")) for line in run.stdout.splitlines()[2:]}
    assert set(rows) == {"input", "output", "previous"}
    assert rows["output"] > 80 and rows["output"] > rows["previous"] + 20, run.stdout
    bad = _run([sys.executable, os.path.join(REPO, "scripts", "predict_next_layer.py"), "-n", "1"])
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "-n" in bad.stderr
