"""The vocabulary of results: backend keys and names, statuses, and one Record per measurement."""
import dataclasses
import math

from .shapes import Shape

# Backend key -> display name, in table column order.
BACKEND_NAMES = {
    "flash_ext": "flash_ext",
    "flash_ext_no_window": "flash_ext (no window)",
    "flash_ext_no_softcap": "flash_ext (no softcap)",
    "flash_ext_dense": "flash_ext (dense, same work)",  # --varlen's yardstick: shapes.dense_equivalent
    "flash_ext_bf16": "flash_ext bf16",
    "fa3": "FA3",
    "sdpa_cudnn": "SDPA cuDNN",
    "sdpa_flash": "SDPA flash",
    "sdpa_efficient": "SDPA mem-eff",
    "sdpa_math": "SDPA math",
    "sdpa_nested": "SDPA nested",
    "flex": "FlexAttention",
}
SDPA_KEYS = ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math", "sdpa_nested")


def backend_name(key):
    return BACKEND_NAMES.get(key, key)


def order_backends(keys):
    """Known backends in table order, then unknown ones (e.g. test fakes) in the order given."""
    keys = list(dict.fromkeys(keys))
    return [k for k in BACKEND_NAMES if k in keys] + [k for k in keys if k not in BACKEND_NAMES]


OK = "ok"
SKIPPED = "skipped"  # unavailable, or refused the shape / dtype (the reason says which)
WRONG = "wrong"  # ran, but its result failed the correctness check: not timed
OOM = "oom"
ERROR = "error"  # raised while running something it had accepted
NA = "n/a"  # the operation does not exist for this backend (e.g. no backward)
CELL_TAGS = {SKIPPED: "skip", WRONG: "WRONG", OOM: "OOM", ERROR: "err", NA: "n/a"}


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

    def timed(self):
        """Timed and correct (or unchecked): the records that count in ratios and plots."""
        return self.status == OK and self.tflops is not None and math.isfinite(self.tflops)

    def to_dict(self):
        d = {"backend": self.backend, "backend_name": backend_name(self.backend), "mode": self.mode}
        d.update(self.shape.to_dict())
        for f in dataclasses.fields(self):
            if f.name not in ("shape", "mode", "backend"):
                d[f.name] = getattr(self, f.name)
        return d

    @classmethod
    def from_dict(cls, d):
        names = [f.name for f in dataclasses.fields(cls) if f.name != "shape"]
        # Missing or null fields keep their defaults.
        return cls(shape=Shape.from_dict(d), **{n: d[n] for n in names if d.get(n) is not None})
