"""Benchmark shapes (with their sliding window and softcap, if any; dense or variable-length batches),
the --varlen batch's lengths, and FlashAttention's FLOP convention."""
import dataclasses
import math
import random


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
    # A variable-length batch (--varlen): each sequence's length (its queries = its keys), the sequences
    # packed without padding; () for a dense batch. batch is then their number, seqlen_q = seqlen_k the longest.
    seqlens: tuple = ()

    @property
    def window(self):
        return (self.window_left, self.window_right)

    def is_varlen(self):
        return bool(self.seqlens)

    @property
    def tokens(self):
        """Query rows of the whole batch (packed: the sum of the lengths)."""
        return sum(self.seqlens) if self.seqlens else self.batch * self.seqlen_q

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
        if self.seqlens:
            return f"varlen {fmt_seqlen(self.tokens)}"
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
        """'d128 8k C b2 h16' (N = non-causal, C = causal; 'sq/sk' when they differ; 'varlen 32k' for a packed
        batch of 32k tokens in all, b its number of sequences), then ' w256,0' with a window and ' cap30' with
        a softcap."""
        return (f"d{self.headdim} {self.seq_label()} {'C' if self.causal else 'N'} b{self.batch} {self.heads_label()}"
                + self.variant_label())

    def to_dict(self):
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d):
        """From to_dict()'s keys; the window, softcap and seqlens keep their defaults when absent (older files)."""
        fields = {f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d}
        if "seqlens" in fields:
            fields["seqlens"] = tuple(fields["seqlens"])  # a JSON list; shapes are dict keys, so hashable
        return cls(**fields)


# The --varlen batch: 16 sequences whose lengths are drawn from 128..8k with a fixed seed, 32k tokens in all,
# timed next to flash_ext's dense kernel on the dense batch that does the same work (dense_equivalent).
VARLEN_SEQS = 16
VARLEN_TOKENS = 32768
VARLEN_MIN, VARLEN_MAX = 128, 8192
VARLEN_SEED = 0


def varlen_seqlens(num_seqs=VARLEN_SEQS, total=VARLEN_TOKENS, low=VARLEN_MIN, high=VARLEN_MAX, seed=VARLEN_SEED):
    """num_seqs lengths in [low, high] that sum to exactly `total`, the same for a given seed on any machine.

    Drawn log-uniformly (many short sequences, a few long ones, as in real data), then moved to the total
    without leaving the bounds: when the draw is too long, each length's excess over `low` shrinks by one
    factor; when it is too short, each one's room below `high`. Rounded by largest remainder."""
    if not (num_seqs >= 1 and 1 <= low <= high and num_seqs * low <= total <= num_seqs * high):
        raise ValueError(f"{num_seqs} lengths in [{low}, {high}] cannot sum to {total}")
    rng = random.Random(seed)
    drawn = [math.exp(rng.uniform(math.log(low), math.log(high))) for _ in range(num_seqs)]
    if sum(drawn) >= total:
        excess = [x - low for x in drawn]
        factor = (total - num_seqs * low) / sum(excess) if sum(excess) > 0 else 0.0
        exact = [low + e * factor for e in excess]
    else:
        room = [high - x for x in drawn]
        factor = (num_seqs * high - total) / sum(room)
        exact = [high - r * factor for r in room]
    lengths = [math.floor(x) for x in exact]
    # Largest remainder: the missing tokens go to the lengths rounded down the most (never past `high`,
    # since a length with a remainder is below it).
    by_remainder = sorted(range(num_seqs), key=lambda i: exact[i] - lengths[i], reverse=True)
    for i in by_remainder[:total - sum(lengths)]:
        lengths[i] += 1
    return tuple(lengths)


def varlen_shape(seqlens, nheads, nheads_kv, headdim, causal, window=NO_WINDOW, softcap=0.0):
    return Shape(len(seqlens), max(seqlens), max(seqlens), nheads, nheads_kv, headdim, causal, window[0], window[1],
                 softcap, tuple(seqlens))


def dense_equivalent(shape):
    """The dense batch that does a varlen shape's work: the yardstick of the varlen kernels.

    Its sequences have the length L = round(sum(s^2) / sum(s)) over the varlen lengths s, so that L * tokens =
    sum(s^2): as many (query, key) pairs as the varlen batch over as many tokens (a dense sequence of 8k has
    far more pairs per token than the varlen batch's shorter ones, and long sequences run at higher TFLOP/s);
    its batch is max(1, round(tokens / L)), so batch * L is the varlen tokens (and batch * L^2 its pairs) up to
    that rounding. The same heads, head dim, mask, window and softcap. The default --varlen batch (32k tokens)
    gives 11 x 3107."""
    if not shape.is_varlen():
        raise ValueError("dense_equivalent takes a varlen shape (one with seqlens)")
    tokens = shape.tokens
    seqlen = max(1, round(sum(s * s for s in shape.seqlens) / tokens))
    batch = max(1, round(tokens / seqlen))
    return dataclasses.replace(shape, batch=batch, seqlen_q=seqlen, seqlen_k=seqlen, seqlens=())


def dense_label(shape):
    """'11 x 3107': a varlen shape's dense_equivalent, batch x sequence length."""
    dense = dense_equivalent(shape)
    return f"{dense.batch} x {dense.seqlen_q}"


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

    A varlen batch: the sum over its sequences of 4 * h * d * visible_pairs(s, s) (causal and windows
    counting the exact visible pairs, s(s+1)/2 for causal), backward 2.5x.

    Forward: two matmuls, 2 * (2 * sq * sk * d) per head -> 4 * b * h * sq * sk * d. Causal with
    sq == sk: exactly half of that (what the FlashAttention papers and our ANCHORS use; the exact
    pair count s(s+1)/2 would add the diagonal, +1/s). Causal with sq != sk: 4 * b * h * d * (the exact
    number of unmasked pairs, bottom-right aligned). With a sliding window (causal or not): 4 * b * h * d
    * visible_pairs(), the exact number of pairs in the band. Backward ('bwd'): 2.5x forward (five matmuls
    instead of two). Softmax/exp work, and the softcap's tanh, are not counted."""
    b, h, d = shape.batch, shape.nheads, shape.headdim
    sq, sk = shape.seqlen_q, shape.seqlen_k
    if shape.is_varlen():
        fwd = 4 * h * d * sum(visible_pairs(s, s, shape.causal, shape.window) for s in shape.seqlens)
    elif shape.has_window():
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
