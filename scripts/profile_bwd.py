"""One backward call of one shape, for Nsight Compute (`ncu -k regex:BwdKernel ...`): the forward and a
warm-up backward run first, then the profiled call. `--impl fa3` runs FlashAttention-3's backward instead
(flash_attn_interface on PYTHONPATH; its main kernel matches `regex:flash_bwd|FlashAttnBwd`).

    PYTHONPATH=$PWD python3 scripts/profile_bwd.py --headdim 256 --seqlen 8192 [--causal] [--impl fa3]
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
    parser.add_argument("--impl", choices=("ours", "fa3"), default="ours")
    args = parser.parse_args()
    d, s = args.headdim, args.seqlen
    b, h = 16384 // s, 2048 // d
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = 1 / math.sqrt(d)
    if args.impl == "fa3":
        import flash_attn_interface

        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = flash_attn_interface.flash_attn_func(q, k, v, softmax_scale=scale, causal=args.causal)
        out = out[0] if isinstance(out, tuple) else out
        for _ in range(2):
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    else:
        out, lse = torch.ops.flash_ext.fwd(q, k, v, scale, args.causal)
        for _ in range(2):
            torch.ops.flash_ext.bwd(dout, q, k, v, out, lse, None, scale, args.causal, False)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
