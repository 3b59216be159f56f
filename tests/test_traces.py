import hashlib
import os
import re
import tracemalloc
from dataclasses import replace

import numpy as np
import pytest
from conftest import TRACES  # noqa: E402

from moecache.formats import csv_trace
import moecache.util as util
from moecache.formats.binary_trace import write_binary_trace
from moecache.formats.trace_writer import TraceWriter
from moecache.formats.traces import (DECODE, MAX_READ, PREFILL, READS, SHIPPED_TRACES, TRACES_DIR, TraceError,
                                     read_trace, synthetic_routing)

QWEN = TRACES / "qwen3-30b-a3b.route.csv"
GPTOSS = TRACES / "gpt-oss-120b.route.csv"

SMALL = """# route_trace v1
# model=m.gguf arch=qwen3moe n_layer=3 n_expert=8 n_expert_used=2
# layer=1 expert_bytes=1000 dense_bytes=10
# layer=2 expert_bytes=2000 dense_bytes=10
turn,phase,step,layer,slot,expert,weight,residency,expert_bytes
0,0,0,1,0,3,0.6,0,1000
0,0,0,1,1,4,0.4,0,1000
0,1,1,1,0,3,0.7,1,0
0,1,1,1,1,5,0.3,0,1000
0,1,1,2,0,0,0.5,0,2000
0,1,1,2,1,7,0.5,0,2000
"""


def with_reads(text):
    """SMALL with the RAM tier's reads: row r's READS columns all r (summed per step and layer)."""
    lines = text.splitlines()
    lines[4] += "," + ",".join(READS)
    lines[5:] = [f"{row}{f',{r}' * len(READS)}" for r, row in enumerate(lines[5:])]
    return "\n".join(lines) + "\n"


def write(tmp_path, text, name="t.csv"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.fixture(params=[None, 40], ids=["one-block", "blocks-of-a-line-or-two"])
def blocks(request, monkeypatch):
    """The reader parses the text a block at a time: read in one block, and in blocks of a line
    or two, so that every check meets rows of several blocks."""
    if request.param:
        monkeypatch.setattr(csv_trace, "BLOCK_CHARS", request.param)


def test_real_traces_load_with_the_documented_shapes():
    qwen = read_trace(str(QWEN))
    assert qwen.ids.shape == (156, 48, 6)
    assert (qwen.phase == PREFILL).sum() == 28 and (qwen.phase == DECODE).sum() == 128
    gpt = read_trace(str(GPTOSS))
    assert gpt.ids.shape == (149, 36, 2)
    assert (gpt.phase == DECODE).sum() == 64
    # the recorded residency reproduces the README's decode hit shares
    for trace, share in ((qwen, 80.29), (gpt, 44.84)):
        decode = trace.residency[trace.phase == DECODE]
        assert 100 * (decode > 0).mean() == pytest.approx(share, abs=0.01)
    # sizes come from the preamble; the column's zeros are hits/repeats, not sizes
    assert set(qwen.expert_bytes.tolist()) == {3059712, 2654208}
    assert (qwen.ids[qwen.phase == DECODE] >= 0).all()


def test_last_layer_absent_from_early_prefill_tokens_reads_minus_one():
    qwen = read_trace(str(QWEN))
    prefill = qwen.ids[qwen.phase == PREFILL]
    assert (prefill[:-1, -1] == -1).all()   # llama.cpp runs the last layer for the last token only
    assert (prefill[-1, -1] >= 0).all()


def test_small_trace_columns_by_name(tmp_path):
    lines = SMALL.splitlines()
    # reorder columns: read by name, not position
    header = lines[4].split(",")
    order = [header.index(c) for c in reversed(header)]
    body = [",".join(line.split(",")[i] for i in order) for line in lines[4:]]
    trace = read_trace(write(tmp_path, "\n".join(lines[:4] + body) + "\n"))
    assert trace.layers.tolist() == [1, 2]
    assert trace.expert_bytes.tolist() == [1000, 2000]
    assert trace.ids[1].tolist() == [[3, 5], [0, 7]]
    assert trace.ids[0].tolist() == [[3, 4], [-1, -1]]  # layer 2 absent from that prefill token
    assert trace.weights[1, 0, 0] == pytest.approx(0.7)
    assert trace.phase.tolist() == [PREFILL, DECODE]


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.replace("# layer=2 expert_bytes=2000 dense_bytes=10\n", ""),
     "t.csv:9: layer=2 has no expert_bytes in the preamble"),
    (lambda s: s.replace("slot,expert,", "slot,exprt,"), "t.csv:5: header lacks column(s) expert"),
    (lambda s: s.replace("0,1,1,1,1,5,0.3,0,1000", "0,1,1,1,1,five,0.3,0,1000"),
     "t.csv:9: expert='five' is not an integer"),
    (lambda s: s.replace("0,1,1,2,1,7,0.5,0,2000", "0,1,1,2,1,8,0.5,0,2000"),
     "t.csv:11: expert=8 out of range [0, 8)"),
    (lambda s: s.replace("0,1,1,2,1,7,0.5,0,2000", "0,1,1,2,2,7,0.5,0,2000"),
     "t.csv:11: slot=2 out of range [0, 2)"),
    (lambda s: s.replace("0,1,1,1,1,5,0.3,0,1000", "0,1,1,1,1,5,0.3,0"),
     "t.csv:9: expected 9 fields, got 8"),
    (lambda s: s.replace("0,1,1,1,1,5,0.3,0,1000", "0,1,1,1,1,5,heavy,0,1000"),
     "t.csv:9: weight='heavy' is not a number"),
    (lambda s: s.replace("0,1,1,1,1,5,0.3,0,1000", "0,1,1,1,1,5,1e39,0,1000"),
     "t.csv:9: weight=1e39 is out of the float32 range"),
    (lambda s: s.replace("0,1,1,1,1,5,0.3,0,1000", "0,1,1,1,0,5,0.3,0,1000"),
     "t.csv:9: duplicate row for turn 0 step 1 layer 1 slot 0"),
    (lambda s: s.replace("0,1,1,2,1,7,0.5,0,2000\n", ""), "lacks rows for layer 2"),
    (lambda s: s.replace("# route_trace v1", "# route_trace v2"), "t.csv:1: "),
    (lambda s: s.replace(" n_expert=8", " n_expert=eight"), "t.csv:2: n_expert='eight' is not an integer"),
    (lambda s: s.replace("expert_bytes=1000", "expert_bytes=0"), "t.csv:3: expert_bytes=0 must be in [1, 1099511627776]"),
    # absurd sizes and values: bounded, never a MemoryError or an OverflowError
    (lambda s: s.replace(" n_expert=8", " n_expert=4000000000"), "t.csv:2: n_expert=4000000000 must be in [1, 65536]"),
    (lambda s: s.replace("n_layer=3", "n_layer=2000000000"), "t.csv:2: n_layer=2000000000 must be in [1, 4096]"),
    (lambda s: s.replace("n_expert_used=2", "n_expert_used=3000000000"),
     "t.csv:2: n_expert_used=3000000000 must be in [1, 8] (n_expert=8)"),
    (lambda s: s.replace("expert_bytes=1000", f"expert_bytes={2**70}"),
     f"t.csv:3: expert_bytes={2**70} must be in [1, {2**40}]"),
    (lambda s: s.replace("0,1,1,2,1,7,0.5,0,2000", f"{2**63},1,1,2,1,7,0.5,0,2000"),
     f"t.csv:11: turn={2**63} is out of range"),
    (lambda s: s.replace("0,1,1,2,1,7,0.5,0,2000", f"{2**40},1,1,2,1,7,0.5,0,2000"),
     f"t.csv:11: turn={2**40} must be <= {2**31 - 1}"),
    (lambda s: s.replace("0,1,1,2,1,7,0.5,0,2000", f"0,1,{2**62},2,1,7,0.5,0,2000"),
     f"t.csv:11: step={2**62} must be <= {2**31 - 1}"),
    (lambda s: s.replace("0,1,1,2,1,7,0.5,0,2000", f"0,1,1,2,1,7,0.5,0,{2**70}"),
     f"t.csv:11: expert_bytes={2**70} is out of range"),
    (lambda s: s.replace("0,1,1,2,1,7,0.5,0,2000", "0,1,1,2,1,7,0.5,0,-5"), "t.csv:11: negative expert_bytes"),
    # a field csv refuses, and a preamble line too long to read whole (issue 24, found 9)
    (lambda s: s.replace("0,1,1,2,1,7,0.5,0,2000", "0,1,1,2,1,7,0.5,0," + "9" * 140_000),
     "t.csv:11: field larger than field limit"),
    (lambda s: s.replace("# layer=2 ", "# layer=2 " + "x" * 70_000 + "=1 "), "t.csv:4: line longer than 65536 characters"),
    (lambda s: s.replace("0,1,1,1,1,5,0.3,0,1000", "0,1,1,1,1,5,0.3,0,1000\n\n"), "t.csv:10: expected 9 fields, got 0"),
])
def test_malformed_traces_fail_with_file_and_line(tmp_path, blocks, edit, message):
    path = write(tmp_path, edit(SMALL))
    with pytest.raises(TraceError) as info:
        read_trace(path)
    assert message in str(info.value)
    assert str(info.value).startswith(path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("batch", [2**31, 2**63 - 1, -1])
def test_a_batch_number_out_of_range_names_its_line(tmp_path, blocks, batch):
    lines = SMALL.splitlines()
    lines[4] += ",batch"
    lines[5:] = [f"{row},{batch if i >= 2 else 0}" for i, row in enumerate(lines[5:])]
    with pytest.raises(TraceError, match=rf"t.csv:8: batch={batch} must be in \[0, {2**31 - 1}\]"):
        read_trace(write(tmp_path, "\n".join(lines) + "\n"))


def test_missing_file_is_a_trace_error(tmp_path):
    with pytest.raises(TraceError, match="No such file"):
        read_trace(str(tmp_path / "absent.csv"))


def test_writer_round_trip_and_crash_leaves_readable_prefix(tmp_path):
    path = str(tmp_path / "live.csv")
    ids = synthetic_routing(5, 3, 16, 2, seed=7)
    writer = TraceWriter(path, model="tiny.gguf", arch="qwen3moe", n_layer=4, n_expert=16,
                         n_expert_used=2, layers=[(1, 100, 5), (2, 100, 5), (3, 200, 5)])
    residency = np.zeros((3, 2), dtype=np.int8)
    writer.write_step(0, PREFILL, 0, np.concatenate([ids[0], ids[1]], axis=1), None,
                      np.zeros((3, 4), dtype=np.int8))  # a two-token prefill batch
    for t in range(2, 5):
        residency[:, 0] = 1
        writer.write_step(0, DECODE, t, ids[t], np.full((3, 2), 0.5), residency)
        # not closed yet, as after a crash: every step written so far reads back
        trace = read_trace(path)
        assert trace.ids.shape == (t + 1, 3, 2)
    writer.close()
    trace = read_trace(path)
    assert np.array_equal(trace.ids, ids)
    assert trace.layers.tolist() == [1, 2, 3] and trace.expert_bytes.tolist() == [100, 100, 200]
    assert trace.phase.tolist() == [PREFILL, PREFILL, DECODE, DECODE, DECODE]
    assert np.isnan(trace.weights[0]).all() and (trace.weights[2:] == 0.5).all()
    assert (trace.residency[2:, :, 0] == 1).all()
    with pytest.raises(ValueError, match="closed"):
        writer.write_step(0, DECODE, 9, ids[0], None, residency)


def test_writer_refuses_a_symlink_and_follows_the_umask(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    (tmp_path / "trace.csv").symlink_to(target)
    args = dict(model="m", arch="qwen3moe", n_layer=1, n_expert=4, n_expert_used=2, layers=[(0, 10, 1)])
    with pytest.raises(OSError, match="symbolic link"):
        TraceWriter(str(tmp_path / "trace.csv"), **args)
    assert target.read_text() == "keep me"
    old = os.umask(0o077)
    try:
        TraceWriter(str(tmp_path / "own.csv"), **args).close()
    finally:
        os.umask(old)
    assert (tmp_path / "own.csv").stat().st_mode & 0o777 == 0o600


def test_a_full_disk_leaves_whole_steps(tmp_path, monkeypatch):
    path = str(tmp_path / "t.csv")
    ids = synthetic_routing(3, 2, 8, 2, seed=3)
    writer = TraceWriter(path, model="m", arch="qwen3moe", n_layer=2, n_expert=8, n_expert_used=2,
                         layers=[(0, 10, 1), (1, 10, 1)])
    no_residency = np.zeros((2, 2), dtype=np.int8)
    writer.write_step(0, DECODE, 0, ids[0], None, no_residency)
    real_write = os.write

    def disk_fills(fd, data):  # half of this step's bytes fit, then the disk is full
        if len(data) > 8:
            return real_write(fd, data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", disk_fills)
    with pytest.raises(OSError, match="No space"):
        writer.write_step(0, DECODE, 1, ids[1], None, no_residency)
    monkeypatch.undo()
    trace = read_trace(path)  # reads back: the torn step was cut off
    assert np.array_equal(trace.ids, ids[:1])
    writer.write_step(0, DECODE, 2, ids[2], None, no_residency)  # space again: goes on whole
    writer.close()
    assert read_trace(path).ids.shape == (2, 2, 2)


def test_writer_rejects_bad_steps(tmp_path):
    writer = TraceWriter(str(tmp_path / "w.csv"), model="m", arch="a", n_layer=2, n_expert=4,
                         n_expert_used=2, layers=[(0, 10, 0), (1, 10, 0)])
    with pytest.raises(ValueError, match="shape"):
        writer.write_step(0, DECODE, 0, np.zeros((1, 2), int), None, np.zeros((1, 2), int))
    with pytest.raises(ValueError, match="out of range"):
        writer.write_step(0, DECODE, 0, np.full((2, 2), 4), None, np.zeros((2, 2), int))
    with pytest.raises(ValueError, match="all k experts or none"):
        writer.write_step(0, DECODE, 0, np.array([[1, -1], [0, 1]]), None, np.zeros((2, 2), int))
    writer.close()


def test_writer_skips_layers_that_did_not_run(tmp_path):
    path = str(tmp_path / "w.csv")
    with TraceWriter(path, model="m", arch="a", n_layer=2, n_expert=4, n_expert_used=2,
                     layers=[(0, 10, 0), (1, 10, 0)]) as writer:
        writer.write_step(0, PREFILL, 0, np.array([[1, 2, 3, 0], [-1, -1, 2, 3]]), None,
                          np.zeros((2, 4), int))
        writer.write_step(0, DECODE, 2, np.array([[1, 2], [2, 3]]), None, np.ones((2, 2), int))
    trace = read_trace(path)
    assert trace.ids[:, 1].tolist() == [[-1, -1], [2, 3], [2, 3]]


def test_synthetic_routing_has_distinct_experts_and_locality():
    ids = synthetic_routing(200, 4, 64, 4, seed=3)
    assert ids.shape == (200, 4, 4) and ids.dtype == np.int32
    assert all(len(set(row)) == 4 for step in ids for row in step.tolist())
    reuse = np.mean([len(set(a) & set(b)) for s0, s1 in zip(ids[:-1], ids[1:])
                     for a, b in zip(s0.tolist(), s1.tolist())]) / 4
    assert reuse > 2 * 4 / 64  # consecutive steps share far more than chance


def test_binary_or_directory_is_a_trace_error(tmp_path):
    binary = tmp_path / "b.csv"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(TraceError, match="not UTF-8 text"):
        read_trace(str(binary))
    with pytest.raises(TraceError, match="Is a directory"):
        read_trace(str(tmp_path))


def test_trailing_blank_lines_and_crlf_are_read(tmp_path, blocks):
    trace = read_trace(write(tmp_path, SMALL.replace("\n", "\r\n") + "\r\n  \n"))
    assert trace.ids[1].tolist() == [[3, 5], [0, 7]]


def test_a_grid_larger_than_memory_is_refused_before_allocating(tmp_path, blocks, monkeypatch):
    monkeypatch.setattr(util, "available_memory", lambda: (100, "MemAvailable"))
    with pytest.raises(TraceError) as info:
        read_trace(write(tmp_path, SMALL))
    assert str(info.value).endswith("t.csv: 2 steps x 2 layers x 2 ranks need 128 bytes, 100 bytes available "
                                    "(MemAvailable)")


# What the reader of 578d740 (the csv module, every row held) read from the shipped traces:
# digest() of each, recorded before the reader streamed.
READ_BEFORE = {QWEN: "21d5dd51b1f1a734", GPTOSS: "409f8e22b016a615"}


def digest(trace) -> str:
    """Every array of a trace (dtype, shape, values) and its model facts, in 16 hex digits."""
    h = hashlib.sha256()
    for name in ("turn", "step", "phase", "batch", "ids", "weights", "residency", "dropped", "layers",
                 "expert_bytes", "dense_bytes"):
        a = np.ascontiguousarray(getattr(trace, name))
        h.update(f"{name} {a.dtype.str} {a.shape}".encode() + a.tobytes())
    h.update(repr((trace.model, trace.arch, trace.n_layer, trace.n_expert, trace.n_expert_used)).encode())
    if trace.reads is not None:  # (the shipped traces predate them: their digests stay)
        h.update(np.ascontiguousarray(trace.reads).tobytes())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("path", [QWEN, GPTOSS], ids=["qwen", "gptoss"])
@pytest.mark.parametrize("block_chars", [None, 4096])
def test_the_shipped_traces_read_as_before_in_blocks_of_any_size(monkeypatch, path, block_chars):
    if block_chars:
        monkeypatch.setattr(csv_trace, "BLOCK_CHARS", block_chars)
    assert digest(read_trace(str(path))) == READ_BEFORE[path]


def test_rows_in_any_order_read_as_in_writing_order(tmp_path, monkeypatch):
    """Steps are ordered by (turn, step), not by where their rows are: the rows of the Qwen trace
    shuffled (every block then mixes steps) read as the file does."""
    lines = QWEN.read_text().splitlines(keepends=True)
    header = next(i for i, line in enumerate(lines) if not line.startswith("#"))
    rows = lines[header + 1:]
    shuffled = [rows[i] for i in np.random.default_rng(0).permutation(len(rows))]
    path = write(tmp_path, "".join(lines[:header + 1] + shuffled))
    monkeypatch.setattr(csv_trace, "BLOCK_CHARS", 1 << 16)
    assert digest(read_trace(path)) == READ_BEFORE[QWEN]
    with open(path, "a") as f:
        f.write(shuffled[0])
    with pytest.raises(TraceError, match=rf"t.csv:{header + 2 + len(rows)}: duplicate row for"):
        read_trace(path)


def test_reading_holds_the_arrays_not_the_text(tmp_path, monkeypatch):
    """Peak memory while reading is the trace's arrays (10 bytes a lookup, a quarter more while
    they grow) and one block's temporaries, whatever the text's length (the reader before
    held some 160 bytes a row)."""
    monkeypatch.setattr(csv_trace, "BLOCK_CHARS", 1 << 15)
    path = str(tmp_path / "long.csv")
    ids = synthetic_routing(200, 48, 128, 8, seed=1)
    with TraceWriter(path, model="m", arch="a", n_layer=48, n_expert=128, n_expert_used=8,
                     layers=[(layer, 3059712, 0) for layer in range(48)]) as writer:
        for step, routing in enumerate(ids):
            writer.write_step(0, DECODE, step, routing, None, np.zeros((48, 8), int))
    tracemalloc.start()
    try:
        trace = read_trace(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    arrays = sum(getattr(trace, name).nbytes for name in ("ids", "weights", "residency", "dropped"))
    assert np.array_equal(trace.ids, ids) and arrays == 10 * ids.size
    assert os.path.getsize(path) > 30 * ids.size  # the text: 3 times the arrays
    assert peak < 1.25 * arrays + (1 << 20), (peak, arrays)


def test_from_routing_and_select():
    from moecache.formats.traces import RouteTrace

    routing = synthetic_routing(6, 2, 8, 2, seed=1)
    trace = RouteTrace.from_routing(routing, 8, expert_bytes=[10, 20])
    assert trace.decode_ids.tolist() == routing.tolist() and trace.expert_bytes.tolist() == [10, 20]
    assert trace.select(slice(2, 4)).ids.tolist() == routing[2:4].tolist()
    with pytest.raises(ValueError, match=r"in \[-1, 8\)"):
        RouteTrace.from_routing(routing + 8, 8)


def test_a_multi_token_step_reads_back_as_one_batch_and_replays_as_one_observation(tmp_path):
    """A live ubatch of several tokens is one write_step (one batch); its last layer may run
    fewer tokens (the outputs only). The per-layer replay observes the batch as one step."""
    from moecache.core.engine import CacheEngine
    from moecache.core.policies import make_policy
    from moecache.offline.replay import PerLayerReplay, simulate

    path = str(tmp_path / "batches.csv")
    single = np.array([[1, 2], [3, 0]])
    batch = np.array([[1, 2, 0, 3, 2, 1], [3, 0, -1, -1, -1, -1]])  # 3 tokens, layer 1 ran one
    with TraceWriter(path, model="m", arch="a", n_layer=2, n_expert=4, n_expert_used=2,
                     layers=[(0, 10, 0), (1, 10, 0)]) as writer:
        writer.write_step(0, DECODE, 0, single, None, np.zeros((2, 2), int))
        writer.write_step(0, DECODE, 1, batch, None, np.zeros((2, 6), int))
        writer.write_step(0, DECODE, 4, single, None, np.zeros((2, 2), int))
    trace = read_trace(path)
    assert trace.batch.tolist() == [0, 1, 1, 1, 2]
    assert trace.ids[2:4, 1].tolist() == [[-1, -1], [-1, -1]]

    engine = CacheEngine(2, 4, 2, make_policy("lru"), inserts=2)
    engine.step(None)
    for ids in (single, batch, single):
        engine.step(ids)
    replayed = simulate(trace, PerLayerReplay("lru", 2, inserts=2)).totals
    assert (replayed["hits"], replayed["misses"]) == (int(engine.counters["hits"].sum()),
                                                      int(engine.counters["misses"].sum()))
    assert replayed["hits"] + replayed["misses"] == 4 + 8 + 4


def test_a_decode_token_without_a_layer_needs_a_shared_batch(tmp_path):
    path = tmp_path / "hole.csv"
    with TraceWriter(str(path), model="m", arch="a", n_layer=2, n_expert=4, n_expert_used=2,
                     layers=[(0, 10, 0), (1, 10, 0)]) as writer:
        writer.write_step(0, DECODE, 0, np.array([[1, 2], [2, 3]]), None, np.zeros((2, 2), int))
        writer.write_step(0, DECODE, 1, np.array([[1, 2], [-1, -1]]), None, np.zeros((2, 2), int))
    with pytest.raises(TraceError, match="step 1 lacks rows for layer 1"):
        read_trace(str(path))


@pytest.mark.parametrize("name, recorded", [
    ("SmolLM2 135M Instruct", "SmolLM2_135M_Instruct"),
    (" Qwen3-30B-A3B\tInstruct 2507\n", "Qwen3-30B-A3B_Instruct_2507"),
    ("a=b,c # d", "a_b_c_d"),
    ("Модель 7B", "Модель_7B"),
    ("", "unknown"),
])
def test_writer_records_any_model_name_readably(tmp_path, name, recorded):
    """general.name of real models has spaces; the preamble splits words on whitespace."""
    path = str(tmp_path / "w.csv")
    with TraceWriter(path, model=name, arch=name, n_layer=1, n_expert=4, n_expert_used=2,
                     layers=[(0, 10, 0)]) as writer:
        writer.write_step(0, DECODE, 0, np.array([[1, 2]]), None, np.zeros((1, 2), int))
    trace = read_trace(path)
    assert (trace.model, trace.arch) == (recorded, recorded)
    assert trace.ids.tolist() == [[[1, 2]]]


# --- the compact binary form ----------------------------------------------------------------

@pytest.mark.parametrize("path", [QWEN, GPTOSS], ids=["qwen", "gptoss"])
def test_a_converted_trace_reads_back_as_its_csv_mapped(tmp_path, path):
    out = tmp_path / "t.bin"
    write_binary_trace(read_trace(str(path)), out)
    trace = read_trace(str(out))
    assert digest(trace) == READ_BEFORE[path] and trace.path == str(out)
    assert trace.pages is not None and not trace.ids.flags.writeable  # views of the file
    assert os.path.getsize(out) < os.path.getsize(path) / 2


def small_binary(tmp_path, text=SMALL):
    path = tmp_path / "t.bin"
    write_binary_trace(read_trace(write(tmp_path, text)), path)
    return path


@pytest.mark.parametrize("text", [SMALL, with_reads(SMALL)], ids=["routing", "with the RAM tier's reads"])
def test_a_damaged_binary_trace_is_an_error_naming_it_never_other_values(tmp_path, text):
    """Any byte flipped fails a check (CRC-32s of the header and of each array, sizes, ranges)
    or lies in the padding between arrays; a file cut anywhere, or grown, is refused."""
    path = small_binary(tmp_path, text)
    data, good = path.read_bytes(), digest(read_trace(str(path)))
    seen = set()

    def outcome():
        try:
            trace = read_trace(str(path))
        except TraceError as e:
            assert str(e).startswith(str(path)) and "\n" not in str(e)
            return "error"
        assert digest(trace) == good
        return "same"

    for i in range(len(data)):
        for bit in (0x01, 0x80):
            path.write_bytes(data[:i] + bytes([data[i] ^ bit]) + data[i + 1:])
            seen.add(outcome())
    assert seen == {"error", "same"}
    for size in range(len(data)):
        path.write_bytes(data[:size])
        assert outcome() == "error"
    path.write_bytes(data + b"\0")
    with pytest.raises(TraceError, match=f"t.bin: {len(data) + 1} bytes where its header describes {len(data)}"):
        read_trace(str(path))


def test_a_binary_trace_with_a_deeply_nested_header_is_one_error_naming_it(tmp_path):
    """A header of 200000 nested lists (its CRC-32 right) hit "maximum recursion depth exceeded"."""
    import zlib

    from moecache.formats.binary_trace import MAGIC

    header = b"[" * 200000 + b"]" * 200000
    path = tmp_path / "deep.bin"
    path.write_bytes(b"%s\n%s\n%08x\n" % (MAGIC, header, zlib.crc32(header)))
    with pytest.raises(TraceError, match=f"^{path}: the header is not a JSON object$"):
        read_trace(str(path))


@pytest.mark.parametrize("change, message", [
    (lambda t: {"ids": np.where(t.ids == 7, 8, t.ids)}, r"t.bin: ids holds values outside \[-1, 7\]"),
    (lambda t: {"phase": t.phase + 1}, r"t.bin: phase holds values outside \[0, 1\]"),
    (lambda t: {"residency": t.residency + 3}, r"t.bin: residency holds values outside \[0, 2\]"),
    (lambda t: {"step": t.step[::-1].copy()}, r"t.bin: steps out of \(turn, step\) order"),
    (lambda t: {"layers": t.layers[::-1].copy()}, "t.bin: header: layers must be ascending"),
    (lambda t: {"expert_bytes": 0 * t.expert_bytes}, r"t.bin: header: expert_bytes=0 must be in \[1, "),
    (lambda t: {"n_expert_used": 3}, "t.bin: .* bytes where its header describes"),
])
def test_a_binary_trace_of_values_no_trace_holds_is_refused(tmp_path, change, message):
    """Whole CRC-32s do not make a file a trace: what the replay relies on is checked too."""
    trace = read_trace(write(tmp_path, SMALL))
    write_binary_trace(replace(trace, **change(trace)), tmp_path / "t.bin")
    with pytest.raises(TraceError, match=message):
        read_trace(str(tmp_path / "t.bin"))


# --- the RAM tier's reads (optional columns) -------------------------------------------------

def test_the_ram_tiers_reads_land_on_each_layers_first_row_and_survive_conversion(tmp_path):
    """A batch's reads of a layer go on the layer's first row in the batch (a prompt's last layer
    ran its last token only); they read back per step and layer, and the binary form and a
    selection of steps keep them. Traces without the columns read as before, reads None."""
    path = str(tmp_path / "reads.csv")
    prompt_reads, decode_reads = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], [[11, 12, 13, 14, 15], [0, 0, 0, 0, 0]]
    with TraceWriter(path, model="m", arch="a", n_layer=3, n_expert=4, n_expert_used=2,
                     layers=[(0, 10, 0), (2, 10, 0)], reads=True) as writer:
        writer.write_step(0, PREFILL, 0, np.array([[1, 2, 3, 0], [-1, -1, 2, 3]]), None, np.zeros((2, 4), int),
                          prompt_reads)
        writer.write_step(0, DECODE, 2, np.array([[1, 2], [2, 3]]), None, np.ones((2, 2), int), decode_reads)
        with pytest.raises(ValueError, match=r"reads for layer\(s\) \[2\] with no rows"):
            writer.write_step(0, DECODE, 3, np.array([[1, 2], [-1, -1]]), None, np.ones((2, 2), int), prompt_reads)
    trace = read_trace(path)
    assert trace.reads.tolist() == [[prompt_reads[0], [0] * 5], [[0] * 5, prompt_reads[1]], decode_reads]
    out = tmp_path / "reads.bin"
    write_binary_trace(trace, out)
    assert digest(read_trace(str(out))) == digest(trace)
    assert trace.select([2]).reads.tolist() == [decode_reads]
    for shipped in (*SHIPPED_TRACES, TRACES_DIR / "synth-qwen3-30b-a3b-L8.ram-tier.route.csv"):
        assert read_trace(str(shipped)).reads is None


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.replace(",read_bytes", ""), "t.csv:5: header has read_ahead, read_ahead_used, read_ahead_bytes, "
                                            "read_ahead_wasted_bytes without read_bytes"),
    (lambda s: s.replace("0,1,1,2,1,7,0.5,0,2000,5,5,5,5,5", "0,1,1,2,1,7,0.5,0,2000,5,5,-5,5,5"),
     f"t.csv:11: read_ahead_bytes=-5 must be in [0, {MAX_READ}]"),
    (lambda s: s.replace("0,1,1,2,1,7,0.5,0,2000,5,5,5,5,5", f"0,1,1,2,1,7,0.5,0,2000,5,5,5,5,{MAX_READ + 1}"),
     f"t.csv:11: read_bytes={MAX_READ + 1} must be in [0, {MAX_READ}]"),
])
def test_bad_reads_fail_with_file_and_line(tmp_path, blocks, edit, message):
    with pytest.raises(TraceError, match=re.escape(message)):
        read_trace(write(tmp_path, edit(with_reads(SMALL))))
