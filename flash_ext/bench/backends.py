"""The timed backends: flash_ext, FlashAttention-3, SDPA (cuDNN, flash, memory-efficient, math) and Flex.

A backend gives the runner two closures built OUTSIDE the timed region: fn() launches exactly the timed
work, and post(fn's result) returns (b, s, h, d) tensors for the check: the output (fwd) or dq, dk, dv (bwd).

A shape may carry a sliding window and a softcap (--window, --softcap): flash_ext and FA3 run them; SDPA
and Flex are skipped with the reason; flash_ext's comparison columns (flash_ext_no_window,
flash_ext_no_softcap) run the same shape without one of them (Backend.problem).

A --varlen row is a packed batch of sequences (Shape.seqlens), its inputs (1, total, h, d): flash_ext and FA3
run their varlen functions on the packed rows; SDPA runs the batch zero-padded to the longest sequence with an
additive mask (Packed), and SDPA nested on nested tensors (layout=torch.jagged); flash_ext_dense runs the
dense kernels on the dense batch that does the same work (shapes.dense_equivalent: sequences of
L = round(sum(s^2) / sum(s)), batch round(tokens / L); Backend.problem: the runner lays the packed rows out as
that batch). Every
post() returns the packed layout, which the check compares sequence by sequence.
"""
import contextlib
import dataclasses
import functools
import importlib.util

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_ext
from flash_ext import ops as flash_ext_ops

from .records import NA, SKIPPED
from .shapes import dense_equivalent


def _first(res):
    """The output of an op that returns out or (out, lse, ...)."""
    return res[0] if isinstance(res, (tuple, list)) else res


def padded_length(shape):
    """The length SDPA's padded batch has for a --varlen row: the longest sequence rounded up to a multiple of
    16 (as a tokenizer's pad_to_multiple_of would; SDPA's memory-efficient kernel then needs no re-padded mask)."""
    return -(-max(shape.seqlens) // 16) * 16


class Packed:
    """A --varlen row's inputs, drawn by the runner as (1, total, h, d), in the layouts each backend takes:
    the packed rows with int32 offsets (flash_ext, FA3), a zero-padded (B, L, h, d) batch with its mask (SDPA),
    nested tensors (SDPA nested). Built outside the timed region."""

    def __init__(self, shape, device):
        self.seqlens = shape.seqlens
        offsets = [0]
        for n in self.seqlens:
            offsets.append(offsets[-1] + n)
        self.cu_seqlens = torch.tensor(offsets, dtype=torch.int32, device=device)
        self.max_seqlen = max(self.seqlens)
        self.padded = padded_length(shape)
        # Row b * padded + i of the padded batch holds token i of sequence b.
        self.index = torch.cat([torch.arange(n, device=device) + b * self.padded for b, n in enumerate(self.seqlens)])

    def pad(self, t):
        """(1, total, ...) -> (B, L, ...), zeros past each sequence."""
        out = t.new_zeros(len(self.seqlens) * self.padded, *t.shape[2:])
        out[self.index] = t[0]
        return out.view(len(self.seqlens), self.padded, *t.shape[2:])

    def unpad(self, t):
        """(B, L, ...) -> (1, total, ...): the rows of the sequences, packed."""
        return t.reshape(-1, *t.shape[2:])[self.index].unsqueeze(0)

    def attn_bias(self, causal, dtype):
        """(B, 1, L, L) additive mask in `dtype` (built once: SDPA would convert a boolean one on every call): 0
        where query i of sequence b sees key j (j below its length, and j <= i when causal: the sequences are
        self-attention, so top-left is bottom-right), -inf elsewhere. Padding rows see their sequence's keys
        (finite, and dropped by unpad)."""
        device, n = self.cu_seqlens.device, self.padded
        cols = torch.arange(n, device=device)
        lengths = torch.tensor(self.seqlens, device=device)
        visible = (cols[None, None, :] < lengths[:, None, None]).expand(-1, n, -1)  # (B, L, L)
        if causal:
            visible = visible & (cols[None, None, :] <= cols[None, :, None])
        bias = torch.zeros(len(self.seqlens), 1, n, n, dtype=dtype, device=device)
        return bias.masked_fill_(~visible[:, None], float("-inf"))

    def nested(self, t):
        """(total, h, d) -> a jagged nested tensor (B, j, h, d), a view; its lengths are given so that SDPA never
        reads them back from the GPU."""
        return torch.nested.nested_tensor_from_jagged(t, self.cu_seqlens.long(), min_seqlen=min(self.seqlens),
                                                      max_seqlen=self.max_seqlen)


def _autograd_bwd(forward, leaves, dout, to_table):
    """One forward with grad here; fn() = torch.autograd.grad(out, leaves, dout) (the graph kept); post maps
    each gradient back to the runner's layout."""
    out = forward(*leaves)
    grad = torch.empty_like(out)  # dout in the output's own layout, as a training step would give it
    grad.copy_(dout)

    def fn():
        return torch.autograd.grad(out, leaves, grad, retain_graph=True)

    return fn, lambda grads: tuple(to_table(g) for g in grads)


def varlen_forward(q, k, v, packed, scale, shape):
    """flash_ext's timed varlen forward: the op flash_attn_varlen_func calls once its eager value checks (a copy
    of the offsets to the host) have passed; the benchmark's own offsets need none."""
    return torch.ops.flash_ext.fwd_varlen(q, k, v, packed.cu_seqlens, packed.cu_seqlens, None, None, packed.max_seqlen,
                                          packed.max_seqlen, scale, shape.causal, shape.window_left,
                                          shape.window_right, shape.softcap)


def varlen_backward(dout, q, k, v, out, lse, packed, scale, shape, deterministic):
    """flash_ext's timed varlen backward (the op flash_attn_varlen_func's autograd calls)."""
    return torch.ops.flash_ext.bwd_varlen(dout, q, k, v, out, lse, None, packed.cu_seqlens, packed.cu_seqlens, None,
                                          None, packed.max_seqlen, packed.max_seqlen, scale, shape.causal,
                                          deterministic, shape.window_left, shape.window_right, shape.softcap)


class Backend:
    """Runs call() on inputs in its native layout; the backward goes through torch.autograd."""

    key = "?"
    bhsd = False  # True: the op takes (b, h, s, d), given as transposed views of the (b, s, h, d) inputs

    def __init__(self, cfg):
        self.cfg = cfg
        self.unavailable = self.check_available()  # why it cannot run at all in this process, or None

    def check_available(self):
        return None

    def problem(self, shape):
        """The shape this backend actually computes for a row of the table: the row's own, except for the
        comparison columns that drop its window or softcap (their FLOPs and reference are this one's)."""
        return shape

    def refuse(self, shape, mode):
        """(status, reason) when it does not run this shape/mode, known without running; else None."""
        return None

    def context(self):
        return contextlib.nullcontext()

    def prepare(self, shape, scale, device):
        """Per-shape state built outside the timed region (masks...)."""
        return None

    def call(self, q, k, v, shape, scale, state):
        raise NotImplementedError

    def native(self, t):
        """(b, s, h, d) <-> the op's layout (a transpose is its own inverse)."""
        return t.transpose(1, 2) if self.bhsd else t

    def make_fwd(self, q, k, v, shape, scale):
        state = self.prepare(shape, scale, q.device)
        qn, kn, vn = (self.native(t) for t in (q, k, v))

        def fn():
            return self.call(qn, kn, vn, shape, scale, state)

        return fn, lambda res: self.native(_first(res))

    def make_bwd(self, q, k, v, dout, shape, scale):
        """One forward with grad here; fn() = torch.autograd.grad(out, (q, k, v), dout), keeping the graph."""
        leaves = [self.native(t).detach().requires_grad_(True) for t in (q, k, v)]
        out = _first(self.call(*leaves, shape, scale, self.prepare(shape, scale, q.device)))
        grad = torch.empty_like(out)  # dout in the output's own layout, as a training step would give it
        grad.copy_(self.native(dout))

        def fn():
            return torch.autograd.grad(out, leaves, grad, retain_graph=True)

        return fn, lambda grads: tuple(self.native(g) for g in grads)


def flash_ext_has_backward():
    """True when the loaded flash_ext build has at least one backward kernel."""
    return flash_ext.extension_available() and flash_ext.build_info()["backward"]


def _kernel_mask(shape):
    """(the kernel table's causal flag, its name) of the kernel a shape runs on: a window runs on the causal
    kernel (which computes any band; a window as wide as the sequences falls back to the non-causal one,
    which the op then asks for itself)."""
    if shape.has_window():
        return True, "causal (it runs sliding windows)"
    return shape.causal, "causal" if shape.causal else "non-causal"


def _refuse_window_softcap(shape, what):
    """The refusal of a backend that has neither a sliding window nor a softcap."""
    if shape.has_window():
        return SKIPPED, (f"{what} has no sliding window (--window {shape.window_left},{shape.window_right}); "
                         "flash_ext (no window) is the same attention without it")
    if shape.softcap:
        return SKIPPED, f"{what} has no softcap (--softcap {shape.softcap:g}); flash_ext (no softcap) runs without it"
    return None


class FlashExtBackend(Backend):
    key = "flash_ext"

    def __init__(self, cfg):
        # What the loaded build compiled (kernels, dtypes, backward...); None when the extension did not load.
        self.info = flash_ext.build_info() if flash_ext.extension_available() else None
        super().__init__(cfg)

    def check_available(self):
        return None if self.info is not None else "flash_ext extension not built (or it failed to load)"

    # The benchmark's dtype names -> the kernel table's (flash_ext/kernel_table.py).
    KERNEL_DTYPE = {"fp8": "e4m3"}

    def refuse(self, shape, mode):
        dtype = self.KERNEL_DTYPE.get(self.cfg.dtype, self.cfg.dtype)
        if shape.is_varlen() and dtype == "e4m3":
            return SKIPPED, "flash_ext has no FP8 variable-length attention"
        if mode == "bwd" and dtype == "e4m3":
            return NA, "FP8 is forward-only"
        if dtype not in self.info["dtypes"]:
            name = self.cfg.dtype + (f" ({dtype})" if dtype != self.cfg.dtype else "")
            return SKIPPED, f"{name} not in this flash_ext build (it has {', '.join(self.info['dtypes'])})"
        if mode == "bwd" and not self.info["backward"]:
            return NA, "no backward in this flash_ext build"
        try:
            headdim = flash_ext.kernel_headdim(shape.headdim, mode)  # d192's backward runs on the d256 kernel
        except ValueError as e:
            return SKIPPED, str(e)
        kernel_causal, mask = _kernel_mask(shape)
        if not flash_ext.has_kernel(mode, headdim, dtype, kernel_causal, info=self.info):
            return SKIPPED, f"no {mode} kernel for d{headdim} {dtype} {mask} in this flash_ext build"
        if shape.is_varlen() and not flash_ext_ops.has_varlen_ops():
            return SKIPPED, "this flash_ext build has no varlen ops (torch.ops.flash_ext.fwd_varlen)"
        return None

    def make_fwd(self, q, k, v, shape, scale):
        if shape.is_varlen():
            packed = Packed(shape, q.device)
            q3, k3, v3 = q[0], k[0], v[0]

            def fn():
                return varlen_forward(q3, k3, v3, packed, scale, shape)

            return fn, lambda res: res[0].unsqueeze(0)
        extra = shape.window_softcap_kwargs()
        if self.cfg.fp8_v_colmajor and v.dtype == torch.float8_e4m3fn and self._has_v_colmajor_kernel(shape):
            v = flash_ext.fp8.colmajor(v)  # the same values; made here, outside the timed call

        def fn():
            return flash_ext.forward(q, k, v, softmax_scale=scale, causal=shape.causal, **extra)

        return fn, lambda res: res[0]

    def _has_v_colmajor_kernel(self, shape):
        kernel_causal, _ = _kernel_mask(shape)
        wanted = {"direction": "fwd", "headdim": flash_ext.kernel_headdim(shape.headdim), "dtype": "e4m3",
                  "causal": kernel_causal, "v_colmajor": True}
        return wanted in self.info["kernels"]

    def make_bwd(self, q, k, v, dout, shape, scale):
        if shape.is_varlen():
            packed = Packed(shape, q.device)
            dout3, q3, k3, v3 = dout[0], q[0], k[0], v[0]
            out, lse = varlen_forward(q3, k3, v3, packed, scale, shape)

            def fn():
                return varlen_backward(dout3, q3, k3, v3, out, lse, packed, scale, shape, self.cfg.deterministic)

            return fn, lambda grads: tuple(g.unsqueeze(0) for g in grads)
        extra = shape.window_softcap_kwargs()
        out, lse = flash_ext.forward(q, k, v, softmax_scale=scale, causal=shape.causal, **extra)

        def fn():
            return flash_ext.backward(
                dout, q, k, v, out, lse, softmax_scale=scale, causal=shape.causal, deterministic=self.cfg.deterministic,
                **extra
            )

        return fn, tuple


class FlashExtNoWindowBackend(FlashExtBackend):
    """flash_ext on the same inputs without the row's window (its softcap kept), so that one table gives the
    window's effect: its TFLOP/s count the pairs it computes (the whole causal or full attention). Runs only
    with --window."""

    key = "flash_ext_no_window"

    def problem(self, shape):
        return dataclasses.replace(shape, window_left=-1, window_right=-1)

    def refuse(self, shape, mode):
        if not shape.has_window():
            return SKIPPED, "the comparison column of --window runs"
        return super().refuse(self.problem(shape), mode)


class FlashExtNoSoftcapBackend(FlashExtBackend):
    """flash_ext on the same inputs without the row's softcap (its window kept). Runs only with --softcap."""

    key = "flash_ext_no_softcap"

    def problem(self, shape):
        return dataclasses.replace(shape, softcap=0.0)

    def refuse(self, shape, mode):
        if not shape.softcap:
            return SKIPPED, "the comparison column of --softcap runs"
        return super().refuse(self.problem(shape), mode)


class FlashExtDenseBackend(FlashExtBackend):
    """flash_ext's dense kernels on the dense batch that does a --varlen row's work (shapes.dense_equivalent:
    sequences of L = round(sum(s^2) / sum(s)), batch round(tokens / L), so the same (query, key) pairs and
    tokens up to rounding; 11 x 3107 for the default 32k tokens), the same heads, mask, window and softcap: the
    yardstick of the varlen kernels (the table's varlen/dense is the ratio of their TFLOP/s, each counting its
    own pairs). Runs only with --varlen."""

    key = "flash_ext_dense"

    def problem(self, shape):
        return dense_equivalent(shape) if shape.is_varlen() else shape

    def refuse(self, shape, mode):
        if not shape.is_varlen():
            return SKIPPED, "the comparison column of --varlen runs"
        return super().refuse(self.problem(shape), mode)


class FlashExtBf16Backend(FlashExtBackend):
    """flash_ext's bf16 forward on the same inputs, as the yardstick of an fp8 run (SDPA has no fp8):
    the inputs are converted to bf16 outside the timed region. Runs only with --dtype fp8."""

    key = "flash_ext_bf16"

    def refuse(self, shape, mode):
        if self.cfg.dtype != "fp8":
            return SKIPPED, "the bf16 yardstick of --dtype fp8 runs"
        if shape.is_varlen():
            return SKIPPED, "flash_ext has no FP8 variable-length attention to compare with"
        if mode == "bwd":
            return NA, "FP8 is forward-only"
        if not flash_ext.has_kernel("fwd", shape.headdim, "bf16", _kernel_mask(shape)[0], info=self.info):
            return SKIPPED, "no bf16 forward kernel for this shape in this flash_ext build"
        return None

    def make_fwd(self, q, k, v, shape, scale):
        return super().make_fwd(*(t.to(torch.bfloat16) for t in (q, k, v)), shape, scale)


def fa3_importable():
    """Whether flash_attn_interface (FlashAttention-3) is installed, without importing it."""
    return importlib.util.find_spec("flash_attn_interface") is not None


class FA3Backend(Backend):
    key = "fa3"

    def check_available(self):
        try:
            import flash_attn_interface  # noqa: F401
        except Exception as e:  # not installed, or a broken build (missing symbols...)
            return f"flash_attn_interface not importable ({type(e).__name__}: {e})"
        return None

    def refuse(self, shape, mode):
        if self.cfg.dtype == "fp8" and mode == "bwd":
            return NA, "FA3 has no fp8 backward"
        return None

    def prepare(self, shape, scale, device):
        import flash_attn_interface  # optional: imported only once check_available() found it

        return flash_attn_interface.flash_attn_func

    def call(self, q, k, v, shape, scale, state):
        # FA3 takes window_size and softcap with flash_ext's meaning (for the windows the CLI allows).
        return state(q, k, v, softmax_scale=scale, causal=shape.causal, **shape.window_softcap_kwargs())

    def _varlen(self, shape, device):
        """(forward on packed (total, h, d) rows, Packed) for a --varlen row: FA3's flash_attn_varlen_func."""
        import flash_attn_interface

        packed = Packed(shape, device)
        cu, n = packed.cu_seqlens, packed.max_seqlen

        def forward(q, k, v, scale):
            return _first(flash_attn_interface.flash_attn_varlen_func(
                q, k, v, cu, cu, n, n, softmax_scale=scale, causal=shape.causal, **shape.window_softcap_kwargs()))

        return forward, packed

    def make_fwd(self, q, k, v, shape, scale):
        if not shape.is_varlen():
            return super().make_fwd(q, k, v, shape, scale)
        forward, _ = self._varlen(shape, q.device)
        q3, k3, v3 = q[0], k[0], v[0]
        return (lambda: forward(q3, k3, v3, scale)), lambda res: res.unsqueeze(0)

    def make_bwd(self, q, k, v, dout, shape, scale):
        if not shape.is_varlen():
            return super().make_bwd(q, k, v, dout, shape, scale)
        forward, _ = self._varlen(shape, q.device)
        leaves = [t[0].detach().requires_grad_(True) for t in (q, k, v)]
        return _autograd_bwd(lambda *x: forward(*x, scale), leaves, dout[0], lambda g: g.unsqueeze(0))


class SDPABackend(Backend):
    bhsd = True
    sdp_backend = None  # a torch.nn.attention.SDPBackend
    native_lower_right = False  # True: takes causal_lower_right(sq, sk) natively (flash, efficient)

    def refuse(self, shape, mode):
        if self.cfg.dtype == "fp8":
            return SKIPPED, "SDPA has no fp8 attention"
        # A window could be an explicit boolean attn_mask for math / mem-eff only, timing a dense masked
        # kernel rather than a band; a softcap cannot be expressed at all.
        return _refuse_window_softcap(shape, "SDPA")

    def context(self):
        return sdpa_kernel(self.sdp_backend)

    def prepare(self, shape, scale, device):
        kwargs = {"scale": scale, "enable_gqa": shape.nheads != shape.nheads_kv}
        sq, sk = shape.seqlen_q, shape.seqlen_k
        if shape.causal and sq != sk:
            # SDPA's is_causal is top-left aligned; flash_ext's causal is bottom-right. Same thing when sq == sk.
            if self.native_lower_right:
                from torch.nn.attention.bias import causal_lower_right  # imports torch._dynamo (~1.5 s)

                kwargs["attn_mask"] = causal_lower_right(sq, sk)
            else:  # an explicit boolean mask, built here rather than inside the timed call
                kwargs["attn_mask"] = torch.ones(sq, sk, dtype=torch.bool, device=device).tril(diagonal=sk - sq)
        else:
            kwargs["is_causal"] = shape.causal
        return kwargs

    def call(self, q, k, v, shape, scale, state):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, **state)

    def _padded(self, shape, scale, q):
        """(Packed, SDPA's keyword arguments) of a --varlen row: the padded batch's additive mask."""
        packed = Packed(shape, q.device)
        return packed, {"scale": scale, "enable_gqa": shape.nheads != shape.nheads_kv,
                        "attn_mask": packed.attn_bias(shape.causal, q.dtype)}

    def make_fwd(self, q, k, v, shape, scale):
        if not shape.is_varlen():
            return super().make_fwd(q, k, v, shape, scale)
        packed, kwargs = self._padded(shape, scale, q)
        qp, kp, vp = (packed.pad(t).transpose(1, 2) for t in (q, k, v))

        def fn():
            return torch.nn.functional.scaled_dot_product_attention(qp, kp, vp, **kwargs)

        return fn, lambda res: packed.unpad(res.transpose(1, 2))

    def make_bwd(self, q, k, v, dout, shape, scale):
        if not shape.is_varlen():
            return super().make_bwd(q, k, v, dout, shape, scale)
        packed, kwargs = self._padded(shape, scale, q)
        leaves = [packed.pad(t).transpose(1, 2).detach().requires_grad_(True) for t in (q, k, v)]
        # dout is 0 on the padding rows, so that they add nothing to dk, dv.
        return _autograd_bwd(lambda *x: torch.nn.functional.scaled_dot_product_attention(*x, **kwargs), leaves,
                             packed.pad(dout).transpose(1, 2), lambda g: packed.unpad(g.transpose(1, 2)))


class SDPAFlash(SDPABackend):
    key = "sdpa_flash"
    sdp_backend = SDPBackend.FLASH_ATTENTION
    native_lower_right = True


class SDPACudnn(SDPABackend):
    key = "sdpa_cudnn"
    sdp_backend = SDPBackend.CUDNN_ATTENTION


class SDPAEfficient(SDPABackend):
    key = "sdpa_efficient"
    sdp_backend = SDPBackend.EFFICIENT_ATTENTION
    native_lower_right = True


class SDPAMath(SDPABackend):
    key = "sdpa_math"
    sdp_backend = SDPBackend.MATH

    def refuse(self, shape, mode):
        refusal = super().refuse(shape, mode)
        nbytes = shape.batch * shape.nheads * shape.seqlen_q * shape.seqlen_k * 4
        if refusal is None and nbytes > self.cfg.math_max_gb * 2**30:
            refusal = SKIPPED, (
                f"too large: its b*h*sq*sk fp32 scores need {nbytes / 2**30:.1f} GiB > "
                f"{self.cfg.math_max_gb:g} GiB (--math-max-gb)"
            )
        return refusal


class SDPANested(Backend):
    """SDPA on nested tensors (torch.nested, layout=torch.jagged) over a --varlen row's packed rows, with SDPA's
    own choice of kernel (it picks flash, then memory-efficient, math, cuDNN); is_causal is per sequence. Runs
    only with --varlen."""

    key = "sdpa_nested"

    def refuse(self, shape, mode):
        if not shape.is_varlen():
            return SKIPPED, "the nested-tensor column of --varlen runs"
        if self.cfg.dtype == "fp8":
            return SKIPPED, "SDPA has no fp8 attention"
        return _refuse_window_softcap(shape, "SDPA")

    def _kwargs(self, shape, scale):
        return {"scale": scale, "is_causal": shape.causal, "enable_gqa": shape.nheads != shape.nheads_kv}

    def make_fwd(self, q, k, v, shape, scale):
        packed, kwargs = Packed(shape, q.device), self._kwargs(shape, scale)
        qn, kn, vn = (packed.nested(t[0]).transpose(1, 2) for t in (q, k, v))

        def fn():
            return torch.nn.functional.scaled_dot_product_attention(qn, kn, vn, **kwargs)

        return fn, lambda res: res.transpose(1, 2).values().unsqueeze(0)

    def make_bwd(self, q, k, v, dout, shape, scale):
        packed, kwargs = Packed(shape, q.device), self._kwargs(shape, scale)

        def forward(*leaves):  # packed rows in, packed rows out: the gradients land on the leaves' rows
            nested = (packed.nested(t).transpose(1, 2) for t in leaves)
            return torch.nn.functional.scaled_dot_product_attention(*nested, **kwargs).transpose(1, 2).values()

        leaves = [t[0].detach().requires_grad_(True) for t in (q, k, v)]
        return _autograd_bwd(forward, leaves, dout[0], lambda g: g.unsqueeze(0))


@functools.cache
def _compiled_flex():
    """torch.compile(flex_attention), made once. It recompiles for every new shape: lift dynamo's limits."""
    from torch.nn.attention.flex_attention import flex_attention  # imports torch._dynamo (~1.5 s): only with --flex

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 1024)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 1024)
    return torch.compile(flex_attention, dynamic=False)


class FlexBackend(Backend):
    key = "flex"
    bhsd = True

    def refuse(self, shape, mode):
        if self.cfg.dtype == "fp8":
            return SKIPPED, "FlexAttention has no fp8 path"
        if shape.has_window() or shape.softcap:
            return SKIPPED, ("--window / --softcap are not wired into this benchmark's FlexAttention (its block mask "
                             "and score_mod)")
        if shape.is_varlen():
            return SKIPPED, "--varlen is not wired into this benchmark's FlexAttention (a document mask)"
        return None

    def prepare(self, shape, scale, device):
        if not shape.causal:
            return None
        from torch.nn.attention.flex_attention import create_block_mask

        offset = shape.seqlen_k - shape.seqlen_q  # bottom-right: query i sees keys j <= i + offset

        def causal_bottom_right(b, h, q_idx, kv_idx):
            return q_idx + offset >= kv_idx

        return create_block_mask(causal_bottom_right, None, None, shape.seqlen_q, shape.seqlen_k, device=device)

    def call(self, q, k, v, shape, scale, state):
        return _compiled_flex()(q, k, v, block_mask=state, scale=scale, enable_gqa=shape.nheads != shape.nheads_kv)


BACKENDS = {
    b.key: b
    for b in (FlashExtBackend, FlashExtNoWindowBackend, FlashExtNoSoftcapBackend, FlashExtDenseBackend,
              FlashExtBf16Backend, FA3Backend, SDPACudnn, SDPAFlash, SDPAEfficient, SDPAMath, SDPANested, FlexBackend)
}


def make_backends(keys, cfg):
    return [BACKENDS[k](cfg) for k in keys]
