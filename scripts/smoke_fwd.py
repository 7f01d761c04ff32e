"""Quick forward smoke check on the GPU: one line per (head dim, dtype, causal) with the max error against
the float64 reference and against PyTorch's own low-precision attention. Meant as the first thing a
device call runs after a kernel change (seconds), before the full test suite.

    PYTHONPATH=$PWD python3 scripts/smoke_fwd.py
"""
import sys
import time

import torch

import flash_ext
from flash_ext.reference import attention_lowp, attention_ref

SHAPES = [(2, 1, 1, 4, 4), (2, 129, 257, 4, 2), (1, 1000, 777, 6, 1)]  # (batch, sq, sk, h, h_kv)


def main():
    print(flash_ext.build_info(), flush=True)
    failures = 0
    for d in flash_ext.KERNEL_HEADDIMS:
        for dtype in (torch.bfloat16, torch.float16):
            for causal in (False, True):
                if not flash_ext.has_kernel("fwd", d, dtype, causal):
                    continue
                worst = 0.0
                worst_ratio = 0.0
                t0 = time.time()
                for b, sq, sk, h, hkv in SHAPES:
                    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
                    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
                    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
                    out, lse = flash_ext.forward(q, k, v, causal=causal)
                    ref, lse_ref = attention_ref(q, k, v, causal=causal)
                    pt = attention_lowp(q, k, v, causal=causal)
                    err = (out.double() - ref).abs().max().item()
                    err_pt = (pt.double() - ref).abs().max().item()
                    fin = torch.isfinite(lse_ref)
                    lse_err = (lse.double()[fin] - lse_ref[fin]).abs().max().item() if fin.any() else 0.0
                    inf_ok = torch.equal(torch.isfinite(lse), fin)
                    worst = max(worst, err)
                    worst_ratio = max(worst_ratio, err / max(err_pt, 1e-6))
                    ok = err == err and err <= 2 * err_pt + 1e-3 and lse_err < 1e-3 and inf_ok
                    if not ok:
                        failures += 1
                        print(f"  FAIL d{d} {dtype} causal={causal} shape={(b, sq, sk, h, hkv)} err={err:.3e} "
                              f"pt={err_pt:.3e} lse_err={lse_err:.3e} inf_ok={inf_ok}", flush=True)
                torch.cuda.synchronize()
                print(f"d{d:<3} {str(dtype):<15} causal={causal!s:<5} max_err={worst:.3e} ratio_to_pt={worst_ratio:.2f} "
                      f"({time.time() - t0:.1f}s)", flush=True)
    print("smoke:", "FAILED" if failures else "ok", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
