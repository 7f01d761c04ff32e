"""flash_ext.combine on the GPU, over flash_ext.forward's own results: the forward run on disjoint parts of
the keys, merged, is the attention over all keys within FlashAttention's error rule (2x the error of
PyTorch's attention in the inputs' dtype against the float64 reference, plus the rounding of the 16-bit
parts and of the result), with lse within 1e-3. The CPU tests (tests/test_combine.py) check the merge
itself to float64 rounding.
"""
import pytest
import torch

import flash_ext
from flash_ext.reference import attention_lowp, attention_ref
from gpu_helpers import assert_lse_matches, rounding_noise

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("bounds", [[0, 1000, 2049], [0, 1, 7, 113, 1000, 1500]], ids=["2parts", "5parts"])
@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_forward_parts_merge_to_the_whole(bounds, headdim, dtype):
    if not flash_ext.has_kernel("fwd", headdim, dtype, False):
        pytest.skip(f"this build has no {dtype} head dim {headdim} non-causal forward kernel")
    gen = torch.Generator(device="cuda").manual_seed(headdim + len(bounds))
    seqlen_k = bounds[-1]
    q = torch.randn(2, 113, 8, headdim, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(2, seqlen_k, 2, headdim, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(2, seqlen_k, 2, headdim, device="cuda", dtype=dtype, generator=gen)
    parts = [flash_ext.forward(q, k[:, a:b], v[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    out, lse = flash_ext.combine(torch.stack([o for o, _ in parts]), torch.stack([l for _, l in parts]))
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == (2, 8, 113)
    out_ref, lse_ref = attention_ref(q, k, v)
    out_pt = attention_lowp(q, k, v)
    err = (out.double() - out_ref).abs().max().item()
    err_pt = (out_pt.double() - out_ref).abs().max().item()
    noise = rounding_noise(out_ref, dtype)
    # One rounding more than a single call has: the parts' 16-bit outputs.
    assert err <= 2 * err_pt + 2 * noise, f"max error {err:.3e} > 2 * {err_pt:.3e} (PyTorch {dtype}) + 2 * {noise:.1e}"
    assert_lse_matches(lse, lse_ref, 1e-3)
