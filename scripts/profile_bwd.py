"""One backward call of one shape, for Nsight Compute (`ncu -k regex:BwdKernel ...`): the forward and a
warm-up backward run first, then the profiled call.

    PYTHONPATH=$PWD python3 scripts/profile_bwd.py --headdim 256 --seqlen 8192 [--causal]
"""
import argparse
import math

import torch

import flash_ext  # noqa: F401  (loads the ops)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    d, s = args.headdim, args.seqlen
    b, h = 16384 // s, 2048 // d
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = 1 / math.sqrt(d)
    out, lse = torch.ops.flash_ext.fwd(q, k, v, scale, args.causal)
    for _ in range(2):
        torch.ops.flash_ext.bwd(dout, q, k, v, out, lse, None, scale, args.causal, False)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
