"""CPU tests of the FP8 helpers (flash_ext.fp8) and of the FP8 argument rules of flash_ext.forward (the
C++ op runs them on CPU tensors too, before its device check: those need the built extension)."""
import pytest
import torch

import flash_ext
from flash_ext import fp8
from flash_ext.reference import attention_fp8_emulation, attention_ref

needs_ext = pytest.mark.skipif(not flash_ext.extension_available(),
                               reason="the tensor rules are the C++ op's: flash_ext._C is not built")
E4M3 = torch.float8_e4m3fn


@pytest.mark.parametrize("n", [1, 2, 16, 64, 128, 256])
def test_hadamard_is_orthonormal_and_symmetric(n):
    h = fp8.hadamard_matrix(n, dtype=torch.float64)
    assert torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    assert torch.equal(h, h.T)
    assert torch.allclose(h.abs(), torch.full_like(h, n ** -0.5))


def test_hadamard_rejects_non_power_of_two():
    with pytest.raises(ValueError, match=r"power of two, got 96"):
        fp8.hadamard_matrix(96)


@pytest.mark.parametrize("headdim,block", [(64, 64), (96, 32), (128, 128), (192, 64), (256, 256), (80, 16)])
def test_rotation_preserves_scores(headdim, block):
    assert fp8.hadamard_block(headdim) == block
    gen = torch.Generator().manual_seed(headdim)
    q = torch.randn(2, 5, 3, headdim, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 7, 3, headdim, generator=gen, dtype=torch.float64)
    rq, rk = fp8.rotate_head_dim(q), fp8.rotate_head_dim(k)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k)
    assert torch.allclose(torch.einsum("bqhd,bkhd->bhqk", rq, rk), s, atol=1e-10)
    assert torch.allclose(rq.norm(dim=-1), q.norm(dim=-1))


def test_rotation_spreads_an_outlier_channel():
    x = torch.zeros(1, 1, 1, 128, dtype=torch.float64)
    x[..., 5] = 100.0
    assert fp8.rotate_head_dim(x).abs().max().item() == pytest.approx(100.0 / 128 ** 0.5)


@pytest.mark.parametrize("hadamard", [False, True])
def test_quantize_qkv_layout_and_scale(hadamard):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 33, 8, 64, generator=gen).bfloat16()
    k = torch.randn(2, 17, 2, 64, generator=gen).bfloat16() * 5
    v = torch.randn(2, 17, 2, 64, generator=gen).bfloat16()
    q8, k8, v8, qd, kd, vd = fp8.quantize_qkv(q, k, v, hadamard=hadamard)
    for x8, d in ((q8, qd), (k8, kd), (v8, vd)):
        assert x8.dtype == E4M3 and x8.is_contiguous()
        assert d.dtype == torch.float32 and d.shape == (2, 2) and d.is_contiguous()
    # Each (batch, KV head) group reaches the e4m3 maximum, and the descale gives the real values back.
    grouped = q8.float().reshape(2, 33, 2, 4, 64).abs().amax(dim=(1, 3, 4))
    assert torch.equal(grouped, torch.full_like(grouped, 448.0))
    assert torch.allclose(fp8.dequantize(v8, vd), v.double(), rtol=0.07, atol=1e-6)
    assert torch.allclose(fp8.dequantize(k8, kd).abs().amax(), (fp8.rotate_head_dim(k.float()) if hadamard
                                                               else k.float()).abs().amax().double(), rtol=1e-6)


def test_quantize_all_zero_slice():
    q = torch.zeros(1, 4, 2, 64)
    q8, qd = fp8.quantize(q, 2)
    assert torch.equal(q8.float(), torch.zeros_like(q)) and torch.isfinite(qd).all()


@pytest.mark.parametrize("bad,match,exc", [
    (dict(q=torch.zeros(1, 4, 2, 64, dtype=torch.int32)), r"q has dtype torch.int32", TypeError),
    (dict(k=torch.zeros(1, 4, 2, 64)), r"k and v must have the same shape", ValueError),
    (dict(q=torch.zeros(1, 4, 3, 64)), r"nheads \(3\) must be a multiple of nheads_kv \(2\)", ValueError),
    (dict(q=torch.zeros(1, 4, 2, 72), k=torch.zeros(1, 5, 2, 72), v=torch.zeros(1, 5, 2, 72)),
     r"head dim 72 .* multiple of 16", ValueError),
    (dict(v=torch.zeros(5, 2, 64)), r"v must have 4 dims", ValueError),
])
def test_quantize_qkv_bad_inputs(bad, match, exc):
    args = dict(q=torch.zeros(1, 4, 2, 64), k=torch.zeros(1, 5, 2, 64), v=torch.zeros(1, 5, 2, 64))
    args.update(bad)
    with pytest.raises(exc, match=match):
        fp8.quantize_qkv(**args)


def test_emulation_without_rounding_is_exact():
    """attention_fp8_emulation differs from the float64 reference only by its e4m3 roundings: on inputs
    that e4m3 holds exactly and with P's rounding removed (offset chosen so P is tiny, then scaled back), the
    emulation of one key per row is exact."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 9, 2, 64, generator=gen).to(E4M3)
    k = torch.randn(1, 1, 2, 64, generator=gen).to(E4M3)
    v = torch.randn(1, 1, 2, 64, generator=gen).to(E4M3)
    emu = attention_fp8_emulation(q, k, v, max_offset=8)  # one key: P = 2^8 exactly
    ref, _ = attention_ref(q.double(), k.double(), v.double())
    assert torch.allclose(emu, ref, atol=1e-12)


@needs_ext
def test_fp8_mixed_with_16bit():
    q = torch.zeros(1, 8, 2, 64).to(E4M3)
    k = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"share one dtype, got q torch.float8_e4m3fn, k torch.bfloat16"):
        flash_ext.forward(q, k, k)


@needs_ext
def test_fp8_e5m2_rejected():
    x = torch.zeros(1, 8, 2, 64).to(torch.float8_e5m2)
    with pytest.raises(TypeError, match=r"q has dtype torch.float8_e5m2; .*torch.float8_e4m3fn"):
        flash_ext.forward(x, x, x)


@needs_ext
@pytest.mark.parametrize("name", ["q_descale", "k_descale", "v_descale"])
@pytest.mark.parametrize("descale,match,exc", [
    (torch.ones(2, 3), r"must have shape \(batch, nheads_kv\) = \(1, 2\), got \(2, 3\)", ValueError),
    (torch.ones(2), r"must have shape \(batch, nheads_kv\)", ValueError),
    (torch.ones(1, 2, dtype=torch.float16), r"must be torch.float32, got torch.float16", TypeError),
])
def test_fp8_bad_descale(name, descale, match, exc):
    q = torch.zeros(1, 8, 4, 64).to(E4M3)
    k = torch.zeros(1, 8, 2, 64).to(E4M3)
    with pytest.raises(exc, match=rf"{name} {match}"):
        flash_ext.forward(q, k, k, **{name: descale})


@needs_ext
def test_descale_with_16bit_inputs():
    q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"q_descale is only for FP8 \(torch.float8_e4m3fn\) q, k, v; got torch.bfloat16"):
        flash_ext.forward(q, q, q, q_descale=torch.ones(1, 2))


@needs_ext
def test_fp8_headdim_multiple_of_16():
    x = torch.zeros(1, 8, 2, 72).to(E4M3)
    with pytest.raises(ValueError, match=r"head dim 72 is not supported for FP8: it must be a multiple of 16"):
        flash_ext.forward(x, x, x)


@needs_ext
def test_fp8_valid_cpu_tensors_need_cuda():
    x = torch.zeros(1, 8, 2, 64).to(E4M3)
    with pytest.raises(ValueError, match=r"q is on cpu; flash_ext.forward needs CUDA tensors"):
        flash_ext.forward(x, x, x, q_descale=torch.ones(1, 2))


@needs_ext
def test_fp8_backward_rejected_before_launch():
    x = torch.zeros(1, 8, 2, 64).to(E4M3)
    lse = torch.zeros(1, 2, 8)
    with pytest.raises(TypeError, match=r"flash_ext.backward supports torch.float16 and torch.bfloat16 \(FP8 is forward-only\)"):
        flash_ext.backward(x, x, x, x, x, lse)


def test_descale_argument_type():
    x = torch.zeros(1, 8, 2, 64).to(E4M3)
    with pytest.raises(TypeError, match=r"k_descale must be a torch.Tensor, got float"):
        flash_ext.forward(x, x, x, k_descale=1.0)


def test_quantize_with_a_cache_descale():
    """New keys for an FP8 cache: stored with the cache's descales, so that dequantize gives them back within
    e4m3's rounding, and values past the range clamped."""
    torch.manual_seed(3)
    k_cache = torch.randn(2, 16, 4, 32)
    cache8, descale = fp8.quantize(k_cache, 2)
    k_new = torch.randn(2, 3, 4, 32)
    k_new[1, 0, 3, 5] = 1e6  # beyond the cache's range: clamped to 448 * descale
    k8 = fp8.quantize_with(k_new, descale)
    assert k8.dtype == torch.float8_e4m3fn and k8.shape == k_new.shape
    back = fp8.dequantize(k8, descale)
    assert back[1, 0, 3, 5].item() == pytest.approx(448 * descale[1, 1].item())
    k_new[1, 0, 3, 5] = 0.0
    back[1, 0, 3, 5] = 0.0
    assert ((back - k_new.double()).abs() <= k_new.double().abs() * 2 ** -4 + descale.max().item() * 2 ** -9).all()
    with pytest.raises(ValueError, match=r"descale must be \(batch=2, nheads_kv\)"):
        fp8.quantize_with(k_new, descale[:, :1].expand(2, 3))


def test_quantize_qkv_v_colmajor():
    """v_colmajor=True: the same values, the sequence dim contiguous (what the forward's column-major path reads)."""
    q, k, v = (torch.randn(2, s, h, 64) for s, h in ((9, 4), (33, 2), (33, 2)))
    rowmajor = fp8.quantize_qkv(q, k, v)
    colmajor = fp8.quantize_qkv(q, k, v, v_colmajor=True)
    v8 = colmajor[2]
    assert v8.shape == (2, 33, 2, 64) and v8.stride(1) == 1 and v8.stride(-1) == 48  # 33 keys padded to 48
    assert torch.equal(v8.view(torch.uint8), rowmajor[2].view(torch.uint8))
    for a, b in zip(colmajor[:2] + colmajor[3:], rowmajor[:2] + rowmajor[3:]):
        assert torch.equal(a.float(), b.float())
    with pytest.raises(TypeError, match=r"v_colmajor must be a bool, got int"):
        fp8.quantize_qkv(q, k, v, v_colmajor=1)
    with pytest.raises(ValueError, match=r"v must be a 4-dim tensor \(batch, seqlen, heads, headdim\), got Tensor of shape \(33, 64\)"):
        fp8.colmajor(v[0, :, 0])


def test_kernel_table_v_colmajor_entries():
    """Column-major V has kernels of its own only for the FP8 forward at the listed head dims, both masks."""
    entries = [e for e in flash_ext.kernel_table.all_kernels() if e.v_colmajor]
    assert sorted((e.direction, e.dtype, e.headdim, e.causal) for e in entries) == sorted(
        ("fwd", dtype, headdim, causal) for dtype, headdim in flash_ext.kernel_table.V_COLMAJOR_FWD for causal in (False, True))
    assert all(e.file_name.endswith("_vcolmajor_sm90.cu") for e in entries)


def test_has_kernel_ignores_v_colmajor_entries():
    info = {"kernels": [{"direction": "fwd", "headdim": 256, "dtype": "e4m3", "causal": False, "v_colmajor": True}]}
    assert not flash_ext.has_kernel("fwd", 256, E4M3, False, info=info)
    info["kernels"].append({"direction": "fwd", "headdim": 256, "dtype": "e4m3", "causal": False, "v_colmajor": False})
    assert flash_ext.has_kernel("fwd", 256, E4M3, False, info=info)


@needs_ext
def test_fp8_v_neither_row_nor_column_major():
    q = torch.zeros(1, 8, 2, 64).to(E4M3)
    v = torch.zeros(1, 2, 64, 16).to(E4M3).permute(0, 3, 1, 2)[:, :8]  # head dim and seqlen both strided
    v = v.as_strided(v.shape, (v.stride(0), 2, v.stride(2), v.stride(3)))
    with pytest.raises(ValueError, match=r"v must be contiguous in its last \(headdim\) dim"):
        flash_ext.forward(q, q, v)


@needs_ext
def test_fp8_v_colmajor_bad_stride():
    q = torch.zeros(1, 8, 2, 64).to(E4M3)
    base = torch.zeros(1, 2, 64, 8 + 4).to(E4M3)[..., :8]  # seqlen stride 1, head dim stride 12 (not 16-aligned)
    v = base.permute(0, 3, 1, 2)
    assert v.stride(1) == 1 and v.stride(3) == 12
    with pytest.raises(ValueError, match=r"v \(column-major: its sequence dim contiguous\) stride 12 of dim 3"):
        flash_ext.forward(q, q, v)
