"""Helpers shared by the GPU tests: poisoned output memory, the rounding-noise term of the error rule, and
the rule itself for the forward's out and lse and the backward's gradients."""
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
