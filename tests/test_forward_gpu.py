"""flash_ext.forward on the GPU against the float64 reference (FlashAttention's error rule).

Every case draws fresh random inputs, poisons the memory the outputs will land in, and checks that
  max|out - ref| <= 2 * max|out_pt - ref| + rounding noise,
where out_pt is PyTorch attention computed in the same low precision, and that the LSE matches the
reference within 1e-3 where finite and is -inf exactly where a row sees no key.
"""
import math
import os

import pytest
import torch

import flash_ext
from flash_ext.reference import attention_lowp, attention_ref
from gpu_helpers import assert_lse_matches, assert_out_within_rule, poison_allocator, row_max_staircase

pytestmark = pytest.mark.gpu

HEADDIMS = flash_ext.KERNEL_HEADDIMS
DTYPES = (torch.float16, torch.bfloat16)
# (seqlen_q, seqlen_k): 1, odd lengths, below/above one tile, q longer and shorter than k, a few thousand.
SEQLENS = [
    (1, 1),
    (1, 239),
    (7, 113),
    (113, 7),
    (128, 128),
    (200, 1000),
    (1000, 200),
    (511, 513),
    (1000, 1000),
    (2049, 2049),
    (3000, 1025),
]
# (nheads, nheads_kv): MHA, GQA 4:1, MQA.
HEADS = [(4, 4), (8, 2), (6, 1)]


def _make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, seqlen_q, nheads, headdim, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(batch, seqlen_k, nheads_kv, headdim, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(batch, seqlen_k, nheads_kv, headdim, device="cuda", dtype=dtype, generator=gen)
    return q, k, v


def _require_kernel(headdim, dtype, causal):
    """Reduced builds (FLASH_EXT_HEADDIMS, ...) lack some kernels: skip those cases with the reason."""
    if not flash_ext.has_kernel("fwd", headdim, dtype, causal):
        mask = "causal" if causal else "non-causal"
        pytest.skip(f"this build has no {dtype} head dim {flash_ext.kernel_headdim(headdim)} {mask} forward kernel")


def _check_against_reference(q, k, v, causal, softmax_scale=None):
    batch, seqlen_q, nheads, headdim = q.shape
    _require_kernel(headdim, q.dtype, causal)
    poison_allocator(((batch, seqlen_q, nheads, headdim), q.dtype), ((batch, nheads, seqlen_q), torch.float32))
    out, lse = flash_ext.forward(q, k, v, softmax_scale=softmax_scale, causal=causal)
    torch.cuda.synchronize()
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (batch, nheads, seqlen_q) and lse.dtype == torch.float32
    assert not out.isnan().any(), "NaN in out (unwritten or invalid elements)"
    assert not lse.isnan().any(), "NaN in lse (unwritten or invalid elements)"

    out_ref, lse_ref = attention_ref(q, k, v, softmax_scale=softmax_scale, causal=causal)
    out_pt = attention_lowp(q, k, v, softmax_scale=softmax_scale, causal=causal)
    assert_out_within_rule(out, out_ref, out_pt, q.dtype)
    finite = assert_lse_matches(lse, lse_ref, 1e-3)
    # Rows that see no key: out exactly 0.
    no_key = ~finite.transpose(1, 2)  # (batch, seqlen_q, nheads)
    assert torch.all(out[no_key] == 0)
    return out, lse


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"sq{s[0]}sk{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("headdim", HEADDIMS)
def test_forward_matches_reference(headdim, dtype, seqlens, heads, causal):
    seqlen_q, seqlen_k = seqlens
    nheads, nheads_kv = heads
    batch = 2 if seqlen_q * seqlen_k <= 1_000_000 else 1
    seed = hash((headdim, str(dtype), seqlens, heads, causal)) % (2**31)
    q, k, v = _make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, dtype, seed)
    _check_against_reference(q, k, v, causal)


@pytest.mark.parametrize("headdim", [8, 40, 72, 80, 120, 136, 168, 200, 248])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_headdims_between_kernels(headdim, causal):
    """Head dims without their own kernel run on the next size up (TMA zero-fills and clips the rest)."""
    q, k, v = _make_qkv(2, 157, 301, 4, 2, headdim, torch.bfloat16, seed=headdim)
    _check_against_reference(q, k, v, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_strided_views(causal):
    """Slices of packed tensors: q, k, v as views of one (b, s, 3, h, d) buffer, and a transposed batch."""
    b, s, h, d = 2, 333, 4, 128
    qkv = torch.randn(b, s, 3, h, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(dim=2)
    assert not q.is_contiguous()
    out, _ = _check_against_reference(q, k, v, causal)
    assert out.is_contiguous()
    # Heads-major storage viewed as (b, s, h, d).
    q2 = torch.randn(b, h, s, d, device="cuda", dtype=torch.float16).transpose(1, 2)
    k2 = torch.randn(b, h, 100, d, device="cuda", dtype=torch.float16).transpose(1, 2)
    v2 = torch.randn(b, h, 100, d, device="cuda", dtype=torch.float16).transpose(1, 2)
    _check_against_reference(q2, k2, v2, causal)


def test_forward_softmax_scale():
    q, k, v = _make_qkv(2, 250, 260, 4, 4, 64, torch.bfloat16, seed=7)
    for scale in (0.01, 0.3, 1.0):
        _check_against_reference(q, k, v, causal=False, softmax_scale=scale)


def test_forward_fully_masked_rows():
    """Causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k queries see no key."""
    q, k, v = _make_qkv(2, 300, 50, 4, 2, 128, torch.float16, seed=3)
    out, lse = _check_against_reference(q, k, v, causal=True)
    assert torch.all(out[:, :250] == 0)
    assert torch.all(lse[:, :, :250] == -math.inf)
    assert torch.isfinite(lse[:, :, 250:]).all()


def test_forward_large_scores_stable():
    """Scores far beyond exp's range: the online softmax must not overflow."""
    q, k, v = _make_qkv(1, 300, 300, 2, 2, 64, torch.bfloat16, seed=11)
    _check_against_reference(q * 30, k * 30, v, causal=False)
    _check_against_reference(q * 30, k * 30, v, causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", HEADDIMS)
def test_forward_row_max_moving_across_blocks(headdim, causal, dtype):
    scale = 1 / math.sqrt(headdim)
    q, k, v = row_max_staircase(2, 700, 1000, 4, headdim, scale, seed=headdim + causal)
    _check_against_reference(*(t.to(dtype) for t in (q, k, v)), causal=causal, softmax_scale=scale)


@pytest.mark.parametrize("headdim", HEADDIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_deterministic(headdim, causal):
    _require_kernel(headdim, torch.bfloat16, causal)
    q, k, v = _make_qkv(2, 1111, 1333, 4, 2, headdim, torch.bfloat16, seed=headdim)
    out1, lse1 = flash_ext.forward(q, k, v, causal=causal)
    out2, lse2 = flash_ext.forward(q, k, v, causal=causal)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)


@pytest.mark.parametrize("persistent", ["0", "1"], ids=["one_cta_per_tile", "persistent"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", HEADDIMS)
def test_forward_launch_modes(headdim, causal, persistent, monkeypatch):
    """Both launch modes, forced through FLASH_EXT_PERSISTENT (kernels that cannot run persistent ignore it),
    with several hundred tiles so that persistent CTAs walk many tiles and their Q/O buffer hand-overs,
    with GQA and odd lengths."""
    monkeypatch.setenv("FLASH_EXT_PERSISTENT", persistent)
    q, k, v = _make_qkv(3, 333, 777, 40, 8, headdim, torch.bfloat16, seed=headdim + 7 * causal)
    _check_against_reference(q, k, v, causal)


@pytest.mark.parametrize("softcap", [0.0, 20.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("mode", [None, "2"], ids=["default_choice", "forced"])
def test_forward_mid_length_tiles(mode, dtype, softcap, monkeypatch):
    """d128 non-causal has a third tile set for 2k-4k keys (tile_size.h's kStagesMid: the 128x128 tiles with three
    K/V stages, persistent, unchained, O staged in V's last stage): chosen by default at 3001 keys (4 x 24 tiles of
    128 rows: more than one wave), and forced (FLASH_EXT_PERSISTENT=2) at odd lengths with many tiles per CTA and
    a partial last K/V block; GQA, softcap."""
    _require_kernel(128, dtype, False)
    if mode is None:
        monkeypatch.delenv("FLASH_EXT_PERSISTENT", raising=False)
        q, k, v = _make_qkv(4, 3001, 3001, 6, 2, 128, dtype, seed=71)
    else:
        monkeypatch.setenv("FLASH_EXT_PERSISTENT", mode)
        q, k, v = _make_qkv(3, 777, 333, 40, 8, 128, dtype, seed=72)
    batch, seqlen_q, nheads, headdim = q.shape
    poison_allocator(((batch, seqlen_q, nheads, headdim), dtype), ((batch, nheads, seqlen_q), torch.float32))
    out, lse = flash_ext.forward(q, k, v, softcap=softcap)
    torch.cuda.synchronize()
    assert not out.isnan().any() and not lse.isnan().any()
    out_ref, lse_ref = attention_ref(q, k, v, softcap=softcap)
    assert_out_within_rule(out, out_ref, attention_lowp(q, k, v, softcap=softcap), dtype)
    assert_lse_matches(lse, lse_ref, 1e-3)


@pytest.mark.parametrize("softcap", [0.0, 20.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("window", [(-1, -1), (40, 0)], ids=["causal", "window40"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("headdim", [64, 96, 128])
def test_forward_chained_tiles(headdim, dtype, window, softcap, monkeypatch):
    """The persistent kernels with room for a second Q (16-bit d64, d96, d128) chain a CTA's tiles: each warpgroup
    issues a tile's last GEMM1 with the next tile's first GEMM0 (its Q in the other buffer) and stores its own rows
    of O. Several tiles per CTA in both masks, and, with a window of 40 keys and seqlen_q > seqlen_k, causal tiles
    that see no key between tiles that do (their rows: O = 0, LSE = -inf)."""
    monkeypatch.setenv("FLASH_EXT_PERSISTENT", "1")
    q, k, v = _make_qkv(5, 1500, 700, 24, 6, headdim, dtype, seed=61 + headdim)
    for causal in (False, True):
        _require_kernel(headdim, dtype, causal)
        call_window = window if causal else (-1, -1)
        batch, seqlen_q, nheads, headdim = q.shape
        poison_allocator(((batch, seqlen_q, nheads, headdim), dtype), ((batch, nheads, seqlen_q), torch.float32))
        out, lse = flash_ext.forward(q, k, v, causal=causal, window_size=call_window, softcap=softcap)
        torch.cuda.synchronize()
        assert not out.isnan().any() and not lse.isnan().any()
        mask = dict(causal=causal, window_size=call_window, softcap=softcap)
        out_ref, lse_ref = attention_ref(q, k, v, **mask)
        assert_out_within_rule(out, out_ref, attention_lowp(q, k, v, **mask), dtype)
        finite = assert_lse_matches(lse, lse_ref, 1e-3)
        no_key = ~finite.transpose(1, 2)
        assert torch.all(out[no_key] == 0)
        if call_window != (-1, -1):
            assert no_key.any(), "the case must hold rows that see no key"


@pytest.mark.parametrize("persistent", ["0", "1"], ids=["one_cta_per_tile", "persistent"])
def test_forward_causal_tile_groups(persistent, monkeypatch):
    """Persistent causal CTAs draw tiles from a counter that every call clears (two calls, the same bits),
    longest first within groups of heads whose K/V fit in L2: 12000 keys of d128 allow 5 K/V heads (15 query
    heads here) per 32 MB, so 21 query heads make two groups, made equal up to whole K/V heads: 12 and 9.
    One CTA per tile: per-head order."""
    monkeypatch.setenv("FLASH_EXT_PERSISTENT", persistent)
    q, k, v = _make_qkv(1, 600, 12000, 21, 7, 128, torch.bfloat16, seed=21)
    _check_against_reference(q, k, v, causal=True)
    out1, lse1 = flash_ext.forward(q, k, v, causal=True)
    out2, lse2 = flash_ext.forward(q, k, v, causal=True)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_cuda_graph(causal):
    """Captured in a CUDA graph (the tile counter's clearing included) and replayed on new values."""
    _require_kernel(64, torch.bfloat16, causal)
    q, k, v = _make_qkv(4, 700, 700, 8, 2, 64, torch.bfloat16, seed=31)
    flash_ext.forward(q, k, v, causal=causal)  # first call outside the capture: lazy initialisation
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = flash_ext.forward(q, k, v, causal=causal)
    for seed in (32, 33):
        q2, k2, v2 = _make_qkv(4, 700, 700, 8, 2, 64, torch.bfloat16, seed=seed)
        q.copy_(q2)
        k.copy_(k2)
        v.copy_(v2)
        graph.replay()
        expected, expected_lse = flash_ext.forward(q2, k2, v2, causal=causal)
        torch.cuda.synchronize()
        assert torch.equal(out, expected) and torch.equal(lse, expected_lse)


def test_forward_many_heads_and_batches():
    """Many more tiles than SMs (batch 17, 48 heads), with GQA."""
    q, k, v = _make_qkv(17, 70, 90, 48, 6, 64, torch.float16, seed=5)
    _check_against_reference(q, k, v, causal=True)


def test_forward_on_side_stream():
    _require_kernel(128, torch.bfloat16, False)
    q, k, v = _make_qkv(2, 500, 500, 4, 4, 128, torch.bfloat16, seed=9)
    expected, _ = flash_ext.forward(q, k, v)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out, _ = flash_ext.forward(q, k, v)
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(out, expected)


def test_forward_gpu_argument_errors():
    """Errors raised before launch, on real GPU tensors, also through torch.ops directly."""
    q, k, v = _make_qkv(1, 64, 64, 2, 2, 64, torch.bfloat16, seed=1)
    buf = torch.randn(64 * 2 * 64 + 1, device="cuda", dtype=torch.bfloat16)
    q_misaligned = buf[1:].view(1, 64, 2, 64)  # starts 2 bytes into an allocation
    with pytest.raises(ValueError, match="aligned"):
        flash_ext.forward(q_misaligned, k, v)
    with pytest.raises(TypeError, match="dtype"):
        flash_ext.forward(q.float(), k, v)
    with pytest.raises(ValueError, match="multiple of nheads_kv"):
        flash_ext.forward(torch.randn(1, 64, 3, 64, device="cuda", dtype=torch.bfloat16), k, v)
    # The op itself re-checks what the kernel needs, for callers who bypass the Python wrapper.
    with pytest.raises((RuntimeError, ValueError, TypeError)):
        torch.ops.flash_ext.fwd(q, k[..., :32].contiguous(), v, 0.125, False)
    with pytest.raises((RuntimeError, ValueError, TypeError)):
        torch.ops.flash_ext.fwd(q.cpu(), k.cpu(), v.cpu(), 0.125, False)
    with pytest.raises((RuntimeError, ValueError, TypeError)):
        torch.ops.flash_ext.fwd(q[..., ::2], k[..., ::2], v[..., ::2], 0.125, False)


@pytest.mark.skipif(os.environ.get("FLASH_EXT_REDUCED_BUILD") == "1", reason="FLASH_EXT_REDUCED_BUILD=1: a partial build on purpose")
def test_build_info_lists_every_kernel():
    compiled = flash_ext.build_info()["kernels"]
    expected = [vars(k) for k in flash_ext.kernel_table.all_kernels()]
    assert sorted(map(str, compiled)) == sorted(map(str, expected))
