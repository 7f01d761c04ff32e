"""Merging attentions computed over disjoint parts of the keys (split-KV decoding, ring attention, chunked
prefill):

    out, lse = flash_ext.combine(out_partial, lse_partial)

Part i holds out_i = softmax(S_i) V_i over its keys and lse_i = logsumexp(S_i) (natural log, as
flash_ext.forward returns it). The attention over all the keys is

    lse = logsumexp_i(lse_i),    out = sum_i exp(lse_i - lse) * out_i.

A part whose row sees no key (lse_i = -inf) adds nothing, whatever its out_i holds; a row that no part
sees gets out = 0 and lse = -inf, as the forward gives it. The weights and the sum are computed in float32
(float64 when an input is float64), one part at a time, so the extra memory is one output in that precision.
Plain PyTorch operations: differentiable (ring attention's backward needs d lse_i), usable under
torch.compile and during CUDA-graph capture (no host synchronisation), on any device.
"""
import torch

__all__ = ["combine"]

_LAYOUTS = ("(num_splits, batch, seqlen, nheads, headdim) with lse_partial (num_splits, batch, nheads, seqlen), "
            "or varlen (num_splits, total, nheads, headdim) with lse_partial (num_splits, nheads, total)")


def _check(out_partial, lse_partial, out_dtype):
    for name, t in (("out_partial", out_partial), ("lse_partial", lse_partial)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.dtype.is_floating_point or t.dtype.itemsize < 2 or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if out_partial.dim() not in (4, 5):
        raise ValueError(f"out_partial must be {_LAYOUTS}; got out_partial of shape {tuple(out_partial.shape)}")
    if out_partial.shape[0] < 1:
        raise ValueError("out_partial must hold at least one part (num_splits >= 1), got 0")
    rows = out_partial.shape[:-1]  # (num_splits, ..., seqlen, nheads)
    expected = (*rows[:-2], rows[-1], rows[-2])
    if tuple(lse_partial.shape) != expected:
        raise ValueError(f"lse_partial must have shape {expected} for out_partial of shape {tuple(out_partial.shape)} "
                         f"({_LAYOUTS}); got {tuple(lse_partial.shape)}")
    if lse_partial.device != out_partial.device:
        raise ValueError(f"lse_partial must be on out_partial's device ({out_partial.device}), got {lse_partial.device}")
    if out_dtype is not None and (not isinstance(out_dtype, torch.dtype) or not out_dtype.is_floating_point):
        raise TypeError(f"out_dtype must be a floating-point torch.dtype or None, got {out_dtype!r}")


def combine(out_partial, lse_partial, out_dtype=None):
    """The attention over all keys from attentions over disjoint parts of them (see the module docstring).

    out_partial: (num_splits, batch, seqlen, nheads, headdim), lse_partial: (num_splits, batch, nheads, seqlen)
    (flash_ext.forward's layouts, stacked); or varlen (num_splits, total, nheads, headdim) and
    (num_splits, nheads, total) (flash_attn_varlen_func's). Returns out (out_partial's shape without the
    first dim, in out_dtype, default out_partial's dtype) and lse (lse_partial's likewise, float32, or
    float64 when an input is float64).
    """
    _check(out_partial, lse_partial, out_dtype)
    work = torch.float64 if torch.float64 in (out_partial.dtype, lse_partial.dtype) else torch.float32
    lse_rows = lse_partial.to(work).transpose(-1, -2)  # (num_splits, ..., seqlen, nheads): out_partial's rows
    lse_max = lse_rows.amax(dim=0)
    # Rows no part sees: subtract 0 instead of -inf, so that every weight is exp(-inf) = 0, not NaN.
    lse_max = torch.where(lse_max == -torch.inf, 0.0, lse_max)
    weights = torch.exp(lse_rows - lse_max)  # 0 for parts that see no key
    weight_sum = weights.sum(dim=0)
    seen = weight_sum > 0
    inv_sum = torch.where(seen, 1.0 / torch.where(seen, weight_sum, 1.0), 0.0)
    out = None
    for i in range(out_partial.shape[0]):
        coef = (weights[i] * inv_sum).unsqueeze(-1)
        # A part without keys adds nothing even where its out holds garbage (NaN * 0 would not), and passes
        # no NaN into the gradients either: the garbage is replaced before the product.
        term = torch.where(coef > 0, out_partial[i].to(work), 0.0) * coef
        out = term if out is None else out + term
    lse = torch.where(seen, lse_max + torch.log(torch.where(seen, weight_sum, 1.0)), -torch.inf)
    return out.to(out_dtype or out_partial.dtype), lse.transpose(-1, -2).contiguous()
