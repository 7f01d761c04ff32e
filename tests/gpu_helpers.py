"""Helpers shared by the GPU tests (and scripts/check_variants.py): poisoned output memory, the rounding-noise
term of the error rule, the rule itself for the forward's out and lse and the backward's gradients, and inputs
whose row maxima move between key blocks by chosen steps."""
import math

import torch


def poison_allocator(*shapes_dtypes):
    """Fill blocks of the sizes the outputs will take with NaN and free them, so the caching allocator
    hands NaN-filled memory to the kernel's outputs: an element the kernel forgets to write stays NaN."""
    for shape, dtype in shapes_dtypes:
        torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def rounding_noise(ref, dtype):
    """The error of merely storing `ref` in `dtype` (the slack FlashAttention's tests add to 2x PyTorch's)."""
    if ref.numel() == 0:
        return 0.0
    ref_lowp = ref.to(dtype)
    return (ref_lowp + 0.3 - 0.3 - ref_lowp).abs().max().item()


def assert_grads_within_rule(grads, ref, low, dtype):
    """FlashAttention's error rule for (dq, dk, dv): each within 2x the max error of the same gradient
    computed by PyTorch in `dtype` (low) against the float64 one (ref), plus rounding noise; no NaN."""
    for name, got, g_ref, g_low in zip(("dq", "dk", "dv"), grads, ref, low):
        assert not got.isnan().any(), f"NaN in {name} (unwritten or invalid elements)"
        err = (got.double() - g_ref).abs().max().item()
        err_pt = (g_low.double() - g_ref).abs().max().item()
        noise = rounding_noise(g_ref, dtype)
        assert err <= 2 * err_pt + noise, f"{name}: max error {err:.3e} > 2 * {err_pt:.3e} (PyTorch {dtype}) + {noise:.1e}"


def assert_out_within_rule(out, out_ref, out_pt, dtype):
    """FlashAttention's error rule for the forward's out: max error at most 2x that of PyTorch's attention
    in `dtype` (out_pt) against the float64 reference (out_ref), plus rounding noise."""
    err = (out.double() - out_ref).abs().max().item()
    err_pt = (out_pt.double() - out_ref).abs().max().item()
    noise = rounding_noise(out_ref, dtype)
    assert err <= 2 * err_pt + noise, f"max error {err:.3e} > 2 * {err_pt:.3e} (PyTorch {dtype}) + {noise:.1e}"


def assert_lse_matches(lse, lse_ref, tol):
    """lse is -inf exactly where the float64 reference's is (rows that see no key) and within `tol` of it
    elsewhere. Returns the mask of finite rows."""
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite), "lse is -inf exactly where a row sees no key"
    assert torch.all(lse[~finite] == -math.inf)
    if finite.any():
        lse_err = (lse.double()[finite] - lse_ref[finite]).abs().max().item()
        assert lse_err <= tol, f"lse error {lse_err:.3e} > {tol:.1e}"
    return finite


def row_max_staircase(batch, seqlen_q, seqlen_k, nheads, headdim, softmax_scale, seed):
    """q, k, v (float32) whose scores' row maxima move between key blocks by chosen amounts: every query of a
    head leans on one direction e, and key j on it by t_j, so that S_ij ~ t_j * |e|^2. The mainloop walks the
    key blocks last first; t rises towards the first keys, so each block raises the row max. In log2 units of
    the softmax: head 0 rises by 4 over all keys (about 0.5 per 128-key block: below FP8's lazy-rescale
    threshold), head 1 by 50 (about 6 per block: below 16-bit's), heads 2 and up by a staircase of steps 0.3,
    0.7, 0.8, 2, 7.9, 8.1 and 20 every 112 keys (head 3 at half those). Exercises every path of the online
    softmax's max update, a lazy rescale's included where the build has one."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    e = torch.randn(nheads, headdim, device="cuda", generator=gen)
    e = e / e.norm(dim=-1, keepdim=True)
    back = (seqlen_k - 1 - torch.arange(seqlen_k, device="cuda")).float()  # distance from the last key
    log2_unit = 1.0 / (softmax_scale * math.log2(math.e))  # the score change that moves exp2's argument by 1
    steps = torch.tensor([0.3, 0.7, 0.8, 2.0, 7.9, 8.1, 20.0], device="cuda")
    stair = torch.cumsum(steps.repeat(seqlen_k // (112 * len(steps)) + 1), 0)
    t = torch.empty(nheads, seqlen_k, device="cuda")
    for h in range(nheads):
        if h < 2:
            t[h] = back / seqlen_k * (4.0 if h == 0 else 50.0) * log2_unit
        else:
            t[h] = stair[back.long() // 112] * log2_unit * (0.5 if h % 2 else 1.0)
    noise = lambda *shape: 0.05 * torch.randn(*shape, device="cuda", generator=gen)  # noqa: E731
    q = e.expand(batch, seqlen_q, nheads, headdim) + noise(batch, seqlen_q, nheads, headdim)
    k = t.t()[None, :, :, None] * e[None, None] + noise(batch, seqlen_k, nheads, headdim)
    v = torch.randn(batch, seqlen_k, nheads, headdim, device="cuda", generator=gen)
    return q, k, v
