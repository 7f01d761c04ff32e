"""flash_ext.combine on the CPU (no GPU or compiled extension needed), against the float64 reference:

- attentions over disjoint parts of the keys, merged, are the attention over all keys (dense and varlen
  layouts, uneven parts, GQA), to float64 rounding;
- parts whose rows see no key add nothing even when their out holds NaN; rows no part sees give out = 0 and
  lse = -inf; one part is returned as it is;
- 16-bit parts give 16-bit output within the rounding of the inputs;
- gradients match float64 autograd through the reference on all keys (gradcheck), and stay finite with
  parts that see no key;
- bad input raises, naming the argument.
The same merge of flash_ext.forward's own parts runs on the GPU in tests/test_combine_gpu.py.
"""
import math

import pytest
import torch

import flash_ext
from flash_ext.reference import attention_autograd, attention_ref


def _qkv(batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, nheads, headdim, generator=gen, dtype=dtype)
    k = torch.randn(batch, seqlen_k, nheads_kv, headdim, generator=gen, dtype=dtype)
    v = torch.randn(batch, seqlen_k, nheads_kv, headdim, generator=gen, dtype=dtype)
    return q, k, v


def _parts(q, k, v, bounds, scale, attention=attention_ref):
    """attention over each [start, end) of the keys, stacked: (splits, b, s, h, d), (splits, b, h, s)."""
    outs, lses = [], []
    for start, end in zip(bounds[:-1], bounds[1:]):
        out, lse = attention(q, k[:, start:end], v[:, start:end], softmax_scale=scale)
        outs.append(out)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("bounds", [[0, 37], [0, 1, 37], [0, 5, 6, 20, 37], [0, 12, 24, 37]],
                         ids=["one", "1+36", "uneven4", "even3"])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa"])
def test_parts_merge_to_the_whole(bounds, heads):
    q, k, v = _qkv(2, 9, 37, *heads, 16, seed=len(bounds) + heads[1])
    scale = 1 / math.sqrt(16)
    out_ref, lse_ref = attention_ref(q, k, v, softmax_scale=scale)
    out, lse = flash_ext.combine(*_parts(q, k, v, bounds, scale))
    assert out.shape == out_ref.shape and lse.shape == lse_ref.shape
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    assert (out - out_ref).abs().max().item() < 1e-12
    assert (lse - lse_ref).abs().max().item() < 1e-12


def test_varlen_layout():
    """(splits, total, h, d) with lse (splits, h, total): flash_attn_varlen_func's layouts."""
    q, k, v = _qkv(1, 11, 30, 3, 3, 8, seed=5)
    scale = 0.3
    out_parts, lse_parts = _parts(q, k, v, [0, 10, 30], scale)
    out_ref, lse_ref = attention_ref(q, k, v, softmax_scale=scale)
    out, lse = flash_ext.combine(out_parts[:, 0], lse_parts[:, 0])
    assert out.shape == (11, 3, 8) and lse.shape == (3, 11)
    assert torch.allclose(out, out_ref[0], rtol=0, atol=1e-12) and torch.allclose(lse, lse_ref[0], rtol=0, atol=1e-12)


def test_parts_without_keys_add_nothing():
    """lse = -inf marks rows of a part that see no key: their out is ignored even when it is NaN; rows no
    part sees give out = 0 and lse = -inf."""
    q, k, v = _qkv(1, 6, 20, 2, 2, 8, seed=7)
    scale = 0.25
    out_parts, lse_parts = _parts(q, k, v, [0, 8, 20], scale)
    out_ref, lse_ref = attention_ref(q[:, :, :, :], k[:, 8:], v[:, 8:], softmax_scale=scale)
    # Part 0 sees nothing for rows 0..2 of head 1: the whole is then part 1 there.
    lse_parts[0, 0, 1, :3] = -math.inf
    out_parts[0, 0, :3, 1] = math.nan
    # Row 5 of head 0: no part sees a key.
    lse_parts[:, 0, 0, 5] = -math.inf
    out_parts[:, 0, 5, 0] = math.nan
    out, lse = flash_ext.combine(out_parts, lse_parts)
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.allclose(out[0, :3, 1], out_ref[0, :3, 1], rtol=0, atol=1e-12)
    assert torch.allclose(lse[0, 1, :3], lse_ref[0, 1, :3], rtol=0, atol=1e-12)
    assert torch.all(out[0, 5, 0] == 0) and lse[0, 0, 5].item() == -math.inf


def test_one_part_is_returned_as_it_is():
    q, k, v = _qkv(2, 5, 9, 2, 1, 8, seed=3, dtype=torch.float32)
    out1, lse1 = attention_ref(q, k, v)
    out, lse = flash_ext.combine(out1.float()[None], lse1.float()[None])
    assert torch.allclose(out, out1.float(), rtol=1e-6, atol=1e-7) and torch.allclose(lse, lse1.float(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_16bit_parts(dtype):
    """16-bit parts (as flash_ext.forward returns them) give a 16-bit result within the parts' rounding, and
    float32 on request; lse is float32."""
    q, k, v = _qkv(2, 7, 40, 4, 2, 16, seed=11)
    scale = 1 / 4
    out_parts, lse_parts = _parts(q, k, v, [0, 13, 40], scale)
    out_ref, lse_ref = attention_ref(q, k, v, softmax_scale=scale)
    out, lse = flash_ext.combine(out_parts.to(dtype), lse_parts.float())
    assert out.dtype == dtype and lse.dtype == torch.float32
    eps = torch.finfo(dtype).eps
    # The parts' rounding (relative eps/2 each, averaged) plus the result's own.
    assert (out.double() - out_ref).abs().max().item() <= 2 * eps * out_ref.abs().max().item()
    assert (lse.double() - lse_ref).abs().max().item() < 1e-5
    out32, _ = flash_ext.combine(out_parts.to(dtype), lse_parts.float(), out_dtype=torch.float32)
    assert out32.dtype == torch.float32


def test_gradients_match_the_whole():
    """d(out, lse) / d(parts) chained through the reference parts equal the gradients of attention over
    all keys (float64 autograd), and gradcheck holds for combine itself."""
    q, k, v = _qkv(1, 4, 12, 2, 2, 4, seed=13)
    scale = 0.5
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = flash_ext.combine(*_parts(*leaves, [0, 5, 12], scale, attention=attention_autograd))
    whole = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out_w, lse_w = attention_autograd(*whole, softmax_scale=scale)
    gen = torch.Generator().manual_seed(0)
    d_out, d_lse = torch.randn(out.shape, generator=gen, dtype=torch.float64), torch.randn(lse.shape, generator=gen,
                                                                                             dtype=torch.float64)
    grads = torch.autograd.grad([out, lse], leaves, [d_out, d_lse])
    grads_w = torch.autograd.grad([out_w, lse_w], whole, [d_out, d_lse])
    for g, g_w in zip(grads, grads_w):
        assert torch.allclose(g, g_w, rtol=0, atol=1e-10)
    out_parts, lse_parts = _parts(q, k, v, [0, 3, 12], scale)
    assert torch.autograd.gradcheck(flash_ext.combine, (out_parts.requires_grad_(True), lse_parts.requires_grad_(True)))


def test_gradients_finite_with_parts_without_keys():
    q, k, v = _qkv(1, 3, 8, 1, 1, 4, seed=17)
    out_parts, lse_parts = _parts(q, k, v, [0, 4, 8], 0.5)
    lse_parts[1, 0, 0, 1] = -math.inf
    out_parts[1, 0, 1, 0] = math.nan
    lse_parts[:, 0, 0, 2] = -math.inf
    out_parts = out_parts.requires_grad_(True)
    lse_parts = lse_parts.requires_grad_(True)
    out, lse = flash_ext.combine(out_parts, lse_parts)
    (out.sum() + torch.where(torch.isinf(lse), 0.0, lse).sum()).backward()
    assert torch.isfinite(out_parts.grad).all() and torch.isfinite(lse_parts.grad).all()
    assert torch.all(out_parts.grad[1, 0, 1, 0] == 0) and torch.all(out_parts.grad[:, 0, 2, 0] == 0)


def test_bad_input_names_the_argument():
    out_p = torch.zeros(2, 1, 5, 3, 8)
    lse_p = torch.zeros(2, 1, 3, 5)
    with pytest.raises(TypeError, match="out_partial must be a torch.Tensor"):
        flash_ext.combine([1.0], lse_p)
    with pytest.raises(TypeError, match="lse_partial must be float16, bfloat16, float32 or float64"):
        flash_ext.combine(out_p, lse_p.int())
    with pytest.raises(TypeError, match="out_partial must be float16"):
        flash_ext.combine(out_p.to(torch.float8_e4m3fn), lse_p)
    with pytest.raises(ValueError, match=r"out_partial must be \(num_splits, batch, seqlen, nheads, headdim\)"):
        flash_ext.combine(out_p[0, 0], lse_p)
    with pytest.raises(ValueError, match="at least one part"):
        flash_ext.combine(out_p[:0], lse_p[:0])
    with pytest.raises(ValueError, match=r"lse_partial must have shape \(2, 1, 3, 5\)"):
        flash_ext.combine(out_p, lse_p.transpose(-1, -2))
    with pytest.raises(ValueError, match="lse_partial must be on out_partial's device"):
        flash_ext.combine(out_p, lse_p.to("meta"))
    with pytest.raises(TypeError, match="out_dtype must be a floating-point torch.dtype"):
        flash_ext.combine(out_p, lse_p, out_dtype=torch.int32)
