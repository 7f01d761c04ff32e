"""The public forward API: the checks of its Python-typed arguments, defaults, and the call into the op.

The argument rules for tensors (shapes, dtypes, strides, devices) and for the values of the scalar
arguments (softmax_scale, window_size, softcap) are written once, in the C++ op (csrc/arg_checks.cpp),
which runs them on every call, also on CPU tensors and for callers of torch.ops.flash_ext.* directly.
They raise ValueError / TypeError naming the argument. Python checks only the Python types of what it
converts (softmax_scale, causal, deterministic, window_size, softcap).
"""
import json
import math

import torch

from .kernel_table import KERNEL_HEADDIMS, kernel_headdim  # noqa: F401  (re-exported)

_ext_error = None
try:
    from . import _C  # noqa: F401  (loads the library; its TORCH_LIBRARY registers torch.ops.flash_ext)
except ImportError as e:  # CPU-only install, or a build that has not happened yet
    _ext_error = e


def extension_available():
    """True when the compiled CUDA extension (flash_ext._C) is loaded."""
    return _ext_error is None


def build_info():
    """What the loaded extension contains, as a dict:

    kernels: [{"direction": "fwd", "headdim": 128, "dtype": "bf16", "causal": False}, ...] (one per compiled
    kernel; build switches compile a subset of flash_ext/kernel_table.py), and summaries of it: headdims,
    dtypes, causal (sorted lists), backward (bool: any backward kernel); cutlass and cuda versions.
    """
    _require_extension()
    info = json.loads(torch.ops.flash_ext.build_info())
    kernels = info["kernels"]
    info["headdims"] = sorted({k["headdim"] for k in kernels})
    info["dtypes"] = sorted({k["dtype"] for k in kernels})
    info["causal"] = sorted({k["causal"] for k in kernels})
    info["backward"] = any(k["direction"] == "bwd" for k in kernels)
    return info


def has_kernel(direction, headdim, dtype, causal, info=None):
    """Whether the loaded build (or `info`, a build_info() dict) runs `direction` ("fwd"/"bwd") at this head
    dim (any multiple of 8 up to 256), dtype (torch.float16/bfloat16/float8_e4m3fn or "fp16"/"bf16"/"e4m3")
    and mask."""
    name = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float8_e4m3fn: "e4m3"}.get(dtype, dtype)
    wanted = {"direction": direction, "headdim": kernel_headdim(headdim, direction), "dtype": name, "causal": causal}
    kernels = (info if info is not None else build_info())["kernels"]
    # The kernels for the usual layouts (a column-major-V FP8 kernel comes beside one of them).
    return any(all(k.get(key) == value for key, value in wanted.items()) and not k.get("v_colmajor", False)
               for k in kernels)


def _require_extension():
    if _ext_error is not None:
        raise RuntimeError(
            "flash_ext's CUDA extension is not built or failed to load "
            f"({_ext_error}); build it with `pip install --no-build-isolation -e .`"
        )


def _check_tensors(**tensors):
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _softmax_scale(softmax_scale, headdim):
    """softmax_scale as a float (default 1/sqrt(headdim)); its value is the op's to check, and so is a head
    dim of 0 (the default is then a placeholder: the op rejects the shape with its own message)."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(headdim) if headdim > 0 else 1.0
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    return float(softmax_scale)


def _check_bool(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


# The default window (none): its own object, which the per-call checks recognise first (host time per call).
NO_WINDOW = (-1, -1)


def _window_size(window_size):
    """window_size as (left, right) ints; their values (-1 or >= 0, causal's right bound) are the op's to check."""
    if window_size is NO_WINDOW:
        return window_size
    if not isinstance(window_size, (tuple, list)):
        raise TypeError(f"window_size must be a tuple (left, right) of two ints, got {type(window_size).__name__}")
    if len(window_size) != 2:
        raise ValueError(f"window_size must be a tuple (left, right) of two ints, got {len(window_size)} element(s)")
    for bound in window_size:
        if isinstance(bound, bool) or not isinstance(bound, int):
            raise TypeError(f"window_size must be a tuple (left, right) of two ints, got a {type(bound).__name__} "
                            f"in {tuple(window_size)!r}")
    return int(window_size[0]), int(window_size[1])


def _softcap(softcap):
    """softcap as a float; its value (finite, >= 0) is the op's to check."""
    if type(softcap) is float:
        return softcap
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float (0 = off), got {type(softcap).__name__}")
    return float(softcap)


def forward(q, k, v, softmax_scale=None, causal=False, q_descale=None, k_descale=None, v_descale=None,
            window_size=NO_WINDOW, softcap=0.0):
    """Exact attention forward on Hopper.

    Args:
        q: (batch, seqlen_q, nheads, headdim), fp16, bf16 or FP8 (torch.float8_e4m3fn), CUDA (sm_90).
        k, v: (batch, seqlen_k, nheads_kv, headdim), same dtype; nheads must be a multiple of nheads_kv.
            Any strides with a contiguous last dim (16-byte aligned), e.g. slices of a packed qkv tensor.
            An FP8 v may instead be column-major, its seqlen_k dim contiguous (fp8.quantize_qkv(...,
            v_colmajor=True)): head dim 256 reads it without a transpose in shared memory; other head
            dims copy it row-major first.
        softmax_scale: scale of QK^T before the softmax; default 1/sqrt(headdim).
        causal: mask aligned to the bottom-right corner: query i sees keys j <= i + seqlen_k - seqlen_q.
            Queries that see no key get out = 0 and lse = -inf.
        q_descale, k_descale, v_descale: FP8 only: float32 (batch, nheads_kv) factors that turn the stored
            e4m3 values back into real ones (q_real = q * q_descale[b, head // (nheads // nheads_kv)]);
            None means 1. flash_ext.fp8.quantize_qkv makes all six from 16-bit tensors.
        window_size: (left, right), two ints, each -1 (unbounded) or >= 0: a sliding window aligned to the
            same bottom-right diagonal: query i sees key j iff
            i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right (and j < seqlen_k).
            causal=True is the window's right = 0, so with causal the right bound must be -1 or 0 (else
            ValueError). (-1, -1) (the default) is no window. Runs on the causal kernel of the head dim and
            dtype (a window that covers every key, on the non-causal one).
        softcap: c >= 0 (0, the default, = off): the logits s = softmax_scale * q.k become c * tanh(s / c)
            before the softmax (Gemma 2's logit soft-capping); with FP8, s includes q_descale * k_descale.

    Returns:
        (out, lse): out (batch, seqlen_q, nheads, headdim), contiguous, in q's dtype (bf16 for FP8);
        lse float32 (batch, nheads, seqlen_q), the natural log of the softmax denominators (of the
        descaled, soft-capped logits), -inf for queries that see no key. 16-bit: both are differentiable
        when q, k or v require grad (the backward is flash_ext.backward). FP8 is forward-only.
    """
    if q_descale is not None or k_descale is not None or v_descale is not None or _is_fp8(q):
        return _forward_fp8(q, k, v, softmax_scale, causal, q_descale, k_descale, v_descale, window_size, softcap)
    return attention(q, k, v, softmax_scale, causal, deterministic=False, window_size=window_size, softcap=softcap)


def _is_fp8(t):
    return isinstance(t, torch.Tensor) and t.dtype == torch.float8_e4m3fn


def _forward_fp8(q, k, v, softmax_scale, causal, q_descale, k_descale, v_descale, window_size=NO_WINDOW, softcap=0.0):
    """The FP8 path of forward (also reached by 16-bit inputs with descales, for the op's error)."""
    _check_tensors(q=q, k=k, v=v)
    for name, t in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        if t is not None:
            _check_tensors(**{name: t})
    scale = _softmax_scale(softmax_scale, q.shape[-1] if q.dim() > 0 else 1)
    _check_bool("causal", causal)
    window, softcap = _window_size(window_size), _softcap(softcap)
    _require_extension()
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise NotImplementedError("the FP8 forward is not differentiable: flash_ext has no FP8 backward; "
                                  "detach q, k, v or use 16-bit inputs for training")
    return torch.ops.flash_ext.fwd(q, k, v, scale, causal, q_descale, k_descale, v_descale, window[0], window[1], softcap)


def attention(q, k, v, softmax_scale=None, causal=False, deterministic=False, window_size=NO_WINDOW, softcap=0.0):
    """forward() (16-bit) with the backward's deterministic switch: (out, lse), differentiable; window_size
    and softcap as in forward(), and the backward uses the same ones."""
    _check_tensors(q=q, k=k, v=v)
    scale = _softmax_scale(softmax_scale, q.shape[-1] if q.dim() > 0 else 1)
    _check_bool("causal", causal)
    _check_bool("deterministic", deterministic)
    window, softcap = _window_size(window_size), _softcap(softcap)
    _require_extension()
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return torch.ops.flash_ext.attention(q, k, v, scale, causal, deterministic, window[0], window[1], softcap)
    # Positional: keyword arguments cost the op's dispatch more host time per call.
    return torch.ops.flash_ext.fwd(q, k, v, scale, causal, None, None, None, window[0], window[1], softcap)


def backward(dout, q, k, v, out, lse, softmax_scale=None, causal=False, deterministic=False, dq=None, dk=None, dv=None,
             dlse=None, window_size=NO_WINDOW, softcap=0.0):
    """Gradients of exact attention: (dq, dk, dv).

    Args:
        dout: the gradient of out, q's shape and dtype.
        q, k, v, out, lse: the forward's inputs and outputs (same layout rules as forward).
        softmax_scale, causal, window_size, softcap: as given to the forward (see forward(); the gradient
            of a soft-capped logit goes through its tanh, and masked keys get zero dk, dv from that query).
        deterministic: add the contributions to dq in a fixed order, so that gradients are bitwise equal
            from run to run (a little slower).
        dq, dk, dv: optional preallocated outputs (shapes and dtypes of q, k, v; any TMA-compatible strides).
        dlse: optional gradient flowing into lse (float32, lse's shape), for losses that use lse itself
            (e.g. merging partial attentions by their LSE); None means zero.

    Returns:
        (dq, dk, dv); with GQA/MQA dk and dv are summed over each group of query heads.
    """
    _check_tensors(dout=dout, q=q, k=k, v=v, out=out, lse=lse)
    for name, t in (("dq", dq), ("dk", dk), ("dv", dv), ("dlse", dlse)):
        if t is not None:
            _check_tensors(**{name: t})
    scale = _softmax_scale(softmax_scale, q.shape[-1] if q.dim() > 0 else 1)
    _check_bool("causal", causal)
    _check_bool("deterministic", deterministic)
    window, softcap = _window_size(window_size), _softcap(softcap)
    _require_extension()
    if dq is None and dk is None and dv is None:
        return torch.ops.flash_ext.bwd(dout, q, k, v, out, lse, dlse, scale, causal, deterministic, *window, softcap)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format) if dq is None else dq
    dk = torch.empty_like(k, memory_format=torch.contiguous_format) if dk is None else dk
    dv = torch.empty_like(v, memory_format=torch.contiguous_format) if dv is None else dv
    torch.ops.flash_ext.bwd_out(dout, q, k, v, out, lse, dlse, scale, causal, deterministic, dq, dk, dv, *window, softcap)
    return dq, dk, dv


if _ext_error is None:
    from . import ops

    ops.register()
