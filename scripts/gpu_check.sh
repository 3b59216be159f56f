#!/usr/bin/env bash
# One command for a GPU machine without network: build, install, generate the benchmark model,
# check exactness, benchmark. Everything lands under the output directory.
#
#   scripts/gpu_check.sh [--bundle DIR] [--wheel PATH] [--build-only] [--out DIR] [--results DIR]
#                        [--limit PHASE=SECONDS]... [--cpu-rehearsal]
#
#   --bundle DIR     offline inputs made by scripts/gpu_bundle.sh (the patched source and the
#                    wheels the GPU image lacks); copy it to the GPU machine
#   --wheel PATH     install this llama-cpp-python wheel instead of building the CUDA one
#   --build-only     stop after building the wheel (into <out>/dist)
#   --out DIR        working directory, <out> below (default ./gpu-out)
#   --results DIR    also copy the small results there: machine.txt, phases.tsv, the JSON, table
#                    and plot, and the logs as one logs.tar.gz
#   --limit P=S      time box of phase P in seconds (repeatable; defaults below)
#   --cpu-rehearsal  the same phases on a CPU-only machine: no build or install (the llama_cpp
#                    already importable is used, with the loopback RPC device as the device, and
#                    moecache from this checkout), a 4-layer model and few tokens
#
# With the CUDA wheel built beforehand (scripts/gpu_bundle.sh --cuda-wheel), one run:
#   scripts/gpu_check.sh --bundle gpu-bundle --wheel gpu-bundle/dist/*.whl
#   (the phases after the build take 975 s at most with the default limits)
# or, should that wheel not load there, building there first:
#   scripts/gpu_check.sh --bundle gpu-bundle --build-only
#   scripts/gpu_check.sh --bundle gpu-bundle --wheel gpu-out/dist/*.whl
#
# Phases, each time-boxed with `timeout` (default seconds):
#   build 540   build_wheel.sh --cuda 90 --cmake-args -DGGML_CUDA_FA=OFF (from the bundle's
#               source when given; FlashAttention kernels are left out to fit the time box:
#               stock and cached runs use the same build)
#   install 45  the bundle's wheels into <out>/site (PYTHONPATH), the llama-cpp-python wheel and
#               moecache with pip --no-deps --no-build-isolation --no-index; fails unless ggml
#               sees a GPU (cuBLAS is put on LD_LIBRARY_PATH, see scripts/cuda_env.sh)
#   model 210   python -m moecache.models synth qwen3-30b-a3b (48 layers, ~17 GB, default
#               locality), in /dev/shm when it has 40 GiB free, else in <out>/cache
#               (MOECACHE_CACHE_DIR overrides)
#   exact 90    scripts/check_exact.py: greedy tokens with a cache of 16 slots identical to the
#               same placement without a cache over 128 tokens; prints max |logit difference|
#   bench 180   scripts/bench_decode.py: stock (repacked, as --cpu-moe), K=64,32,16, all-device (its table
#               and JSON are rewritten after every configuration: a timeout keeps what ran)
#   planner 150 the miss planner (issue 22; first run on an H200 in docs/benchmarks.md): scripts/bench_decode.py
#               --planner-off at K=32: stock, K=32 (the default: the planner on) and "planner off
#               K=32" (LLAMA_MOE_CACHE_PLANNER=0); prints the link rate (timed copies of one expert's bytes to the GPU) and the host
#               read rate it measured at attach, which calibrate the model's (docs/cost-model.md)
#   margin 300  the planner's payback margin (the first GPU check: each upload cost the decode
#               about 0.5 ms, twice its copy's time, while the planner counts only the link's busy
#               time): scripts/bench_decode.py -n 128 --slots 0,8,32 as shipped, then the same
#               planned as though the link ran at 2.5 GB/s (--link-gbps 2.5: a larger
#               margin, fewer uploads)
# Output: machine.txt (CPU, memory, GPU, driver, nvcc), phases.tsv (phase, exit status, seconds),
# <phase>.log, exact.json, bench.{md,json,png}, planner.{md,json}, margin-{default,2.5}.{md,json}.
# Exit status: 0 when every phase passed, 1 otherwise, 2 for bad arguments.
set -uo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=./gpu-out
wheel=""
bundle=""
results=""
build_only=0
rehearsal=0
declare -A limit=([build]=540 [install]=45 [model]=210 [exact]=90 [bench]=180 [planner]=150 [margin]=300)

usage() { sed -n '2,/^[^#]/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }
bad() { echo "gpu_check: error: $*" >&2; exit 2; }

while [ $# -gt 0 ]; do
    case "$1" in
        --wheel) [ $# -gt 1 ] || bad "--wheel needs a path"; wheel=$2; shift ;;
        --bundle) [ $# -gt 1 ] && [ -f "$2/src.tar.gz" ] && [ -d "$2/wheels" ] || bad "--bundle needs a directory made by scripts/gpu_bundle.sh"
                  bundle=$(cd "$2" && pwd); shift ;;
        --build-only) build_only=1 ;;
        --out) [ $# -gt 1 ] || bad "--out needs a directory"; out=$2; shift ;;
        --results) [ $# -gt 1 ] || bad "--results needs a directory"; results=$2; shift ;;
        --limit) [ $# -gt 1 ] && [[ $2 =~ ^([a-z]+)=([0-9]+)$ ]] && [ -n "${limit[${BASH_REMATCH[1]}]:-}" ] \
                     || bad "--limit needs PHASE=SECONDS, PHASE one of build, install, model, exact, bench, planner, margin"
                 limit[${BASH_REMATCH[1]}]=${BASH_REMATCH[2]}; shift ;;
        --cpu-rehearsal) rehearsal=1 ;;
        -h|--help) usage; exit 0 ;;
        *) bad "unknown argument '$1' (see --help)" ;;
    esac
    shift
done
[ -z "$wheel" ] || [ -f "$wheel" ] || bad "wheel not found: $wheel"
[ -z "$wheel" ] || [ "$rehearsal" = 0 ] || bad "--wheel and --cpu-rehearsal exclude each other"
[ "$build_only" = 0 ] || [ -z "$wheel" ] || bad "--build-only and --wheel exclude each other"
[ "$build_only" = 0 ] || [ "$rehearsal" = 0 ] || bad "--build-only and --cpu-rehearsal exclude each other"

mkdir -p "$out" || bad "cannot create $out"
out=$(cd "$out" && pwd)
if [ -n "$results" ]; then
    mkdir -p "$results" || bad "cannot create $results"
    results=$(cd "$results" && pwd)
fi
# the 17 GB model is written at memory speed to /dev/shm when it has room (the GPU machine's
# disk speed is not known), else under <out>
if [ -z "${MOECACHE_CACHE_DIR:-}" ]; then
    export MOECACHE_CACHE_DIR=$out/cache
    shm_free_kib=$(df --output=avail /dev/shm 2>/dev/null | tail -n 1)
    if [ "$rehearsal" = 0 ] && [ "${shm_free_kib:-0}" -gt $((40 << 20)) ] 2>/dev/null; then
        export MOECACHE_CACHE_DIR=/dev/shm/moecache-gpu-check
    fi
fi
threads=$(nproc)
if [ "$rehearsal" = 1 ]; then
    export PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH}   # moecache from this checkout
    model_args=(--layers 4); exact_tokens=16; bench_args=(-n 4 -r 2)
else
    model_args=(); exact_tokens=128; bench_args=(-n 32 -r 3)
fi

status=0
printf 'phase\texit\tseconds\n' > "$out/phases.tsv"
# phase NAME COMMAND...: run it under timeout (--limit), log to NAME.log, record the outcome
phase() {
    local name=$1; shift
    local start=$SECONDS rc seconds=${limit[$name]}
    echo "gpu_check: $name (at most ${seconds} s)" >&2
    timeout --kill-after=10 "$seconds" "$@" > "$out/$name.log" 2>&1
    rc=$?
    printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" >> "$out/phases.tsv"
    if [ "$rc" != 0 ]; then
        status=1
        [ "$rc" = 124 ] && echo "gpu_check: $name timed out after $seconds s" >&2
        echo "gpu_check: $name failed (exit $rc); last lines of $out/$name.log:" >&2
        tail -n 5 "$out/$name.log" >&2
    fi
    return "$rc"
}

# --results: the small results, the logs as one archive
report() {
    [ -n "$results" ] && [ "$results" != "$out" ] || return 0
    mkdir -p "$results" && cp "$out"/*.tsv "$out"/machine.txt "$out"/*.json "$out"/*.md "$out"/*.png "$results"/ 2>/dev/null
    (cd "$out" && tar czf "$results/logs.tar.gz" -- *.log) 2>/dev/null
    return 0
}
trap report EXIT

# what the figures were measured on
{
    date -u +"%Y-%m-%d %H:%M UTC"
    uname -srm
    lscpu | grep -E '^(Model name|CPU\(s\)|Thread\(s\) per core|L3 cache|NUMA node\(s\)):'
    grep MemTotal /proc/meminfo
    nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max \
        --format=csv 2>&1
    nvcc --version 2>&1 | tail -n 2
    python3 --version
    echo "model cache: $MOECACHE_CACHE_DIR"
} > "$out/machine.txt" 2>&1

if [ "$rehearsal" = 0 ]; then
    # libggml-cuda loads cuBLAS at run time: from python3's nvidia-cublas when the toolkit has none
    source "$repo/scripts/cuda_env.sh"
    if cuda_find_cublas && [ -n "$CUBLAS_LIB" ]; then
        export LD_LIBRARY_PATH=$CUBLAS_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
        echo "cuBLAS: $CUBLAS_LIB" >> "$out/machine.txt"
    else
        echo "cuBLAS: not found beside nvcc (${CUDA_TOP:-no nvcc}) nor in python3's nvidia-cublas" >> "$out/machine.txt"
    fi
    if [ -n "$bundle" ]; then
        export PYTHONPATH=$out/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    if [ -z "$wheel" ]; then
        source_args=()
        if [ -n "$bundle" ]; then
            rm -rf "$out/src" && mkdir -p "$out/src" && tar xzf "$bundle/src.tar.gz" -C "$out/src"
            source_args=(--source "$out/src")
        fi
        phase build "$repo/scripts/build_wheel.sh" --cuda 90 --cmake-args "-DGGML_CUDA_FA=OFF" \
            "${source_args[@]}" --out "$out/dist" || exit 1
        wheel=$(ls "$out"/dist/llama_cpp_python-*.whl | head -n 1)
        [ "$build_only" = 0 ] || { echo "gpu_check: built $wheel" >&2; exit 0; }
    fi
    phase install bash -c '{ [ -z "$3" ] || python3 -m pip install -q --no-index --no-deps --upgrade --target "$4" "$3"/wheels/*.whl; } \
        && python3 -m pip install --no-deps --no-build-isolation --no-index --force-reinstall "$1" \
        && python3 -m pip install --no-deps --no-build-isolation --no-index "$2" \
        && cd / && python3 -c "import llama_cpp, moecache.live.native as n, moecache.live.ggml as g; print(llama_cpp.__version__, n.patch_version()); g.has_gpu() or exit(\"ggml sees no GPU: the CUDA backend did not start\")"' \
        _ "$wheel" "$repo" "$bundle" "$out/site" || exit 1
fi

phase model python3 -m moecache.models synth qwen3-30b-a3b "${model_args[@]}" --threads "$threads" || exit 1
model=$(tail -n 1 "$out/model.log")

phase exact python3 "$repo/scripts/check_exact.py" -m "$model" -n "$exact_tokens" --slots 16 \
    -t "$threads" --json "$out/exact.json"
grep '^check_exact:' "$out/exact.log" >&2

png=()
python3 -c "import matplotlib" 2>/dev/null && png=(--png "$out/bench.png")
phase bench python3 "$repo/scripts/bench_decode.py" -m "$model" "${bench_args[@]}" -t "$threads" \
    --slots 0,16,32,64 --all-device --md "$out/bench.md" --json "$out/bench.json" "${png[@]}"
[ -f "$out/bench.md" ] && cat "$out/bench.md" >&2

# issue 22: the planner's measured rates and its decode beside the same cache without it; not run
# on a GPU yet (the rehearsal ran it on the RPC device)
phase planner python3 "$repo/scripts/bench_decode.py" -m "$model" "${bench_args[@]}" -t "$threads" \
    --slots 0,32 --planner-off --md "$out/planner.md" --json "$out/planner.json"
[ -f "$out/planner.md" ] && cat "$out/planner.md" >&2

# the planner's margin: the default rows and the same planned at a slower link, in one phase so
# that both run on the same warm machine
phase margin bash -c 'for link in default 2.5; do
        python3 "$1" -m "$2" -n "$3" -r 3 -t "$4" --slots 0,8,32 $([ "$link" = default ] || echo --link-gbps "$link") \
            --md "$5/margin-$link.md" --json "$5/margin-$link.json" || exit
    done' _ "$repo/scripts/bench_decode.py" "$model" "$([ "$rehearsal" = 1 ] && echo 4 || echo 128)" "$threads" "$out"
for link in default 2.5; do [ -f "$out/margin-$link.md" ] && cat "$out/margin-$link.md" >&2; done

echo "gpu_check: $([ "$status" = 0 ] && echo passed || echo FAILED); phases in $out/phases.tsv" >&2
exit "$status"
