"""Decode kernels of variant builds side by side in one process (graph replay, median us, the decode benchmark's
clean L2 flush), with SDPA cuDNN on the same cache: b, 1 query, cache L, h32/kv8, d128, num_splits from each
build's heuristic.
--dtype e4m3 runs the FP8 kernels on the same q and caches cast to e4m3 (descales of 1; cuDNN keeps bf16).
Outputs are compared with the main build's (max abs difference). --page-size N times every build on a paged
cache (and main on the contiguous one beside it).

    PYTHONPATH=$PWD python3 scripts/ab_decode.py --variants w8,s5 [--shapes 8x512,8x4096] [--dtype e4m3]
"""
import argparse
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_ext  # noqa: F401  (loads the main build's ops)
from variant_builds import build_ops
from flash_ext.bench.decode import _graphed, decode_inputs, make_timer, paged_cache

_do_bench = make_timer("clean")  # us, L2 evicted with clean lines (the decode benchmark's timing)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default="")
    p.add_argument("--shapes", default="1x512,1x4096,8x512,8x4096,1x32768,64x512,8x32768")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtype", choices=("bf16", "e4m3"), default="bf16")
    p.add_argument("--page-size", type=int, default=0,
                   help="time every build on a paged cache of this page size (pages in shuffled order, as the decode "
                        "benchmark lays them out) and add main on the contiguous cache as a column; 0 = contiguous")
    a = p.parse_args()
    ops = build_ops(a.variants)
    contiguous_column = ["main contig"] if a.page_size else []
    print(f"{'shape':<12}" + "".join(f"{n:>12}" for n in [*ops, *contiguous_column]) + f"{'cuDNN':>10}"
          "  max |diff| vs main")
    for shape in a.shapes.split(","):
        b, L = (int(x) for x in shape.split("x"))
        q, kc, vc, lens = decode_inputs(b, 1, L)
        q8, kc8, vc8 = (x.to(torch.float8_e4m3fn) for x in (q, kc, vc)) if a.dtype == "e4m3" else (q, kc, vc)

        def call(ns, k_cache, v_cache, table):
            return ns.decode(q8, k_cache, v_cache, None, None, lens, None, table, 1 / math.sqrt(128), False, -1, -1,
                             0.0, 0)

        if a.page_size:
            k_pages, v_pages, table = paged_cache(kc8, vc8, a.page_size)
            calls = {n: (lambda ns=ns: call(ns, k_pages, v_pages, table)) for n, ns in ops.items()}
            calls["main contig"] = lambda: call(ops["main"], kc8, vc8, None)
        else:
            calls = {n: (lambda ns=ns: call(ns, kc8, vc8, None)) for n, ns in ops.items()}
        replays = {n: _graphed(fn) for n, fn in calls.items()}
        times = {n: [] for n in calls}
        for _ in range(a.rounds):
            for n, replay in replays.items():
                times[n].append(_do_bench(replay, 25, 100))
        qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn = _do_bench(_graphed(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)), 25, 100)
        ref = calls["main"]()[0].float()
        diffs = [(calls[n]()[0].float() - ref).abs().max().item() for n in calls if n != "main"]
        print(f"b{b} L{L:<8}" + "".join(f"{min(t):>12.1f}" for t in times.values()) + f"{cudnn:>10.1f}  "
              + " ".join(f"{d:.1e}" for d in diffs), flush=True)


if __name__ == "__main__":
    main()
