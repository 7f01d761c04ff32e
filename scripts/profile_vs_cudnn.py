"""One forward call of one shape, ours or SDPA's cuDNN backend, inside cudaProfilerStart/Stop, for Nsight
Compute with `--profile-from-start off` (warm-up calls outside the range, so only the measured call's kernels,
cuDNN's memset included, are profiled):

    ncu --clock-control none --profile-from-start off --section SpeedOfLight ... \
        python3 scripts/profile_vs_cudnn.py --impl cudnn --headdim 64 --seqlen 512 [--causal]
Inputs as the benchmark's: (b, s, h, d) tensors, given to SDPA as transposed views; b * seqlen = 16k and
hidden 2048 unless --batch / --heads say otherwise.
"""
import argparse
import math

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_ext


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=("ours", "cudnn"), required=True)
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--batch", type=int, default=0, help="0: 16k tokens / seqlen")
    parser.add_argument("--heads", type=int, default=0, help="0: 2048 / headdim")
    args = parser.parse_args()
    d, s = args.headdim, args.seqlen
    b, h = args.batch or 16384 // s, args.heads or 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    scale = 1 / math.sqrt(d)
    if args.impl == "ours":
        def call():
            return flash_ext.forward(q, k, v, softmax_scale=scale, causal=args.causal)
    else:
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def call():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal, scale=scale)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
