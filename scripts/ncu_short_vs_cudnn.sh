#!/usr/bin/env bash
# Nsight Compute on one forward call of ours and of SDPA's cuDNN backend at short shapes (perf-notes section
# 44); run on the GPU machine from the repository root. Writes $OUT/ncu_<shape>_<impl>.txt.
export PYTHONPATH=$PWD
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || ls /usr/local/cuda/bin/ncu)
echo "ncu: $NCU"
for spec in "64 512" "128 512" "256 512" "64 512 --causal"; do
  set -- $spec
  for impl in ours cudnn; do
    name=d$1_s$2${3:+_c}_$impl
    timeout 120 $NCU --clock-control none --profile-from-start off --set full --import-source no \
      python3 scripts/profile_fwd.py --impl $impl --headdim $1 --seqlen $2 $3 > $OUT/ncu_$name.txt 2>&1
    echo "$name rc=$?"; grep -E "^\s+[a-zA-Z_0-9:<>]+.*\(|Duration|Registers Per|Grid Size|Block Size|Dynamic Shared|Achieved Occ|Compute \(SM\) Thr|Memory Thr|DRAM Thr|Issue Slots Busy|Theoretical Occ" $OUT/ncu_$name.txt | head -40
  done
done
