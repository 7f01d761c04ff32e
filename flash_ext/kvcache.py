"""Decoding from a KV cache with FlashAttention's entry point (issue 12, first step):

    out = flash_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lens,
                                            causal=True)

This first version runs the existing variable-length kernels: the cache's entries are the sequences of a
varlen call (cu_seqlens every seqlen_cache rows, seqused_k = cache_seqlens + the new keys), so every mask,
softcap, GQA and head dim of flash_attn_varlen_func works, and the results are those kernels' to the bit.
It has none of the decoding speed-ups yet (GQA packing, split-KV): a decode step of one query fills one
row of each 128-row tile. Paged caches (page_table) and cache_batch_idx raise NotImplementedError.
"""
import torch

from .fa3_compat import _check_index_tensor, _reads_values_now, _require_varlen_ops
from .interface import _check_bool, _check_tensors, _softcap, _softmax_scale, _window_size

__all__ = ["flash_attn_with_kvcache"]

# FA3 keywords that change what is computed, or the layouts, and that this version does not implement, with
# their neutral values. (num_splits, pack_gqa and sm_margin are speed hints: taken and ignored.)
_NOT_YET = {
    "page_table": None,
    "cache_batch_idx": None,
    "cache_leftpad": None,
    "rotary_cos": None,
    "rotary_sin": None,
    "cu_seqlens_q": None,
    "cu_seqlens_k_new": None,
    "max_seqlen_q": None,
    "qv": None,
    "q_descale": None,
    "k_descale": None,
    "v_descale": None,
}


def _cache_seqlens(cache_seqlens, batch, seqlen_cache, device):
    """(batch,) int32 on the cache's device: an int for every entry, a tensor, or None (every entry full)."""
    if cache_seqlens is None:
        return torch.full((batch,), seqlen_cache, dtype=torch.int32, device=device), None
    if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, (int, torch.Tensor)):
        raise TypeError(f"cache_seqlens must be an int, an int32 tensor (batch,) or None, got "
                        f"{type(cache_seqlens).__name__}")
    if isinstance(cache_seqlens, int):
        if not 0 <= cache_seqlens <= seqlen_cache:
            raise ValueError(f"cache_seqlens = {cache_seqlens} must be in [0, seqlen_cache = {seqlen_cache}]")
        return torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device), cache_seqlens
    _check_index_tensor("cache_seqlens", cache_seqlens, batch, "(batch,)")
    if cache_seqlens.device != device:
        raise ValueError(f"cache_seqlens must be on the cache's device ({device}), got {cache_seqlens.device}")
    return cache_seqlens, None


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, num_splits=0, pack_gqa=None, sm_margin=0,
                            return_softmax_lse=False, **not_yet):
    """Attention of q over a KV cache, after appending k and v to it in place (FA3's flash_attn_with_kvcache).

    Args:
        q: (batch, seqlen_q, nheads, headdim), fp16 or bf16 on an sm_90 GPU.
        k_cache, v_cache: (batch, seqlen_cache, nheads_kv, headdim), q's dtype and device, nheads a multiple of
            nheads_kv; each entry's rows contiguous with the next entry's (stride(0) = seqlen_cache *
            stride(1), e.g. a contiguous tensor). Paged caches are not supported yet.
        k, v: optional new keys and values (batch, seqlen_new, nheads_kv, headdim), written into the caches
            at rows cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 of entry b before the attention.
        cache_seqlens: the keys entry b holds before the append: an int for all, an int32 tensor (batch,), or
            None (every entry holds seqlen_cache keys; then k, v cannot be appended).
        softmax_scale, causal, window_size, softcap: as in flash_attn_func; the masks align to the
            bottom-right corner of entry b's (seqlen_q, cache_seqlens[b] + seqlen_new) block, so a new token
            sees the whole cache and the new tokens up to itself.
        num_splits, pack_gqa, sm_margin: FA3's speed hints, accepted and ignored.
        return_softmax_lse: also return lse (batch, nheads, seqlen_q), float32.

    Returns out (batch, seqlen_q, nheads, headdim) in q's dtype, or (out, lse). An entry without keys gets
    out = 0 and lse = -inf. Forward only (no autograd).

    Checks: the types, ranks, dtypes and shapes always; the VALUES of a cache_seqlens tensor (each length plus
    seqlen_new within seqlen_cache) in eager mode only, by one device-to-host copy, skipped under
    torch.compile and during CUDA graph capture, where out-of-range lengths are clamped (memory-safe, wrong
    results).
    """
    for name, value in not_yet.items():
        if name not in _NOT_YET:
            raise TypeError(f"flash_attn_with_kvcache() got an unexpected keyword argument '{name}'")
        if value is not None:
            raise NotImplementedError(f"flash_attn_with_kvcache: {name} is not supported by flash_ext yet (only None)")
    _check_tensors(q=q, k_cache=k_cache, v_cache=v_cache)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            raise ValueError(f"flash_attn_with_kvcache: {name} must have 4 dims, got shape {tuple(t.shape)}")
    batch, seqlen_q, nheads, headdim = q.shape
    if k_cache.shape != v_cache.shape or k_cache.shape[0] != batch or k_cache.shape[3] != headdim:
        raise ValueError(f"flash_attn_with_kvcache: k_cache and v_cache must be (batch={batch}, seqlen_cache, "
                         f"nheads_kv, headdim={headdim}), got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    seqlen_cache, nheads_kv = k_cache.shape[1], k_cache.shape[2]
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if batch > 1 and t.stride(0) != seqlen_cache * t.stride(1):
            raise ValueError(f"flash_attn_with_kvcache: {name}'s entries must follow each other (stride(0) = "
                             f"seqlen_cache * stride(1) = {seqlen_cache * t.stride(1)}), got strides {t.stride()}")
    if (k is None) != (v is None):
        raise ValueError("flash_attn_with_kvcache: k and v (the new keys and values) must be given together")
    seqlen_new = 0
    if k is not None:
        _check_tensors(k=k, v=v)
        if k.shape != v.shape or k.dim() != 4 or k.shape[0] != batch or k.shape[2:] != k_cache.shape[2:]:
            raise ValueError(f"flash_attn_with_kvcache: k and v must be (batch={batch}, seqlen_new, {nheads_kv}, "
                             f"{headdim}), got {tuple(k.shape)} and {tuple(v.shape)}")
        if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
            raise TypeError(f"flash_attn_with_kvcache: k and v must have the caches' dtype {k_cache.dtype}, got "
                            f"{k.dtype} and {v.dtype}")
        seqlen_new = k.shape[1]
        if cache_seqlens is None and seqlen_new > 0:
            raise ValueError("flash_attn_with_kvcache: appending k and v needs cache_seqlens (where they go)")
    scale = _softmax_scale(softmax_scale, headdim)
    _check_bool("causal", causal)
    _check_bool("return_softmax_lse", return_softmax_lse)
    window, softcap = _window_size(window_size), _softcap(softcap)
    lens, lens_int = _cache_seqlens(cache_seqlens, batch, seqlen_cache, k_cache.device)
    if lens_int is not None and lens_int + seqlen_new > seqlen_cache:
        raise ValueError(f"flash_attn_with_kvcache: cache_seqlens = {lens_int} plus {seqlen_new} new keys exceed "
                         f"seqlen_cache = {seqlen_cache}")
    if lens_int is None and cache_seqlens is not None and _reads_values_now([lens]):
        for b, n in enumerate(lens.tolist()):
            if not 0 <= n <= seqlen_cache - seqlen_new:
                raise ValueError(f"flash_attn_with_kvcache: cache_seqlens[{b}] = {n} must be in [0, seqlen_cache - "
                                 f"seqlen_new = {seqlen_cache - seqlen_new}]")
    _require_varlen_ops()
    device = k_cache.device
    if seqlen_new > 0:
        # Row cache_seqlens[b] + j of entry b, clamped into the entry (values the checks did not read).
        rows = (lens.long()[:, None] + torch.arange(seqlen_new, device=device)).clamp_(0, seqlen_cache - 1)
        flat = (torch.arange(batch, device=device)[:, None] * seqlen_cache + rows).reshape(-1)
        for cache, new in ((k_cache, k), (v_cache, v)):
            cache.view(batch * seqlen_cache, nheads_kv, headdim).index_copy_(0, flat, new.reshape(-1, nheads_kv, headdim))
    used_k = (lens + seqlen_new).clamp_(0, seqlen_cache).to(torch.int32)
    cu_q = torch.arange(0, (batch + 1) * seqlen_q, max(seqlen_q, 1), dtype=torch.int32, device=device)[:batch + 1]
    cu_k = torch.arange(0, (batch + 1) * seqlen_cache, max(seqlen_cache, 1), dtype=torch.int32, device=device)[:batch + 1]
    if seqlen_q == 0:
        cu_q = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    if seqlen_cache == 0:
        cu_k = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    out, lse = torch.ops.flash_ext.fwd_varlen(
        q.reshape(batch * seqlen_q, nheads, headdim), k_cache.view(batch * seqlen_cache, nheads_kv, headdim),
        v_cache.view(batch * seqlen_cache, nheads_kv, headdim), cu_q, cu_k, None, used_k, seqlen_q, seqlen_cache, scale,
        causal, window[0], window[1], softcap)
    out = out.view(batch, seqlen_q, nheads, headdim)
    if not return_softmax_lse:
        return out
    return out, lse.view(nheads, batch, seqlen_q).permute(1, 0, 2).contiguous()
