"""FP8 (e4m3) inputs for flash_ext.forward from 16-bit (or float32) tensors.

    q8, k8, v8, q_descale, k_descale, v_descale = flash_ext.fp8.quantize_qkv(q, k, v, hadamard=True)
    out, lse = flash_ext.forward(q8, k8, v8, causal=True, q_descale=q_descale, k_descale=k_descale,
                                 v_descale=v_descale)   # out is bf16

Each tensor is scaled per (batch, KV head) so that its largest magnitude maps to e4m3's largest finite value
(448); the descale is the inverse factor, float32 (batch, nheads_kv), the layout forward reads. For q the
group of query heads that shares a KV head shares one factor (forward's q_descale is per KV head, as in
FlashAttention-3).

An FP8 KV cache (flash_attn_with_kvcache): quantize the cache once (quantize(k_cache, nheads_kv)), then each
step's new keys and values with the cache's descales (quantize_with) and q with its own (quantize).

hadamard=True first rotates q and k by the same orthonormal Hadamard matrix along the head dim. QK^T is
unchanged (H H^T = I) while an outlier channel is spread over all channels, so the per-head scale is set by
typical values rather than by the outlier: the "incoherent processing" of the FlashAttention-3 paper. Head
dims that are not powers of two (96, 192) use a block-diagonal rotation with the largest power-of-two block
that divides them (32 and 64), still orthonormal. V is never rotated (the output would be too).

v_colmajor=True (or colmajor(v8)) lays v8 out column-major, its sequence dim contiguous (FlashAttention-3's
V_colmajor): at head dim 256 the forward then skips the transpose of V in shared memory that FP8 GEMMs need
otherwise, 3-10% faster on the H200 (docs/fp8.md).
"""
import torch

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
# An all-zero (batch, head) slice gets this amax: its scale stays finite and its values stay 0.
_AMAX_FLOOR = 1e-30

_hadamard_cache = {}


def hadamard_matrix(n, device=None, dtype=torch.float32):
    """The orthonormal Sylvester-Hadamard matrix of order n (a power of two), symmetric: H @ H = I."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard order must be a power of two, got {n}")
    key = (n, str(device), dtype)
    if key not in _hadamard_cache:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        _hadamard_cache[key] = (h / h.shape[0] ** 0.5).to(device=device, dtype=dtype)
    return _hadamard_cache[key]


def hadamard_block(headdim):
    """The block size of the head-dim rotation: the largest power of two dividing headdim, at most 256."""
    return min(headdim & -headdim, 256)


def rotate_head_dim(x):
    """x (..., headdim) times the block-diagonal orthonormal Hadamard matrix of hadamard_block(headdim)."""
    d = x.shape[-1]
    n = hadamard_block(d)
    h = hadamard_matrix(n, device=x.device, dtype=x.dtype)
    return torch.matmul(x.reshape(*x.shape[:-1], d // n, n), h).reshape(x.shape)


def _check_inputs(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"{name} has dtype {t.dtype}; quantize_qkv takes torch.float16, torch.bfloat16 or "
                            "torch.float32")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims (batch, seqlen, nheads, headdim), got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)} disagree on batch or head dim")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"nheads ({q.shape[2]}) must be a multiple of nheads_kv ({k.shape[2]})")
    if q.shape[3] % 16 != 0:
        raise ValueError(f"head dim {q.shape[3]} is not supported for FP8: it must be a multiple of 16")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def quantize(x, nheads_kv):
    """x (batch, seqlen, nheads, headdim) -> (e4m3 tensor, float32 descale (batch, nheads_kv)), one scale
    per batch and KV head (over the query heads of its group for q)."""
    batch, seqlen, nheads, headdim = x.shape
    grouped = x.float().reshape(batch, seqlen, nheads_kv, nheads // nheads_kv, headdim)
    amax = grouped.abs().amax(dim=(1, 3, 4)).clamp_min(_AMAX_FLOOR)  # (batch, nheads_kv)
    scale = E4M3_MAX / amax
    stored = (grouped * scale[:, None, :, None, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return stored.reshape(x.shape).contiguous(), (amax / E4M3_MAX).float().contiguous()


def quantize_with(x, descale):
    """x (batch, seqlen, nheads, headdim) stored in e4m3 with a given float32 descale (batch, nheads_kv), values
    beyond e4m3's range clamped: new keys and values for an FP8 KV cache, which keeps the descales it was
    quantized with (flash_attn_with_kvcache's k_descale, v_descale)."""
    batch, seqlen, nheads, headdim = x.shape
    if descale.dim() != 2 or descale.shape[0] != batch or descale.shape[1] == 0 or nheads % descale.shape[1]:
        raise ValueError(f"descale must be (batch={batch}, nheads_kv) with nheads_kv dividing {nheads}, got shape "
                         f"{tuple(descale.shape)}")
    nheads_kv = descale.shape[1]
    grouped = x.float().reshape(batch, seqlen, nheads_kv, nheads // nheads_kv, headdim)
    scale = 1.0 / descale.float()
    stored = (grouped * scale[:, None, :, None, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return stored.reshape(x.shape).contiguous()


def quantize_qkv(q, k, v, hadamard=False, v_colmajor=False):
    """(q8, k8, v8, q_descale, k_descale, v_descale) for flash_ext.forward, from q (batch, seqlen_q, nheads,
    headdim) and k, v (batch, seqlen_k, nheads_kv, headdim) in fp16, bf16 or float32. hadamard=True rotates q
    and k along the head dim first (see the module docstring); the attention they compute is the same.
    v_colmajor=True gives v8 column-major: the same (batch, seqlen_k, nheads_kv, headdim) values with the
    sequence dim contiguous (a view of a (batch, nheads_kv, headdim, seqlen_k) tensor), which the forward
    reads without transposing it in shared memory where kernels for it are compiled (head dim 256; others
    copy it row-major first)."""
    _check_inputs(q, k, v)
    for name, flag in (("hadamard", hadamard), ("v_colmajor", v_colmajor)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    nheads_kv = k.shape[2]
    if hadamard:
        q, k = rotate_head_dim(q.float()), rotate_head_dim(k.float())
    q8, q_descale = quantize(q, nheads_kv)
    k8, k_descale = quantize(k, nheads_kv)
    v8, v_descale = quantize(v, nheads_kv)
    if v_colmajor:
        v8 = colmajor(v8)
    return q8, k8, v8, q_descale, k_descale, v_descale


def colmajor(v):
    """v (batch, seqlen, heads, headdim) as the same values laid out column-major: the sequence dim contiguous
    (a view of a (batch, heads, headdim, seqlen) buffer whose rows are padded to a multiple of 16 elements, as
    the TMA loads need). The FP8 forward reads such a v without transposing it in shared memory at head dim
    256 (flash_ext.forward)."""
    if not isinstance(v, torch.Tensor) or v.dim() != 4:
        raise ValueError(f"v must be a 4-dim tensor (batch, seqlen, heads, headdim), got {type(v).__name__}"
                         + (f" of shape {tuple(v.shape)}" if isinstance(v, torch.Tensor) else ""))
    batch, seqlen, heads, headdim = v.shape
    buf = v.new_empty(batch, heads, headdim, (seqlen + 15) // 16 * 16)
    buf[..., :seqlen] = v.permute(0, 2, 3, 1)
    return buf[..., :seqlen].permute(0, 3, 1, 2)


def dequantize(x8, descale, nheads_kv=None):
    """The real values an e4m3 tensor (batch, seqlen, nheads, headdim) with its (batch, nheads_kv) descale
    stands for, in float64 (for references)."""
    batch, seqlen, nheads, headdim = x8.shape
    nheads_kv = descale.shape[1] if nheads_kv is None else nheads_kv
    per_head = descale.double().repeat_interleave(nheads // nheads_kv, dim=1)  # (batch, nheads)
    return x8.double() * per_head[:, None, :, None]
