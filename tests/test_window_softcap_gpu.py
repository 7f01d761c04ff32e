"""Sliding window (window_size) and softcap on the GPU, forward and backward, against the float64 references
(FlashAttention's error rule, as tests/test_forward_gpu.py and tests/test_backward_gpu.py apply it).

Every case draws fresh random inputs and poisons the memory the outputs will land in (an element the kernel
forgets to write stays NaN). Forward:
  max|out - ref| <= 2 * max|out_pt - ref| + rounding noise,
out_pt being attention_lowp (PyTorch attention in the inputs' dtype, the softcap's tanh included), and the
LSE within 1e-3 of the float64 reference where finite (plus softcap * 2^-10 with a softcap: the kernels
take tanh.approx.f32, whose relative error is below 2^-10.987, and |logit| <= softcap; the LSE is a convex
mix of the logits), -inf exactly where a row sees no key (out exactly 0 there). Backward: every gradient
within 2x the error of attention_autograd in the inputs' dtype (+ rounding noise) of float64 autograd of
attention_autograd, with zero gradients for queries that see no key and for keys no query sees.

A window runs on the causal kernel of its head dim and dtype, and a window that covers every key (e.g.
(-1, -1) or one wider than the sequences) on the non-causal one: windowed cases need both kernels in the
build, and are skipped with the reason otherwise.

The cases are chosen, not crossed: each head dim meets every (window, causal) pair, on a sequence-length
pair and a head layout that rotate with it, so that every window meets several lengths and layouts.
"""
import math

import pytest
import torch

import flash_ext
from flash_ext import fp8
from flash_ext.reference import attention_autograd, attention_fp8_emulation, attention_lowp, attention_ref
from gpu_helpers import assert_grads_within_rule, poison_allocator, rounding_noise

pytestmark = pytest.mark.gpu

FWD_HEADDIMS = flash_ext.KERNEL_HEADDIMS
BWD_HEADDIMS = flash_ext.kernel_table.HEADDIMS_BY_DIRECTION["bwd"]
DTYPES = (torch.float16, torch.bfloat16)
# (left, right): one key, a few keys, a block's worth on both sides, left-only and right-only bands, a
# lopsided band, and one wider than most sequences here.
WINDOWS = [(0, 0), (1, 0), (17, 0), (64, 64), (100, -1), (-1, 100), (256, 3), (1000, 0)]
# Every window with and without causal where that is legal (causal: right must be -1 or 0).
WINDOW_MASKS = [(w, c) for w in WINDOWS for c in (False, True) if not c or w[1] in (-1, 0)]
SEQLENS = [(1, 1), (7, 113), (113, 7), (128, 128), (1000, 1000), (2049, 2049), (3000, 1025), (200, 1000)]
HEADS = [(4, 4), (8, 2), (6, 1)]  # MHA, GQA 8:2 (4 query heads per KV head), MQA 6:1
# (softcap, causal, window): off-diagonal cases of softcap x mask.
SOFTCAP_MASKS = [(5.0, False, (-1, -1)), (30.0, False, (-1, -1)), (5.0, True, (-1, -1)), (30.0, True, (-1, -1)),
                 (5.0, False, (64, 64)), (30.0, True, (100, 0))]
# Logits of a few units (q scaled by this): softcap 5 caps them hard, 30 a little.
SOFTCAP_Q_SCALE = 3.0
# tanh.approx.f32's documented relative error bound (2^-10.987), rounded up.
TANH_APPROX_REL_ERR = 2.0 ** -10
NO_WINDOW = (-1, -1)


def _label(window, causal):
    mask = "causal" if causal else "full"
    return mask if window == NO_WINDOW else f"w{window[0]}_{window[1]}-{mask}"


def _cases(headdims, masks):
    """pytest.params (headdim, window, causal, seqlens, heads): every head dim with every (window, causal),
    the lengths and heads rotating with both so that each window meets several of them."""
    cases = []
    for hi, headdim in enumerate(headdims):
        for mi, (window, causal) in enumerate(masks):
            seqlens = SEQLENS[(mi + 3 * hi) % len(SEQLENS)]
            heads = HEADS[(mi + hi) % len(HEADS)]
            cases.append(pytest.param(headdim, window, causal, seqlens, heads,
                                      id=f"d{headdim}-{_label(window, causal)}-sq{seqlens[0]}sk{seqlens[1]}"
                                         f"-h{heads[0]}kv{heads[1]}"))
    return cases


def _softcap_cases(headdims):
    cases = []
    for hi, headdim in enumerate(headdims):
        for ci, (softcap, causal, window) in enumerate(SOFTCAP_MASKS):
            seqlens = SEQLENS[(2 * ci + hi) % len(SEQLENS)]
            heads = HEADS[(ci + hi) % len(HEADS)]
            cases.append(pytest.param(headdim, softcap, window, causal, seqlens, heads,
                                      id=f"d{headdim}-cap{softcap:g}-{_label(window, causal)}"
                                         f"-sq{seqlens[0]}sk{seqlens[1]}-h{heads[0]}kv{heads[1]}"))
    return cases


def _require_kernels(direction, headdim, dtype, causal, window):
    """The kernels the call may run: the causal flag's, and with a window both (see the module docstring)."""
    for mask in ((False, True) if window != NO_WINDOW else (causal,)):
        if not flash_ext.has_kernel(direction, headdim, dtype, mask):
            name = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float8_e4m3fn: "e4m3"}[dtype]
            pytest.skip(f"this build has no {name} head dim {flash_ext.kernel_headdim(headdim, direction)} "
                        f"{'causal' if mask else 'non-causal'} {direction} kernel"
                        + (" (a window needs both)" if window != NO_WINDOW else ""))


def _batch(seqlen_q, seqlen_k):
    return 2 if seqlen_q * seqlen_k <= 1_000_000 else 1


def _make(batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, dtype, seed, q_scale=1.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, seqlen_q, nheads, headdim, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(batch, seqlen_k, nheads_kv, headdim, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(batch, seqlen_k, nheads_kv, headdim, device="cuda", dtype=dtype, generator=gen)
    dout = torch.randn(batch, seqlen_q, nheads, headdim, device="cuda", dtype=dtype, generator=gen)
    return (q * q_scale).to(dtype), k, v, dout


def _band(seqlen_q, seqlen_k, causal, window):
    """(seqlen_q, seqlen_k) bool on the GPU: the visible pairs, from tril/triu (independent of the reference)."""
    left, right = window
    right = 0 if causal else right
    ones = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device="cuda")
    band = ones.clone()
    if right >= 0:
        band &= ones.tril(diagonal=seqlen_k - seqlen_q + right)
    if left >= 0:
        band &= ones.triu(diagonal=seqlen_k - seqlen_q - left)
    return band


def _lse_tol(softcap):
    return 1e-3 + softcap * TANH_APPROX_REL_ERR


def _check_forward(q, k, v, causal, window=NO_WINDOW, softcap=0.0, softmax_scale=None):
    batch, seqlen_q, nheads, headdim = q.shape
    _require_kernels("fwd", headdim, q.dtype, causal, window)
    poison_allocator(((batch, seqlen_q, nheads, headdim), q.dtype), ((batch, nheads, seqlen_q), torch.float32))
    out, lse = flash_ext.forward(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window,
                                 softcap=softcap)
    torch.cuda.synchronize()
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (batch, nheads, seqlen_q) and lse.dtype == torch.float32
    assert not out.isnan().any(), "NaN in out (unwritten or invalid elements)"
    assert not lse.isnan().any(), "NaN in lse (unwritten or invalid elements)"

    mask = dict(causal=causal, window_size=window, softcap=softcap)
    out_ref, lse_ref = attention_ref(q, k, v, softmax_scale=softmax_scale, **mask)
    out_pt = attention_lowp(q, k, v, softmax_scale=softmax_scale, **mask)
    err = (out.double() - out_ref).abs().max().item()
    err_pt = (out_pt.double() - out_ref).abs().max().item()
    noise = rounding_noise(out_ref, q.dtype)
    assert err <= 2 * err_pt + noise, f"max error {err:.3e} > 2 * {err_pt:.3e} (PyTorch {q.dtype}) + {noise:.1e}"

    finite = torch.isfinite(lse_ref)
    sees_a_key = _band(seqlen_q, k.shape[1], causal, window).any(dim=-1)  # (seqlen_q,)
    assert torch.equal(finite, sees_a_key.expand_as(finite)), "the reference and the band disagree"
    assert torch.equal(torch.isfinite(lse), finite), "lse is -inf exactly where a row sees no key"
    assert torch.all(lse[~finite] == -math.inf)
    if finite.any():
        lse_err = (lse.double()[finite] - lse_ref[finite]).abs().max().item()
        assert lse_err <= _lse_tol(softcap), f"lse error {lse_err:.3e} > {_lse_tol(softcap):.1e}"
    assert torch.all(out[:, ~sees_a_key] == 0), "rows that see no key: out exactly 0"
    return out, lse


def _reference_grads(q, k, v, dout, causal, window, softcap, softmax_scale=None, upcast=True):
    dtype = torch.float64 if upcast else q.dtype
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    out, _ = attention_autograd(*leaves, softmax_scale=softmax_scale, causal=causal, upcast=upcast,
                                window_size=window, softcap=softcap)
    return torch.autograd.grad(out, leaves, dout.to(dtype))


def _check_grads(q, k, v, dout, causal, window=NO_WINDOW, softcap=0.0, softmax_scale=None, deterministic=False):
    _require_kernels("bwd", q.shape[-1], q.dtype, causal, window)
    _require_kernels("fwd", q.shape[-1], q.dtype, causal, window)
    mask = dict(causal=causal, window_size=window, softcap=softcap)
    out, lse = flash_ext.forward(q, k, v, softmax_scale=softmax_scale, **mask)
    poison_allocator((q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype))
    dq, dk, dv = flash_ext.backward(dout, q, k, v, out, lse, softmax_scale=softmax_scale, deterministic=deterministic,
                                    **mask)
    torch.cuda.synchronize()
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dq.dtype == dk.dtype == dv.dtype == q.dtype
    ref = _reference_grads(q, k, v, dout, causal, window, softcap, softmax_scale, upcast=True)
    low = _reference_grads(q, k, v, dout, causal, window, softcap, softmax_scale, upcast=False)
    assert_grads_within_rule((dq, dk, dv), ref, low, q.dtype)
    band = _band(q.shape[1], k.shape[1], causal, window)
    assert torch.all(dq[:, ~band.any(dim=1)] == 0), "queries that see no key: dq exactly 0"
    unseen = ~band.any(dim=0)
    assert torch.all(dk[:, unseen] == 0) and torch.all(dv[:, unseen] == 0), "keys no query sees: dk, dv exactly 0"
    return dq, dk, dv


# ------------------------------------------------------------------------------------------------
# Forward
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("headdim,window,causal,seqlens,heads", _cases(FWD_HEADDIMS, WINDOW_MASKS))
def test_window_forward(headdim, window, causal, seqlens, heads, dtype):
    seqlen_q, seqlen_k = seqlens
    seed = hash((headdim, str(dtype), seqlens, heads, causal, window)) % (2**31)
    q, k, v, _ = _make(_batch(seqlen_q, seqlen_k), seqlen_q, seqlen_k, *heads, headdim, dtype, seed)
    _check_forward(q, k, v, causal, window)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("headdim,softcap,window,causal,seqlens,heads", _softcap_cases(FWD_HEADDIMS))
def test_softcap_forward(headdim, softcap, window, causal, seqlens, heads, dtype):
    seqlen_q, seqlen_k = seqlens
    seed = hash((headdim, str(dtype), seqlens, heads, causal, window, softcap)) % (2**31)
    q, k, v, _ = _make(_batch(seqlen_q, seqlen_k), seqlen_q, seqlen_k, *heads, headdim, dtype, seed,
                       q_scale=SOFTCAP_Q_SCALE)
    _check_forward(q, k, v, causal, window, softcap)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("seqlens", [(300, 300), (250, 700), (700, 250)], ids=lambda s: f"sq{s[0]}sk{s[1]}")
def test_window_equivalences_bitwise(seqlens, dtype):
    """Neutral values are the plain call; causal is the window (-1, 0) (causal with (left, -1) is (left, 0));
    a window as wide as the sequences is no window: each pair runs the same kernel on the same band."""
    seqlen_q, seqlen_k = seqlens
    _require_kernels("fwd", 128, dtype, True, (0, 0))
    q, k, v, _ = _make(2, seqlen_q, seqlen_k, 4, 2, 128, dtype, seed=seqlen_q + seqlen_k)

    def same(a, b):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])

    for causal in (False, True):
        same(flash_ext.forward(q, k, v, causal=causal, window_size=(-1, -1), softcap=0.0),
             flash_ext.forward(q, k, v, causal=causal))
        same(flash_ext.forward(q, k, v, causal=causal, window_size=(seqlen_k, 0 if causal else seqlen_q)),
             flash_ext.forward(q, k, v, causal=causal))
    same(flash_ext.forward(q, k, v, window_size=(-1, 0)), flash_ext.forward(q, k, v, causal=True))
    same(flash_ext.forward(q, k, v, causal=True, window_size=(40, -1)), flash_ext.forward(q, k, v, window_size=(40, 0)))
    same(flash_ext.forward(q, k, v, causal=True, window_size=(40, 0)), flash_ext.forward(q, k, v, window_size=(40, 0)))


@pytest.mark.parametrize("headdim", [40, 136, 200])
def test_window_softcap_headdims_between_kernels(headdim):
    """Head dims without their own kernel run on the next size up, windowed and soft-capped, both ways."""
    q, k, v, dout = _make(2, 157, 301, 4, 2, headdim, torch.bfloat16, seed=headdim, q_scale=2.0)
    _check_forward(q, k, v, causal=True, window=(50, 0), softcap=10.0)
    _check_grads(q, k, v, dout, causal=False, window=(30, 20), softcap=10.0)


def test_window_many_tiles_and_blind_rows():
    """Many tiles (batch 5, 24 heads, GQA) with a narrow band, and seqlen_q > seqlen_k so that the first
    query rows see no key: their out is 0 and lse -inf, the rest finite."""
    q, k, v, _ = _make(5, 700, 400, 24, 6, 64, torch.float16, seed=8)
    out, lse = _check_forward(q, k, v, causal=True, window=(33, 0))
    assert torch.all(out[:, :300] == 0) and torch.all(lse[:, :, :300] == -math.inf)
    assert torch.isfinite(lse[:, :, 300:]).all()


# ------------------------------------------------------------------------------------------------
# Backward
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("headdim,window,causal,seqlens,heads", _cases(BWD_HEADDIMS, WINDOW_MASKS))
def test_window_backward(headdim, window, causal, seqlens, heads, dtype):
    seqlen_q, seqlen_k = seqlens
    seed = hash((headdim, str(dtype), seqlens, heads, causal, window, "bwd")) % (2**31)
    q, k, v, dout = _make(_batch(seqlen_q, seqlen_k), seqlen_q, seqlen_k, *heads, headdim, dtype, seed)
    _check_grads(q, k, v, dout, causal, window)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("headdim,softcap,window,causal,seqlens,heads", _softcap_cases(BWD_HEADDIMS))
def test_softcap_backward(headdim, softcap, window, causal, seqlens, heads, dtype):
    seqlen_q, seqlen_k = seqlens
    seed = hash((headdim, str(dtype), seqlens, heads, causal, window, softcap, "bwd")) % (2**31)
    q, k, v, dout = _make(_batch(seqlen_q, seqlen_k), seqlen_q, seqlen_k, *heads, headdim, dtype, seed,
                          q_scale=SOFTCAP_Q_SCALE)
    _check_grads(q, k, v, dout, causal, window, softcap)


@pytest.mark.parametrize("causal,window,softcap", [(True, (256, 0), 0.0), (False, (64, 64), 5.0)],
                         ids=["w256_0-causal", "w64_64-full-cap5"])
@pytest.mark.parametrize("headdim", BWD_HEADDIMS)
def test_window_backward_deterministic_bitwise(headdim, causal, window, softcap):
    _require_kernels("bwd", headdim, torch.bfloat16, causal, window)
    _require_kernels("fwd", headdim, torch.bfloat16, causal, window)
    q, k, v, dout = _make(2, 1031, 1100, 8, 2, headdim, torch.bfloat16, seed=headdim, q_scale=2.0)
    mask = dict(causal=causal, window_size=window, softcap=softcap)
    out, lse = flash_ext.forward(q, k, v, **mask)
    first = flash_ext.backward(dout, q, k, v, out, lse, deterministic=True, **mask)
    for _ in range(4):
        again = flash_ext.backward(dout, q, k, v, out, lse, deterministic=True, **mask)
        for a, b in zip(first, again):
            assert torch.equal(a, b)
    _check_grads(q, k, v, dout, causal, window, softcap, deterministic=True)


def test_window_backward_dlse_and_preallocated_outputs():
    """dlse with a window and softcap, and the gradients written into slices of one packed buffer."""
    q, k, v, dout = _make(2, 300, 400, 4, 2, 128, torch.bfloat16, seed=12, q_scale=2.0)
    mask = dict(causal=True, window_size=(48, 0), softcap=8.0)
    _require_kernels("bwd", 128, torch.bfloat16, True, mask["window_size"])
    _require_kernels("fwd", 128, torch.bfloat16, True, mask["window_size"])
    dlse = torch.randn(2, 4, 300, device="cuda", dtype=torch.float32)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = flash_ext.attention(*leaves, deterministic=True, **mask)
    grads = torch.autograd.grad([out, lse], leaves, [dout, dlse])
    expected = flash_ext.backward(dout, q, k, v, out.detach(), lse.detach(), dlse=dlse, deterministic=True, **mask)
    for got, exp in zip(grads, expected):
        assert torch.equal(got, exp)
    # Against float64 autograd of loss = <out, dout> + <lse, dlse> (lse finite here: every row sees a key).
    f64 = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    out64, lse64 = attention_autograd(*f64, **mask)
    ref = torch.autograd.grad([out64, lse64], f64, [dout.double(), dlse.double()])
    low = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out_low, lse_low = attention_autograd(*low, upcast=False, **mask)
    ref_low = torch.autograd.grad([out_low, lse_low], low, [dout, dlse.float()])
    assert_grads_within_rule(expected, ref, ref_low, q.dtype)
    packed = torch.full((2, 400, 3, 4, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    dq_buf = torch.full_like(q, float("nan"))
    r = flash_ext.backward(dout, q, k, v, out.detach(), lse.detach(), dlse=dlse, deterministic=True, dq=dq_buf,
                           dk=packed[:, :, 1, :2], dv=packed[:, :, 2, :2], **mask)
    assert r[0].data_ptr() == dq_buf.data_ptr()
    assert torch.equal(dq_buf, expected[0]) and torch.equal(packed[:, :, 1, :2], expected[1])
    assert torch.equal(packed[:, :, 2, :2], expected[2])


# ------------------------------------------------------------------------------------------------
# FP8 forward
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal,window,softcap", [(True, (128, 0), 0.0), (False, (64, 64), 5.0),
                                                   (True, (-1, -1), 30.0)],
                         ids=["w128_0-causal", "w64_64-full-cap5", "causal-cap30"])
@pytest.mark.parametrize("headdim", FWD_HEADDIMS)
def test_fp8_window_softcap(headdim, causal, window, softcap):
    """The FP8 forward against attention_fp8_emulation with the same window and softcap (the pre-tanh
    factor includes q_descale * k_descale), the 2x rule of tests/test_fp8_gpu.py."""
    _require_kernels("fwd", headdim, torch.float8_e4m3fn, causal, window)
    seqlen_q, seqlen_k = (700, 1100) if headdim != 256 else (333, 517)
    gen = torch.Generator(device="cuda").manual_seed(headdim + 1000 * causal)
    q = torch.randn(2, seqlen_q, 8, headdim, device="cuda", generator=gen) * SOFTCAP_Q_SCALE
    k = torch.randn(2, seqlen_k, 2, headdim, device="cuda", generator=gen)
    v = torch.randn(2, seqlen_k, 2, headdim, device="cuda", generator=gen)
    q8, k8, v8, q_d, k_d, v_d = fp8.quantize_qkv(q.bfloat16(), k.bfloat16(), v.bfloat16())
    poison_allocator(((2, seqlen_q, 8, headdim), torch.bfloat16), ((2, 8, seqlen_q), torch.float32))
    out, lse = flash_ext.forward(q8, k8, v8, causal=causal, q_descale=q_d, k_descale=k_d, v_descale=v_d,
                                 window_size=window, softcap=softcap)
    torch.cuda.synchronize()
    assert out.dtype == torch.bfloat16 and not out.isnan().any() and not lse.isnan().any()
    deq = [fp8.dequantize(x, d, 2) for x, d in ((q8, q_d), (k8, k_d), (v8, v_d))]
    ref, ref_lse = attention_ref(*deq, causal=causal, window_size=window, softcap=softcap)
    emu = attention_fp8_emulation(q8, k8, v8, q_d, k_d, v_d, causal=causal, window_size=window, softcap=softcap,
                                  max_offset=flash_ext.build_info()["fp8_max_offset"])
    err = (out.double() - ref).abs().max().item()
    err_emu = (emu - ref).abs().max().item()
    assert err <= 2 * err_emu + rounding_noise(ref, torch.bfloat16) + 1e-5, (err, err_emu)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "LSE must be -inf exactly where a row sees no key"
    if finite.any():  # test_fp8_gpu.py's relative bound, plus the softcap's tanh.approx term
        lse_err = (lse.double()[finite] - ref_lse[finite]).abs()
        bound = 2e-3 * ref_lse[finite].abs().clamp_min(1.0) + softcap * TANH_APPROX_REL_ERR
        assert (lse_err <= bound).all(), lse_err.max().item()


# ------------------------------------------------------------------------------------------------
# Entry points: FA3's signature, autograd, torch.compile, opcheck
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal,window,softcap", [(True, (100, 0), 0.0), (False, (32, 64), 0.0),
                                                   (False, (-1, -1), 20.0), (True, (77, -1), 7.5)],
                         ids=["w100_0-causal", "w32_64-full", "cap20", "w77_-1-causal-cap7.5"])
def test_flash_attn_func_window_softcap_matches_forward(causal, window, softcap):
    """flash_attn_func and flash_attn_qkvpacked_func with window_size / softcap are flash_ext.forward /
    backward with the same arguments, bit for bit (the backward through autograd included)."""
    _require_kernels("bwd", 128, torch.bfloat16, causal, window)
    _require_kernels("fwd", 128, torch.bfloat16, causal, window)
    q, k, v, dout = _make(2, 333, 333, 8, 2, 128, torch.bfloat16, seed=3, q_scale=2.0)
    mask = dict(causal=causal, window_size=window, softcap=softcap)
    out_ref, lse_ref = flash_ext.forward(q, k, v, **mask)
    out, lse = flash_ext.flash_attn_func(q, k, v, return_attn_probs=True, **mask)
    assert torch.equal(out, out_ref) and torch.equal(lse, lse_ref)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    flash_ext.flash_attn_func(*leaves, deterministic=True, **mask).backward(dout)
    expected = flash_ext.backward(dout, q, k, v, out_ref, lse_ref, deterministic=True, **mask)
    for leaf, exp in zip(leaves, expected):
        assert torch.equal(leaf.grad, exp)
    # The packed layout (GQA: 8 query heads, then 2 + 2 KV heads) reaches the same kernels.
    qkv = torch.cat((q, k, v), dim=2).requires_grad_(True)
    out_packed = flash_ext.flash_attn_qkvpacked_func(qkv, num_heads_q=8, deterministic=True, **mask)
    assert torch.equal(out_packed, out_ref)
    (dqkv,) = torch.autograd.grad(out_packed, (qkv,), dout)
    assert torch.equal(dqkv, torch.cat(expected, dim=2))


def test_torch_compile_fullgraph_matches_eager():
    """torch.compile(fullgraph=True) of a model calling flash_attn_func (forward and backward) equals eager,
    causal, with a window and softcap, and with a window alone."""
    _require_kernels("bwd", 64, torch.bfloat16, True, (32, 0))
    _require_kernels("fwd", 64, torch.bfloat16, True, (32, 0))

    class Attention(torch.nn.Module):
        def __init__(self, **mask):
            super().__init__()
            self.mask = mask
            self.qkv = torch.nn.Linear(256, 3 * 256, dtype=torch.bfloat16)

        def forward(self, x):
            q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 4, 64).unbind(2)
            return flash_ext.flash_attn_func(q, k, v, deterministic=True, **self.mask).flatten(2)

    x = torch.randn(2, 100, 256, device="cuda", dtype=torch.bfloat16)
    for mask in (dict(causal=True), dict(causal=True, window_size=(32, 0), softcap=20.0),
                 dict(causal=False, window_size=(16, 16))):
        torch.manual_seed(0)
        model = Attention(**mask).cuda()
        eager_out = model(x)
        eager_out.float().square().sum().backward()
        eager_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        compiled = torch.compile(model, fullgraph=True)
        out = compiled(x)
        out.float().square().sum().backward()
        assert torch.equal(out, eager_out)
        for p, g in zip(model.parameters(), eager_grads):
            torch.testing.assert_close(p.grad, g, rtol=1e-2, atol=1e-2)
        if len(mask) > 1:  # and the window really applied: the unwindowed model gives something else
            plain = Attention().cuda()
            plain.load_state_dict(model.state_dict())
            assert not torch.equal(plain(x), eager_out)


def test_opcheck_window_softcap():
    _require_kernels("bwd", 64, torch.bfloat16, True, (16, 0))
    _require_kernels("fwd", 64, torch.bfloat16, True, (16, 0))
    q, k, v, dout = _make(1, 70, 90, 4, 2, 64, torch.bfloat16, seed=4)
    scale, window, softcap = 0.125, (16, 0), 5.0
    out, lse = flash_ext.forward(q, k, v, softmax_scale=scale, causal=True, window_size=window, softcap=softcap)
    torch.library.opcheck(torch.ops.flash_ext.fwd, (q, k, v, scale, True, None, None, None, *window, softcap))
    torch.library.opcheck(torch.ops.flash_ext.bwd, (dout, q, k, v, out, lse, None, scale, True, True, *window, softcap))
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    torch.library.opcheck(torch.ops.flash_ext.bwd_out,
                          (dout, q, k, v, out, lse, None, scale, True, True, dq, dk, dv, *window, softcap))
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    torch.library.opcheck(torch.ops.flash_ext.attention, (*leaves, scale, True, True, *window, softcap))


def test_window_softcap_gpu_argument_errors():
    """The op's value checks on real GPU tensors, also through torch.ops directly."""
    q, k, v, dout = _make(1, 64, 64, 2, 2, 64, torch.bfloat16, seed=6)
    with pytest.raises(ValueError, match="window_size"):
        flash_ext.forward(q, k, v, window_size=(-2, 0))
    with pytest.raises(ValueError, match="window_size"):
        flash_ext.forward(q, k, v, causal=True, window_size=(8, 8))
    with pytest.raises(ValueError, match="softcap"):
        flash_ext.forward(q, k, v, softcap=-1.0)
    with pytest.raises(ValueError, match="softcap"):
        torch.ops.flash_ext.fwd(q, k, v, 0.125, False, window_left=-1, window_right=-1, softcap=float("inf"))
    with pytest.raises(TypeError, match="window_size"):
        flash_ext.forward(q, k, v, window_size=(1.0, 0))
    lse = torch.zeros(1, 2, 64, device="cuda")
    with pytest.raises(ValueError, match="window_size"):
        flash_ext.backward(dout, q, k, v, q, lse, causal=True, window_size=(0, 3))
    with pytest.raises(ValueError, match="softcap"):
        flash_ext.backward(dout, q, k, v, q, lse, softcap=float("nan"))
