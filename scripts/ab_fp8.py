"""Same-process A/B of FP8 forward variants: TFLOP/s of torch.ops.flash_ext.fwd and of each variant build's
fwd (flash_ext._C_<name>) on one shape, interleaved, median of several rounds.

    python scripts/ab_fp8.py --variants nt [--headdim 128] [--seqlen 8192] [--causal]
"""
import argparse
import importlib
import math

import torch
from triton.testing import do_bench


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default="")
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    import flash_ext  # noqa: F401

    ops = {"main": torch.ops.flash_ext.fwd}
    for v in filter(None, a.variants.split(",")):
        importlib.import_module(f"flash_ext._C_{v}")
        ops[v] = getattr(torch.ops, f"flash_ext_{v}").fwd
    b, h, d, s = 16384 // a.seqlen, 2048 // a.headdim, a.headdim, a.seqlen
    q, k, v = (torch.randn(b, s, h, d, device="cuda").to(torch.float8_e4m3fn) for _ in range(3))
    flops = 4 * b * h * s * s * d / (2 if a.causal else 1)
    res = {n: [] for n in ops}
    for _ in range(a.rounds):
        for n, op in ops.items():
            ms = do_bench(lambda: op(q, k, v, 1 / math.sqrt(d), a.causal), warmup=25, rep=100)
            res[n].append(flops / ms / 1e9)
    for n, r in res.items():
        print(f"d{d} {s} {'C' if a.causal else 'N'} {n}: {sorted(r)[len(r) // 2]:.1f} TFLOP/s")


if __name__ == "__main__":
    main()
