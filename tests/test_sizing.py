"""Sizing the expert cache by memory (LLAMA_MOE_CACHE_MIB=N|auto, SLOTS=auto, RESERVE_MIB).

The device tests run on loopback RPC devices with a memory size (RpcDevice(memory_mib=N)): each
reports N MiB less what is allocated on it as free and refuses allocations beyond, as a GPU
does. They run in subprocesses: ggml cannot unregister a device, and a sized device left in
this process would change where every later test's model goes. The expected K comes from this
file's own arithmetic on the GGUF's expert tensors, not from moecache.live.sizing."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from moecache.core.banks import equal_bytes, slots_for_budget
from moecache.live.config import CacheConfig, ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20


# --- configuration -----------------------------------------------------------------------------

@pytest.mark.parametrize("env,message", [
    ({"LLAMA_MOE_CACHE_SLOTS": "4", "LLAMA_MOE_CACHE_MIB": "64"},
     "LLAMA_MOE_CACHE_SLOTS=4 and LLAMA_MOE_CACHE_MIB=64 both size the cache: set one"),
    ({"LLAMA_MOE_CACHE_SLOTS": "auto", "LLAMA_MOE_CACHE_MIB": "64"},
     "LLAMA_MOE_CACHE_SLOTS=auto and LLAMA_MOE_CACHE_MIB=64 both size the cache: set one"),
    ({"LLAMA_MOE_CACHE_SLOTS": "2", "LLAMA_MOE_CACHE_MIB": "auto"},
     "LLAMA_MOE_CACHE_SLOTS=2 and LLAMA_MOE_CACHE_MIB=auto both size the cache: set one"),
    ({"LLAMA_MOE_CACHE_MIB": "64MiB"}, "LLAMA_MOE_CACHE_MIB='64MiB' is not an integer"),
    ({"LLAMA_MOE_CACHE_MIB": "-1"}, "LLAMA_MOE_CACHE_MIB=-1 must be >= 0"),
    ({"LLAMA_MOE_CACHE_MIB": "AUTO"}, "LLAMA_MOE_CACHE_MIB='AUTO' is not an integer"),
    ({"LLAMA_MOE_CACHE_MIB": "auto", "LLAMA_MOE_CACHE_RESERVE_MIB": "-5"},
     "LLAMA_MOE_CACHE_RESERVE_MIB=-5 must be >= 0"),
    ({"LLAMA_MOE_CACHE_MIB": "auto", "LLAMA_MOE_CACHE_RESERVE_MIB": "1 GiB"},
     "LLAMA_MOE_CACHE_RESERVE_MIB='1 GiB' is not an integer"),
])
def test_bad_sizing_values_are_one_line(env, message):
    with pytest.raises(ConfigError) as err:
        CacheConfig.from_env(env)
    assert str(err.value) == message


@pytest.mark.parametrize("env,overrides,budget,sized_by", [
    ({"LLAMA_MOE_CACHE_MIB": "64"}, {}, 64, "LLAMA_MOE_CACHE_MIB=64"),
    ({"LLAMA_MOE_CACHE_MIB": "auto"}, {}, "auto", "LLAMA_MOE_CACHE_MIB=auto"),
    ({"LLAMA_MOE_CACHE_SLOTS": "auto"}, {}, "auto", "LLAMA_MOE_CACHE_SLOTS=auto"),
    ({"LLAMA_MOE_CACHE_SLOTS": "auto", "LLAMA_MOE_CACHE_MIB": "auto"}, {}, "auto", "LLAMA_MOE_CACHE_SLOTS=auto"),
    ({"LLAMA_MOE_CACHE_SLOTS": "8"}, {}, None, "LLAMA_MOE_CACHE_SLOTS=8"),
    ({}, {"mib": 32}, 32, "LLAMA_MOE_CACHE_MIB=32"),
    ({}, {"mib": "auto", "reserve_mib": 0}, "auto", "LLAMA_MOE_CACHE_MIB=auto"),
])
def test_sizing_settings(env, overrides, budget, sized_by):
    config = CacheConfig.from_env(env, **overrides)
    assert config.enabled and config.budget_mib == budget and config.sized_by == sized_by


def test_mib_zero_is_off_and_reserve_defaults_to_llama_cpps_margin():
    config = CacheConfig.from_env({"LLAMA_MOE_CACHE_MIB": "0"})
    assert not config.enabled and config.reserve_mib == 1024


@pytest.mark.parametrize("budget", [0, 1, 99, 100, 101, 5000, 10**9])
def test_slots_for_budget_is_the_largest_k_that_fits(budget):
    def bytes_of(k):
        return 100 + 37 * (k + 1)

    linear = max([k for k in range(1, 65) if bytes_of(k) <= budget], default=0)
    assert slots_for_budget(bytes_of, budget, 64) == linear


# --- the replay's per-layer model at a budget --------------------------------------------------------

def test_replay_per_layer_k_is_the_largest_that_fits_the_budget():
    from conftest import TRACES

    from moecache.formats.traces import read_trace
    from moecache.offline.replay import per_layer_slots

    trace = read_trace(str(TRACES / "qwen3-30b-a3b.route.csv"))
    for budget in (300, 1000, 3000, 4000):
        k = per_layer_slots(trace, budget)
        fits = lambda k: equal_bytes(trace.expert_bytes, k) <= budget * MIB  # noqa: E731
        assert fits(k) and not fits(k + 1), budget
    assert per_layer_slots(trace, 3000) == 22  # 48 layers x 22 slots + a zero slot per bank (2 expert sizes)
    assert per_layer_slots(trace, 10**6) == trace.n_expert


def test_replay_budget_runs_both_models_at_the_same_bytes(tmp_path):
    from conftest import TRACES

    from moecache.formats.traces import read_trace
    from moecache.offline.cli import main
    from moecache.offline.replay import PerLayerReplay, simulate

    path = TRACES / "qwen3-30b-a3b.route.csv"
    out = tmp_path / "r.csv"
    assert main([str(path), "--budget-mib", "3000", "--policies", "lru", "--csv", str(out)]) == 0
    import csv

    rows = {row["model"]: row for row in csv.DictReader(out.open())}
    assert rows.keys() == {"per-layer", "global"}
    assert rows["per-layer"]["slots"] == "22" and rows["per-layer"]["budget_mib"] == "3000.0"
    expected = simulate(read_trace(str(path)), PerLayerReplay("lru", 22, admission="eager")).totals  # the live default
    assert int(rows["per-layer"]["hits"]) == expected["hits"]
    assert rows["global"]["budget_mib"] == "3000.0" and rows["global"]["slots"] == ""


def test_replay_budget_below_one_slot_per_layer_is_one_line(capsys):
    from conftest import TRACES

    from moecache.offline.cli import main

    assert main([str(TRACES / "qwen3-30b-a3b.route.csv"), "--budget-mib", "100", "--policies", "lru"]) == 2
    err = capsys.readouterr().err
    assert err == ("python -m moecache.replay: error: --budget-mib 100 is below one slot per layer for the "
                   "per-layer model: this trace needs at least 137 MiB\n")


# --- on sized RPC devices --------------------------------------------------------------------------

def expected_bytes(path: str, layers, k: int, alignment: int) -> int:
    """What K slots per layer take on a device: per expert layout (the types and shapes of a
    layer's per-expert tensors: weights, biases, scales, all but the down bias, which the graph
    adds after the merge), a bank of each with n_layers*K + 1 slots (one zero slot per bank), and
    the I32 id -> slot table of all the layers, each padded to the alignment."""
    import gguf

    pad = lambda n: -(-n // alignment) * alignment  # noqa: E731
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    banked = re.compile(r"blk\.(\d+)\.ffn_(up|gate|gate_up|down)_exps\.(weight|bias|scale)")
    layouts = {}
    for il in layers:
        parts = [t for name, t in sorted(tensors.items())
                 if (m := banked.fullmatch(name)) and int(m[1]) == il and not name.endswith("down_exps.bias")]
        key = tuple((m[2], m[3], int(t.tensor_type), *map(int, t.shape[:-1]))
                    for t in parts for m in [banked.fullmatch(t.name)])
        layouts.setdefault(key, [0, [int(t.n_bytes) // int(t.shape[-1]) for t in parts]])[0] += 1
    total = pad(4 * sum(int(tensors[f"blk.{il}.ffn_gate_inp.weight"].shape[1]) for il in layers))
    for count, per_expert in layouts.values():
        total += sum(pad((count * k + 1) * size) for size in per_expert)
    return total


def expected_k(path, layers, budget, alignment, n_expert):
    return max([k for k in range(1, n_expert + 1) if expected_bytes(path, layers, k, alignment) <= budget],
               default=0)


SCENARIO = """
    import json, logging, sys
    sys.path.insert(0, "tests")
    from moecache.live.rpc import RpcDevice
    devices = [RpcDevice(threads=1, memory_mib=m) for m in {memory}]
    from conftest import greedy, load
    from moecache.live import ggml
    from moecache.live.activate import attach
    from moecache.live.config import ConfigError
    from moecache.live.probe import CacheUnavailable

    rpc = [d for d in ggml.devices() if ggml.device_name(d).startswith("RPC")]
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)

    def free():
        return {{ggml.buffer_type_name(ggml.device_buffer_type(d)): ggml.device_memory(d)[0] for d in rpc}}

    results = []
    for settings in {runs}:
        llm = load({path!r}, **{load!r})
        row = {{"settings": settings, "free_before": free(),
               "alignment": ggml.buffer_type_alignment(ggml.device_buffer_type(rpc[0]))}}
        try:
            cache = attach(llm, **settings)
        except (ConfigError, CacheUnavailable) as e:
            row["error"] = type(e).__name__ + ": " + str(e)
        else:
            row.update(slots=cache.slots, device_bytes=cache.device_bytes, plan=cache.stats()["plan"],
                       layers=[l.il for l in cache.layers], free_after=free())
            if {exact}:
                tokens, logits = greedy(llm, b"The three primary colors are", 24)
                cache.detach()
                from moecache.live import native
                native.init(cache.ctx, 0)
                stock = greedy(llm, b"The three primary colors are", 24)
                row["exact"] = tokens == stock[0] and bool((logits == stock[1]).all())
            else:
                cache.detach()
        llm.close()
        results.append(row)
    print("RESULT=" + json.dumps(results))
"""


def run_scenario(path, memory, runs, *, exact=False, env=None, load=None):
    code = textwrap.dedent(SCENARIO.format(memory=memory, runs=runs, path=path, exact=exact, load=load or {}))
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_MOE_CACHE_")}
    full_env.update(env or {})
    run = subprocess.run([sys.executable, "-c", code], env=full_env, cwd=REPO, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    line = next(line for line in run.stdout.splitlines() if line.startswith("RESULT="))
    return json.loads(line[len("RESULT="):]), run.stderr


@pytest.fixture(scope="module")
def sized_model():
    pytest.importorskip("llama_cpp")
    from moecache.models import tiny_moe

    # q8_0 experts of 0.2 MiB: budgets of a few MiB give distinct K between 1 and 16
    return str(tiny_moe(n_layer=2, n_expert=16, n_embd=128, n_ff_exp=512, expert_type="q8_0"))


def test_mib_gives_the_k_the_arithmetic_predicts(sized_model):
    budgets = [1, 2, 3, 4, 6, 100]
    results, _ = run_scenario(sized_model, [64], [{"mib": n} for n in budgets] + [{"slots": 5}], exact=True)
    for n, row in zip(budgets, results):
        k = expected_k(sized_model, [0, 1], n * MIB, row["alignment"], 16)
        assert row["slots"] == k, (n, row)
        assert row["device_bytes"] == expected_bytes(sized_model, [0, 1], k, row["alignment"])
        plan = row["plan"]
        assert plan["sized_by"] == f"LLAMA_MOE_CACHE_MIB={n}" and plan["bytes"] == row["device_bytes"]
        (device,) = plan["devices"]
        assert device["bytes"] == row["device_bytes"] and device["budget"] == n * MIB
        assert device["experts_cached"] == pytest.approx(k / 16)
        (free_before,) = row["free_before"].values()
        assert device["free_after"] == free_before - row["device_bytes"]
        assert row["exact"], f"MIB={n}: not bit-identical to the stock graph"
    assert len({row.get("slots") for row in results}) == len(results), "budgets must give distinct K"
    fixed = results[-1]
    assert fixed["slots"] == 5 and fixed["plan"]["devices"][0]["budget"] is None
    assert fixed["device_bytes"] == expected_bytes(sized_model, [0, 1], 5, fixed["alignment"])


@pytest.mark.parametrize("arch", ["gpt-oss", "gemma4", "qwen3next"])  # biases; fused gate_up and scales
def test_mib_counts_every_banked_tensor(arch):
    """Biases and per-expert scales are banked with the weights: the plan's bytes, what libllama
    allocates and the arithmetic of the GGUF's per-expert tensors agree, and the cache is exact."""
    from moecache.models import tiny_moe

    path = str(tiny_moe(arch=arch, n_layer=2, n_expert=16, n_embd=64, n_ff_exp=256, expert_type="q8_0"))
    results, _ = run_scenario(path, [64], [{"mib": 1}, {"slots": 3}], exact=True)
    for row in results:
        assert "error" not in row, row
        assert row["device_bytes"] == expected_bytes(path, row["layers"], row["slots"], row["alignment"])
        assert row["plan"]["bytes"] == row["device_bytes"] and row["exact"]
    assert results[0]["slots"] == expected_k(path, results[0]["layers"], MIB, results[0]["alignment"], 16)


def test_below_one_slot_names_the_minimum():
    from moecache.models import tiny_moe

    path = str(tiny_moe(n_layer=2, n_expert=8, n_embd=128, n_ff_exp=512))  # f32: 0.75 MiB experts
    results, _ = run_scenario(path, [64], [{"mib": 1}])
    one_slot = expected_bytes(path, [0, 1], 1, results[0]["alignment"])
    minimum = -(-one_slot // MIB)
    assert results[0]["error"] == (f"ConfigError: LLAMA_MOE_CACHE_MIB=1 is below one slot per cached layer: "
                                   f"this model needs at least {minimum} MiB (2 cached layers)")


def test_auto_uses_the_free_memory_the_device_reports(sized_model):
    # a 24 MiB device: the weights, KV cache and compute buffers leave about 17 MiB
    runs = [{"mib": "auto", "reserve_mib": 13}, {"slots": "auto", "reserve_mib": 15}, {"mib": "auto", "reserve_mib": 24}]
    results, _ = run_scenario(sized_model, [24], runs)
    fitted = []
    for settings, row in zip(runs, results):
        (free_before,) = row["free_before"].values()
        budget = free_before - settings["reserve_mib"] * MIB
        k = expected_k(sized_model, [0, 1], budget, row["alignment"], 16)
        if k == 0:
            name = "SLOTS" if "slots" in settings else "MIB"
            assert row["error"].startswith(f"ConfigError: LLAMA_MOE_CACHE_{name}=auto: RPC0"), row
            assert f"keeping LLAMA_MOE_CACHE_RESERVE_MIB={settings['reserve_mib']} of it leaves" in row["error"]
            continue
        fitted.append(k)
        assert 1 <= k < 16, "the reserve must bind"
        assert row["slots"] == k and row["plan"]["reserve_bytes"] == settings["reserve_mib"] * MIB
        assert row["plan"]["devices"][0]["free_before"] == free_before
    assert len(set(fitted)) == 2, "two reserves must give two K"
    assert results[1]["plan"]["sized_by"] == "LLAMA_MOE_CACHE_SLOTS=auto"
    assert "error" in results[2]


def test_two_devices_get_budgets_in_proportion_to_their_free_memory():
    from moecache.models import tiny_moe

    path = str(tiny_moe(n_layer=6, n_expert=16, n_embd=128, n_ff_exp=512, expert_type="q8_0"))
    results, _ = run_scenario(path, [48, 24], [{"mib": 12}], exact=True)
    (row,) = results
    plan = row["plan"]
    assert len(plan["devices"]) == 2 and plan["split"] == "free memory"
    free = [d["free_before"] for d in plan["devices"]]
    budgets = [d["budget"] for d in plan["devices"]]
    assert free[0] != free[1]
    assert sum(budgets) == pytest.approx(12 * MIB, abs=2)
    assert budgets[0] / budgets[1] == pytest.approx(free[0] / free[1], rel=1e-6)
    for d in plan["devices"]:  # each share's own largest K, by the arithmetic
        assert d["slots"] == expected_k(path, d["layers"], d["budget"], row["alignment"], 16)
    assert row["slots"] == min(d["slots"] for d in plan["devices"]) >= 1
    assert row["device_bytes"] == sum(expected_bytes(path, d["layers"], row["slots"], row["alignment"])
                                      for d in plan["devices"])
    assert row["exact"]


def test_a_tensor_split_shares_the_budget_as_it_shares_the_layers():
    from moecache.models import tiny_moe

    path = str(tiny_moe(n_layer=6, n_expert=16, n_embd=128, n_ff_exp=512, expert_type="q8_0"))
    results, _ = run_scenario(path, [48, 48], [{"mib": 8}], load={"tensor_split": [1.0, 3.0]})
    plan = results[0]["plan"]
    assert plan["split"] == "tensor split"
    low, high = sorted(plan["devices"], key=lambda d: len(d["layers"]))
    assert len(low["layers"]) < len(high["layers"])  # llama.cpp split the layers 1:3 too
    assert high["budget"] == pytest.approx(3 * low["budget"], abs=3)
    assert results[0]["slots"] == min(low["slots"], high["slots"]) >= 1


def test_unreadable_free_memory_splits_evenly_and_auto_is_refused():
    from moecache.models import tiny_moe

    path = str(tiny_moe(n_layer=6, n_expert=16, n_embd=128, n_ff_exp=512, expert_type="q8_0"))
    results, stderr = run_scenario(path, [0, 0], [{"mib": 4}, {"mib": "auto"}])
    even, auto = results
    assert even["plan"]["split"].startswith("even")
    assert len({d["budget"] for d in even["plan"]["devices"]}) == 1
    assert [line for line in stderr.splitlines() if "splits evenly" in line] == \
        [f"moecache: {even['plan']['devices'][0]['device']} does not report its free memory: the budget splits evenly"]
    assert auto["error"].startswith("ConfigError: LLAMA_MOE_CACHE_MIB=auto: RPC")
    assert auto["error"].endswith("does not report its free memory; set LLAMA_MOE_CACHE_MIB=N")


def test_a_failed_allocation_retries_once_at_the_largest_k_that_fits(sized_model):
    # a 12 MiB device has about 5 MiB free: 16 slots per layer (7.1 MiB) do not fit
    results, stderr = run_scenario(sized_model, [12], [{"mib": 100, "reserve_mib": 1}, {"mib": 100}])
    retried, refused = results
    (free_before,) = retried["free_before"].values()
    k = expected_k(sized_model, [0, 1], free_before - MIB, retried["alignment"], 15)
    assert retried["plan"]["retried_from"] == 16 and retried["slots"] == k >= 1
    assert any("allocating 16 slots per layer failed; retrying at %d" % k in line for line in stderr.splitlines())
    assert refused["error"] == ("CacheUnavailable: LLAMA_MOE_CACHE_MIB=100: allocating 16 slots per layer failed "
                                "and not one slot per layer fits the free memory less LLAMA_MOE_CACHE_RESERVE_MIB=1024")


@pytest.mark.parametrize("env", [{"LLAMA_MOE_CACHE_SLOTS": "auto", "LLAMA_MOE_CACHE_RESERVE_MIB": "8"},
                                 {"LLAMA_MOE_CACHE_MIB": "3"}])
def test_zero_code_sizing(tmp_path, sized_model, env):
    stats = tmp_path / "stats.json"
    code = textwrap.dedent("""
        from moecache.live.rpc import RpcDevice
        device = RpcDevice(threads=1, memory_mib=16)
        from llama_cpp import Llama
        llm = Llama(model_path=%r, n_gpu_layers=-1, n_ctx=256, verbose=False)
        print(llm.create_completion("The three primary colors are", max_tokens=8, temperature=0.0)["choices"][0]["text"])
    """ % sized_model)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_MOE_CACHE_")}
    full_env.update({**env, "LLAMA_MOE_CACHE_STATS": str(stats), "LLAMA_MOE_CACHE_DEBUG": "1000"})
    run = subprocess.run([sys.executable, "-c", code], env=full_env, cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    report = json.loads(stats.read_text())
    name, value = next((k, v) for k, v in env.items() if k != "LLAMA_MOE_CACHE_RESERVE_MIB")
    assert report["plan"]["sized_by"] == f"{name}={value}" and report["slots"] >= 1
    assert report["decode_steps"] > 0
    plan_lines = [line for line in run.stderr.splitlines() if line.startswith("moecache: plan for")]
    assert len(plan_lines) == 1 and f"x {report['slots']} slots" in plan_lines[0]


def test_a_budget_without_the_model_file_is_one_line_and_releases_the_trial(rpc_device, tiny_path):
    from conftest import load

    from moecache.live import native
    from moecache.live.activate import attach

    llm = load(tiny_path)
    with pytest.raises(ConfigError) as err:
        attach(llm.ctx, mib=4)  # a bare context: no Llama to say which file it came from
    assert str(err.value) == ("LLAMA_MOE_CACHE_MIB=4: sizing by memory needs the model's GGUF file: "
                              "attach a llama_cpp.Llama")
    assert native.lib().llama_moe_cache_n_layers(native.as_context(llm.ctx), native.DEVICE) == 0


@pytest.mark.parametrize("settings,trial", [({"slots": 3}, []), ({"mib": "auto", "reserve_mib": 0}, [1, 0])])
def test_the_planned_k_is_allocated_once(rpc_device, tiny_path, monkeypatch, settings, trial):
    """SLOTS=K allocates K; a budget's probe allocates one slot per layer to learn the layers and
    releases it before planning, then the planned K is allocated."""
    from conftest import load

    from moecache.live import native
    from moecache.live.activate import attach

    llm = load(tiny_path)
    init, calls = native.init, []
    monkeypatch.setattr(native, "init", lambda ctx, slots, **kw: calls.append(slots) or init(ctx, slots, **kw))
    cache = attach(llm, **settings)
    try:
        assert calls == trial + [cache.slots] and cache.slots == settings.get("slots", 8)
        assert cache.stats()["plan"]["slots"] == cache.slots
    finally:
        cache.detach()
        init(cache.ctx, 0)


def test_attach_takes_a_config_or_keywords_not_both():
    from moecache.live.activate import attach

    with pytest.raises(TypeError, match="a config or settings as keywords, not both"):
        attach(object(), config=CacheConfig(slots=2), slots=3)


# --- run.py -------------------------------------------------------------------------------------

@pytest.mark.parametrize("args,env,message", [
    (["--slots", "2", "--cache-mib", "8"], {}, "--slots and --cache-mib both size the cache: give one"),
    (["--cache-mib", "lots"], {}, "argument --cache-mib: 'lots' is neither a number of MiB nor auto"),
    (["--cache-mib", "-1"], {}, "argument --cache-mib: -1 must be >= 0"),
    ([], {"LLAMA_MOE_CACHE_MIB": "8", "LLAMA_MOE_CACHE_SLOTS": "2"},
     "LLAMA_MOE_CACHE_SLOTS=2 and LLAMA_MOE_CACHE_MIB=8 both size the cache: set one"),
])
def test_run_py_sizing_flags_are_one_line(args, env, message):
    from test_cli import run_py

    out = run_py(*args, env=env)
    assert out.returncode == 2 and out.stderr == f"run.py: error: {message}\n"


def test_run_py_cache_mib_prints_the_plan(sized_model):
    from test_cli import run_py

    out = run_py("-m", sized_model, "--cache-mib", "3", "-n", "4", "--no-chat", "-p", "hello",
                 env={"LLAMA_MOE_CACHE_SLOTS": "2"})  # the flag's size replaces the variable's
    assert out.returncode == 0, out.stderr
    plan = [line for line in out.stderr.splitlines() if line.startswith("moecache: plan for")]
    assert plan == [line for line in plan if "LLAMA_MOE_CACHE_MIB=3: 2 layers x 7 slots" in line] != []


def test_bench_decode_sweeps_by_memory(tmp_path, sized_model):
    js = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_decode.py"), "-m", sized_model,
                          "-n", "4", "-r", "1", "-c", "256", "--slots", "0", "--mib", "3,1", "--json", str(js)],
                         capture_output=True, text=True, timeout=300, cwd=REPO,
                         env={k: v for k, v in os.environ.items() if not k.startswith("LLAMA_MOE_CACHE_")})
    assert run.returncode == 0, run.stderr
    rows = {r["config"]: r for r in json.loads(js.read_text())["rows"]}
    assert list(rows) == ["stock", "MiB=3", "MiB=1"]
    assert (rows["MiB=3"]["slots"], rows["MiB=1"]["slots"]) == (7, 2)  # as the arithmetic test above
    assert rows["MiB=3"]["device_bytes"] <= 3 * MIB and rows["MiB=3"]["hit_rate"] is not None
    assert "| MiB=3 (K=7) |" in run.stdout
