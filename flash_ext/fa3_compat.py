"""FlashAttention-3-compatible entry points (flash_attn_interface's names and keywords), so that its users
swap one import. An FA3 argument flash_ext does not support yet raises NotImplementedError naming it,
unless it has its neutral default."""
import operator

import torch

from .interface import (_check_bool, _check_tensors, _require_extension, _softcap, _softmax_scale, _window_size,
                        attention, forward)
from .ops import has_varlen_ops

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
            shown = f"<a tensor of shape {tuple(value.shape)}>" if isinstance(value, torch.Tensor) else repr(value)
            raise NotImplementedError(
                f"{function}: {name}={shown} is not supported by flash_ext yet (only its default {neutral!r})"
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


# ----------------------------------------------------------------------------------------------------------
# Variable-length batches
# ----------------------------------------------------------------------------------------------------------

def _check_index_tensor(name, t, length, what):
    """An int32 1-D tensor of `length` entries (None: any length); `what` says what those entries are."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be torch.int32, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D {what}, got shape {tuple(t.shape)}")
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{name} must have shape {what} = ({length},), got ({t.shape[0]},)")


def _max_seqlen(name, value):
    """max_seqlen_q / max_seqlen_k as an int >= 0 (a SymInt under torch.compile stays one)."""
    if isinstance(value, torch.SymInt):
        return value
    # A tensor would be read to the host (a sync, and a graph break under torch.compile): ints only, as FA3.
    if isinstance(value, (bool, torch.Tensor)) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = operator.index(value)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def _check_varlen_layout(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
    """The metadata rules of a varlen call (ranks, dtypes and lengths, no values): cheap, so they run under
    torch.compile too. The op checks the rest of the tensor rules (dtypes of q, k, v, heads, strides,
    devices)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            what = "(total_q, nheads, headdim)" if name == "q" else "(total_k, nheads_kv, headdim)"
            raise ValueError(f"flash_attn_varlen_func: {name} must have 3 dims {what}, got shape {tuple(t.shape)}")
    if any(t.dtype == torch.float8_e4m3fn for t in (q, k, v)):
        raise NotImplementedError("flash_attn_varlen_func: FP8 (torch.float8_e4m3fn) inputs are not supported for "
                                  "variable-length batches (the FP8 forward takes dense batches: flash_attn_func)")
    _check_index_tensor("cu_seqlens_q", cu_seqlens_q, None, "(batch + 1,)")
    _check_index_tensor("cu_seqlens_k", cu_seqlens_k, None, "(batch + 1,)")
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
                         f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    if cu_seqlens_q.shape[0] < 1:
        raise ValueError("cu_seqlens_q must have batch + 1 >= 1 entries (the first one 0), got 0")
    batch = cu_seqlens_q.shape[0] - 1
    for name, t in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if t is not None:
            _check_index_tensor(name, t, batch, "(batch,)")


def _host_lists(tensors):
    """The values of small int32 tensors as Python lists: one device-to-host copy when they share a device."""
    if len({t.device for t in tensors}) == 1 and len(tensors) > 1:
        flat = torch.cat(tensors).tolist()
        out, start = [], 0
        for t in tensors:
            out.append(flat[start:start + t.shape[0]])
            start += t.shape[0]
        return out
    return [t.tolist() for t in tensors]


def _reads_values_now(tensors):
    """Whether the value checks may read the offsets to the host: not while torch.compile traces (no data),
    not during CUDA graph capture (a copy to the host would break it), not for meta tensors."""
    if torch.compiler.is_compiling():
        return False
    if any(t.device.type == "meta" for t in tensors):
        return False
    if any(t.is_cuda for t in tensors) and torch.cuda.is_current_stream_capturing():
        return False
    return True


def _check_offsets(name, offsets, total, rows):
    """cu_seqlens_q / cu_seqlens_k: first 0, non-decreasing, last = the total number of rows."""
    if offsets[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {offsets[0]}")
    for i in range(1, len(offsets)):
        if offsets[i] < offsets[i - 1]:
            raise ValueError(f"{name} must be non-decreasing: {name}[{i}] = {offsets[i]} < {name}[{i - 1}] = "
                             f"{offsets[i - 1]}")
    if offsets[-1] != total:
        raise ValueError(f"{name}[-1] (index {len(offsets) - 1}) = {offsets[-1]} must equal {rows}.shape[0] = {total}, "
                         f"the total number of {rows} rows")


def _check_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k):
    """The value rules of the offsets, used lengths and maximum lengths, read on the host (one copy).
    ValueError naming the argument and the offending index."""
    tensors = [cu_seqlens_q, cu_seqlens_k] + [t for t in (seqused_q, seqused_k) if t is not None]
    values = _host_lists(tensors)
    cu_q, cu_k = values[0], values[1]
    used = dict(zip([n for n, t in (("seqused_q", seqused_q), ("seqused_k", seqused_k)) if t is not None], values[2:]))
    _check_offsets("cu_seqlens_q", cu_q, q.shape[0], "q")
    _check_offsets("cu_seqlens_k", cu_k, k.shape[0], "k")
    for side, offsets, max_seqlen in (("q", cu_q, max_seqlen_q), ("k", cu_k, max_seqlen_k)):
        lengths = [offsets[b + 1] - offsets[b] for b in range(len(offsets) - 1)]
        if lengths and not isinstance(max_seqlen, torch.SymInt):
            longest = max(range(len(lengths)), key=lengths.__getitem__)
            if max_seqlen < lengths[longest]:
                raise ValueError(f"max_seqlen_{side} = {max_seqlen} is smaller than the longest sequence: sequence "
                                 f"{longest} has {lengths[longest]} rows (cu_seqlens_{side}[{longest + 1}] - "
                                 f"cu_seqlens_{side}[{longest}])")
        name = f"seqused_{side}"
        for b, n in enumerate(used.get(name, ())):
            if not 0 <= n <= lengths[b]:
                raise ValueError(f"{name}[{b}] = {n} is out of range: sequence {b} has {lengths[b]} rows "
                                 f"(cu_seqlens_{side}[{b + 1}] - cu_seqlens_{side}[{b}]), so it must be in "
                                 f"[0, {lengths[b]}]")


def _require_varlen_ops():
    _require_extension()
    if not has_varlen_ops():
        raise RuntimeError("this build of flash_ext has no variable-length ops (torch.ops.flash_ext.fwd_varlen, "
                           "bwd_varlen); rebuild it from a checkout that has them")


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                           v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    """Attention over a batch of variable-length sequences packed without padding, with FA3's signature.

    Args:
        q: (total_q, nheads, headdim), fp16 or bf16, CUDA (sm_90); k, v: (total_k, nheads_kv, headdim), same
            dtype, nheads a multiple of nheads_kv (GQA/MQA). Head dim contiguous (any other strides the dense
            op takes). FP8 is not supported here (NotImplementedError, and for q_descale/k_descale/v_descale).
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) on q's device: sequence b owns rows
            cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k and v.
            Each starts at 0, never decreases and ends at q.shape[0] (k.shape[0]).
        max_seqlen_q, max_seqlen_k: ints >= the longest sequence of q (of k).
        seqused_q, seqused_k: optional int32 (batch,): only the first seqused_q[b] rows of sequence b (its
            first seqused_k[b] keys) take part, each in [0, the sequence's length].
        softmax_scale, causal, window_size, softcap, deterministic: as in flash_attn_func, per sequence: the
            causal mask and the window align to the bottom-right corner of each sequence's own
            (seqlen_q_b, seqlen_k_b) block (the used lengths where seqused is given).
        return_attn_probs: also return softmax_lse.

    Returns:
        out (total_q, nheads, headdim) in q's dtype, or (out, softmax_lse) with return_attn_probs=True,
        softmax_lse float32 (nheads, total_q) (FA3's varlen layout). Rows outside every sequence's used
        range, rows that see no key and every row of a sequence without keys get out = 0 and lse = -inf;
        their gradients and those of unused k/v rows are 0. Differentiable (dlse included).

    Checks: every argument's Python type and the tensors' ranks, dtypes and lengths are checked on every call,
    the rest of the tensor rules by the op. The VALUES of cu_seqlens_q/k, seqused_q/k and the maximum lengths
    (the rules above) are checked in eager mode only, by reading those small tensors to the host (one
    device-to-host copy, which waits for the GPU): under torch.compile, while a CUDA graph is captured, or
    with meta tensors they are skipped and their correctness is the caller's responsibility (the kernels
    stay memory-safe for any values, but compute garbage for bad ones).
    """
    _reject_unsupported("flash_attn_varlen_func", qv=qv, attention_chunk=attention_chunk, num_splits=num_splits,
                        pack_gqa=pack_gqa, sm_margin=sm_margin)
    for name, t in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        if t is not None:
            raise NotImplementedError(f"flash_attn_varlen_func: {name} is not supported: flash_ext has no FP8 "
                                      "variable-length attention (only None)")
    _check_tensors(q=q, k=k, v=v)
    scale = _softmax_scale(softmax_scale, q.shape[-1] if q.dim() > 0 else 1)
    _check_bool("causal", causal)
    _check_bool("deterministic", deterministic)
    _check_bool("return_attn_probs", return_attn_probs)
    window, softcap = _window_size(window_size), _softcap(softcap)
    max_seqlen_q, max_seqlen_k = _max_seqlen("max_seqlen_q", max_seqlen_q), _max_seqlen("max_seqlen_k", max_seqlen_k)
    _check_varlen_layout(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    offsets = [t for t in (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k) if t is not None]
    if _reads_values_now(offsets):
        _check_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k)
    _require_varlen_ops()
    args = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, scale, causal)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = torch.ops.flash_ext.attention_varlen(q, k, v, *args, deterministic, window[0], window[1], softcap)
    else:
        out, lse = torch.ops.flash_ext.fwd_varlen(q, k, v, *args, window[0], window[1], softcap)
    return (out, lse) if return_attn_probs else out
