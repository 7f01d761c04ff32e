#!/usr/bin/env bash
# For every compiled kernel object: count GMMA (tensor-core HGMMA for 16-bit, QGMMA for FP8) and LDL/STL
# (local memory: spills or dynamically indexed register arrays) instructions in the SASS. A main kernel
# must show GMMA; LDL/STL are flagged (the FP8 kernels keep some: docs/perf-notes.md section 14).
#   scripts/sass_check.sh [build/temp.linux-x86_64-cpython-311]
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-$(ls -d "$root"/build/temp.*/hopper/instantiations 2>/dev/null | head -1)}
[ -d "$dir/hopper/instantiations" ] && dir=$dir/hopper/instantiations
cuobjdump=$(command -v cuobjdump || ls "$root"/.venv/lib/python3*/site-packages/triton/backends/nvidia/bin/cuobjdump 2>/dev/null | head -1)
[ -n "$cuobjdump" ] || { echo "no cuobjdump (CUDA toolkit or triton's copy)" >&2; exit 2; }
export PATH=$(dirname "$cuobjdump"):$PATH  # cuobjdump -sass runs nvdisasm (triton ships both side by side)
status=0
for obj in "$dir"/*.o; do
  sass=$("$cuobjdump" -sass "$obj" 2>/dev/null)
  hgmma=$(grep -cE "HGMMA|QGMMA" <<<"$sass")
  local_mem=$(grep -cE "\b(LDL|STL)\b" <<<"$sass")
  printf '%-45s GMMA %4d  LDL/STL %3d\n' "$(basename "$obj")" "$hgmma" "$local_mem"
  if [ "$hgmma" = 0 ] || [ "$local_mem" != 0 ]; then status=1; fi
done
exit $status
