"""Forward calls of one shape, for Nsight Compute: two warm-up calls, then the one to profile
(`ncu --launch-skip 2 --launch-count 1 -k regex:FwdKernel ...`).

    PYTHONPATH=$PWD python3 scripts/profile_fwd.py --headdim 256 --seqlen 512 [--causal] [--softcap 30]
        [--batch B --heads H]
b * seqlen = 16k and hidden 2048, as the benchmark's default grid, unless --batch / --heads say otherwise.
"""
import argparse
import math

import torch

import flash_ext


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--softcap", type=float, default=0.0)
    parser.add_argument("--batch", type=int, default=0, help="0: 16k tokens / seqlen")
    parser.add_argument("--heads", type=int, default=0, help="0: 2048 / headdim")
    args = parser.parse_args()
    d, s = args.headdim, args.seqlen
    b, h = args.batch or 16384 // s, args.heads or 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for _ in range(3):
        flash_ext.forward(q, k, v, softmax_scale=1 / math.sqrt(d), causal=args.causal, softcap=args.softcap)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
