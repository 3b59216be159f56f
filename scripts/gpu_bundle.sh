#!/usr/bin/env bash
# Pack what scripts/gpu_check.sh needs on a lent GPU machine, which has no network, into one
# directory to carry there (the device tool's `carry`, 64 MiB in all):
#
#   scripts/gpu_bundle.sh [DIR]        (default: gpu-bundle/, ignored by git)
#
#   DIR/src.tar.gz  the patched llama-cpp-python tree, without what the build never reads
#                   (models, docs, tests, examples, tools): the sdist itself is 76 MB
#   DIR/wheels/     the Python packages moecache needs that the GPU image lacks (cffi, pycparser,
#                   gguf, diskcache), for its Python (3.12; MOECACHE_GPU_PYTHON overrides)
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:-$repo/gpu-bundle}
python_version=${MOECACHE_GPU_PYTHON:-3.12}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$repo/scripts/build_wheel.sh" --cuda 90 --export-source "$tmp/src"

rm -rf "$out" && mkdir -p "$out/wheels"
vendor=vendor/llama.cpp
tar czf "$out/src.tar.gz" -C "$tmp/src" \
    --exclude="./$vendor/models" --exclude="./$vendor/docs" --exclude="./$vendor/media" \
    --exclude="./$vendor/tests" --exclude="./$vendor/examples" --exclude="./$vendor/tools" \
    --exclude="./$vendor/app" --exclude="./$vendor/benches" --exclude="./$vendor/pocs" \
    --exclude="./$vendor/gguf-py" --exclude="./$vendor/conversion" --exclude="./$vendor/.git" \
    --exclude=./.git --exclude=./docs --exclude=./examples --exclude=./tests --exclude=./docker .

python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$python_version" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$out/wheels" \
    cffi==2.0.0 pycparser gguf==0.19.0 diskcache

echo "gpu_bundle: $(du -sh "$out" | cut -f1) in $out (carry it; gpu_check.sh --bundle $out)"
