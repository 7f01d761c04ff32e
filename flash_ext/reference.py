"""Pure-PyTorch attention references and a step-for-step emulation of the kernel's online softmax.

Layout everywhere: q (batch, seqlen_q, nheads, headdim), k/v (batch, seqlen_k, nheads_kv, headdim),
nheads a multiple of nheads_kv (query head h reads kv head h // (nheads // nheads_kv)). Masks are aligned
to the bottom-right corner: with window_size=(left, right) (each -1 = unbounded, or >= 0) query i sees key
j iff i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right; causal=True is the band with
right = 0 (so with causal the right bound must be -1 or 0). softcap=c > 0 replaces the logits
s = softmax_scale * q.k by c * tanh(s / c) before the softmax (0 = off); lse is the natural-log
logsumexp of the logits actually used. Queries that see no key get out = 0 and lse = -inf.

- attention_ref: the float64 ground truth (out, lse).
- attention_lowp: attention in the inputs' own dtype, the yardstick of FlashAttention's error rule
  (the kernel's max error vs attention_ref must stay within ~2x that of attention_lowp).
- attention_autograd: the same two computations (float64, or the inputs' dtype as PyTorch's math attention
  runs it), differentiable through torch.autograd and returning (out, lse): the reference of the backward.
- attention_varlen_ref / attention_varlen_lowp / attention_varlen_autograd: the three above for a batch of
  variable-length sequences packed without padding (flash_attn_varlen_func's layouts), sequence by sequence.
- attention_kvcache_ref: attention_ref for decoding from a KV cache, contiguous or paged, with new keys
  appended (flash_attn_with_kvcache's semantics); returns the caches as they are after the append too.
- attention_fp8_emulation: the FP8 forward's arithmetic in float64 except for its two roundings to e4m3
  (the inputs, given already quantized, and P scaled by 2^max_offset): the yardstick of the FP8 error rule.
- softmax_three_pass / softmax_online_two_pass: the seed's strategies 1 and 2 on the rows of a 2-D tensor.
- OnlineSoftmax / attention_tiled: strategy 3, the kernel's single-pass tiled loop (Softmax<kNRows, Max_offset>
  of hopper/softmax.h and the mainloop's call order), for checking its numerics on the CPU.
"""
import math
import operator

import torch

# Largest score tensor (bytes) one chunk of attention_ref/attention_lowp may build; a few temporaries of this
# size live at once, so a chunk stays well under ~512 MiB even for 4k x 4k with many heads.
_CHUNK_BYTES = 128 * 1024 * 1024

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_QUAD = 4  # threads of a quad sharing one accumulator row in the GMMA layout


# ----------------------------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------------------------

def _check_shapes(q, k, v):
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"expected q (b, sq, h, d) and k, v (b, sk, h_kv, d), got {q.shape}, {k.shape}, {v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"incompatible q {tuple(q.shape)} and k/v {tuple(k.shape)}")


def _default_scale(softmax_scale, headdim):
    return 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)


def _heads_first(q, k, v, dtype):
    """Flatten to (batch*nheads, seqlen, headdim) in `dtype`, with k/v gathered per query head (GQA/MQA)."""
    batch, seqlen_q, nheads, headdim = q.shape
    nheads_kv = k.shape[2]
    group = nheads // nheads_kv
    qf = q.to(dtype).transpose(1, 2).reshape(batch * nheads, seqlen_q, headdim)
    kf = k.to(dtype).transpose(1, 2).reshape(batch * nheads_kv, k.shape[1], headdim)
    vf = v.to(dtype).transpose(1, 2).reshape(batch * nheads_kv, v.shape[1], headdim)
    head = torch.arange(batch * nheads, device=q.device)
    kv_index = (head // nheads) * nheads_kv + (head % nheads) // group
    return qf, kf, vf, kv_index


def _band(causal, window_size):
    """(left, right) of the visible band, each None when unbounded; causal is the band with right = 0.

    What the ops refuse (a bound below -1, causal with right > 0) has no meaning for a reference either:
    ValueError naming window_size."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(f"window_size must be (left, right), got {window_size!r}")
    left, right = (operator.index(w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"window_size bounds must be -1 (unbounded) or >= 0, got {tuple(window_size)}")
    if causal:
        if right > 0:
            raise ValueError(f"causal=True is the band with right = 0: window_size's right bound must be -1 or 0, "
                             f"got {right}")
        right = 0
    return (None if left < 0 else left), (None if right < 0 else right)


def _is_masked(causal, window_size):
    """Whether any key inside seqlen_k can be masked (causal, or a bounded window)."""
    return any(bound is not None for bound in _band(causal, window_size))


def _visible(rows, cols, seqlen_q, seqlen_k, causal, window_size=(-1, -1)):
    """Boolean (len(rows), len(cols)): which keys each query row may attend to. The one place of the mask
    rule: key j < seqlen_k, and i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right
    for the bounds that exist (causal: right = 0)."""
    left, right = _band(causal, window_size)
    visible = (cols < seqlen_k)[None, :].expand(len(rows), len(cols))
    diag = rows[:, None] + (seqlen_k - seqlen_q)  # the key aligned with each query row
    if right is not None:
        visible = visible & (cols[None, :] <= diag + right)
    if left is not None:
        visible = visible & (cols[None, :] >= diag - left)
    return visible


def _mask_rows_(scores, rows, seqlen_q, seqlen_k, causal, window_size):
    """scores (..., len(rows), seqlen_k) of the query rows `rows` (a range): -inf, in place, where a row may not
    see a key (nothing without a mask). Returns scores."""
    if _is_masked(causal, window_size):
        row_ids = torch.arange(rows.start, rows.stop, device=scores.device)
        cols = torch.arange(seqlen_k, device=scores.device)
        scores.masked_fill_(~_visible(row_ids, cols, seqlen_q, seqlen_k, causal, window_size), -math.inf)
    return scores


def _check_softcap(softcap):
    softcap = float(softcap)
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap must be a finite number >= 0 (0 = off), got {softcap!r}")
    return softcap


def _apply_softcap(scores, softcap):
    """c * tanh(scores / c), in the scores' dtype (each op rounded there); unchanged for c = 0."""
    if softcap == 0:
        return scores
    return torch.tanh(scores / softcap) * softcap


def _chunks(num_heads, seqlen_q, seqlen_k, elem_bytes):
    """Yield (head slice, row slice) pieces whose (heads, rows, seqlen_k) score tensor fits _CHUNK_BYTES."""
    rows_fit = max(1, _CHUNK_BYTES // (seqlen_k * elem_bytes))
    if rows_fit >= seqlen_q:  # whole heads fit: take as many as possible at once
        heads_fit = rows_fit // seqlen_q
        for h0 in range(0, num_heads, heads_fit):
            yield slice(h0, min(h0 + heads_fit, num_heads)), slice(0, seqlen_q)
    else:  # very long sequences: one head at a time, in row chunks
        for h in range(num_heads):
            for r0 in range(0, seqlen_q, rows_fit):
                yield slice(h, h + 1), slice(r0, min(r0 + rows_fit, seqlen_q))


def _to_bshd(x_flat, batch, nheads):
    """(batch*nheads, seqlen, headdim) -> (batch, seqlen, nheads, headdim)."""
    return x_flat.reshape(batch, nheads, *x_flat.shape[1:]).transpose(1, 2).contiguous()


# ----------------------------------------------------------------------------------------------------------
# References
# ----------------------------------------------------------------------------------------------------------

def attention_ref(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0):
    """Exact attention in float64. Returns out (b, sq, h, d) and lse (b, h, sq), both float64.

    window_size=(left, right) and causal select the visible keys (see the module docstring); softcap > 0
    caps the logits (c * tanh(s / c), in float64), and lse is the logsumexp of the capped logits."""
    _check_shapes(q, k, v)
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k = k.shape[1]
    scale = _default_scale(softmax_scale, headdim)
    softcap = _check_softcap(softcap)
    qf, kf, vf, kv_index = _heads_first(q, k, v, torch.float64)
    out = torch.zeros_like(qf)
    lse = torch.full((batch * nheads, seqlen_q), -math.inf, dtype=torch.float64, device=q.device)
    for heads, rows in _chunks(batch * nheads, seqlen_q, seqlen_k, elem_bytes=8):
        kv = kv_index[heads]
        scores = _apply_softcap(torch.matmul(qf[heads, rows], kf[kv].transpose(-1, -2)) * scale, softcap)
        _mask_rows_(scores, rows, seqlen_q, seqlen_k, causal, window_size)
        row_lse = torch.logsumexp(scores, dim=-1)  # -inf for rows that see no key
        # Subtract 0 instead of -inf on such rows: exp(-inf - 0) = 0 gives out = 0 rather than NaN.
        # In place, so that a chunk holds a single score-sized tensor.
        probs = scores.sub_(torch.where(torch.isinf(row_lse), 0.0, row_lse)[..., None]).exp_()
        out[heads, rows] = torch.matmul(probs, vf[kv])
        lse[heads, rows] = row_lse
    return _to_bshd(out, batch, nheads), lse.reshape(batch, nheads, seqlen_q)


def attention_lowp(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0):
    """Attention as PyTorch computes it in the inputs' dtype (e.g. fp16/bf16): the baseline of the error rule.

    As PyTorch's math attention computes it: (q * scale) K^T and P V are matmuls in the input dtype, the
    softmax runs in float32 and P is cast back to that dtype. softcap > 0 caps the scores in the input dtype
    (c * tanh(s / c), each op rounded to it, as PyTorch code of a softcapped model computes it) before the
    float32 softmax. window_size / causal as in attention_ref. Queries that see no key give 0 (SDPA would
    give NaN). Returns out only, (batch, seqlen_q, nheads, headdim) in q's dtype.
    """
    _check_shapes(q, k, v)
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k = k.shape[1]
    scale = _default_scale(softmax_scale, headdim)
    softcap = _check_softcap(softcap)
    qf, kf, vf, kv_index = _heads_first(q, k, v, q.dtype)
    out = torch.zeros_like(qf)
    for heads, rows in _chunks(batch * nheads, seqlen_q, seqlen_k, elem_bytes=4):
        kv = kv_index[heads]
        scores = _apply_softcap(torch.matmul(qf[heads, rows] * scale, kf[kv].transpose(-1, -2)), softcap)
        _mask_rows_(scores, rows, seqlen_q, seqlen_k, causal, window_size)
        probs = torch.softmax(scores.float(), dim=-1).nan_to_num_(nan=0.0).to(q.dtype)  # all -inf row: NaN -> 0
        out[heads, rows] = torch.matmul(probs, vf[kv])
    return _to_bshd(out, batch, nheads)


def attention_fp8_emulation(q8, k8, v8, q_descale=None, k_descale=None, v_descale=None, softmax_scale=None,
                            causal=False, max_offset=8, window_size=(-1, -1), softcap=0.0):
    """FP8 attention as the kernel rounds it, otherwise exact (float64): S from the descaled e4m3 inputs
    (softmax_scale * q_descale * k_descale * q8.k8, then c * tanh(S / c) when softcap = c > 0), P =
    exp(S - rowmax) * 2^max_offset rounded to e4m3 for the PV product while the row sums use the unrounded
    P, O = (P8 V8) / sum * v_descale. Descales are float32 (batch, nheads_kv) or None (= 1); window_size /
    causal as in attention_ref. Returns out (batch, seqlen_q, nheads, headdim) in float64."""
    _check_shapes(q8, k8, v8)
    batch, seqlen_q, nheads, headdim = q8.shape
    seqlen_k, nheads_kv = k8.shape[1], k8.shape[2]
    scale = _default_scale(softmax_scale, headdim)
    softcap = _check_softcap(softcap)
    ones = torch.ones(batch, nheads_kv, dtype=torch.float64, device=q8.device)
    qd, kd, vd = (ones if d is None else d.double() for d in (q_descale, k_descale, v_descale))
    qf, kf, vf, kv_index = _heads_first(q8, k8, v8, torch.float64)
    # Per flattened query head: q*k descale folded into the scale, v descale applied to O at the end.
    qk_scale = (qd * kd).reshape(-1)[kv_index] * scale
    v_scale = vd.reshape(-1)[kv_index]
    out = torch.zeros_like(qf)
    for heads, rows in _chunks(batch * nheads, seqlen_q, seqlen_k, elem_bytes=8):
        kv = kv_index[heads]
        scores = torch.matmul(qf[heads, rows], kf[kv].transpose(-1, -2)) * qk_scale[heads, None, None]
        scores = _apply_softcap(scores, softcap)
        _mask_rows_(scores, rows, seqlen_q, seqlen_k, causal, window_size)
        row_max = scores.amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isinf(row_max), 0.0, row_max)  # rows that see no key: P = 0
        p = scores.sub_(row_max).exp_().mul_(2.0 ** max_offset)
        row_sum = p.sum(dim=-1, keepdim=True)
        p8 = p.float().to(torch.float8_e4m3fn).double()
        o = torch.matmul(p8, vf[kv]) / torch.where(row_sum == 0, 1.0, row_sum)
        out[heads, rows] = o * v_scale[heads, None, None]
    return _to_bshd(out, batch, nheads)


def attention_autograd(q, k, v, softmax_scale=None, causal=False, upcast=True, window_size=(-1, -1), softcap=0.0):
    """Differentiable attention for gradient references: (out, lse), with lse (b, h, sq) float.

    upcast=True computes in float64 (the ground truth of the backward: float64 autograd); upcast=False as
    PyTorch's math attention runs in the inputs' dtype ((q * scale) K^T and P V in that dtype, softmax in
    float32), the baseline of the error rule. softcap > 0 caps the scores (c * tanh(s / c)) in the compute
    dtype, before the softmax (so its gradient flows through the tanh); window_size / causal as in
    attention_ref. GQA by repeating K/V per query head, so autograd sums dk/dv over each group. Rows that
    see no key give out 0 and lse -inf, with zero (never NaN) gradients. Builds the whole (b, h, sq, sk)
    score tensor: meant for test-sized problems.
    """
    _check_shapes(q, k, v)
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k = k.shape[1]
    scale = _default_scale(softmax_scale, headdim)
    softcap = _check_softcap(softcap)
    group = nheads // k.shape[2]
    compute = torch.float64 if upcast else q.dtype
    soft = torch.float64 if upcast else torch.float32
    qh = q.to(compute).transpose(1, 2)
    kh = k.to(compute).repeat_interleave(group, dim=2).transpose(1, 2)
    vh = v.to(compute).repeat_interleave(group, dim=2).transpose(1, 2)
    scores = (torch.matmul(qh, kh.transpose(-1, -2)) * scale if upcast
              else torch.matmul(qh * scale, kh.transpose(-1, -2)))
    scores = _apply_softcap(scores, softcap).to(soft)
    rows = torch.arange(seqlen_q, device=q.device)
    visible = _visible(rows, torch.arange(seqlen_k, device=q.device), seqlen_q, seqlen_k, causal, window_size)
    # A finite fill keeps the softmax of a fully masked row NaN-free; its row is zeroed below.
    scores = scores.masked_fill(~visible, -1e30)
    any_visible = visible.any(dim=-1)  # (sq,)
    lse = torch.where(any_visible, torch.logsumexp(scores, dim=-1), -math.inf)
    probs = torch.softmax(scores, dim=-1) * any_visible[:, None].to(soft)
    out = torch.matmul(probs.to(compute), vh).transpose(1, 2)
    return out, lse


# ----------------------------------------------------------------------------------------------------------
# Variable-length batches
# ----------------------------------------------------------------------------------------------------------
#
# Layout: q (total_q, nheads, headdim), k/v (total_k, nheads_kv, headdim); sequence b owns rows
# cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k/v, of which only the
# first seqused_q[b] (seqused_k[b]) take part when seqused is given. Each sequence is the dense problem of
# its used rows (masks bottom-right aligned to its own block); out is 0 and lse -inf on every other row.
# lse is (nheads, total_q).

def _varlen_spans(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
    """[(q_start, used_q, k_start, used_k)] per sequence, from host copies of the offsets. ValueError when
    they do not describe q and k (the reference has no meaning for them)."""
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"expected q (total_q, h, d) and k, v (total_k, h_kv, d), got {q.shape}, {k.shape}, {v.shape}")
    if q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"incompatible q {tuple(q.shape)} and k/v {tuple(k.shape)}")
    cu_q, cu_k = (torch.as_tensor(c).tolist() for c in (cu_seqlens_q, cu_seqlens_k))
    batch = len(cu_q) - 1
    if len(cu_k) != len(cu_q) or batch < 0 or cu_q[0] != 0 or cu_k[0] != 0 or cu_q[-1] != q.shape[0] \
            or cu_k[-1] != k.shape[0] or any(b < a for c in (cu_q, cu_k) for a, b in zip(c, c[1:])):
        raise ValueError(f"cu_seqlens_q {cu_q} and cu_seqlens_k {cu_k} do not split q ({q.shape[0]} rows) and k "
                         f"({k.shape[0]} rows) into the same number of sequences")
    used = [None if t is None else torch.as_tensor(t).tolist() for t in (seqused_q, seqused_k)]
    if any(u is not None and len(u) != batch for u in used):
        raise ValueError(f"seqused_q / seqused_k must have one entry per sequence ({batch})")
    spans = []
    for b in range(batch):
        len_q, len_k = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        used_q = len_q if used[0] is None else used[0][b]
        used_k = len_k if used[1] is None else used[1][b]
        if not (0 <= used_q <= len_q and 0 <= used_k <= len_k):
            raise ValueError(f"sequence {b}: seqused ({used_q}, {used_k}) outside its lengths ({len_q}, {len_k})")
        spans.append((cu_q[b], used_q, cu_k[b], used_k))
    return spans


def _varlen_check_options(causal, window_size, softcap):
    """The same argument rules as the dense references, also for a batch whose sequences are all empty."""
    _band(causal, window_size)
    return _check_softcap(softcap)


def attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False, window_size=(-1, -1),
                         softcap=0.0, seqused_q=None, seqused_k=None):
    """attention_ref for a packed variable-length batch (layout above), sequence by sequence in float64.

    Returns out (total_q, nheads, headdim) and lse (nheads, total_q), both float64; rows outside every
    sequence's used range, rows that see no key and the rows of a sequence without keys get out = 0,
    lse = -inf. The default scale is 1/sqrt(headdim), as for the whole batch."""
    spans = _varlen_spans(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    softcap = _varlen_check_options(causal, window_size, softcap)
    scale = _default_scale(softmax_scale, q.shape[-1])
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float64, device=q.device)
    for q0, nq, k0, nk in spans:
        if nq == 0 or nk == 0:
            continue  # nothing to compute: no rows, or rows that see no key (out 0, lse -inf as filled)
        o, l = attention_ref(q[None, q0:q0 + nq], k[None, k0:k0 + nk], v[None, k0:k0 + nk], scale, causal,
                             window_size, softcap)
        out[q0:q0 + nq] = o[0]
        lse[:, q0:q0 + nq] = l[0]
    return out, lse


def attention_varlen_lowp(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False, window_size=(-1, -1),
                          softcap=0.0, seqused_q=None, seqused_k=None):
    """attention_lowp (PyTorch's attention in the inputs' dtype, the error rule's baseline) for a packed
    variable-length batch, sequence by sequence. Returns out (total_q, nheads, headdim) in q's dtype, 0 on
    the rows attention_varlen_ref gives 0."""
    spans = _varlen_spans(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    softcap = _varlen_check_options(causal, window_size, softcap)
    scale = _default_scale(softmax_scale, q.shape[-1])
    out = torch.zeros_like(q)
    for q0, nq, k0, nk in spans:
        if nq and nk:
            out[q0:q0 + nq] = attention_lowp(q[None, q0:q0 + nq], k[None, k0:k0 + nk], v[None, k0:k0 + nk], scale,
                                             causal, window_size, softcap)[0]
    return out


def attention_varlen_autograd(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False, upcast=True,
                              window_size=(-1, -1), softcap=0.0, seqused_q=None, seqused_k=None):
    """attention_autograd for a packed variable-length batch: (out (total_q, nheads, headdim), lse (nheads,
    total_q)), differentiable, in float64 (upcast=True) or as PyTorch's math attention runs in the inputs'
    dtype (upcast=False; lse float32). The unused rows are constant zeros (out) and -inf (lse), so their
    gradients, and those of unused keys, are 0. Keys that no computed row reads are not in the graph at all
    (autograd.grad then needs allow_unused=True, materialize_grads=True)."""
    spans = _varlen_spans(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    softcap = _varlen_check_options(causal, window_size, softcap)
    scale = _default_scale(softmax_scale, q.shape[-1])
    compute = torch.float64 if upcast else q.dtype
    soft = torch.float64 if upcast else torch.float32
    nheads, headdim = q.shape[1], q.shape[2]
    outs, lses = [], []

    def blank(rows):  # rows that take no part: out 0, lse -inf, no gradient
        outs.append(torch.zeros(rows, nheads, headdim, dtype=compute, device=q.device))
        lses.append(torch.full((nheads, rows), -math.inf, dtype=soft, device=q.device))

    cu_q = torch.as_tensor(cu_seqlens_q).tolist()
    outs.append(q[:0].to(compute))  # no rows: keeps out in q's graph when no sequence has a computed row
    for b, (q0, nq, k0, nk) in enumerate(spans):
        if nq and nk:
            o, l = attention_autograd(q[None, q0:q0 + nq], k[None, k0:k0 + nk], v[None, k0:k0 + nk], scale, causal,
                                      upcast, window_size, softcap)
            outs.append(o[0].to(compute))
            lses.append(l[0].to(soft))
        else:
            blank(nq)
        blank(cu_q[b + 1] - q0 - nq)  # the sequence's rows past seqused_q
    lses.append(torch.empty(nheads, 0, dtype=soft, device=q.device))
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


# ----------------------------------------------------------------------------------------------------------
# Decoding from a KV cache
# ----------------------------------------------------------------------------------------------------------
#
# flash_attn_with_kvcache's semantics (FlashAttention's names): the cache holds, for batch entry b,
# cache_seqlens[b] keys; new keys k[b] (seqlen_new of them, optional) are written after them, and q[b]
# attends to the cache_seqlens[b] + seqlen_new keys, masks bottom-right aligned to that length. The cache is
# contiguous, (batch_cache, seqlen_cache, nheads_kv, headdim), entry b in row cache_batch_idx[b] (default b),
# or paged, (num_pages, page_size, nheads_kv, headdim), with key r of entry b in page page_table[b, r //
# page_size] at offset r % page_size.

def _kvcache_rows(b, count, start, k_cache, cache_batch_idx, page_table):
    """(index tuples into k_cache's first two dims) of keys start .. start + count - 1 of batch entry b."""
    rows = torch.arange(start, start + count)
    if page_table is None:
        entry = b if cache_batch_idx is None else int(cache_batch_idx[b])
        return torch.full_like(rows, entry), rows
    page_size = k_cache.shape[1]
    return page_table[b].cpu().long()[rows // page_size], rows % page_size


def attention_kvcache_ref(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, cache_batch_idx=None,
                          page_table=None, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0):
    """attention_ref over a KV cache (layouts above), in float64, leaving its inputs unchanged.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_new, nheads_kv, headdim) or None;
    cache_seqlens: None (every entry full: contiguous caches only), an int, or one length per entry;
    cache_batch_idx: (batch,) rows of a contiguous cache; page_table: (batch, pages per entry) int.
    Returns out (batch, seqlen_q, nheads, headdim) and lse (batch, nheads, seqlen_q), float64, and the
    caches as they are after the new keys are written (copies, in the caches' dtype). An entry with no key
    gets out = 0 and lse = -inf. ValueError when the lengths, page table or indices do not fit the cache."""
    batch, seqlen_q, nheads, headdim = q.shape
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[-1] != headdim \
            or nheads % k_cache.shape[2] != 0:
        raise ValueError(f"k_cache and v_cache must be (batch_cache or num_pages, seqlen_cache or page_size, "
                         f"nheads_kv, {headdim}) with nheads_kv dividing {nheads}; got {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (the new keys and values) or both be None")
    seqlen_new = 0 if k is None else k.shape[1]
    if k is not None and (k.shape != v.shape or k.shape[0] != batch or k.shape[2:] != k_cache.shape[2:]):
        raise ValueError(f"k and v must be (batch={batch}, seqlen_new, {k_cache.shape[2]}, {headdim}); got "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if page_table is not None and cache_batch_idx is not None:
        raise ValueError("cache_batch_idx selects rows of a contiguous cache; a paged cache takes page_table alone")
    if page_table is not None:
        if page_table.dim() != 2 or page_table.shape[0] != batch:
            raise ValueError(f"page_table must be (batch={batch}, pages per entry), got {tuple(page_table.shape)}")
        bad = (page_table < 0) | (page_table >= k_cache.shape[0])
        if bad.any():
            raise ValueError(f"page_table holds pages outside 0..{k_cache.shape[0] - 1}")
        capacity = page_table.shape[1] * k_cache.shape[1]
    else:
        capacity = k_cache.shape[1]
        if cache_batch_idx is not None:
            idx = torch.as_tensor(cache_batch_idx).tolist()
            if len(idx) != batch or any(not 0 <= i < k_cache.shape[0] for i in idx):
                raise ValueError(f"cache_batch_idx must hold {batch} rows of the cache (0..{k_cache.shape[0] - 1})")
        elif k_cache.shape[0] < batch:
            raise ValueError(f"a contiguous cache needs a row per batch entry ({batch}), got {k_cache.shape[0]}")
    if cache_seqlens is None:
        if page_table is not None:
            raise ValueError("a paged cache needs cache_seqlens")
        lens = [capacity - seqlen_new] * batch
    elif isinstance(cache_seqlens, int):
        lens = [cache_seqlens] * batch
    else:
        lens = torch.as_tensor(cache_seqlens).tolist()
    if len(lens) != batch or any(n < 0 or n + seqlen_new > capacity for n in lens):
        raise ValueError(f"cache_seqlens {lens} plus {seqlen_new} new keys must fit the cache's {capacity} per entry")
    scale = _default_scale(softmax_scale, headdim)
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    lse = torch.full((batch, nheads, seqlen_q), -math.inf, dtype=torch.float64, device=q.device)
    for b in range(batch):
        if seqlen_new:
            at = _kvcache_rows(b, seqlen_new, lens[b], k_cache, cache_batch_idx, page_table)
            k_cache[at] = k[b].to(k_cache.dtype)
            v_cache[at] = v[b].to(v_cache.dtype)
        total = lens[b] + seqlen_new
        if total == 0 or seqlen_q == 0:
            continue  # no key: out 0, lse -inf as filled
        rows = _kvcache_rows(b, total, 0, k_cache, cache_batch_idx, page_table)
        o, l = attention_ref(q[b:b + 1], k_cache[rows][None], v_cache[rows][None], scale, causal, window_size, softcap)
        out[b], lse[b] = o[0], l[0]
    return out, lse, k_cache, v_cache


# ----------------------------------------------------------------------------------------------------------
# The seed's strategies 1 and 2 (rows of a 2-D tensor)
# ----------------------------------------------------------------------------------------------------------

def softmax_three_pass(x):
    """Safe softmax: pass 1 row max, pass 2 sum of exp(x - max), pass 3 normalize.

    A row that is all -inf returns all zeros (torch.softmax gives NaN); this matches the kernel, whose
    finalize() turns a zero sum into a zero output.
    """
    row_max = x.max(dim=-1, keepdim=True).values
    row_max = torch.where(row_max == -math.inf, 0.0, row_max)  # all -inf row: exp(-inf - 0) = 0, not NaN
    row_sum = torch.exp(x - row_max).sum(dim=-1, keepdim=True)
    inv_sum = torch.where(row_sum == 0, 0.0, 1.0 / row_sum)
    return torch.exp(x - row_max) * inv_sum


def softmax_online_two_pass(x):
    """Milakov & Gimelshein: pass 1 fuses max and sum in one sweep over the columns, pass 2 normalizes.

    The sweep is a Python loop over columns, vectorised over rows. An all -inf row returns all zeros,
    like softmax_three_pass.
    """
    rows, ncols = x.shape
    row_max = torch.full((rows,), -math.inf, dtype=x.dtype, device=x.device)
    row_sum = torch.zeros(rows, dtype=x.dtype, device=x.device)
    for j in range(ncols):
        new_max = torch.maximum(row_max, x[:, j])
        # While a row has seen only -inf, use 0 as its max: avoids (-inf) - (-inf) = NaN, and exp(-inf) = 0.
        safe_max = torch.where(new_max == -math.inf, 0.0, new_max)
        row_sum = torch.exp(row_max - safe_max) * row_sum + torch.exp(x[:, j] - safe_max)
        row_max = new_max
    safe_max = torch.where(row_max == -math.inf, 0.0, row_max)
    inv_sum = torch.where(row_sum == 0, 0.0, 1.0 / row_sum)
    return torch.exp(x - safe_max[:, None]) * inv_sum[:, None]


# ----------------------------------------------------------------------------------------------------------
# Strategy 3: the kernel's single-pass online softmax
# ----------------------------------------------------------------------------------------------------------

def _quad_lane_columns(scores):
    """(..., rows, n) -> (..., rows, 4, n_per_lane): the columns each quad lane holds, in its own order.

    In the Hopper GMMA accumulator layout lane l of a quad holds columns 8*i + 2*l + {0, 1}, i.e. column c
    belongs to lane (c % 8) // 2. Zero columns pad n to a multiple of 8; adding 0 leaves a sum unchanged.
    """
    n = scores.shape[-1]
    padded = torch.nn.functional.pad(scores, (0, (-n) % 8))
    groups = padded.reshape(*padded.shape[:-1], -1, _QUAD, 2)  # (..., rows, n/8, lane, 2)
    return groups.movedim(-2, -3).reshape(*padded.shape[:-1], _QUAD, -1)


class OnlineSoftmax:
    """PyTorch mirror of hopper/softmax.h's Softmax<kNRows, Max_offset>, vectorised over any leading dims.

    scores are (..., rows, kBlockN) raw Q K^T blocks (unscaled). row_max is (..., rows). row_sum holds the
    4 per-lane partial sums, (..., rows, 4), exactly as the quad's threads keep them in registers; they are
    reduced across the quad only in finalize(), after which row_sum is the LSE, (..., rows).
    """

    def __init__(self, softmax_scale_log2, max_offset=0):
        self.softmax_scale_log2 = softmax_scale_log2
        self.max_offset = max_offset
        self.row_max = None
        self.row_sum = None

    def max_get_scale(self, scores, is_first, check_inf=False):
        """Update row_max with this block; return the factor that rescales the old row_sum and acc_o."""
        block_max = scores.max(dim=-1).values
        if is_first:
            self.row_max = block_max
            return torch.ones_like(block_max)
        prev_max = self.row_max
        self.row_max = torch.maximum(prev_max, block_max)
        cur_max = self.row_max
        if check_inf:  # a row still fully masked: make (-inf) - (-inf) into (-inf) - 0 so the scale is 0, not NaN
            cur_max = torch.where(cur_max == -math.inf, 0.0, cur_max)
        scores_scale = torch.exp2((prev_max - cur_max) * self.softmax_scale_log2)
        self.row_sum = self.row_sum * scores_scale[..., None]  # each lane rescales its own partial
        return scores_scale

    def online_softmax(self, scores, is_first, check_inf=False):
        """In place: scores = exp2(scores * scale_log2 - max_scaled), i.e. P * 2^max_offset; returns it.

        Adds each lane's columns into its own partial sum, column by column in the thread's order
        (warp_reduce=false in the kernel: no cross-thread traffic in the main loop).
        """
        max_scaled = self.row_max * self.softmax_scale_log2 - self.max_offset
        if check_inf:  # fully masked row: exp2(-inf - 0) = 0 instead of exp2(-inf + inf) = NaN
            max_scaled = torch.where(self.row_max == -math.inf, 0.0, max_scaled)
        # The kernel fuses the multiply-subtract into one FFMA; two roundings here only matter below float64.
        scores.mul_(self.softmax_scale_log2).sub_(max_scaled[..., None]).exp2_()
        lane_cols = _quad_lane_columns(scores)
        partial = lane_cols[..., 0] if is_first else self.row_sum + lane_cols[..., 0]
        for j in range(1, lane_cols.shape[-1]):
            partial = partial + lane_cols[..., j]
        self.row_sum = partial
        return scores

    @staticmethod
    def rescale_o(acc_o, scores_scale):
        """In place: acc_o (..., rows, headdim) *= scores_scale per row."""
        return acc_o.mul_(scores_scale[..., None])

    def finalize(self, final_scale=1.0):
        """Reduce the quad's partials, return the output scale 1/sum * final_scale, turn row_sum into the LSE."""
        p = self.row_sum
        # Butterfly all-reduce: shfl_xor 2 pairs lanes (0,2),(1,3); shfl_xor 1 then adds the two pair sums.
        row_sum = (p[..., 0] + p[..., 2]) + (p[..., 1] + p[..., 3])
        empty = (row_sum == 0) | torch.isnan(row_sum)  # fully masked row (or a NaN): output 0, lse -inf
        inv_sum = torch.where(empty, 0.0, 1.0 / row_sum)
        scores_scale = inv_sum * final_scale
        # P carried a 2^max_offset factor; it cancels in O = acc_o / sum but must come out of the LSE.
        if self.max_offset != 0:
            row_sum = row_sum * (1.0 / float(1 << self.max_offset))
        lse = self.row_max * (self.softmax_scale_log2 * _LN2) + torch.log(row_sum)
        self.row_sum = torch.where(empty, -math.inf, lse)
        return scores_scale


def attention_tiled(q, k, v, softmax_scale=None, causal=False, block_m=128, block_n=128, max_offset=0,
                    compute_dtype=torch.float64, p_dtype=None):
    """The kernel's tiled forward, emulated: per M-tile, K/V blocks from the last needed one down to the first.

    Returns out (b, sq, h, d) and lse (b, h, sq) in compute_dtype. p_dtype (e.g. torch.bfloat16) rounds P
    before the PV product, like the kernel's 16-bit P operand; row sums always use the unrounded P.
    """
    _check_shapes(q, k, v)
    if block_n % 8 != 0:
        raise ValueError(f"block_n must be a multiple of 8 (a GMMA N size), got {block_n}")
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k = k.shape[1]
    scale = _default_scale(softmax_scale, headdim)
    diag = seqlen_k - seqlen_q  # query i sees keys j <= i + diag under the causal mask
    device = q.device

    qf, kf, vf, kv_index = _heads_first(q, k, v, compute_dtype)
    # Zero-pad K/V to whole blocks: the padded keys are always masked, and P = 0 there times V = 0 adds 0.
    n_blocks_k = -(-seqlen_k // block_n)
    pad = n_blocks_k * block_n - seqlen_k
    kf = torch.nn.functional.pad(kf, (0, 0, 0, pad))[kv_index]
    vf = torch.nn.functional.pad(vf, (0, 0, 0, pad))[kv_index]

    out = torch.zeros_like(qf)
    lse = torch.full((batch * nheads, seqlen_q), -math.inf, dtype=compute_dtype, device=device)
    for m_block in range(-(-seqlen_q // block_m)):
        row0 = m_block * block_m
        rows = torch.arange(row0, min(row0 + block_m, seqlen_q), device=device)
        n_block_max = n_blocks_k
        if causal:  # the tile's last row sees keys up to row0 + block_m - 1 + diag
            n_block_max = max(0, -(-min(seqlen_k, row0 + block_m + diag) // block_n))
        if n_block_max == 0:
            continue  # no key visible to any row of the tile: out stays 0, lse -inf

        q_tile = qf[:, rows]
        softmax = OnlineSoftmax(scale * _LOG2E, max_offset)
        acc_o = torch.zeros_like(q_tile)
        for step, n_block in enumerate(reversed(range(n_block_max))):
            col0 = n_block * block_n
            cols = torch.arange(col0, col0 + block_n, device=device)
            scores = torch.matmul(q_tile, kf[:, col0:col0 + block_n].transpose(-1, -2))
            is_first = step == 0
            # The first block processed is the only one that can hold keys >= seqlen_k; a causal block needs
            # the mask when its last key is past what the tile's top row may see.
            needs_mask = is_first or (causal and col0 + block_n - 1 > row0 + diag)
            if needs_mask:
                scores.masked_fill_(~_visible(rows, cols, seqlen_q, seqlen_k, causal), -math.inf)
            scores_scale = softmax.max_get_scale(scores, is_first, check_inf=needs_mask)
            p = softmax.online_softmax(scores, is_first, check_inf=needs_mask)
            softmax.rescale_o(acc_o, scores_scale)
            if p_dtype is not None:
                p = p.to(p_dtype).to(compute_dtype)
            acc_o += torch.matmul(p, vf[:, col0:col0 + block_n])
        softmax.rescale_o(acc_o, softmax.finalize())
        out[:, rows] = acc_o
        lse[:, rows] = softmax.row_sum
    return _to_bshd(out, batch, nheads), lse.reshape(batch, nheads, seqlen_q)
