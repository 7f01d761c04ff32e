"""Helpers shared by the GPU tests: poisoned output memory and the rounding-noise term of the error rule."""
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
