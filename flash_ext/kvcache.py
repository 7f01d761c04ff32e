"""Decoding from a KV cache with FlashAttention's entry point (issue 12):

    out = flash_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lens,
                                            causal=True)                      # contiguous cache
    out = flash_ext.flash_attn_with_kvcache(q, k_pages, v_pages, k=k_new, v=v_new, cache_seqlens=lens,
                                            page_table=pages, causal=True)    # paged cache

Two kernels serve it:
- the decode kernel (hopper/decode_kernel.h, torch.ops.flash_ext.decode) for few query rows per KV head
  (seqlen_q * nheads / nheads_kv <= 64: decoding, speculative steps), any cache layout: contiguous, with
  cache_batch_idx, or paged. It packs a KV head's query heads into one tile and splits the keys over CTAs
  (num_splits; 0 = chosen from the shapes), and appends the new keys in the same launch. It alone takes FP8
  (e4m3) caches, at any number of query rows;
- the varlen attention kernels for longer queries over a contiguous cache (prefill into a cache): the
  cache's entries become a varlen call's sequences, and the new keys are written first by index_copy_.
Both take no host synchronisation, so they run under CUDA graph capture and torch.compile.
"""
import torch

from .fa3_compat import _check_index_tensor, _reads_values_now, _require_varlen_ops
from .interface import NO_WINDOW, _check_bool, _check_tensors, _require_extension, _softcap, _softmax_scale, _window_size

__all__ = ["flash_attn_with_kvcache"]

# The most query rows per KV head (seqlen_q * nheads / nheads_kv) sent to the decode kernel with a contiguous
# cache: it reads K and V once per 16 rows, so longer queries go to the attention kernels' 128-row tiles.
DECODE_MAX_ROWS = 64

# FA3 keywords that change what is computed, or the layouts, and that flash_ext does not implement, with their
# neutral values. (pack_gqa and sm_margin are speed hints: taken and ignored.)
_NOT_YET = {
    "cache_leftpad": None,
    "rotary_cos": None,
    "rotary_sin": None,
    "cu_seqlens_q": None,
    "cu_seqlens_k_new": None,
    "max_seqlen_q": None,
    "qv": None,
}


def _cache_seqlens(cache_seqlens, batch, capacity, seqlen_new, device):
    """(batch,) int32 on the cache's device: an int for every sequence, a tensor, or None (every entry full)."""
    if cache_seqlens is None:
        return torch.full((batch,), capacity - seqlen_new, dtype=torch.int32, device=device)
    if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, (int, torch.Tensor)):
        raise TypeError(f"cache_seqlens must be an int, an int32 tensor (batch,) or None, got "
                        f"{type(cache_seqlens).__name__}")
    if isinstance(cache_seqlens, int):
        if not 0 <= cache_seqlens <= capacity - seqlen_new:
            extra = f" plus {seqlen_new} new keys" if seqlen_new else ""
            raise ValueError(f"cache_seqlens = {cache_seqlens}{extra} must fit the cache: cache_seqlens must be in "
                             f"[0, {capacity - seqlen_new}] (the cache holds {capacity} keys per sequence)")
        return torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    if cache_seqlens.dtype != torch.int32 or cache_seqlens.dim() != 1 or cache_seqlens.shape[0] != batch:
        _check_index_tensor("cache_seqlens", cache_seqlens, batch, "(batch,)")
    if cache_seqlens.device != device:
        raise ValueError(f"cache_seqlens must be on the cache's device ({device}), got {cache_seqlens.device}")
    return cache_seqlens


def _check_values(lens, seqlen_new, capacity, page_table, page_size, cache_batch_idx, entries):
    """The values the kernels would clamp, read in one device-to-host copy (eager mode only). `entries`: the
    caches' first dim (pages of a paged cache, entries of a contiguous one)."""
    parts = [lens.reshape(-1)]
    if page_table is not None:
        parts.append(page_table.reshape(-1))
    if cache_batch_idx is not None:
        parts.append(cache_batch_idx.reshape(-1))
    values = torch.cat(parts).tolist() if len(parts) > 1 else parts[0].tolist()
    batch = lens.shape[0]
    lens_v = values[:batch]
    for b, n in enumerate(lens_v):
        if not 0 <= n <= capacity - seqlen_new:
            raise ValueError(f"flash_attn_with_kvcache: cache_seqlens[{b}] = {n} must be in [0, capacity - seqlen_new = "
                             f"{capacity - seqlen_new}] (the cache holds {capacity} keys per sequence, {seqlen_new} "
                             f"new ones are appended)")
    at = batch
    if page_table is not None:
        pages_per_seq = page_table.shape[1]
        for b, n in enumerate(lens_v):
            used = -(-(n + seqlen_new) // page_size)  # the slots this sequence's keys occupy
            for slot in range(used):
                page = values[at + b * pages_per_seq + slot]
                if not 0 <= page < entries:
                    raise ValueError(f"flash_attn_with_kvcache: page_table[{b}, {slot}] = {page} is not a page of the "
                                     f"cache (0..{entries - 1}); sequence {b} uses slots 0..{used - 1}")
        at += batch * pages_per_seq
    if cache_batch_idx is not None:
        for b in range(batch):
            if not 0 <= values[at + b] < entries:
                raise ValueError(f"flash_attn_with_kvcache: cache_batch_idx[{b}] = {values[at + b]} is not an entry of "
                                 f"the cache (0..{entries - 1})")


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, cache_batch_idx=None,
                            page_table=None, softmax_scale=None, causal=False, window_size=NO_WINDOW, softcap=0.0,
                            num_splits=0, pack_gqa=None, sm_margin=0, return_softmax_lse=False, check_values=None,
                            q_descale=None, k_descale=None, v_descale=None, **not_yet):
    """Attention of q over a KV cache, after appending k and v to it in place (FA3's flash_attn_with_kvcache).

    Args:
        q: (batch, seqlen_q, nheads, headdim), fp16, bf16 or FP8 (torch.float8_e4m3fn) on an sm_90 GPU; headdim
            a multiple of 8 up to 256 (of 16 for FP8).
        k_cache, v_cache: q's dtype and device, nheads a multiple of nheads_kv, their last dim contiguous, either
            contiguous caches (entries, seqlen_cache, nheads_kv, headdim), or with page_table paged caches
            (num_pages, page_size, nheads_kv, headdim), page_size a multiple of 16.
        k, v: optional new keys and values (batch, seqlen_new, nheads_kv, headdim), written into the caches at
            positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 of sequence b before the attention.
        cache_seqlens: the keys sequence b holds before the append: an int for all, an int32 tensor (batch,),
            or None (every sequence holds the whole capacity; then nothing can be appended).
        cache_batch_idx: int32 (batch,): the entry of a contiguous cache that sequence b uses (default b).
        page_table: int32 (batch, pages_per_seq): the pages of sequence b, in order; its capacity is
            pages_per_seq * page_size keys.
        softmax_scale, causal, window_size, softcap: as in flash_attn_func; the masks align to the
            bottom-right corner of sequence b's (seqlen_q, cache_seqlens[b] + seqlen_new) block, so a new token
            sees the whole cache and the new tokens up to itself.
        num_splits: how many CTAs share one sequence's keys (decode kernel): 0 = chosen from the shapes (enough
            CTAs to fill the GPU), 1..128 = that many; the results agree within rounding.
        pack_gqa, sm_margin: FA3's speed hints, accepted and ignored (the decode kernel always packs).
        return_softmax_lse: also return lse (batch, nheads, seqlen_q), float32.
        check_values: read the values of cache_seqlens, page_table and cache_batch_idx to the host and raise
            ValueError naming any out of range (None: in eager mode, not under torch.compile or CUDA graph
            capture; False: never, for eager decoding loops, where that device-to-host copy would wait for
            the GPU on every step; True: always, where it can). Unchecked values are clamped on the device:
            memory-safe, but the results of out-of-range values are not defined.
        q_descale, k_descale, v_descale: FP8 only: float32 (batch, nheads_kv) factors (None = 1); a stored value x
            of q stands for x * q_descale[b, kv_head], of the caches and k, v likewise (flash_ext.fp8).

    Returns out (batch, seqlen_q, nheads, headdim) in q's dtype (bf16 for FP8), or (out, lse). A sequence without keys gets
    out = 0 and lse = -inf. Forward only (no autograd).
    """
    if not_yet:
        _reject_not_yet(not_yet)
    if not (isinstance(q, torch.Tensor) and isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor)):
        _check_tensors(q=q, k_cache=k_cache, v_cache=v_cache)
    if q.dim() != 4 or k_cache.dim() != 4:
        name, t = ("q", q) if q.dim() != 4 else ("k_cache", k_cache)
        raise ValueError(f"flash_attn_with_kvcache: {name} must have 4 dims, got shape {tuple(t.shape)}")
    batch, seqlen_q, nheads, headdim = q.shape
    nheads_kv = k_cache.shape[2]
    paged = page_table is not None
    seqlen_new = 0
    if k is not None:
        _check_tensors(k=k)
        if k.dim() != 4:
            raise ValueError(f"flash_attn_with_kvcache: k must have 4 dims, got shape {tuple(k.shape)}")
        seqlen_new = k.shape[1]
        if cache_seqlens is None and seqlen_new > 0:
            raise ValueError("flash_attn_with_kvcache: appending k and v needs cache_seqlens (where they go)")
    if paged:
        _check_tensors(page_table=page_table)
        if page_table.dim() != 2:
            raise ValueError(f"flash_attn_with_kvcache: page_table must be int32 (batch={batch}, pages_per_seq), got "
                             f"shape {tuple(page_table.shape)}")
        if cache_seqlens is None:
            raise ValueError("flash_attn_with_kvcache: a paged cache needs cache_seqlens")
        page_size = k_cache.shape[1]
        capacity = page_table.shape[1] * page_size
    else:
        page_size = 0
        capacity = k_cache.shape[1]
    scale = _softmax_scale(softmax_scale, headdim)
    if causal is not False and causal is not True:
        _check_bool("causal", causal)
    if return_softmax_lse is not False and return_softmax_lse is not True:
        _check_bool("return_softmax_lse", return_softmax_lse)
    if check_values is not None:
        _check_bool("check_values", check_values)
    if type(num_splits) is not int or not 0 <= num_splits <= 128:
        raise ValueError(f"flash_attn_with_kvcache: num_splits must be an int in [0, 128] (0 = chosen per call), got "
                         f"{num_splits!r}")
    window, softcap = _window_size(window_size), _softcap(softcap)
    if type(cache_seqlens) is torch.Tensor and cache_seqlens.dtype is torch.int32 and cache_seqlens.dim() == 1 \
            and cache_seqlens.shape[0] == batch and cache_seqlens.device == k_cache.device:
        lens = cache_seqlens  # the common case, checked in one line (host time per call)
    else:
        lens = _cache_seqlens(cache_seqlens, batch, capacity, seqlen_new, k_cache.device)
    if cache_batch_idx is not None:
        _check_index_tensor("cache_batch_idx", cache_batch_idx, batch, "(batch,)")
    device_values = paged or cache_batch_idx is not None or lens is cache_seqlens
    if device_values and check_values is not False and (check_values or _reads_values_now([lens])):
        if paged and (page_table.dtype != torch.int32 or page_table.shape[0] != batch):
            raise ValueError(f"flash_attn_with_kvcache: page_table must be int32 (batch={batch}, pages_per_seq), got "
                             f"{page_table.dtype} {tuple(page_table.shape)}")
        if paged and (page_size == 0 or page_size % 16):
            raise ValueError(f"flash_attn_with_kvcache: a paged cache's page size (k_cache.shape[1]) must be a "
                             f"positive multiple of 16, got {page_size}")
        _check_values(lens, seqlen_new, capacity, page_table, page_size, cache_batch_idx, k_cache.shape[0])

    # Few query rows per KV head, FP8, or a cache the varlen view cannot describe: the decode kernel, whose op
    # checks every tensor (csrc/arg_checks.cpp: check_decode; descales given with 16-bit tensors raise there).
    # Else the varlen attention kernels.
    fp8 = q.dtype == torch.float8_e4m3fn or q_descale is not None or k_descale is not None or v_descale is not None
    if paged or cache_batch_idx is not None or fp8 or seqlen_q * nheads <= DECODE_MAX_ROWS * max(nheads_kv, 1) \
            or not _entries_follow(k_cache, v_cache, batch):
        _require_extension()
        out, lse = torch.ops.flash_ext.decode(q, k_cache, v_cache, k, v, lens, cache_batch_idx, page_table, scale, causal,
                                              window[0], window[1], softcap, num_splits, q_descale, k_descale, v_descale)
        return (out, lse) if return_softmax_lse else out
    _check_for_varlen_path(q, k_cache, v_cache, k, v, nheads_kv)
    return _varlen_path(q, k_cache, v_cache, k, v, lens, seqlen_new, scale, causal, window, softcap,
                        return_softmax_lse)


def _reject_not_yet(not_yet):
    for name, value in not_yet.items():
        if name not in _NOT_YET:
            raise TypeError(f"flash_attn_with_kvcache() got an unexpected keyword argument '{name}'")
        if value is not None:
            raise NotImplementedError(f"flash_attn_with_kvcache: {name} is not supported by flash_ext yet (only None)")


def _entries_follow(k_cache, v_cache, batch):
    """Whether the first `batch` entries of each contiguous cache are one packed tensor (the varlen view)."""
    return batch <= 1 or all(c.stride(0) == c.shape[1] * c.stride(1) for c in (k_cache, v_cache))


def _check_for_varlen_path(q, k_cache, v_cache, k, v, nheads_kv):
    """The varlen path's op sees packed views, so the caches' and new keys' shapes are checked here."""
    batch, _, nheads, headdim = q.shape
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != headdim or k_cache.shape[0] < batch:
        raise ValueError(f"flash_attn_with_kvcache: k_cache and v_cache must be (entries >= {batch}, seqlen_cache, "
                         f"nheads_kv, headdim={headdim}), got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if (k is None) != (v is None):
        raise ValueError("flash_attn_with_kvcache: k and v (the new keys and values) must be given together")
    if k is not None:
        _check_tensors(v=v)
        if k.shape != v.shape or k.shape[0] != batch or k.shape[2:] != k_cache.shape[2:]:
            raise ValueError(f"flash_attn_with_kvcache: k and v must be (batch, seqlen_new, nheads_kv, headdim) = "
                             f"({batch}, {k.shape[1]}, {nheads_kv}, {headdim}), got {tuple(k.shape)} and "
                             f"{tuple(v.shape)}")
        if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
            raise TypeError(f"flash_attn_with_kvcache: k and v must have the caches' dtype {k_cache.dtype}, got "
                            f"{k.dtype} and {v.dtype}")


def _varlen_path(q, k_cache, v_cache, k, v, lens, seqlen_new, scale, causal, window, softcap, return_softmax_lse):
    """A contiguous cache whose entries follow each other, many query rows: the cache's entries are the
    sequences of a varlen call (cu_seqlens every seqlen_cache rows, seqused_k = cache_seqlens + seqlen_new)."""
    _require_varlen_ops()
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_cache, nheads_kv = k_cache.shape[1], k_cache.shape[2]
    device = k_cache.device
    if seqlen_new > 0:
        # Row cache_seqlens[b] + j of entry b, clamped into the entry (values the checks did not read).
        rows = (lens.long()[:, None] + torch.arange(seqlen_new, device=device)).clamp_(0, seqlen_cache - 1)
        flat = (torch.arange(batch, device=device)[:, None] * seqlen_cache + rows).reshape(-1)
        for cache, new in ((k_cache, k), (v_cache, v)):
            cache[:batch].view(batch * seqlen_cache, nheads_kv, headdim).index_copy_(0, flat,
                                                                                    new.reshape(-1, nheads_kv, headdim))
    used_k = (lens + seqlen_new).clamp_(0, seqlen_cache).to(torch.int32)
    cu_q = torch.arange(0, (batch + 1) * seqlen_q, max(seqlen_q, 1), dtype=torch.int32, device=device)[:batch + 1]
    cu_k = torch.arange(0, (batch + 1) * seqlen_cache, max(seqlen_cache, 1), dtype=torch.int32, device=device)[:batch + 1]
    if seqlen_q == 0:
        cu_q = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    if seqlen_cache == 0:
        cu_k = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    out, lse = torch.ops.flash_ext.fwd_varlen(
        q.reshape(batch * seqlen_q, nheads, headdim), k_cache[:batch].view(batch * seqlen_cache, nheads_kv, headdim),
        v_cache[:batch].view(batch * seqlen_cache, nheads_kv, headdim), cu_q, cu_k, None, used_k, seqlen_q,
        seqlen_cache, scale, causal, window[0], window[1], softcap)
    out = out.view(batch, seqlen_q, nheads, headdim)
    if not return_softmax_lse:
        return out
    return out, lse.view(nheads, batch, seqlen_q).permute(1, 0, 2).contiguous()
