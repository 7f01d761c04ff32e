"""Runs every compiled backward kernel once on small odd shapes (GQA, a partial last block, causal rows
that see no key, sliding windows and softcap; the d256 kernel also with a 192-wide head), deterministic
and not, without reference computations: the workload for compute-sanitizer, which slows every kernel
down by orders of magnitude.

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/memcheck_bwd.py
"""
import torch

import flash_ext
from compiled_kernels import call_options, compiled_kernels

SHAPES = [(1, 129, 257, 4, 2), (2, 300, 50, 2, 1)]  # (batch, seqlen_q, seqlen_k, nheads, nheads_kv)


def main():
    for kernel_d, dtype, causal in compiled_kernels("bwd", ["bf16", "fp16"]):
        head_dims = [kernel_d]
        if kernel_d == 256 and flash_ext.has_kernel("fwd", 192, dtype, causal):
            head_dims.append(192)  # the d256 kernel with its last head-dim box left out (head_dim_boxes.h)
        for d, (b, sq, sk, h, hkv) in ((d, shape) for d in head_dims for shape in SHAPES):
            q, dout = (torch.randn(b, sq, h, d, device="cuda", dtype=dtype) for _ in range(2))
            k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype) for _ in range(2))
            for options in call_options(causal):
                out, lse = flash_ext.forward(q, k, v, **options)
                for deterministic in (False, True):
                    grads = flash_ext.backward(dout, q, k, v, out, lse, deterministic=deterministic, **options)
                    assert all(torch.isfinite(g).all() for g in grads)
        torch.cuda.synchronize()
        print(f"d{kernel_d} {dtype} causal={causal}: ran", flush=True)

if __name__ == "__main__":
    main()
