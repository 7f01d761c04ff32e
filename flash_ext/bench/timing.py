"""Timers and the peak-memory probe. A timer takes the list of closures that launch exactly the timed work
(one per backend of a row) and returns one time per closure, in ms."""
import statistics
import time

import torch
from triton.testing import do_bench


def heat(fns, ms, results):
    """Runs the fns in turn, back to back, for about `ms` milliseconds of wall time (each at least once), then
    waits for the GPU. A fn that raises gets its exception in results[i] and runs no more.

    Under sustained load the H200 runs at its power limit, which acts over about a second: a backend timed
    right after low-power work (the float64 reference, SDPA's math backend, an idle gap) runs at a higher
    clock than one timed after a heavy kernel (docs/perf-notes.md section 47). Heating first brings the GPU
    to the steady clock a training run sees."""
    if ms <= 0:
        return
    torch.cuda.synchronize()
    end = time.perf_counter() + ms / 1e3
    while True:
        for i, fn in enumerate(fns):
            if results[i] is None:
                try:
                    fn()
                except Exception as e:  # noqa: BLE001 -- reported per backend by the caller
                    results[i] = e
        torch.cuda.synchronize()
        if time.perf_counter() >= end:
            return


def balanced_orders(n):
    """Orders of 0..n-1 in which every item comes first equally often and right after every other item
    equally often (a Williams design): n orders for even n (and n = 1), 2n for odd n. Rotations alone would
    not do: they keep each item's predecessor the same in every order but one."""
    seq, low, high = [0], 1, n - 1
    while len(seq) < n:
        seq.append(low)
        low += 1
        if len(seq) < n:
            seq.append(high)
            high -= 1
    orders = [[(x + r) % n for x in seq] for r in range(n)]
    return orders + [order[::-1] for order in orders] if n % 2 and n > 1 else orders


def make_do_bench_timer(warmup_ms, rep_ms, heat_ms=0.0, rounds=0):
    """fns -> [median ms or the exception that stopped it] by triton.testing.do_bench (CUDA events, L2
    flushed before every call), the fns interleaved so that none is favoured by the order it runs in.

    The fns run in turn, back to back, for heat_ms (heat); then in rounds, each timing every fn once by
    do_bench with warmup_ms / rounds and rep_ms / rounds, in the orders of balanced_orders (rounds = 0: one
    round per order; more cycle through them): every fn runs first equally often and right after each other
    fn equally often, so the power state each leaves to the next (section 47: up to 7% for whoever ran
    first) weighs on all alike. A fn's time is the median of its rounds' medians. A fn that raises is dropped
    from later rounds and reports its exception."""

    def timer(fns):
        n = len(fns)
        results = [None] * n
        if n == 0:
            return results
        heat(fns, heat_ms, results)
        orders = balanced_orders(n)
        num_rounds = rounds or len(orders)
        per_round = [[] for _ in fns]
        for r in range(num_rounds):
            for i in orders[r % len(orders)]:
                if isinstance(results[i], BaseException):
                    continue
                try:
                    per_round[i].append(float(do_bench(fns[i], warmup=warmup_ms / num_rounds,
                                                       rep=rep_ms / num_rounds, return_mode="median")))
                except Exception as e:  # noqa: BLE001 -- reported per backend by the caller
                    results[i] = e
        return [res if isinstance(res, BaseException) else statistics.median(per_round[i])
                for i, res in enumerate(results)]

    return timer


_FLUSH_BYTES = 256 * 1024 * 1024
_flush_buffers = {}  # device index -> the 256 MB buffer that the flushes read or write
L2_FLUSHES = ("clean", "dirty", "none")


def l2_flush(kind):
    """A callable that evicts L2 before a timed call: "clean" reads 256 MB, leaving L2 holding clean lines;
    "dirty" writes it (triton's do_bench), leaving dirty lines whose write-back to HBM the timed call then
    pays for: 8-9 us of a 50 us decoding step that reads 134 MB (docs/perf-notes.md section 48), where a
    model's step follows kernels that leave little dirty data; "none" does nothing."""
    if kind not in L2_FLUSHES:
        raise ValueError(f"flush must be one of {L2_FLUSHES}, got {kind!r}")
    if kind == "none":
        return lambda: None
    device = torch.cuda.current_device()
    if device not in _flush_buffers:
        _flush_buffers[device] = torch.zeros(_FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
    buf = _flush_buffers[device]
    return buf.amax if kind == "clean" else buf.zero_


def flushed_us(fn, warmup_ms, rep_ms, flush):
    """Median us of fn, timed as triton's do_bench times it (CUDA events around each call, flush() before
    each, call counts from a 5-call estimate), with the flush given (l2_flush)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate_ms = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate_ms))):
        flush()
        fn()
    n = max(1, int(rep_ms / estimate_ms))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for s, e in zip(starts, ends):
        flush()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def cpu_timer(fns, reps=3):
    """A stand-in timer for --device cpu (a smoke test of the harness): fns -> median wall time of a few
    calls of each, ms (or the exception that stopped it)."""
    results = []
    for fn in fns:
        times = []
        try:
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        except Exception as e:  # noqa: BLE001
            results.append(e)
            continue
        results.append(statistics.median(times))
    return results


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
