"""A variant build's forward against the main build's, bit for bit, where the variant should change how the
work is scheduled but not its arithmetic (e.g. chained tiles): dense calls at odd lengths, GQA, both masks,
sliding windows (tiles with no visible key included), softcap, and varlen batches of mixed lengths, each in
both launch forms (FLASH_EXT_PERSISTENT=0/1). Outputs poisoned with NaN first (tests/gpu_helpers.py).

    PYTHONPATH=$PWD python3 scripts/check_bitwise.py --variant chain --headdims 64,128 [--dtypes bf16,fp16] [--causal 1]

Prints each case that differs (max |diff| of out and LSE) and a summary; exits 1 if any case differs.
"""
import argparse
import math
import os
import sys
from pathlib import Path

import torch

from variant_builds import build_ops

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from gpu_helpers import poison_allocator  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# (batch, seqlen_q, seqlen_k, nheads, nheads_kv)
DENSE = [(2, 1, 1, 4, 4), (1, 7, 7, 2, 1), (2, 113, 113, 4, 2), (1, 1000, 1000, 8, 2), (1, 2049, 2049, 2, 2),
         (2, 113, 1000, 4, 4), (1, 1000, 113, 4, 1), (4, 512, 512, 16, 16), (2, 1024, 1024, 32, 8)]
# (window_left, window_right), run by the banded (causal) kernels: with seqlen_q > seqlen_k some query blocks
# see no key. Causal calls take right = 0.
WINDOWS = {False: [(-1, -1), (300, 50), (0, 0)], True: [(-1, -1), (64, 0), (1, 0)]}
SOFTCAPS = [0.0, 15.0]


def run_dense(fwd, q, k, v, scale, causal, window, softcap):
    out, lse = fwd(q, k, v, scale, causal, None, None, None, window[0], window[1], softcap)
    torch.cuda.synchronize()
    return out, lse


def run_varlen(fwd_varlen, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, softcap):
    out, lse = fwd_varlen(q, k, v, cu_q, cu_k, None, None, max_q, max_k, scale, causal, window[0], window[1], softcap)
    torch.cuda.synchronize()
    return out, lse


def differs(a, b):
    """None when bitwise equal (NaNs in the same places), else the max |difference|."""
    if torch.equal(a.isnan(), b.isnan()) and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)):
        return None
    return (a.float() - b.float()).abs().nan_to_num(float("inf")).max().item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", required=True)
    parser.add_argument("--headdims", default="64,128")
    parser.add_argument("--dtypes", default="bf16")
    parser.add_argument("--causal", default="0,1", help="the masks the variant compiled: 0 (non-causal), 1 (causal)")
    args = parser.parse_args()
    ops = build_ops(args.variant)
    base, var = ops["main"], ops[args.variant]
    cases = failures = 0
    gen = torch.Generator(device="cuda").manual_seed(0)

    def compare(label, call, out_shape, lse_shape, dtype):
        nonlocal cases, failures
        results = []
        for op in (base, var):
            poison_allocator((out_shape, dtype), (lse_shape, torch.float32))
            results.append(call(op))
        cases += 1
        d_out, d_lse = differs(results[0][0], results[1][0]), differs(results[0][1], results[1][1])
        if d_out is not None or d_lse is not None:
            failures += 1
            print(f"DIFFERS {label}: out {d_out}, lse {d_lse}")

    for persistent in ("0", "1"):
        os.environ["FLASH_EXT_PERSISTENT"] = persistent
        for dname in args.dtypes.split(","):
            dtype = DTYPES[dname]
            for d in map(int, args.headdims.split(",")):
                scale = 1 / math.sqrt(d)
                for causal in (c == "1" for c in args.causal.split(",")):
                    for b, sq, sk, h, hk in DENSE:
                        q = torch.randn(b, sq, h, d, device="cuda", generator=gen).to(dtype)
                        k = torch.randn(b, sk, hk, d, device="cuda", generator=gen).to(dtype)
                        v = torch.randn(b, sk, hk, d, device="cuda", generator=gen).to(dtype)
                        for window in WINDOWS[causal]:
                            for softcap in SOFTCAPS:
                                label = (f"persistent={persistent} {dname} d{d} causal={causal} {(b, sq, sk, h, hk)} "
                                         f"window={window} softcap={softcap}")
                                compare(label, lambda op: run_dense(op.fwd, q, k, v, scale, causal, window, softcap),
                                        (b, sq, h, d), (b, h, sq), dtype)
                    # varlen: mixed lengths, one of them 0 keys' worth of queries
                    lens_q = [1, 700, 129, 2049, 0, 333]
                    lens_k = [5, 700, 1000, 2049, 17, 128]
                    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device="cuda")
                    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device="cuda")
                    h, hk = 8, 2
                    q = torch.randn(sum(lens_q), h, d, device="cuda", generator=gen).to(dtype)
                    k = torch.randn(sum(lens_k), hk, d, device="cuda", generator=gen).to(dtype)
                    v = torch.randn(sum(lens_k), hk, d, device="cuda", generator=gen).to(dtype)
                    for window in WINDOWS[causal]:
                        label = f"persistent={persistent} {dname} d{d} causal={causal} varlen window={window}"
                        compare(label, lambda op: run_varlen(op.fwd_varlen, q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                                             scale, causal, window, 0.0),
                                (sum(lens_q), h, d), (h, sum(lens_q)), dtype)
    print(f"{args.variant} against main: {cases - failures}/{cases} cases bitwise equal")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
