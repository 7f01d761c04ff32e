"""flash_ext.sdpa: torch.nn.functional.scaled_dot_product_attention's signature and (batch, heads, seq, dim)
layout over flash_ext's kernels, so that SDPA call sites switch by name. Differentiable (fp16/bf16)."""
import torch

from .interface import _check_bool, attention


def _check_sdpa_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"sdpa: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"sdpa: {name} must be 4-D (batch, heads, seq, dim), got shape {tuple(t.shape)}")


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
    scale=None, enable_gqa=False) with SDPA's semantics:

    - query (batch, heads, L, E), key and value (batch, heads_kv, S, E); returns (batch, heads, L, E), a view
      of flash_ext's (batch, L, heads, E) output.
    - is_causal is SDPA's top-left aligned mask (query i sees keys 0..i), for any L and S.
    - heads_kv != heads needs enable_gqa=True, as in SDPA.
    - Only attn_mask=None and dropout_p=0.0 are supported: anything else raises NotImplementedError.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check_sdpa_tensor(name, t)
    if attn_mask is not None:
        raise NotImplementedError("sdpa: attn_mask is not supported by flash_ext (only None; use is_causal=True "
                                  "for a causal mask)")
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool) or dropout_p != 0.0:
        raise NotImplementedError(f"sdpa: dropout_p={dropout_p!r} is not supported by flash_ext (only 0.0)")
    _check_bool("is_causal", is_causal)
    _check_bool("enable_gqa", enable_gqa)
    if key.shape[1] != value.shape[1]:
        raise ValueError(f"sdpa: key and value must have the same number of heads, got {key.shape[1]} and "
                         f"{value.shape[1]}")
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(f"sdpa: query has {query.shape[1]} heads and key/value {key.shape[1]}: pass "
                         "enable_gqa=True for grouped-query attention, as scaled_dot_product_attention requires")
    # (batch, heads, seq, dim) -> (batch, seq, heads, dim) views: the kernels take strided views with a
    # contiguous head dim.
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    if not is_causal or seqlen_q == seqlen_k:
        out = attention(q, k, v, scale, is_causal)[0]
    elif seqlen_q < seqlen_k:
        # Top-left causal: query i sees keys 0..i, so keys from seqlen_q on are seen by no query, and the
        # rest is the square causal case.
        out = attention(q, k[:, :seqlen_q], v[:, :seqlen_q], scale, True)[0]
    else:
        # Queries 0..S-1 see keys 0..i (square causal); queries from S on see every key.
        first = attention(q[:, :seqlen_k], k, v, scale, True)[0]
        rest = attention(q[:, seqlen_k:], k, v, scale, False)[0]
        out = torch.cat((first, rest), dim=1)
    return out.transpose(1, 2)
