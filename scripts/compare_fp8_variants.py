"""Checks that FP8 variant builds compute what the main build computes (same inputs, max difference of
out and lse), before timing them: python scripts/compare_fp8_variants.py --variants lm"""
import argparse
import importlib
import math

import torch

import flash_ext  # noqa: F401


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--variants", required=True)
    p.add_argument("--headdim", type=int, default=128)
    a = p.parse_args()
    d = a.headdim
    for v in a.variants.split(","):
        importlib.import_module(f"flash_ext._C_{v}")
        op = getattr(torch.ops, f"flash_ext_{v}").fwd
        for (b, sq, sk, h, hk) in ((2, 1000, 1000, 8, 2), (1, 77, 500, 4, 4), (1, 4096, 4096, 16, 16)):
            q = torch.randn(b, sq, h, d, device="cuda").to(torch.float8_e4m3fn)
            k, vv = (torch.randn(b, sk, hk, d, device="cuda").to(torch.float8_e4m3fn) for _ in range(2))
            o0, l0 = torch.ops.flash_ext.fwd(q, k, vv, 1 / math.sqrt(d), False)
            o1, l1 = op(q, k, vv, 1 / math.sqrt(d), False)
            print(f"{v} {(b, sq, sk, h, hk)}: max|out diff| {(o0.float() - o1.float()).abs().max().item():.3e} "
                  f"max|lse diff| {(l0 - l1).abs().max().item():.3e} out mean|.| {o0.float().abs().mean().item():.3f}")


if __name__ == "__main__":
    main()
