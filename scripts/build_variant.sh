#!/usr/bin/env bash
# Builds a variant of the extension that loads beside the main build (flash_ext/_C_<name>.abi3.so, ops in
# torch.ops.flash_ext_<name>), for A/B measurements in one process (scripts/ab_fwd.py).
#   FLASH_EXT_HEADDIMS=128 FLASH_EXT_DTYPES=bf16 FLASH_EXT_CAUSAL=0 \
#     scripts/build_variant.sh n176 -DFLASH_EXT_TILE_M=128 -DFLASH_EXT_TILE_N=176
set -euo pipefail
name=$1
shift
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
FLASH_EXT_VARIANT=$name FLASH_EXT_VARIANT_DEFINES="$*" "${PYTHON:-.venv/bin/python}" setup.py build_ext --inplace \
  --build-temp "build/variant_$name" --build-lib "build/variant_lib_$name"
ls -la "flash_ext/_C_$name".*so
