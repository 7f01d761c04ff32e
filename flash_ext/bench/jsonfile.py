"""The JSON results file: environment, configuration, one entry per record, and the ratio summary."""
import json
import math
import os

from .env import ENV_KEYS
from .records import Record
from .shapes import dense_equivalent
from .report import best_sdpa, geomean, modes_in, ratio_to, rows_for_mode, time_ratio

SCHEMA = "flash_ext.benchmark/1"
_FLOAT_FIELDS = ("ms", "tflops", "max_err", "tol", "diff_vs_flash_ext", "peak_mib")


def _json_safe(x):
    """JSON has no NaN/inf: write them as the strings 'nan', 'inf', '-inf'."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


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
                    # --varlen: flash_ext varlen's TFLOP/s over its dense kernels' on the dense batch that does the
                    # same work (shapes.dense_equivalent: [batch, seqlen] below), else None
                    "flash_ext_over_dense": ratio_to(row, against="flash_ext_dense"),
                    "dense_same_work": ([dense_equivalent(shape).batch, dense_equivalent(shape).seqlen_q]
                                        if shape.is_varlen() else None),
                    # flash_ext's time over its comparison columns' (--window / --softcap runs), else None
                    "flash_ext_time_over_no_window": time_ratio(row, against="flash_ext_no_window"),
                    "flash_ext_time_over_no_softcap": time_ratio(row, against="flash_ext_no_softcap"),
                }
            )
        out[mode] = {"rows": rows, "geomean_flash_ext_over_best_sdpa": geomean(r["flash_ext_over_best_sdpa"] for r in rows)}
    return out


def build_document(env, config, records, created=None, command=None):
    return {
        "schema": SCHEMA,
        "created": created,
        "command": command,
        "env": {**dict.fromkeys(ENV_KEYS), **(env or {})},
        "config": config,
        "flop_convention": "forward 4*b*h*sq*sk*d; causal: half when sq == sk, else 4*b*h*d*(bottom-right "
        "unmasked pairs); with a sliding window: 4*b*h*d*(exact visible pairs of the band); varlen: 4*h*d*(sum over "
        "sequences of their exact visible pairs); backward 2.5x forward",
        "results": [r.to_dict() for r in records],
        "summary": summary(records),
    }


def write_json(path, env, config, records, created=None, command=None):
    doc = build_document(env, config, records, created=created, command=command)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"  # written whole, then renamed: an interrupted run never leaves half a file
    with open(tmp, "w") as f:
        json.dump(_json_safe(doc), f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)
    return path


def load_json(path):
    """(document, [Record]) from a file written by write_json."""
    with open(path) as f:
        doc = json.load(f)
    records = []
    for d in doc["results"]:
        d = {k: float(v) if k in _FLOAT_FIELDS and isinstance(v, str) else v for k, v in d.items()}
        records.append(Record.from_dict(d))
    return doc, records
