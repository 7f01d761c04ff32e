#!/usr/bin/env bash
# One call on the GPU machine checks everything: run from the repository root with the prebuilt
# flash_ext/_C.abi3.so (and any variant builds) carried along. Writes logs to $OUT (or ./gpu_check_out).
# Every step runs under a time limit, so a hung kernel costs minutes, not the whole call.
#   bash scripts/gpu_check.sh                     smoke checks, all tests, the quick benchmark
#   BENCH=full / BENCH=0                          the default forward grid / no benchmark
#   BWD_BENCH=1                                   also the backward benchmark (d64/d128/d256 at 8k, both masks)
#   AB=v0                                         also scripts/ab_fwd.py against variant build(s) v0,...
#                                                 (AB_TOGGLE=FLASH_EXT_PERSISTENT times both launch forms; AB_SEQLENS)
#   AB_BWD=b0                                     also scripts/ab_bwd.py against variant build(s) b0,...
#                                                 (AB_BWD_HEADDIMS=64,128, AB_BWD_SEQLENS=2048,8192)
#   MEMCHECK=1                                    also compute-sanitizer memcheck over every 16-bit forward kernel
#                                                 (both launch forms), every backward kernel, and both through
#                                                 the varlen ops (valid and invalid offsets), and every
#                                                 decode kernel (scripts/memcheck_decode.py)
#   GRID16=1                                      also the fp16 forward grid and GQA (nheads_kv = nheads / 8) at d128
#   VARLEN=1                                      also the --varlen benchmark (fwd and bwd, d64/128/256, both masks)
#   OVERHEAD=1                                    also scripts/call_overhead.py (host and GPU time of a tiny call)
#   DECODE=1                                      also the --decode benchmark (flash_attn_with_kvcache beside SDPA)
#   FP8=1                                         also the FP8 benchmark (fp8 vs our bf16, 8k, d64/128/256, both masks;
#                                                 d256 again with V column-major),
#                                                 memcheck over every FP8 kernel, and the accuracy table
#                                                 (FP8_VARIANT=off0: a -DFLASH_EXT_FP8_MAX_OFFSET=0 variant build)
#   TESTS=0, PYTEST_ARGS="-k backward"            skip or narrow the tests
#   SMOKE_S, PYTEST_S, BENCH_S                    time limits in seconds (a device call is at most 600 s)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/gpu_check_out}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
status=0
step() {  # step NAME LIMIT_S COMMAND...: run, log to $out/NAME.log, note a failure or a time-out
  local name=$1 limit=$2
  shift 2
  echo "=== $name" | tee -a "$out/summary.txt"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$out/$name.log"
  [ $rc = 0 ] || { status=1; echo "!!! $name exited $rc$([ $rc = 124 ] && echo ' (time limit)')" | tee -a "$out/summary.txt"; }
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,utilization.gpu --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, flash_ext; print('torch', torch.__version__, '| flash_ext build:', flash_ext.build_info())" | tee -a "$out/gpu.txt" || status=1

step smoke_fwd ${SMOKE_S:-90} python3 scripts/smoke_fwd.py
step smoke_bwd ${SMOKE_S:-90} python3 scripts/smoke_bwd.py
step smoke_bwd_det ${SMOKE_S:-90} python3 scripts/smoke_bwd.py --deterministic
if [ "${TESTS:-1}" != 0 ]; then
  step pytest ${PYTEST_S:-300} python3 -m pytest tests -q -p no:cacheprovider ${PYTEST_ARGS:-}
  grep -E "passed|failed" "$out/pytest.log" | tail -n 1 | tee -a "$out/summary.txt"
fi
if [ -n "${AB_BWD:-}" ]; then
  step ab_bwd ${BENCH_S:-240} python3 scripts/ab_bwd.py --variants "$AB_BWD" --headdims ${AB_BWD_HEADDIMS:-64,128} --seqlens ${AB_BWD_SEQLENS:-2048,8192}
fi
if [ -n "${AB:-}" ]; then
  step ab_fwd ${BENCH_S:-240} python3 scripts/ab_fwd.py --variants "$AB" --toggle ${AB_TOGGLE:-none} --headdims 64,128,256 \
    --seqlens ${AB_SEQLENS:-512,1024,2048,4096,8192,16384}
fi
case "${BENCH:-quick}" in
  0) ;;
  full) step bench ${BENCH_S:-240} python3 -m flash_ext.benchmark --mode fwd --out "$out" --no-progress ;;
  *) step bench ${BENCH_S:-240} python3 -m flash_ext.benchmark --quick --mode fwd --out "$out" --no-progress ;;
esac
if [ "${GRID16:-0}" != 0 ]; then
  step bench_fp16 ${BENCH_S:-240} python3 -m flash_ext.benchmark --mode fwd --dtype fp16 --out "$out" --name bench_fp16 --no-progress
  step bench_gqa ${BENCH_S:-240} python3 -m flash_ext.benchmark --mode fwd --headdims 128 --gqa 8 --out "$out" --name bench_gqa \
    --no-progress
fi
if [ "${VARLEN:-0}" != 0 ]; then
  step bench_varlen ${BENCH_S:-240} python3 -m flash_ext.benchmark --varlen --mode both --headdims 64,128,256 --causal both \
    --out "$out" --name bench_varlen --no-progress
fi
if [ "${OVERHEAD:-0}" != 0 ]; then
  step call_overhead ${BENCH_S:-240} python3 scripts/call_overhead.py
fi
if [ "${BWD_BENCH:-0}" != 0 ]; then
  step bench_bwd ${BENCH_S:-240} python3 -m flash_ext.benchmark --mode bwd --headdims 64,128,256 --seqlens 8k --causal both \
    --out "$out" --name bench_bwd --no-progress
fi
if [ "${MEMCHECK:-0}" != 0 ]; then
  step memcheck_fwd ${MEMCHECK_S:-240} compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/memcheck_fwd.py
  step memcheck_bwd ${MEMCHECK_S:-240} compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/memcheck_bwd.py
  step memcheck_varlen ${MEMCHECK_S:-240} compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/memcheck_varlen.py
  step memcheck_decode ${MEMCHECK_S:-240} compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/memcheck_decode.py
fi
if [ "${DECODE:-0}" != 0 ]; then
  step bench_decode ${BENCH_S:-240} python3 -m flash_ext.benchmark --decode --out "$out" --name bench_decode --no-progress
fi
if [ "${FP8:-0}" != 0 ]; then
  step bench_fp8 ${BENCH_S:-240} python3 -m flash_ext.benchmark --dtype fp8 --headdims 64,128,256 --seqlens 8k --causal both \
    --out "$out" --name bench_fp8 --no-progress
  step bench_fp8_v_colmajor ${BENCH_S:-240} python3 -m flash_ext.benchmark --dtype fp8 --fp8-v-colmajor --headdims 256 \
    --seqlens 8k --causal both --out "$out" --name bench_fp8_v_colmajor --no-progress
  step memcheck_fp8 ${MEMCHECK_S:-240} compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/memcheck_fp8.py
  step fp8_accuracy ${BENCH_S:-240} python3 scripts/fp8_accuracy.py ${FP8_VARIANT:+--variant $FP8_VARIANT} \
    --out "$out/fp8_accuracy.md"
fi
# The device tool returns at most 8 files: everything but the summary travels in one archive.
archive=$(mktemp /tmp/gpu_check_logs.XXXXXX.tgz)
(cd "$out" && tar czf "$archive" --exclude=summary.txt . && find . -type f ! -name summary.txt -delete && mv "$archive" logs.tgz)
exit $status
