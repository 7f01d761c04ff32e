#!/usr/bin/env bash
# One call on the GPU machine checks everything: run from the repository root with the prebuilt
# flash_ext/_C.abi3.so carried along. Writes logs to $OUT (or ./gpu_check_out).
#   bash scripts/gpu_check.sh            GPU + CPU tests, then the quick benchmark
#   BENCH=full bash scripts/gpu_check.sh the default benchmark grid instead
#   TESTS=0 / BENCH=0                    skip a part
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/gpu_check_out}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
status=0

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,utilization.gpu --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, flash_ext; print('torch', torch.__version__, '| flash_ext build:', flash_ext.build_info())" | tee -a "$out/gpu.txt" || status=1

if [ "${TESTS:-1}" != 0 ]; then
  python3 -m pytest tests -q -x -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$out/test.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi

case "${BENCH:-quick}" in
  0) ;;
  full) python3 -m flash_ext.benchmark --out "$out" --no-progress 2>&1 | tee "$out/bench.log"; [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
  *) python3 -m flash_ext.benchmark --quick --out "$out" --no-progress 2>&1 | tee "$out/bench.log"; [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
esac
exit $status
