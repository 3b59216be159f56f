"""scripts/bench_larger_than_ram.py without a memory cgroup: its flags, the refusal where no cgroup
can be made, and the report."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "scripts", "bench_larger_than_ram.py")


def _run(*flags, timeout=60):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_MOE_CACHE_")}
    return subprocess.run([sys.executable, BENCH, *flags], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=REPO)


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_larger_than_ram", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def report_of(bench, rows: list[dict]) -> dict:
    """A report of rows for bench.markdown: a 300 MB model of 2 layers, a 100 MB cgroup, no disk."""
    return {"model": "m.gguf", "command": "c", "facts": {
        "file_bytes": 300 * bench.MB, "expert_bytes": 280 * bench.MB, "other_bytes": 20 * bench.MB,
        "moe_layers": 2, "n_expert": 8, "n_expert_used": 2}, "limit_mb": 100, "n_predict": 2, "repetitions": 3,
        "threads": 2, "ctx_size": 64, "host": {"cpu": "cpu", "cpus": 2, "ram_bytes": 2**30},
        "cgroup": {"version": 1, "limit_file": "memory.limit_in_bytes"}, "rows": rows, "disk": None,
        "bound": None, "notes": []}


@pytest.mark.parametrize("flags, message", [
    (["--limit-mb", "-1"], "argument --limit-mb: -1 must be >= 0"),
    (["-n", "x"], "argument -n/--n-predict: 'x' is not an integer"),
    (["--ram-mib", "lots"], "argument --ram-mib: 'lots' is not an integer"),
    (["--ram-mib", "-1"], "argument --ram-mib: -1 must be >= 0"),
    (["--disk-threads", "1"], "argument --disk-threads: 1 must be >= 2"),
    (["--requests", "0"], "argument --requests: 0 must be >= 1"),
    (["--no-disk", "--disk-only"], "argument --disk-only: not allowed with argument --no-disk"),
])
def test_bad_flags_are_one_line_errors(flags, message):
    run = _run(*flags)
    assert run.returncode == 2
    assert run.stderr == f"bench_larger_than_ram.py: error: {message}\n"


def test_missing_model_and_output_directory(tmp_path):
    run = _run("-m", str(tmp_path / "none.gguf"))
    assert (run.returncode, run.stderr) == (2, f"bench_larger_than_ram.py: error: model file not found: "
                                               f"{tmp_path / 'none.gguf'}\n")
    run = _run("-m", str(tmp_path / "none.gguf"), "--json", str(tmp_path / "no" / "r.json"))
    assert run.returncode == 2 and "cannot write" in run.stderr


def test_no_cgroup_stops_before_measuring(tmp_path, tiny_path):
    """A cgroup root that does not exist: one line, exit 1, no run reported as limited."""
    report = tmp_path / "report.json"
    run = _run("-m", tiny_path, "--cgroup-root", str(tmp_path / "no-cgroups"), "--json", str(report))
    assert run.returncode == 1
    assert run.stderr.splitlines()[-1] == (f"bench_larger_than_ram.py: error: cannot make a memory cgroup: "
                                           f"no cgroup directory {tmp_path / 'no-cgroups'}")
    assert run.stdout == "" and not report.exists()


def test_a_directory_without_a_memory_controller_is_refused(bench, tmp_path):
    """A plain directory takes the cgroup's mkdir but grows no memory files: refused, removed."""
    with pytest.raises(bench.CgroupUnavailable, match="the new cgroup has no memory controller"):
        bench.probe_cgroup(str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_a_run_with_a_moecache_error_is_not_ok(bench):
    done = subprocess.CompletedProcess([], 0, "", "moecache: error: LLAMA_MOE_CACHE_RAM_MIB is not a moecache "
                                                 "variable; known: ... - expert cache disabled\n")
    assert bench.child_status(done).startswith("failed: moecache: error: LLAMA_MOE_CACHE_RAM_MIB")
    assert bench.child_status(subprocess.CompletedProcess([], -9, "", "")) == "killed by signal SIGKILL"
    assert bench.child_status(subprocess.CompletedProcess([], 0, "", "llama.cpp chatter\n")) == "ok"


def test_summary_medians_tokens_and_limit(bench):
    class Args:
        limit_mb = 100

    def run(decode, tokens, peak=None):
        return {"status": "ok", "decode_tok_s": decode, "prompt_tok_s": 2 * decode, "tokens": tokens,
                "peak_bytes": peak, "anon_bytes": 10, "prompt_tokens": 5}

    rows = bench.summarize(Args, {
        ("stock", "ram"): [run(30.0, [1, 2]), run(10.0, [1, 2]), run(20.0, [1, 2])],
        ("stock", "limited"): [run(1.0, [1, 2], 99 * bench.MB), run(3.0, [1, 3], 101 * bench.MB),
                               {"status": "killed by signal SIGKILL"}],
    })
    ram, limited = rows
    assert (ram["decode_tok_s"], ram["decode_tok_s_range"], ram["prompt_tok_s"]) == (20.0, [10.0, 30.0], 40.0)
    assert ram["tokens_match"] is True and ram["peak_within_limit"] is None
    assert limited["config"] == "stock, 100 MB" and limited["ok_runs"] == 2
    assert limited["failures"] == ["killed by signal SIGKILL"]
    assert limited["tokens_match"] is False and limited["peak_within_limit"] is False
    table = bench.markdown(report_of(bench, rows))
    assert "| stock, 100 MB (1 failed: killed by signal SIGKILL) | 2.00 [1.00, 3.00] |" in table
    assert "101 (over the limit)" in table and "| DIFFER |" in table


def test_requests_in_a_row_are_reported_one_by_one_with_the_limits_hits(bench):
    """--requests: each row's requests one by one (medians of the runs) and the most times a
    limited run's cgroup hit its limit; the header says how long each request's prompt was."""
    class Args:
        limit_mb = 100

    def run(decode, hits=None):
        requests = [{"prompt_tokens": 5 * (i + 1), "prompt_tok_s": 10.0 * (i + 1), "decode_tok_s": decode + i}
                    for i in range(3)]
        return {"status": "ok", "decode_tok_s": decode, "prompt_tok_s": 10.0, "tokens": [1], "peak_bytes": 90 * bench.MB,
                "anon_bytes": 10, "prompt_tokens": 30, "requests": requests, "limit_hits": hits}

    rows = bench.summarize(Args, {("stock", "ram"): [run(30.0), run(10.0)],
                                  ("tier", "limited"): [run(1.0, 0), run(3.0, 7), run(2.0, 2)]})
    assert rows[1]["requests"] == [{"prompt_tokens": 5, "prompt_tok_s": 10.0, "decode_tok_s": 2.0},
                                   {"prompt_tokens": 10, "prompt_tok_s": 20.0, "decode_tok_s": 3.0},
                                   {"prompt_tokens": 15, "prompt_tok_s": 30.0, "decode_tok_s": 4.0}]
    assert (rows[0]["limit_hits"], rows[1]["limit_hits"]) == (None, 7)
    table = bench.markdown(report_of(bench, rows))
    assert "3 requests a run, one after the other in its process (prompts of 5, 10, 15 tokens)" in table
    assert ("Requests of tier, 100 MB, one by one: decode 2.00, 3.00, 4.00 tok/s, prompt 10.00, 20.00, 30.00 "
            "tok/s; the cgroup hit its limit 7 times") in table
    assert "Requests of stock, in RAM, one by one: decode 20.00, 21.00, 22.00 tok/s" in table


def test_io_bound(bench):
    MB = bench.MB

    def row(kind, placement, prompt_tok_s, *read_bytes):
        return {"kind": kind, "placement": placement, "config": f"{kind}, {placement}", "anon_bytes": 100 * MB,
                "prompt_tok_s": prompt_tok_s,
                "runs": [{"status": "ok", "prompt_tokens": 10, "read_bytes_prompt": b, "prompt_tok_s": prompt_tok_s,
                          "decode_read_bytes_per_token": 0, "decode_tok_s": 1.0} for b in read_bytes]}

    report = {"limit_mb": 1000, "disk": {"sequential_qd1_gbps": 0.5, "sequential_threads_gbps": 1.0},
              "facts": {"expert_bytes": 1600 * MB, "other_bytes": 100 * MB, "moe_layers": 2, "n_expert": 8,
                        "n_expert_used": 2},
              "rows": [row("stock", "ram", 40.0, 0), row("stock", "limited", 5.0, 1500 * MB),
                       row("tier", "limited", 8.0, 900 * MB, 1000 * MB, 1100 * MB)]}
    bound = bench.io_bound(report)
    # 800 MB of the 1600 MB of experts fit; a token uses 2 x 2 experts of 100 MB, reads half
    assert bound["resident_share"] == pytest.approx(0.5)
    assert bound["expert_bytes_per_token"] == pytest.approx(400 * MB)
    assert bound["decode_tok_s"] == pytest.approx(1e9 / (200 * MB))
    # a fresh process's prompt: each row's own reads (median) at 1 GB/s, under stock's in-RAM prompt
    assert bound["prompt_ceiling_tok_s"] == 40.0
    assert bound["prompt_reads"]["tier"] == {"bytes": 1000 * MB, "tok_s": pytest.approx(10.0)}
    assert bound["prompt_reads"]["stock"]["tok_s"] == pytest.approx(10 / 1.5)
    report["disk"] = None
    assert bench.io_bound(report) is None


def test_paired_ratios_pair_each_round(bench):
    def run(decode, prompt, status="ok"):
        return {"status": status, "decode_tok_s": decode, "prompt_tok_s": prompt}

    rows = [{"kind": "stock", "placement": "ram", "runs": [run(10, 20), run(20, 40), run(30, 60)]},
            {"kind": "tier", "placement": "ram", "runs": [run(9, 20), run(20, 44), run(1, 1, "failed: x")]}]
    assert bench.paired_ratios(rows) == {"ram": {"rounds": 2, "decode_tok_s": [0.95, 0.9, 1.0],
                                                 "prompt_tok_s": [1.05, 1.0, 1.1]}}
    assert bench.paired_ratios(rows[:1]) == {}


def test_page_cache_share(bench, tmp_path):
    path = tmp_path / "f"
    path.write_bytes(os.urandom(1 << 20))
    assert bench.cache_whole_file(str(path)) == 1.0
    # tmpfs keeps its pages: only check that eviction answers with a share
    assert 0.0 <= bench.evict(str(path)) <= 1.0


def test_roofline_of_each_limited_tier_row(bench):
    """max(the in-RAM tier's time per token, the row's own bytes per token at the best disk rate)."""
    MB = bench.MB

    def row(kind, placement, decode, read_bytes):
        return {"kind": kind, "placement": placement, "config": f"{kind}, {placement}", "decode_tok_s": decode,
                "decode_read_bytes_per_token": read_bytes}

    report = {"disk": {"sequential_qd1_gbps": 1.0, "sequential_threads_gbps": 1.25},
              "rows": [row("stock", "ram", 60.0, 0), row("stock", "limited", 1.0, 900 * MB),
                       row("tier", "ram", 50.0, 0), row("tier", "limited", 20.0, 25 * MB)]}
    roof = bench.rooflines(report)
    assert list(roof) == ["tier, limited"]
    r = roof["tier, limited"]
    # 25 MB at 1.25 GB/s: 20 ms, over the 20 ms in RAM... equal: 50 tok/s, reached 40%
    assert (r["ram_ms"], r["read_ms"]) == (pytest.approx(20.0), pytest.approx(20.0))
    assert (r["tok_s"], r["share"]) == (pytest.approx(50.0), pytest.approx(0.4))
    assert r["later_share"] is None  # the row timed no token apart
    report["rows"][3]["decode_ms_later"] = 25.0  # 40 tok/s after the first tokens: 80% of 50
    assert bench.rooflines(report)["tier, limited"]["later_share"] == pytest.approx(0.8)
    report["rows"][3]["decode_read_bytes_per_token"] = 50 * MB  # disk bound: 40 ms
    assert bench.rooflines(report)["tier, limited"]["tok_s"] == pytest.approx(25.0)
    report["disk"] = None
    assert bench.rooflines(report) == {}


def test_the_rooflines_disk_rate_is_the_best_the_run_measured(bench):
    """A limited run whose own reads went faster than the O_DIRECT measurement sets the rate."""
    MB = bench.MB

    def run(prompt_bytes, decode_bytes):
        return {"status": "ok", "read_bytes_prompt": prompt_bytes, "prompt_tok_s": 20.0, "prompt_tokens": 40,
                "decode_read_bytes_per_token": decode_bytes, "decode_tok_s": 10.0}

    tier = {"kind": "tier", "placement": "limited", "config": "tier, 1600 MB", "decode_tok_s": 10.0,
            "decode_read_bytes_per_token": 100 * MB, "runs": [run(1000 * MB, 100 * MB)]}
    in_ram = {"kind": "tier", "placement": "ram", "config": "tier, in RAM", "decode_tok_s": 50.0,
              "decode_read_bytes_per_token": 0, "runs": [run(0, 0)]}
    report = {"disk": {"sequential_qd1_gbps": 1.0, "sequential_threads_gbps": 0.9}, "rows": [in_ram, tier]}
    # the prompt read 1000 MB in 2 s: 0.5 GB/s, slower than the disk measurement: 1.0 GB/s stands
    r = bench.rooflines(report)["tier, 1600 MB"]
    assert (r["gbps"], r["gbps_from"]) == (pytest.approx(1.0), "the disk measurement")
    tier["runs"].append(run(3000 * MB, 100 * MB))  # 1.5 GB/s in its prompt
    r = bench.rooflines(report)["tier, 1600 MB"]
    assert (r["gbps"], r["gbps_from"]) == (pytest.approx(1.5), "tier, 1600 MB's prompt")
    assert r["tok_s"] == pytest.approx(15.0)  # 100 MB at 1.5 GB/s
    tier["runs"].append({**run(0, 200 * MB), "status": "killed"})  # a failed run measures nothing
    assert bench.rooflines(report)["tier, 1600 MB"]["gbps"] == pytest.approx(1.5)


def test_a_tokens_time_is_fitted_against_its_reads(bench):
    """Least squares over the run's decode tokens: ms per MB read and ms at no read; none where
    the reads do not vary (in RAM) or there are too few tokens."""
    MB = bench.MB
    fit = bench.token_time_fit([20.0 + 0.5 * mb for mb in (10, 30, 20, 40)], [mb * MB for mb in (10, 30, 20, 40)])
    assert fit == {"decode_ms_per_read_mb": pytest.approx(0.5), "decode_ms_at_no_read": pytest.approx(20.0)}
    assert bench.token_time_fit([30.0, 31.0, 29.0], [0, 0, 0]) == {"decode_ms_per_read_mb": None,
                                                                    "decode_ms_at_no_read": None}
    assert bench.token_time_fit([30.0, 40.0], [0, MB])["decode_ms_per_read_mb"] is None


def test_each_requests_first_tokens_are_timed_apart(bench):
    assert bench.FIRST_TOKENS == 2
    # two requests of 4 tokens: 100, 80 | 50, 60 and 90, 70 | 40, 50
    phases = bench.token_phases([100.0, 80.0, 50.0, 60.0, 90.0, 70.0, 40.0, 50.0], [0, 4])
    assert phases == {"decode_ms_first": pytest.approx(85.0), "decode_ms_later": pytest.approx(50.0)}
    assert bench.token_phases([100.0, 80.0], [0]) == {"decode_ms_first": pytest.approx(90.0), "decode_ms_later": None}
    assert bench.token_phases([], [0]) == {"decode_ms_first": None, "decode_ms_later": None}


def test_the_read_paths_cost_the_cpu_per_mb_read(bench, tmp_path):
    """Both paths read their requests and report a rate and the CPU per MB; a file too small
    for the requests is one error naming it."""
    path = tmp_path / "model.gguf"
    path.write_bytes(os.urandom(8 << 20))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        pytest.skip("no O_DIRECT on the test's filesystem")
    try:
        costs = bench.read_path_costs(str(path), fd, 300_000)
        with pytest.raises(bench.BenchError, match="too small to measure reads of 3000000 bytes"):
            bench.read_path_costs(str(path), fd, 3_000_000)
    finally:
        os.close(fd)
    assert costs["request_bytes"] == 303104  # whole pages
    # the file holds 27 requests that share no page: half of them each
    assert (costs["page_cache"]["requests"], costs["direct"]["requests"]) == (13, 14)
    for name in ("page_cache", "direct"):
        assert costs[name]["gbps"] > 0 and costs[name]["cpu_ms_per_mb"] >= 0


def test_rounds_alternate_which_in_ram_run_comes_first(bench):
    configs = [("stock", "ram"), ("tier", "ram"), ("stock", "limited"), ("tier", "limited"), ("tier-noahead", "limited")]
    limited = configs[2:]
    assert bench.round_order(configs, 0) == configs
    assert bench.round_order(configs, 1) == [("tier", "ram"), ("stock", "ram")] + limited
    assert bench.round_order(configs, 2) == configs
    assert bench.round_order(configs[:2], 3) == [("tier", "ram"), ("stock", "ram")]
    assert bench.round_order([("stock", "ram")], 1) == [("stock", "ram")]
