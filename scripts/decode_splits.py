"""Decode-kernel time by split count and the kernels' own durations (torch.profiler), flash_ext's and SDPA
cuDNN's, for tuning the split heuristic and seeing the fixed costs: b, 1 query, cache L, h32/kv8, d128 bf16.

    PYTHONPATH=$PWD python3 scripts/decode_splits.py [--shapes 8x512,8x4096,1x32768]
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import flash_ext
from flash_ext.bench.decode import _graphed, decode_inputs, make_timer
from flash_ext.bench.timing import l2_flush

_do_bench = make_timer("clean")  # us, L2 evicted with clean lines (the decode benchmark's timing)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="8x512,8x4096,1x32768,64x512")
    p.add_argument("--splits", default="0,1,2,3,4,6,8,12,16,24,32")
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--no-profile", action="store_true", help="the split scan only")
    a = p.parse_args()
    flush = l2_flush("clean")  # as the timer does: a profiled call starts with L2 holding none of its data
    for shape in a.shapes.split(","):
        b, L = (int(x) for x in shape.split("x"))
        q, kc, vc, lens = decode_inputs(b, 1, L, headdim=a.headdim)
        kv_mb = 2 * kc.numel() * 2 / 1e6
        line = []
        for s in (int(x) for x in a.splits.split(",")):
            fn = lambda: flash_ext.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=s, check_values=False)  # noqa: E731
            t = _do_bench(_graphed(fn), 25, 100)
            line.append(f"{s}:{t:.1f}")
        print(f"d{a.headdim} b{b} L{L} ({kv_mb:.0f} MB) graph us by num_splits: " + " ".join(line), flush=True)
        if a.no_profile:
            continue
        ext = lambda: flash_ext.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, check_values=False)  # noqa: E731
        qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

        for name, fn in (("flash_ext", ext), ("SDPA cuDNN", cudnn)):
            print(f"  {name}: graph {_do_bench(_graphed(fn), 25, 100):.1f} us; its kernels (torch.profiler, eager):")
            fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    flush()
                    fn()
                torch.cuda.synchronize()
            for e in prof.key_averages():
                if (e.device_type.name == "CUDA" or "ernel" in e.key) and "reduce_kernel" not in e.key:
                    print(f"   {e.key[:90]:<90} n={e.count:<4} avg {e.device_time_total / max(e.count, 1):.1f} us")


if __name__ == "__main__":
    main()
