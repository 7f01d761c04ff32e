#!/usr/bin/env bash
# Nsight Compute on the forward's (PASS=fwd) or the backward's (PASS=bwd, default) main kernel, ours against
# FlashAttention-3's (flash_attn_interface on PYTHONPATH), one call each; run on the GPU machine from the
# repository root. SHAPES: "d s [--causal]" specs separated by commas (default "128 8192"). Writes
# $OUT/ncu_<pass>_<shape>_<impl>.txt (the details page) and $OUT/ncu_<pass>_<shape>_<impl>_stalls.txt
# (scripts/ncu_top_stalls.py over the source page).
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || ls /usr/local/cuda/bin/ncu)
echo "ncu: $NCU"
pass=${PASS:-bwd}
if [ "$pass" = fwd ]; then
  select=(--profile-from-start off -k "regex:FwdKernel|FlashAttnFwd"); script=scripts/profile_fwd.py
else
  select=(--launch-skip 1 -k "regex:BwdKernel|FlashAttnBwd"); script=scripts/profile_bwd.py
fi
IFS=, read -ra specs <<< "${SHAPES:-128 8192}"
for spec in "${specs[@]}"; do
  set -- $spec
  for impl in ${IMPLS:-ours fa3}; do
    name=d$1_s$2${3:+_c}_$impl
    rep=$OUT/ncu_${pass}_$name
    timeout 240 $NCU --clock-control none --set full --import-source yes -c 1 --kernel-name-base demangled "${select[@]}" \
      -o $rep python3 $script --impl $impl --headdim $1 --seqlen $2 $3 > $rep.log 2>&1
    echo "$name rc=$?"
    $NCU -i $rep.ncu-rep --page details > $rep.txt 2>&1
    $NCU -i $rep.ncu-rep --page source --csv --print-source sass > $rep.csv 2>/dev/null &&
      python3 scripts/ncu_top_stalls.py $rep.csv --top 30 > ${rep}_stalls.txt 2>&1
    rm -f $rep.csv $rep.ncu-rep
    grep -E "Duration|Registers Per|Grid Size|Dynamic Shared|Compute \(SM\) Thr|Memory Thr|L2 Cache Thr|DRAM Thr|Issue Slots Busy|Executed Ipc A|Warp Cycles Per Issued" $rep.txt | head -20
  done
done
