"""python -m moecache.stats: a stats JSON as a per-layer table, once or whenever it changes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moecache.stats import main, table

REPO = Path(__file__).resolve().parent.parent


def stats(hits: int) -> dict:
    layers = [{"layer": 3, "hits": hits, "misses": 10 - hits, "uploads": 2, "evictions": 1, "late": 0,
               "prefill_uploads": 4},
              {"layer": 5, "hits": 0, "misses": 0, "uploads": 0, "evictions": 0, "late": 0, "prefill_uploads": 0}]
    totals = {c: sum(layer[c] for layer in layers) for c in layers[0] if c != "layer"}
    return {"tier": "device", "policy": "heat", "slots": 2, "inserts": 2, "admission": "eager",
            "device_bytes": 3 << 20, "steps": 6, "decode_steps": 5, "decode_tokens": 5, "hit_rate": hits / 10,
            "totals": totals, "step_us_mean": 250.0, "failed": None, "layers": layers}


def test_the_table_has_a_row_per_layer_and_the_totals():
    lines = table(stats(7)).splitlines()
    assert lines[0] == ("device cache: policy heat, K=2, inserts 2, admission eager, 3.0 MiB; 5 decode steps "
                        "(5 tokens), hit rate 70.0%, step 250 us mean")
    assert lines[1].split() == ["layer", "hit", "rate", "hits", "misses", "uploads", "evictions", "late",
                                "prefill", "uploads"]
    assert lines[2].split() == ["3", "70.0%", "7", "3", "2", "1", "0", "4"]
    assert lines[3].split() == ["5", "-", "0", "0", "0", "0", "0", "0"]  # no lookups: no rate
    assert lines[4].split() == ["all", "70.0%", "7", "3", "2", "1", "0", "4"]


def test_a_file_that_is_not_stats_is_one_line(tmp_path, capsys):
    (tmp_path / "x.json").write_text("[1, 2]")
    assert main([str(tmp_path / "x.json")]) == 2
    assert capsys.readouterr().err == (f"python -m moecache.stats: error: {tmp_path / 'x.json'}: "
                                       f"not a moecache stats file (no layers and totals)\n")
    assert main([str(tmp_path / "missing.json")]) == 2


def test_watch_prints_again_when_the_file_changes(tmp_path):
    path = tmp_path / "stats.json"
    path.write_text(json.dumps(stats(1)))
    viewer = subprocess.Popen([sys.executable, "-m", "moecache.stats", str(path), "--watch", "1"],
                              stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert "hit rate 10.0%" in viewer.stdout.readline()
        time.sleep(0.05)  # a distinct modification time
        path.write_text(json.dumps(stats(9)))
        lines = [viewer.stdout.readline() for _ in range(5)]
        assert "hit rate 90.0%" in lines[-1]
    finally:
        viewer.kill()
        viewer.wait()


def ram_stats(hits: int) -> dict:
    """stats() of a RAM tier: alone, or under a device cache (its "ram_tier")."""
    s = stats(hits)
    s.update(tier="RAM", slots=4, device_bytes=100 << 20, admission="eager")
    return s


class Cache:
    """What a LiveCache's stats() gives, with the counters the metrics read beyond the table's."""

    def __init__(self, s):
        for tier in (s, s.get("ram_tier") or {}):
            if tier:
                tier["totals"]["upload_bytes"], tier["prefill_tokens"] = 1024, 12
        self.s = s

    def stats(self):
        return self.s


def families(caches) -> dict:
    """exposition() of these caches' stats, parsed as Prometheus text: {family name: family}."""
    from prometheus_client.parser import text_string_to_metric_families

    from moecache.live.metrics import exposition

    return {f.name: f for f in text_string_to_metric_families(exposition(lambda: [Cache(s) for s in caches]).decode())}


def test_metrics_are_prometheus_text_per_layer_and_per_cache():
    found = families([stats(7), stats(2)])
    hits = {(s.labels["context"], s.labels["layer"]): s.value for s in found["moecache_hits"].samples}
    assert hits == {("0", "3"): 7, ("0", "5"): 0, ("1", "3"): 2, ("1", "5"): 0}
    assert found["moecache_hits"].type == "counter"
    assert [s.value for s in found["moecache_hit_ratio"].samples] == [0.7, 0.2]
    assert [s.value for s in found["moecache_upload_bytes"].samples] == [1024, 1024]
    # the step time as a _sum/_count pair: 6 steps of 250 us
    step = {s.name: s.value for s in found["moecache_step_seconds"].samples if s.labels["context"] == "0"}
    assert found["moecache_step_seconds"].type == "summary"
    assert step == {"moecache_step_seconds_count": 6, "moecache_step_seconds_sum": pytest.approx(1.5e-3)}


def test_metric_names_follow_prometheus_conventions():
    """moecache_ and snake case (a colon is for recording rules), base units in the name,
    counters in _total, a HELP and a TYPE line each (issue 36)."""
    from moecache.live.metrics import exposition

    both = stats(7)
    both["ram_tier"] = ram_stats(3)
    found = families([both])
    assert all(re.fullmatch(r"moecache_[a-z_]+", name) for name in found), sorted(found)
    for family in found.values():
        assert family.documentation, family.name
        if family.type == "counter":
            assert all(s.name == family.name + "_total" for s in family.samples), family.name
    assert {"moecache_cache_bytes", "moecache_step_seconds", "moecache_late_uploads"} <= set(found)
    assert "moecache_step_seconds_mean" not in found and "moecache_device_bytes" not in found
    text = exposition(lambda: [Cache(both)]).decode()
    samples = {line.split("{")[0].split()[0] for line in text.splitlines() if not line.startswith("#")}
    assert samples and all(":" not in name for name in samples)
    assert all(f"# HELP {name}" in text and f"# TYPE {name}" in text for name in found)


def test_both_tiers_are_in_the_metrics_and_the_table_each_under_its_tier():
    """The RAM tier alone went out under the device cache's names; under a device cache it was in
    the JSON only."""
    alone = families([ram_stats(3)])
    assert {s.labels["tier"] for f in alone.values() for s in f.samples} == {"ram"}
    assert [s.value for s in alone["moecache_cache_bytes"].samples] == [100 << 20]
    both = stats(7)
    both["ram_tier"] = ram_stats(3)
    found = families([both])
    size = {s.labels["tier"]: s.value for s in found["moecache_cache_bytes"].samples}
    assert size == {"device": 3 << 20, "ram": 100 << 20}
    hits = {(s.labels["tier"], s.labels["layer"]): s.value for s in found["moecache_hits"].samples}
    assert hits == {("device", "3"): 7, ("device", "5"): 0, ("ram", "3"): 3, ("ram", "5"): 0}
    assert all("tier" in s.labels for f in found.values() for s in f.samples)
    lines = table(both).splitlines()
    assert lines[0].startswith("device cache: policy heat, K=2,") and "hit rate 70.0%" in lines[0]
    ram = lines.index(next(line for line in lines if line.startswith("RAM tier:")))
    assert lines[ram].startswith("RAM tier: policy heat, K=4, inserts 2, admission eager, 100.0 MiB;")
    assert lines[ram + 4].split() == ["all", "30.0%", "3", "7", "2", "1", "0", "4"]


@pytest.mark.parametrize("content,problem", [
    ({"layers": [1], "totals": {}}, "layers[0] is not an object"),  # was: 'int' object has no attribute 'get'
    ({"layers": [], "totals": 3}, "no layers and totals"),
    ({"layers": [{"layer": 0, "hits": "7"}], "totals": {}}, "layers[0].hits is not a count"),
    ({"layers": [], "totals": {}, "decode_steps": [1]}, "decode_steps is not a number"),
    ({"layers": [], "totals": {}, "planner": {"link_gbps": 1}}, "planner lacks its rates, sources or payback"),  # was: 'link_source'
    ({"layers": [], "totals": {}, "ram_tier": {"layers": 3}}, "ram_tier has no layers and totals"),
    ({"layers": [], "totals": {}, "tier": "disk"}, "tier is not one of device, RAM"),
])
def test_stats_of_the_wrong_shape_are_one_line_naming_the_file(tmp_path, capsys, content, problem):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(content))
    assert main([str(path)]) == 2
    assert capsys.readouterr().err == f"python -m moecache.stats: error: {path}: not a moecache stats file ({problem})\n"


def test_files_that_are_not_stats_are_one_line_never_a_hang_or_memory_error(tmp_path):
    """A FIFO with no writer hung, a 3 GB file was read whole (a bare MemoryError), --watch
    99999999999 failed in time.sleep, a deeply nested JSON hit the recursion limit."""
    fifo, big, deep = tmp_path / "fifo", tmp_path / "big.json", tmp_path / "deep.json"
    os.mkfifo(fifo)
    with open(big, "wb") as f:
        f.truncate(3 << 30)  # sparse: no disk taken
    deep.write_text("[" * 100000 + "]" * 100000)
    for args, line in (([fifo], f"{fifo}: not a regular file"),
                       ([big], f"{big}: larger than a stats file (64 MiB at most)"),
                       ([deep], f"{deep}: not a moecache stats file (not JSON)"),
                       ([deep, "--watch", "99999999999"], "argument --watch: 99999999999 must be in [1, 86400]")):
        run = subprocess.run([sys.executable, "-m", "moecache.stats", *map(str, args)], capture_output=True,
                             text=True, cwd=REPO, timeout=60)
        assert run.returncode == 2 and run.stderr == f"python -m moecache.stats: error: {line}\n", run.stderr


def planner_stats(hits: int) -> dict:
    """stats() of a cache with the miss planner on (LLAMA_MOE_CACHE_PLANNER=1)."""
    s = stats(hits)
    for layer, declined in zip(s["layers"], (6, 0)):
        layer["declined"] = declined
    s["totals"]["declined"] = 6
    s["link_bytes_per_token"] = 3 << 19
    s["planner"] = {"host_gbps": 40.0, "link_gbps": 2.5, "dram_gbps": 41.0, "device_gbps": 314.0,
                    "ids_trip_us": 30.0, "join_us": 10.0, "payback_uses": 17.0, "hardware": "pcie3-x4-egpu",
                    "link_source": "LLAMA_MOE_CACHE_LINK_GBPS", "host_source": "measured: ..."}
    return s


def test_with_the_planner_the_table_and_metrics_show_its_rates_and_declined_uploads():
    lines = table(planner_stats(7)).splitlines()
    assert lines[1].startswith("miss planner: link 2.5 GB/s (LLAMA_MOE_CACHE_LINK_GBPS), host 40 GB/s")
    assert "pays back 17.00 uses; 1.50 MiB uploaded per decode token" in lines[1]
    assert lines[2].split()[-1] == "declined"
    assert lines[3].split()[-1] == "6" and lines[5].split()[-1] == "6"
    found = families([planner_stats(7)])
    assert {s.labels["layer"]: s.value for s in found["moecache_declined_uploads"].samples} == {"3": 6, "5": 0}
    assert {s.labels["rate"]: s.value for s in found["moecache_planner_rate_bytes_per_second"].samples} == \
        {"link": 2.5e9, "host": 40e9, "dram": 41e9}
    assert [s.value for s in found["moecache_planner_payback_uses"].samples] == [17.0]
    assert [s.value for s in found["moecache_link_bytes_per_token"].samples] == [3 << 19]


def test_the_ram_tiers_reads_are_in_the_table_and_the_metrics_per_phase():
    """Its reads of the model file (issue 38, item 5): bytes, experts read ahead and of them selected,
    the bytes of those not, the time the layers waited; per phase in /metrics, decode's per token in
    the table."""
    s = ram_stats(3)
    decode = {"read_bytes": 50 << 20, "read_ahead": 40, "read_ahead_used": 30, "read_ahead_bytes": 40 << 20,
              "read_ahead_wasted_bytes": 10 << 20, "read_wait_us": 25_000}
    prompt = dict(decode, read_bytes=300 << 20, read_wait_us=0)
    s["reads"] = {"decode": decode, "prompt": prompt,
                  "decode_per_token": {"read_bytes_per_token": 10 << 20, "wasted_bytes_per_token": 2 << 20,
                                       "wait_ms_per_token": 5.0, "read_ahead_precision": 0.75}}
    found = families([s])
    read = {s.labels["phase"]: s.value for s in found["moecache_read_bytes"].samples}
    assert read == {"decode": 50 << 20, "prompt": 300 << 20}
    assert found["moecache_read_bytes"].type == "counter"
    used = {s.labels["phase"]: s.value for s in found["moecache_read_ahead_used_experts"].samples}
    assert used == {"decode": 30, "prompt": 30}
    wait = {s.labels["phase"]: s.value for s in found["moecache_read_wait_seconds"].samples}
    assert wait == {"decode": pytest.approx(0.025), "prompt": 0}
    assert {s.labels["tier"] for s in found["moecache_read_ahead_wasted_bytes"].samples} == {"ram"}
    lines = table(s).splitlines()
    assert lines[1] == ("reads: decode 10.00 MiB per token, 75.0% of the experts read ahead selected, 2.00 MiB "
                        "read ahead and not selected, waited 5.00 ms per token; prompt 300.0 MiB")
    # a device cache has no reads: no such series
    device = families([stats(7)])
    assert "moecache_read_bytes" not in device or not device["moecache_read_bytes"].samples
