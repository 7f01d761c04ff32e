"""FlashAttention-3-compatible entry points (flash_attn_interface's names and keywords), so that its users
swap one import. An FA3 argument flash_ext does not support yet raises NotImplementedError naming it,
unless it has its neutral default."""
import torch

from .interface import _check_bool, attention, forward

# FA3 keywords flash_ext does not implement yet, with the value that turns each of them off.
_NEUTRAL = {
    "qv": None,
    "attention_chunk": 0,
    "num_splits": 1,
    "pack_gqa": None,
    "sm_margin": 0,
}


def _reject_unsupported(function, **kwargs):
    for name, value in kwargs.items():
        neutral = _NEUTRAL[name]
        if value is not neutral and value != neutral:
            raise NotImplementedError(
                f"{function}: {name}={value!r} is not supported by flash_ext yet (only its default {neutral!r})"
            )


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None,
                    window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
                    deterministic=False, sm_margin=0, return_attn_probs=False):
    """Attention with FA3's signature: q (batch, seqlen_q, nheads, headdim), k/v (batch, seqlen_k, nheads_kv,
    headdim); causal aligned bottom-right; differentiable (deterministic selects the deterministic backward).
    FP8 (torch.float8_e4m3fn) q, k, v with q_descale/k_descale/v_descale (float32 (batch, nheads_kv), None =
    1) run the FP8 forward, which returns bf16 and is not differentiable.
    window_size=(left, right) (sliding window, -1 = unbounded) and softcap (c * tanh(s / c) on the logits,
    0 = off) as in flash_ext.forward, forward and backward. One difference from FA3: FA3 silently sets the
    right bound to 0 when causal=True, while here causal=True with a right bound other than -1 or 0 raises
    ValueError (the op's check): pass window_size=(left, 0) or (left, -1) with causal, or causal=False
    with (left, right) for a band that looks ahead.
    Returns out, or (out, softmax_lse) with return_attn_probs=True, as FA3 does."""
    _reject_unsupported("flash_attn_func", qv=qv, attention_chunk=attention_chunk, num_splits=num_splits,
                        pack_gqa=pack_gqa, sm_margin=sm_margin)
    if not isinstance(return_attn_probs, bool):
        raise TypeError(f"return_attn_probs must be a bool, got {type(return_attn_probs).__name__}")
    if any(t is not None for t in (q_descale, k_descale, v_descale)) or (
            isinstance(q, torch.Tensor) and q.dtype == torch.float8_e4m3fn):
        _check_bool("deterministic", deterministic)  # FP8 is forward-only: the switch has nothing to select
        out, lse = forward(q, k, v, softmax_scale, causal, q_descale, k_descale, v_descale, window_size=window_size,
                           softcap=softcap)
    else:
        out, lse = attention(q, k, v, softmax_scale, causal, deterministic, window_size=window_size, softcap=softcap)
    return (out, lse) if return_attn_probs else out


def _unpack_qkv(qkv, num_heads_q):
    """FA3's packed layouts: (batch, seqlen, 3, nheads, headdim), or (batch, seqlen, nheads_q + 2 * nheads_kv,
    headdim) with num_heads_q given. Returns views of q, k, v."""
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"flash_attn_qkvpacked_func: qkv must be a torch.Tensor, got {type(qkv).__name__}")
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise ValueError("flash_attn_qkvpacked_func: a 5-D qkv must be (batch, seqlen, 3, nheads, headdim), "
                             f"got shape {tuple(qkv.shape)}")
        if num_heads_q is not None:
            raise ValueError("flash_attn_qkvpacked_func: num_heads_q is only for a 4-D qkv "
                             "(batch, seqlen, nheads_q + 2 * nheads_kv, headdim)")
        return qkv.unbind(dim=2)
    if qkv.dim() == 4:
        if isinstance(num_heads_q, bool) or not isinstance(num_heads_q, int):
            raise ValueError("flash_attn_qkvpacked_func: a 4-D qkv (batch, seqlen, nheads_q + 2 * nheads_kv, "
                             f"headdim) needs num_heads_q (an int), got {num_heads_q!r}")
        num_heads_kv2 = qkv.shape[2] - num_heads_q
        if num_heads_q <= 0 or num_heads_kv2 <= 0 or num_heads_kv2 % 2 != 0:
            raise ValueError(f"flash_attn_qkvpacked_func: qkv's {qkv.shape[2]} heads are not num_heads_q="
                             f"{num_heads_q} plus twice a positive number of KV heads")
        return qkv.split([num_heads_q, num_heads_kv2 // 2, num_heads_kv2 // 2], dim=2)
    raise ValueError("flash_attn_qkvpacked_func: qkv must be 5-D (batch, seqlen, 3, nheads, headdim) or 4-D "
                     f"(batch, seqlen, nheads_q + 2 * nheads_kv, headdim), got shape {tuple(qkv.shape)}")


def flash_attn_qkvpacked_func(qkv, softmax_scale=None, causal=False, q_descale=None, k_descale=None, v_descale=None,
                              window_size=(-1, -1), attention_chunk=0, softcap=0.0, deterministic=False,
                              num_heads_q=None, sm_margin=0, return_attn_probs=False):
    """FA3's flash_attn_qkvpacked_func: q, k and v stacked in one tensor (see _unpack_qkv), otherwise as
    flash_attn_func (window_size and softcap included). Differentiable (the gradient lands in qkv's layout)."""
    _reject_unsupported("flash_attn_qkvpacked_func", attention_chunk=attention_chunk, sm_margin=sm_margin)
    q, k, v = _unpack_qkv(qkv, num_heads_q)
    return flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, q_descale=q_descale,
                           k_descale=k_descale, v_descale=v_descale, window_size=window_size, softcap=softcap,
                           deterministic=deterministic, return_attn_probs=return_attn_probs)
