"""moecache.models.synth: preset shapes and metadata on shrunk configs, caching, bad input, and a
shrunk model decoding on the loopback RPC device."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from moecache.models import synth  # noqa: E402

# shrunk widths: a few MB per file, every preset keeps its expert count and top-k
SMALL = dict(n_layer=2, n_embd=64, n_ff_exp=32, n_head=4, n_head_kv=2, head_dim=16)


def _fields(reader):
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


@pytest.mark.parametrize("preset", sorted(synth.PRESETS))
def test_preset_shapes_and_metadata(tmp_path, preset):
    full = synth.PRESETS[preset]
    path = synth.synth_moe(preset, tmp_path / "m.gguf", threads=2, **SMALL)
    reader = gguf.GGUFReader(path)
    kv = _fields(reader)
    a = full.arch
    assert kv["general.architecture"] == a
    assert kv[f"{a}.block_count"] == 2
    assert kv[f"{a}.expert_count"] == full.n_expert
    assert kv[f"{a}.expert_used_count"] == full.n_expert_used
    assert kv[f"{a}.expert_feed_forward_length"] == 32
    assert kv["moecache.synth.preset"] == preset
    assert kv["moecache.synth.locality"] == pytest.approx(synth.DEFAULT_LOCALITY)

    tensors = {t.name: t for t in reader.tensors}
    q4_0 = gguf.GGMLQuantizationType.Q4_0
    experts = ((("gate_up", (64, 64, full.n_expert)),) if a == "qwen3next" else
               (("gate", (64, 32, full.n_expert)), ("up", (64, 32, full.n_expert))))
    for kind, ne in (*experts, ("down", (32, 64, full.n_expert))):
        t = tensors[f"blk.1.ffn_{kind}_exps.weight"]
        assert t.tensor_type == q4_0 and tuple(int(x) for x in t.shape) == ne
    assert tuple(int(x) for x in tensors["blk.0.ffn_gate_inp.weight"].shape) == (64, full.n_expert)
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert sum(int(t.n_bytes) for t in reader.tensors) == synth.file_bytes(
        synth.Shape(**{**vars(full), **SMALL}))


def test_full_presets_have_the_documented_sizes():
    assert synth.file_bytes(synth.PRESETS["qwen3-30b-a3b"]) == pytest.approx(17.0e9, rel=0.03)
    assert synth.file_bytes(synth.PRESETS["moe-512x10"]) == pytest.approx(44.0e9, rel=0.03)
    assert synth.file_bytes(synth.PRESETS["gpt-oss-20b"]) == pytest.approx(11.0e9, rel=0.03)
    assert synth.file_bytes(synth.PRESETS["qwen3-next-80b-a3b"]) == pytest.approx(45.0e9, rel=0.03)


def test_random_q4_0_blocks_have_unit_gain_and_no_bias():
    blocks = synth.random_q4_0((1, 2), (64, 256), 256).reshape(-1, synth.Q4_0_BLOCK_BYTES)
    scales = blocks[:, :2].copy().view(np.float16).astype(np.float64).ravel()
    nibbles = np.concatenate([blocks[:, 2:] & 15, blocks[:, 2:] >> 4], axis=1).astype(np.float64) - 8
    values = scales[:, None] * nibbles
    assert np.isfinite(scales).all() and set(np.unique(np.abs(scales))) == {float(np.abs(scales[0]))}
    assert abs(values.mean()) < 0.05 * values.std()  # random signs cancel the -0.5 nibble bias
    assert values.std() * np.sqrt(256) == pytest.approx(1.0, rel=0.05)


def test_cached_file_is_reused_and_arguments_change_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv("MOECACHE_CACHE_DIR", str(tmp_path))
    first = synth.synth_moe("qwen3-30b-a3b", threads=1, **SMALL)
    mtime = first.stat().st_mtime_ns
    assert synth.synth_moe("qwen3-30b-a3b", threads=2, **SMALL) == first  # threads: same bytes
    assert first.stat().st_mtime_ns == mtime
    other = synth.synth_moe("qwen3-30b-a3b", locality=0.0, threads=1, **SMALL)
    assert other != first
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == sorted([first.name, other.name])


@pytest.mark.parametrize("kwargs,message", [
    (dict(preset="nope"), "unknown preset 'nope'"),
    (dict(locality=0.99), "locality must be in [0, 0.95]"),
    (dict(locality="high"), "locality must be a number"),
    (dict(n_embd=100), "n_embd must be a multiple of 32"),
    (dict(n_expert_used=200), "n_expert_used=200 must be in [1, 128]"),
    (dict(n_heads=4), "unknown shape field 'n_heads'"),
    (dict(seed=-1), "seed=-1 must be in [0, 4294967295]"),
])
def test_bad_arguments_are_one_line_value_errors(tmp_path, kwargs, message):
    kwargs = {"preset": "qwen3-30b-a3b", **kwargs}
    with pytest.raises(ValueError) as err:
        synth.synth_moe(kwargs.pop("preset"), tmp_path / "m.gguf", **kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("argv,message", [
    (["nope"], ": error: unknown preset 'nope'"),
    (["qwen3-30b-a3b", "--layers", "0"], ": error: n_layer=0 must be in [1, 512]"),
    (["qwen3-30b-a3b", "--layers", "1_0"], " synth: error: argument --layers: '1_0' is not an integer"),
    (["qwen3-30b-a3b", "--locality", "x"], " synth: error: argument --locality: invalid float value: 'x'"),
    (["qwen3-30b-a3b", "--bogus"], ": error: unrecognized arguments: --bogus"),
])
def test_cli_bad_arguments_exit_2_with_one_line(argv, message):
    run = subprocess.run([sys.executable, "-m", "moecache.models", "synth", *argv], capture_output=True, text=True)
    assert run.returncode == 2
    assert run.stderr.startswith(f"python -m moecache.models{message}")
    assert run.stderr.count("\n") == 1 and run.stdout == ""


def test_cli_prints_the_path(tmp_path):
    out = tmp_path / "m.gguf"
    run = subprocess.run([sys.executable, "-m", "moecache.models", "synth", "moe-512x10", "--layers", "1", "--embd", "64",
                          "--expert-ff", "32", "--experts", "16", "--top-k", "4", "--out", str(out)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(out) and out.is_file()


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "gpt-oss-20b", "qwen3-next-80b-a3b"])  # one per arch
def test_shrunk_model_decodes_along_its_token_cycle(rpc_device, tmp_path, preset):
    """The residual stream stays dominated by the embedding: greedy decoding walks the
    vocabulary cycle (no token repeats within a cycle), which is what routing locality rests on."""
    pytest.importorskip("llama_cpp")
    from conftest import greedy, load

    path = synth.synth_moe(preset, tmp_path / "m.gguf", n_layer=4, n_expert=16,
                           n_expert_used=2, n_embd=64, n_ff_exp=32, n_head=4, n_head_kv=2, head_dim=16)
    tokens, logits = greedy(load(str(path)), b"The three primary colors are", 48)
    assert len(set(tokens)) == len(tokens)
    assert np.isfinite(logits).all()
