"""python -m moecache.models {tiny,smol-moe,synth} ...: build (or reuse) a model, print its path."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ..util import OneLineParser, int_arg
from . import cache_dir, smol_moe, synth_moe, tiny_moe
from .synth import DEFAULT_LOCALITY, MAX_LOCALITY, PRESETS
from .tiny import ARCHS, EXPERT_TYPES


def parser() -> OneLineParser:
    # flags are stored under the builders' keyword names; absent flags keep the defaults
    p = OneLineParser(prog="python -m moecache.models",
                      description="Build (or reuse) a model and print its path.")
    models = p.add_subparsers(dest="model", required=True, metavar="{tiny,smol-moe,synth}")

    def model(name: str, build, description: str) -> OneLineParser:
        sub = models.add_parser(name, description=description, help=description,
                                argument_default=argparse.SUPPRESS)
        sub.set_defaults(build=build)
        if name == "synth":
            sub.add_argument("preset", help=" | ".join(PRESETS))
        sub.add_argument("--experts", dest="n_expert", type=int_arg(), metavar="E", help="experts per layer")
        sub.add_argument("--top-k", dest="n_expert_used", type=int_arg(), metavar="K",
                         help="experts used per token")
        sub.add_argument("--seed", type=int_arg(), metavar="S", help="random seed (default 0)")
        sub.add_argument("--out", dest="path", metavar="PATH", help=f"output file (default: a file in {cache_dir()})")
        return sub

    tiny = model("tiny", tiny_moe, "a random tiny MoE model of a llama.cpp architecture (milliseconds; for tests)")
    tiny.add_argument("--layers", dest="n_layer", type=int_arg(), metavar="N", help="layers (default 2)")
    tiny.add_argument("--embd", dest="n_embd", type=int_arg(), metavar="D", help="n_embd (default 64)")
    tiny.add_argument("--expert-type", metavar="T", help=f"{' | '.join(EXPERT_TYPES)} (default f32)")
    tiny.add_argument("--arch", metavar="A", help=f"the GGUF architecture: {' | '.join(sorted(ARCHS))} (default qwen3moe)")
    model("smol-moe", smol_moe, "SmolLM2-135M upcycled into an MoE (the default model)")
    synth = model("synth", synth_moe, "a shape-realistic random MoE model (for benchmarks)")
    synth.add_argument("--layers", dest="n_layer", type=int_arg(), metavar="N", help="layers (shrinks the model)")
    synth.add_argument("--embd", dest="n_embd", type=int_arg(), metavar="D", help="n_embd (a multiple of 32)")
    synth.add_argument("--expert-ff", dest="n_ff_exp", type=int_arg(), metavar="F",
                       help="expert FFN width (a multiple of 32)")
    synth.add_argument("--locality", type=float, metavar="S",
                       help=f"routing locality in [0, {MAX_LOCALITY}] (default {DEFAULT_LOCALITY}; 0 = random)")
    synth.add_argument("--threads", type=int_arg(), metavar="T", help="generator threads (default: all cores)")
    return p


def _build(args: argparse.Namespace) -> None:
    kwargs = vars(args)
    build = kwargs.pop("build")
    del kwargs["model"]
    print(build(**kwargs))


def main(argv: Sequence[str] | None = None) -> int:
    return parser().run(_build, argv)


if __name__ == "__main__":
    sys.exit(main())
