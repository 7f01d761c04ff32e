"""Runs every compiled 16-bit forward kernel in every launch form (one CTA per tile, persistent, the mid-length
tiles where a configuration has them: FLASH_EXT_PERSISTENT=0/1/2) and under the default choice (small grids: one CTA per tile on the persistent
form's tiles) on small odd shapes (GQA, partial last blocks, causal rows that see no key,
many tiles per persistent CTA) with every mask and score option the kernel runs (sliding windows, softcap),
without reference computations: the workload for compute-sanitizer.

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/memcheck_fwd.py [--headdims 256]
"""
import argparse

import torch

import flash_ext
from compiled_kernels import call_options, compiled_kernels, launch_forms

SHAPES = [(1, 129, 257, 4, 2), (2, 300, 50, 2, 1), (3, 700, 700, 16, 4)]  # (batch, sq, sk, nheads, nheads_kv)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--headdims", default="", help="comma list: only these kernels' head dims (default: all)")
    headdims = {int(h) for h in parser.parse_args().headdims.split(",") if h}
    for d, dtype, causal in compiled_kernels("fwd", ["fp16", "bf16"]):
        if headdims and d not in headdims:
            continue
        for persistent in launch_forms():
            for b, sq, sk, h, hkv in SHAPES:
                q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
                k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype) for _ in range(2))
                for options in call_options(causal):
                    out, lse = flash_ext.forward(q, k, v, **options)
                    assert torch.isfinite(out).all()
            torch.cuda.synchronize()
            print(f"d{d} {dtype} causal={causal} persistent={persistent}: ran", flush=True)


if __name__ == "__main__":
    main()
