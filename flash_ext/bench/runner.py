"""Running the benchmark: inputs per shape, then for each mode: each backend runs once, is checked against the
reference (a WRONG result is not timed) and has its peak memory measured; then the checked backends are
timed together, interleaved by the timer so that no backend gains from its place in the order.
Device-agnostic: the CPU tests drive it with a CPU timer."""
import dataclasses
import gc
import math
import warnings

import torch

from .check import build_reference, check_result, max_abs_err, verdict
from .progress import Progress
from .records import ERROR, OK, OOM, SKIPPED, WRONG, Record
from .shapes import attention_flops, tflops

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}


@dataclasses.dataclass
class RunConfig:
    dtype: str = "bf16"
    input_scale: float = 1.0
    seed: int = 0
    math_max_gb: float = 2.0
    deterministic: bool = False  # flash_ext's backward only
    fp8_v_colmajor: bool = False  # flash_ext's FP8 forward reads V column-major where it has kernels for it


class FatalDeviceError(RuntimeError):
    """A sticky CUDA error: the context is unusable, so the run stops (the records so far are kept)."""

    def __init__(self, reason, records=()):
        super().__init__(reason)
        self.records = list(records)


_FATAL_MARKERS = (
    "illegal memory access",
    "unspecified launch failure",
    "device-side assert",
    "misaligned address",
    "illegal instruction",
    "an illegal",
    "CUDA error: unknown error",
)
_NOISE_WARNINGS = (
    "not used because",  # SDPA's header line; the specific reasons follow it
    "flex_attention called without",
    "Lower right causal bias will produce NaNs",  # raised by CausalBias itself, not a refusal reason
)


def is_fatal(exc):
    return any(m in str(exc) for m in _FATAL_MARKERS)


def describe(exc, caught=()):
    """A one-line reason from an exception and the warnings SDPA emitted while refusing."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    msgs = []
    for w in caught:
        m = " ".join(str(w.message).split())
        if m and m not in msgs and not any(s in m for s in _NOISE_WARNINGS):
            msgs.append(m)
    if msgs and ("No available kernel" in text or "No viable backend" in text):
        return "refused: " + "; ".join(msgs[:3])
    name = type(exc).__name__
    return f"{name}: {text}" if text else name


def free(device):
    gc.collect()
    if device.type == "cuda":
        try:
            torch.cuda.empty_cache()
        except Exception:  # after a sticky CUDA error this raises again; the run is stopping anyway
            pass


def make_inputs(shape, dtype, device, scale, seed, need_dout):
    """q, k, v (and dout) in (b, s, h, d): randn * scale (never zeros), identical for every backend. A varlen
    shape's packed rows are (1, total, h, d)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    work = torch.bfloat16 if dtype == torch.float8_e4m3fn else dtype  # randn has no fp8

    def rnd(*size):
        return torch.randn(*size, generator=gen, device=device, dtype=work).mul_(scale).to(dtype)

    b, sq, sk, h, hkv, d = shape.batch, shape.seqlen_q, shape.seqlen_k, shape.nheads, shape.nheads_kv, shape.headdim
    if shape.is_varlen():
        b, sq, sk = 1, shape.tokens, shape.tokens
    q, k, v = rnd(b, sq, h, d), rnd(b, sk, hkv, d), rnd(b, sk, hkv, d)
    dout = rnd(b, sq, h, d).to(work) if need_dout else None  # gradients arrive in 16 bits even for fp8
    return q, k, v, dout


def _prepare(backend, rec, q, k, v, dout, scale, ref, device, peak_fn, ext):
    """Build fn, run it once, check it, then measure its peak memory; fills rec. Returns fn, to be timed, or
    None when rec is not to be timed (skipped or wrong)."""
    shape, mode = backend.problem(rec.shape), rec.mode
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if mode == "fwd":
                fn, post = backend.make_fwd(q, k, v, shape, scale)
            else:
                fn, post = backend.make_bwd(q, k, v, dout, shape, scale)
            res = fn()  # the first call compiles / autotunes where the backend does; not timed
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:
            if is_fatal(e):
                raise
            # Refused at call time (SDPA raises and gives its reasons as warnings): skipped, not an error.
            rec.status, rec.reason = SKIPPED, describe(e, caught)
            return None
    outs = post(res)
    del res
    if ref is not None:
        err, tol, detail, got = check_result(mode, outs, ref)
        rec.max_err, rec.tol, rec.err_detail, rec.checked = err, tol, detail, True
        if backend.key == "flash_ext":  # it runs first: the others report their difference from it
            ext["slice"] = got
        elif "slice" in ext:
            rec.diff_vs_flash_ext = max_abs_err(got, ext["slice"])
        ok, why = verdict(err, tol)
        if not ok:
            rec.status, rec.reason = WRONG, why
            return None
        rec.note = ref.note
    del outs
    rec.peak_mib = peak_fn(fn) if peak_fn else None
    return fn


def _in_context(backend, fn):
    """fn run inside the backend's context (SDPA's backend choice is made at call time)."""

    def run():
        with backend.context():
            return fn()

    return run


def prepare_backend(backend, mode, q, k, v, dout, shape, scale, ref, device, peak_fn, ext):
    """One backend, one mode, one shape (a cell of the table) -> (Record, fn to time or None): run, checked,
    peak memory measured, not yet timed. Raises only FatalDeviceError.

    The backend computes backend.problem(shape) (the row's shape, or it without its window or softcap for
    flash_ext's comparison columns): its FLOPs count, and ref is its reference. ext: a dict shared by the
    backends of one problem and mode (flash_ext's checked slice)."""
    rec = Record(shape=shape, mode=mode, backend=backend.key, flops=attention_flops(backend.problem(shape), mode))
    if backend.unavailable:
        rec.status, rec.reason = SKIPPED, backend.unavailable
        return rec, None
    refusal = backend.refuse(shape, mode)
    if refusal:
        rec.status, rec.reason = refusal
        return rec, None
    oom, fn = False, None
    try:
        with backend.context():
            fn = _prepare(backend, rec, q, k, v, dout, scale, ref, device, peak_fn, ext)
    except torch.OutOfMemoryError as e:
        rec.status, rec.reason = OOM, describe(e)
        oom = True
    except Exception as e:
        if is_fatal(e):
            raise FatalDeviceError(describe(e)) from e
        rec.status, rec.reason = ERROR, describe(e)
    if oom:  # freed here, once the exception (whose frames hold the tensors) is gone
        free(device)
    return rec, (_in_context(backend, fn) if fn is not None else None)


def time_backends(recs, fns, timer):
    """Times the prepared fns together (the timer interleaves them) and fills their records' ms and TFLOP/s;
    a backend that fails while timed gets its error. Raises only FatalDeviceError."""
    results = timer(fns)
    for rec, res in zip(recs, results):
        if isinstance(res, BaseException):
            if is_fatal(res):
                raise FatalDeviceError(describe(res))
            rec.status, rec.reason = (OOM if isinstance(res, torch.OutOfMemoryError) else ERROR), describe(res)
        else:
            rec.ms = res
            rec.tflops = tflops(rec.flops, rec.ms)


def problem_inputs(problem, tensors):
    """The row's inputs as `problem` takes them: unchanged, or, for a dense problem drawn from a --varlen row's
    packed (1, total, h, d) rows (flash_ext_dense: the dense batch of the same work, whose batch * seqlen is
    the total only up to rounding), its batch * seqlen rows laid out as (batch, seqlen, h, d): the first
    rows (a view) when there are enough, else the packed rows repeated (a copy; no sequence holds a row
    twice, as seqlen <= total)."""
    if problem.is_varlen() or tensors[0].shape[:2] == (problem.batch, problem.seqlen_q):
        return tensors
    rows = problem.batch * problem.seqlen_q

    def lay_out(t):
        if t is None:
            return None
        if t.shape[0] != 1 or problem.seqlen_q > t.shape[1]:
            raise ValueError(f"cannot lay out inputs {tuple(t.shape)} as {problem.batch} x {problem.seqlen_q}")
        if rows > t.shape[1]:
            t = t.repeat(1, -(-rows // t.shape[1]), 1, 1)
        return t[:, :rows].reshape(problem.batch, problem.seqlen_q, *t.shape[2:])

    return tuple(lay_out(t) for t in tensors)


def _reference(q, k, v, dout, shape, scale, cfg, need_bwd):
    """(reference or None, note): when the reference fails (OOM...), the backends are timed unchecked."""
    try:
        return build_reference(q, k, v, dout, shape, scale, cfg.dtype, need_bwd), ""
    except Exception as e:
        if is_fatal(e):
            raise FatalDeviceError(describe(e)) from e
        return None, f"unchecked: the reference failed ({describe(e)})"


def run_shape(shape, shape_idx, modes, backends, cfg, device, timer, peak_fn, progress):
    """All modes and backends on one shape -> records. Raises FatalDeviceError holding the records so far."""
    records = []
    scale = 1.0 / math.sqrt(shape.headdim)
    need_bwd = "bwd" in modes
    problems = {be.key: be.problem(shape) for be in backends}
    try:
        q, k, v, dout = make_inputs(shape, DTYPES[cfg.dtype], device, cfg.input_scale, cfg.seed + shape_idx, need_bwd)
    except torch.OutOfMemoryError as e:
        for mode in modes:
            for be in backends:
                records.append(Record(shape, mode, be.key, status=OOM, reason=f"inputs do not fit: {describe(e)}",
                                      flops=attention_flops(problems[be.key], mode)))
                progress.step()
        return records
    refs, inputs = {}, {}  # problem -> (reference or None, note), its inputs: the row's first, then comparisons'
    for problem in dict.fromkeys([shape, *problems.values()]):
        inputs[problem] = problem_inputs(problem, (q, k, v, dout))
        refs[problem] = _reference(*inputs[problem], problem, scale, cfg, need_bwd)
        if refs[problem][0] is None:
            free(device)
    for mode in modes:
        mode_recs, to_time = [], []  # to_time: (record, fn) of the backends checked and waiting for the timer
        exts = {problem: {} for problem in refs}
        for be in backends:
            progress.show(shape_idx, shape, mode, be.key)
            problem = problems[be.key]
            ref, ref_note = refs[problem]
            try:
                rec, fn = prepare_backend(be, mode, *inputs[problem], shape, scale, ref, device, peak_fn,
                                          exts[problem])
            except FatalDeviceError as e:
                rec = Record(shape, mode, be.key, status=ERROR, reason=str(e), flops=attention_flops(problem, mode))
                raise FatalDeviceError(str(e), records + mode_recs + [rec]) from e
            if ref_note and rec.status == OK:
                rec.note = ref_note
            mode_recs.append(rec)
            if fn is not None:
                to_time.append((rec, fn))
            progress.step()
        try:
            time_backends([rec for rec, _ in to_time], [fn for _, fn in to_time], timer)
        except FatalDeviceError as e:
            raise FatalDeviceError(str(e), records + mode_recs) from e
        del to_time
        progress.shape_done(shape_idx, shape, mode, mode_recs)
        records.extend(mode_recs)
    return records


def run_benchmark(shapes, modes, backends, cfg, device, timer, peak_fn=None, progress=None, records=None):
    """Every shape; returns (records, fatal reason or None). Stops early only on a sticky device error.

    Records are appended to `records` (when given) as each shape finishes, so that a caller that is
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
            records.extend(e.records)
            fatal = str(e)
            break
        finally:
            free(device)  # the shape's inputs and reference are gone by now
    progress.close()
    return records, fatal
