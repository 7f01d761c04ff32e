"""flash_ext.backward / autograd on the GPU against float64 autograd of the reference (FlashAttention's rule).

For every gradient: max|g - g_ref| <= 2 * max|g_pt - g_ref| + rounding noise, where g_ref is float64
autograd of flash_ext.reference.attention_autograd and g_pt the same computed as PyTorch's math attention
does in the inputs' dtype. Outputs are poisoned with NaN first (an unwritten element fails), inputs are fresh
random values.
"""
import math

import pytest
import torch

import flash_ext
from flash_ext.reference import attention_autograd
from gpu_helpers import assert_grads_within_rule, poison_allocator

pytestmark = pytest.mark.gpu

BWD_HEADDIMS = flash_ext.kernel_table.HEADDIMS_BY_DIRECTION["bwd"]
DTYPES = (torch.float16, torch.bfloat16)
SEQLENS = [(1, 1), (1, 239), (7, 113), (113, 7), (128, 128), (200, 1000), (1000, 200), (511, 513), (1000, 1000),
           (2049, 2049)]
HEADS = [(4, 4), (8, 2), (6, 1)]


def _require_bwd_kernel(headdim, dtype, causal):
    if not flash_ext.has_kernel("bwd", headdim, dtype, causal):
        mask = "causal" if causal else "non-causal"
        pytest.skip(f"this build has no {dtype} head dim {flash_ext.kernel_headdim(headdim, 'bwd')} {mask} backward kernel")


def _make(batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, seqlen_q, nheads, headdim, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(batch, seqlen_k, nheads_kv, headdim, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(batch, seqlen_k, nheads_kv, headdim, device="cuda", dtype=dtype, generator=gen)
    dout = torch.randn(batch, seqlen_q, nheads, headdim, device="cuda", dtype=dtype, generator=gen)
    return q, k, v, dout


def _reference_grads(q, k, v, dout, causal, softmax_scale=None, dlse=None, upcast=True):
    dtype = torch.float64 if upcast else q.dtype
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    out, lse = attention_autograd(*leaves, softmax_scale=softmax_scale, causal=causal, upcast=upcast)
    outputs, grads = [out], [dout.to(dtype)]
    if dlse is not None:
        finite = torch.isfinite(lse)
        outputs.append(torch.where(finite, lse, 0.0))
        grads.append(dlse.to(lse.dtype))
    return torch.autograd.grad(outputs, leaves, grads)


def _check_grads(q, k, v, dout, causal, softmax_scale=None, dlse=None, deterministic=False):
    _require_bwd_kernel(q.shape[-1], q.dtype, causal)
    out, lse = flash_ext.forward(q, k, v, softmax_scale=softmax_scale, causal=causal)
    poison_allocator((q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype))
    dq, dk, dv = flash_ext.backward(dout, q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal,
                                    deterministic=deterministic, dlse=dlse)
    torch.cuda.synchronize()
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dq.dtype == dk.dtype == dv.dtype == q.dtype
    ref = _reference_grads(q, k, v, dout, causal, softmax_scale, dlse, upcast=True)
    low = _reference_grads(q, k, v, dout, causal, softmax_scale, dlse, upcast=False)
    assert_grads_within_rule((dq, dk, dv), ref, low, q.dtype)
    return dq, dk, dv


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"sq{s[0]}sk{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("headdim", BWD_HEADDIMS)
def test_backward_matches_reference(headdim, dtype, seqlens, heads, causal):
    seqlen_q, seqlen_k = seqlens
    batch = 2 if seqlen_q * seqlen_k <= 1_000_000 else 1
    seed = hash((headdim, str(dtype), seqlens, heads, causal)) % (2**31)
    q, k, v, dout = _make(batch, seqlen_q, seqlen_k, *heads, headdim, dtype, seed)
    _check_grads(q, k, v, dout, causal)


# Lengths at the edges of every kernel's query block (64, 80 at d128 non-causal, 128 at d64) and K/V block
# (128; 80 at d256): the padding rows of the last block, and lengths a block longer than the keys and shorter.
@pytest.mark.parametrize("seqlens", [(79, 300), (81, 81), (161, 255), (129, 129), (257, 130), (100, 79), (64, 161), (200, 240)],
                         ids=lambda s: f"sq{s[0]}sk{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", BWD_HEADDIMS)
def test_backward_block_edges(headdim, causal, seqlens):
    q, k, v, dout = _make(2, seqlens[0], seqlens[1], 4, 2, headdim, torch.bfloat16, seed=headdim + seqlens[0])
    _check_grads(q, k, v, dout, causal)


@pytest.mark.parametrize("headdim", [40, 80, 120, 192, 200])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_headdims_between_kernels(headdim, causal):
    """Head dims without a backward kernel of their own (d192 included) run on the next size up."""
    q, k, v, dout = _make(2, 157, 301, 4, 2, headdim, torch.bfloat16, seed=headdim)
    _check_grads(q, k, v, dout, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_strided_views_and_preallocated_outputs(causal):
    b, s, h, d = 2, 333, 4, 128
    _require_bwd_kernel(d, torch.bfloat16, causal)
    qkv = torch.randn(b, s, 3, h, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(dim=2)
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    dq, dk, dv = _check_grads(q, k, v, dout, causal, deterministic=True)
    # Gradients written into slices of one packed buffer, as a fused qkv projection would want them.
    out, lse = flash_ext.forward(q, k, v, causal=causal)
    dqkv = torch.full_like(qkv, float("nan"))
    r = flash_ext.backward(dout, q, k, v, out, lse, causal=causal, deterministic=True, dq=dqkv[:, :, 0], dk=dqkv[:, :, 1],
                           dv=dqkv[:, :, 2])
    assert r[0].data_ptr() == dqkv[:, :, 0].data_ptr()
    assert torch.equal(dqkv[:, :, 0], dq) and torch.equal(dqkv[:, :, 1], dk) and torch.equal(dqkv[:, :, 2], dv)


def test_backward_softmax_scale_and_large_scores():
    q, k, v, dout = _make(2, 250, 260, 4, 4, 64, torch.bfloat16, seed=7)
    for scale in (0.01, 0.3):
        _check_grads(q, k, v, dout, causal=False, softmax_scale=scale)
    _check_grads(q * 8, k * 8, v, dout, causal=True)


def test_backward_rows_that_see_no_key():
    """Causal with seqlen_q > seqlen_k: the first queries see no key; their dq is 0, not NaN."""
    q, k, v, dout = _make(2, 300, 50, 4, 2, 128, torch.float16, seed=3)
    dq, _, _ = _check_grads(q, k, v, dout, causal=True)
    assert torch.all(dq[:, :250] == 0)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", [64, 128])
def test_backward_dlse(headdim, causal):
    """A loss that uses lse too (as LSE-merging split or ring attention does): dlse is honoured exactly."""
    q, k, v, dout = _make(2, 300, 400, 4, 2, headdim, torch.bfloat16, seed=5)
    dlse = torch.randn(2, 4, 300, device="cuda", dtype=torch.float32)
    _check_grads(q, k, v, dout, causal, dlse=dlse)
    # The same through autograd: loss = <out, dout> + <lse, dlse>.
    _require_bwd_kernel(headdim, q.dtype, causal)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = flash_ext.attention(*leaves, causal=causal, deterministic=True)
    grads = torch.autograd.grad([out, lse], leaves, [dout, dlse])
    expected = flash_ext.backward(dout, q, k, v, out.detach(), lse.detach(), causal=causal, dlse=dlse, deterministic=True)
    for got, exp in zip(grads, expected):
        assert torch.equal(got, exp)


@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", BWD_HEADDIMS)
def test_backward_deterministic_bitwise(headdim, causal, heads):
    _require_bwd_kernel(headdim, torch.bfloat16, causal)
    q, k, v, dout = _make(2, 1031, 1100, *heads, headdim, torch.bfloat16, seed=headdim)
    out, lse = flash_ext.forward(q, k, v, causal=causal)
    first = flash_ext.backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)
    for _ in range(19):
        again = flash_ext.backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)
        for a, b in zip(first, again):
            assert torch.equal(a, b)
    _check_grads(q, k, v, dout, causal, deterministic=True)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("headdim", BWD_HEADDIMS)
def test_backward_workspace_is_not_assumed_zero(headdim, deterministic):
    """The preprocess kernel zeroes the dQ accumulator (and the deterministic mode's semaphores) block by
    block, with no memset of its own: workspace memory full of NaN, or of an earlier call's sums, must not
    reach dq (a block left unzeroed would make dq NaN, or twice its value on the second call)."""
    _require_bwd_kernel(headdim, torch.bfloat16, True)
    q, k, v, dout = _make(2, 300, 300, 4, 2, headdim, torch.bfloat16, seed=11 + headdim)
    out, lse = flash_ext.forward(q, k, v, causal=True)
    # NaN in both of the caching allocator's pools (blocks from 1 MB up, and the 2 MB segments of smaller ones).
    poison = [torch.full((64 << 20,), float("nan"), device="cuda")] + [
        torch.full((250_000,), float("nan"), device="cuda") for _ in range(8)]
    del poison
    first = flash_ext.backward(dout, q, k, v, out, lse, causal=True, deterministic=deterministic)
    second = flash_ext.backward(dout, q, k, v, out, lse, causal=True, deterministic=deterministic)
    torch.cuda.synchronize()
    ref = _reference_grads(q, k, v, dout, True, upcast=True)
    low = _reference_grads(q, k, v, dout, True, upcast=False)
    assert_grads_within_rule(first, ref, low, q.dtype)
    assert_grads_within_rule(second, ref, low, q.dtype)
    if deterministic:
        for name, a, b in zip(("dq", "dk", "dv"), first, second):
            assert torch.equal(a, b), f"{name} differs between two deterministic calls"


def test_autograd_through_forward_and_flash_attn_func():
    q, k, v, dout = _make(2, 200, 300, 8, 2, 128, torch.bfloat16, seed=1)
    _require_bwd_kernel(128, torch.bfloat16, True)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = flash_ext.flash_attn_func(*leaves, causal=True, deterministic=True)
    out.backward(dout)
    out_ref, lse_ref = flash_ext.forward(q, k, v, causal=True)
    expected = flash_ext.backward(dout, q, k, v, out_ref, lse_ref, causal=True, deterministic=True)
    assert torch.equal(out, out_ref)
    for leaf, exp in zip(leaves, expected):
        assert torch.equal(leaf.grad, exp)
    out2, lse2 = flash_ext.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.equal(out2, out_ref) and torch.equal(lse2, lse_ref)
    # A sum() hands autograd an expanded (stride 0) gradient: made kernel-readable, not rejected.
    leaves[0].grad = None
    flash_ext.flash_attn_func(*leaves, causal=True).sum().backward()
    assert torch.isfinite(leaves[0].grad).all()


def test_flash_attn_func_rejects_unsupported_fa3_arguments():
    q, k, v, _ = _make(1, 16, 16, 2, 2, 64, torch.bfloat16, seed=2)
    for name, value in (("num_splits", 4), ("qv", q), ("attention_chunk", 64), ("pack_gqa", True), ("sm_margin", 8)):
        with pytest.raises(NotImplementedError, match=name):
            flash_ext.flash_attn_func(q, k, v, **{name: value})
    for name, value in (("attention_chunk", 64), ("sm_margin", 8)):
        with pytest.raises(NotImplementedError, match=rf"flash_attn_qkvpacked_func: {name}"):
            flash_ext.flash_attn_qkvpacked_func(torch.stack((q, k, v), dim=2), **{name: value})
    # Their neutral values are accepted (window_size and softcap are supported: tests/test_window_softcap_gpu.py).
    flash_ext.flash_attn_func(q, k, v, window_size=[-1, -1], softcap=0.0, num_splits=1, pack_gqa=None,
                              attention_chunk=0, sm_margin=0)
    # Descales are supported, for FP8 inputs only (tests/test_fp8_*.py).
    with pytest.raises(ValueError, match=r"q_descale is only for FP8"):
        flash_ext.flash_attn_func(q, k, v, q_descale=torch.ones(1, 2, device="cuda"))


def test_opcheck_every_op():
    _require_bwd_kernel(64, torch.bfloat16, False)
    q, k, v, dout = _make(1, 70, 90, 4, 2, 64, torch.bfloat16, seed=4)
    out, lse = flash_ext.forward(q, k, v)
    scale = 0.125
    torch.library.opcheck(torch.ops.flash_ext.fwd, (q, k, v, scale, False))
    torch.library.opcheck(torch.ops.flash_ext.bwd, (dout, q, k, v, out, lse, None, scale, False, True))
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    torch.library.opcheck(torch.ops.flash_ext.bwd_out, (dout, q, k, v, out, lse, None, scale, False, True, dq, dk, dv))
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    torch.library.opcheck(torch.ops.flash_ext.attention, (*leaves, scale, False, True))


def test_backward_gpu_argument_errors():
    q, k, v, dout = _make(1, 64, 80, 2, 2, 64, torch.bfloat16, seed=6)
    _require_bwd_kernel(64, torch.bfloat16, False)
    out, lse = flash_ext.forward(q, k, v)
    with pytest.raises(ValueError, match=r"dout must have the shape of q"):
        flash_ext.backward(dout[:, :10], q, k, v, out, lse)
    with pytest.raises(TypeError, match=r"out must have the dtype of q"):
        flash_ext.backward(dout, q, k, v, out.half(), lse)
    with pytest.raises(ValueError, match=r"lse must have shape \(batch, nheads, seqlen_q\) = \(1, 2, 64\)"):
        flash_ext.backward(dout, q, k, v, out, lse[:, :, :32])
    with pytest.raises(TypeError, match=r"lse must be torch.float32"):
        flash_ext.backward(dout, q, k, v, out, lse.double())
    with pytest.raises(ValueError, match=r"dk must have the shape of k"):
        flash_ext.backward(dout, q, k, v, out, lse, dk=torch.empty_like(q))
    with pytest.raises(ValueError, match=r"lse is on cpu"):
        flash_ext.backward(dout, q, k, v, out, lse.cpu())
    with pytest.raises(ValueError, match=r"dlse must have shape"):
        flash_ext.backward(dout, q, k, v, out, lse, dlse=lse[0])
    with pytest.raises((ValueError, TypeError, RuntimeError)):
        torch.ops.flash_ext.bwd(dout, q, k, v, out, lse[:, :1], None, 0.125, False, False)


def test_short_training_run_matches_sdpa():
    """A tiny causal transformer trained 100 steps with a fixed seed: flash_ext's attention against
    SDPA's, same initial weights and data. Both learn, and every step's loss is within 5% (+0.05) of SDPA's:
    bf16 rounding differences between two correct kernels grow over the steps but stay far below that,
    while a wrong gradient would stall or derail the curve."""
    _require_bwd_kernel(64, torch.bfloat16, True)

    class Block(torch.nn.Module):
        def __init__(self, dim, heads, attention):
            super().__init__()
            self.heads, self.attention = heads, attention
            self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
            self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

        def forward(self, x):
            b, s, d = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
            x = x + self.proj(self.attention(q, k, v).reshape(b, s, d))
            return x + self.mlp(self.norm2(x))

    def flash(q, k, v):
        return flash_ext.flash_attn_func(q, k, v, causal=True)

    def sdpa(q, k, v):
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                             is_causal=True)
        return o.transpose(1, 2)

    def train(attention):
        torch.manual_seed(0)
        vocab, dim = 512, 256
        model = torch.nn.Sequential(torch.nn.Embedding(vocab, dim), *[Block(dim, 4, attention) for _ in range(2)],
                                    torch.nn.LayerNorm(dim), torch.nn.Linear(dim, vocab)).cuda().to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator(device="cuda").manual_seed(1)
        # A learnable sequence task: each token is the previous one plus 1 (mod vocab), from random starts.
        losses = []
        for _ in range(100):
            start = torch.randint(0, vocab, (8, 1), device="cuda", generator=gen)
            tokens = (start + torch.arange(129, device="cuda")) % vocab
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    ours, theirs = train(flash), train(sdpa)
    assert ours[-1] < 0.5 * ours[0] and theirs[-1] < 0.5 * theirs[0], "both must learn"
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert abs(a - b) <= 0.05 * abs(b) + 0.05, f"step {step}: flash_ext loss {a:.4f} vs SDPA {b:.4f}"
