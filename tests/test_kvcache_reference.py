"""The KV-cache reference (flash_ext.reference.attention_kvcache_ref) on the CPU, against attention_ref on the
keys each batch entry sees: full and ragged caches, new keys appended (and written into the returned caches,
the inputs untouched), cache_batch_idx, a paged cache bitwise equal to the contiguous one, causal decoding
and multi-token appends, entries without keys, and the errors for lengths, pages and indices that do not
fit the cache.
"""
import math

import pytest
import torch

from flash_ext.reference import attention_kvcache_ref, attention_ref


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _cache(batch, seqlen, nheads_kv=2, headdim=8, seed=0):
    return _randn(batch, seqlen, nheads_kv, headdim, seed=seed), _randn(batch, seqlen, nheads_kv, headdim, seed=seed + 1)


def _paged(k_cache, v_cache, page_size, seed):
    """The same cache as pages in a shuffled pool with spare pages: (k_pages, v_pages, page_table)."""
    batch, seqlen, nheads_kv, headdim = k_cache.shape
    per_entry = seqlen // page_size
    num_pages = batch * per_entry + 3
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))[:batch * per_entry]
    page_table = order.view(batch, per_entry).to(torch.int32)
    k_pages = _randn(num_pages, page_size, nheads_kv, headdim, seed=seed + 10)
    v_pages = _randn(num_pages, page_size, nheads_kv, headdim, seed=seed + 11)
    for b in range(batch):
        for p in range(per_entry):
            k_pages[page_table[b, p]] = k_cache[b, p * page_size:(p + 1) * page_size]
            v_pages[page_table[b, p]] = v_cache[b, p * page_size:(p + 1) * page_size]
    return k_pages, v_pages, page_table


def test_full_cache_is_attention_over_it():
    k_cache, v_cache = _cache(3, 40)
    q = _randn(3, 1, 4, 8, seed=5)
    out, lse, k_after, v_after = attention_kvcache_ref(q, k_cache, v_cache)
    out_ref, lse_ref = attention_ref(q, k_cache, v_cache)
    assert torch.equal(out, out_ref) and torch.equal(lse, lse_ref)
    assert torch.equal(k_after, k_cache) and torch.equal(v_after, v_cache)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ragged_lengths_and_appended_keys(causal):
    """Entry b sees its cache_seqlens[b] cached keys and then the new ones, written into the returned caches
    at those positions (the input caches unchanged); a multi-token causal append is bottom-right aligned."""
    k_cache, v_cache = _cache(3, 64)
    k_orig, v_orig = k_cache.clone(), v_cache.clone()
    lens = [0, 17, 60]
    q = _randn(3, 4, 4, 8, seed=7)
    k_new, v_new = _randn(3, 4, 2, 8, seed=8), _randn(3, 4, 2, 8, seed=9)
    out, lse, k_after, v_after = attention_kvcache_ref(q, k_cache, v_cache, k_new, v_new,
                                                       cache_seqlens=torch.tensor(lens, dtype=torch.int32), causal=causal)
    assert torch.equal(k_cache, k_orig) and torch.equal(v_cache, v_orig)
    for b, n in enumerate(lens):
        keys = torch.cat([k_cache[b, :n], k_new[b]])
        values = torch.cat([v_cache[b, :n], v_new[b]])
        o, l = attention_ref(q[b:b + 1], keys[None], values[None], causal=causal)
        assert torch.equal(out[b], o[0]) and torch.equal(lse[b], l[0])
        assert torch.equal(k_after[b, n:n + 4], k_new[b]) and torch.equal(v_after[b, n:n + 4], v_new[b])
        assert torch.equal(k_after[b, :n], k_cache[b, :n]) and torch.equal(k_after[b, n + 4:], k_cache[b, n + 4:])


def test_decoding_one_query_causal_sees_every_key():
    k_cache, v_cache = _cache(2, 30)
    q = _randn(2, 1, 2, 8, seed=3)
    causal = attention_kvcache_ref(q, k_cache, v_cache, cache_seqlens=25, causal=True)
    full = attention_kvcache_ref(q, k_cache, v_cache, cache_seqlens=25)
    assert torch.equal(causal[0], full[0]) and torch.equal(causal[1], full[1])


def test_cache_batch_idx_selects_rows():
    k_cache, v_cache = _cache(4, 20)
    q = _randn(2, 1, 2, 8, seed=4)
    idx = torch.tensor([3, 1], dtype=torch.int32)
    out, lse, _, _ = attention_kvcache_ref(q, k_cache, v_cache, cache_seqlens=[20, 9], cache_batch_idx=idx)
    o0, l0 = attention_ref(q[:1], k_cache[3:4], v_cache[3:4])
    o1, l1 = attention_ref(q[1:], k_cache[1:2, :9], v_cache[1:2, :9])
    assert torch.equal(out, torch.cat([o0, o1])) and torch.equal(lse, torch.cat([l0, l1]))


@pytest.mark.parametrize("page_size", [16, 64])
def test_paged_equals_contiguous(page_size):
    """The same keys in shuffled pages give the same bits, and the append lands in the right pages."""
    k_cache, v_cache = _cache(2, 128, seed=20)
    k_pages, v_pages, page_table = _paged(k_cache, v_cache, page_size, seed=21)
    q = _randn(2, 3, 4, 8, seed=22)
    k_new, v_new = _randn(2, 3, 2, 8, seed=23), _randn(2, 3, 2, 8, seed=24)
    lens = torch.tensor([page_size - 1, 100], dtype=torch.int32)  # the first append crosses a page boundary
    contiguous = attention_kvcache_ref(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, causal=True)
    paged = attention_kvcache_ref(q, k_pages, v_pages, k_new, v_new, cache_seqlens=lens, page_table=page_table,
                                  causal=True)
    assert torch.equal(paged[0], contiguous[0]) and torch.equal(paged[1], contiguous[1])
    for b in range(2):
        for r in range(int(lens[b]) + 3):
            page, offset = page_table[b, r // page_size], r % page_size
            assert torch.equal(paged[2][page, offset], contiguous[2][b, r])
            assert torch.equal(paged[3][page, offset], contiguous[3][b, r])


def test_entry_without_keys():
    k_cache, v_cache = _cache(2, 8)
    q = _randn(2, 2, 2, 8, seed=30)
    out, lse, _, _ = attention_kvcache_ref(q, k_cache, v_cache, cache_seqlens=[0, 5])
    assert torch.all(out[0] == 0) and torch.all(lse[0] == -math.inf)
    assert torch.isfinite(lse[1]).all()


def test_errors():
    k_cache, v_cache = _cache(2, 16)
    q = _randn(2, 1, 2, 8, seed=40)
    k_new, v_new = _randn(2, 2, 2, 8, seed=41), _randn(2, 2, 2, 8, seed=42)
    with pytest.raises(ValueError, match="must fit the cache's 16 per entry"):
        attention_kvcache_ref(q, k_cache, v_cache, k_new, v_new, cache_seqlens=15)
    with pytest.raises(ValueError, match="k and v must be given together"):
        attention_kvcache_ref(q, k_cache, v_cache, k_new, None, cache_seqlens=3)
    with pytest.raises(ValueError, match="page_table holds pages outside 0..1"):
        attention_kvcache_ref(q, k_cache, v_cache, cache_seqlens=3, page_table=torch.tensor([[0], [2]]))
    with pytest.raises(ValueError, match="a paged cache takes page_table alone"):
        attention_kvcache_ref(q, k_cache, v_cache, cache_seqlens=3, page_table=torch.tensor([[0], [1]]),
                              cache_batch_idx=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="cache_batch_idx must hold 2 rows"):
        attention_kvcache_ref(q, k_cache, v_cache, cache_seqlens=3, cache_batch_idx=torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="a paged cache needs cache_seqlens"):
        attention_kvcache_ref(q, k_cache, v_cache, page_table=torch.tensor([[0], [1]]))
    with pytest.raises(ValueError, match="k_cache and v_cache must be"):
        attention_kvcache_ref(q, k_cache[..., :4], v_cache[..., :4])
