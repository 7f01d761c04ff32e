"""Kernel time of small forward calls, main build beside variant builds and SDPA's cuDNN backend.

Small grids (one wave of CTAs or less) show a CTA's fixed costs: its start, the first loads, the epilogue.
Times are the torch profiler's device times per call (the sum of the call's kernels, cuDNN's memset
included), averaged over `--calls` calls. `--settings` times every build under each setting of the run-time
knobs (as scripts/ab_env.py), e.g. 'FLASH_EXT_PERSISTENT=0;FLASH_EXT_PERSISTENT=1'.

    PYTHONPATH=$PWD python3 scripts/ab_tiny.py --variants early [--shapes 1x1x128x128,1x16x1024x256] [--fp8]
        [--settings 'FLASH_EXT_PINGPONG=0;FLASH_EXT_PINGPONG=1']
"""
import argparse
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import flash_ext  # noqa: F401  (loads the main build's ops)
from variant_builds import apply_setting, build_ops, parse_settings, setting_name


def device_us_per_call(fn, calls):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.time_range.elapsed_us() for e in kernels)
    return total / calls


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="")
    parser.add_argument("--shapes", default="1x1x128x64,1x1x128x128,1x16x512x256,2x16x1024x128",
                        help="comma list of batch x heads x seqlen x headdim")
    parser.add_argument("--causal", default="0,1")
    parser.add_argument("--fp8", action="store_true", help="also time e4m3 inputs (no SDPA column)")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--settings", default="", help="';'-separated settings, each a ','-separated list of VAR=VALUE")
    args = parser.parse_args()
    settings = parse_settings(args.settings)
    runs = [(name, ns, setting) for name, ns in build_ops(args.variants).items() for setting in settings]
    if len(settings) > 1:
        for i, setting in enumerate(settings):
            print(f"setting /{i}: {setting_name(setting)}")
    names = [name + (f"/{i}" if len(settings) > 1 else "") for name in dict.fromkeys(r[0] for r in runs) for i in range(len(settings))]
    print(f"{'shape':<22}{'dtype':>6}" + "".join(f"{n:>10}" for n in names) + f"{'cuDNN':>10}   (us per call)")
    for shape in args.shapes.split(","):
        b, h, s, d = map(int, shape.split("x"))
        for causal in (c == "1" for c in args.causal.split(",")):
            dtypes = [torch.bfloat16] + ([torch.float8_e4m3fn] if args.fp8 else [])
            for dtype in dtypes:
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).to(dtype) for _ in range(3))
                call = (1 / math.sqrt(d), causal, None, None, None, -1, -1, 0.0)
                row = f"b{b} h{h} s{s} d{d} {'C' if causal else 'N'}".ljust(22) + f"{'fp8' if dtype != torch.bfloat16 else 'bf16':>6}"
                outs = []
                for _, ns, setting in runs:
                    apply_setting(setting, settings)
                    outs.append(ns.fwd(q, k, v, *call)[0])
                    row += f"{device_us_per_call(lambda: ns.fwd(q, k, v, *call), args.calls):>10.2f}"
                apply_setting({}, settings)
                if dtype == torch.bfloat16:
                    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        us = device_us_per_call(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal), args.calls)
                    row += f"{us:>10.2f}"
                else:
                    row += f"{'':>10}"
                same = all(torch.equal(o, outs[0]) for o in outs)
                print(row + ("" if same else "   outputs differ"), flush=True)


if __name__ == "__main__":
    main()
