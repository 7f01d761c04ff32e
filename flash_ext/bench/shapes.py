"""Benchmark shapes and FlashAttention's FLOP convention."""
import dataclasses
import math


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
