import csv
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import TRACES, replay_cli  # noqa: E402

from moecache.core.policies import Heat
from moecache.formats.profile import ProfileError, UsageProfile
from moecache.formats.trace_writer import TraceWriter
from moecache.formats.traces import DECODE, PREFILL, RouteTrace, read_trace, synthetic_routing
from moecache.offline.cli import main
from moecache.offline.replay import MIB, PREFILL_MODES, GlobalReplay, PerLayerReplay, UpstreamReplay, simulate

QWEN = TRACES / "qwen3-30b-a3b.route.csv"
GPTOSS = TRACES / "gpt-oss-120b.route.csv"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def qwen():
    return read_trace(str(QWEN))


@pytest.mark.parametrize("policy, budget, published", [
    ("lru", 4000, 80.3), ("belady", 4000, 92.7),
    ("lru", 3000, 70.6), ("plain-lfu", 3000, 71.3), ("layer-plain-lfu", 3000, 74.2), ("belady", 3000, 87.8),
])
def test_global_model_reproduces_bigmoeonedge_published_figures(qwen, policy, budget, published):
    result = simulate(qwen, GlobalReplay(policy, budget))
    assert round(100 * result.hit_rate, 1) == published


def test_global_lru_matches_the_recorded_residency(qwen):
    # the trace was recorded by that engine's global LRU at 4000 MiB
    recorded = 100 * (qwen.residency[qwen.phase == DECODE] > 0).mean()
    assert 100 * simulate(qwen, GlobalReplay("lru", 4000)).hit_rate == pytest.approx(recorded, abs=0.01)


def test_global_lru_falls_to_zero_below_one_tokens_working_set(qwen):
    working_set_mib = qwen.working_set_bytes() / MIB
    for fraction in (0.25, 0.5, 0.9, 0.95):
        assert simulate(qwen, GlobalReplay("lru", fraction * working_set_mib)).hit_rate == 0.0
    assert simulate(qwen, GlobalReplay("lru", 2 * working_set_mib)).hit_rate > 0.3
    # belady is not trapped by the layer cycle
    assert simulate(qwen, GlobalReplay("belady", 0.5 * working_set_mib)).hit_rate > 0.3


def test_per_layer_replay_counts_lookups_and_bytes(qwen):
    result = simulate(qwen, PerLayerReplay("lru", 16, inserts=2, prefill="off"))
    decode_lookups = result.totals["hits"] + result.totals["misses"]
    assert decode_lookups == result.lookups == 128 * 48 * 6
    assert 0 < result.upload_bytes_per_token <= 2 * 48 * qwen.expert_bytes.max()
    with_prefill = simulate(qwen, PerLayerReplay("lru", 16, inserts=2, prefill="plain"))
    assert with_prefill.lookups > decode_lookups
    assert with_prefill.totals["hits"] + with_prefill.totals["misses"] == decode_lookups


PROG = "python -m moecache.replay"




def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "moecache.replay", *map(str, args)],
                          capture_output=True, text=True, cwd=REPO, timeout=120)


def test_cli_table_and_csv(tmp_path):
    out = tmp_path / "r.csv"
    proc = run_cli(GPTOSS, "--slots", "8,16", "--policies", "lru,belady,default",
                   "--budget-mib", "3000", "--csv", out)
    assert proc.returncode == 0, proc.stderr
    assert "default(heat)" in proc.stdout and "global cache" in proc.stdout
    rows = list(csv.DictReader(out.open()))
    assert {"policy", "slots", "hits", "misses", "hit_rate", "hit_rate_all", "upload_bytes",
            "upload_bytes_per_token"} <= set(rows[0])
    per_layer = [r for r in rows if r["model"] == "per-layer"]
    assert [(r["policy"], r["slots"]) for r in per_layer][:2] == [("lru", "8"), ("lru", "16")]
    # the recorded global LRU outcome for gpt-oss at about 3000 MiB is 44.84 %
    global_lru = [r for r in rows if r["model"] == "global" and r["policy"] == "lru"][0]
    assert float(global_lru["hit_rate"]) == pytest.approx(0.4484, abs=0.0005)
    assert int(global_lru["hits"]) / (int(global_lru["hits"]) + int(global_lru["misses"])) == \
        pytest.approx(float(global_lru["hit_rate"]), abs=1e-6)


@pytest.mark.parametrize("slots, hit_pct, ms", [(16, 56.3, 7.37), (32, 71.3, 5.18)])
def test_h200_traces_replay_to_the_modelled_figures_docs_set_against_the_gpu(tmp_path, slots, hit_pct, ms):
    # docs/benchmarks.md, "On a GPU: one H200, the first GPU check": the model against the runs
    out = tmp_path / "r.csv"
    proc = run_cli(TRACES / f"synth-qwen3-30b-a3b.h200-k{slots}.route.csv", "--slots", slots,
                   "--policies", "default", "--planner", "--hardware", "pcie4-x16", "--link-gbps", "10.5",
                   "--host-gbps", "69", "--dram-gbps", "71.7", "--ids-trip-us", "14", "--csv", out)
    assert proc.returncode == 0, proc.stderr
    assert "stock --cpu-moe 15.68" in proc.stdout
    (row,) = list(csv.DictReader(out.open()))
    assert (round(100 * float(row["hit_rate"]), 1), float(row["modelled_ms_per_token"])) == (hit_pct, ms)


def test_the_h200_rows_fit_one_line_and_a_slower_planned_link_uploads_less():
    from moecache.offline.gpu_calibration import fit, planned_at

    line, residuals = fit()
    assert (round(line.fixed_ms, 2), round(line.host_ms, 2), round(line.per_upload_ms, 3)) == (10.51, 15.73, 0.499)
    assert max(abs(r) for r in residuals) < 0.03
    trace = read_trace(str(TRACES / "synth-qwen3-30b-a3b.h200-k16.route.csv"))
    measured, slower = planned_at(trace, 8, 10.5), planned_at(trace, 8, 5.3)
    assert (round(100 * measured[0], 1), round(measured[1], 1)) == (38.7, 18.0)
    assert slower[1] < measured[1] and line.ms(*slower) < line.ms(*measured)


@pytest.mark.parametrize("args, message", [
    (["--policies", "lru,lur"], "unknown policy lur for --slots; valid --slots: default, lru"),
    (["--budget-mib", "3000", "--policies", "lur"], "unknown policy lur for --budget-mib; valid --budget-mib: default,"),
    (["--slots", "8", "--budget-mib", "3000", "--policies", "lfu,x"],
     "unknown policy x for --slots and --budget-mib; valid --slots: default"),
    (["--slots", "8,x"], "argument --slots: 'x' is not an integer"),
    (["--seed", "1_0"], "argument --seed: '1_0' is not an integer"),
    (["--slots", "1000"], "exceeds n_expert=128"),
])
def test_cli_rejects_bad_arguments_in_one_line(args, message):
    proc = run_cli(QWEN, *args)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_cli_bad_trace_exits_2_with_file_and_line(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("# route_trace v1\n# model=m arch=a n_layer=1 n_expert=4 n_expert_used=1\n"
                   "turn,phase,step,layer,slot,expert,weight,residency,expert_bytes\n"
                   "0,1,0,0,0,1,1.0,0,0\n")
    proc = run_cli(bad, "--slots", "2")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"{bad}:4: layer=0 has no expert_bytes in the preamble" in proc.stderr
    proc = run_cli(tmp_path / "missing.csv")
    assert proc.returncode == 2 and "No such file" in proc.stderr


def test_plot_without_matplotlib_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails, as when not installed
    assert main([str(QWEN), "--slots", "8", "--plot", str(tmp_path / "p.png")]) == 2
    assert capsys.readouterr().err == f"{PROG}: error: --plot needs matplotlib (pip install matplotlib)\n"


def test_main_returns_2_for_unknown_policy(capsys):
    assert main([str(QWEN), "--policies", "nope"]) == 2
    assert "unknown policy nope" in capsys.readouterr().err


# --- warm start profiles ---------------------------------------------------------------

def test_profile_round_trip_is_atomic_and_validated(tmp_path):
    ids = np.array([[[0, 1], [2, 3]], [[0, 2], [2, 1]]])
    profile = UsageProfile.from_ids("m.gguf", [4, 5], 4, ids)
    assert profile.counts.tolist() == [[2, 1, 1, 0], [0, 1, 2, 1]]
    assert [row.tolist() for row in profile.top(2)] == [[0, 1], [2, 1]]
    assert profile.rates(2).tolist() == [[1, 0.5, 0.5, 0], [0, 0.5, 1, 0.5]]  # 2 steps, top-2
    assert UsageProfile("m", [0], [[0, 0]]).rates(2).tolist() == [[0, 0]]
    path = tmp_path / "p.json"
    profile.save(str(path))
    assert os.listdir(tmp_path) == ["p.json"]  # no temporary left behind
    loaded = UsageProfile.load(str(path), layers=[4, 5], n_expert=4)
    assert loaded.counts.tolist() == profile.counts.tolist()
    assert loaded.merged(profile).counts.sum() == 2 * profile.counts.sum()
    with pytest.raises(ProfileError) as info:
        UsageProfile.load(str(path), layers=[4, 5, 6], n_expert=4)
    assert str(info.value).startswith(f"{path}: profile covers 2 layers x 4 experts")
    with pytest.raises(ProfileError, match="x 8"):
        UsageProfile.load(str(path), layers=[4, 5], n_expert=8)
    path.write_text(json.dumps({"format": "moecache-profile", "version": 1, "model": "m",
                                "n_expert": 4, "layers": [0], "counts": [[1, 2]]}))
    with pytest.raises(ProfileError, match="n_expert=4 but counts rows have 2"):
        UsageProfile.load(str(path))
    path.write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        UsageProfile.load(str(path))


@pytest.mark.parametrize("path", [QWEN, GPTOSS], ids=["qwen", "gptoss"])
def test_first_half_profile_warms_the_second_half(path, monkeypatch):
    trace = read_trace(str(path))
    decode = trace.ids[trace.phase == DECODE]
    half = len(decode) // 2
    profile = UsageProfile.from_ids(trace.model, trace.layers, trace.n_expert, decode[:half])
    second = trace.select(np.flatnonzero(trace.phase == DECODE)[half:])
    hit = lambda policy, warm: simulate(  # noqa: E731
        second, PerLayerReplay(policy, 16, profile=profile if warm else None)).hit_rate
    assert hit("lru", True) > hit("lru", False)
    heat_warm = hit("heat", True)
    monkeypatch.setattr(Heat, "prior", lambda self, rates: None)  # preload alone
    heat_preloaded = hit("heat", True)
    assert heat_warm > heat_preloaded > hit("heat", False)


def test_cli_preload_profile(tmp_path, qwen):
    profile = UsageProfile.from_ids(qwen.model, qwen.layers, qwen.n_expert, qwen.decode_ids)
    good = tmp_path / "good.json"
    profile.save(str(good))
    proc = run_cli(QWEN, "--slots", "16", "--policies", "lru", "--preload-profile", good)
    assert proc.returncode == 0 and "warm start" in proc.stdout
    UsageProfile("m", [0], np.zeros((1, 128), int)).save(str(tmp_path / "bad.json"))
    proc = run_cli(QWEN, "--slots", "16", "--preload-profile", tmp_path / "bad.json")
    assert proc.returncode == 2 and "profile covers 1 layers" in proc.stderr


# --- behaviour unchanged -----------------------------------------------------------------

def test_every_documented_replay_figure_is_unchanged():
    """Every replay figure docs/engine.md and docs/notes/ state (both shipped traces, both models, the
    synthetic tables, warm starts), recomputed and compared as exact integers with the values
    stored before the replay was restructured (tests/replay_values.py writes them)."""
    from replay_values import STORED, compute

    stored = json.loads(STORED.read_text())
    now = compute()
    assert sorted(now) == sorted(stored)
    assert {key: value for key, value in now.items() if stored[key] != value} == {}


# --- bad input: one line, exit 2, nothing run ----------------------------------------------

def small_trace(tmp_path, edit=lambda s: s):
    from test_traces import SMALL

    path = tmp_path / "small.csv"
    path.write_text(edit(SMALL))
    return path


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.replace(" n_expert=8", " n_expert=4000000000"), "n_expert=4000000000 must be in [1, 65536]"),
    (lambda s: s.replace("n_layer=3", "n_layer=2000000000"), "n_layer=2000000000 must be in [1, 4096]"),
    (lambda s: s.replace("n_expert_used=2", "n_expert_used=3000000000"), "must be in [1, 8] (n_expert=8)"),
    (lambda s: s.replace("0,1,1,2,1,7,0.5,0,2000", f"{2**63},1,1,2,1,7,0.5,0,2000"), f"turn={2**63} is out of range"),
    (lambda s: s.replace("expert_bytes=1000", f"expert_bytes={2**70}"), f"expert_bytes={2**70} must be in [1, "),
])
def test_cli_absurd_trace_is_one_line(tmp_path, edit, message):
    proc = run_cli(small_trace(tmp_path, edit), "--slots", "2", "--budget-mib", "1")
    assert proc.returncode == 2 and proc.stdout == ""
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args, message", [
    (["--budget-mib", "nan"], "argument --budget-mib: 'nan': budgets must be finite numbers > 0"),
    (["--budget-mib", "3000,inf"], "argument --budget-mib: '3000,inf': budgets must be finite numbers > 0"),
    (["--budget-mib", "-1"], "argument --budget-mib: '-1': budgets must be finite numbers > 0"),
    (["--seed", "-1"], "argument --seed: -1 must be >= 0"),
    (["--inserts", "2,3"], "argument --inserts: '2,3' is not an integer"),
    (["--csv", "{tmp}/missing/r.csv"], "--csv {tmp}/missing/r.csv: directory {tmp}/missing does not exist"),
    (["--csv", "{tmp}"], "--csv {tmp}: is a directory"),
    (["--csv", "{tmp}/new/"], "--csv {tmp}/new/: ends with '/': a file name is needed"),
    (["--plot", "{tmp}/missing/p.png"], "--plot {tmp}/missing/p.png: directory {tmp}/missing does not exist"),
    (["--admission", "early"], "argument --admission: 'early': each must be one of boundary, eager"),
    (["--admission", ","], "argument --admission: ',': each must be one of boundary, eager"),
    (["--link-gbps", "0"], "argument --link-gbps: '0' must be in [0.001, 100000] GB/s"),
    (["--link-gbps", "5e-324"], "argument --link-gbps: '5e-324' is not a decimal number of GB/s"),
    (["--host-gbps", "100001"], "argument --host-gbps: '100001' must be in [0.001, 100000] GB/s"),
    (["--host-gbps", "nan"], "argument --host-gbps: 'nan' is not a decimal number of GB/s"),
    (["--host-gbps", "60,70"], "argument --host-gbps: '60,70' is not a decimal number of GB/s"),
    (["--hardware", "nvlink"], "argument --hardware: invalid choice: 'nvlink'"),
    (["--join-us", "-1"], "argument --join-us: '-1': a latency must be a finite number of us >= 0"),
    (["--policies", "lru", "--planner"], "--planner needs per-layer policies whose worth counts uses "
                                         "(default, heat, lfu); not lru"),
    (["--policies", "heat", "--planner", "--admission", "boundary"], "--planner needs --admission eager"),
    (["--convert", "{tmp}/t.bin", "--slots", "8", "--prefill", "off"], "--convert replays nothing: drop --slots, --prefill"),
    (["--convert", "{tmp}/missing/t.bin"], "--convert {tmp}/missing/t.bin: directory {tmp}/missing does not exist"),
    (["--convert", "{tmp}/small.csv"], "--convert {tmp}/small.csv: is the trace itself"),
])
def test_cli_bad_flags_are_one_line_before_any_replay(tmp_path, capsys, args, message):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert replay_cli(small_trace(tmp_path), *args) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"{PROG}: error: {message.replace('{tmp}', str(tmp_path))}")
    assert err.count("\n") == 1


def test_cli_engine_larger_than_memory_is_one_line(tmp_path, monkeypatch, capsys):
    import moecache.util as util

    path = small_trace(tmp_path)
    read_trace(str(path))  # the trace itself fits
    monkeypatch.setattr(util, "available_memory", lambda: (500, "cgroup /x: 1 MiB limit, 1 MiB used"))
    assert main([str(path), "--slots", "2"]) == 2
    assert capsys.readouterr().err == (f"{PROG}: error: {path}: the cache engine's 2 layers x 8 experts need 768 "
                                       f"bytes, 500 bytes available (cgroup /x: 1 MiB limit, 1 MiB used)\n")


def _huge_trace(path):
    """A valid binary trace of 4 steps that declares 4096 layers x 65536 experts (400 KB): a
    replay's engine for it takes 12 GiB."""
    from moecache.formats.binary_trace import write_binary_trace

    ids = np.random.default_rng(0).integers(0, 65536, size=(4, 4096, 2)).astype(np.int32)
    write_binary_trace(RouteTrace.from_routing(ids, 65536, expert_bytes=np.full(4096, 1 << 20)), path)
    return path


def test_a_trace_too_large_for_the_address_space_is_one_line_naming_it(tmp_path):
    """Under `ulimit -v` it was a bare "Unable to allocate 1.00 GiB" naming no file (and OOM-killed,
    with no line, in a memory cgroup: the check read MemAvailable only)."""
    path = _huge_trace(tmp_path / "huge.bin")
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, resource.RLIM_INFINITY)); "
            "from moecache.offline.cli import main; sys.exit(main(sys.argv[1:]))")
    run = subprocess.run([sys.executable, "-c", code, str(path), "--slots", "4"], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.startswith(f"{PROG}: error: {path}: the cache engine's 4096 layers x 65536 experts need "
                                 f"12.0 GiB, ") and "available (ulimit -v: 3072 MiB of address space" in run.stderr
    assert run.stderr.count("\n") == 1


def test_cli_csv_uses_fractions_and_the_stats_names(tmp_path):
    out = tmp_path / "r.csv"
    assert main([str(small_trace(tmp_path)), "--slots", "2", "--policies", "lru", "--prefill", "off",
                 "--csv", str(out)]) == 0
    row = next(csv.DictReader(out.open()))
    assert row["hits"] == "0" and row["misses"] == "4" and row["hit_rate"] == "0.000000"
    assert row["decode_steps"] == "1" and row["upload_bytes"] == str(2 * 1000 + 2 * 2000)


@pytest.mark.parametrize("path, figures", [
    # K=16 and 32, eager heat: decode hit%, MiB up/decode token, prefill MiB per turn (off, warm),
    # as docs/engine.md ("Prefill warm") states them
    (QWEN, [(61.5, 111.9, 0.0), (62.4, 107.0, 2063.3), (80.2, 101.7, 0.0), (83.1, 89.5, 4109.1)]),
    (GPTOSS, [(64.0, 326.8, 0.0), (65.6, 289.2, 7085.0), (71.1, 262.0, 0.0), (77.5, 190.1, 14144.8)]),
])
def test_documented_prefill_warm_figures(path, figures):
    trace = read_trace(str(path))
    runs = [simulate(trace, PerLayerReplay("default", k, admission="eager", prefill=prefill))
            for k in (16, 32) for prefill in ("off", "warm")]
    assert [(round(100 * r.hit_rate, 1), round(r.upload_bytes_per_token / MIB, 1),
             round(r.prefill_upload_bytes_per_turn / MIB, 1)) for r in runs] == figures


def test_the_default_admission_is_the_live_caches(tmp_path):
    # eager, as LLAMA_MOE_CACHE_ADMISSION defaults to; boundary for a policy that picks its victims
    out = tmp_path / "r.csv"
    assert replay_cli(GPTOSS, "--slots", "8", "--policies", "lru,arc,default", "--csv", out) == 0
    rows = {row["policy"]: row["admission"] for row in csv.DictReader(out.open())}
    assert rows == {"lru": "eager", "arc": "boundary", "default(heat)": "eager"}


def batched_turns(path):
    """Two turns as the live cache writes them: a prompt in two ubatches, then decode tokens,
    three of them verified in one batch."""
    ids = synthetic_routing(24, 3, 8, 2, seed=5)
    with TraceWriter(str(path), model="m", arch="a", n_layer=3, n_expert=8, n_expert_used=2,
                     layers=[(layer, MIB, 0) for layer in range(3)]) as writer:
        for turn, base in ((0, 0), (1, 12)):
            for phase, first, n in ((PREFILL, 0, 2), (PREFILL, 2, 3), (DECODE, 5, 1), (DECODE, 6, 3),
                                    (DECODE, 9, 1), (DECODE, 10, 2)):
                tokens = ids[base + first:base + first + n]
                writer.write_step(turn, phase, first, np.concatenate(list(tokens), axis=1), None,
                                  np.zeros((3, 2 * n), int))
    return read_trace(str(path))


def test_a_replay_in_windows_of_a_few_steps_counts_as_in_one(tmp_path, monkeypatch, qwen):
    """The adapter hands the steps over a window at a time, cut between observations: in windows
    of 2 steps every model and prompt mode counts what it counts in windows of thousands."""
    from moecache.offline import steps

    def counts(traces):
        per_layer = [PerLayerReplay(policy, 3, prefill=prefill) for policy in ("lru", "belady") for prefill in PREFILL_MODES]
        return [simulate(trace, replay).totals_all for trace, mib in traces
                for replay in per_layer + [GlobalReplay("lru", mib), GlobalReplay("belady", mib),
                                           UpstreamReplay("upstream", mib)]]

    def traces():  # new objects: the NextUse of a trace is kept
        return [(batched_turns(tmp_path / "b.csv"), 5), (qwen.select(slice(None)), 3000)]

    whole = counts(traces())
    monkeypatch.setattr(steps, "WINDOW_STEPS", 2)
    assert counts(traces()) == whole


# --- the compact binary form ---------------------------------------------------------------

def test_outputs_write_through_a_device_or_fifo_and_never_replace_it(tmp_path):
    """--convert and --csv at a link to /dev/null, at a link to this process's stdout (a pipe here;
    what /dev/stdout is) and at a FIFO: written through, nothing renamed over them (they were
    replaced by regular files; the system's /dev/null and /dev/stdout with them, so no test names
    those: the code before the fix would replace them)."""
    trace = small_trace(tmp_path)
    null = tmp_path / "null"
    null.symlink_to("/dev/null")
    for args in (["--convert", null], ["--slots", "2", "--policies", "lru", "--csv", null]):
        proc = run_cli(trace, *args)
        assert proc.returncode == 0 and f"wrote {null}" in proc.stderr, proc.stderr
        assert null.is_symlink() and os.readlink(null) == "/dev/null"
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert run_cli(trace, "--convert", tmp_path / "t.bin").returncode == 0
    stdout = tmp_path / "stdout"
    stdout.symlink_to("/proc/self/fd/1")
    piped = subprocess.run([sys.executable, "-m", "moecache.replay", str(trace), "--convert", str(stdout)],
                           capture_output=True, cwd=REPO, timeout=120)
    assert piped.returncode == 0 and piped.stdout == (tmp_path / "t.bin").read_bytes()
    assert piped.stderr.decode().startswith(f"wrote {stdout}: ") and stdout.is_symlink()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    proc = subprocess.Popen([sys.executable, "-m", "moecache.replay", str(trace), "--slots", "2",
                             "--policies", "lru", "--csv", str(fifo)], stdout=subprocess.PIPE, cwd=REPO, text=True)
    with open(fifo) as f:
        rows = list(csv.DictReader(f))
    assert proc.wait(timeout=120) == 0 and [row["policy"] for row in rows] == ["lru"]
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


@pytest.mark.parametrize("path", [QWEN, GPTOSS], ids=["qwen", "gptoss"])
def test_a_converted_trace_replays_to_the_numbers_of_its_csv(tmp_path, path):
    """--convert, then every model (per-layer at each admission, global, upstream) replays the
    binary file to the CSV's rows, all but the seconds."""
    converted = tmp_path / "t.bin"
    proc = run_cli(path, "--convert", converted)
    assert proc.returncode == 0 and proc.stdout.startswith(f"wrote {converted}: "), proc.stderr
    rows = []
    for trace in (path, converted):
        out = tmp_path / "r.csv"
        proc = run_cli(trace, "--slots", "16", "--budget-mib", "3000", "--admission", "boundary,eager",
                       "--policies", "lru,belady,default,upstream", "--csv", out)
        assert proc.returncode == 0, proc.stderr
        rows.append([{k: v for k, v in row.items() if k != "seconds"} for row in csv.DictReader(out.open())])
    assert len(rows[0]) == 16 and rows[0] == rows[1]


def test_a_converted_trace_replays_every_stored_figure_of_its_csv(tmp_path):
    """The gpt-oss trace's 102 runs of tests/replay_values.json, replayed from its binary form."""
    from replay_values import STORED, trace_values

    from moecache.formats.binary_trace import write_binary_trace

    write_binary_trace(read_trace(str(GPTOSS)), tmp_path / "t.bin")
    now = trace_values(read_trace(str(tmp_path / "t.bin")), "gpt-oss-120b")
    stored = json.loads(STORED.read_text())
    assert len(now) == 102 and {key: value for key, value in now.items() if stored[key] != list(value)} == {}


def test_cli_damaged_binary_trace_exits_2_with_one_line(tmp_path):
    converted = tmp_path / "t.bin"
    assert replay_cli(GPTOSS, "--convert", converted) == 0
    converted.write_bytes(converted.read_bytes()[:-1])
    proc = run_cli(converted, "--slots", "8")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"{PROG}: error: {converted}: {converted.stat().st_size} bytes where its header " \
                          f"describes {converted.stat().st_size + 1}: truncated or damaged\n"


MAPPED_REPLAY = """
import sys
from moecache.formats.traces import read_trace
from moecache.offline.replay import PerLayerReplay, simulate
result = simulate(read_trace(sys.argv[1]), PerLayerReplay("lru", 4, admission="boundary"))
with open("/proc/self/status") as f:  # VmHWM: this program's peak (ru_maxrss counts the parent's too)
    peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
print(result.lookups, peak)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the peak RSS from /proc")
def test_a_mapped_replay_needs_the_same_memory_for_a_trace_4_times_as_long(tmp_path):
    """Replaying the binary form maps it and drops each window's pages: peak memory (RSS) does
    not grow with the trace, whose arrays here grow by 38 MB (only its per-step numbers do,
    some 40 bytes a step)."""
    from moecache.formats.binary_trace import write_binary_trace

    routing = synthetic_routing(10000, 16, 64, 8, seed=2)
    peaks = []
    for repeats in (1, 4):
        path = tmp_path / f"{repeats}.bin"
        write_binary_trace(RouteTrace.from_routing(np.concatenate([routing] * repeats), 64), path)
        proc = subprocess.run([sys.executable, "-c", MAPPED_REPLAY, str(path)], capture_output=True, text=True,
                              cwd=REPO, timeout=120)
        lookups, peak_kib = map(int, proc.stdout.split())
        assert lookups == repeats * routing.size, proc.stderr
        peaks.append(peak_kib << 10)
    assert peaks[1] - peaks[0] < 4 << 20, peaks
