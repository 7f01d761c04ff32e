"""The FP8 (e4m3) forward on the GPU.

Error rule: the kernel's output is compared with the float64 reference computed on the dequantized inputs
(what the FP8 tensors stand for); its max error must stay within 2x that of attention_fp8_emulation, which
rounds the inputs and P to e4m3 the same way (same Max_offset) and is exact otherwise, plus the rounding
noise of bf16 (the output dtype). The LSE is the reference's within 2e-3 relative (FP8 GEMMs accumulate
S with fewer mantissa bits than fp32: ~5e-4 relative error measured).
"""
import math

import pytest
import torch

import flash_ext
from flash_ext import fp8
from flash_ext.reference import attention_fp8_emulation, attention_ref
from gpu_helpers import poison_allocator, rounding_noise, row_max_staircase

pytestmark = pytest.mark.gpu

HEADDIMS = flash_ext.KERNEL_HEADDIMS
SEQLENS = [(1, 1), (7, 113), (113, 7), (239, 1000), (1000, 1000), (2049, 2049)]
HEADS = [(4, 4), (8, 2), (6, 1)]


def _require_kernel(headdim, causal):
    if not flash_ext.has_kernel("fwd", headdim, torch.float8_e4m3fn, causal):
        mask = "causal" if causal else "non-causal"
        pytest.skip(f"this build has no e4m3 head dim {flash_ext.kernel_headdim(headdim)} {mask} forward kernel")


def _max_offset():
    """The build's Max_offset (8 unless built with -DFLASH_EXT_FP8_MAX_OFFSET=0 for a measurement)."""
    return flash_ext.build_info()["fp8_max_offset"]


def _inputs(batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, seed, hadamard=False, v_colmajor=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, seqlen_q, nheads, headdim, device="cuda", generator=gen)
    k = torch.randn(batch, seqlen_k, nheads_kv, headdim, device="cuda", generator=gen)
    v = torch.randn(batch, seqlen_k, nheads_kv, headdim, device="cuda", generator=gen)
    return fp8.quantize_qkv(q.bfloat16(), k.bfloat16(), v.bfloat16(), hadamard=hadamard, v_colmajor=v_colmajor)


def _check(q8, k8, v8, q_descale, k_descale, v_descale, causal, softmax_scale=None):
    batch, seqlen_q, nheads, headdim = q8.shape
    _require_kernel(headdim, causal)
    poison_allocator(((batch, seqlen_q, nheads, headdim), torch.bfloat16), ((batch, nheads, seqlen_q), torch.float32))
    out, lse = flash_ext.forward(q8, k8, v8, softmax_scale=softmax_scale, causal=causal, q_descale=q_descale,
                                 k_descale=k_descale, v_descale=v_descale)
    torch.cuda.synchronize()
    assert out.dtype == torch.bfloat16 and out.shape == q8.shape and lse.dtype == torch.float32
    nheads_kv = k8.shape[2]
    ones = torch.ones(batch, nheads_kv, device="cuda")
    deq = [fp8.dequantize(x, ones if d is None else d, nheads_kv) for x, d in
           ((q8, q_descale), (k8, k_descale), (v8, v_descale))]
    ref, ref_lse = attention_ref(*deq, softmax_scale=softmax_scale, causal=causal)
    emu = attention_fp8_emulation(q8, k8, v8, q_descale, k_descale, v_descale, softmax_scale=softmax_scale,
                                  causal=causal, max_offset=_max_offset())
    assert not out.isnan().any(), "output has NaN (unwritten or poisoned elements)"
    err = (out.double() - ref).abs().max().item()
    err_emu = (emu - ref).abs().max().item()
    assert err <= 2 * err_emu + rounding_noise(ref, torch.bfloat16) + 1e-5, (err, err_emu)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "LSE must be -inf exactly where a row sees no key"
    # FP8 GMMA accumulates S with fewer mantissa bits than fp32: S, and with it the LSE, carries a relative
    # error of ~5e-4 (measured on the H200), so the LSE bound scales with its size.
    if finite.any():
        lse_err = (lse.double()[finite] - ref_lse[finite]).abs()
        assert (lse_err <= 2e-3 * ref_lse[finite].abs().clamp_min(1.0)).all(), lse_err.max().item()
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("headdim", HEADDIMS)
def test_fp8_row_max_moving_across_blocks(headdim, causal):
    """Row maxima that move between key blocks by steps around FP8's tighter limits (P may not pass 448)."""
    scale = 1 / math.sqrt(headdim)
    q, k, v = row_max_staircase(1, 500, 1000, 4, headdim, scale, seed=headdim + causal)
    q8, k8, v8, qd, kd, vd = fp8.quantize_qkv(q.bfloat16(), k.bfloat16(), v.bfloat16())
    _check(q8, k8, v8, qd, kd, vd, causal, softmax_scale=scale)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("headdim", HEADDIMS)
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS)
@pytest.mark.parametrize("nheads,nheads_kv", HEADS)
def test_fp8_forward_matches_reference(seqlen_q, seqlen_k, nheads, nheads_kv, headdim, causal):
    seed = hash((seqlen_q, seqlen_k, nheads, nheads_kv, headdim, causal)) % 2**31
    _check(*_inputs(2, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, seed), causal=causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("headdim", HEADDIMS)
def test_fp8_descales_other_than_one(headdim, causal):
    """Descales far from 1 and different per (batch, KV head), q stored directly in e4m3."""
    _require_kernel(headdim, causal)
    gen = torch.Generator(device="cuda").manual_seed(headdim + causal)
    batch, nheads, nheads_kv = 2, 8, 2
    q8, k8, v8 = (torch.randn(batch, s, h, headdim, device="cuda", generator=gen).mul_(30).to(torch.float8_e4m3fn)
                  for s, h in ((300, nheads), (517, nheads_kv), (517, nheads_kv)))
    q_d, k_d, v_d = (torch.rand(batch, nheads_kv, device="cuda", generator=gen) * 0.05 + 0.01 for _ in range(3))
    _check(q8, k8, v8, q_d, k_d, v_d, causal=causal)
    # Only some of them given: the others are 1.
    _check(q8, k8, v8, None, k_d, None, causal=causal, softmax_scale=0.02)


@pytest.mark.parametrize("persistent", ["0", "1"], ids=["one_cta_per_tile", "persistent"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", HEADDIMS)
def test_fp8_launch_modes(headdim, causal, persistent, monkeypatch):
    """Both launch modes, forced through FLASH_EXT_PERSISTENT (FP8 d256 has no persistent form and ignores
    it): several hundred tiles, so that persistent CTAs walk many tiles (the transposing warps keep their V
    stages across them), GQA, odd lengths, and descales that differ per (batch, KV head)."""
    monkeypatch.setenv("FLASH_EXT_PERSISTENT", persistent)
    batch, nheads, nheads_kv = 3, 40, 8
    q8, k8, v8, *descales = _inputs(batch, 333, 777, nheads, nheads_kv, headdim, seed=headdim + 7 * causal)
    # Each (batch, KV head) rescaled by its own factor, so that a tile with another tile's descales shows.
    gen = torch.Generator(device="cuda").manual_seed(headdim)
    q_d, k_d, v_d = (d * (torch.rand(batch, nheads_kv, device="cuda", generator=gen) + 0.5) for d in descales)
    _check(q8, k8, v8, q_d, k_d, v_d, causal=causal)


def test_fp8_descale_strided_view():
    _require_kernel(128, False)
    q8, k8, v8, q_d, k_d, v_d = _inputs(2, 128, 256, 4, 4, 128, seed=3)
    wide = torch.zeros(4, 2, device="cuda").t()  # (2, 4) with strides (1, 2)
    wide.copy_(k_d)
    _check(q8, k8, v8, q_d, wide, v_d, causal=False)


def test_fp8_strided_packed_qkv():
    """q, k, v as slices of one packed (batch, seqlen, 3, heads, headdim) e4m3 tensor."""
    _require_kernel(128, True)
    gen = torch.Generator(device="cuda").manual_seed(11)
    packed = torch.randn(2, 333, 3, 4, 128, device="cuda", generator=gen).to(torch.float8_e4m3fn)
    q8, k8, v8 = packed.unbind(2)
    assert not q8.is_contiguous()
    _check(q8, k8, v8, None, None, None, causal=True)


@pytest.mark.parametrize("headdim", [80, 112, 160])
def test_fp8_headdim_padded_to_kernel(headdim):
    """Head dims between kernel sizes (multiples of 16) run zero-padded on the next kernel."""
    _check(*_inputs(1, 200, 300, 2, 2, headdim, seed=headdim), causal=False)


@pytest.mark.parametrize("hadamard", [False, True])
def test_fp8_quantize_qkv_end_to_end(hadamard):
    """quantize_qkv + forward approximates the 16-bit attention of the original tensors."""
    _require_kernel(128, True)
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(2, 1024, 8, 128, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(3))
    out, _ = flash_ext.forward(*fp8.quantize_qkv(q, k, v, hadamard=hadamard)[:3], causal=True,
                               **dict(zip(("q_descale", "k_descale", "v_descale"),
                                          fp8.quantize_qkv(q, k, v, hadamard=hadamard)[3:])))
    ref, _ = attention_ref(q, k, v, causal=True)
    rmse = (out.double() - ref).pow(2).mean().sqrt().item()
    assert rmse < 2.5e-2, rmse


def test_fp8_flash_attn_func_matches_forward():
    _require_kernel(128, False)
    q8, k8, v8, q_d, k_d, v_d = _inputs(2, 200, 300, 8, 2, 128, seed=9)
    out, lse = flash_ext.forward(q8, k8, v8, q_descale=q_d, k_descale=k_d, v_descale=v_d)
    out2, lse2 = flash_ext.flash_attn_func(q8, k8, v8, q_descale=q_d, k_descale=k_d, v_descale=v_d,
                                           return_attn_probs=True)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_fp8_opcheck():
    """The fake implementation and dispatch of fwd with FP8 inputs and descales. opcheck's test_schema is
    left out: its SchemaCheckMode compares inputs with arithmetic torch has no e4m3 kernel for ("mul_cuda"
    not implemented for Float8_e4m3fn); the 16-bit opcheck runs it (test_backward_gpu.py)."""
    _require_kernel(128, False)
    q8, k8, v8, q_d, k_d, v_d = _inputs(1, 130, 70, 4, 2, 128, seed=1)
    torch.library.opcheck(torch.ops.flash_ext.fwd, (q8, k8, v8, 0.1, False, q_d, k_d, v_d),
                          test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))


def test_fp8_bad_inputs_on_gpu():
    """Errors that need CUDA tensors: descales on another device, FP8 with the backward or with autograd."""
    _require_kernel(128, False)
    q8, k8, v8, q_d, k_d, v_d = _inputs(1, 64, 64, 2, 2, 128, seed=2)
    with pytest.raises(ValueError, match=r"k_descale is on cpu"):
        flash_ext.forward(q8, k8, v8, q_descale=q_d, k_descale=k_d.cpu(), v_descale=v_d)
    out, lse = flash_ext.forward(q8, k8, v8)
    with pytest.raises(TypeError, match=r"q has dtype torch.float8_e4m3fn; flash_ext.backward .*FP8 is forward-only"):
        flash_ext.backward(out.to(torch.float8_e4m3fn), q8, k8, v8, out.to(torch.float8_e4m3fn), lse)
    q_grad = q8.detach().requires_grad_(True)
    with pytest.raises(NotImplementedError, match=r"FP8 forward is not differentiable"):
        flash_ext.forward(q_grad, k8, v8)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("headdim", [256, 128])  # 256: the kernels for column-major V; 128: a row-major copy
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(7, 113), (239, 1000), (2049, 2049)])
def test_fp8_v_colmajor(seqlen_q, seqlen_k, headdim, causal):
    """v column-major (its sequence dim contiguous, quantize_qkv(v_colmajor=True)): within the error rule, and
    next to the row-major call on the same values: the same P and V, only GEMM1's key order differs."""
    q8, k8, v_colmajor, q_d, k_d, v_d = _inputs(2, seqlen_q, seqlen_k, 8, 2, headdim, seed=headdim + seqlen_k,
                                                v_colmajor=True)
    assert v_colmajor.stride(1) == 1 and v_colmajor.stride(-1) != 1
    out_cm, lse_cm = _check(q8, k8, v_colmajor, q_d, k_d, v_d, causal=causal)
    if causal and headdim == 256:
        # The row-major causal d256 kernel rescales O lazily and the column-major one eagerly (tile_size.h's
        # kLazyRescale): a row's P may be scaled by up to 2^0.75 more before its e4m3 rounding, and its LSE
        # comes from another max. Both calls are held to the error rule; the LSEs agree to fp32 rounding.
        out, lse = _check(q8, k8, v_colmajor.contiguous(), q_d, k_d, v_d, causal=causal)
        torch.testing.assert_close(lse_cm, lse, rtol=0, atol=1e-5)
    else:
        out, lse = flash_ext.forward(q8, k8, v_colmajor.contiguous(), causal=causal, q_descale=q_d, k_descale=k_d,
                                     v_descale=v_d)
        assert torch.equal(lse_cm, lse)  # S and the softmax statistics do not depend on V's layout
        assert (out_cm.float() - out.float()).abs().max().item() <= 2e-2 * out.float().abs().max().item()
