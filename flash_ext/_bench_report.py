"""The pure (GPU-free) half of `python -m flash_ext.benchmark`.

Shapes, the FLOP convention, result records, the correctness verdict, the "best SDPA" ratio, the
terminal table, the JSON file and the PNG plot. Nothing here touches a GPU, so all of it is tested on
CPU (tests/test_benchmark_cpu.py); `flash_ext.benchmark` holds the GPU runner and the CLI.
"""
import dataclasses
import json
import math
import os
import sys
import warnings

SCHEMA = "flash_ext.benchmark/1"

# ---------------------------------------------------------------------------------------------
# Backends: key -> display name, plot colour. The order is the column order of the table.
# ---------------------------------------------------------------------------------------------
BACKEND_ORDER = (
    "flash_ext",
    "fa3",
    "sdpa_cudnn",
    "sdpa_flash",
    "sdpa_efficient",
    "sdpa_math",
    "flex",
)
BACKEND_NAMES = {
    "flash_ext": "flash_ext",
    "fa3": "FA3",
    "sdpa_cudnn": "SDPA cuDNN",
    "sdpa_flash": "SDPA flash",
    "sdpa_efficient": "SDPA mem-eff",
    "sdpa_math": "SDPA math",
    "flex": "FlexAttention",
}
BACKEND_COLORS = {  # fixed per backend, so every panel and every run uses the same colour
    "flash_ext": "#d62728",  # red: ours
    "fa3": "#9467bd",
    "sdpa_cudnn": "#2ca02c",
    "sdpa_flash": "#1f77b4",
    "sdpa_efficient": "#ff7f0e",
    "sdpa_math": "#7f7f7f",
    "flex": "#17becf",
}
SDPA_KEYS = ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math")
EXTRA_COLORS = ("#8c564b", "#e377c2", "#bcbd22", "#393b79", "#637939")


def backend_name(key):
    return BACKEND_NAMES.get(key, key)


def backend_color(key):
    if key in BACKEND_COLORS:
        return BACKEND_COLORS[key]
    return EXTRA_COLORS[sum(map(ord, key)) % len(EXTRA_COLORS)]


def order_backends(keys):
    """Known backends in table order, then unknown ones in the order given."""
    keys = list(dict.fromkeys(keys))
    known = [k for k in BACKEND_ORDER if k in keys]
    return known + [k for k in keys if k not in BACKEND_ORDER]


# ---------------------------------------------------------------------------------------------
# Shapes and FLOPs
# ---------------------------------------------------------------------------------------------
def fmt_seqlen(n):
    """512 -> '512', 8192 -> '8k', 1536 -> '1536'."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_kv: int
    headdim: int
    causal: bool

    @property
    def mask(self):
        return "causal" if self.causal else "non-causal"

    def seq_label(self):
        if self.seqlen_q == self.seqlen_k:
            return fmt_seqlen(self.seqlen_q)
        return f"{fmt_seqlen(self.seqlen_q)}/{fmt_seqlen(self.seqlen_k)}"

    def heads_label(self):
        return f"h{self.nheads}" if self.nheads == self.nheads_kv else f"h{self.nheads}/kv{self.nheads_kv}"

    def label(self):
        """'d128 8k C b2 h16' (N = non-causal, C = causal; 'sq/sk' when they differ)."""
        return f"d{self.headdim} {self.seq_label()} {'C' if self.causal else 'N'} b{self.batch} {self.heads_label()}"

    def to_dict(self):
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d):
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})


def causal_pairs(seqlen_q, seqlen_k):
    """Number of (query i, key j) pairs a bottom-right-aligned causal mask keeps.

    Query i sees keys j <= i + seqlen_k - seqlen_q, i.e. clamp(i + seqlen_k - seqlen_q + 1, 0, seqlen_k)
    of them; summed over i. The upper clamp never binds (i <= seqlen_q - 1), so the sum is that of
    the positive integers t in [seqlen_k - seqlen_q + 1, seqlen_k]."""
    if seqlen_q <= 0 or seqlen_k <= 0:
        return 0
    lo = max(seqlen_k - seqlen_q + 1, 1)
    hi = seqlen_k
    if hi < lo:
        return 0
    return (lo + hi) * (hi - lo + 1) // 2


def attention_flops(shape, mode="fwd"):
    """FLOPs of one attention call, FlashAttention's convention.

    Forward: two matmuls, 2 * (2 * sq * sk * d) per head -> 4 * b * h * sq * sk * d. Causal with
    sq == sk: exactly half of that (what the FlashAttention papers and our ANCHORS use; the exact
    pair count s(s+1)/2 would add the diagonal, +1/s). Causal with sq != sk: 4 * b * h * d * (the exact
    number of unmasked pairs, bottom-right aligned). Backward ('bwd'): 2.5x forward (five matmuls
    instead of two). Softmax/exp work is not counted."""
    b, h, d = shape.batch, shape.nheads, shape.headdim
    sq, sk = shape.seqlen_q, shape.seqlen_k
    if not shape.causal:
        fwd = 4 * b * h * sq * sk * d
    elif sq == sk:
        fwd = 2 * b * h * sq * sk * d
    else:
        fwd = 4 * b * h * d * causal_pairs(sq, sk)
    if mode == "fwd":
        return fwd
    if mode == "bwd":
        return fwd * 5 // 2  # fwd is always even, so this is exact
    raise ValueError(f"unknown mode {mode!r}; expected 'fwd' or 'bwd'")


def tflops(flops, ms):
    if ms is None or not (ms > 0) or not math.isfinite(ms):
        return None
    return flops / (ms * 1e-3) / 1e12


# ---------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------
OK = "ok"
SKIPPED = "skipped"  # unavailable, or refused the shape / dtype (the reason says which)
WRONG = "wrong"  # ran, but its result failed the correctness check: not timed
OOM = "oom"
ERROR = "error"  # raised while running something it had accepted
NA = "n/a"  # the operation does not exist for this backend (e.g. no backward yet)
STATUSES = (OK, SKIPPED, WRONG, OOM, ERROR, NA)
_CELL_TAG = {SKIPPED: "skip", WRONG: "WRONG", OOM: "OOM", ERROR: "err", NA: "n/a"}


@dataclasses.dataclass
class Record:
    """One backend on one shape in one mode (fwd or bwd)."""

    shape: Shape
    mode: str
    backend: str
    status: str = OK
    reason: str = ""
    ms: float = None
    tflops: float = None
    flops: int = None
    max_err: float = None  # max |out - ref| on the checked slice (bwd: of the worst gradient)
    tol: float = None  # the tolerance max_err was held to
    checked: bool = False  # False: timed without a reference check (the reference could not run)
    diff_vs_flash_ext: float = None  # max |out - flash_ext's out| on the same slice
    peak_mib: float = None  # peak extra memory of one call, above what was allocated before it
    err_detail: dict = None  # bwd: {"dq": [err, tol], ...}
    note: str = ""

    def to_dict(self):
        d = {"backend": self.backend, "backend_name": backend_name(self.backend), "mode": self.mode}
        d.update(self.shape.to_dict())
        for f in dataclasses.fields(self):
            if f.name not in ("shape", "mode", "backend"):
                d[f.name] = _json_float(getattr(self, f.name))
        return d

    @classmethod
    def from_dict(cls, d):
        kwargs = {f.name: d.get(f.name) for f in dataclasses.fields(cls) if f.name not in ("shape",)}
        for f in dataclasses.fields(cls):
            if kwargs.get(f.name) is None and f.default is not dataclasses.MISSING and f.name != "shape":
                kwargs[f.name] = f.default
        return cls(shape=Shape.from_dict(d), **kwargs)


def _json_float(x):
    # JSON has no NaN/inf; keep them readable as strings.
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _json_float(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_float(v) for v in x]
    return x


# ---------------------------------------------------------------------------------------------
# Correctness verdict
# ---------------------------------------------------------------------------------------------
# A small absolute slack on top of 2x the error of PyTorch's own attention in the same dtype (the
# criterion of FlashAttention's test suite), scaled by max(1, max|ref|) so that it stays meaningful
# when values are large.
ABS_SLACK = {"fp16": 1e-3, "bf16": 1e-3, "fp8": 6e-2}
# Used when PyTorch's math attention could not give a baseline error (e.g. it failed or produced
# non-finite values on fully masked rows). bf16 keeps 8 significant bits: one ulp at |x| ~ 2 is
# 1.6e-2, so 2e-2 allows one ulp of disagreement at typical output magnitudes and still catches a
# wrong mask, scale or layout (errors of order 0.1-1). fp16 has 3 more bits; fp8 (e4m3) keeps 4
# bits and FP8 kernels also quantize P.
FALLBACK_TOL = {"fp16": 4e-3, "bf16": 2e-2, "fp8": 1.5e-1}


def tolerance(dtype_name, math_err=None, ref_absmax=1.0):
    """The largest max-abs error a backend may show vs the float64 reference on the slice."""
    scale = max(1.0, float(ref_absmax)) if ref_absmax is not None and math.isfinite(ref_absmax) else 1.0
    if math_err is not None and math.isfinite(math_err):
        return 2.0 * float(math_err) + ABS_SLACK.get(dtype_name, 1e-3) * scale
    return FALLBACK_TOL.get(dtype_name, 2e-2) * scale


def verdict(err, tol):
    """(passed, reason). NaN/inf errors never pass."""
    if err is None:
        return True, "unchecked"
    if not math.isfinite(err):
        return False, "non-finite values (NaN/inf) in the output"
    if err > tol:
        return False, f"max abs error {err:.3g} > tolerance {tol:.3g} vs the float64 reference"
    return True, ""


# ---------------------------------------------------------------------------------------------
# Grouping and the ratio to the best SDPA backend
# ---------------------------------------------------------------------------------------------
def rows_for_mode(records, mode):
    """[(shape, {backend: record})] in first-seen order, for one mode."""
    rows = {}
    for r in records:
        if r.mode == mode:
            rows.setdefault(r.shape, {})[r.backend] = r
    return list(rows.items())


def modes_in(records):
    return [m for m in ("fwd", "bwd") if any(r.mode == m for r in records)]


def _timed(rec):
    return rec is not None and rec.status == OK and rec.tflops is not None and math.isfinite(rec.tflops)


def best_sdpa(row):
    """(backend key, TFLOP/s) of the fastest SDPA backend that was timed and correct, else (None, None)."""
    best = (None, None)
    for key in SDPA_KEYS:
        rec = row.get(key)
        if _timed(rec) and (best[1] is None or rec.tflops > best[1]):
            best = (key, rec.tflops)
    return best


def ratio_to(row, key="flash_ext", against=None):
    """flash_ext's TFLOP/s over the best SDPA's (against=None) or over one backend's; None if either is missing."""
    mine = row.get(key)
    if not _timed(mine):
        return None
    if against is None:
        _, ref = best_sdpa(row)
    else:
        other = row.get(against)
        ref = other.tflops if _timed(other) else None
    if not ref:
        return None
    return mine.tflops / ref


def geomean(values):
    values = [v for v in values if v is not None and v > 0]
    if not values:
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


# ---------------------------------------------------------------------------------------------
# Terminal table
# ---------------------------------------------------------------------------------------------
MODE_TITLES = {"fwd": "forward", "bwd": "backward"}


def _short_reason(text, limit=160):
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_table(records, mode, backends=None, title=None):
    """One row per shape, one column per backend (TFLOP/s or a tagged footnote), best SDPA and ratios."""
    rows = rows_for_mode(records, mode)
    if backends is None:
        backends = order_backends(r.backend for r in records if r.mode == mode)
    backends = list(backends)
    have_fa3 = "fa3" in backends and any(_timed(row.get("fa3")) for _, row in rows)
    header = ["shape"] + [backend_name(k) for k in backends] + ["best SDPA", "ext/SDPA"]
    if have_fa3:
        header.append("ext/FA3")
    notes = {}  # (backend, reason) -> footnote number
    unchecked = False
    body = []
    ratios = []
    for shape, row in rows:
        line = [shape.label()]
        for key in backends:
            rec = row.get(key)
            if rec is None:
                line.append("-")
            elif rec.status == OK and rec.tflops is not None:
                cell = f"{rec.tflops:.1f}"
                if not rec.checked:
                    cell += "*"
                    unchecked = True
                line.append(cell)
            else:
                tag = _CELL_TAG.get(rec.status, rec.status)
                reason = _short_reason(rec.reason or rec.status)
                n = notes.setdefault((key, reason), len(notes) + 1)
                line.append(f"{tag}[{n}]")
        best_key, _ = best_sdpa(row)
        line.append(backend_name(best_key).replace("SDPA ", "") if best_key else "-")
        r = ratio_to(row)
        ratios.append(r)
        line.append(f"{r:.2f}x" if r is not None else "-")
        if have_fa3:
            r3 = ratio_to(row, against="fa3")
            line.append(f"{r3:.2f}x" if r3 is not None else "-")
        body.append(line)
    widths = [max(len(str(c)) for c in col) for col in zip(header, *body)] if body else [len(h) for h in header]
    out = []
    if title:
        out.append(title)
    sep = "-+-".join("-" * w for w in widths)

    def fmt(cells):
        first = str(cells[0]).ljust(widths[0])
        rest = [str(c).rjust(w) for c, w in zip(cells[1:], widths[1:])]
        return " | ".join([first] + rest)

    out.append(fmt(header))
    out.append(sep)
    for line in body:
        out.append(fmt(line))
    if not body:
        out.append("(no results)")
    g = geomean(ratios)
    if g is not None:
        n = sum(1 for r in ratios if r is not None)
        out.append(f"geomean flash_ext / best SDPA over {n} shape(s): {g:.2f}x")
    out.append(
        "TFLOP/s (higher is better): "
        + ("forward 4*b*h*sq*sk*d, halved for causal sq == sk" if mode == "fwd" else "backward 2.5x the forward FLOPs")
        + "; ext/SDPA = flash_ext over the fastest correct SDPA backend."
    )
    if unchecked:
        out.append("* timed without a correctness check (the float64 reference could not run on this shape)")
    for (key, reason), n in sorted(notes.items(), key=lambda kv: kv[1]):
        out.append(f"[{n}] {backend_name(key)}: {reason}")
    return "\n".join(out)


_METRIC_FORMATS = {"peak_mib": "{:.0f}", "ms": "{:.3f}", "max_err": "{:.2e}", "tflops": "{:.1f}"}


def format_metric_table(records, mode, metric, backends=None, title=None):
    """A compact companion table of one record field (peak_mib, ms, max_err) per shape and backend.

    Backends that were not timed show their status tag only (the TFLOP/s table has the reasons)."""
    rows = rows_for_mode(records, mode)
    if backends is None:
        backends = order_backends(r.backend for r in records if r.mode == mode)
    fmt = _METRIC_FORMATS.get(metric, "{}")
    header = ["shape"] + [backend_name(k) for k in backends]
    body = []
    for shape, row in rows:
        line = [shape.label()]
        for key in backends:
            rec = row.get(key)
            value = getattr(rec, metric, None) if rec is not None else None
            if rec is None:
                line.append("-")
            elif rec.status == OK and value is not None:
                line.append(fmt.format(value))
            elif rec.status == OK:
                line.append("-")
            else:
                line.append(_CELL_TAG.get(rec.status, rec.status))
        body.append(line)
    widths = [max(len(str(c)) for c in col) for col in zip(header, *body)] if body else [len(h) for h in header]
    out = [title] if title else []
    out.append(" | ".join([header[0].ljust(widths[0])] + [h.rjust(w) for h, w in zip(header[1:], widths[1:])]))
    out.append("-+-".join("-" * w for w in widths))
    for line in body:
        out.append(" | ".join([line[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(line[1:], widths[1:])]))
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------------------------
ENV_KEYS = (
    "gpu_name",
    "gpu_capability",
    "sm_count",
    "sm_clock_mhz",
    "sm_clock_max_mhz",
    "sm_clock_after_run_mhz",
    "driver_version",
    "cuda_version",
    "torch_version",
    "cudnn_version",
    "triton_version",
    "python_version",
    "flash_ext_version",
    "flash_ext_extension",
    "flash_ext_build_info",
    "flash_attn_interface",
    "git_commit",
    "git_dirty",
    "hostname",
)


def summary(records):
    """Per mode and shape: the best SDPA backend and flash_ext's ratios (what the table prints)."""
    out = {}
    for mode in modes_in(records):
        rows = []
        for shape, row in rows_for_mode(records, mode):
            key, best = best_sdpa(row)
            rows.append(
                {
                    "shape": shape.to_dict(),
                    "best_sdpa": key,
                    "best_sdpa_tflops": best,
                    "flash_ext_over_best_sdpa": ratio_to(row),
                    "flash_ext_over_fa3": ratio_to(row, against="fa3"),
                }
            )
        out[mode] = {"rows": rows, "geomean_flash_ext_over_best_sdpa": geomean(r["flash_ext_over_best_sdpa"] for r in rows)}
    return out


def build_document(env, config, records, created=None, command=None):
    env = dict(env or {})
    for k in ENV_KEYS:
        env.setdefault(k, None)
    return {
        "schema": SCHEMA,
        "created": created,
        "command": command,
        "env": env,
        "config": config,
        "flop_convention": "forward 4*b*h*sq*sk*d; causal: half when sq == sk, else 4*b*h*d*(bottom-right "
        "unmasked pairs); backward 2.5x forward",
        "results": [r.to_dict() for r in records],
        "summary": summary(records),
    }


def write_json(path, env, config, records, created=None, command=None):
    doc = build_document(env, config, records, created=created, command=command)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(_json_float(doc), f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)
    return path


def load_json(path):
    """(document, [Record]) from a file written by write_json."""
    with open(path) as f:
        doc = json.load(f)
    records = []
    for d in doc.get("results", []):
        d = dict(d)
        for k in ("ms", "tflops", "max_err", "tol", "diff_vs_flash_ext", "peak_mib"):
            if isinstance(d.get(k), str):
                d[k] = float(d[k])
        records.append(Record.from_dict(d))
    return doc, records


# ---------------------------------------------------------------------------------------------
# PNG plot, in the style of the FlashAttention papers
# ---------------------------------------------------------------------------------------------
def _import_pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except Exception as e:  # ImportError, or a broken install
        return None, e
    return plt, None


def plot_panels(records, mode):
    """[((headdim, causal), [shape, ...])] in the order panels are drawn: head dims down, masks across."""
    panels = {}
    for shape, _ in rows_for_mode(records, mode):
        panels.setdefault((shape.headdim, shape.causal), []).append(shape)
    return sorted(panels.items(), key=lambda kv: (kv[0][0], kv[0][1]))


def write_plot(path, records, mode, gpu_name=None, dtype="bf16", backends=None):
    """Grouped bars (TFLOP/s per backend) per sequence length, one panel per head dim x mask.

    Returns the path written, or None (with a warning on stderr) if matplotlib is missing or there
    is nothing timed to plot."""
    plt, err = _import_pyplot()
    if plt is None:
        print(f"warning: matplotlib is not importable ({err}); no plot written", file=sys.stderr)
        return None
    mode_records = [r for r in records if r.mode == mode]
    if backends is None:
        backends = order_backends(r.backend for r in mode_records)
    plotted = [k for k in backends if any(_timed(r) for r in mode_records if r.backend == k)]
    panels = plot_panels(records, mode)
    if not panels or not plotted:
        print(f"warning: nothing timed in mode {mode}; no plot written", file=sys.stderr)
        return None
    headdims = sorted({hd for (hd, _), _ in panels})
    masks = sorted({c for (_, c), _ in panels})
    nrows, ncols = len(headdims), len(masks)
    fig_h = 3.6 * nrows + 0.9  # + room for the title and the legend
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.2 * ncols, fig_h), squeeze=False)
    for ax in axes.flat:
        ax.set_visible(False)
    rows = dict(rows_for_mode(records, mode))
    nb = len(plotted)
    width = 0.8 / nb
    handles = {}
    for (hd, causal), shapes in panels:
        ax = axes[headdims.index(hd)][masks.index(causal)]
        ax.set_visible(True)
        labels = [s.seq_label() for s in shapes]
        if len(set(labels)) != len(labels):  # several shapes share a sequence length: say which is which
            labels = [f"{s.seq_label()}\nb{s.batch} {s.heads_label()}" for s in shapes]
        ymax = 0.0
        for bi, key in enumerate(plotted):
            xs, ys = [], []
            for xi, s in enumerate(shapes):
                rec = rows.get(s, {}).get(key)
                if _timed(rec):
                    xs.append(xi + (bi - (nb - 1) / 2) * width)
                    ys.append(rec.tflops)
            if not xs:
                continue
            bars = ax.bar(xs, ys, width=width * 0.95, color=backend_color(key), label=backend_name(key), zorder=3)
            handles.setdefault(key, bars)
            ymax = max(ymax, max(ys))
            for x, y in zip(xs, ys):
                ax.text(
                    x,
                    y,
                    f"{y:.0f}",
                    ha="center",
                    va="bottom",
                    fontsize=5 if nb > 3 else 6.5,
                    rotation=90 if nb > 4 else 0,
                )
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_xlim(-0.6, len(shapes) - 0.4)
        ax.set_ylim(0, ymax * 1.18 if ymax > 0 else 1)
        ax.set_xlabel("Sequence length", fontsize=8)
        ax.set_ylabel("Speed (TFLOP/s)", fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(axis="y", alpha=0.3, zorder=0)
        ax.set_title(f"{'Causal' if causal else 'Non-causal'}, head dim {hd}", fontsize=9)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    title = f"Attention {MODE_TITLES.get(mode, mode)} speed ({dtype}"
    title += f", {gpu_name})" if gpu_name else ")"
    fig.suptitle(title, fontsize=11, y=1 - 0.12 / fig_h, va="top")
    keys = [k for k in plotted if k in handles]
    fig.legend(
        [handles[k] for k in keys],
        [backend_name(k) for k in keys],
        loc="upper center",
        ncol=min(len(keys), 7),
        fontsize=8,
        frameon=False,
        bbox_to_anchor=(0.5, 1 - 0.42 / fig_h),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.6 / fig_h))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path
