"""flash_ext.sdpa (SDPA's signature and layout) and flash_attn_qkvpacked_func (FA3's) on the GPU.

sdpa is checked against float64 scaled_dot_product_attention (math backend) with the 2x rule of the other
GPU tests (the baseline: math attention in the inputs' dtype), outputs and gradients, including SDPA's
top-left causal mask when seqlen_q != seqlen_k; the packed entry point against flash_attn_func on the same
values (same kernels: bitwise equal); empty inputs (batch, seqlen_q or seqlen_k 0) through every entry point."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_ext
from gpu_helpers import rounding_noise

pytestmark = pytest.mark.gpu

DTYPES = (torch.float16, torch.bfloat16)


def _require(headdim, dtype, causals):
    for causal in causals:
        for direction in ("fwd", "bwd"):
            if not flash_ext.has_kernel(direction, headdim, dtype, causal):
                pytest.skip(f"this build has no {dtype} head dim {headdim} {direction} kernel (causal={causal})")


def _torch_sdpa_float64(q, k, v, is_causal, enable_gqa):
    """The ground truth: scaled_dot_product_attention's math backend in float64. (out, leaves)."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(*leaves, is_causal=is_causal, enable_gqa=enable_gqa)
    return out, leaves


def _math_lowp(q, k, v, is_causal):
    """The error rule's baseline: math attention in the inputs' dtype ((q * scale) K^T and P V in that dtype,
    softmax in float32), SDPA's layout and top-left causal mask, GQA by repeating K/V. (out, leaves)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ql, kl, vl = leaves
    group = ql.shape[1] // kl.shape[1]
    kh, vh = (t.repeat_interleave(group, dim=1) for t in (kl, vl))
    scores = torch.matmul(ql * ql.shape[-1] ** -0.5, kh.transpose(-1, -2)).float()
    if is_causal:
        visible = torch.ones(ql.shape[2], kl.shape[2], dtype=torch.bool, device=ql.device).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1).to(ql.dtype), vh)
    return out, leaves


def _assert_close(name, value, ref, lowp, dtype):
    err = (value.double() - ref).abs().max().item()
    err_pt = (lowp.double() - ref).abs().max().item()
    noise = rounding_noise(ref, dtype)
    assert err <= 2 * err_pt + noise, f"{name}: max error {err:.3e} > 2 * {err_pt:.3e} (math in {dtype}) + {noise:.1e}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", [(1, 1), (7, 113), (113, 7), (128, 128), (333, 1000), (1000, 333), (2049, 2049)],
                         ids=lambda s: f"L{s[0]}S{s[1]}")
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_sdpa_matches_scaled_dot_product_attention(dtype, headdim, heads, seqlens, causal):
    (nheads, nheads_kv), (seqlen_q, seqlen_k) = heads, seqlens
    # The top-left causal case with seqlen_q > seqlen_k also runs the non-causal kernel.
    _require(headdim, dtype, {causal, False})
    gen = torch.Generator(device="cuda").manual_seed(seqlen_q * 7919 + seqlen_k + headdim)
    q = torch.randn(2, nheads, seqlen_q, headdim, device="cuda", dtype=dtype, generator=gen).requires_grad_()
    k = torch.randn(2, nheads_kv, seqlen_k, headdim, device="cuda", dtype=dtype, generator=gen).requires_grad_()
    v = torch.randn(2, nheads_kv, seqlen_k, headdim, device="cuda", dtype=dtype, generator=gen).requires_grad_()
    gqa = nheads != nheads_kv
    out = flash_ext.sdpa(q, k, v, is_causal=causal, enable_gqa=gqa)
    assert out.shape == q.shape and out.dtype == dtype
    dout = torch.randn(out.shape, device="cuda", dtype=dtype, generator=gen)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)

    out_ref, leaves_ref = _torch_sdpa_float64(q, k, v, causal, gqa)
    grads_ref = torch.autograd.grad(out_ref, leaves_ref, dout.double())
    out_pt, leaves_pt = _math_lowp(q, k, v, causal)
    grads_pt = torch.autograd.grad(out_pt, leaves_pt, dout)
    _assert_close("out", out, out_ref, out_pt, dtype)
    for name, g, g_ref, g_pt in zip(("dq", "dk", "dv"), (dq, dk, dv), grads_ref, grads_pt):
        assert g.shape == g_ref.shape
        _assert_close(name, g, g_ref, g_pt, dtype)


def test_sdpa_under_torch_compile_fullgraph():
    _require(128, torch.bfloat16, (False, True))
    q = torch.randn(2, 4, 300, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 2, 200, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 2, 200, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def f(q, k, v):  # seqlen_q > seqlen_k with is_causal: the two-part path
        return flash_ext.sdpa(q, k, v, is_causal=True, enable_gqa=True)

    eager = f(q, k, v)
    compiled = torch.compile(f, fullgraph=True)(q, k, v)
    assert torch.equal(eager, compiled)
    g_eager = torch.autograd.grad(eager.float().square().sum(), (q, k, v))
    g_compiled = torch.autograd.grad(compiled.float().square().sum(), (q, k, v))
    for a, b in zip(g_eager, g_compiled):
        assert torch.equal(a, b)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", ["stacked", "gqa"])
def test_flash_attn_qkvpacked_func_equals_unpacked(layout, causal):
    _require(128, torch.bfloat16, (causal,))
    if layout == "stacked":
        qkv = torch.randn(2, 257, 3, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        num_heads_q = None
        q, k, v = (qkv.detach()[:, :, i].clone().requires_grad_() for i in range(3))
    else:
        qkv = torch.randn(2, 257, 8 + 2 * 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        num_heads_q = 8
        q, k, v = (t.clone().requires_grad_() for t in qkv.detach().split([8, 2, 2], dim=2))
    # Deterministic: dq's additions in a fixed order, so that the two gradients can be compared bitwise (the
    # default order varies from run to run).
    out, lse = flash_ext.flash_attn_qkvpacked_func(qkv, causal=causal, num_heads_q=num_heads_q, deterministic=True,
                                                   return_attn_probs=True)
    out_ref, lse_ref = flash_ext.flash_attn_func(q, k, v, causal=causal, deterministic=True, return_attn_probs=True)
    assert torch.equal(out, out_ref) and torch.equal(lse, lse_ref)
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, (qkv,), dout)
    grads = torch.autograd.grad(out_ref, (q, k, v), dout)
    expected = torch.stack(grads, dim=2) if layout == "stacked" else torch.cat(grads, dim=2)
    assert torch.equal(dqkv, expected)


# (batch, seqlen_q, seqlen_k): no batch, no query, no key, neither.
EMPTY_SHAPES = [(0, 8, 8), (2, 0, 8), (2, 8, 0), (2, 0, 0)]


@pytest.mark.parametrize("mask", [dict(causal=False), dict(causal=True), dict(window_size=(4, 4), softcap=5.0)],
                         ids=["full", "causal", "window-softcap"])
@pytest.mark.parametrize("shape", EMPTY_SHAPES, ids=lambda s: f"b{s[0]}sq{s[1]}sk{s[2]}")
def test_empty_inputs(shape, mask):
    """An empty problem returns empty outputs as SDPA does, without a launch: out = 0 and lse = -inf for
    queries when there is no key, and zero gradients (of the inputs' shapes)."""
    batch, seqlen_q, seqlen_k = shape
    q = torch.randn(batch, seqlen_q, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(batch, seqlen_k, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    out, lse = flash_ext.attention(q, k, v, **mask)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (batch, 4, seqlen_q)
    assert torch.all(out == 0) and torch.all(lse == -float("inf"))
    dq, dk, dv = torch.autograd.grad(out.float().sum() + lse.clamp(min=0).sum(), (q, k, v), allow_unused=False)
    for grad, t in ((dq, q), (dk, k), (dv, v)):
        assert grad.shape == t.shape and torch.all(grad == 0)
    grads = flash_ext.backward(torch.ones_like(out), q.detach(), k.detach(), v.detach(), out, lse, **mask)
    assert all(g.shape == t.shape and torch.all(g == 0) for g, t in zip(grads, (q, k, v)))
    assert flash_ext.flash_attn_func(q, k, v, **mask).shape == q.shape
    assert flash_ext.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True,
                          is_causal=mask.get("causal", False)).shape == q.transpose(1, 2).shape
