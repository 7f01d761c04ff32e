"""The correctness check: a float64 reference on a slice of each shape, the error baseline and the verdict.

The slice is batch 0, the first REF_HEADS query heads (and the kv heads they read) and all query rows,
unless its score matrix would exceed REF_MAX_ELEMS elements: then the last rows, since a tail of queries
with all keys is itself a bottom-right-aligned problem with the same band (causal, window), so the mask
stays exact. The shape's window and softcap apply to the reference and the baseline. A varlen row (packed,
(1, total, h, d)) is checked on whole sequences from the first, as many as fit REF_MAX_ELEMS, with the
varlen references.
"""
import dataclasses
import math

import torch

from ..reference import (attention_autograd, attention_lowp, attention_ref, attention_varlen_autograd,
                         attention_varlen_lowp, attention_varlen_ref)

REF_HEADS = 2
REF_MAX_ELEMS = 1 << 29
GRAD_NAMES = ("dq", "dk", "dv")

# A small absolute slack on top of 2x the error of PyTorch's own attention in the same dtype (the
# criterion of FlashAttention's test suite), scaled by max(1, max|ref|) so that it stays meaningful
# when values are large.
ABS_SLACK = {"fp16": 1e-3, "bf16": 1e-3, "fp8": 6e-2}
# Used when the low-precision baseline is not finite. bf16 keeps 8 significant bits: one ulp at |x| ~ 2
# is 1.6e-2, so 2e-2 allows one ulp of disagreement at typical output magnitudes and still catches a
# wrong mask, scale or layout (errors of order 0.1-1). fp16 has 3 more bits; fp8 (e4m3) keeps 4 bits
# and FP8 kernels also quantize P.
FALLBACK_TOL = {"fp16": 4e-3, "bf16": 2e-2, "fp8": 1.5e-1}


def tolerance(dtype_name, math_err=None, ref_absmax=1.0):
    """The largest max-abs error a backend may show vs the float64 reference on the slice."""
    scale = max(1.0, float(ref_absmax)) if ref_absmax is not None and math.isfinite(ref_absmax) else 1.0
    if math_err is not None and math.isfinite(math_err):
        return 2.0 * float(math_err) + ABS_SLACK.get(dtype_name, 1e-3) * scale
    return FALLBACK_TOL.get(dtype_name, 2e-2) * scale


def verdict(err, tol):
    """(passed, reason). NaN/inf errors never pass."""
    if err is None:
        return True, "unchecked"
    if not math.isfinite(err):
        return False, "non-finite values (NaN/inf) in the output"
    if err > tol:
        return False, f"max abs error {err:.3g} > tolerance {tol:.3g} vs the float64 reference"
    return True, ""


def max_abs_err(x, ref):
    """max |x - ref| in float64; NaN when x has NaN/inf."""
    x = x.to(torch.float64)
    if not bool(torch.isfinite(x).all()):
        return float("nan")
    return float((x - ref).abs().max())


@dataclasses.dataclass
class SliceRef:
    rows: slice  # query rows checked (all, or the last ones; varlen: the first sequences' rows)
    hq: int  # query heads checked: 0 .. hq-1 of batch 0
    hkv: int  # kv heads they read: 0 .. hkv-1
    # key rows checked: all (dense), those of the same sequences (varlen)
    k_rows: slice = dataclasses.field(default_factory=lambda: slice(None))
    out: torch.Tensor = None  # float64 (1, rows, hq, d)
    tol_out: float = None
    grads: dict = None  # name -> float64 reference gradient on the slice
    tol_grads: dict = None
    note: str = ""

    def q_slice(self, t):
        return t[0:1, self.rows, : self.hq]

    def kv_slice(self, t):
        return t[0:1, self.k_rows, : self.hkv]


def _grads(q, k, v, dout, scale, shape, dtype):
    """{dq, dk, dv} of attention_autograd run in `dtype`: float64 is the reference, else the baseline."""
    # Leaves in `dtype` itself: a float64 gradient flowing into a 16-bit leaf would be rounded.
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    out, _ = attention_autograd(*leaves, softmax_scale=scale, causal=shape.causal, upcast=dtype == torch.float64,
                                window_size=shape.window, softcap=shape.softcap)
    return dict(zip(GRAD_NAMES, torch.autograd.grad(out, leaves, dout.to(dtype))))


def _varlen_grads(q, k, v, dout, cu, scale, shape, dtype):
    """_grads for packed rows (total, h, d) of sequences with offsets cu, in the runner's (1, total, h, d)."""
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    out, _ = attention_varlen_autograd(*leaves, cu, cu, softmax_scale=scale, causal=shape.causal,
                                       upcast=dtype == torch.float64, window_size=shape.window, softcap=shape.softcap)
    grads = torch.autograd.grad(out, leaves, dout.to(dtype))
    return {n: g[None] for n, g in zip(GRAD_NAMES, grads)}


def _build_varlen_reference(q, k, v, dout, shape, scale, dtype_name, need_bwd):
    """build_reference for a packed row: the first sequences whose score matrices fit REF_MAX_ELEMS (at least
    one), all their rows and keys, the first REF_HEADS query heads."""
    group = shape.nheads // shape.nheads_kv
    hq = min(REF_HEADS, shape.nheads)
    hkv = hq if group == 1 else 1
    count, elems = 0, 0
    while count < len(shape.seqlens) and (count == 0 or elems + hq * shape.seqlens[count] ** 2 <= REF_MAX_ELEMS):
        elems += hq * shape.seqlens[count] ** 2
        count += 1
    rows = slice(0, sum(shape.seqlens[:count]))
    ref = SliceRef(rows=rows, hq=hq, hkv=hkv, k_rows=rows)
    if count < len(shape.seqlens):
        ref.note = f"checked the first {count} of {len(shape.seqlens)} sequences"
    cu = torch.tensor([0] + [sum(shape.seqlens[:i + 1]) for i in range(count)], dtype=torch.int32, device=q.device)
    work = torch.bfloat16 if dtype_name == "fp8" else q.dtype
    qs, ks, vs = (t[0, rows, :h].to(work).contiguous() for t, h in ((q, hq), (k, hkv), (v, hkv)))
    mask = dict(causal=shape.causal, window_size=shape.window, softcap=shape.softcap)
    out, _ = attention_varlen_ref(qs, ks, vs, cu, cu, softmax_scale=scale, **mask)
    ref.out = out[None]
    baseline_err = max_abs_err(attention_varlen_lowp(qs, ks, vs, cu, cu, softmax_scale=scale, **mask)[None], ref.out)
    ref.tol_out = tolerance(dtype_name, baseline_err, float(ref.out.abs().max()))
    if need_bwd:
        dos = dout[0, rows, :hq].to(work).contiguous()
        g64 = _varlen_grads(qs, ks, vs, dos, cu, scale, shape, torch.float64)
        glow = _varlen_grads(qs, ks, vs, dos, cu, scale, shape, work)
        # Whole sequences: dk/dv are checkable when every query head reading the kv heads is in the slice.
        names = GRAD_NAMES if hq == hkv * group else ("dq",)
        ref.grads = {n: g64[n] for n in names}
        ref.tol_grads = {
            n: tolerance(dtype_name, max_abs_err(glow[n], g64[n]), float(g64[n].abs().max())) for n in names
        }
    return ref


def build_reference(q, k, v, dout, shape, scale, dtype_name, need_bwd):
    """The float64 reference on the slice, with tolerances from the low-precision baseline's error."""
    if shape.is_varlen():
        return _build_varlen_reference(q, k, v, dout, shape, scale, dtype_name, need_bwd)
    sq, sk = shape.seqlen_q, shape.seqlen_k
    group = shape.nheads // shape.nheads_kv
    hq = min(REF_HEADS, shape.nheads)
    hkv = hq if group == 1 else 1  # with groups of >= 2 the first hq (<= 2) query heads all read kv head 0
    nrows = sq if hq * sq * sk <= REF_MAX_ELEMS else max(1, REF_MAX_ELEMS // (hq * sk))
    ref = SliceRef(rows=slice(sq - nrows, sq), hq=hq, hkv=hkv)
    if nrows < sq:
        ref.note = f"checked the last {nrows} of {sq} query rows"
    work = torch.bfloat16 if dtype_name == "fp8" else q.dtype  # fp8 values are exact in bf16
    qs = ref.q_slice(q).to(work).contiguous()
    ks = ref.kv_slice(k).to(work).contiguous()
    vs = ref.kv_slice(v).to(work).contiguous()
    mask = dict(causal=shape.causal, window_size=shape.window, softcap=shape.softcap)
    ref.out, _ = attention_ref(qs, ks, vs, softmax_scale=scale, **mask)
    baseline_err = max_abs_err(attention_lowp(qs, ks, vs, softmax_scale=scale, **mask), ref.out)
    ref.tol_out = tolerance(dtype_name, baseline_err, float(ref.out.abs().max()))
    if need_bwd:
        dos = ref.q_slice(dout).to(work).contiguous()
        g64 = _grads(qs, ks, vs, dos, scale, shape, torch.float64)
        glow = _grads(qs, ks, vs, dos, scale, shape, work)
        # dk/dv of a kv head sum over every query row of every query head that reads it: checkable only
        # when all of those are in the slice.
        names = GRAD_NAMES if nrows == sq and hq == hkv * group else ("dq",)
        ref.grads = {n: g64[n] for n in names}
        ref.tol_grads = {
            n: tolerance(dtype_name, max_abs_err(glow[n], g64[n]), float(g64[n].abs().max())) for n in names
        }
    return ref


def check_result(mode, outs, ref):
    """(max_err, tol, err_detail, checked slice) of a backend's output (fwd) or (dq, dk, dv) (bwd).

    The checked slice (the output, or dq) is returned as a float64 copy, so that the backend's full
    result can be freed while it is kept for the diff against flash_ext."""
    if mode == "fwd":
        got = ref.q_slice(outs)
        return max_abs_err(got, ref.out), ref.tol_out, None, got.to(torch.float64, copy=True)
    dq, dk, dv = outs
    got = {"dq": ref.q_slice(dq), "dk": ref.kv_slice(dk), "dv": ref.kv_slice(dv)}
    detail = {n: [max_abs_err(got[n], g), ref.tol_grads[n]] for n, g in ref.grads.items()}
    # The record shows the gradient worst relative to its own tolerance; a NaN error is the worst.
    err, tol = max(detail.values(), key=lambda et: et[0] / et[1] if math.isfinite(et[0]) else math.inf)
    return err, tol, detail, got["dq"].to(torch.float64, copy=True)
