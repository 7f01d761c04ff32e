"""Same-process timing of one forward build under several settings of the run-time developer knobs
(environment variables read on every call: FLASH_EXT_PERSISTENT, FLASH_EXT_PINGPONG, and whatever a variant
build reads), interleaved over rounds; median TFLOP/s per setting, outputs compared with the first setting's.

    PYTHONPATH=$PWD python3 scripts/ab_env.py --build main --headdims 128 --seqlens 4096,8192 --causal 1 \\
        --settings "FLASH_EXT_PERSISTENT=0;FLASH_EXT_PERSISTENT=1"
(--build NAME: a variant build's ops, torch.ops.flash_ext_NAME; --dtype bf16|fp16|fp8)
A knob missing from a setting is unset there. "VAR=" sets it to the empty string, which the extension's own
knobs (env_override in csrc/flash_api.cpp) read as unset but a plain getenv() check reads as set.
"""
import argparse
import math

import torch
from triton.testing import do_bench

import flash_ext  # noqa: F401
from variant_builds import apply_setting, build_ops, parse_settings, setting_name


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--build", default="main")
    p.add_argument("--headdims", default="128")
    p.add_argument("--seqlens", default="8192")
    p.add_argument("--causal", default="1", help="comma list of 0/1")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp8"))
    p.add_argument("--settings", required=True, help="';'-separated settings, each a ','-separated list of VAR=VALUE")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    op = build_ops(a.build)[a.build].fwd
    settings = parse_settings(a.settings)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}[a.dtype]

    def apply(setting):
        apply_setting(setting, settings)

    print(f"build {a.build}, {a.dtype}; settings: " + " | ".join(setting_name(s) for s in settings))
    for d in map(int, a.headdims.split(",")):
        for causal in (c == "1" for c in a.causal.split(",")):
            for s in map(int, a.seqlens.split(",")):
                b, h = 16384 // s, 2048 // d
                q, k, v = (torch.randn(b, s, h, d, device="cuda").to(dtype) for _ in range(3))
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                call = lambda: op(q, k, v, 1 / math.sqrt(d), causal)  # noqa: E731
                res = [[] for _ in settings]
                first = None
                diffs = []
                for setting in settings:
                    apply(setting)
                    out = call()[0].float()
                    first = out if first is None else first
                    diffs.append((out - first).abs().max().item())
                for _ in range(a.rounds):
                    for i, setting in enumerate(settings):
                        apply(setting)
                        res[i].append(flops / do_bench(call, warmup=25, rep=100) / 1e9)
                apply({})
                row = f"d{d} {s} {'C' if causal else 'N'}:"
                for r, diff in zip(res, diffs):
                    row += f"  {sorted(r)[len(r) // 2]:7.1f}" + ("" if diff == 0 else f" (diff {diff:.1e})")
                print(row, flush=True)


if __name__ == "__main__":
    main()
