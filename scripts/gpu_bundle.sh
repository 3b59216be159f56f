#!/usr/bin/env bash
# Pack what scripts/gpu_check.sh needs on a GPU machine without network into one directory to
# copy there:
#
#   scripts/gpu_bundle.sh [--cuda-wheel] [--max-mib N] [DIR]   (DIR default: gpu-bundle/, ignored by git)
#
#   --max-mib N     fail (exit 1) when the bundle is larger than N MiB (default: no limit), for a
#                   transfer with a size limit
#
#   DIR/src.tar.gz  the patched llama-cpp-python tree, without what the build never reads
#                   (models, docs, tests, examples, tools): the sdist itself is 76 MB
#   DIR/wheels/     the Python packages moecache needs that the GPU image lacks (cffi, pycparser,
#                   gguf, diskcache), for its Python (3.12; MOECACHE_GPU_PYTHON overrides)
#   DIR/dist/       with --cuda-wheel: the CUDA wheel, built here from that tree (sm_90, the
#                   flags gpu_check.sh builds with, but portable AVX2 CPU code instead of
#                   -march=native, since the GPU machine's CPU is not known here), so that the
#                   GPU check is one run with no build. Needs nvcc and cuBLAS (where the
#                   toolkit has none: pip install nvidia-cublas); about 20 minutes on 2 cores
#                   with a cold ccache (docs/build.md).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cuda_wheel=0
max_mib=0
out=$repo/gpu-bundle
while [ $# -gt 0 ]; do
    case "$1" in
        --cuda-wheel) cuda_wheel=1 ;;
        --max-mib) [[ $# -gt 1 && $2 =~ ^[0-9]+$ ]] || { echo "gpu_bundle: error: --max-mib needs a number of MiB" >&2; exit 2; }
                   max_mib=$2; shift ;;
        -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;;
        -*) echo "gpu_bundle: error: unknown argument '$1' (see --help)" >&2; exit 2 ;;
        *) out=$1 ;;
    esac
    shift
done
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

if [ "$cuda_wheel" = 1 ]; then
    mkdir -p "$tmp/built" && tar xzf "$out/src.tar.gz" -C "$tmp/built"
    "$repo/scripts/build_wheel.sh" --cuda 90 --cmake-args "-DGGML_CUDA_FA=OFF -DGGML_NATIVE=OFF" \
        --source "$tmp/built" --out "$tmp/dist"
    # The wheel holds every library three times (lib*.so, .so.0, .so.0.x.y) plus CMake's install
    # tree: 187 MB. Keep what is loaded: libllama.so and libggml.so by name (llama_cpp), the rest by
    # SONAME (lib*.so.0).
    mkdir -p "$out/dist"
    python3 - "$tmp"/dist/*.whl "$out/dist" <<'EOF'
import os, re, sys, zipfile

source, out_dir = sys.argv[1], sys.argv[2]
loaded = re.compile(r"llama_cpp/lib/(libllama\.so|libggml\.so|lib[\w-]+\.so\.0)$")

def kept(name):
    if name.startswith("llama_cpp/lib/"):
        return bool(loaded.match(name))
    return name.startswith(("llama_cpp/", "llama_cpp_python-"))

with zipfile.ZipFile(source) as zin, \
        zipfile.ZipFile(os.path.join(out_dir, os.path.basename(source)), "w") as zout:
    for info in zin.infolist():
        if not kept(info.filename):
            continue
        data = zin.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            data = "".join(line for line in data.decode().splitlines(True) if kept(line.split(",")[0])).encode()
        zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
EOF
    # built without a driver, the CUDA library must still name libcuda.so.1 for its cu* symbols
    python3 -c 'import sys, zipfile; sys.stdout.buffer.write(zipfile.ZipFile(sys.argv[1]).read("llama_cpp/lib/libggml-cuda.so.0"))' \
        "$out"/dist/*.whl > "$tmp/libggml-cuda.so.0"
    if nm -D --undefined-only "$tmp/libggml-cuda.so.0" | grep -q ' cu[A-Z]' \
            && ! objdump -p "$tmp/libggml-cuda.so.0" | grep -q 'NEEDED.*libcuda\.so\.1'; then
        echo "gpu_bundle: error: libggml-cuda uses the CUDA driver API but does not name libcuda.so.1" >&2
        exit 1
    fi
fi

mib=$(( ($(du -sk "$out" | cut -f1) + 1023) / 1024 ))
if [ "$max_mib" -gt 0 ] && [ "$mib" -gt "$max_mib" ]; then
    echo "gpu_bundle: error: $out is $mib MiB, more than --max-mib $max_mib" >&2
    exit 1
fi
echo "gpu_bundle: $mib MiB in $out (copy it there; gpu_check.sh --bundle $out)"
