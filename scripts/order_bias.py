"""Does the benchmark's order favour the backend that runs first? (perf-notes section 47)

The GPU runs at its power limit under load, and the limit acts over about a second, so a backend timed right
after low-power work (the benchmark's float64 reference, SDPA's math backend) can see a higher clock than one
timed right after a heavy kernel. This times flash_ext and SDPA cuDNN as the benchmark does, each pair after
`--idle` seconds of idle GPU, in both orders, several times, and prints flash_ext / cuDNN for each order.
`--rounds 0` (default) is the benchmark's timer (flash_ext/bench/timing.py: --heat-ms of heat, then balanced
interleaved rounds), which should make the order not matter; `--rounds 1` is the benchmark before it (one
do_bench each, warm-up 25 ms, 100 ms, in the order given, after the heat).

    PYTHONPATH=$PWD python3 scripts/order_bias.py --shapes 128:N:8192,128:N:512 --repeats 3 [--heat-ms 500]
"""
import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_ext
from flash_ext.bench.timing import make_do_bench_timer


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="128:N:512,128:N:2048,128:N:8192,128:C:8192,64:N:2048,256:N:8192",
                        help="comma list of headdim:N|C:seqlen (b*s = 16k, hidden 2048)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--idle", type=float, default=1.0, help="seconds of idle GPU before each pair")
    parser.add_argument("--heat-ms", type=float, default=500.0, help="heat before the timing (benchmark's option)")
    parser.add_argument("--rounds", type=int, default=0,
                        help="the benchmark's --rounds (0: balanced interleaved rounds; 1: one do_bench each, in order)")
    args = parser.parse_args()
    timer = make_do_bench_timer(25, 100, args.heat_ms, args.rounds)
    print(f"heat {args.heat_ms:g} ms, rounds {args.rounds or 'balanced'}, {args.idle:g} s idle before each pair")
    print(f"{'shape':<16}{'ext first: ext/cuDNN':>28}{'cuDNN first: ext/cuDNN':>30}{'ratio ext-first / cuDNN-first':>32}")
    for spec in args.shapes.split(","):
        d, mask, s = spec.split(":")
        d, s, causal = int(d), int(s), mask == "C"
        b, h = 16384 // s, 2048 // d
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        flops = 4 * b * h * s * s * d / (2 if causal else 1)

        def ext():
            return flash_ext.forward(q, k, v, causal=causal)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

        ext(), cudnn()
        torch.cuda.synchronize()
        cells = {True: [], False: []}  # ext first? -> [(ext TFLOP/s, cuDNN TFLOP/s)]
        for r in range(args.repeats):
            for ext_first in (r % 2 == 0, r % 2 != 0):
                time.sleep(args.idle)
                order = (ext, cudnn) if ext_first else (cudnn, ext)
                ms = dict(zip(order, timer(list(order))))
                cells[ext_first].append((flops / ms[ext] / 1e9, flops / ms[cudnn] / 1e9))

        def summary(pairs):
            ratios = [e / c for e, c in pairs]
            e = sum(p[0] for p in pairs) / len(pairs)
            c = sum(p[1] for p in pairs) / len(pairs)
            return f"{e:6.1f}/{c:6.1f} {math.prod(ratios) ** (1 / len(ratios)):5.3f}x", math.prod(ratios) ** (1 / len(ratios))

        first, rf = summary(cells[True])
        second, rs = summary(cells[False])
        print(f"d{d} {mask} s{s:<9}{first:>28}{second:>30}{rf / rs:>32.3f}", flush=True)


if __name__ == "__main__":
    main()
