"""Timers and the peak-memory probe; each takes fn, the closure that launches exactly the timed work."""
import time

import torch
from triton.testing import do_bench


def heat(fn, ms):
    """Runs fn back to back for about `ms` milliseconds of wall time (at least once), then waits for the GPU.

    Under sustained load the H200 runs at its power limit, which acts over about a second: a backend timed
    right after low-power work (the float64 reference, SDPA's math backend, an idle gap) runs at a higher
    clock than one timed after a heavy kernel, and which backend comes first would move the ratios by 2-7%
    (docs/perf-notes.md section 47). Heating with the backend's own work first times every backend at the
    steady clock a training run sees."""
    if ms <= 0:
        return
    torch.cuda.synchronize()
    end = time.perf_counter() + ms / 1e3
    while True:
        for _ in range(4):
            fn()
        torch.cuda.synchronize()
        if time.perf_counter() >= end:
            return


def make_do_bench_timer(warmup_ms, rep_ms, heat_ms=0.0):
    """fn -> median ms by triton.testing.do_bench (CUDA events, L2 flushed before every call), after
    heat(fn, heat_ms)."""

    def timer(fn):
        heat(fn, heat_ms)
        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))

    return timer


def cpu_timer(fn, reps=3):
    """A stand-in timer for --device cpu (a smoke test of the harness): median wall time of a few calls, ms."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def cuda_peak_mib(fn, device):
    """Peak memory one call of fn allocates above what is allocated before it (inputs, saved tensors), MiB."""
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    res = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del res
    return max(0, peak - base) / 2**20


def host_us_per_call(fn, calls=300, warmup=20):
    """Host time of one call: a tight loop of calls without synchronisation (the GPU keeps up, so the loop is
    host-bound), wall time / calls, in us."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6
