"""Correctness of variant builds before they are timed: each variant's forward (and the main build's, for
reference) on odd lengths, GQA, both masks, every head dim and dtype the variant compiled, against the
float64 reference with the tests' rules (tests/gpu_helpers.py): 16-bit out within 2x the error of
PyTorch's attention in that dtype plus rounding noise; FP8 out within 2x the error of the FP8 emulation
(flash_ext.reference.attention_fp8_emulation); LSE checked; outputs poisoned with NaN first.

    PYTHONPATH=$PWD python3 scripts/check_variants.py --variants sb,odir \
        [--settings 'FLASH_EXT_SHORT_BANDED=0;FLASH_EXT_SHORT_BANDED=1'] [--v-seq-contiguous vcol]

Prints one line per failing case and a summary per build and setting; exits 1 if any case failed.
"""
import argparse
import json
import math
import sys
from pathlib import Path

import torch

from flash_ext import fp8
from flash_ext.fp8 import colmajor
from flash_ext.reference import attention_fp8_emulation, attention_lowp, attention_ref
from variant_builds import apply_setting, build_ops, parse_settings, setting_name

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from gpu_helpers import poison_allocator, rounding_noise, row_max_staircase  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn}
# (batch, seqlen_q, seqlen_k, nheads, nheads_kv): odd lengths, seqlen_q != seqlen_k, GQA and MQA.
SHAPES = [(2, 1, 1, 4, 4), (1, 7, 7, 2, 1), (2, 113, 113, 4, 2), (1, 1000, 1000, 8, 2), (1, 2049, 2049, 2, 2),
          (2, 113, 1000, 4, 4), (1, 1000, 113, 4, 1), (3, 512, 512, 8, 8)]
# Inputs whose row maxima move between key blocks by chosen steps (tests/gpu_helpers.py's
# row_max_staircase) instead of Gaussian ones: the online softmax's max update on every path.
STAIRCASE = (1, 500, 1000, 4, 4)


def check_case(fwd, dtype, headdim, causal, shape, seq_contiguous_v, seed, staircase=False):
    batch, seqlen_q, seqlen_k, nheads, nheads_kv = shape
    scale = 1 / math.sqrt(headdim)
    if staircase:
        q, k, v = row_max_staircase(batch, seqlen_q, seqlen_k, nheads, headdim, scale, seed)
    else:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        q = torch.randn(batch, seqlen_q, nheads, headdim, device="cuda", generator=gen)
        k = torch.randn(batch, seqlen_k, nheads_kv, headdim, device="cuda", generator=gen)
        v = torch.randn(batch, seqlen_k, nheads_kv, headdim, device="cuda", generator=gen)
    fp8_call = dtype == torch.float8_e4m3fn
    if fp8_call:
        q, k, v, qd, kd, vd = fp8.quantize_qkv(q.bfloat16(), k.bfloat16(), v.bfloat16())
    else:
        q, k, v = (t.to(dtype) for t in (q, k, v))
        qd = kd = vd = None
    v_in = colmajor(v) if seq_contiguous_v else v
    out_dtype = torch.bfloat16 if fp8_call else dtype
    poison_allocator(((batch, seqlen_q, nheads, headdim), out_dtype), ((batch, nheads, seqlen_q), torch.float32))
    out, lse = fwd(q, k, v_in, scale, causal, qd, kd, vd, -1, -1, 0.0)
    torch.cuda.synchronize()
    if out.isnan().any():
        return "NaN in out (unwritten elements?)"
    if fp8_call:
        deq = [fp8.dequantize(x, d, nheads_kv) for x, d in ((q, qd), (k, kd), (v, vd))]
        ref, ref_lse = attention_ref(*deq, softmax_scale=scale, causal=causal)
        low = attention_fp8_emulation(q, k, v, qd, kd, vd, softmax_scale=scale, causal=causal)
        lse_tol = lambda r: 2e-3 * r.abs().clamp_min(1.0)  # noqa: E731  (FP8 GEMM0's accumulation, tests/test_fp8_gpu.py)
    else:
        ref, ref_lse = attention_ref(q, k, v, softmax_scale=scale, causal=causal)
        low = attention_lowp(q, k, v, softmax_scale=scale, causal=causal)
        lse_tol = lambda r: torch.full_like(r, 1e-3)  # noqa: E731
    err = (out.double() - ref).abs().max().item()
    err_low = (low.double() - ref).abs().max().item()
    bound = 2 * err_low + rounding_noise(ref, torch.bfloat16 if fp8_call else dtype) + 1e-5
    if err > bound:
        return f"out max error {err:.3e} > {bound:.3e}"
    finite = torch.isfinite(ref_lse)
    if not torch.equal(torch.isfinite(lse), finite):
        return "lse not -inf exactly where a row sees no key"
    if finite.any():
        lse_err = (lse.double()[finite] - ref_lse[finite]).abs()
        if not (lse_err <= lse_tol(ref_lse[finite])).all():
            return f"lse error {lse_err.max().item():.3e}"
    return None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default="")
    p.add_argument("--settings", default="", help="';'-separated settings, each a ','-separated list of VAR=VALUE")
    p.add_argument("--v-seq-contiguous", default="", help="comma list of builds that take v with its sequence dim contiguous")
    a = p.parse_args()
    settings = parse_settings(a.settings)
    seq_contiguous_v = set(filter(None, a.v_seq_contiguous.split(",")))
    failed = 0
    for name, ns in build_ops(a.variants).items():
        kernels = [k for k in json.loads(ns.build_info())["kernels"] if k["direction"] == "fwd"]
        for setting in settings:
            apply_setting(setting, settings)
            cases = bad = 0
            for kern in kernels:
                for shape_idx, shape in enumerate(SHAPES + [STAIRCASE]):
                    if kern["dtype"] == "e4m3" and shape[1] * shape[2] * shape[3] > 2_000_000:
                        continue  # the float64 emulation of the largest shapes takes minutes
                    cases += 1
                    staircase = shape_idx == len(SHAPES)
                    why = check_case(ns.fwd, DTYPES[kern["dtype"]], kern["headdim"], kern["causal"], shape,
                                     name in seq_contiguous_v, seed=shape_idx, staircase=staircase)
                    shape = "staircase" if staircase else shape
                    if why is not None:
                        bad += 1
                        print(f"FAIL {name} [{setting_name(setting)}] {kern['dtype']} d{kern['headdim']} "
                              f"{'C' if kern['causal'] else 'N'} {shape}: {why}", flush=True)
            apply_setting({}, settings)
            failed += bad
            print(f"{name} [{setting_name(setting)}]: {cases - bad}/{cases} cases pass", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
