"""CPU tests of flash_ext.reference: the float64 reference, the low-precision baseline, the seed's softmax
strategies and the emulation of the kernel's online softmax (OnlineSoftmax / attention_tiled)."""
import math

import pytest
import torch

from flash_ext import reference
from flash_ext.reference import (
    OnlineSoftmax,
    attention_lowp,
    attention_ref,
    attention_tiled,
    softmax_online_two_pass,
    softmax_three_pass,
)

LOG2E = math.log2(math.e)


def make_qkv(seed, batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, nheads, headdim, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, seqlen_k, nheads_kv, headdim, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, seqlen_k, nheads_kv, headdim, generator=gen, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def visible_mask(seqlen_q, seqlen_k, causal):
    """(seqlen_q, seqlen_k) bool: key j visible to query i (bottom-right aligned causal)."""
    i = torch.arange(seqlen_q)[:, None]
    j = torch.arange(seqlen_k)[None, :]
    if not causal:
        return torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    return j <= i + seqlen_k - seqlen_q


def assert_lse_equal(lse, lse_ref, atol):
    """-inf at exactly the same places, finite values close."""
    ninf = lse_ref == -math.inf
    assert torch.equal(lse == -math.inf, ninf)
    torch.testing.assert_close(lse[~ninf], lse_ref[~ninf], atol=atol, rtol=0)


def assert_no_nan(*tensors):
    for t in tensors:
        assert not torch.isnan(t).any()


# Seqlen pairs (incl. 1, 7, 113, 200, sq > sk and sq < sk), crossed with causal; heads, head dims and block
# sizes cycle through divisors and non-divisors of the lengths.
SEQLENS = [(1, 1), (1, 7), (7, 1), (7, 113), (113, 7), (113, 200), (200, 113), (200, 200), (128, 128),
           (1, 200), (200, 1), (64, 176)]
HEADS = [(4, 1), (4, 2), (4, 4)]
HEADDIMS = [16, 40, 64]
BLOCKS = [(64, 48), (128, 64), (64, 128), (128, 176), (128, 128)]
TILED_CASES = [
    (seqlen_q, seqlen_k, causal, HEADS[i % 3], HEADDIMS[(i + causal) % 3], BLOCKS[(2 * i + causal) % 5])
    for i, (seqlen_q, seqlen_k) in enumerate(SEQLENS)
    for causal in (False, True)
]


@pytest.mark.parametrize("seqlen_q,seqlen_k,causal,heads,headdim,blocks", TILED_CASES)
def test_tiled_matches_ref(seqlen_q, seqlen_k, causal, heads, headdim, blocks):
    nheads, nheads_kv = heads
    block_m, block_n = blocks
    q, k, v = make_qkv(seqlen_q * 1000 + seqlen_k, 2, seqlen_q, seqlen_k, nheads, nheads_kv, headdim)
    out_ref, lse_ref = attention_ref(q, k, v, causal=causal)
    out, lse = attention_tiled(q, k, v, causal=causal, block_m=block_m, block_n=block_n)
    assert out.shape == q.shape and out.dtype == torch.float64
    assert lse.shape == (2, nheads, seqlen_q) and lse.dtype == torch.float64
    torch.testing.assert_close(out, out_ref, atol=1e-12, rtol=0)
    assert_lse_equal(lse, lse_ref, atol=1e-12)


def test_ref_matches_naive_softmax_with_gqa_and_scale():
    # Independent check of attention_ref: explicit kv head expansion and torch.softmax.
    q, k, v = make_qkv(1, 2, 33, 45, 6, 2, 24)
    scale = 0.37
    for causal in (False, True):
        out, lse = attention_ref(q, k, v, softmax_scale=scale, causal=causal)
        kx = k.repeat_interleave(3, dim=2)
        vx = v.repeat_interleave(3, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, kx) * scale
        scores = scores.masked_fill(~visible_mask(33, 45, causal), -math.inf)
        expected = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), vx)
        torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
        torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), atol=1e-12, rtol=0)


def test_ref_chunking_matches_unchunked(monkeypatch):
    q, k, v = make_qkv(2, 2, 40, 30, 4, 2, 16)
    full = attention_ref(q, k, v, causal=True)
    full_lowp = attention_lowp(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True)
    # 3 heads per chunk, then 7 rows per chunk (a single head no longer fits).
    for budget in (3 * 40 * 30 * 8, 7 * 30 * 8):
        monkeypatch.setattr(reference, "_CHUNK_BYTES", budget)
        out, lse = attention_ref(q, k, v, causal=True)
        torch.testing.assert_close(out, full[0], atol=1e-14, rtol=0)
        assert_lse_equal(lse, full[1], atol=1e-14)
        out_lowp = attention_lowp(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True)
        torch.testing.assert_close(out_lowp, full_lowp, atol=1e-2, rtol=0)


@pytest.mark.parametrize("bh,seqlen_q,seqlen_k", [(16, 4096, 4096), (3, 40, 30), (2, 100000, 4096)])
def test_chunks_cover_everything_once_within_budget(bh, seqlen_q, seqlen_k):
    covered = torch.zeros(bh, seqlen_q, dtype=torch.int32)
    for heads, rows in reference._chunks(bh, seqlen_q, seqlen_k, elem_bytes=8):
        n_heads = heads.stop - heads.start
        n_rows = rows.stop - rows.start
        assert n_heads * n_rows * seqlen_k * 8 <= reference._CHUNK_BYTES
        covered[heads, rows] += 1
    assert (covered == 1).all()


@pytest.mark.parametrize("block_m,block_n", [(16, 8), (64, 48), (128, 128)])
def test_fully_masked_rows_give_zero_and_neg_inf(block_m, block_n):
    # Causal with seqlen_q > seqlen_k: queries i < seqlen_q - seqlen_k see no key. With block_m = 16 some
    # tiles have no K block at all and one tile mixes masked and visible rows (the check_inf path).
    seqlen_q, seqlen_k = 50, 20
    q, k, v = make_qkv(3, 2, seqlen_q, seqlen_k, 4, 2, 16)
    blind = seqlen_q - seqlen_k
    for out, lse in (attention_ref(q, k, v, causal=True),
                     attention_tiled(q, k, v, causal=True, block_m=block_m, block_n=block_n),
                     attention_tiled(q, k, v, causal=True, block_m=block_m, block_n=block_n, max_offset=8)):
        assert_no_nan(out, lse)
        assert (out[:, :blind] == 0).all()
        assert (lse[:, :, :blind] == -math.inf).all()
        assert torch.isfinite(lse[:, :, blind:]).all()
        assert (out[:, blind:].abs().sum(-1) > 0).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k,blocks", [(113, 200, (64, 48)), (200, 113, (128, 64)), (7, 7, (64, 128))])
def test_max_offset_0_and_8_agree(causal, seqlen_q, seqlen_k, blocks):
    # P is scaled by 2^8 in both acc_o and the row sum, so O is unchanged; finalize divides it out of the LSE.
    q, k, v = make_qkv(4, 1, seqlen_q, seqlen_k, 4, 2, 40)
    out0, lse0 = attention_tiled(q, k, v, causal=causal, block_m=blocks[0], block_n=blocks[1], max_offset=0)
    out8, lse8 = attention_tiled(q, k, v, causal=causal, block_m=blocks[0], block_n=blocks[1], max_offset=8)
    torch.testing.assert_close(out8, out0, atol=1e-12, rtol=0)
    assert_lse_equal(lse8, lse0, atol=1e-12)
    out_ref, lse_ref = attention_ref(q, k, v, causal=causal)
    torch.testing.assert_close(out8, out_ref, atol=1e-12, rtol=0)
    assert_lse_equal(lse8, lse_ref, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(70, 150), (150, 70)])
def test_lse_recovers_probabilities(causal, seqlen_q, seqlen_k):
    q, k, v = make_qkv(5, 2, seqlen_q, seqlen_k, 4, 2, 32)
    scale = 1 / math.sqrt(32)
    out, lse = attention_tiled(q, k, v, causal=causal, block_m=64, block_n=48)
    kx, vx = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kx) * scale
    visible = visible_mask(seqlen_q, seqlen_k, causal)
    sees_keys = visible.any(-1)
    probs = torch.exp(scores - lse[..., None]).masked_fill(~visible, 0.0)
    sums = probs.sum(-1)
    torch.testing.assert_close(sums[:, :, sees_keys], torch.ones_like(sums[:, :, sees_keys]), atol=1e-12, rtol=0)
    # The output is exactly these probabilities applied to V: masked keys contribute nothing.
    torch.testing.assert_close(out, torch.einsum("bhqk,bkhd->bqhd", probs, vx), atol=1e-12, rtol=0)


def test_causal_ignores_future_keys():
    # Changing the last key/value may only change the rows that can see it (here only the last query).
    q, k, v = make_qkv(6, 1, 30, 40, 2, 2, 16)
    out, lse = attention_tiled(q, k, v, causal=True, block_m=16, block_n=16)
    k2, v2 = k.clone(), v.clone()
    k2[:, -1] += 100.0
    v2[:, -1] -= 100.0
    out2, lse2 = attention_tiled(q, k2, v2, causal=True, block_m=16, block_n=16)
    assert torch.equal(out2[:, :-1], out[:, :-1]) and torch.equal(lse2[..., :-1], lse[..., :-1])
    assert not torch.allclose(out2[:, -1], out[:, -1])


# ---- the seed's softmax strategies 1 and 2 -------------------------------------------------------------

def softmax_inputs():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(6, 37, generator=gen, dtype=torch.float64) * 5
    x[1, ::3] = -math.inf  # some masked entries
    x[2, 1:] = -math.inf  # only one live entry
    x[3] *= 300  # large magnitudes: a naive exp would overflow
    x[4] = -math.inf  # fully masked row
    return x


@pytest.mark.parametrize("softmax", [softmax_three_pass, softmax_online_two_pass])
def test_softmax_strategies_match_torch(softmax):
    x = softmax_inputs()
    y = softmax(x)
    assert_no_nan(y)
    live = torch.tensor([0, 1, 2, 3, 5])
    torch.testing.assert_close(y[live], torch.softmax(x[live], dim=-1), atol=1e-14, rtol=0)
    assert (y[1, ::3] == 0).all()
    # Documented choice: an all -inf row gives all zeros (torch.softmax gives NaN), like the kernel.
    assert torch.equal(y[4], torch.zeros(37, dtype=torch.float64))


# ---- OnlineSoftmax unit behaviour -----------------------------------------------------------------------

def lane_partials(p):
    """Per quad lane sums of p (rows, n): column c belongs to lane (c % 8) // 2."""
    lane = (torch.arange(p.shape[-1]) % 8) // 2
    return torch.stack([p[:, lane == l].sum(-1) for l in range(4)], dim=-1)


def test_online_softmax_keeps_quad_partials_until_finalize():
    gen = torch.Generator().manual_seed(8)
    blocks = [torch.randn(3, 24, generator=gen, dtype=torch.float64) * 3 for _ in range(2)]
    blocks[1][0] += 5.0  # the second block raises row 0's max: its old partials must be rescaled
    scale_log2 = 0.5 * LOG2E
    sm = OnlineSoftmax(scale_log2)

    sm.max_get_scale(blocks[0].clone(), is_first=True)
    p0 = sm.online_softmax(blocks[0].clone(), is_first=True)
    assert sm.row_sum.shape == (3, 4)
    torch.testing.assert_close(sm.row_sum, lane_partials(p0), atol=1e-14, rtol=0)
    assert not torch.allclose(sm.row_sum[:, 0], sm.row_sum[:, 1])  # really per lane, not reduced

    scores_scale = sm.max_get_scale(blocks[1].clone(), is_first=False)
    assert scores_scale[0] < 1.0
    p1 = sm.online_softmax(blocks[1].clone(), is_first=False)
    assert sm.row_sum.shape == (3, 4)
    expected = lane_partials(p0) * scores_scale[:, None] + lane_partials(p1)
    torch.testing.assert_close(sm.row_sum, expected, atol=1e-13, rtol=0)

    inv_sum = sm.finalize()
    all_scores = torch.cat(blocks, dim=-1)
    assert sm.row_sum.shape == (3,)
    torch.testing.assert_close(inv_sum, 1.0 / expected.sum(-1), atol=1e-14, rtol=1e-13)
    torch.testing.assert_close(sm.row_sum, torch.logsumexp(all_scores * 0.5, dim=-1), atol=1e-13, rtol=0)


def test_finalize_reduces_in_butterfly_order():
    # lane 0 gets (p0 + p2) + (p1 + p3); a left-to-right sum would lose the 1 to rounding and give 1, not 2.
    sm = OnlineSoftmax(1.0 / math.log(2.0))  # scale_log2 * ln2 = 1: lse = row_max + ln(sum)
    sm.row_max = torch.tensor([0.0], dtype=torch.float64)
    sm.row_sum = torch.tensor([[1e16, 1.0, -1e16, 1.0]], dtype=torch.float64)
    scores_scale = sm.finalize()
    assert scores_scale.item() == 0.5
    assert sm.row_sum.item() == pytest.approx(math.log(2.0), abs=1e-15)


def test_check_inf_guard_masked_block_then_real_block():
    masked = torch.full((2, 16), -math.inf, dtype=torch.float64)
    masked[1, :3] = 1.0  # row 1 sees keys in the first block, row 0 does not
    real = torch.randn(2, 16, generator=torch.Generator().manual_seed(9), dtype=torch.float64)

    sm = OnlineSoftmax(LOG2E)
    sm.max_get_scale(masked.clone(), is_first=True, check_inf=True)
    p = sm.online_softmax(masked.clone(), is_first=True, check_inf=True)
    assert_no_nan(p, sm.row_sum)
    assert (p[0] == 0).all() and (sm.row_sum[0] == 0).all()
    scores_scale = sm.max_get_scale(real.clone(), is_first=False)
    assert scores_scale[0] == 0.0  # exp2(-inf - m): the empty history is dropped, not NaN
    sm.online_softmax(real.clone(), is_first=False)
    sm.finalize()
    assert_no_nan(sm.row_sum)
    torch.testing.assert_close(sm.row_sum, torch.logsumexp(torch.cat([masked, real], -1), -1), atol=1e-14, rtol=0)

    # Without the guard the fully masked row computes exp2(-inf - (-inf)) = NaN: the guard is what prevents it.
    unguarded = OnlineSoftmax(LOG2E)
    unguarded.max_get_scale(masked.clone(), is_first=True)
    assert torch.isnan(unguarded.online_softmax(masked.clone(), is_first=True)[0]).all()


def test_check_inf_guard_two_masked_blocks():
    # A row still fully masked after the second block: the rescale factor must be 0, not exp2(NaN).
    masked = torch.full((1, 8), -math.inf, dtype=torch.float64)
    sm = OnlineSoftmax(LOG2E)
    sm.max_get_scale(masked.clone(), is_first=True, check_inf=True)
    sm.online_softmax(masked.clone(), is_first=True, check_inf=True)
    assert sm.max_get_scale(masked.clone(), is_first=False, check_inf=True).item() == 0.0
    unguarded = OnlineSoftmax(LOG2E)
    unguarded.max_get_scale(masked.clone(), is_first=True)
    unguarded.row_sum = torch.zeros(1, 4, dtype=torch.float64)
    assert torch.isnan(unguarded.max_get_scale(masked.clone(), is_first=False)).all()


@pytest.mark.parametrize("max_offset", [0, 8])
def test_zero_sum_guard_gives_zero_scale_and_neg_inf_lse(max_offset):
    masked = torch.full((3, 16), -math.inf, dtype=torch.float64)
    sm = OnlineSoftmax(LOG2E, max_offset=max_offset)
    sm.max_get_scale(masked.clone(), is_first=True, check_inf=True)
    sm.online_softmax(masked.clone(), is_first=True, check_inf=True)
    scores_scale = sm.finalize(final_scale=2.0)
    assert (scores_scale == 0).all()
    assert (sm.row_sum == -math.inf).all()
    acc_o = torch.zeros(3, 8, dtype=torch.float64)
    assert torch.equal(OnlineSoftmax.rescale_o(acc_o, scores_scale), torch.zeros(3, 8, dtype=torch.float64))


def test_finalize_final_scale_and_rescale_o():
    scores = torch.randn(4, 32, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    sm = OnlineSoftmax(LOG2E)
    sm.max_get_scale(scores.clone(), is_first=True)
    p = sm.online_softmax(scores.clone(), is_first=True)
    total = p.sum(-1)
    scores_scale = sm.finalize(final_scale=3.0)
    torch.testing.assert_close(scores_scale, 3.0 / total, atol=0, rtol=1e-14)
    acc_o = torch.ones(4, 5, dtype=torch.float64)
    out = OnlineSoftmax.rescale_o(acc_o, scores_scale)
    assert out is acc_o  # in place, like the kernel's register update
    torch.testing.assert_close(acc_o, (3.0 / total)[:, None].expand(4, 5), atol=0, rtol=1e-14)


# ---- reduced precision ------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_tiled_with_bf16_p_stays_close(causal):
    q, k, v = make_qkv(11, 2, 150, 190, 4, 2, 64, dtype=torch.bfloat16)
    out_ref, lse_ref = attention_ref(q, k, v, causal=causal)
    out, lse = attention_tiled(q, k, v, causal=causal, block_m=64, block_n=48, p_dtype=torch.bfloat16)
    torch.testing.assert_close(out, out_ref, atol=1e-2, rtol=0)
    assert not torch.allclose(out, out_ref, atol=1e-5, rtol=0)  # the bf16 rounding of P really happened
    assert_lse_equal(lse, lse_ref, atol=1e-12)  # the row sums use the unrounded P
    out32, lse32 = attention_tiled(q, k, v, causal=causal, block_m=64, block_n=48,
                                   compute_dtype=torch.float32, p_dtype=torch.bfloat16)
    assert out32.dtype == torch.float32 and lse32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), out_ref, atol=1e-2, rtol=0)
    assert_lse_equal(lse32.double(), lse_ref, atol=1e-4)
    # FlashAttention's error rule, on the emulated kernel: within 2x the error of bf16 PyTorch attention.
    err_kernel = (out32.double() - out_ref).abs().max()
    err_lowp = (attention_lowp(q, k, v, causal=causal).double() - out_ref).abs().max()
    assert err_kernel <= 2 * err_lowp + 1e-5


@pytest.mark.parametrize("dtype,atol", [(torch.float16, 5e-3), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("causal", [False, True])
def test_lowp_close_to_ref(dtype, atol, causal):
    q, k, v = make_qkv(12, 2, 90, 60, 4, 1, 40, dtype=dtype)  # seqlen_q > seqlen_k: 30 rows see no key
    out = attention_lowp(q, k, v, causal=causal)
    assert out.dtype == dtype and out.shape == q.shape
    assert_no_nan(out)
    out_ref, _ = attention_ref(q, k, v, causal=causal)
    torch.testing.assert_close(out.double(), out_ref, atol=atol, rtol=0)
    if causal:
        assert (out[:, :30] == 0).all()


# ---- sliding window and softcap ---------------------------------------------------------------------------

def band_mask(seqlen_q, seqlen_k, causal=False, window_size=(-1, -1)):
    """(seqlen_q, seqlen_k) bool, built with tril/triu independently of reference._visible: key j visible
    to query i iff i + d - left <= j <= i + d + right, d = seqlen_k - seqlen_q (causal: right = 0)."""
    left, right = window_size
    if causal:
        right = 0
    ones = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    d = seqlen_k - seqlen_q
    mask = ones.clone()
    if right >= 0:
        mask &= ones.tril(diagonal=d + right)
    if left >= 0:
        mask &= ones.triu(diagonal=d - left)
    return mask


def naive_attention(q, k, v, scale, mask, softcap=0.0):
    """float64 attention written out: expanded kv heads, c * tanh(s / c), explicit mask, torch.softmax.
    (out, lse); rows that see no key give out 0, lse -inf."""
    group = q.shape[2] // k.shape[2]
    kx, vx = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kx) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", probs, vx), lse


# (seqlen_q, seqlen_k, causal, window): bands narrower than a row, wider than the keys, looking ahead,
# q longer and shorter than k (rows that see no key), causal with a left bound.
WINDOW_CASES = [
    (33, 45, False, (0, 0)),
    (33, 45, False, (3, 5)),
    (45, 33, False, (0, 0)),  # the first 12 queries see no key
    (45, 33, False, (-1, 4)),
    (45, 33, False, (7, -1)),
    (20, 20, False, (100, 100)),  # wider than everything: the full attention
    (1, 17, False, (4, 0)),
    (17, 1, False, (2, 2)),
    (33, 45, True, (5, -1)),
    (33, 45, True, (0, 0)),
    (45, 33, True, (9, 0)),
    (45, 33, True, (-1, -1)),
]


@pytest.mark.parametrize("seqlen_q,seqlen_k,causal,window", WINDOW_CASES)
def test_ref_window_matches_explicit_mask(seqlen_q, seqlen_k, causal, window):
    q, k, v = make_qkv(seqlen_q + 100 * seqlen_k, 2, seqlen_q, seqlen_k, 6, 2, 24)
    mask = band_mask(seqlen_q, seqlen_k, causal, window)
    expected_out, expected_lse = naive_attention(q, k, v, 0.37, mask)
    out, lse = attention_ref(q, k, v, softmax_scale=0.37, causal=causal, window_size=window)
    torch.testing.assert_close(out, expected_out, atol=1e-12, rtol=0)
    assert_lse_equal(lse, expected_lse, atol=1e-12)
    blind = ~mask.any(-1)  # rows that see no key: out exactly 0, lse -inf
    assert (out[:, blind] == 0).all() and (lse[:, :, blind] == -math.inf).all()
    # The low-precision baseline and the differentiable reference apply the same mask.
    torch.testing.assert_close(attention_lowp(q.bfloat16(), k.bfloat16(), v.bfloat16(), softmax_scale=0.37,
                                              causal=causal, window_size=window).double(), expected_out,
                               atol=3e-2, rtol=0)
    out_ag, lse_ag = reference.attention_autograd(q, k, v, softmax_scale=0.37, causal=causal, window_size=window)
    torch.testing.assert_close(out_ag, expected_out, atol=1e-12, rtol=0)
    assert_lse_equal(lse_ag, expected_lse, atol=1e-12)


def test_visible_is_the_band_rule():
    rows, cols = torch.arange(13), torch.arange(16)  # 16 columns for 11 keys: the padding is never visible
    for causal, window in [(False, (-1, -1)), (True, (-1, -1)), (False, (2, 3)), (True, (4, 0)), (False, (-1, 0)),
                           (False, (0, -1))]:
        got = reference._visible(rows, cols, 13, 11, causal, window)
        expected = torch.zeros(13, 16, dtype=torch.bool)
        expected[:, :11] = band_mask(13, 11, causal, window)
        assert torch.equal(got, expected), (causal, window)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(40, 30), (30, 40), (1, 1)])
def test_window_defaults_and_causal_band_are_bitwise_identical(seqlen_q, seqlen_k):
    """window (-1, -1) is no window; causal is the window (-1, 0); causal with (L, -1) is (L, 0)."""
    q, k, v = make_qkv(13, 2, seqlen_q, seqlen_k, 4, 2, 16)
    lowp = [t.bfloat16() for t in (q, k, v)]

    def same(a, b):
        for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            assert torch.equal(x, y)

    for causal in (False, True):
        same(attention_ref(q, k, v, causal=causal, window_size=(-1, -1), softcap=0.0), attention_ref(q, k, v, causal=causal))
        same(attention_lowp(*lowp, causal=causal, window_size=[-1, -1]), attention_lowp(*lowp, causal=causal))
        same(reference.attention_autograd(q, k, v, causal=causal, window_size=(-1, -1)),
             reference.attention_autograd(q, k, v, causal=causal))
    same(attention_ref(q, k, v, window_size=(-1, 0)), attention_ref(q, k, v, causal=True))
    same(attention_lowp(*lowp, window_size=(-1, 0)), attention_lowp(*lowp, causal=True))
    same(reference.attention_autograd(q, k, v, window_size=(-1, 0)), reference.attention_autograd(q, k, v, causal=True))
    same(attention_ref(q, k, v, causal=True, window_size=(5, -1)), attention_ref(q, k, v, window_size=(5, 0)))
    same(attention_ref(q, k, v, causal=True, window_size=(5, 0)), attention_ref(q, k, v, window_size=(5, 0)))


@pytest.mark.parametrize("bad,causal", [((-2, 0), False), ((0, -5), False), ((-1, 5), True), ((3, 1), True), ((1,), False)])
def test_ref_rejects_windows_the_ops_reject(bad, causal):
    q, k, v = make_qkv(14, 1, 8, 8, 2, 2, 16)
    for fn in (attention_ref, reference.attention_autograd):
        with pytest.raises(ValueError, match="window_size"):
            fn(q, k, v, causal=causal, window_size=bad)


@pytest.mark.parametrize("softcap", [-1.0, math.inf, math.nan])
def test_ref_rejects_bad_softcap(softcap):
    q, k, v = make_qkv(15, 1, 8, 8, 2, 2, 16)
    with pytest.raises(ValueError, match="softcap"):
        attention_ref(q, k, v, softcap=softcap)


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (6, 2)), (True, (3, 0))])
@pytest.mark.parametrize("softcap", [0.5, 5.0, 30.0])
def test_ref_softcap_matches_hand_written(softcap, causal, window):
    q, k, v = make_qkv(16, 2, 37, 29, 4, 2, 32)
    q = q * 3  # scores of a few units: softcap 0.5 and 5 really cap, 30 barely
    mask = band_mask(37, 29, causal, window)
    expected_out, expected_lse = naive_attention(q, k, v, 0.2, mask, softcap=softcap)
    out, lse = attention_ref(q, k, v, softmax_scale=0.2, causal=causal, window_size=window, softcap=softcap)
    torch.testing.assert_close(out, expected_out, atol=1e-12, rtol=0)
    assert_lse_equal(lse, expected_lse, atol=1e-12)
    # The capped logits are bounded by c, so the lse of a row is at most c + log(number of visible keys).
    finite = torch.isfinite(lse)
    assert (lse[finite] <= softcap + torch.log(mask.sum(-1).double()).expand_as(lse)[finite] + 1e-12).all()
    uncapped, _ = attention_ref(q, k, v, softmax_scale=0.2, causal=causal, window_size=window)
    assert not torch.allclose(out, uncapped, atol=1e-6)
    out_ag, lse_ag = reference.attention_autograd(q, k, v, softmax_scale=0.2, causal=causal, window_size=window,
                                                  softcap=softcap)
    torch.testing.assert_close(out_ag, expected_out, atol=1e-12, rtol=0)
    assert_lse_equal(lse_ag, expected_lse, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_lowp_softcap_rounds_in_the_input_dtype(dtype):
    """attention_lowp caps the low-precision scores in their own dtype, then the float32 softmax: close to
    the float64 reference, and exactly the hand-written PyTorch computation in that dtype."""
    q, k, v = make_qkv(17, 1, 50, 70, 2, 2, 64, dtype=dtype)
    q = q * 4
    out = attention_lowp(q, k, v, softmax_scale=0.125, causal=True, window_size=(20, 0), softcap=5.0)
    assert out.dtype == dtype
    ref, _ = attention_ref(q, k, v, softmax_scale=0.125, causal=True, window_size=(20, 0), softcap=5.0)
    torch.testing.assert_close(out.double(), ref, atol=3e-2 if dtype == torch.bfloat16 else 5e-3, rtol=0)
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    scores = torch.matmul(qh * 0.125, kh.transpose(-1, -2))
    scores = torch.tanh(scores / 5.0) * 5.0  # in `dtype`
    scores = scores.float().masked_fill(~band_mask(50, 70, True, (20, 0)), -math.inf)
    expected = torch.matmul(torch.softmax(scores, dim=-1).to(dtype), vh).transpose(1, 2)
    assert torch.equal(out, expected)


def _autograd_formula(q, k, v, scale, mask, softcap):
    """The float64 formula written independently of attention_autograd (finite fill, zeroed blind rows)."""
    group = q.shape[2] // k.shape[2]
    kx, vx = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kx) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, -1e30)
    probs = torch.softmax(scores, dim=-1) * mask.any(-1)[:, None].double()
    return torch.einsum("bhqk,bkhd->bqhd", probs, vx)


@pytest.mark.parametrize("causal,window,softcap", [
    (False, (4, 6), 0.0),
    (True, (7, 0), 0.0),
    (False, (-1, -1), 2.0),
    (True, (-1, -1), 30.0),
    (False, (0, 3), 1.5),
    (True, (5, -1), 5.0),
])
def test_autograd_window_softcap_gradients(causal, window, softcap):
    # seqlen_q > seqlen_k: with these windows some rows see no key, and their gradients must be 0, not NaN.
    q, k, v = make_qkv(18, 2, 31, 23, 6, 2, 16)
    q = q * 2
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(19), dtype=torch.float64)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = reference.attention_autograd(*leaves, softmax_scale=0.3, causal=causal, window_size=window,
                                            softcap=softcap)
    grads = torch.autograd.grad(out, leaves, dout)
    leaves2 = [t.clone().requires_grad_(True) for t in (q, k, v)]
    mask = band_mask(31, 23, causal, window)
    expected = _autograd_formula(*leaves2, 0.3, mask, softcap)
    expected_grads = torch.autograd.grad(expected, leaves2, dout)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    for g, e in zip(grads, expected_grads):
        assert_no_nan(g)
        torch.testing.assert_close(g, e, atol=1e-11, rtol=0)
    # The low-precision baseline of the backward: same structure, close to float64.
    low = [t.bfloat16().requires_grad_(True) for t in (q, k, v)]
    out_low, _ = reference.attention_autograd(*low, softmax_scale=0.3, causal=causal, window_size=window,
                                              softcap=softcap, upcast=False)
    grads_low = torch.autograd.grad(out_low, low, dout.bfloat16())
    for g, e in zip(grads_low, expected_grads):
        assert_no_nan(g)
        torch.testing.assert_close(g.double(), e, atol=0.15, rtol=0.05)
    blind = ~mask.any(-1)  # seqlen_q > seqlen_k: every masked case here has rows whose band ends before key 0
    assert bool(blind.any()) == (causal or window != (-1, -1))
    assert (grads[0][:, blind] == 0).all()


def test_fp8_emulation_window_and_softcap():
    """One visible key per row (window (0, 0), sq == sk): P = 2^max_offset exactly, so the emulation is exact
    whatever the softcap; with a wider band it stays close to the float64 reference of the dequantized inputs."""
    E4M3 = torch.float8_e4m3fn
    gen = torch.Generator().manual_seed(20)
    q8, k8, v8 = (torch.randn(1, 24, 2, 64, generator=gen).to(E4M3) for _ in range(3))
    qd, kd, vd = (torch.rand(1, 2, generator=gen) * 0.5 + 0.25 for _ in range(3))
    emu = reference.attention_fp8_emulation(q8, k8, v8, qd, kd, vd, window_size=(0, 0), softcap=3.0)
    assert torch.allclose(emu, v8.double() * vd.double()[:, None, :, None], atol=1e-12, rtol=0)
    deq = [x.double() * d.double()[:, None, :, None] for x, d in ((q8, qd), (k8, kd), (v8, vd))]
    for causal, window, softcap in [(True, (5, 0), 0.0), (False, (3, 2), 2.0), (True, (-1, -1), 1.0)]:
        emu = reference.attention_fp8_emulation(q8, k8, v8, qd, kd, vd, causal=causal, window_size=window,
                                                softcap=softcap)
        ref, _ = attention_ref(*deq, causal=causal, window_size=window, softcap=softcap)
        torch.testing.assert_close(emu, ref, atol=0.05, rtol=0)
        plain = reference.attention_fp8_emulation(q8, k8, v8, qd, kd, vd, causal=causal)
        assert not torch.allclose(emu, plain, atol=1e-6)
