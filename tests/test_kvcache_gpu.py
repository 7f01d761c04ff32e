"""flash_attn_with_kvcache on the GPU against the float64 KV-cache reference (reference.attention_kvcache_ref)
with FlashAttention's error rule (2x the error of PyTorch's attention in the inputs' dtype on each sequence's
keys, plus rounding noise), outputs poisoned first:
- the decode kernel: decoding one token and appending several, ragged and odd cache lengths, every head dim,
  fp16 and bf16, GQA and MQA, causal, window and softcap, a sequence without keys;
- FP8 (e4m3) q and caches with descales other than 1 against the float64 reference on the dequantized
  values (the rule's PyTorch attention runs them in bf16, the output's dtype); paged FP8 == contiguous;
- paged caches (page sizes 16, 64, 256, pages in shuffled order) bitwise equal to the contiguous cache, and
  cache_batch_idx;
- split counts 1..16 equal within rounding, and the heuristic's;
- the varlen path for long queries;
- the new keys land in the caches in place and nothing else there changes;
- CUDA graph capture and replay with new values (contiguous and paged); torch.compile(fullgraph=True) and
  torch.library.opcheck of the op;
- out-of-range values raise ValueError naming them, and with the checks off run memory-safely."""
import math

import pytest
import torch

import flash_ext
from flash_ext import fp8
from flash_ext.reference import attention_kvcache_ref, attention_lowp
from gpu_helpers import assert_lse_matches, assert_out_within_rule, poison_allocator

pytestmark = pytest.mark.gpu


def _require_decode(headdim, dtype):
    if not flash_ext.has_kernel("decode", headdim, dtype, False):
        pytest.skip(f"this build has no {dtype} head dim {headdim} decode kernel")


def _lowp(q, k_cache, v_cache, lens, causal, window, softcap, entries=None):
    """attention_lowp on each sequence's keys (the caches after the append; entries[b] = its cache row)."""
    out = torch.zeros_like(q)
    for b, n in enumerate(lens):
        e = b if entries is None else entries[b]
        if n:
            out[b:b + 1] = attention_lowp(q[b:b + 1], k_cache[e:e + 1, :n], v_cache[e:e + 1, :n], causal=causal,
                                          window_size=window, softcap=softcap)
    return out


def _inputs(batch, seqlen_q, seqlen_new, seqlen_cache, nheads, nheads_kv, headdim, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    randn = lambda *s: torch.randn(*s, device="cuda", dtype=dtype, generator=gen)  # noqa: E731
    q = randn(batch, seqlen_q, nheads, headdim)
    k_cache, v_cache = randn(batch, seqlen_cache, nheads_kv, headdim), randn(batch, seqlen_cache, nheads_kv, headdim)
    k_new, v_new = randn(batch, seqlen_new, nheads_kv, headdim), randn(batch, seqlen_new, nheads_kv, headdim)
    return q, k_cache, v_cache, k_new, v_new


def _check(q, k_cache, v_cache, k_new, v_new, lens, causal=False, window=(-1, -1), softcap=0.0, **kwargs):
    """One call against the reference; returns (out, lse)."""
    dtype = q.dtype
    seqlen_new = 0 if k_new is None else k_new.shape[1]
    cache_seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out_ref, lse_ref, k_after, v_after = attention_kvcache_ref(q, k_cache, v_cache, k_new, v_new, cache_seqlens,
                                                               causal=causal, window_size=window, softcap=softcap)
    poison_allocator((q.shape, dtype), ((q.shape[0], q.shape[2], q.shape[1]), torch.float32))
    out, lse = flash_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens, causal=causal,
                                                 window_size=window, softcap=softcap, return_softmax_lse=True, **kwargs)
    torch.cuda.synchronize()
    assert torch.equal(k_cache, k_after) and torch.equal(v_cache, v_after), "the caches after the append"
    assert not out.isnan().any(), "NaN in out (unwritten elements?)"
    total = [n + seqlen_new for n in lens]
    assert_out_within_rule(out, out_ref, _lowp(q, k_cache, v_cache, total, causal, window, softcap), dtype)
    assert_lse_matches(lse, lse_ref, 1e-3 + softcap * 2.0 ** -10)
    return out, lse


CASES = [  # (seqlen_q = seqlen_new, cache lengths before the append, heads, causal, window, softcap)
    (1, [4095, 100, 0, 2047], (32, 8), True, (-1, -1), 0.0),
    (1, [513, 7, 1000], (16, 1), False, (-1, -1), 0.0),
    (5, [300, 0, 1500], (8, 2), True, (-1, -1), 0.0),
    (3, [700, 64], (8, 8), True, (128, 0), 10.0),
    (1, [1, 113, 2049], (4, 4), True, (-1, -1), 30.0),
    (4, [1000, 3], (32, 2), True, (33, 0), 0.0),  # 64 rows per KV head: four row tiles
]


@pytest.mark.parametrize("headdim", [64, 128, 256])
@pytest.mark.parametrize("seqlen_new,lens,heads,causal,window,softcap", CASES)
def test_decode_and_append(seqlen_new, lens, heads, causal, window, softcap, headdim):
    dtype = torch.bfloat16
    _require_decode(headdim, dtype)
    nheads, nheads_kv = heads
    tensors = _inputs(len(lens), seqlen_new, seqlen_new, 4096, nheads, nheads_kv, headdim, dtype, headdim + seqlen_new)
    _check(*tensors, lens, causal, window, softcap)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("headdim", [8, 64, 80, 96, 128, 160, 192, 256])
def test_head_dims_and_dtypes(headdim, dtype):
    _require_decode(headdim, dtype)
    tensors = _inputs(3, 2, 2, 1000, 12, 4, headdim, dtype, headdim)
    _check(*tensors, [998, 1, 500], causal=True)


def test_no_new_keys_and_no_lengths():
    """Without k, v the cache is read as it is; without cache_seqlens every entry is full."""
    q, k_cache, v_cache, _, _ = _inputs(2, 1, 0, 256, 8, 2, 128, torch.bfloat16, 1)
    _check(q, k_cache, v_cache, None, None, [0, 255])
    full, lse_full = flash_ext.flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True)
    ref, lse_ref, _, _ = attention_kvcache_ref(q, k_cache, v_cache)
    assert_out_within_rule(full, ref, _lowp(q, k_cache, v_cache, [256, 256], False, (-1, -1), 0.0), torch.bfloat16)
    assert_lse_matches(lse_full, lse_ref, 1e-3)


FP8 = torch.float8_e4m3fn


def _fp8_inputs(batch, seqlen_q, seqlen_new, seqlen_cache, nheads, nheads_kv, headdim, seed):
    """e4m3 q, caches and new keys (random values, never zeros) and (batch, nheads_kv) descales in [0.5, 2)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    randn = lambda *s: torch.randn(*s, device="cuda", generator=gen).to(FP8)  # noqa: E731
    tensors = (randn(batch, seqlen_q, nheads, headdim), randn(batch, seqlen_cache, nheads_kv, headdim),
               randn(batch, seqlen_cache, nheads_kv, headdim), randn(batch, seqlen_new, nheads_kv, headdim),
               randn(batch, seqlen_new, nheads_kv, headdim))
    descales = [torch.rand(batch, nheads_kv, device="cuda", generator=gen) * 1.5 + 0.5 for _ in range(3)]
    return tensors, descales


def _bytes(t):
    return t.view(torch.uint8)


@pytest.mark.parametrize("headdim", [64, 128, 256])
@pytest.mark.parametrize("seqlen_new,lens,heads,causal,window,softcap", CASES)
def test_fp8_caches(seqlen_new, lens, heads, causal, window, softcap, headdim):
    _require_decode(headdim, FP8)
    nheads, nheads_kv = heads
    (q, k_cache, v_cache, k_new, v_new), (qd, kd, vd) = _fp8_inputs(len(lens), seqlen_new, seqlen_new, 4096, nheads,
                                                                    nheads_kv, headdim, headdim + 7 * seqlen_new)
    deq = lambda x, d: fp8.dequantize(x, d, nheads_kv)  # noqa: E731
    cache_seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out_ref, lse_ref, k_after, v_after = attention_kvcache_ref(
        deq(q, qd), deq(k_cache, kd), deq(v_cache, vd), deq(k_new, kd), deq(v_new, vd), cache_seqlens, causal=causal,
        window_size=window, softcap=softcap)
    k_expected, v_expected = _bytes(k_cache).clone(), _bytes(v_cache).clone()
    for b, n in enumerate(lens):
        k_expected[b, n:n + seqlen_new] = _bytes(k_new[b])
        v_expected[b, n:n + seqlen_new] = _bytes(v_new[b])
    poison_allocator((q.shape, torch.bfloat16), ((q.shape[0], q.shape[2], q.shape[1]), torch.float32))
    out, lse = flash_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens, causal=causal,
                                                 window_size=window, softcap=softcap, q_descale=qd, k_descale=kd,
                                                 v_descale=vd, return_softmax_lse=True)
    torch.cuda.synchronize()
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert torch.equal(_bytes(k_cache), k_expected) and torch.equal(_bytes(v_cache), v_expected), "the FP8 append"
    assert not out.isnan().any(), "NaN in out (unwritten elements?)"
    total = [n + seqlen_new for n in lens]
    bf16 = lambda t: t.to(torch.bfloat16)  # noqa: E731
    assert_out_within_rule(out, out_ref, _lowp(bf16(deq(q, qd)), bf16(k_after), bf16(v_after), total, causal, window,
                                               softcap), torch.bfloat16)
    assert_lse_matches(lse, lse_ref, 1e-3 + softcap * 2.0 ** -10)


def test_fp8_paged_equals_contiguous_and_splits():
    _require_decode(128, FP8)
    (q, k_cache, v_cache, k_new, v_new), (qd, kd, vd) = _fp8_inputs(3, 1, 1, 1024, 32, 8, 128, 11)
    lens = torch.tensor([1000, 5, 511], dtype=torch.int32, device="cuda")
    k_pages, v_pages, table = _paged_copy(k_cache, v_cache, 64, 3)
    scales = {"q_descale": qd, "k_descale": kd, "v_descale": vd}
    out, lse = flash_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, lens, causal=True, num_splits=3,
                                                 return_softmax_lse=True, **scales)
    out_p, lse_p = flash_ext.flash_attn_with_kvcache(q, k_pages, v_pages, k_new, v_new, lens, page_table=table,
                                                     causal=True, num_splits=3, return_softmax_lse=True, **scales)
    assert torch.equal(out_p, out) and torch.equal(lse_p, lse), "paged and contiguous FP8 caches give the same bits"
    for splits in (1, 8):
        out_s = flash_ext.flash_attn_with_kvcache(q, k_cache, v_cache, None, None, lens + 1, causal=True,
                                                  num_splits=splits, **scales)
        torch.testing.assert_close(out_s, out, atol=1e-2, rtol=0)


def _paged_copy(k_cache, v_cache, page_size, seed):
    """The same keys in a paged cache: every entry's pages in a shuffled pool, plus unused pages."""
    batch, seqlen_cache, nheads_kv, headdim = k_cache.shape
    pages_per_seq = seqlen_cache // page_size
    num_pages = batch * pages_per_seq + 3
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_pages, generator=gen)[:batch * pages_per_seq]
    table = order.reshape(batch, pages_per_seq).to(torch.int32).cuda()
    pools = []
    for cache in (k_cache, v_cache):
        pool = torch.randn(num_pages, page_size, nheads_kv, headdim, device="cuda").to(cache.dtype)
        rows = cache.reshape(batch * pages_per_seq, page_size, nheads_kv, headdim)
        if cache.dtype == FP8:  # copied as bytes: indexed assignment of float8 tensors is not everywhere
            pool.view(torch.uint8)[order.cuda()] = rows.view(torch.uint8)
        else:
            pool[order.cuda()] = rows
        pools.append(pool)
    return pools[0], pools[1], table


# 48 and 208: page sizes that are not powers of two (the kernel finds a key's page by a multiply-high and a
# shift, decode_params.h's FastDivisor, exact for every divisor).
@pytest.mark.parametrize("page_size", [16, 48, 64, 208, 256])
def test_paged_equals_contiguous(page_size):
    _require_decode(128, torch.bfloat16)
    seqlen_cache = -(-1024 // page_size) * page_size  # whole pages, room for 1000 + 2 keys
    q, k_cache, v_cache, k_new, v_new = _inputs(4, 2, 2, seqlen_cache, 32, 8, 128, torch.bfloat16, page_size)
    lens = [1000, 0, 17, 511]
    k_pages, v_pages, table = _paged_copy(k_cache, v_cache, page_size, page_size)
    cache_seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out, lse = _check(q, k_cache, v_cache, k_new, v_new, lens, causal=True, num_splits=3)
    out_p, lse_p = flash_ext.flash_attn_with_kvcache(q, k_pages, v_pages, k_new, v_new, cache_seqlens, page_table=table,
                                                     causal=True, num_splits=3, return_softmax_lse=True)
    assert torch.equal(out_p, out) and torch.equal(lse_p, lse), "paged and contiguous caches give the same bits"
    for b, n in enumerate(lens):  # the new keys landed in the right pages
        pos = torch.arange(n, n + 2)
        pages = table[b].cpu()[pos // page_size]
        assert torch.equal(k_pages[pages, pos % page_size], k_cache[b, pos])
        assert torch.equal(v_pages[pages, pos % page_size], v_cache[b, pos])


def test_cache_batch_idx():
    _require_decode(64, torch.float16)
    q, k_cache, v_cache, k_new, v_new = _inputs(3, 1, 1, 300, 8, 2, 64, torch.float16, 5)
    pool_k = torch.randn(5, 300, 2, 64, device="cuda", dtype=torch.float16)
    pool_v = torch.randn_like(pool_k)
    idx = [4, 0, 2]
    pool_k[idx], pool_v[idx] = k_cache, v_cache
    lens = torch.tensor([299, 10, 0], dtype=torch.int32, device="cuda")
    out = flash_ext.flash_attn_with_kvcache(q, pool_k, pool_v, k_new, v_new, lens,
                                            cache_batch_idx=torch.tensor(idx, dtype=torch.int32, device="cuda"))
    expected = _check(q, k_cache, v_cache, k_new, v_new, [299, 10, 0])[0]
    assert torch.equal(out, expected)
    assert torch.equal(pool_k[idx], k_cache) and torch.equal(pool_v[idx], v_cache)


def test_split_counts_agree():
    _require_decode(128, torch.bfloat16)
    q, k_cache, v_cache, _, _ = _inputs(2, 1, 0, 8192, 32, 8, 128, torch.bfloat16, 9)
    lens = torch.tensor([8192, 3000], dtype=torch.int32, device="cuda")
    ref, _, _, _ = attention_kvcache_ref(q, k_cache, v_cache, cache_seqlens=lens)
    one = flash_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, num_splits=1)
    low = _lowp(q, k_cache, v_cache, [8192, 3000], False, (-1, -1), 0.0)
    for splits in list(range(1, 17)) + [0, 128]:
        out = flash_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, num_splits=splits)
        assert_out_within_rule(out, ref, low, torch.bfloat16)
        assert (out.float() - one.float()).abs().max().item() <= 2 ** -7, f"num_splits={splits} vs 1"


def test_long_queries_take_the_varlen_path():
    """128 query rows per KV head over a contiguous cache: the attention kernels (prefill into a cache)."""
    if not flash_ext.has_kernel("fwd", 128, torch.bfloat16, True):
        pytest.skip("this build has no bf16 head dim 128 causal forward kernel")
    tensors = _inputs(2, 64, 64, 2048, 8, 4, 128, torch.bfloat16, 11)
    _check(*tensors, [1000, 0], causal=True)


def _graph(step):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


@pytest.mark.parametrize("paged", [False, True])
def test_cuda_graph_replay_with_new_values(paged):
    """Captured once, replayed with new q, new keys and new lengths: no host synchronisation inside."""
    _require_decode(128, torch.bfloat16)
    batch, nheads, nheads_kv, headdim, seqlen_cache = 4, 16, 4, 128, 1024
    q, k_cache, v_cache, k_new, v_new = _inputs(batch, 1, 1, seqlen_cache, nheads, nheads_kv, headdim, torch.bfloat16, 3)
    lens = torch.tensor([10, 500, 1000, 0], dtype=torch.int32, device="cuda")
    if paged:
        k_store, v_store, table = _paged_copy(k_cache, v_cache, 64, 3)
        step = lambda: flash_ext.flash_attn_with_kvcache(q, k_store, v_store, k_new, v_new, lens,  # noqa: E731
                                                         page_table=table, causal=True)
        # The cache as each sequence sees it, gathered from its pages.
        caches = lambda: tuple(s[table.long()].reshape(batch, seqlen_cache, nheads_kv, headdim)  # noqa: E731
                               for s in (k_store, v_store))
    else:
        step = lambda: flash_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, lens, causal=True)  # noqa: E731
        caches = lambda: (k_cache, v_cache)  # noqa: E731
    graph, out = _graph(step)
    for trial in range(2):
        q.normal_()
        k_new.normal_()
        v_new.normal_()
        lens.copy_(torch.tensor([20 + trial, 600, 3, 1022], dtype=torch.int32))
        k_before, v_before = (c.clone() for c in caches())
        graph.replay()
        torch.cuda.synchronize()
        expected, _, k_after, v_after = attention_kvcache_ref(q, k_before, v_before, k_new, v_new, lens, causal=True)
        k_now, v_now = caches()
        assert torch.equal(k_now, k_after) and torch.equal(v_now, v_after)
        low = _lowp(q, k_after, v_after, [n + 1 for n in lens.tolist()], True, (-1, -1), 0.0)
        assert_out_within_rule(out, expected, low, torch.bfloat16)

def test_out_of_range_values():
    """Eager calls read the values and name the bad one; with check_values=False the kernel clamps them and
    stays inside the tensors (the next synchronisation would report an illegal address)."""
    _require_decode(64, torch.bfloat16)
    q, k_cache, v_cache, k_new, v_new = _inputs(2, 1, 1, 64, 4, 2, 64, torch.bfloat16, 4)
    k_pages, v_pages, table = _paged_copy(k_cache, v_cache, 16, 4)
    bad_table = table.clone()
    bad_table[1, 0] = 1 << 30
    lens = torch.tensor([3, 5], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match=r"page_table\[1, 0\] = 1073741824 is not a page of the cache"):
        flash_ext.flash_attn_with_kvcache(q, k_pages, v_pages, k_new, v_new, lens, page_table=bad_table)
    too_long = torch.tensor([3, 64], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 64 must be in \[0, capacity - seqlen_new = 63\]"):
        flash_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, too_long)
    with pytest.raises(ValueError, match=r"cache_batch_idx\[0\] = -1 is not an entry"):
        flash_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                          cache_batch_idx=torch.tensor([-1, 0], dtype=torch.int32, device="cuda"))
    for kwargs in (dict(page_table=bad_table), dict(cache_seqlens_override=torch.tensor([-5, 1 << 30], dtype=torch.int32))):
        lens_used = kwargs.pop("cache_seqlens_override", lens).cuda()
        kc, vc = (k_pages, v_pages) if "page_table" in kwargs else (k_cache, v_cache)
        out = flash_ext.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, lens_used, check_values=False, **kwargs)
        torch.cuda.synchronize()
        assert out.shape == q.shape
    assert math.isfinite(torch.zeros(1, device="cuda").sum().item()), "the context survived"


def test_torch_compile_and_opcheck():
    _require_decode(64, torch.bfloat16)
    q, k_cache, v_cache, k_new, v_new = _inputs(2, 1, 1, 256, 8, 2, 64, torch.bfloat16, 7)
    lens = torch.tensor([10, 200], dtype=torch.int32, device="cuda")
    k_twin, v_twin = k_cache.clone(), v_cache.clone()

    def step(q, k_cache, v_cache, k_new, v_new, lens):
        return flash_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, lens, causal=True,
                                                 return_softmax_lse=True)

    out, lse = torch.compile(step, fullgraph=True)(q, k_cache, v_cache, k_new, v_new, lens)
    out_eager, lse_eager = step(q, k_twin, v_twin, k_new, v_new, lens)
    assert torch.equal(out, out_eager) and torch.equal(lse, lse_eager)
    assert torch.equal(k_cache, k_twin) and torch.equal(v_cache, v_twin), "the compiled call appended in place"
    torch.library.opcheck(torch.ops.flash_ext.decode.default,
                          (q, k_cache, v_cache, k_new, v_new, lens, None, None, 0.125, True, -1, -1, 0.0, 0))
