#!/usr/bin/env bash
# Build the moecache-patched llama-cpp-python wheel into dist/.
#
#   scripts/build_wheel.sh [--cuda [ARCHS]] [--mtmd] [--cmake-args ARGS] [--jobs N] [--out DIR]
#                          [--export-source DIR | --source DIR]
#
# Fetches the pinned llama-cpp-python sdist with pip (sha256 checked), applies patches/series
# in order, copies the expert cache's own C++ (native/llama/) into its llama.cpp's src/, and
# builds a wheel with a local version (0.3.36+moecache.<key>). The default build is CPU-only with
# the ggml RPC backend (the test device). A rebuild is skipped when the sdist, the patches, the
# sources, the flags and this script are unchanged; ccache is used when installed.
#
#   --cuda [ARCHS]       also build the CUDA backend (CMAKE_CUDA_ARCHITECTURES, default "native").
#                        Needs nvcc (CUDA 12/13) and cuBLAS: the toolkit's, or else python3's
#                        nvidia-cublas package (scripts/cuda_env.sh).
#   --mtmd               also build libmtmd (multimodal chat handlers); off by default to save time
#   --cmake-args ARGS    more CMake flags, e.g. "-DGGML_CUDA_FA=OFF"
#   --jobs N             parallel compile jobs (default: nproc)
#   --out DIR            where to put the wheel (default: dist/)
#   --export-source DIR  write the patched source tree (version set, native/llama/ copied in) to
#                        DIR and stop: for a machine without network (scripts/gpu_bundle.sh packs it)
#   --source DIR         build from such a tree, offline: no download, no patching, and no build
#                        isolation (scikit-build-core must be installed)
#
# Environment: MOECACHE_CACHE_DIR (default ${XDG_CACHE_HOME:-~/.cache}/moecache) holds the sdist,
# the build tree and the built wheels.
set -euo pipefail

VERSION=0.3.36
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${MOECACHE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/moecache}
out=$repo/dist
jobs=$(nproc)
cuda_archs=""
mtmd=OFF
extra_args=""
export_dir=""
source_dir=""

die() { echo "build_wheel: error: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
    case "$1" in
        --cuda)
            cuda_archs=native
            if [ $# -gt 1 ] && [[ "$2" != --* ]]; then cuda_archs=$2; shift; fi ;;
        --mtmd) mtmd=ON ;;
        --jobs) [ $# -gt 1 ] && [[ "$2" =~ ^[1-9][0-9]*$ ]] || die "--jobs needs a positive integer"; jobs=$2; shift ;;
        --out)  [ $# -gt 1 ] || die "--out needs a directory"; out=$2; shift ;;
        --cmake-args) [ $# -gt 1 ] || die "--cmake-args needs a value"; extra_args=$2; shift ;;
        --export-source) [ $# -gt 1 ] || die "--export-source needs a directory"; export_dir=$2; shift ;;
        --source) [ $# -gt 1 ] && [ -f "$2/llama_cpp/__init__.py" ] || die "--source needs a patched llama-cpp-python tree"; source_dir=$(cd "$2" && pwd); shift ;;
        -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
    shift
done

flags="-DGGML_RPC=ON -DLLAVA_BUILD=$mtmd -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
if [ -n "$cuda_archs" ]; then
    [ -n "$export_dir" ] || command -v nvcc >/dev/null || die "--cuda needs nvcc on PATH"
    flags="$flags -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$cuda_archs"
fi
[ -z "$extra_args" ] || flags="$flags $extra_args"
[ -z "$export_dir" ] || [ -z "$source_dir" ] || die "--export-source and --source exclude each other"

publish() {  # dist/ holds one patched wheel: the current one
    mkdir -p "$out"
    rm -f "$out"/llama_cpp_python-*+moecache.*.whl
    cp "$wheel_dir"/*.whl "$out"/
}

if [ -n "$source_dir" ]; then
    src=$source_dir
    version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$src/llama_cpp/__init__.py")
    [[ "$version" == *+moecache.* ]] || die "$src is not a patched tree (version '$version')"
    wheel_dir=$cache/wheels/source-$(echo "$version $flags" | sha256sum | cut -c1-12)
    pip_offline=(--no-build-isolation --no-index)
else

# --- the pinned sdist ---------------------------------------------------------------------
sdist=$cache/sdist/llama_cpp_python-$VERSION.tar.gz
if [ ! -f "$sdist" ]; then
    echo "build_wheel: fetching llama-cpp-python==$VERSION sdist"
    "${PYTHON:-python3}" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$cache/sdist" \
        || die "could not download the llama-cpp-python==$VERSION sdist"
fi
echo "$SDIST_SHA256  $sdist" | sha256sum --check --status \
    || die "$sdist does not have the pinned sha256 $SDIST_SHA256 (delete it to download again)"

# --- skip when nothing changed --------------------------------------------------------------
series=$repo/patches/series
[ -f "$series" ] || die "$series not found"
mapfile -t patches < <(grep -v -e '^#' -e '^[[:space:]]*$' "$series")
# the cache's C++ (native/llama/), which the patches add to libllama's sources: named and hashed in order
native=$repo/native/llama
mapfile -t sources < <(cd "$native" && find . -maxdepth 1 -type f \( -name '*.h' -o -name '*.cpp' \) | sed 's|^\./||' | LC_ALL=C sort)
[ "${#sources[@]}" -gt 0 ] || die "no C++ sources in $native"
key=$( { echo "$SDIST_SHA256 $flags"; cat "${BASH_SOURCE[0]}" "$series"; for p in "${patches[@]}"; do cat "$repo/patches/$p"; done
         for f in "${sources[@]}"; do echo "$f"; cat "$native/$f"; done; } \
       | sha256sum | cut -c1-12)
wheel_dir=$cache/wheels/$key
if [ -z "$export_dir" ] && ls "$wheel_dir"/*.whl >/dev/null 2>&1; then
    publish
    echo "build_wheel: up to date: $out/$(basename "$wheel_dir"/*.whl)"
    exit 0
fi

# --- patched source tree (a fixed path, so ccache hits across patch revisions) ----------------
src=${export_dir:-$cache/build/src}
rm -rf "$src" && mkdir -p "$src"
tar xzf "$sdist" -C "$src" --strip-components=1
for p in "${patches[@]}"; do
    [ -f "$repo/patches/$p" ] || die "patch patches/$p (listed in patches/series) not found"
    if ! msg=$(cd "$src" && git apply --check "$repo/patches/$p" 2>&1); then
        die "patch patches/$p does not apply: $(echo "$msg" | head -n 2 | tr '\n' ' ')"
    fi
    (cd "$src" && git apply "$repo/patches/$p")
done
dest=$src/vendor/llama.cpp/src
for f in "${sources[@]}"; do  # beside llama.cpp's own files, never over one of them
    [ ! -e "$dest/$f" ] || die "native/llama/$f: vendor/llama.cpp/src/$f exists already (the sdist's, or a patch's)"
    cp "$native/$f" "$dest/$f"
done
sed -i "s/^__version__ = \"$VERSION\"$/__version__ = \"$VERSION+moecache.$key\"/" "$src/llama_cpp/__init__.py"
grep -q "moecache.$key" "$src/llama_cpp/__init__.py" || die "could not set the local version in llama_cpp/__init__.py"
if [ -n "$export_dir" ]; then
    echo "build_wheel: patched source of $VERSION+moecache.$key in $export_dir"
    exit 0
fi
pip_offline=()
fi

# --- build ---------------------------------------------------------------------------------------
# FindCUDAToolkit wants one root holding nvcc, cuBLAS and a libcuda.so to link against. A toolkit
# assembled from pip wheels has neither of the last two: build against a completed copy of it.
cuda_toolkit() {
    source "$repo/scripts/cuda_env.sh"
    cuda_find_cublas || die "--cuda needs cuBLAS: none in nvcc's toolkit (${CUDA_TOP:-not found}) nor in ${PYTHON:-python3}'s nvidia-cublas package"
    local driver_stub toolkit lib so driver
    driver_stub=""
    for so in "$CUDA_TOP"/lib*/stubs/libcuda.so "$CUDA_TOP"/targets/*/lib/stubs/libcuda.so; do
        [ -f "$so" ] && { driver_stub=$so; break; }
    done
    [ -z "$CUBLAS_HOME" ] && [ -n "$driver_stub" ] && return 0
    toolkit=$cache/cuda-toolkit
    rm -rf "$toolkit" && mkdir -p "$toolkit" && cp -a "$CUDA_TOP/." "$toolkit/"
    lib=$toolkit/lib64
    [ -d "$lib" ] || lib=$toolkit/lib
    if [ -n "$CUBLAS_HOME" ]; then
        cp -a "$CUBLAS_HOME/include/." "$toolkit/include/"
        for so in "$CUBLAS_LIB"/libcublas*.so.*; do
            ln -sf "$so" "$lib/"
            ln -sf "${so##*/}" "$lib/$(basename "${so%%.so.*}").so"
        done
    fi
    if [ -z "$driver_stub" ]; then
        mkdir -p "$lib/stubs"
        driver=$(ldconfig -p | sed -n 's/^[[:space:]]*libcuda\.so\.1 .*=> //p')
        driver=${driver%%$'\n'*}  # the first one
        if [ -n "$driver" ]; then
            ln -sf "$driver" "$lib/stubs/libcuda.so"
        else  # no driver here (a build-only machine): a libcuda.so.1 defining the driver API's
              # names, so that the link records it as needed (an empty one would be dropped,
              # leaving cu* symbols nothing loads); the driver's own is loaded at run time. Each
              # returns CUDA_ERROR_NO_DEVICE, so the stub can also stand in for a driver here.
            echo '#include <cuda.h>' | cc -E -P -I"$toolkit/include" -x c - \
                | grep -o '\bcu[A-Za-z0-9_]*[[:space:]]*(' | tr -d '( \t' | sort -u | sed 's/.*/int &(void) { return 100; }/' \
                | cc -shared -fPIC -Wl,-soname,libcuda.so.1 -x c - -o "$lib/stubs/libcuda.so" \
                || die "could not make a libcuda.so to link against"
        fi
    fi
    echo "build_wheel: CUDA toolkit $CUDA_TOP completed in $toolkit (cuBLAS from ${CUBLAS_HOME:-the toolkit})"
    export CUDACXX=$toolkit/bin/nvcc CUDAToolkit_ROOT=$toolkit PATH=$toolkit/bin:$PATH
}
[ -z "$cuda_archs" ] || cuda_toolkit

if command -v ccache >/dev/null; then
    flags="$flags -DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache"
    [ -n "$cuda_archs" ] && flags="$flags -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache"
    export CCACHE_BASEDIR=$cache/build CCACHE_NOHASHDIR=1
else
    echo "build_wheel: ccache not found: a full build (510 s on a fresh 2-core machine, docs/build.md)"
fi

# No AMX on x86: ggml's AMX kernels only serve dense matmuls on the CPU (never the experts'
# MUL_MAT_ID, which the cache splits), and on KVM guests that advertise AMX without enabling it
# their first tile instruction dies with SIGILL (seen on a project machine: stock CPU decode of a
# Q4_1 model). A -march=native build turns them on wherever the CPU says it has AMX.
no_amx=()
if [ "$(uname -m)" = x86_64 ] && echo 'int x;' | ${CC:-cc} -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 -x c -c - -o /dev/null 2>/dev/null; then
    amx_off="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    no_amx=(--config-settings="cmake.define.CMAKE_C_FLAGS=$amx_off" --config-settings="cmake.define.CMAKE_CXX_FLAGS=$amx_off")
fi

echo "build_wheel: building $(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$src/llama_cpp/__init__.py") ($flags)"
start=$(date +%s)
rm -rf "$wheel_dir.tmp" && mkdir -p "$wheel_dir.tmp"
CMAKE_ARGS="$flags" CMAKE_BUILD_PARALLEL_LEVEL=$jobs \
    "${PYTHON:-python3}" -m pip wheel --no-deps "${pip_offline[@]}" --wheel-dir "$wheel_dir.tmp" \
        --config-settings=build-dir="$cache/build/cmake" --config-settings=cmake.verbose=false "${no_amx[@]}" "$src" \
    || die "the wheel build failed (see the compiler output above)"
rm -rf "$wheel_dir" && mv "$wheel_dir.tmp" "$wheel_dir"
publish
echo "build_wheel: built $out/$(basename "$wheel_dir"/*.whl) in $(( $(date +%s) - start )) s"
