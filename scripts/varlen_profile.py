"""Where a varlen batch's time goes, against its dense yardstick (issue 11's varlen/dense ratio).

For the benchmark's --varlen batch (flash_ext.bench.shapes.varlen_seqlens: 16 sequences, 32k tokens) and each
head dim and mask, times (do_bench medians, bf16):
  varlen   the packed batch through fwd_varlen / bwd_varlen (the benchmark's row);
  dense    its dense equivalent (batch x L with L = sum(s^2) / sum(s): the benchmark's yardstick);
  parts    each sequence's length s run dense on a batch that fills the GPU (about 32k tokens: ceil(32k / s)
           sequences), its time divided by that batch: what the sequence costs at its own length's rate
           in a full GPU; summed over the sequences.
So varlen / parts is what packing costs beyond the lengths themselves (tile order, tails, the prepare kernel),
and parts / dense what the mixture of shorter and longer sequences costs against one length. TFLOP/s count
each variant's own (query, key) pairs, as the benchmark does.

    PYTHONPATH=$PWD python3 scripts/varlen_profile.py --headdims 128,256 --causal 0
"""
import argparse
import math

import torch
import triton.testing

import flash_ext  # noqa: F401  (loads the ops)
from flash_ext.bench.shapes import varlen_seqlens


def timed_ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def dense_ms(batch, seqlen, nheads, d, causal, direction):
    q, k, v, dout = (torch.randn(batch, seqlen, nheads, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = 1 / math.sqrt(d)
    out, lse = torch.ops.flash_ext.fwd(q, k, v, scale, causal, None, None, None, -1, -1, 0.0)
    if direction == "fwd":
        return timed_ms(lambda: torch.ops.flash_ext.fwd(q, k, v, scale, causal, None, None, None, -1, -1, 0.0))
    return timed_ms(lambda: torch.ops.flash_ext.bwd(dout, q, k, v, out, lse, None, scale, causal, False, -1, -1, 0.0))


def varlen_ms(seqlens, nheads, d, causal, direction):
    total = sum(seqlens)
    q, k, v, dout = (torch.randn(total, nheads, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    cu = torch.tensor([0] + [sum(seqlens[:i + 1]) for i in range(len(seqlens))], dtype=torch.int32, device="cuda")
    smax, scale = max(seqlens), 1 / math.sqrt(d)
    fwd = lambda: torch.ops.flash_ext.fwd_varlen(q, k, v, cu, cu, None, None, smax, smax, scale, causal, -1, -1, 0.0)  # noqa: E731
    out, lse = fwd()[:2]
    if direction == "fwd":
        return timed_ms(fwd)
    return timed_ms(lambda: torch.ops.flash_ext.bwd_varlen(dout, q, k, v, out, lse, None, cu, cu, None, None, smax, smax,
                                                           scale, causal, False, -1, -1, 0.0))


def pairs(s, causal):
    return s * (s + 1) / 2 if causal else s * s


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--headdims", default="128,256")
    parser.add_argument("--causal", default="0")
    parser.add_argument("--directions", default="fwd,bwd")
    args = parser.parse_args()
    seqlens = varlen_seqlens()
    tokens = sum(seqlens)
    dense_len = round(sum(s * s for s in seqlens) / tokens)
    dense_batch = max(1, round(tokens / dense_len))
    print(f"varlen batch: {sorted(seqlens, reverse=True)}; dense equivalent {dense_batch} x {dense_len}")
    print(f"{'row':<14}{'varlen':>10}{'dense':>10}{'parts':>10}{'varlen/dense':>14}{'varlen/parts':>14}{'parts/dense':>13}"
          "   (TFLOP/s; ratios of TFLOP/s)")
    for d in map(int, args.headdims.split(",")):
        nheads = 2048 // d
        for causal in (c == "1" for c in args.causal.split(",")):
            for direction in args.directions.split(","):
                mult = (2.5 if direction == "bwd" else 1.0) * 4 * nheads * d / 1e9  # TFLOP per (query, key) pair, in ms units
                work_varlen = sum(pairs(s, causal) for s in seqlens) * mult
                t_varlen = varlen_ms(seqlens, nheads, d, causal, direction)
                t_dense = dense_ms(dense_batch, dense_len, nheads, d, causal, direction)
                work_dense = dense_batch * pairs(dense_len, causal) * mult
                t_parts, per_seq = 0.0, []
                for s in sorted(set(seqlens)):
                    b = -(-tokens // s)
                    t = dense_ms(b, s, nheads, d, causal, direction) / b
                    per_seq.append((s, pairs(s, causal) * mult / t))
                    t_parts += t * seqlens.count(s)
                r_varlen, r_dense, r_parts = work_varlen / t_varlen, work_dense / t_dense, work_varlen / t_parts
                row = f"d{d} {'C' if causal else 'N'} {direction}"
                print(f"{row:<14}{r_varlen:>10.1f}{r_dense:>10.1f}{r_parts:>10.1f}{r_varlen / r_dense:>14.3f}"
                      f"{r_varlen / r_parts:>14.3f}{r_parts / r_dense:>13.3f}", flush=True)
                print("    per length (TFLOP/s at a full GPU): " + ", ".join(f"{s}: {r:.0f}" for s, r in per_seq), flush=True)


if __name__ == "__main__":
    main()
