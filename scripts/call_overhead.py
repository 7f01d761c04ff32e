"""Per-call cost of a tiny forward (b1 h1 s128 d128 bf16), flash_ext beside SDPA's backends.

  host us/call: a tight loop of launches without synchronisation, wall time / calls (the Python wrapper,
                the op's checks and the launch; the GPU keeps up, so the loop is host-bound); the loops of
                all four calls run in rounds, in the balanced orders of the benchmark's timer (each call
                first and after each other equally often), and each call's figure is its median over the
                rounds (a single pass in a fixed order moved by tens of percent between calls: perf-notes 49);
  GPU us/call:  do_bench's median (CUDA events around the call).

    PYTHONPATH=$PWD python3 scripts/call_overhead.py [--causal]
"""
import argparse
import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import statistics

import flash_ext
from flash_ext.bench.timing import balanced_orders, host_us_per_call


def host_us(fn):
    return host_us_per_call(fn, calls=2000, warmup=50)


def gpu_us(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=8, help="rounds of host loops (cycling the balanced orders)")
    args = parser.parse_args()
    q, k, v = (torch.randn(1, args.seqlen, 1, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    candidates = [
        ("flash_ext.forward", lambda: flash_ext.forward(q, k, v, causal=args.causal), None),
        ("torch.ops.flash_ext.fwd", lambda: torch.ops.flash_ext.fwd(q, k, v, 128 ** -0.5, args.causal), None),
    ]
    sdpa = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal)  # noqa: E731
    candidates += [("SDPA cuDNN", sdpa, SDPBackend.CUDNN_ATTENTION), ("SDPA flash", sdpa, SDPBackend.FLASH_ATTENTION)]
    print(f"b1 h1 s{args.seqlen} d128 bf16 {'causal' if args.causal else 'non-causal'}, host time the median of "
          f"{args.rounds} interleaved rounds")
    print(f"{'call':<26}{'host us/call':>14}{'min..max':>16}{'GPU us/call':>14}")

    def backend_of(backend):  # the SDPA backend chosen outside the timed loop
        return contextlib.nullcontext() if backend is None else sdpa_kernel(backend)

    host = [[] for _ in candidates]
    orders = balanced_orders(len(candidates))
    for r in range(args.rounds):
        for i in orders[r % len(orders)]:
            _, fn, backend = candidates[i]
            with backend_of(backend):
                host[i].append(host_us(fn))
    for (name, fn, backend), times in zip(candidates, host):
        with backend_of(backend):
            gpu = gpu_us(fn)
        spread = f"{min(times):.1f}..{max(times):.1f}"
        print(f"{name:<26}{statistics.median(times):>14.1f}{spread:>16}{gpu:>14.1f}", flush=True)


if __name__ == "__main__":
    main()
