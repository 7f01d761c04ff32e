"""`python -m flash_ext.benchmark --decode`: one decoding step over a KV cache (issue 12), flash_ext's
flash_attn_with_kvcache (contiguous and paged caches) beside SDPA's backends on the same cache, and the
bandwidth a device-to-device copy reaches in the same run.

Per (batch, cache length): q (batch, seqlen_q, nheads, headdim), a full cache of that length (and, where the
build has the kernel, the same cache in FP8, "flash_ext fp8": q and caches cast to e4m3, descales of 1, bf16
out; it reads half the bytes, so its ratio to SDPA's 16-bit backends is a different computation's); times are
medians over calls timed with CUDA events, L2 evicted before each call (timing.flushed_us: by reading 256 MB,
or with flush="dirty" by writing it as triton's do_bench does, whose dirty lines the timed call must write back) of
- "graph": one call captured in a CUDA graph and replayed (kernel time, as a decoder under
  torch.compile(mode="reduce-overhead") runs it),
- "eager": the Python call itself (host and launch overhead included when they exceed the GPU time);
and the host time of a tight loop of eager calls without synchronisation. flash_ext's eager calls pass
check_values=False (a decoding loop's setting: the value checks read cache_seqlens to the host).
K+V GB/s = the cache's K and V bytes / graph time; "% copy" = that over the D2D copy's read+write bandwidth.
"""
import contextlib

import torch
import torch.nn.functional as F

from .timing import flushed_us, host_us_per_call, l2_flush

DEFAULT_BATCHES = (1, 8, 64)
DEFAULT_CACHE_LENS = (512, 4096, 32768, 131072)
DEFAULT_PAGE_SIZES = (64, 256)
MAX_CACHE_TOKENS = 2 * 1024 * 1024  # batch * cache length: skip larger (b64 x 128k would be 34 GB of K/V)


FLUSHES = ("clean", "dirty")


def make_timer(flush):
    """(fn, warmup_ms, rep_ms) -> median us, L2 evicted before each call with clean or dirty lines left."""
    if flush not in FLUSHES:
        raise ValueError(f"flush must be one of {FLUSHES}, got {flush!r}")
    evict = l2_flush(flush)
    return lambda fn, warmup_ms, rep_ms: flushed_us(fn, warmup_ms, rep_ms, evict)


def _graphed(fn):
    """fn captured in a CUDA graph (after a warm-up on a side stream); returns replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def decode_inputs(batch, seqlen_q, cache_len, nheads=32, nheads_kv=8, headdim=128, dtype=torch.bfloat16):
    """q, a full contiguous cache and its lengths, random (never zeros)."""
    q = torch.randn(batch, seqlen_q, nheads, headdim, device="cuda", dtype=dtype)
    k_cache = torch.randn(batch, cache_len, nheads_kv, headdim, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    return q, k_cache, v_cache, torch.full((batch,), cache_len, dtype=torch.int32, device="cuda")


def paged_cache(k_cache, v_cache, page_size):
    """The cache's keys in pages of page_size, in shuffled order: (k_pages, v_pages, page_table int32 (batch,
    pages)). The cache length must be a multiple of page_size."""
    batch, seqlen, nheads_kv, headdim = k_cache.shape
    pages = seqlen // page_size
    if pages * page_size != seqlen:
        raise ValueError(f"page size {page_size} does not divide the cache length {seqlen}")
    order = torch.randperm(batch * pages, device=k_cache.device)
    k_pages, v_pages = (torch.empty(batch * pages, page_size, nheads_kv, headdim, device=k_cache.device,
                                    dtype=k_cache.dtype) for _ in range(2))
    for pages_of, cache in ((k_pages, k_cache), (v_pages, v_cache)):  # as bytes: index_put has no fp8
        pages_of.view(torch.uint8)[order] = cache.view(torch.uint8).reshape(batch * pages, page_size, nheads_kv, -1)
    return k_pages, v_pages, order.view(batch, pages).to(torch.int32)


def _candidates(batch, seqlen_q, cache_len, nheads, nheads_kv, headdim, dtype, page_sizes):
    """(name, fn, sdpa_backend or None, K/V bytes read) for one shape; tensors allocated here."""
    import flash_ext
    from torch.nn.attention import SDPBackend

    q, k_cache, v_cache, lens = decode_inputs(batch, seqlen_q, cache_len, nheads, nheads_kv, headdim, dtype)
    causal = seqlen_q > 1
    kv_bytes = 2 * k_cache.numel() * k_cache.element_size()
    out = [("flash_ext", lambda: flash_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=causal,
                                                                   check_values=False), None, kv_bytes)]
    if flash_ext.has_kernel("decode", headdim, torch.float8_e4m3fn, False):
        q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k_cache, v_cache))
        ones = torch.ones(batch, nheads_kv, device="cuda")
        out.append(("flash_ext fp8", lambda: flash_ext.flash_attn_with_kvcache(
            q8, k8, v8, cache_seqlens=lens, causal=causal, check_values=False, q_descale=ones, k_descale=ones,
            v_descale=ones), None, kv_bytes // 2))
    for page_size in page_sizes:
        if cache_len % page_size:
            continue
        k_pages, v_pages, table = paged_cache(k_cache, v_cache, page_size)
        out.append((f"flash_ext paged {page_size}",
                    lambda kp=k_pages, vp=v_pages, t=table: flash_ext.flash_attn_with_kvcache(
                        q, kp, vp, cache_seqlens=lens, page_table=t, causal=causal, check_values=False), None, kv_bytes))
    qt, kt, vt = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    # SDPA's causal mask is top-left aligned: a decoding step (one query) sees the whole cache, so no mask.
    sdpa = lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=nheads != nheads_kv)  # noqa: E731
    for name, backend in (("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION), ("SDPA flash", SDPBackend.FLASH_ATTENTION),
                          ("SDPA efficient", SDPBackend.EFFICIENT_ATTENTION)):
        out.append((name, sdpa, backend, kv_bytes))
    return out


def run_decode(batches, cache_lens, seqlen_q, nheads, nheads_kv, headdim, dtype, page_sizes, warmup_ms, rep_ms,
               log=print, flush="clean"):
    """Returns rows (dicts) and the copy bandwidth; log() gets progress lines. flush: how L2 is evicted before
    each timed call (FLUSHES; the copy is timed the same way)."""
    import warnings

    from torch.nn.attention import sdpa_kernel

    timed_us = make_timer(flush)
    rows = []
    copy_src = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    copy_dst = torch.empty_like(copy_src)
    copy_us = timed_us(lambda: copy_dst.copy_(copy_src), warmup_ms, rep_ms)
    copy_gbs = 2 * copy_src.numel() / copy_us / 1e3  # read + write
    del copy_src, copy_dst
    for batch in batches:
        for cache_len in cache_lens:
            if batch * cache_len > MAX_CACHE_TOKENS:
                continue
            cands = _candidates(batch, seqlen_q, cache_len, nheads, nheads_kv, headdim, dtype, page_sizes)
            for name, fn, backend, kv_bytes in cands:
                ctx = contextlib.nullcontext() if backend is None else sdpa_kernel(backend)
                row = {"batch": batch, "cache_len": cache_len, "backend": name, "kv_bytes": kv_bytes}
                try:
                    with ctx, warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        fn()
                        torch.cuda.synchronize()
                        row["eager_us"] = timed_us(fn, warmup_ms, rep_ms)
                        row["host_us"] = host_us_per_call(fn)
                        replay = _graphed(fn)
                        row["graph_us"] = timed_us(replay, warmup_ms, rep_ms)
                except Exception as e:  # a backend that does not take this shape
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
                rows.append(row)
                log(_format_row(row, copy_gbs))
            del cands
            torch.cuda.empty_cache()
    return rows, copy_gbs


def _format_row(row, copy_gbs):
    head = f"b{row['batch']:<3} L{row['cache_len']:<7} {row['backend']:<22}"
    if "error" in row:
        return head + f" n/a ({row['error']})"
    gbs = row["kv_bytes"] / row["graph_us"] / 1e3
    return (head + f"{row['graph_us']:>9.1f} {row['eager_us']:>9.1f} {row['host_us']:>8.1f} {gbs:>8.0f} "
            f"{100 * gbs / copy_gbs:>6.0f}%")


def format_table(rows, copy_gbs, title):
    lines = [title, f"D2D copy: {copy_gbs:.0f} GB/s (read + write)",
             f"{'shape':<13}{'backend':<22}{'graph us':>9} {'eager us':>9} {'host us':>8} {'K+V GB/s':>8} {'% copy':>7}"
             f" {'flash_ext / best SDPA (graph, eager)':>38}"]
    by_shape = {}
    for row in rows:
        by_shape.setdefault((row["batch"], row["cache_len"]), []).append(row)
    for (batch, cache_len), group in by_shape.items():
        sdpa = [r for r in group if r["backend"].startswith("SDPA") and "error" not in r]
        best_graph = min((r["graph_us"] for r in sdpa), default=None)
        best_eager = min((r["eager_us"] for r in sdpa), default=None)
        for row in group:
            line = _format_row(row, copy_gbs)
            if row["backend"].startswith("flash_ext") and "error" not in row and best_graph:
                line += f"   {best_graph / row['graph_us']:>6.2f}x {best_eager / row['eager_us']:>6.2f}x"
            lines.append(line)
    return "\n".join(lines)
