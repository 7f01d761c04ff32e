"""The public forward API: argument checks (raised before any launch) and the call into the CUDA op."""
import math

import torch

# Head dims with their own kernels; other multiples of 8 up to 256 run on the next size up.
SUPPORTED_HEADDIMS = (64, 96, 128, 192, 256)
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
_ALIGN_BYTES = 16  # TMA: base address and every non-unit stride must be multiples of 16 bytes

_ext_error = None
try:
    from . import _C  # noqa: F401  (loads the library; its TORCH_LIBRARY registers torch.ops.flash_ext)
except ImportError as e:  # CPU-only install, or a build that has not happened yet
    _ext_error = e


def extension_available():
    """True when the compiled CUDA extension (flash_ext._C) is loaded."""
    return _ext_error is None


def build_info():
    """What the loaded extension was compiled with (head dims, dtypes, causal variants, CUDA, CUTLASS)."""
    _require_extension()
    return torch.ops.flash_ext.build_info()


def kernel_headdim(headdim):
    """The kernel head dim that runs a given head dim (the smallest supported size >= headdim)."""
    if isinstance(headdim, bool) or not isinstance(headdim, int) or headdim < 8 or headdim % 8 != 0:
        raise ValueError(f"head dim must be a positive multiple of 8, got {headdim!r}")
    for d in SUPPORTED_HEADDIMS:
        if headdim <= d:
            return d
    raise ValueError(f"head dim {headdim} is larger than the largest supported ({SUPPORTED_HEADDIMS[-1]})")


def _require_extension():
    if _ext_error is not None:
        raise RuntimeError(
            "flash_ext's CUDA extension is not built or failed to load "
            f"({_ext_error}); build it with `pip install --no-build-isolation -e .`"
        )


def _check_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(
            f"{name} must have 4 dims (batch, seqlen, nheads, headdim), got {t.dim()} dims with shape {tuple(t.shape)}"
        )
    if t.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; flash_ext.forward supports torch.float16 and torch.bfloat16")


def _check_layout(name, t):
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last (headdim) dim, got strides {t.stride()}; call .contiguous()")
    elem = t.element_size()
    for dim in range(3):
        stride_bytes = t.stride(dim) * elem
        if t.size(dim) > 1 and (stride_bytes <= 0 or stride_bytes % _ALIGN_BYTES != 0 or stride_bytes >= 2**40):
            raise ValueError(
                f"{name} stride {t.stride(dim)} of dim {dim} must be a positive multiple of {_ALIGN_BYTES // elem} "
                f"elements ({_ALIGN_BYTES} bytes) for the TMA loads (expanded or oddly strided views are not); "
                "call .contiguous()"
            )
    if t.data_ptr() % _ALIGN_BYTES != 0:
        raise ValueError(f"{name}'s data pointer is not {_ALIGN_BYTES}-byte aligned (a view at an odd offset?); call .clone()")


def check_forward_args(q, k, v, softmax_scale=None, causal=False):
    """Validate forward's arguments; raises TypeError/ValueError/RuntimeError naming the problem."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    batch, seqlen_q, nheads, headdim = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    batch_k, seqlen_k, nheads_kv, headdim_k = k.shape
    if batch_k != batch:
        raise ValueError(f"batch mismatch: q has batch {batch}, k and v have {batch_k}")
    if headdim_k != headdim:
        raise ValueError(f"head dim mismatch: q has {headdim}, k and v have {headdim_k}")
    if batch < 1 or nheads < 1 or nheads_kv < 1:
        raise ValueError(f"batch and head counts must be >= 1, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if seqlen_q < 1 or seqlen_k < 1:
        raise ValueError(f"seqlen_q and seqlen_k must be >= 1, got {seqlen_q} and {seqlen_k}")
    if nheads % nheads_kv != 0:
        raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_kv ({nheads_kv}) for MQA/GQA")
    if headdim % 8 != 0 or not (8 <= headdim <= SUPPORTED_HEADDIMS[-1]):
        raise ValueError(
            f"head dim {headdim} is not supported: it must be a multiple of 8 in [8, {SUPPORTED_HEADDIMS[-1]}] "
            f"(kernels for {SUPPORTED_HEADDIMS}; others run on the next size up)"
        )
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
        if not math.isfinite(softmax_scale) or softmax_scale <= 0:
            raise ValueError(f"softmax_scale must be a finite positive number, got {softmax_scale}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_layout(name, t)
    # Device checks last, so that shape and dtype errors are reported for CPU tensors too.
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.device.type != "cuda":
            raise ValueError(f"{name} is on {t.device}; flash_ext.forward needs CUDA tensors on an sm_90 GPU")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    major, minor = torch.cuda.get_device_capability(q.device)
    if (major, minor) != (9, 0):
        raise RuntimeError(
            f"flash_ext's kernels need an sm_90 (Hopper H100/H200) GPU; {torch.cuda.get_device_name(q.device)} "
            f"is sm_{major}{minor}"
        )


def forward(q, k, v, softmax_scale=None, causal=False):
    """Exact attention forward on Hopper.

    Args:
        q: (batch, seqlen_q, nheads, headdim), fp16 or bf16, CUDA (sm_90).
        k, v: (batch, seqlen_k, nheads_kv, headdim), same dtype; nheads must be a multiple of nheads_kv.
            Any strides with a contiguous last dim (16-byte aligned), e.g. slices of a packed qkv tensor.
        softmax_scale: scale of QK^T before the softmax; default 1/sqrt(headdim).
        causal: mask aligned to the bottom-right corner: query i sees keys j <= i + seqlen_k - seqlen_q.
            Queries that see no key get out = 0 and lse = -inf.

    Returns:
        (out, lse): out like q (batch, seqlen_q, nheads, headdim) in q's dtype, contiguous;
        lse float32 (batch, nheads, seqlen_q), the natural log of the softmax denominators.
    """
    check_forward_args(q, k, v, softmax_scale, causal)
    _require_extension()
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    return torch.ops.flash_ext.fwd(q, k, v, float(softmax_scale), causal)


def _register_fake():
    # Shape inference for torch.compile / meta tensors.
    if _ext_error is not None or not hasattr(torch.library, "register_fake"):
        return

    @torch.library.register_fake("flash_ext::fwd")
    def _fwd_fake(q, k, v, softmax_scale, causal):
        b, sq, h, _ = q.shape
        return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((b, h, sq), dtype=torch.float32)


_register_fake()
