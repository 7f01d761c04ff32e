"""Timers and the peak-memory probe; each takes fn, the closure that launches exactly the timed work."""
import time

import torch
from triton.testing import do_bench


def make_do_bench_timer(warmup_ms, rep_ms):
    """fn -> median ms by triton.testing.do_bench (CUDA events, L2 flushed before every call)."""

    def timer(fn):
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
