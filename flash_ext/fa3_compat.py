"""FlashAttention-3-compatible entry points (flash_attn_interface's names and keywords), so that its users
swap one import. An FA3 argument flash_ext does not support yet raises NotImplementedError naming it,
unless it has its neutral default."""
import torch

from .interface import _check_bool, attention, forward

# FA3 keywords flash_ext does not implement yet, with the value that turns each of them off.
_NEUTRAL = {
    "qv": None,
    "window_size": (-1, -1),
    "attention_chunk": 0,
    "softcap": 0.0,
    "num_splits": 1,
    "pack_gqa": None,
    "sm_margin": 0,
}


def _reject_unsupported(**kwargs):
    for name, value in kwargs.items():
        neutral = _NEUTRAL[name]
        if isinstance(neutral, tuple) and isinstance(value, (tuple, list)):
            value = tuple(value)
        if value is not neutral and value != neutral:
            raise NotImplementedError(
                f"flash_attn_func: {name}={value!r} is not supported by flash_ext yet (only its default {neutral!r})"
            )


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None,
                    window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
                    deterministic=False, sm_margin=0, return_attn_probs=False):
    """Attention with FA3's signature: q (batch, seqlen_q, nheads, headdim), k/v (batch, seqlen_k, nheads_kv,
    headdim); causal aligned bottom-right; differentiable (deterministic selects the deterministic backward).
    FP8 (torch.float8_e4m3fn) q, k, v with q_descale/k_descale/v_descale (float32 (batch, nheads_kv), None =
    1) run the FP8 forward, which returns bf16 and is not differentiable.
    Returns out, or (out, softmax_lse) with return_attn_probs=True, as FA3 does."""
    _reject_unsupported(qv=qv, window_size=window_size, attention_chunk=attention_chunk, softcap=softcap,
                        num_splits=num_splits, pack_gqa=pack_gqa, sm_margin=sm_margin)
    if not isinstance(return_attn_probs, bool):
        raise TypeError(f"return_attn_probs must be a bool, got {type(return_attn_probs).__name__}")
    if any(t is not None for t in (q_descale, k_descale, v_descale)) or (
            isinstance(q, torch.Tensor) and q.dtype == torch.float8_e4m3fn):
        _check_bool("deterministic", deterministic)  # FP8 is forward-only: the switch has nothing to select
        out, lse = forward(q, k, v, softmax_scale, causal, q_descale, k_descale, v_descale)
    else:
        out, lse = attention(q, k, v, softmax_scale, causal, deterministic)
    return (out, lse) if return_attn_probs else out
