#!/usr/bin/env bash
# Compiles one kernel instantiation to an object with the extension's flags and prints ptxas's resource
# report (registers, spills, shared memory): the quick edit-compile loop for kernel work.
#   scripts/nvcc_one.sh hopper/instantiations/flash_fwd_hdim128_bf16_sm90.cu [out.o]
# NVCC_EXTRA adds flags, e.g. a variant's defines: NVCC_EXTRA="-DFLASH_EXT_TILE_M=192 -DFLASH_EXT_TILE_N=128".
set -euo pipefail
src=$1
out=${2:-/tmp/$(basename "$src" .cu).o}
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
cutlass_inc=$("$py" -c "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))")
nvcc=${CUDA_HOME:-/usr/local/cuda}/bin/nvcc
"$nvcc" -c "$src" -o "$out" -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
  --expt-extended-lambda --use_fast_math -lineinfo -DNDEBUG \
  -DCUTLASS_ENABLE_GDC_FOR_SM90 ${NVCC_EXTRA:-} -Xptxas=-v -Xptxas=--warn-on-spills -I"$root/hopper" -I"$cutlass_inc" \
  2>&1 | grep -v "^ptxas info    : Function properties for\|bytes stack frame, 0 bytes spill stores" || true
echo "object: $out"
