"""Where a backward call's time goes, kernel by kernel (torch.profiler over a few calls): the main kernel,
the preprocess, the postprocess, the accumulator's memset, and the gaps between them (wall time per call
from CUDA events minus the kernels' sum). b*s = 16k tokens, hidden 2048, as the benchmark.

    PYTHONPATH=$PWD:$PWD/scripts python3 scripts/bwd_parts.py --headdims 64,128,256 --seqlens 512,1024,2048,8192 \
        [--causal 0,1] [--variants main,pdl]

Each variant (the main build, or a variant build: scripts/build_variant.sh) is timed on the same inputs, one
after the other, shape by shape.
"""
import argparse
import math
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import flash_ext  # noqa: F401  (loads the ops)
from variant_builds import build_ops


def short_name(name):
    for key in ("BwdPreprocess", "BwdPostprocess", "BwdKernel", "VarlenPrepare", "Memset"):
        if key in name:
            return key
    return name[:40]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--headdims", default="64,128,256")
    parser.add_argument("--seqlens", default="512,1024,2048,8192")
    parser.add_argument("--causal", default="0,1")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--variants", default="main")
    args = parser.parse_args()
    ops = build_ops(args.variants)
    print("shape | build | wall us/call | " + " | ".join(["BwdKernel", "BwdPreprocess", "BwdPostprocess", "Memset"]) + " | rest (gaps)")
    for d in (int(x) for x in args.headdims.split(",")):
        for s in (int(x) for x in args.seqlens.split(",")):
            for causal in (bool(int(x)) for x in args.causal.split(",")):
                b, h = 16384 // s, 2048 // d
                q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                scale = 1 / math.sqrt(d)
                out, lse = torch.ops.flash_ext.fwd(q, k, v, scale, causal)
                for name, ns in ops.items():
                    if name not in args.variants.split(","):
                        continue
                    call = lambda: ns.bwd(dout, q, k, v, out, lse, None, scale, causal, False)  # noqa: E731
                    wall, per = measure(call, args.calls)
                    parts = [per.get(kname, 0.0) for kname in ("BwdKernel", "BwdPreprocess", "BwdPostprocess", "Memset")]
                    print(f"d{d} {s} {'C' if causal else 'N'} | {name} | {wall:.1f} | " + " | ".join(f"{x:.1f}" for x in parts)
                          + f" | {wall - sum(per.values()):.1f}", flush=True)


def measure(call, calls):
    """Wall time per call (CUDA events over `calls` back-to-back calls) and the device time of each kind of
    kernel per call (torch.profiler over as many more)."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        call()
    end.record()
    torch.cuda.synchronize()
    wall = start.elapsed_time(end) * 1000 / calls
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    per = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[short_name(e.name)] += e.device_time / calls
    return wall, per

if __name__ == "__main__":
    main()
