"""Where a decode step's time goes today (issue 12 baseline): b, 1 query, L cached keys, h32/kv8, d128 bf16.

    PYTHONPATH=$PWD python3 scripts/decode_probe.py [--batch 8] [--seqlen 4096]
"""
import argparse

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_ext


def us(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seqlen", type=int, default=4096)
    a = p.parse_args()
    b, L, h, hkv, d = a.batch, a.seqlen, 32, 8, 128
    dt = torch.bfloat16
    q = torch.randn(b, 1, h, d, device="cuda", dtype=dt)
    kc = torch.randn(b, L, hkv, d, device="cuda", dtype=dt)
    vc = torch.randn(b, L, hkv, d, device="cuda", dtype=dt)
    lens = torch.full((b,), L, dtype=torch.int32, device="cuda")
    qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
    kv_bytes = 2 * kc.numel() * kc.element_size()
    src = torch.empty(kv_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t_copy = us(lambda: dst.copy_(src))
    print(f"decode b{b} L{L} h{h}/kv{hkv} d{d}: K+V {kv_bytes / 1e6:.1f} MB; D2D copy of that many bytes "
          f"{t_copy:.1f} us = {2 * kv_bytes / t_copy / 1e3:.0f} GB/s (read+write)")
    rows = []
    for name, backend in (("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION), ("SDPA flash", SDPBackend.FLASH_ATTENTION),
                          ("SDPA efficient", SDPBackend.EFFICIENT_ATTENTION), ("SDPA math", SDPBackend.MATH)):
        try:
            with sdpa_kernel(backend):
                fn = lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)  # noqa: E731
                fn()
                rows.append((name, us(fn)))
        except Exception as e:  # a backend that does not take this shape
            rows.append((name, f"n/a ({type(e).__name__})"))
    rows.append(("flash_ext.forward", us(lambda: flash_ext.forward(q, kc, vc))))
    rows.append(("flash_attn_with_kvcache", us(lambda: flash_ext.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens))))
    for name, t in rows:
        extra = f"  K+V at {kv_bytes / t / 1e3:.0f} GB/s" if isinstance(t, float) else ""
        print(f"{name:<26}{t if isinstance(t, str) else f'{t:10.1f} us'}{extra}")


if __name__ == "__main__":
    main()
