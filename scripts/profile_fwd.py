"""Forward calls of one shape, for Nsight Compute: ours (default), SDPA's cuDNN backend (--impl cudnn) or
FlashAttention-3's (--impl fa3: flash_attn_interface on PYTHONPATH; its kernel matches `regex:FlashAttnFwd`),
three warm-up calls, then the one to profile, inside cudaProfilerStart/Stop:

    ncu --profile-from-start off ... python3 scripts/profile_fwd.py --headdim 256 --seqlen 512 [--causal] \
        [--softcap 30] [--batch B --heads H] [--impl cudnn]
(or, without --profile-from-start off: `--launch-skip 3 --launch-count 1 -k regex:FwdKernel`).
Inputs as the benchmark's: (b, s, h, d) tensors, given to SDPA as transposed views; b * seqlen = 16k and
hidden 2048, as the default grid, unless --batch / --heads say otherwise.
"""
import argparse
import math

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_ext


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=("ours", "cudnn", "fa3"), default="ours")
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--softcap", type=float, default=0.0, help="ours only (SDPA has no softcap)")
    parser.add_argument("--batch", type=int, default=0, help="0: 16k tokens / seqlen")
    parser.add_argument("--heads", type=int, default=0, help="0: 2048 / headdim")
    args = parser.parse_args()
    d, s = args.headdim, args.seqlen
    b, h = args.batch or 16384 // s, args.heads or 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    scale = 1 / math.sqrt(d)
    if args.impl == "ours":
        def call():
            return flash_ext.forward(q, k, v, softmax_scale=scale, causal=args.causal, softcap=args.softcap)
    elif args.impl == "fa3":
        import flash_attn_interface

        def call():
            return flash_attn_interface.flash_attn_func(q, k, v, softmax_scale=scale, causal=args.causal)
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
