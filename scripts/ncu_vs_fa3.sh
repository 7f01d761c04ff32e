#!/usr/bin/env bash
# Nsight Compute on the backward's main kernel, ours against FlashAttention-3's (flash_attn_interface on
# PYTHONPATH), one call each; run on the GPU machine from the repository root. SHAPES: "d s [--causal]" specs
# separated by commas (default "128 8192"). Writes $OUT/ncu_bwd_<shape>_<impl>.txt (the details page) and
# $OUT/ncu_bwd_<shape>_<impl>_stalls.txt (scripts/ncu_top_stalls.py over the source page).
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || ls /usr/local/cuda/bin/ncu)
echo "ncu: $NCU"
IFS=, read -ra specs <<< "${SHAPES:-128 8192}"
for spec in "${specs[@]}"; do
  set -- $spec
  for impl in ${IMPLS:-ours fa3}; do
    name=d$1_s$2${3:+_c}_$impl
    rep=$OUT/ncu_bwd_$name
    timeout 240 $NCU --clock-control none --set full --import-source yes --launch-skip 1 -c 1 --kernel-name-base demangled -k "regex:BwdKernel|FlashAttnBwd" \
      -o $rep python3 scripts/profile_bwd.py --impl $impl --headdim $1 --seqlen $2 $3 > $rep.log 2>&1
    echo "$name rc=$?"
    $NCU -i $rep.ncu-rep --page details > $rep.txt 2>&1
    $NCU -i $rep.ncu-rep --page source --csv --print-source sass > $rep.csv 2>/dev/null &&
      python3 scripts/ncu_top_stalls.py $rep.csv --top 30 > ${rep}_stalls.txt 2>&1
    rm -f $rep.csv $rep.ncu-rep
    grep -E "Duration|Registers Per|Grid Size|Dynamic Shared|Compute \(SM\) Thr|Memory Thr|L2 Cache Thr|DRAM Thr|Issue Slots Busy|Executed Ipc A|Warp Cycles Per Issued" $rep.txt | head -20
  done
done
