"""Benchmark flash_ext against PyTorch's attention backends (and FlashAttention-3 when installed).

    python -m flash_ext.benchmark                 # the default grid (36 shapes), bf16, forward
    python -m flash_ext.benchmark --quick         # d128 x {1k, 8k} x both masks, well under a minute
    python -m flash_ext.benchmark --dry-run       # print the grid and exit (no GPU needed)

See benchmarks/README.md for every option, the columns and the FLOP convention. The pure parts
(FLOPs, records, table, JSON, plot, verdicts) live in flash_ext/_bench_report.py.
"""
import argparse
import contextlib
import dataclasses
import datetime
import gc
import importlib.util
import math
import os
import platform
import subprocess
import sys
import time
import warnings

import torch

from . import _bench_report as rep
from ._bench_report import (  # noqa: F401  (re-exported for tests and users)
    ERROR,
    NA,
    OK,
    OOM,
    SKIPPED,
    WRONG,
    Record,
    Shape,
    attention_flops,
    best_sdpa,
    causal_pairs,
    format_table,
    ratio_to,
    tflops,
    tolerance,
    verdict,
    write_json,
    write_plot,
)

DEFAULT_HEADDIMS = (64, 128, 256)
DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_HEADDIMS = (128,)
QUICK_SEQLENS = (1024, 8192)
DEFAULT_TOKENS = 16384  # batch * seqlen
DEFAULT_HIDDEN = 2048  # nheads * headdim
DEFAULT_BACKENDS = ("flash_ext", "fa3", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math")
ALL_BACKENDS = DEFAULT_BACKENDS + ("flex",)
DTYPE_NAMES = ("bf16", "fp16", "fp8")
# Reference slice: batch 0, the first REF_HEADS query heads, and all query rows unless the slice's score
# matrix would exceed REF_MAX_ELEMS elements (then the last rows: a tail of queries with all keys is
# itself a bottom-right-aligned causal problem, so the mask stays exact).
REF_HEADS = 2
REF_MAX_ELEMS = 1 << 29


def _torch_dtype(name):
    if name == "bf16":
        return torch.bfloat16
    if name == "fp16":
        return torch.float16
    if name == "fp8":
        return torch.float8_e4m3fn
    raise ValueError(f"unknown dtype {name!r}; expected one of {DTYPE_NAMES}")


# =============================================================================================
# Command line and grid (pure)
# =============================================================================================
def parse_int_list(text):
    """'512,1k,8192' -> [512, 1024, 8192]; a 'k' suffix means x1024."""
    out = []
    for item in str(text).split(","):
        item = item.strip().lower()
        if not item:
            continue
        try:
            n = int(item[:-1]) * 1024 if item.endswith("k") else int(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not an integer (a 'k' suffix means x1024)") from None
        if n <= 0:
            raise argparse.ArgumentTypeError(f"{item!r} must be positive")
        out.append(n)
    if not out:
        raise argparse.ArgumentTypeError(f"empty list {text!r}")
    return out


def _positive_int(text):
    (n,) = parse_int_list(text)
    return n


def _name_list(text):
    names = [t.strip() for t in str(text).split(",") if t.strip()]
    bad = [n for n in names if n not in ALL_BACKENDS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown backend(s) {bad}; known: {','.join(ALL_BACKENDS)}")
    return names


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m flash_ext.benchmark",
        description="Time flash_ext against SDPA (flash, cuDNN, memory-efficient, math), FlexAttention and "
        "FlashAttention-3 on one grid of shapes; print a table, write JSON and a PNG plot.",
    )
    g = p.add_argument_group("what to run")
    g.add_argument(
        "--mode",
        choices=("fwd", "bwd", "both", "auto"),
        default="auto",
        help="forward, backward or both; auto (default) = both once flash_ext has a backward, else fwd",
    )
    g.add_argument("--dtype", choices=DTYPE_NAMES, default="bf16", help="input dtype (default bf16)")
    g.add_argument("--quick", action="store_true", help="small grid: d128 x {1k, 8k} x both masks (< 1 minute)")
    g.add_argument(
        "--backends",
        type=_name_list,
        default=None,
        help=f"comma list from {','.join(ALL_BACKENDS)} (default: all but flex; fa3 only when importable)",
    )
    g.add_argument("--flex", action="store_true", help="add FlexAttention (torch.compile; compiles once per shape)")
    s = p.add_argument_group("shapes (default grid: d {64,128,256} x s {512..16k} x both masks, b*s = 16k, h*d = 2048)")
    s.add_argument("--headdims", type=parse_int_list, default=None, help="comma list of head dims, e.g. 64,128")
    s.add_argument("--seqlens", type=parse_int_list, default=None, help="comma list of seqlens, e.g. 512,8k")
    s.add_argument("--causal", choices=("both", "yes", "no"), default="both", help="masks to run (default both)")
    s.add_argument("--batch", type=_positive_int, default=None, help="batch (default: --tokens // seqlen_q)")
    s.add_argument("--seqlen-q", type=_positive_int, default=None, help="one query length (overrides --seqlens)")
    s.add_argument("--seqlen-k", type=_positive_int, default=None, help="key length (default: = seqlen_q)")
    s.add_argument("--nheads", type=_positive_int, default=None, help="query heads (default: --hidden // headdim)")
    s.add_argument("--nheads-kv", type=_positive_int, default=None, help="key/value heads, GQA/MQA (default: nheads)")
    s.add_argument("--headdim", type=_positive_int, default=None, help="one head dim (overrides --headdims)")
    s.add_argument("--tokens", type=_positive_int, default=DEFAULT_TOKENS, help="batch * seqlen (default 16384)")
    s.add_argument("--hidden", type=_positive_int, default=DEFAULT_HIDDEN, help="nheads * headdim (default 2048)")
    t = p.add_argument_group("timing and checks")
    t.add_argument("--warmup-ms", type=float, default=25.0, help="do_bench warm-up time in ms (default 25)")
    t.add_argument("--repeat-ms", type=float, default=100.0, help="do_bench measuring time in ms (default 100)")
    t.add_argument(
        "--math-max-gb",
        type=float,
        default=2.0,
        help="skip SDPA math when its b*h*sq*sk*4-byte score matrix exceeds this many GiB (default 2)",
    )
    t.add_argument("--input-scale", type=float, default=1.0, help="inputs are randn * this (default 1.0)")
    t.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    o = p.add_argument_group("output")
    o.add_argument("--out", default="bench_out", help="output folder (default ./bench_out)")
    o.add_argument("--name", default="bench", help="file stem: NAME.json, NAME.txt, NAME_fwd.png (default bench)")
    o.add_argument("--no-plot", action="store_true", help="do not write the PNG plot")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    o.add_argument("--dry-run", action="store_true", help="print the grid and backends, then exit (no GPU needed)")
    o.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: a smoke test of the harness itself (CPU wall-clock timings, meaningless as numbers)",
    )
    return p


def build_grid(args):
    """The list of Shapes to run, in table order (head dim, then mask, then seqlen). Raises ValueError."""
    headdims = [args.headdim] if args.headdim else (args.headdims or list(QUICK_HEADDIMS if args.quick else DEFAULT_HEADDIMS))
    seqlens = [args.seqlen_q] if args.seqlen_q else (args.seqlens or list(QUICK_SEQLENS if args.quick else DEFAULT_SEQLENS))
    causals = {"both": (False, True), "no": (False,), "yes": (True,)}[args.causal]
    shapes = []
    for d in dict.fromkeys(headdims):
        nheads = args.nheads or max(1, args.hidden // d)
        nheads_kv = args.nheads_kv or nheads
        if nheads_kv > nheads or nheads % nheads_kv != 0:
            raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_kv ({nheads_kv}) (head dim {d})")
        for causal in causals:
            for sq in dict.fromkeys(seqlens):
                sk = args.seqlen_k or sq
                batch = args.batch or max(1, args.tokens // sq)
                shapes.append(Shape(batch, sq, sk, nheads, nheads_kv, d, causal))
    return shapes


def flash_ext_has_backward():
    import flash_ext

    return hasattr(flash_ext, "backward")


def resolve_modes(mode):
    if mode == "auto":
        mode = "both" if flash_ext_has_backward() else "fwd"
    return {"fwd": ["fwd"], "bwd": ["bwd"], "both": ["fwd", "bwd"]}[mode]


def fa3_importable():
    try:
        return importlib.util.find_spec("flash_attn_interface") is not None
    except (ImportError, ValueError):
        return False


def select_backends(args):
    """Backend keys to run, in table order. FA3 joins the default set only when it is importable."""
    if args.backends:
        keys = list(args.backends)
    else:
        keys = [k for k in DEFAULT_BACKENDS if k != "fa3" or fa3_importable()]
    if args.flex and "flex" not in keys:
        keys.append("flex")
    return rep.order_backends(keys)


def config_dict(args, shapes, modes, backend_keys):
    cfg = {k: v for k, v in vars(args).items()}
    cfg.update(
        {
            "modes": list(modes),
            "backends": list(backend_keys),
            "num_shapes": len(shapes),
            "shapes": [s.to_dict() for s in shapes],
            "timer": "triton.testing.do_bench(return_mode='median')",
            "reference_slice": f"batch 0, first {REF_HEADS} query heads, all rows up to {REF_MAX_ELEMS} score "
            "elements (else the last rows)",
        }
    )
    return cfg


def format_dry_run(shapes, modes, backend_keys, args):
    lines = [
        f"flash_ext benchmark (dry run): modes {'+'.join(modes)}, dtype {args.dtype}, {len(shapes)} shape(s), "
        f"backends {', '.join(rep.backend_name(k) for k in backend_keys)}",
        f"timing: do_bench warmup {args.warmup_ms:g} ms, rep {args.repeat_ms:g} ms, median; output folder {args.out}",
        f"{'#':>3}  {'shape':<24} {'batch':>5} {'seqlen_q':>8} {'seqlen_k':>8} {'nheads':>6} {'nheads_kv':>9} "
        f"{'headdim':>7} {'causal':>6} " + " ".join(f"{'GFLOP ' + m:>11}" for m in modes),
    ]
    for i, s in enumerate(shapes, 1):
        fl = " ".join(f"{attention_flops(s, m) / 1e9:>11.1f}" for m in modes)
        lines.append(
            f"{i:>3}  {s.label():<24} {s.batch:>5} {s.seqlen_q:>8} {s.seqlen_k:>8} {s.nheads:>6} {s.nheads_kv:>9} "
            f"{s.headdim:>7} {str(s.causal):>6} {fl}"
        )
    return "\n".join(lines)


# =============================================================================================
# Backends (GPU side; each one small). A backend gives the runner two closures built OUTSIDE the
# timed region: fn() launches exactly the timed work, post(result) turns the result into
# (batch, seqlen, nheads, headdim) tensors for the check.
# =============================================================================================
def _bshd_to_bhsd(t):
    return t.transpose(1, 2)


def _identity(t):
    return t


class Backend:
    key = "?"
    to_native = staticmethod(_identity)  # (b, s, h, d) -> the layout the backend wants (a view)
    from_native = staticmethod(_identity)

    def __init__(self, cfg):
        self.cfg = cfg
        self._unavailable = False  # not yet checked

    def unavailable_reason(self):
        """Why this backend cannot run at all in this process (cached), or None."""
        if self._unavailable is False:
            self._unavailable = self._check_available()
        return self._unavailable

    def _check_available(self):
        return None

    def refuse(self, shape, mode):
        """(status, reason) when this backend does not run this shape/mode, known without running; else None."""
        return None

    def context(self):
        return contextlib.nullcontext()

    # -- the op itself -------------------------------------------------------------------------
    def prepare(self, shape, scale, device):
        """Per-shape state built outside the timed region (masks...)."""
        return None

    def call(self, q, k, v, shape, scale, state):
        raise NotImplementedError

    def make_fwd(self, q, k, v, shape, scale):
        qn, kn, vn = self.to_native(q), self.to_native(k), self.to_native(v)
        state = self.prepare(shape, scale, q.device)

        def fn():
            return self.call(qn, kn, vn, shape, scale, state)

        def post(res):
            out = res[0] if isinstance(res, (tuple, list)) else res
            return self.from_native(out)

        return fn, post

    def make_bwd(self, q, k, v, dout, shape, scale):
        """Autograd: one forward with grad here, then fn() = torch.autograd.grad(out, (q, k, v), dout)."""
        leaves = [self.to_native(t).detach().requires_grad_(True) for t in (q, k, v)]
        state = self.prepare(shape, scale, q.device)
        res = self.call(*leaves, shape, scale, state)
        out = res[0] if isinstance(res, (tuple, list)) else res
        grad = torch.empty_like(out)
        grad.copy_(self.to_native(dout))
        del res

        def fn():
            return torch.autograd.grad(out, leaves, grad, retain_graph=True)

        def post(grads):
            return tuple(self.from_native(g) for g in grads)

        return fn, post


def flash_ext_dtypes():
    """The dtypes flash_ext advertises (public SUPPORTED_DTYPES if it grows one, else the interface's)."""
    import flash_ext

    for holder in (flash_ext, getattr(flash_ext, "interface", None)):
        for name in ("SUPPORTED_DTYPES", "_SUPPORTED_DTYPES"):
            dtypes = getattr(holder, name, None)
            if dtypes is not None:
                return tuple(dtypes)
    return (torch.float16, torch.bfloat16)


class FlashExtBackend(Backend):
    key = "flash_ext"

    def _check_available(self):
        import flash_ext

        if not flash_ext.extension_available():
            err = getattr(flash_ext.interface, "_ext_error", None)
            return f"extension not built / not loadable ({type(err).__name__ if err else 'ImportError'}: {err})"
        return None

    def refuse(self, shape, mode):
        if _torch_dtype(self.cfg.dtype) not in flash_ext_dtypes():
            return SKIPPED, f"{self.cfg.dtype} not supported by flash_ext yet"
        if mode == "bwd" and not flash_ext_has_backward():
            return NA, "no backward yet"
        return None

    def make_fwd(self, q, k, v, shape, scale):
        import flash_ext

        causal = shape.causal

        def fn():
            return flash_ext.forward(q, k, v, softmax_scale=scale, causal=causal)

        def post(res):
            return res[0]

        return fn, post

    def make_bwd(self, q, k, v, dout, shape, scale):
        # Assumed API (FlashAttention's convention): backward(dout, q, k, v, out, lse, softmax_scale, causal)
        # -> (dq, dk, dv, ...). Check against the real signature once flash_ext has one.
        import flash_ext

        causal = shape.causal
        out, lse = flash_ext.forward(q, k, v, softmax_scale=scale, causal=causal)

        def fn():
            return flash_ext.backward(dout, q, k, v, out, lse, softmax_scale=scale, causal=causal)

        def post(res):
            return tuple(res[:3])

        return fn, post


class FA3Backend(Backend):
    key = "fa3"

    def _check_available(self):
        try:
            import flash_attn_interface  # noqa: F401
        except Exception as e:
            return f"flash_attn_interface not importable ({type(e).__name__}: {e})"
        return None

    def refuse(self, shape, mode):
        if self.cfg.dtype == "fp8" and mode == "bwd":
            return NA, "FA3 has no fp8 backward"
        return None

    def call(self, q, k, v, shape, scale, state):
        import flash_attn_interface

        return flash_attn_interface.flash_attn_func(q, k, v, softmax_scale=scale, causal=shape.causal)


class SDPABackend(Backend):
    to_native = staticmethod(_bshd_to_bhsd)  # SDPA wants (b, h, s, d): a transposed view, no copy
    from_native = staticmethod(_bshd_to_bhsd)
    sdp_backend_name = None  # name in torch.nn.attention.SDPBackend
    native_lower_right = False  # True: pass causal_lower_right(sq, sk) (flash/efficient handle it natively)

    def _check_available(self):
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
        except Exception as e:
            return f"torch.nn.attention.sdpa_kernel not available ({e})"
        if not hasattr(SDPBackend, self.sdp_backend_name):
            return f"SDPBackend.{self.sdp_backend_name} not in this torch"
        return None

    def refuse(self, shape, mode):
        if self.cfg.dtype == "fp8":
            return SKIPPED, "SDPA has no fp8 attention"
        return None

    def context(self):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(getattr(SDPBackend, self.sdp_backend_name))

    def prepare(self, shape, scale, device):
        kwargs = {"scale": scale}
        if shape.nheads != shape.nheads_kv:
            kwargs["enable_gqa"] = True
        sq, sk = shape.seqlen_q, shape.seqlen_k
        if shape.causal and sq != sk:
            # SDPA's is_causal is top-left aligned; flash_ext's causal is bottom-right. Same thing when sq == sk.
            if self.native_lower_right:
                from torch.nn.attention.bias import causal_lower_right

                kwargs["attn_mask"] = causal_lower_right(sq, sk)
            else:  # an explicit boolean mask, built here rather than inside the timed call
                kwargs["attn_mask"] = torch.ones(sq, sk, dtype=torch.bool, device=device).tril(diagonal=sk - sq)
        else:
            kwargs["is_causal"] = shape.causal
        return kwargs

    def call(self, q, k, v, shape, scale, state):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, **state)


class SDPAFlash(SDPABackend):
    key = "sdpa_flash"
    sdp_backend_name = "FLASH_ATTENTION"
    native_lower_right = True


class SDPACudnn(SDPABackend):
    key = "sdpa_cudnn"
    sdp_backend_name = "CUDNN_ATTENTION"


class SDPAEfficient(SDPABackend):
    key = "sdpa_efficient"
    sdp_backend_name = "EFFICIENT_ATTENTION"
    native_lower_right = True


class SDPAMath(SDPABackend):
    key = "sdpa_math"
    sdp_backend_name = "MATH"

    def refuse(self, shape, mode):
        r = super().refuse(shape, mode)
        if r:
            return r
        nbytes = shape.batch * shape.nheads * shape.seqlen_q * shape.seqlen_k * 4
        limit = self.cfg.math_max_gb * 2**30
        if nbytes > limit:
            return SKIPPED, (
                f"too large: its b*h*sq*sk fp32 scores need {nbytes / 2**30:.1f} GiB > "
                f"{self.cfg.math_max_gb:g} GiB (--math-max-gb)"
            )
        return None


_FLEX = {}


def _flex_compiled():
    """torch.compile(flex_attention), made once; recompiles once per shape, so the recompile limit is raised."""
    if "fn" not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        try:
            import torch._dynamo.config as dcfg

            for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
                if hasattr(dcfg, name):
                    setattr(dcfg, name, max(int(getattr(dcfg, name)), 1024))
        except Exception:
            pass
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


class FlexBackend(Backend):
    key = "flex"
    to_native = staticmethod(_bshd_to_bhsd)
    from_native = staticmethod(_bshd_to_bhsd)

    def _check_available(self):
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
        except Exception as e:
            return f"torch.nn.attention.flex_attention not available ({e})"
        return None

    def refuse(self, shape, mode):
        if self.cfg.dtype == "fp8":
            return SKIPPED, "FlexAttention has no fp8 path"
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
        kwargs = {"block_mask": state, "scale": scale}
        if shape.nheads != shape.nheads_kv:
            kwargs["enable_gqa"] = True
        return _flex_compiled()(q, k, v, **kwargs)


BACKEND_CLASSES = {
    "flash_ext": FlashExtBackend,
    "fa3": FA3Backend,
    "sdpa_cudnn": SDPACudnn,
    "sdpa_flash": SDPAFlash,
    "sdpa_efficient": SDPAEfficient,
    "sdpa_math": SDPAMath,
    "flex": FlexBackend,
}


@dataclasses.dataclass
class RunConfig:
    dtype: str = "bf16"
    input_scale: float = 1.0
    seed: int = 0
    math_max_gb: float = 2.0


def make_backends(keys, cfg):
    return [BACKEND_CLASSES[k](cfg) for k in keys]


# =============================================================================================
# The float64 reference on a slice, and the error baseline
# =============================================================================================
@dataclasses.dataclass
class SliceRef:
    rows: slice  # query rows checked (all, or the last ones)
    hq: int  # query heads checked: 0 .. hq-1 of batch 0
    hkv: int  # kv heads they read: 0 .. hkv-1
    out: torch.Tensor = None  # float64 (1, rows, hq, d)
    tol_out: float = None
    math_err_out: float = None
    grads: dict = None  # name -> float64 reference gradient slice
    tol_grads: dict = None
    math_err_grads: dict = None
    note: str = ""

    def q_slice(self, t):
        return t[0:1, self.rows, : self.hq]

    def kv_slice(self, t):
        return t[0:1, :, : self.hkv]


def _max_abs_err(x, ref):
    """max |x - ref| in float64; NaN when x has NaN/inf (torch.max propagates NaN)."""
    x = x.to(torch.float64)
    if not bool(torch.isfinite(x).all()):
        return float("nan")
    if x.numel() == 0:
        return 0.0
    return float((x - ref).abs().max().item())


def _keep_mask(rows, sk, device):
    """Bottom-right causal keep-mask for a problem of `rows` queries (the tail of the full problem) and sk keys."""
    return torch.ones(rows, sk, dtype=torch.bool, device=device).tril(diagonal=sk - rows)


def _attention_autograd(q, k, v, scale, causal, compute_dtype):
    """Differentiable attention, (b, s, h, d), GQA by repeat. compute_dtype float64: the gradient reference;
    the input dtype: PyTorch-style low precision (matmuls in the dtype, softmax in fp32), the error baseline.
    Fully masked rows give 0 (finite fill + row mask), never NaN."""
    group = q.shape[2] // k.shape[2]
    if group > 1:
        k = k.repeat_interleave(group, dim=2)
        v = v.repeat_interleave(group, dim=2)
    qh, kh, vh = (t.to(compute_dtype).transpose(1, 2) for t in (q, k, v))
    scores = torch.matmul(qh * scale, kh.transpose(-1, -2))
    soft_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
    scores = scores.to(soft_dtype)
    if causal:
        keep = _keep_mask(q.shape[1], k.shape[1], q.device)
        scores = scores.masked_fill(~keep, -1e30)
        probs = torch.softmax(scores, dim=-1) * keep.any(dim=-1, keepdim=True).to(soft_dtype)
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.to(compute_dtype), vh)
    return out.transpose(1, 2)


def build_reference(q, k, v, dout, shape, scale, dtype_name, need_bwd):
    """Float64 reference (and the low-precision error baseline) on batch 0, the first REF_HEADS heads."""
    from .reference import attention_ref

    try:
        from .reference import attention_lowp
    except ImportError:
        attention_lowp = None
    h, hkv, sq, sk = shape.nheads, shape.nheads_kv, shape.seqlen_q, shape.seqlen_k
    hq = min(REF_HEADS, h)
    group = h // hkv
    hkv_s = hq if group == 1 else 1  # with group >= 2 the first hq (<= 2) query heads all read kv head 0
    nrows = sq if hq * sq * sk <= REF_MAX_ELEMS else max(1, REF_MAX_ELEMS // (hq * sk))
    ref = SliceRef(rows=slice(sq - nrows, sq), hq=hq, hkv=hkv_s)
    if nrows < sq:
        ref.note = f"checked the last {nrows} of {sq} query rows"
    work = torch.bfloat16 if dtype_name == "fp8" else q.dtype  # fp8 values are exact in bf16
    qs = ref.q_slice(q).to(work).contiguous()
    ks = ref.kv_slice(k).to(work).contiguous()
    vs = ref.kv_slice(v).to(work).contiguous()
    ref.out = attention_ref(qs, ks, vs, softmax_scale=scale, causal=shape.causal)[0].to(torch.float64)
    if attention_lowp is not None:
        low = attention_lowp(qs, ks, vs, softmax_scale=scale, causal=shape.causal)
    else:
        with torch.no_grad():
            low = _attention_autograd(qs, ks, vs, scale, shape.causal, work)
    ref.math_err_out = _max_abs_err(low, ref.out)
    del low
    ref.tol_out = tolerance(dtype_name, ref.math_err_out, float(ref.out.abs().max().item()) if ref.out.numel() else 1.0)
    if need_bwd:
        dos = ref.q_slice(dout).to(work).contiguous()
        names = ["dq"]
        if group == 1 and nrows == sq:  # dk/dv of a kv head depend on every query row of every head reading it
            names += ["dk", "dv"]
        leaves = [t.detach().to(torch.float64).requires_grad_(True) for t in (qs, ks, vs)]
        o64 = _attention_autograd(*leaves, scale, shape.causal, torch.float64)
        g64 = dict(zip(("dq", "dk", "dv"), torch.autograd.grad(o64, leaves, dos.to(torch.float64))))
        del o64, leaves
        lleaves = [t.detach().clone().requires_grad_(True) for t in (qs, ks, vs)]
        olow = _attention_autograd(*lleaves, scale, shape.causal, work)
        glow = dict(zip(("dq", "dk", "dv"), torch.autograd.grad(olow, lleaves, dos)))
        del olow, lleaves
        ref.grads = {n: g64[n] for n in names}
        ref.math_err_grads = {n: _max_abs_err(glow[n], g64[n]) for n in names}
        ref.tol_grads = {
            n: tolerance(dtype_name, ref.math_err_grads[n], float(g64[n].abs().max().item()) if g64[n].numel() else 1.0)
            for n in names
        }
        del g64, glow
    return ref


def check_result(mode, outs, ref):
    """(max_err, tol, detail, comparable slice) of a backend's result against the reference slice."""
    if mode == "fwd":
        got = ref.q_slice(outs)
        err = _max_abs_err(got, ref.out)
        return err, ref.tol_out, None, got.float()
    dq, dk, dv = outs[:3]
    got = {"dq": ref.q_slice(dq), "dk": ref.kv_slice(dk), "dv": ref.kv_slice(dv)}
    detail = {}
    worst = (None, None, -1.0)
    for name, g in ref.grads.items():
        err = _max_abs_err(got[name], g)
        tol = ref.tol_grads[name]
        detail[name] = [err, tol]
        score = math.inf if not math.isfinite(err) else err / tol
        if score > worst[2]:
            worst = (err, tol, score)
    return worst[0], worst[1], detail, got["dq"].float()


# =============================================================================================
# Running (device-agnostic: the CPU tests drive it with a CPU timer)
# =============================================================================================
_FATAL_MARKERS = (
    "illegal memory access",
    "unspecified launch failure",
    "device-side assert",
    "misaligned address",
    "illegal instruction",
    "an illegal",
    "CUDA error: unknown error",
)


class FatalDeviceError(RuntimeError):
    """A sticky CUDA error: the context is unusable, so the run stops (results so far are still written)."""


def _is_fatal(exc):
    text = str(exc)
    return any(m in text for m in _FATAL_MARKERS)


_NOISE_WARNINGS = (
    "not used because",  # SDPA's header line; the specific reasons follow it
    "flex_attention called without",
    "Lower right causal bias will produce NaNs",  # raised by CausalBias itself, not a refusal reason
)


def _describe(exc, caught=()):
    """A one-line reason from an exception and the warnings SDPA emitted while refusing."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    msgs = []
    for w in caught or ():
        m = " ".join(str(w.message).split())
        if m and m not in msgs and not any(s in m for s in _NOISE_WARNINGS):
            msgs.append(m)
    generic = ("No available kernel" in text) or ("No viable backend" in text)
    if msgs and generic:
        return "refused: " + "; ".join(msgs[:3])
    name = type(exc).__name__
    return f"{name}: {text}" if text else name


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device):
    gc.collect()
    if device.type == "cuda":
        try:
            torch.cuda.empty_cache()
        except Exception:  # after a sticky CUDA error this raises again; the run is stopping anyway
            pass


def cuda_peak_mib(fn, device):
    """Peak memory one call of fn allocates above what is allocated before it (inputs, outputs kept...), MiB."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    res = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del res
    return max(0, peak - base) / 2**20


def make_do_bench_timer(warmup_ms, rep_ms):
    """fn -> median ms, with triton.testing.do_bench (device events, L2 flushed before every call).

    Without triton, a plain CUDA-event loop (same warm-up/measure budget, no L2 flush) stands in."""
    try:
        from triton.testing import do_bench
    except Exception as e:
        print(f"warning: triton.testing.do_bench unavailable ({e}); timing with CUDA events", file=sys.stderr)
        return lambda fn: cuda_event_timer(fn, warmup_ms, rep_ms)

    def timer(fn):
        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))

    return timer


def cuda_event_timer(fn, warmup_ms, rep_ms):
    """Median ms of fn over about rep_ms of calls, after about warmup_ms of warm-up (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(3):
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end) / 3, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate))):
        fn()
    n = max(1, int(rep_ms / estimate))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for s, e in events:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in events)
    return times[len(times) // 2]


def cpu_timer(fn, reps=3):
    """A stand-in timer for CPU tests: median wall time of a few calls, ms."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def make_inputs(shape, dtype, device, scale, seed, need_dout):
    """q, k, v (and dout) in (b, s, h, d): randn * scale (never zeros), identical for every backend."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    work = torch.bfloat16 if dtype == torch.float8_e4m3fn else dtype

    def rnd(*size):
        t = torch.randn(*size, generator=gen, device=device, dtype=work)
        if scale != 1.0:
            t.mul_(scale)
        return t.to(dtype) if dtype != work else t

    b, sq, sk, h, hkv, d = shape.batch, shape.seqlen_q, shape.seqlen_k, shape.nheads, shape.nheads_kv, shape.headdim
    q, k, v = rnd(b, sq, h, d), rnd(b, sk, hkv, d), rnd(b, sk, hkv, d)
    dout = rnd(b, sq, h, d).to(work) if need_dout else None  # gradients arrive in 16 bits even for fp8
    return q, k, v, dout


def run_backend(backend, mode, q, k, v, dout, shape, scale, ref, device, timer, peak_fn, ext):
    """One backend, one mode, one shape -> Record. Never raises, except FatalDeviceError.

    ext: a dict shared by the backends of one shape and mode; flash_ext (which runs first) leaves its
    checked slice under "slice", and the others report their max difference from it."""
    rec = Record(shape=shape, mode=mode, backend=backend.key, flops=attention_flops(shape, mode))
    why = backend.unavailable_reason()
    if why:
        rec.status, rec.reason = SKIPPED, why
        return rec
    refusal = backend.refuse(shape, mode)
    if refusal:
        rec.status, rec.reason = refusal
        return rec
    fn = post = res = outs = None
    fatal = None
    oom = False
    try:
        with backend.context():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    if mode == "fwd":
                        fn, post = backend.make_fwd(q, k, v, shape, scale)
                    else:
                        fn, post = backend.make_bwd(q, k, v, dout, shape, scale)
                    res = fn()  # first call: compiles / autotunes where the backend does; not timed
                    _sync(device)
                except torch.OutOfMemoryError:
                    raise
                except Exception as e:
                    if _is_fatal(e):
                        raise
                    rec.status, rec.reason = SKIPPED, _describe(e, caught)
                    return rec
            outs = post(res)
            res = None
            if ref is not None:
                err, tol, detail, got = check_result(mode, outs, ref)
                rec.max_err, rec.tol, rec.err_detail, rec.checked = err, tol, detail, True
                if backend.key == "flash_ext":
                    ext["slice"] = got
                elif ext.get("slice") is not None:
                    rec.diff_vs_flash_ext = _max_abs_err(got, ext["slice"].to(torch.float64))
                ok, why = verdict(err, tol)
                if not ok:
                    rec.status, rec.reason = WRONG, why
                    return rec
                if ref.note:
                    rec.note = ref.note
            outs = None
            rec.peak_mib = peak_fn(fn) if peak_fn else None
            rec.ms = timer(fn)
            rec.tflops = tflops(rec.flops, rec.ms)
            rec.status = OK
    except torch.OutOfMemoryError as e:
        rec.status, rec.reason = OOM, _describe(e)
        oom = True
    except Exception as e:
        rec.status, rec.reason = ERROR, _describe(e)
        if _is_fatal(e):
            fatal = rec.reason
    finally:
        fn = post = res = outs = None
        if oom:
            _free(device)
    if fatal:
        raise FatalDeviceError(fatal)
    return rec


class Progress:
    """A small progress bar on stderr: shape i/N, mode, current backend, elapsed and ETA.

    On a terminal it redraws one line; otherwise (logs) it prints one line per finished shape."""

    def __init__(self, total_steps, num_shapes, stream=None, enabled=True):
        self.total = max(1, total_steps)
        self.num_shapes = num_shapes
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.monotonic()
        self._width = 0

    @staticmethod
    def fmt_time(s):
        if s is None or not math.isfinite(s):
            return "--:--"
        s = int(round(s))
        return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"

    def _eta(self):
        elapsed = time.monotonic() - self.t0
        eta = elapsed / self.done * (self.total - self.done) if self.done else None
        return elapsed, eta

    def show(self, shape_idx, shape, mode, backend_key):
        if not (self.enabled and self.tty):
            return
        elapsed, eta = self._eta()
        n = 20
        filled = int(n * self.done / self.total)
        line = (
            f"[{'#' * filled}{'.' * (n - filled)}] shape {shape_idx}/{self.num_shapes} {shape.label()} {mode} | "
            f"{rep.backend_name(backend_key)} | {self.fmt_time(elapsed)} elapsed, ETA {self.fmt_time(eta)}"
        )
        pad = max(0, self._width - len(line))
        self.stream.write("\r" + line + " " * pad)
        self.stream.flush()
        self._width = len(line)

    def step(self):
        self.done += 1

    def shape_done(self, shape_idx, shape, mode, recs):
        if not self.enabled or self.tty:
            return
        elapsed, eta = self._eta()
        cells = []
        for r in recs:
            cells.append(f"{rep.backend_name(r.backend)} {r.tflops:.0f}" if r.status == OK and r.tflops else f"{rep.backend_name(r.backend)} {r.status}")
        self.stream.write(
            f"[{shape_idx}/{self.num_shapes}] {shape.label()} {mode}: {', '.join(cells)} "
            f"({self.fmt_time(elapsed)} elapsed, ETA {self.fmt_time(eta)})\n"
        )
        self.stream.flush()

    def close(self):
        if self.enabled and self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()
            self._width = 0


def run_shape(shape, shape_idx, modes, backends, cfg, device, timer, peak_fn, progress):
    """All modes and backends on one shape. Returns the records; raises FatalDeviceError (with .records)."""
    records = []
    dtype = _torch_dtype(cfg.dtype)
    scale = 1.0 / math.sqrt(shape.headdim)
    need_bwd = "bwd" in modes
    q = k = v = dout = ref = None
    try:
        try:
            q, k, v, dout = make_inputs(shape, dtype, device, cfg.input_scale, cfg.seed + shape_idx, need_bwd)
        except torch.OutOfMemoryError as e:
            reason = f"inputs do not fit: {_describe(e)}"
            for mode in modes:
                for be in backends:
                    records.append(Record(shape, mode, be.key, status=OOM, reason=reason, flops=attention_flops(shape, mode)))
                    progress.step()
            return records
        ref_note = None
        try:
            ref = build_reference(q, k, v, dout, shape, scale, cfg.dtype, need_bwd)
        except Exception as e:  # OOM or anything else: time without the check, and say so
            if _is_fatal(e):
                raise FatalDeviceError(_describe(e))
            ref, ref_note = None, f"unchecked: the reference failed ({_describe(e)})"
            _free(device)
        for mode in modes:
            mode_recs = []
            ext = {}
            for be in backends:
                progress.show(shape_idx, shape, mode, be.key)
                try:
                    rec = run_backend(be, mode, q, k, v, dout, shape, scale, ref, device, timer, peak_fn, ext)
                except FatalDeviceError as e:
                    rec = Record(shape, mode, be.key, status=ERROR, reason=str(e), flops=attention_flops(shape, mode))
                    mode_recs.append(rec)
                    records.extend(mode_recs)
                    e.records = records
                    raise
                if ref_note and rec.status == OK:
                    rec.note = ref_note
                mode_recs.append(rec)
                progress.step()
            progress.shape_done(shape_idx, shape, mode, mode_recs)
            records.extend(mode_recs)
        return records
    finally:
        q = k = v = dout = ref = None
        _free(device)


def run_benchmark(shapes, modes, backends, cfg, device, timer, peak_fn=None, progress=None, records=None):
    """Every shape; returns (records, fatal reason or None). Stops early only on a sticky device error.

    Records are appended to `records` (when given) as each shape finishes, so a caller that is
    interrupted still holds the shapes done so far."""
    if progress is None:
        progress = Progress(len(shapes) * len(modes) * len(backends), len(shapes), enabled=False)
    if records is None:
        records = []
    fatal = None
    for i, shape in enumerate(shapes, 1):
        try:
            records.extend(run_shape(shape, i, modes, backends, cfg, device, timer, peak_fn, progress))
        except FatalDeviceError as e:
            records.extend(getattr(e, "records", []))
            fatal = str(e)
            break
    progress.close()
    return records, fatal


# =============================================================================================
# Environment
# =============================================================================================
def _run_cmd(cmd, cwd=None):
    try:
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def _nvidia_smi(index=0):
    text = _run_cmd(
        ["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.max.sm", "--format=csv,noheader,nounits"]
    )
    if not text:
        return {}
    lines = [ln for ln in text.splitlines() if ln.strip()]
    line = lines[index] if index < len(lines) else lines[0]
    parts = [p.strip() for p in line.split(",")]
    if len(parts) < 4:
        return {}

    def num(x):
        try:
            return int(float(x))
        except ValueError:
            return None

    return {"name": parts[0], "driver_version": parts[1], "sm_clock_mhz": num(parts[2]), "sm_clock_max_mhz": num(parts[3])}


def collect_env(device=None):
    """GPU, clocks, driver, CUDA/torch/cuDNN/triton versions, flash_ext build and git commit; None when unknown."""
    import flash_ext

    env = {k: None for k in rep.ENV_KEYS}
    env["torch_version"] = torch.__version__
    env["cuda_version"] = torch.version.cuda
    env["python_version"] = platform.python_version()
    env["hostname"] = platform.node()
    try:
        env["cudnn_version"] = torch.backends.cudnn.version()
    except Exception:
        pass
    try:
        from importlib.metadata import version

        env["triton_version"] = version("triton")
    except Exception:
        pass
    env["flash_ext_version"] = getattr(flash_ext, "__version__", None)
    env["flash_ext_extension"] = bool(flash_ext.extension_available())
    if env["flash_ext_extension"]:
        try:
            env["flash_ext_build_info"] = str(flash_ext.build_info())
        except Exception as e:
            env["flash_ext_build_info"] = f"unavailable: {e}"
    env["flash_attn_interface"] = fa3_importable()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["git_commit"] = _run_cmd(["git", "rev-parse", "HEAD"], cwd=root)
    status = _run_cmd(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root)
    env["git_dirty"] = None if status is None or env["git_commit"] is None else bool(status)
    index = 0
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            props = torch.cuda.get_device_properties(index)
            env["gpu_name"] = props.name
            env["gpu_capability"] = f"{props.major}.{props.minor}"
            env["sm_count"] = props.multi_processor_count
            env["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        except Exception:
            pass
        try:
            env["sm_clock_mhz"] = int(torch.cuda.clock_rate(index))
        except Exception:  # needs pynvml
            pass
        try:
            env["cuda_driver_api_version"] = torch._C._cuda_getDriverVersion()
        except Exception:
            pass
    smi = _nvidia_smi(index)
    if smi:
        env["gpu_name"] = env["gpu_name"] or smi.get("name")
        env["driver_version"] = smi.get("driver_version")
        if env["sm_clock_mhz"] is None:
            env["sm_clock_mhz"] = smi.get("sm_clock_mhz")
        env["sm_clock_max_mhz"] = smi.get("sm_clock_max_mhz")
    return env


# =============================================================================================
# main
# =============================================================================================
def _title(mode, env, args, metric="TFLOP/s"):
    gpu = env.get("gpu_name") or "unknown GPU"
    clock = ""
    if env.get("sm_clock_after_run_mhz"):
        clock = f", SM clock {env['sm_clock_after_run_mhz']} MHz at the end (max {env.get('sm_clock_max_mhz')})"
    elif env.get("sm_clock_mhz"):
        clock = f", SM clock {env['sm_clock_mhz']} MHz at the start"
    return (
        f"== {rep.MODE_TITLES.get(mode, mode)} | {args.dtype} | {gpu}{clock} | {metric}, median of do_bench "
        f"(warmup {args.warmup_ms:g} ms, rep {args.repeat_ms:g} ms) =="
    )


def write_outputs(out_dir, name, env, config, records, args, backend_keys, command):
    """Tables (returned and written to NAME.txt), NAME.json and NAME_<mode>.png; returns (text, paths)."""
    os.makedirs(out_dir, exist_ok=True)
    parts = []
    for mode in rep.modes_in(records):
        parts.append(format_table(records, mode, backend_keys, title=_title(mode, env, args)))
        parts.append(rep.format_metric_table(records, mode, "peak_mib", backend_keys, title=f"-- {mode} peak memory above inputs, MiB --"))
    text = "\n\n".join(parts)
    paths = []
    txt_path = os.path.join(out_dir, f"{name}.txt")
    with open(txt_path, "w") as f:
        f.write(text + "\n")
    paths.append(txt_path)
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    paths.append(write_json(os.path.join(out_dir, f"{name}.json"), env, config, records, created=created, command=command))
    if not args.no_plot:
        for mode in rep.modes_in(records):
            p = write_plot(
                os.path.join(out_dir, f"{name}_{mode}.png"),
                records,
                mode,
                gpu_name=env.get("gpu_name"),
                dtype=args.dtype,
                backends=backend_keys,
            )
            if p:
                paths.append(p)
    return text, paths


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        shapes = build_grid(args)
    except ValueError as e:
        parser.error(str(e))
    if args.warmup_ms <= 0 or args.repeat_ms <= 0:
        parser.error("--warmup-ms and --repeat-ms must be positive")
    modes = resolve_modes(args.mode)
    backend_keys = select_backends(args)
    if args.dry_run:
        print(format_dry_run(shapes, modes, backend_keys, args))
        return 0
    if args.device == "cpu":
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("error: no CUDA GPU visible; the benchmark needs one (use --dry-run to see the grid)", file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda", torch.cuda.current_device())
    cfg = RunConfig(dtype=args.dtype, input_scale=args.input_scale, seed=args.seed, math_max_gb=args.math_max_gb)
    backends = make_backends(backend_keys, cfg)
    env = collect_env(device)
    command = [sys.executable, "-m", "flash_ext.benchmark"] + list(sys.argv[1:] if argv is None else argv)
    config = config_dict(args, shapes, modes, backend_keys)
    print(
        f"flash_ext benchmark: {len(shapes)} shape(s) x {'+'.join(modes)} x {len(backends)} backend(s) "
        f"[{', '.join(rep.backend_name(k) for k in backend_keys)}] on {env.get('gpu_name')}, {args.dtype}",
        file=sys.stderr,
    )
    for be in backends:
        why = be.unavailable_reason()
        if why:
            print(f"  {rep.backend_name(be.key)}: skipped everywhere: {why}", file=sys.stderr)
    if device.type == "cuda":
        timer = make_do_bench_timer(args.warmup_ms, args.repeat_ms)
        peak_fn = lambda fn: cuda_peak_mib(fn, device)  # noqa: E731
    else:
        timer, peak_fn = cpu_timer, None
    progress = Progress(len(shapes) * len(modes) * len(backends), len(shapes), enabled=not args.no_progress)
    t0 = time.monotonic()
    records, fatal = [], None
    try:
        _, fatal = run_benchmark(
            shapes,
            modes,
            backends,
            cfg,
            device,
            timer,
            peak_fn=peak_fn,
            progress=progress,
            records=records,
        )
    except KeyboardInterrupt:
        progress.close()
        fatal = "interrupted"
    config["elapsed_s"] = round(time.monotonic() - t0, 1)
    config["stopped_early"] = fatal
    if device.type == "cuda":  # the clock under load (the one read at start is usually the idle clock)
        env["sm_clock_after_run_mhz"] = _nvidia_smi(device.index or 0).get("sm_clock_mhz")
    text, paths = write_outputs(args.out, args.name, env, config, records, args, backend_keys, command)
    print(text)
    print(f"\nwrote {', '.join(paths)} in {config['elapsed_s']:.0f} s", file=sys.stderr)
    if fatal:
        print(f"error: stopped early: {fatal}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
