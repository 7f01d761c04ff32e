"""Ratios to the best SDPA backend and the terminal tables."""
import math

from .records import CELL_TAGS, OK, SDPA_KEYS, backend_name, order_backends
from .shapes import dense_label

MODE_TITLES = {"fwd": "forward", "bwd": "backward"}


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
    return rec is not None and rec.timed()


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
    return mine.tflops / ref if ref else None


def time_ratio(row, key="flash_ext", against="flash_ext_no_window"):
    """key's time over against's (ms / ms): below 1 when key is faster; None if either is missing. For the
    comparison columns, whose FLOP counts differ from flash_ext's (a window computes fewer pairs), this is the
    speed-up a TFLOP/s ratio would not show."""
    mine, other = row.get(key), row.get(against)
    if not (_timed(mine) and _timed(other)):
        return None
    return mine.ms / other.ms


# Comparison column -> the header of flash_ext's time ratio to it.
TIME_RATIO_HEADERS = {"flash_ext_no_window": "t/t(no window)", "flash_ext_no_softcap": "t/t(no softcap)"}


def geomean(values):
    values = [v for v in values if v is not None and v > 0]
    if not values:
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _short_reason(text, limit=160):
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _aligned(header, body):
    """Header, separator and body lines: the first column left-aligned, the others right-aligned."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *body)]

    def fmt(cells):
        return " | ".join([str(cells[0]).ljust(widths[0])] + [str(c).rjust(w) for c, w in zip(cells[1:], widths[1:])])

    return [fmt(header), "-+-".join("-" * w for w in widths)] + [fmt(line) for line in body]


def format_table(records, mode, backends=None, title=None):
    """One row per shape, one column per backend (TFLOP/s or a tagged footnote), best SDPA and ratios."""
    rows = rows_for_mode(records, mode)
    backends = list(backends or order_backends(r.backend for r in records if r.mode == mode))
    have_fa3 = "fa3" in backends and any(_timed(row.get("fa3")) for _, row in rows)
    have_bf16 = "flash_ext_bf16" in backends and any(_timed(row.get("flash_ext_bf16")) for _, row in rows)
    have_dense = "flash_ext_dense" in backends and any(_timed(row.get("flash_ext_dense")) for _, row in rows)
    time_ratios = [k for k in TIME_RATIO_HEADERS if k in backends and any(_timed(row.get(k)) for _, row in rows)]
    header = ["shape"] + [backend_name(k) for k in backends] + ["best SDPA", "ext/SDPA"]
    if have_bf16:
        header.append("fp8/bf16")
    if have_dense:
        header.append("varlen/dense")
    if have_fa3:
        header.append("ext/FA3")
    header += [TIME_RATIO_HEADERS[k] for k in time_ratios]
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
                line.append(f"{rec.tflops:.1f}" + ("" if rec.checked else "*"))
                unchecked = unchecked or not rec.checked
            else:
                n = notes.setdefault((key, _short_reason(rec.reason or rec.status)), len(notes) + 1)
                line.append(f"{CELL_TAGS.get(rec.status, rec.status)}[{n}]")
        best_key, _ = best_sdpa(row)
        line.append(backend_name(best_key).replace("SDPA ", "") if best_key else "-")
        ratios.append(ratio_to(row))
        line.append(f"{ratios[-1]:.2f}x" if ratios[-1] is not None else "-")
        if have_bf16:
            rb = ratio_to(row, against="flash_ext_bf16")
            line.append(f"{rb:.2f}x" if rb is not None else "-")
        if have_dense:
            rd = ratio_to(row, against="flash_ext_dense")
            line.append(f"{rd:.2f}x" if rd is not None else "-")
        if have_fa3:
            r3 = ratio_to(row, against="fa3")
            line.append(f"{r3:.2f}x" if r3 is not None else "-")
        for key in time_ratios:
            rt = time_ratio(row, against=key)
            line.append(f"{rt:.2f}" if rt is not None else "-")
        body.append(line)
    out = ([title] if title else []) + _aligned(header, body)
    if not body:
        out.append("(no results)")
    g = geomean(ratios)
    if g is not None:
        n = sum(1 for r in ratios if r is not None)
        out.append(f"geomean flash_ext / best SDPA over {n} shape(s): {g:.2f}x")
    if have_dense:
        dense = [ratio_to(row, against="flash_ext_dense") for _, row in rows]
        gd = geomean(dense)
        if gd is not None:
            out.append(f"geomean flash_ext varlen / flash_ext dense (same work) over {sum(1 for r in dense if r)} shape(s): "
                       f"{gd:.2f}x")
    windowed = any(shape.has_window() for shape, _ in rows)
    varlen = any(shape.is_varlen() for shape, _ in rows)
    dense_labels = list(dict.fromkeys(dense_label(shape) for shape, _ in rows if shape.is_varlen()))  # '11 x 3107'
    out.append(
        "TFLOP/s (higher is better): "
        + ("forward 4*b*h*sq*sk*d, halved for causal sq == sk" if mode == "fwd" else "backward 2.5x the forward FLOPs")
        + ("; with a window (w) 4*b*h*d*(visible (query, key) pairs), exactly" if windowed else "")
        + ("; varlen: 4*h*d*(each sequence's visible (query, key) pairs, s(s+1)/2 causal), SDPA's padding not "
           "counted" if varlen else "")
        + "; ext/SDPA = flash_ext over the fastest correct SDPA backend"
        + ("; fp8/bf16 = flash_ext fp8 over its own bf16 forward on the same inputs" if have_bf16 else "")
        + ("; varlen/dense = flash_ext varlen's TFLOP/s over its dense kernels' on the dense batch that does the "
           f"same work ({', '.join(dense_labels)}: sequences of L = round(sum(s^2) / sum(s)), batch round(tokens / L); "
           "the same (query, key) pairs and tokens up to rounding)" if have_dense else "")
        + "".join(f"; {TIME_RATIO_HEADERS[k]} = flash_ext's time over {backend_name(k)}'s (below 1: faster)"
                  for k in time_ratios)
        + "."
    )
    if unchecked:
        out.append("* timed without a correctness check (the float64 reference could not run on this shape)")
    for (key, reason), n in notes.items():  # numbered in insertion order
        out.append(f"[{n}] {backend_name(key)}: {reason}")
    return "\n".join(out)


_METRIC_FORMATS = {"peak_mib": "{:.0f}", "ms": "{:.3f}", "max_err": "{:.2e}", "tflops": "{:.1f}"}


def format_metric_table(records, mode, metric, backends=None, title=None):
    """A compact companion table of one record field (peak_mib, ms, max_err) per shape and backend.

    Backends that were not timed show their status tag only (the TFLOP/s table has the reasons)."""
    backends = list(backends or order_backends(r.backend for r in records if r.mode == mode))
    fmt = _METRIC_FORMATS.get(metric, "{}")
    body = []
    for shape, row in rows_for_mode(records, mode):
        line = [shape.label()]
        for key in backends:
            rec = row.get(key)
            value = getattr(rec, metric, None)
            if rec is not None and rec.status != OK:
                line.append(CELL_TAGS.get(rec.status, rec.status))
            else:
                line.append("-" if value is None else fmt.format(value))
        body.append(line)
    return "\n".join(([title] if title else []) + _aligned(["shape"] + [backend_name(k) for k in backends], body))
