"""Would short non-causal calls run faster on the banded (causal) kernel? (perf-notes section 49)

The banded kernels have their own tiles and launch forms (d256: 128 x 64 blocks, persistent with O staged over
V; d64: 128-row tiles where the non-causal kernel takes 192). A window just short of the whole sequence,
(seqlen - 2, -1), routes a non-causal call to the banded kernel while masking one key of the last query only,
so its time is that of a non-causal call on the banded kernel. This times, interleaved as the benchmark does:
the plain non-causal call, the same call with that window, and SDPA cuDNN; TFLOP/s of the non-causal work.

    PYTHONPATH=$PWD python3 scripts/banded_route_probe.py --shapes 256:512,256:1024,64:512
"""
import argparse
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_ext
from flash_ext.bench.timing import make_do_bench_timer


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="256:512,256:1024,256:2048,64:512,64:1024,64:2048,128:512,128:1024",
                        help="comma list of headdim:seqlen (b*s = 16k, hidden 2048, bf16)")
    parser.add_argument("--heat-ms", type=float, default=500.0)
    args = parser.parse_args()
    timer = make_do_bench_timer(150, 600, args.heat_ms)
    print(f"{'shape':<12}{'non-causal':>12}{'banded':>12}{'cuDNN':>10}{'banded/plain':>14}{'banded/cuDNN':>14}"
          f"{'max |diff|':>12}")
    for shape in args.shapes.split(","):
        d, s = (int(x) for x in shape.split(":"))
        b, h = 16384 // s, 2048 // d
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        plain = lambda: flash_ext.forward(q, k, v)  # noqa: E731
        banded = lambda: flash_ext.forward(q, k, v, window_size=(s - 2, -1))  # noqa: E731

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt)

        # Rows before the last see every key in both calls: their outputs must agree up to the tiles' order.
        diff = (plain()[0][:, :-1] - banded()[0][:, :-1]).abs().max().item()
        ms = timer([plain, banded, cudnn])
        tflops = [4 * b * h * s * s * d / (t * 1e-3) / 1e12 for t in ms]
        print(f"d{d} {s:<8}{tflops[0]:>12.1f}{tflops[1]:>12.1f}{tflops[2]:>10.1f}{tflops[1] / tflops[0]:>13.3f}x"
              f"{tflops[1] / tflops[2]:>13.3f}x{diff:>12.2e}", flush=True)
    assert math.isfinite(diff)


if __name__ == "__main__":
    main()
