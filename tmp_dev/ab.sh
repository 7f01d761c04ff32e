export PYTHONPATH=$PWD
python scripts/ab_fwd.py --variants swc --toggle none --headdims 256 --seqlens 512,1024,2048,4096,8192,16384 --causal 1 2>&1 | grep -v kernels
