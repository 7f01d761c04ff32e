"""Quick backward smoke check on the GPU, with diagnostics: per (head dim, dtype, causal) the max error of
dq, dk, dv against float64 autograd of the reference, the ratio to PyTorch's own low-precision error and,
on a failure, where the worst element sits and how many elements are off. The first thing a device call
runs after a backward kernel change (seconds), before the full test suite.

    PYTHONPATH=$PWD python3 scripts/smoke_bwd.py [--deterministic]
"""
import argparse
import sys
import time

import torch

import flash_ext
from flash_ext.reference import attention_autograd

SHAPES = [(1, 128, 128, 2, 2), (2, 129, 257, 4, 2), (1, 1000, 777, 6, 1), (1, 300, 50, 2, 1)]  # (b, sq, sk, h, h_kv)


def grads(q, k, v, dout, causal, upcast):
    dtype = torch.float64 if upcast else q.dtype
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    out, _ = attention_autograd(*leaves, causal=causal, upcast=upcast)
    return torch.autograd.grad(out, leaves, dout.to(dtype))


def describe(name, got, ref, tol):
    diff = (got.double() - ref).abs()
    flat = int(diff.argmax())
    idx = list(torch.unravel_index(torch.tensor(flat), diff.shape))
    bad = (diff > tol).sum().item()
    return (f"    {name}: worst at (b, s, h, d) = {tuple(int(i) for i in idx)} got {got.flatten()[flat].item():.4g} "
            f"ref {ref.flatten()[flat].item():.4g}; {bad} of {diff.numel()} elements off; NaN: {got.isnan().sum().item()}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--deterministic", action="store_true")
    args = parser.parse_args()
    print(flash_ext.build_info(), flush=True)
    failures = 0
    for d in flash_ext.kernel_table.HEADDIMS_BY_DIRECTION["bwd"]:
        for dtype in (torch.bfloat16, torch.float16):
            for causal in (False, True):
                if not flash_ext.has_kernel("bwd", d, dtype, causal):
                    continue
                t0 = time.time()
                worst = 0.0
                for b, sq, sk, h, hkv in SHAPES:
                    q, k, v, dout = (torch.randn(b, s, hh, d, device="cuda", dtype=dtype)
                                     for s, hh in ((sq, h), (sk, hkv), (sk, hkv), (sq, h)))
                    out, lse = flash_ext.forward(q, k, v, causal=causal)
                    got = flash_ext.backward(dout, q, k, v, out, lse, causal=causal, deterministic=args.deterministic)
                    torch.cuda.synchronize()
                    ref = grads(q, k, v, dout, causal, upcast=True)
                    low = grads(q, k, v, dout, causal, upcast=False)
                    lines = []
                    for name, g, r, lo in zip(("dq", "dk", "dv"), got, ref, low):
                        err = (g.double() - r).abs().max().item()
                        err_pt = (lo.double() - r).abs().max().item()
                        tol = 2 * err_pt + 1e-3
                        worst = max(worst, err / max(err_pt, 1e-6))
                        if not err <= tol:
                            lines.append(f"  FAIL d{d} {dtype} causal={causal} shape={(b, sq, sk, h, hkv)} {name} "
                                         f"err={err:.3e} pt={err_pt:.3e}")
                            lines.append(describe(name, g, r, tol))
                    failures += len(lines) // 2
                    for line in lines:
                        print(line, flush=True)
                print(f"d{d:<3} {str(dtype):<15} causal={causal!s:<5} worst ratio to pt={worst:.2f} ({time.time() - t0:.1f}s)",
                      flush=True)
    print("smoke bwd:", "FAILED" if failures else "ok", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
