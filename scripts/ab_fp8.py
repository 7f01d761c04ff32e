"""Same-process A/B of FP8 forward variants: TFLOP/s of torch.ops.flash_ext.fwd and of each variant build's
fwd (flash_ext._C_<name>), interleaved, median of several rounds. Each variant's output is compared with the
main build's (max abs difference printed; 0 = bitwise equal).

    python scripts/ab_fp8.py --variants nt [--headdims 64,128] [--seqlens 2048,8192] [--causal 0,1]
        [--toggle FLASH_EXT_PINGPONG]
"""
import argparse
import math
import os

import torch
from triton.testing import do_bench

from flash_ext.fp8 import colmajor
from variant_builds import build_ops


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default="")
    p.add_argument("--headdims", "--headdim", default="128")
    p.add_argument("--seqlens", "--seqlen", default="8192")
    p.add_argument("--causal", default="0", help="comma list of 0/1")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--toggle", default="none", choices=("none", "FLASH_EXT_PINGPONG", "FLASH_EXT_PERSISTENT"),
                   help="a run-time switch timed on and off for every build")
    p.add_argument("--v-seq-contiguous", default="",
                   help="comma list of variant builds that take v with its sequence dim contiguous (the same values)")
    a = p.parse_args()
    seq_contiguous_v = set(filter(None, a.v_seq_contiguous.split(",")))
    ops = {name: ns.fwd for name, ns in build_ops(a.variants).items()}
    settings = (None,) if a.toggle == "none" else ("1", "0")
    for d in map(int, a.headdims.split(",")):
        for causal in (c == "1" for c in a.causal.split(",")):
            for s in map(int, a.seqlens.split(",")):
                b, h = 16384 // s, 2048 // d
                q, k, v = (torch.randn(b, s, h, d, device="cuda").to(torch.float8_e4m3fn) for _ in range(3))
                v_by_build = {n: colmajor(v) if n in seq_contiguous_v else v for n in ops}
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                runs = [(n, on) for n in ops for on in settings]
                res = {r: [] for r in runs}
                out_main = None
                diffs = {}
                for name, on in runs:
                    if on is not None:
                        os.environ[a.toggle] = on
                    out = ops[name](q, k, v_by_build[name], 1 / math.sqrt(d), causal)[0]
                    if out_main is None:
                        out_main = out.float()
                    diffs[(name, on)] = (out.float() - out_main).abs().max().item()
                for _ in range(a.rounds):
                    for name, on in runs:
                        if on is not None:
                            os.environ[a.toggle] = on
                        ms = do_bench(lambda: ops[name](q, k, v_by_build[name], 1 / math.sqrt(d), causal), warmup=25, rep=100)
                        res[(name, on)].append(flops / ms / 1e9)
                os.environ.pop(a.toggle, None)
                row = f"d{d} {s} {'C' if causal else 'N'}:"
                for (name, on), r in res.items():
                    tag = name if on is None else f"{name}/{a.toggle[10:].lower()}={on}"
                    row += f"  {tag} {sorted(r)[len(r) // 2]:.1f} (diff {diffs[(name, on)]:.1e})"
                print(row, flush=True)


if __name__ == "__main__":
    main()
