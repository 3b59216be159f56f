"""run.py and the placement helper reject bad input with one line."""

from __future__ import annotations

import os
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
    ([], {"LLAMA_MOE_CACHE_INSERTS": "0"}, "LLAMA_MOE_CACHE_INSERTS=0 must be >= 1"),
    (["--policy", "lur"], {}, "LLAMA_MOE_CACHE_POLICY='lur' is not a policy"),
])
def test_run_py_bad_input_is_one_line(args, env, message):
    out = run_py(*args, env=env)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("run.py: error: ") and message in lines[0], out.stderr


def test_placement_rejects_bad_arguments():
    pytest.importorskip("llama_cpp")
    from moecache.placement import expert_overrides, experts_on_host

    with pytest.raises(ValueError, match="repack must be True or False"):
        with experts_on_host(repack="yes"):
            pass
    with pytest.raises(ValueError, match="pattern must be a non-empty regex string"):
        expert_overrides("")
