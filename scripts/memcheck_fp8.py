"""Runs every compiled FP8 forward kernel in both launch forms (one CTA per tile, persistent:
FLASH_EXT_PERSISTENT=0/1; d256 has only the first) and under the default choice once on small odd shapes (GQA, partial last blocks, causal
rows that see no key, several tiles per CTA) with sliding windows and softcap, with v row-major and
column-major (the d256 kernels for that layout; a row-major copy elsewhere), without reference
computations: the workload for compute-sanitizer.

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/memcheck_fp8.py
"""
import torch

import flash_ext
from compiled_kernels import call_options, compiled_kernels, launch_forms
from flash_ext.fp8 import colmajor

SHAPES = [(1, 129, 257, 4, 2), (2, 300, 50, 2, 1), (3, 700, 700, 16, 4)]  # (batch, sq, sk, nheads, nheads_kv)


def main():
    for d, e4m3, causal in compiled_kernels("fwd", ["e4m3"]):
        for persistent in launch_forms():
            for b, sq, sk, h, hkv in SHAPES:
                q = torch.randn(b, sq, h, d, device="cuda").to(e4m3)
                k, v = (torch.randn(b, sk, hkv, d, device="cuda").to(e4m3) for _ in range(2))
                descale = torch.rand(b, hkv, device="cuda") + 0.5
                for v_layout in (v, colmajor(v)):
                    for options in call_options(causal):
                        out, lse = flash_ext.forward(q, k, v_layout, q_descale=descale, k_descale=descale,
                                                     v_descale=descale, **options)
                        assert torch.isfinite(out).all()
            torch.cuda.synchronize()
            print(f"d{d} e4m3 causal={causal} persistent={persistent}: ran", flush=True)


if __name__ == "__main__":
    main()
