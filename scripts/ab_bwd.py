"""A/B timing of backward kernel variants in one process, beside SDPA's cuDNN and flash backwards.

Variants: the main build (torch.ops.flash_ext) and side-by-side builds (scripts/build_variant.sh,
torch.ops.flash_ext_<name>); the main build also in deterministic mode. Each variant's gradients are
compared with the main build's before timing (max abs difference printed; they must agree to rounding).

    PYTHONPATH=$PWD python3 scripts/ab_bwd.py --variants b0 --headdims 64,128 --seqlens 2048,8192
"""
import argparse
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_ext  # noqa: F401  (loads the main build's ops)
from variant_builds import build_ops


def timed(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="", help="comma list of variant build names")
    parser.add_argument("--headdims", default="64,128")
    parser.add_argument("--seqlens", default="2048,8192")
    parser.add_argument("--causal", default="0,1")
    parser.add_argument("--diagnostic", default="", help="comma list of variants timed even though their gradients "
                        "differ (builds with work compiled out, to bound what it costs)")
    args = parser.parse_args()
    ops = build_ops(args.variants)
    columns = [(n, False) for n in ops] + [("main", True)]
    header = f"{'shape':<18}" + "".join(f"{n + ('/det' if det else ''):>12}" for n, det in columns)
    print(header + f"{'cuDNN':>10}{'FA2':>10}{'main/cuDNN':>12}{'det/main':>10}")
    for d in map(int, args.headdims.split(",")):
        for causal in (c == "1" for c in args.causal.split(",")):
            for s in map(int, args.seqlens.split(",")):
                b, h = 16384 // s, 2048 // d
                q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                scale = 1 / math.sqrt(d)
                flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
                out, lse = torch.ops.flash_ext.fwd(q, k, v, scale, causal)
                reference = torch.ops.flash_ext.bwd(dout, q, k, v, out, lse, None, scale, causal, True)
                row = f"d{d} {'C' if causal else 'N'} s{s:<10}"
                tflops = {}
                for name, det in columns:
                    ns = ops[name]
                    args_ = (dout, q, k, v, out, lse, None, scale, causal, det)
                    try:
                        grads = ns.bwd(*args_)
                    except RuntimeError as e:  # a variant built without this kernel
                        row += f"{'n/a':>12}"
                        print(f"    {name}: {str(e).splitlines()[0][:120]}")
                        continue
                    diff = max((g.float() - r.float()).abs().max().item() for g, r in zip(grads, reference))
                    if not diff < 0.1 and name not in args.diagnostic.split(","):
                        row += f"{'DIFF':>12}"
                        print(f"    {name} det={det}: max |grad - main det| = {diff:.3g}")
                        continue
                    tflops[(name, det)] = flops / timed(lambda: ns.bwd(*args_)) / 1e9
                    row += f"{tflops[(name, det)]:>12.1f}"
                sdpa = {}
                for label, backend in (("cuDNN", SDPBackend.CUDNN_ATTENTION), ("FA2", SDPBackend.FLASH_ATTENTION)):
                    leaves = [t.transpose(1, 2).detach().requires_grad_(True) for t in (q, k, v)]
                    with sdpa_kernel(backend):
                        o = F.scaled_dot_product_attention(*leaves, is_causal=causal)
                        g = dout.transpose(1, 2)
                        ms = timed(lambda: torch.autograd.grad(o, leaves, g, retain_graph=True))
                    sdpa[label] = flops / ms / 1e9
                    row += f"{sdpa[label]:>10.1f}"
                main_nd = tflops.get(("main", False), float("nan"))
                row += f"{main_nd / sdpa['cuDNN']:>11.2f}x{tflops.get(('main', True), float('nan')) / main_nd:>9.2f}x"
                print(row, flush=True)


if __name__ == "__main__":
    main()
