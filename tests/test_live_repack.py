"""Host experts repacked as stock llama.cpp loads them: the cache reads its slots back from the
model file (one file or its splits), and stops when that file changes."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import PROMPT, REPO, greedy, load, moecache_log_lines, unreported

llama_cpp = pytest.importorskip("llama_cpp")

from moecache.live.activate import attach  # noqa: E402


@pytest.fixture(scope="module")
def q4_synth():
    """A synthetic Q4_0 MoE (4 layers, 16 experts, top-4) whose greedy decoding walks a fixed
    cycle with wide margins; its experts are what llama.cpp repacks on x86 (q4_0_8x8)."""
    from moecache.models import synth

    return str(synth.synth_moe("qwen3-30b-a3b", n_layer=4, n_expert=16, n_expert_used=4, n_embd=256,
                               n_ff_exp=128, n_head=4, n_head_kv=2, head_dim=64, n_ff=512, threads=1))


# Cached experts run the device's plain Q4_0 kernels, the others the host's repacked ones: the
# logits differ from stock repacked by float rounding only. Measured over 256 greedy tokens of
# q4_synth with K=4 of 16 (test_repacked_host_experts_stay_repacked prints it): 1.1e-4. The bound
# leaves ~100x of margin and stays far below the model's smallest top-2 logit gap.
REPACK_LOGIT_TOLERANCE = 1e-2


def test_repacked_host_experts_stay_repacked(capfd, rpc_device, q4_synth):
    """With the cache on, host experts are repacked as stock --cpu-moe loads them; the skip
    table and observer work in the repacked mul_mat_id (every lookup counted, cached rows
    zero), slots are read from the model file, and greedy decoding matches stock."""
    stock = greedy(load(q4_synth, repack=True), PROMPT, 256)
    capfd.readouterr()
    llm = load(q4_synth, repack=True, verbose=True)
    assert "CPU_REPACK model buffer size" in capfd.readouterr().err  # llama.cpp's load log
    cache = attach(llm, slots=4, inserts=2, policy="lru", wait=1)
    assert all(layer.from_file for layer in cache.layers)
    tokens, logits = greedy(llm, PROMPT, 256)

    diff = float(np.abs(logits - stock[1]).max())
    print(f"repacked: max |logit difference| over 256 tokens {diff:.3g}")
    assert tokens == stock[0]
    assert diff <= REPACK_LOGIT_TOLERANCE
    stats = cache.stats()
    assert stats["totals"]["hits"] > 0 and stats["totals"]["evictions"] > 0
    lookups = stats["totals"]["hits"] + stats["totals"]["misses"]
    native_counters = cache.native_counters()
    n_layers, k = len(cache.layers), cache.n_used
    assert sum(c["hits"] + c["misses"] for c in native_counters) == lookups + n_layers * k
    assert sum(c["uploads"] for c in native_counters) == \
        stats["totals"]["uploads"] + stats["totals"]["prefill_uploads"] + unreported(cache)


def _append_zeros(path):
    with open(path, "ab") as f:
        f.write(b"\0" * 64)


def _rewrite_in_place_as_it_was_stamped(path):
    """New bytes in the same file, its size and modification time set back (as a copy tool
    preserving times would): only the status change time, which no one can set, tells."""
    before = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(before.st_size // 2)
        f.write(bytes(64))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(path).st_size == before.st_size and os.stat(path).st_mtime_ns == before.st_mtime_ns


@pytest.mark.parametrize("change", [_append_zeros, _rewrite_in_place_as_it_was_stamped])
def test_a_model_file_changed_after_load_stops_uploads_and_decoding_stays_stock(
        tmp_path, caplog, rpc_device, q4_synth, change):
    import shutil

    path = tmp_path / "model.gguf"
    shutil.copyfile(q4_synth, path)
    stock = greedy(load(str(path), repack=True), PROMPT, 24)
    llm = load(str(path), repack=True)
    cache = attach(llm, slots=4, inserts=2, policy="lru")
    change(path)  # the file is not what was loaded any more
    with moecache_log_lines(caplog) as lines:
        tokens, logits = greedy(llm, PROMPT, 24)
    assert tokens == stock[0] and np.array_equal(logits, stock[1])  # no slot was ever used
    assert "model file changed" in cache.failed
    assert len(lines) == 1 and "model file changed" in lines[0], lines
    assert sum(c["uploads"] for c in cache.native_counters()) == 0


def test_a_relative_model_path_keeps_working_after_a_chdir(tmp_path, monkeypatch, rpc_device, q4_synth):
    monkeypatch.chdir(os.path.dirname(q4_synth))
    llm = load(os.path.basename(q4_synth), repack=True)
    cache = attach(llm, slots=4, inserts=2, policy="lru", wait=1)
    monkeypatch.chdir(tmp_path)
    greedy(llm, PROMPT, 16)
    assert cache.failed is None and sum(c["uploads"] for c in cache.native_counters()) > 0


def test_repacked_experts_of_a_split_model_are_read_from_their_split(tmp_path, rpc_device, q4_synth):
    """A model in several GGUF files: each expert tensor's bytes come from the split that
    holds it (llama_model::paths, in order)."""
    import gguf
    from gguf.scripts.gguf_new_metadata import copy_with_new_metadata

    reader = gguf.GGUFReader(q4_synth)
    writer = gguf.GGUFWriter(tmp_path / "split.gguf", reader.fields["general.architecture"].contents(),
                             split_max_tensors=len(reader.tensors) // 3 + 1)
    copy_with_new_metadata(reader, writer, {}, [])
    splits = sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert len(splits) == 3
    stock = greedy(load(q4_synth, repack=True), PROMPT, 64)
    llm = load(str(splits[0]), repack=True)
    cache = attach(llm, slots=4, inserts=2, policy="lru", wait=1)
    assert all(layer.from_file for layer in cache.layers)
    tokens, logits = greedy(llm, PROMPT, 64)
    assert tokens == stock[0] and float(np.abs(logits - stock[1]).max()) <= REPACK_LOGIT_TOLERANCE
    assert cache.failed is None and cache.stats()["totals"]["hits"] > 0
    totals = cache.stats()["totals"]
    assert sum(c["uploads"] for c in cache.native_counters()) == \
        totals["uploads"] + totals["prefill_uploads"] + unreported(cache) > 0


def test_a_repacked_model_without_a_file_source_loads_plain(monkeypatch, caplog):
    """Repacked experts need the model file to fill the slots: a path that is not a readable
    file gets plain buffers instead, with one logged line."""
    import llama_cpp.llama_cpp as lib

    from moecache.live import placement

    seen = []
    monkeypatch.setattr(lib, "llama_model_load_from_file", lambda path, params: seen.append(params.use_extra_bufts))

    with moecache_log_lines(caplog) as lines, placement.experts_on_host(repack=True):
        lib.llama_model_load_from_file(b"/nonexistent/model.gguf", lib.llama_model_default_params())
        lib.llama_model_load_from_file(REPO.encode() + b"/README.md", lib.llama_model_default_params())
    assert seen == [False, True]
    assert lines == [
        "moecache: /nonexistent/model.gguf is not a readable file to read repacked experts back "
        "from: experts kept in plain buffers"]
