"""Sustained-load probe: TFLOP/s, SM clock, board power and temperature over time, flash_ext beside SDPA cuDNN.

The benchmark's rows move by up to 8% between device calls (perf-notes section 47). This runs one shape back
to back for --seconds per backend, alternating backends, and prints one line per window: the throughput of
the window (CUDA events) next to nvidia-smi's readings sampled while it ran, to show whether the GPU's clock
or power limit moves the figures as it warms. With --variants (scripts/build_variant.sh builds), it is a
sustained A/B: the builds alternate in windows long enough to run at the power limit, as a training run does.

    PYTHONPATH=$PWD python3 scripts/power_probe.py --headdim 128 --seqlen 8192 --seconds 20 --rounds 2
    PYTHONPATH=$PWD python3 scripts/power_probe.py --dtype fp8 --variants fma0   (no cuDNN column for fp8)
"""
import argparse
import math
import subprocess
import threading
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_ext  # noqa: F401  (loads the main build's ops)
from variant_builds import build_ops


class SmiSampler:
    """nvidia-smi readings (clock MHz, power W, temperature C) every `period` seconds, in a thread."""

    def __init__(self, period=0.25):
        self.period, self.samples, self._stop = period, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            line = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                                   "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
            try:
                clock, power, temp = (float(x) for x in line.strip().split(","))
                self.samples.append((time.monotonic(), clock, power, temp))
            except ValueError:
                pass
            time.sleep(self.period)

    def start(self):
        self._thread.start()

    def stop(self):
        self._stop.set()
        self._thread.join()

    def between(self, t0, t1):
        return [s[1:] for s in self.samples if t0 <= s[0] <= t1]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--causal", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=20.0, help="per backend and round")
    parser.add_argument("--window", type=float, default=2.0, help="seconds per printed line")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", default="", help="comma list of variant build names, timed beside main")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp8"))
    args = parser.parse_args()
    d, s, causal = args.headdim, args.seqlen, bool(args.causal)
    b, h = 16384 // s, 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    flops = 4 * b * h * s * s * d / (2 if causal else 1)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    call = (1 / math.sqrt(d), causal, None, None, None, -1, -1, 0.0)
    q16, k16, v16 = q, k, v
    if args.dtype == "fp8":
        q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    backends = {name: (lambda ns=ns: ns.fwd(q, k, v, *call)) for name, ns in build_ops(args.variants).items()}
    if args.dtype == "fp8":  # our bf16 forward, the yardstick for FP8
        backends["main bf16"] = lambda: torch.ops.flash_ext.fwd(q16, k16, v16, *call)
    else:
        backends["cuDNN"] = cudnn
    smi = SmiSampler()
    smi.start()
    print(f"d{d} {'C' if causal else 'N'} s{s} b{b} h{h} {args.dtype}; {args.seconds:.0f} s per backend per round")
    print(f"{'round':>5} {'backend':>10} {'t s':>6} {'TFLOP/s':>8} {'MHz min/mean':>13} {'W mean/max':>11} {'C':>4}")
    for r in range(args.rounds):
        for name, fn in backends.items():
            fn()
            torch.cuda.synchronize()
            start = time.monotonic()
            while time.monotonic() - start < args.seconds:
                t0 = time.monotonic()
                ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                ev0.record()
                calls = 0
                while time.monotonic() - t0 < args.window:
                    for _ in range(10):
                        fn()
                    calls += 10
                    torch.cuda.synchronize()
                ev1.record()
                torch.cuda.synchronize()
                ms = ev0.elapsed_time(ev1) / calls
                got = smi.between(t0, time.monotonic())
                clocks = [x[0] for x in got] or [math.nan]
                power = [x[1] for x in got] or [math.nan]
                temp = got[-1][2] if got else math.nan
                print(f"{r:>5} {name:>10} {time.monotonic() - start:>6.1f} {flops / ms / 1e9:>8.1f} "
                      f"{min(clocks):>6.0f}/{sum(clocks) / len(clocks):<6.0f} {sum(power) / len(power):>5.0f}/{max(power):<5.0f} "
                      f"{temp:>4.0f}", flush=True)
    smi.stop()


if __name__ == "__main__":
    main()
