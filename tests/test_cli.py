"""run.py and the placement helper reject bad input with one line."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_py(*args, env=None):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_MOE_CACHE_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, os.path.join(REPO, "run.py"), *args], env=full_env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args,env,message", [
    (["--bogus"], {}, "unrecognized arguments: --bogus"),
    (["-n", "abc"], {}, "argument -n/--n-predict: 'abc' is not an integer"),
    (["-n", "0"], {}, "argument -n/--n-predict: 0 must be >= 1"),
    (["--slots", "-2"], {}, "argument --slots: -2 must be >= 0"),
    (["-t", "１"], {}, "argument -t/--threads: '１' is not an integer"),
    ([], {"LLAMA_MOE_CACHE_SLOTS": "2 "}, "LLAMA_MOE_CACHE_SLOTS='2 ' is not an integer"),
    (["-m", "/nonexistent/model.gguf"], {}, "model file not found: /nonexistent/model.gguf"),
    ([], {"LLAMA_MOE_CACHE_INSERTS": "0"}, "LLAMA_MOE_CACHE_INSERTS=0 must be in [1, 2147483647]"),
    (["--policy", "lur"], {}, "LLAMA_MOE_CACHE_POLICY='lur' is not a policy"),
    (["-p", "", "--no-chat"], {}, "argument -p/--prompt: empty"),
    (["-t", "100000"], {}, "argument -t/--threads: 100000 must be in [1, 512]"),
    ([], {"LLAMA_MOE_CACHE_SLOTS": "1_0"}, "LLAMA_MOE_CACHE_SLOTS='1_0' is not an integer"),
    ([], {"LLAMA_MOE_CACHE_FLUSH_STEPS": "\uff18"}, "LLAMA_MOE_CACHE_FLUSH_STEPS='\uff18' is not an integer"),
])
def test_run_py_bad_input_is_one_line(args, env, message):
    out = run_py(*args, env=env)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("run.py: error: ") and message in lines[0], out.stderr


def test_placement_rejects_bad_arguments():
    pytest.importorskip("llama_cpp")
    from moecache.live.placement import expert_overrides, experts_on_host

    with pytest.raises(ValueError, match="repack must be True or False"):
        with experts_on_host(repack="yes"):
            pass
    with pytest.raises(ValueError, match="pattern must be a non-empty regex string"):
        expert_overrides("")


def _text(out) -> str:
    """The generated text: stdout without the trailing newline run.py adds."""
    return out.stdout[:-1]


def test_run_py_context_smaller_than_the_prompt(tiny_path):
    pytest.importorskip("llama_cpp")
    small = run_py("-m", tiny_path, "-c", "8", "-n", "4")  # llama.cpp pads the context to 256
    assert small.returncode == 0, small.stderr
    long_prompt = run_py("-m", tiny_path, "-c", "8", "-n", "4", "--no-chat", "-p", "red " * 300)
    assert long_prompt.returncode == 2
    lines = long_prompt.stderr.strip().splitlines()
    assert lines[-1].startswith("run.py: error: argument -c/--ctx-size: 8 is too small for the prompt"), lines
    assert not any("Traceback" in line or "broadcast" in line for line in lines), lines


def test_run_py_without_a_device_warns_once_and_runs_stock(tiny_path):
    pytest.importorskip("llama_cpp")
    cached = run_py("-m", tiny_path, "-n", "8", "-ngl", "0", "--no-chat", "-p", "The three primary colors are")
    assert cached.returncode == 0, cached.stderr
    warnings = [line for line in cached.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "router on a device" in warnings[0], cached.stderr
    assert "decoding runs the stock graph" in warnings[0]
    stock = run_py("-m", tiny_path, "-n", "8", "-ngl", "0", "--no-chat", "-p", "The three primary colors are",
                   "--slots", "0")
    assert stock.returncode == 0 and _text(cached) == _text(stock) and _text(stock)
    # the decode speed counts llama.cpp's token evaluations, not the streamed text pieces
    decoded = re.search(r"^run\.py: (\d+) tokens decoded, decode (\d+\.\d) tok/s$", stock.stderr, re.MULTILINE)
    assert decoded and 0 < int(decoded[1]) < 8 and float(decoded[2]) > 0, stock.stderr


SCRIPTS = sorted(name for name in os.listdir(os.path.join(REPO, "scripts")) if name.endswith(".py"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_answers_help_and_refuses_an_unknown_flag_in_one_line(script):
    path = os.path.join(REPO, "scripts", script)
    helped = subprocess.run([sys.executable, path, "--help"], capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and helped.stdout.startswith(f"usage: {script}"), helped.stderr
    refused = subprocess.run([sys.executable, path, "--no-such-flag"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2
    (line,) = refused.stderr.splitlines()  # the flag, or first a required argument it lacks
    assert line.startswith(f"{script}: error: ") and ("--no-such-flag" in line or "required" in line)


def test_a_script_given_a_missing_trace_says_so_in_one_line():
    out = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "compare_upstream.py"), "/nonexistent.csv"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.splitlines() == ["compare_upstream.py: error: /nonexistent.csv: No such file or directory"]
