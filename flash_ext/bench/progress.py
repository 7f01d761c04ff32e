"""A small progress display on stderr: shape i/N, mode, current backend, elapsed time and ETA."""
import math
import sys
import time

from .records import backend_name


def fmt_time(s):
    if s is None or not math.isfinite(s):
        return "--:--"
    s = int(round(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Progress:
    """On a terminal, one bar redrawn in place; otherwise (logs) one line per finished shape and mode."""

    def __init__(self, total_steps, num_shapes, stream=None, enabled=True):
        self.total = max(1, total_steps)
        self.num_shapes = num_shapes
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = self.stream.isatty()
        self.t0 = time.monotonic()
        self._width = 0

    def _times(self):
        elapsed = time.monotonic() - self.t0
        eta = elapsed / self.done * (self.total - self.done) if self.done else None
        return fmt_time(elapsed), fmt_time(eta)

    def show(self, shape_idx, shape, mode, backend_key):
        if not (self.enabled and self.tty):
            return
        elapsed, eta = self._times()
        filled = 20 * self.done // self.total
        line = (
            f"[{'#' * filled}{'.' * (20 - filled)}] shape {shape_idx}/{self.num_shapes} {shape.label()} {mode} | "
            f"{backend_name(backend_key)} | {elapsed} elapsed, ETA {eta}"
        )
        self.stream.write("\r" + line + " " * max(0, self._width - len(line)))  # blank out a longer old line
        self.stream.flush()
        self._width = len(line)

    def step(self):
        self.done += 1

    def shape_done(self, shape_idx, shape, mode, recs):
        if not self.enabled or self.tty:
            return
        elapsed, eta = self._times()
        cells = [f"{backend_name(r.backend)} {r.tflops:.0f}" if r.timed() else f"{backend_name(r.backend)} {r.status}"
                 for r in recs]
        self.stream.write(f"[{shape_idx}/{self.num_shapes}] {shape.label()} {mode}: {', '.join(cells)} "
                          f"({elapsed} elapsed, ETA {eta})\n")
        self.stream.flush()

    def close(self):
        if self.enabled and self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()
            self._width = 0
