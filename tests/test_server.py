"""python -m moecache.serve: llama-cpp-python's server with the expert cache on the loopback RPC
device (this machine has no GPU), under a burst of concurrent and sequential requests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from conftest import load

llama_cpp = pytest.importorskip("llama_cpp")
pytest.importorskip("uvicorn")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "The three primary colors are"
N_TOKENS = 24
# greedy, and the server's other defaults as llama_cpp.Llama has them (the server's repeat
# penalty is 1.1)
SAMPLING = {"max_tokens": N_TOKENS, "temperature": 0.0, "repeat_penalty": 1.0}


def _serve(args: list[str], env: dict, **kwargs) -> subprocess.Popen:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_MOE_CACHE_")}
    full_env.update(env)
    return subprocess.Popen([sys.executable, "-m", "moecache.serve", *args], env=full_env, cwd=REPO,
                            stderr=subprocess.PIPE, text=True, **kwargs)


@pytest.mark.parametrize("args,message", [
    (["--bogus", "1"], "unrecognized arguments: --bogus 1"),
    (["--model", "m.gguf", "--n_ctx", "abc"], "argument --n_ctx: invalid int value: 'abc'"),
    ([], "--model: Field required"),
    (["--model", "/nonexistent/m.gguf"], "--model /nonexistent/m.gguf: no such file"),
    (["--config_file", "/nonexistent/c.json"], "--config_file /nonexistent/c.json: no such file"),
    (["--model", __file__, "--port", "99999"], "--port 99999: not a TCP port (1-65535)"),
])
def test_bad_arguments_are_one_line(args, message):
    server = _serve(args, {})
    _, err = server.communicate(timeout=120)
    assert server.returncode == 2
    assert err.splitlines() == [f"python -m moecache.serve: error: {message}"]


@pytest.mark.parametrize("env", [{}, {"LLAMA_MOE_CACHE_MIB": "64"}, {"LLAMA_MOE_CACHE_SLOTS": "2"}])
def test_a_model_llama_cpp_cannot_load_is_one_error_line(env):
    server = _serve(["--model", __file__, "--verbose", "false"], env, stdout=subprocess.DEVNULL)
    _, err = server.communicate(timeout=120)
    assert server.returncode == 2
    assert [line for line in err.splitlines() if "error" in line.lower()] == [
        f"python -m moecache.serve: error: Failed to load model from file: {__file__}"]
    assert ("the expert cache is off" in err) == (not env), err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _complete(port: int) -> tuple[int, str, int, float]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", method="POST", headers={"Content-Type": "application/json"},
        data=json.dumps({"prompt": PROMPT, **SAMPLING}).encode())
    t0 = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        body = json.loads(response.read())
        return (response.status, body["choices"][0]["text"], body["usage"]["completion_tokens"],
                time.perf_counter() - t0)


def _metrics(port: int) -> dict:
    """GET /metrics, parsed as Prometheus text: {family name: family}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as response:
        assert response.status == 200 and response.headers["Content-Type"].startswith("text/plain")
        return {family.name: family for family in text_string_to_metric_families(response.read().decode())}


def _wait_ready(server: subprocess.Popen, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5):
                return
        except OSError:
            if server.poll() is not None:
                raise AssertionError(f"the server exited with {server.returncode}: {server.stderr.read()[-2000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"the server did not answer within {timeout:.0f} s")
            time.sleep(0.3)


def test_server_burst_with_the_cache(tmp_path, rpc_device, tiny_path):
    """20 concurrent, then 20 sequential greedy completions of one prompt: every one HTTP 200,
    all the same text, that of the stock graph in this process (same placement, cache off), and
    the cache attached and used (its stats at the server's exit)."""
    # the server's first request evaluates the whole prompt, the others find it in the KV cache
    # and evaluate only its last token again (see test_reliability): both, stock
    llm = load(tiny_path, n_ctx=1024)
    stock_first, stock_again = (llm.create_completion(PROMPT, **SAMPLING)["choices"][0]["text"] for _ in range(2))
    llm.close()

    port = _free_port()
    stats = tmp_path / "stats.json"
    server = _serve(["--model", tiny_path, "--n_ctx", "1024", "--host", "127.0.0.1", "--port", str(port),
                     "--verbose", "false"],
                    {"LLAMA_MOE_CACHE_SLOTS": "2", "LLAMA_MOE_CACHE_POLICY": "lru",
                     "LLAMA_MOE_CACHE_STATS": str(stats)}, stdout=subprocess.DEVNULL)
    try:
        _wait_ready(server, port, timeout=120)
        results: list = [None] * 20
        errors: list = []

        def one(i):
            try:
                results[i] = _complete(port)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(f"request {i}: {e!r}")

        scrapes: list = []
        done = threading.Event()

        def scrape():  # /metrics while the requests run
            while not done.is_set():
                scrapes.append(_metrics(port))
                time.sleep(0.2)

        t0 = time.perf_counter()
        scraper = threading.Thread(target=scrape)
        threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
        for t in [scraper, *threads]:
            t.start()
        for t in threads:
            t.join(timeout=300)
        done.set()
        scraper.join(timeout=60)
        t_concurrent = time.perf_counter() - t0
        final_metrics = _metrics(port)
        assert not errors, errors
        assert not any(t.is_alive() for t in threads), "a request hung"
        t0 = time.perf_counter()
        sequential = [_complete(port) for _ in range(20)]
        t_sequential = time.perf_counter() - t0
    finally:
        server.send_signal(signal.SIGINT)  # a clean shutdown writes the cache's stats
        try:
            _, err = server.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            _, err = server.communicate()
    assert server.returncode == 0, err[-2000:]

    burst = results + sequential
    assert [status for status, *_ in burst] == [200] * 40
    texts = [text for _, text, *_ in burst]
    assert sorted(texts) == sorted([stock_first] + [stock_again] * 39)
    assert len(set(texts)) == 1, "stock decodes this prompt differently once it is in the KV cache"
    assert len(set(stock_first)) > 5, f"a degenerate greedy text proves little: {stock_first!r}"

    report = json.loads(stats.read_text())
    assert scrapes, "no /metrics scrape while the requests ran"
    hits = [sum(s.value for s in family.samples if s.name == "moecache_hits_total")
            for family in (m["moecache_hits"] for m in scrapes + [final_metrics])]
    assert hits == sorted(hits) and hits[-1] > 0  # counters only grow
    layers = {s.labels["layer"] for s in final_metrics["moecache_hits"].samples}
    assert len(layers) == len(report["layers"])
    assert final_metrics["moecache_slots"].samples[0].value == 2
    assert final_metrics["moecache_slots"].samples[0].labels == {"context": "0", "tier": "device"}
    # cached ubatches (up to LLAMA_MOE_CACHE_MAX_BATCH tokens): the first request's prompt, then
    # each request's sampled tokens but the last, and every request after the first its prompt's
    # last token again (the prompt is in the KV cache); the cache observes each graph at the next
    # one's step, so the very last goes uncounted
    assert report["decode_steps"] == 1 + sum(n - 1 for _, _, n, _ in burst) + 39 - 1
    assert report["totals"]["hits"] > 0 and report["totals"]["uploads"] > 0
    latencies = sorted(latency for *_, latency in sequential)
    print(f"\nserver burst: 20 concurrent in {t_concurrent:.2f} s, 20 sequential in {t_sequential:.2f} s "
          f"(median {latencies[10] * 1e3:.0f} ms per completion), "
          f"{report['decode_steps']} decode steps, hit rate {100 * report['hit_rate']:.1f}%")


def test_sigterm_writes_the_final_stats(tmp_path, tiny_path):
    # systemd, docker and Kubernetes stop a service with SIGTERM; with the default FLUSH_STEPS a
    # short run has written no stats before it
    port = _free_port()
    stats = tmp_path / "stats.json"
    server = _serve(["--model", tiny_path, "--n_ctx", "512", "--host", "127.0.0.1", "--port", str(port),
                     "--verbose", "false"],
                    {"LLAMA_MOE_CACHE_SLOTS": "2", "LLAMA_MOE_CACHE_STATS": str(stats)},
                    stdout=subprocess.DEVNULL)
    try:
        _wait_ready(server, port, timeout=120)
        assert _complete(port)[0] == 200
        assert not stats.exists()
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            _, err = server.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            _, err = server.communicate()
    assert server.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert json.loads(stats.read_text())["decode_steps"] > 0


def test_the_trace_and_the_stats_count_a_request_alike(tmp_path, tiny_path):
    """The server's Llama computes logits for every prompt token (llama_cpp.server's logits_all
    defaults to true), so a prompt of up to LLAMA_MOE_CACHE_MAX_BATCH tokens runs the cached graph:
    one decode step of several tokens. The stats counted it as one step, the replay of the trace
    as one per token (a 150-token completion: 149 decode steps against 152); the replay now counts
    steps as the stats do, and tokens apart."""
    from moecache.formats.traces import PREFILL, read_trace
    from moecache.offline.replay import PerLayerReplay, simulate

    port = _free_port()
    stats, trace = tmp_path / "stats.json", tmp_path / "trace.csv"
    server = _serve(["--model", tiny_path, "--n_ctx", "512", "--host", "127.0.0.1", "--port", str(port),
                     "--verbose", "false"],
                    {"LLAMA_MOE_CACHE_SLOTS": "2", "LLAMA_MOE_CACHE_STATS": str(stats),
                     "LLAMA_MOE_CACHE_TRACE": str(trace)}, stdout=subprocess.DEVNULL)
    try:
        _wait_ready(server, port, timeout=120)
        n_tokens = _complete(port)[2]
    finally:
        server.send_signal(signal.SIGINT)
        _, err = server.communicate(timeout=60)
    assert server.returncode == 0, err[-2000:]
    report, recorded = json.loads(stats.read_text()), read_trace(str(trace))
    run = simulate(recorded, PerLayerReplay("lru", 2))
    assert (run.decode_steps, run.decode_tokens) == (report["decode_steps"], report["decode_tokens"])
    # the prompt, then each sampled token but the last; the very last graph goes unobserved
    assert report["decode_steps"] == 1 + (n_tokens - 1) - 1 and report["decode_tokens"] > report["decode_steps"]
    assert report["prefill_tokens"] == int((recorded.phase == PREFILL).sum()) == 0
