"""A/B timing of forward kernel variants in one process, beside SDPA's cuDNN and flash backends.

Variants: the main build (torch.ops.flash_ext) and any side-by-side builds (scripts/build_variant.sh,
torch.ops.flash_ext_<name>), each with a run-time switch on and off (--toggle: FLASH_EXT_PINGPONG, the
consumer warpgroup ping-pong, or FLASH_EXT_PERSISTENT, the persistent launch).
Every variant is checked against the float64 reference on a slice before it is timed, and its whole output
is compared with the main build's (the same arithmetic per tile gives the same bits, whatever the launch;
a difference is printed).

    PYTHONPATH=$PWD python3 scripts/ab_fwd.py --variants m128 --headdims 64,128,256 --seqlens 1024,8192
(--softcap C: every call soft-capped; SDPA, which has none, is timed without. --gqa N: N query heads per K/V head.
--fa3: FlashAttention-3's forward in a last column, from flash_attn_interface on PYTHONPATH; not soft-capped.)
"""
import argparse
import math
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_ext  # noqa: F401  (loads the main build's ops)
from variant_builds import build_ops
from flash_ext.reference import attention_lowp, attention_ref


def timed(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="", help="comma list of variant build names")
    parser.add_argument("--headdims", default="64,128,256")
    parser.add_argument("--seqlens", default="1024,8192")
    parser.add_argument("--causal", default="0,1")
    parser.add_argument("--softcap", type=float, default=0.0, help="softcap of every call (0 = off)")
    parser.add_argument("--gqa", type=int, default=1, help="query heads per K/V head (the benchmark's GQA grid: 8)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time the builds this many times per shape, in alternating order (main first, then "
                             "last first, ...), and keep each one's best: so that no build always runs after another")
    parser.add_argument("--toggle", default="FLASH_EXT_PINGPONG", choices=("FLASH_EXT_PINGPONG", "FLASH_EXT_PERSISTENT", "none"),
                        help="a run-time switch to time on and off; none: each kernel's own choice only")
    parser.add_argument("--values", default="1,0",
                        help="the toggle's settings, in order; 'default' = unset (e.g. default,2,1,0 with "
                             "FLASH_EXT_PERSISTENT: each kernel's choice, the mid-length tiles, persistent, one CTA per tile)")
    parser.add_argument("--fa3", action="store_true", help="time FlashAttention-3 too (flash_attn_interface)")
    args = parser.parse_args()
    fa3 = None
    if args.fa3:
        import flash_attn_interface as fa3
    ops = build_ops(args.variants)
    for name, ns in ops.items():
        print(f"{name}: {ns.build_info()}")

    tag = {"FLASH_EXT_PINGPONG": "pp", "FLASH_EXT_PERSISTENT": "pers", "none": ""}[args.toggle]
    settings = (None,) if args.toggle == "none" else tuple(
        None if v == "default" else int(v) for v in args.values.split(","))
    def label(on):
        return "" if on is None else ("/no" + tag if on == 0 else f"/{tag}" + ("" if on == 1 else str(on)))
    header = f"{'shape':<18}" + "".join(f"{n + label(on):>14}" for n in ops for on in settings)
    header += f"{'cuDNN':>10}{'FA2':>10}" + (f"{'FA3':>10}" if fa3 else "")
    print(header)
    for d in map(int, args.headdims.split(",")):
        for causal in (c == "1" for c in args.causal.split(",")):
            for s in map(int, args.seqlens.split(",")):
                b, h = 16384 // s, 2048 // d
                if args.gqa < 1 or h % args.gqa:
                    raise SystemExit(f"--gqa {args.gqa} must divide the {h} query heads of d{d}")
                q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
                k, v = (torch.randn(b, s, h // args.gqa, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                scale = 1 / math.sqrt(d)
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                mask = dict(causal=causal, softcap=args.softcap)
                kv_slice = 2 if args.gqa == 1 else 1  # the K/V heads of query heads 0 and 1
                ref, _ = attention_ref(q[:1, :, :2], k[:1, :, :kv_slice], v[:1, :, :kv_slice], **mask)
                err_pt = (attention_lowp(q[:1, :, :2], k[:1, :, :kv_slice], v[:1, :, :kv_slice], **mask).double()
                          - ref).abs().max().item()
                call = (scale, causal, None, None, None, -1, -1, args.softcap)
                row = f"d{d} {'C' if causal else 'N'} s{s:<10}"
                out_main = None  # every variant's whole output must equal the main build's default launch
                runs = [(name, ns, on) for name, ns in ops.items() for on in settings]
                cells = {}  # (name, on) -> best TFLOP/s, or a word
                for r in range(args.rounds):
                    for name, ns, on in runs if r % 2 == 0 else runs[::-1]:
                        if isinstance(cells.get((name, on)), str):
                            continue
                        if on is not None:
                            os.environ[args.toggle] = str(on)
                        elif args.toggle != "none":
                            os.environ.pop(args.toggle, None)
                        try:
                            out, _ = ns.fwd(q, k, v, *call)
                            err = (out[:1, :, :2].double() - ref).abs().max().item()
                            if out_main is None:
                                out_main = out
                            if not err <= 2 * err_pt + 1e-3:
                                cells[(name, on)] = "WRONG"
                                continue
                            if r == 0 and not torch.equal(out, out_main):
                                diff = (out.float() - out_main.float()).abs().max().item()
                                print(f"    {name} {on}: output differs from main's, max |diff| {diff:.3g}")
                            ms = timed(lambda: ns.fwd(q, k, v, *call))
                            cells[(name, on)] = max(cells.get((name, on), 0.0), flops / ms / 1e9)
                        except RuntimeError as e:
                            cells[(name, on)] = "n/a"
                            print("   ", name, on, str(e).splitlines()[0])
                    if args.toggle != "none":
                        os.environ.pop(args.toggle, None)
                for name, ns, on in runs:
                    cell = cells[(name, on)]
                    row += f"{cell:>14}" if isinstance(cell, str) else f"{cell:>14.1f}"
                qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
                for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
                    with sdpa_kernel(backend):
                        ms = timed(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                                          enable_gqa=args.gqa > 1))
                    row += f"{flops / ms / 1e9:>10.1f}"
                if fa3 is not None:
                    ms = timed(lambda: fa3.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal))
                    row += f"{flops / ms / 1e9:>10.1f}"
                print(row, flush=True)


if __name__ == "__main__":
    main()
