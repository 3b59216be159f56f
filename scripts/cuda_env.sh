# Sourced by build_wheel.sh and gpu_check.sh: where cuBLAS is. A full CUDA toolkit has it beside
# nvcc; a toolkit assembled from pip wheels (nvcc on the development machines) has not, but
# python3's nvidia-cublas package (a PyTorch dependency) may.
#
# cuda_find_cublas sets
#   CUDA_TOP      the toolkit nvcc belongs to
#   CUBLAS_HOME   the directory holding include/cublas_v2.h and lib/libcublas.so.N when cuBLAS is
#                 not the toolkit's own (empty when it is)
#   CUBLAS_LIB    the directory of libcublas.so.N (empty if there is none)
# and fails when nvcc or cuBLAS's headers cannot be found.
cuda_find_cublas() {
    CUDA_TOP=$(nvcc --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p')
    CUDA_TOP=$(cd "$CUDA_TOP" 2>/dev/null && pwd -P) || return 1
    CUBLAS_HOME=""
    CUBLAS_LIB=""
    local include
    for include in "$CUDA_TOP/include" "$CUDA_TOP"/targets/*/include; do
        [ -f "$include/cublas_v2.h" ] && { _cuda_cublas_lib; return 0; }
    done
    local major
    major=$(nvcc --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
    # nvidia-cublas lays out nvidia/cu13/{include,lib}; CUDA 12's nvidia-cublas-cu12 nvidia/cublas/
    CUBLAS_HOME=$("${PYTHON:-python3}" - "$major" 2>/dev/null <<'EOF'
import os, sys
import nvidia
names = ["cu" + sys.argv[1]] + (["cublas"] if sys.argv[1] == "12" else [])
for root in nvidia.__path__:
    for name in names:
        if os.path.isfile(os.path.join(root, name, "include", "cublas_v2.h")):
            print(os.path.join(root, name))
            sys.exit()
EOF
)
    [ -n "$CUBLAS_HOME" ] || return 1
    _cuda_cublas_lib
}

_cuda_cublas_lib() {
    local so
    for so in "${CUBLAS_HOME:-$CUDA_TOP}"/{lib64,lib,targets/*/lib}/libcublas.so.*; do
        [ -f "$so" ] && { CUBLAS_LIB=$(dirname "$so"); break; }
    done
    return 0
}
