"""How much of a decoding step's measured time is the timer's L2 flush? (issue 12, perf-notes section 48)

triton's do_bench flushes L2 before every timed call by writing a 256 MB buffer, which leaves L2 full of dirty
lines; the timed call then pays for writing them back to HBM while it reads its own data. A decoding step
reads 134 MB (b8 L4096 h32/kv8 d128), so 50-60 MB of write-back would be a third of its traffic; a large
copy (512 MB of traffic) barely notices. This times one CUDA-graph replay of flash_ext's decode step, SDPA
cuDNN's, and a 256 MB D2D copy with CUDA events around each call, after three flushes:
  dirty  zero a 256 MB buffer (triton's do_bench: L2 left dirty)
  clean  read a 256 MB buffer (L2 left holding clean lines; the decode benchmark's default)
  none   nothing (L2 holds the previous call's lines; more than L2 is read, so most are gone anyway)
and prints the median us and K/V bandwidth of each, and the ratio to the copy's bandwidth under the same flush.

    PYTHONPATH=$PWD python3 scripts/decode_flush_probe.py [--shapes 8:4096,1:32768,8:512] [--rep-ms 100]
"""
import argparse
import contextlib
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_ext
from flash_ext.bench.decode import _graphed, decode_inputs
from flash_ext.bench.timing import L2_FLUSHES, flushed_us, l2_flush


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="8:4096,1:32768,8:512,64:4096", help="batch:cache_len,...")
    parser.add_argument("--rep-ms", type=float, default=100.0)
    args = parser.parse_args()
    flushes = {kind: l2_flush(kind) for kind in L2_FLUSHES}

    def timed_us(fn, flush):
        return flushed_us(fn, 25.0, args.rep_ms, flush)

    src = torch.randn(64 * 1024 * 1024, device="cuda")
    dst = torch.empty_like(src)
    copy_gbs = {}
    for name, flush in flushes.items():
        us = timed_us(lambda: dst.copy_(src), flush)
        copy_gbs[name] = 2 * src.numel() * 4 / us / 1e3
    del src, dst
    print("D2D copy 256 MB, GB/s (read + write): " + ", ".join(f"{k} {v:.0f}" for k, v in copy_gbs.items()))
    print(f"{'shape':<14}{'backend':<12}" + "".join(f"{k + ' us':>10}{'%copy':>7}" for k in flushes))
    for spec in args.shapes.split(","):
        batch, cache_len = (int(x) for x in spec.split(":"))
        q, k, v, lens = decode_inputs(batch, 1, cache_len)
        kv_bytes = 2 * k.numel() * k.element_size()
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cands = {
            "flash_ext": (lambda: flash_ext.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, check_values=False),
                          contextlib.nullcontext),
            "SDPA cuDNN": (lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True),
                           lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION)),
        }
        for name, (fn, ctx) in cands.items():
            with ctx(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                replay = _graphed(fn)
                cells = []
                for fname, flush in flushes.items():
                    us = timed_us(replay, flush)
                    cells.append(f"{us:>10.1f}{100 * kv_bytes / us / 1e3 / copy_gbs[fname]:>6.0f}%")
            print(f"b{batch} L{cache_len:<9}{name:<12}" + "".join(cells), flush=True)
        del q, k, v, qt, kt, vt, cands
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
