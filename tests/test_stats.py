"""python -m moecache.stats: a stats JSON as a per-layer table, once or whenever it changes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from moecache.stats import main, table

REPO = Path(__file__).resolve().parent.parent


def stats(hits: int) -> dict:
    layers = [{"layer": 3, "hits": hits, "misses": 10 - hits, "uploads": 2, "evictions": 1, "late": 0,
               "prefill_uploads": 4},
              {"layer": 5, "hits": 0, "misses": 0, "uploads": 0, "evictions": 0, "late": 0, "prefill_uploads": 0}]
    totals = {c: sum(layer[c] for layer in layers) for c in layers[0] if c != "layer"}
    return {"policy": "heat", "slots": 2, "inserts": 2, "admission": "eager", "device_bytes": 3 << 20,
            "decode_steps": 5, "decode_tokens": 5, "hit_rate": hits / 10, "totals": totals,
            "step_us_mean": 250.0, "failed": None, "layers": layers}


def test_the_table_has_a_row_per_layer_and_the_totals():
    lines = table(stats(7)).splitlines()
    assert lines[0] == ("policy heat, K=2, inserts 2, admission eager, 3.0 MiB; 5 decode steps (5 tokens), "
                        "hit rate 70.0%, step 250 us mean")
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


def test_metrics_are_prometheus_text_per_layer_and_per_cache():
    from prometheus_client.parser import text_string_to_metric_families

    from moecache.live.metrics import exposition

    class Cache:  # what a LiveCache's stats() gives, two contexts
        def __init__(self, hits):
            self.hits = hits

        def stats(self):
            s = stats(self.hits)
            s["totals"]["upload_bytes"] = 1024
            s["prefill_tokens"] = 12
            return s

    families = {f.name: f for f in text_string_to_metric_families(exposition(lambda: [Cache(7), Cache(2)]).decode())}
    hits = {(s.labels["context"], s.labels["layer"]): s.value for s in families["moecache:hits"].samples}
    assert hits == {("0", "3"): 7, ("0", "5"): 0, ("1", "3"): 2, ("1", "5"): 0}
    assert families["moecache:hits"].type == "counter"
    assert [s.value for s in families["moecache:hit_ratio"].samples] == [0.7, 0.2]
    assert [s.value for s in families["moecache:upload_bytes"].samples] == [1024, 1024]
    assert [s.value for s in families["moecache:step_seconds_mean"].samples] == [250e-6, 250e-6]


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
    from prometheus_client.parser import text_string_to_metric_families

    from moecache.live.metrics import exposition

    lines = table(planner_stats(7)).splitlines()
    assert lines[1].startswith("miss planner: link 2.5 GB/s (LLAMA_MOE_CACHE_LINK_GBPS), host 40 GB/s")
    assert "pays back 17.00 uses; 1.50 MiB uploaded per decode token" in lines[1]
    assert lines[2].split()[-1] == "declined"
    assert lines[3].split()[-1] == "6" and lines[5].split()[-1] == "6"

    class Cache:
        def stats(self):
            s = planner_stats(7)
            s["totals"]["upload_bytes"], s["prefill_tokens"] = 1024, 12
            return s

    families = {f.name: f for f in text_string_to_metric_families(exposition(lambda: [Cache()]).decode())}
    assert {s.labels["layer"]: s.value for s in families["moecache:declined"].samples} == {"3": 6, "5": 0}
    assert {s.labels["rate"]: s.value for s in families["moecache:planner_gbps"].samples} == \
        {"link": 2.5, "host": 40.0, "dram": 41.0}
    assert [s.value for s in families["moecache:planner_payback_uses"].samples] == [17.0]
    assert [s.value for s in families["moecache:link_bytes_per_token"].samples] == [3 << 19]
