"""Benchmark shapes (with their sliding window and softcap, if any) and FlashAttention's FLOP convention."""
import dataclasses
import math


def fmt_seqlen(n):
    """512 -> '512', 8192 -> '8k', 1536 -> '1536'."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


NO_WINDOW = (-1, -1)


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_kv: int
    headdim: int
    causal: bool
    # flash_ext's window_size = (window_left, window_right) (-1 = unbounded) and softcap (0 = off).
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0

    @property
    def window(self):
        return (self.window_left, self.window_right)

    def has_window(self):
        return self.window != NO_WINDOW

    def window_softcap_kwargs(self):
        """window_size= / softcap= for flash_ext.forward / backward (and FA3's flash_attn_func): only those
        that differ from their defaults, so that a plain shape makes the plain call."""
        kwargs = {}
        if self.has_window():
            kwargs["window_size"] = self.window
        if self.softcap:
            kwargs["softcap"] = self.softcap
        return kwargs

    def seq_label(self):
        if self.seqlen_q == self.seqlen_k:
            return fmt_seqlen(self.seqlen_q)
        return f"{fmt_seqlen(self.seqlen_q)}/{fmt_seqlen(self.seqlen_k)}"

    def heads_label(self):
        return f"h{self.nheads}" if self.nheads == self.nheads_kv else f"h{self.nheads}/kv{self.nheads_kv}"

    def variant_label(self):
        """' w256,0' for a window, ' cap30' for a softcap, '' for neither."""
        window = f" w{self.window_left},{self.window_right}" if self.has_window() else ""
        return window + (f" cap{self.softcap:g}" if self.softcap else "")

    def label(self):
        """'d128 8k C b2 h16' (N = non-causal, C = causal; 'sq/sk' when they differ), then ' w256,0' with a
        window and ' cap30' with a softcap."""
        return (f"d{self.headdim} {self.seq_label()} {'C' if self.causal else 'N'} b{self.batch} {self.heads_label()}"
                + self.variant_label())

    def to_dict(self):
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d):
        """From to_dict()'s keys; the window and softcap keep their defaults when absent (older files)."""
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


def _clamp_sum_upto(m, n):
    """sum over the integers x in [0, m] of clamp(x, 0, n) (0 when m < 0)."""
    if m < 0:
        return 0
    if m <= n:
        return m * (m + 1) // 2
    return n * (n + 1) // 2 + (m - n) * n


def _clamp_sum(lo, hi, n):
    """sum over the integers x in [lo, hi] of clamp(x, 0, n)."""
    return _clamp_sum_upto(hi, n) - _clamp_sum_upto(lo - 1, n) if hi >= lo else 0


def visible_pairs(seqlen_q, seqlen_k, causal=False, window=NO_WINDOW):
    """The exact number of (query i, key j) pairs attention computes, for any mask flash_ext runs.

    With d = seqlen_k - seqlen_q and window (left, right) (-1 = unbounded; causal is right = 0), query i
    sees the keys j in [0, seqlen_k) with i + d - left <= j <= i + d + right, i.e.
    clamp(i + d + right + 1, 0, seqlen_k) - clamp(i + d - left, 0, seqlen_k) of them (never negative, as
    left, right >= 0). Summed over i in closed form: each term is a sum of clamp(x, 0, seqlen_k) over a
    range of consecutive x."""
    left, right = window
    if left < -1 or right < -1:
        raise ValueError(f"window bounds must be -1 (unbounded) or >= 0, got {tuple(window)}")
    if causal:
        if right > 0:
            raise ValueError(f"causal is the window's right bound 0: window {tuple(window)} is not causal")
        right = 0
    if seqlen_q <= 0 or seqlen_k <= 0:
        return 0
    t0, t1 = seqlen_k - seqlen_q, seqlen_k - 1  # i + d over the query rows
    upto = seqlen_q * seqlen_k if right < 0 else _clamp_sum(t0 + right + 1, t1 + right + 1, seqlen_k)
    before = 0 if left < 0 else _clamp_sum(t0 - left, t1 - left, seqlen_k)
    return upto - before


def causal_pairs(seqlen_q, seqlen_k):
    """Number of (query i, key j) pairs a bottom-right-aligned causal mask keeps: query i sees keys
    j <= i + seqlen_k - seqlen_q, i.e. clamp(i + seqlen_k - seqlen_q + 1, 0, seqlen_k) of them; summed
    over i (visible_pairs with causal=True)."""
    return visible_pairs(seqlen_q, seqlen_k, causal=True)


def attention_flops(shape, mode="fwd"):
    """FLOPs of one attention call, FlashAttention's convention.

    Forward: two matmuls, 2 * (2 * sq * sk * d) per head -> 4 * b * h * sq * sk * d. Causal with
    sq == sk: exactly half of that (what the FlashAttention papers and our ANCHORS use; the exact
    pair count s(s+1)/2 would add the diagonal, +1/s). Causal with sq != sk: 4 * b * h * d * (the exact
    number of unmasked pairs, bottom-right aligned). With a sliding window (causal or not): 4 * b * h * d
    * visible_pairs(), the exact number of pairs in the band. Backward ('bwd'): 2.5x forward (five matmuls
    instead of two). Softmax/exp work, and the softcap's tanh, are not counted."""
    b, h, d = shape.batch, shape.nheads, shape.headdim
    sq, sk = shape.seqlen_q, shape.seqlen_k
    if shape.has_window():
        fwd = 4 * b * h * d * visible_pairs(sq, sk, shape.causal, shape.window)
    elif not shape.causal:
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
