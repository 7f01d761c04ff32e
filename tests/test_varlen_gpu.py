"""Variable-length batches on the GPU (flash_attn_varlen_func, torch.ops.flash_ext.fwd_varlen / bwd_varlen /
attention_varlen) against the float64 references of flash_ext.reference, with FlashAttention's error rule as
tests/test_window_softcap_gpu.py applies it:

- forward: max|out - ref| <= 2 * max|out_pt - ref| + rounding noise over the whole packed batch, out_pt
  being attention_varlen_lowp (PyTorch attention in the inputs' dtype, per sequence); lse within 1e-3
  (+ softcap * 2^-10) of the float64 one where finite and -inf exactly where it is; out exactly 0 and lse
  -inf on every row outside the sequences' used ranges and on rows that see no key;
- backward (the op called directly, right after poisoning the memory the gradients land in): each gradient
  within 2x the error of attention_varlen_autograd in the inputs' dtype (+ rounding noise) of float64
  autograd of it; dq exactly 0 on rows that see no key or take no part, dk and dv exactly 0 on keys no
  query sees (unused ones included).

Every case draws fresh random inputs and poisons the memory its outputs will land in. The batches mix
lengths 1, 7, 113, 1000 and 2049, put empty sequences in the middle and at the end (no queries, no keys,
neither), give seqlen_k != seqlen_q per sequence (rows that see no key under causal), and use seqused_q /
seqused_k. Cases are chosen, not crossed: each head dim meets every batch and mask, with the head layout
(MHA, GQA, MQA) rotating. A batch of equal lengths must be bitwise the dense op's result on the same data
(same kernels, same arithmetic); the deterministic backward is bitwise reproducible.

Varlen runs the kernels of the dense op (flash_ext.has_kernel's table): a case whose kernel the build lacks
is skipped with the reason, as is every case when the build has no varlen ops.
"""
import math
import os

import pytest
import torch

import flash_ext
from flash_ext.ops import has_varlen_ops
from flash_ext.reference import attention_varlen_autograd, attention_varlen_lowp, attention_varlen_ref
from gpu_helpers import assert_grads_within_rule, assert_lse_matches, assert_out_within_rule, poison_allocator

pytestmark = pytest.mark.gpu

FWD_HEADDIMS = flash_ext.KERNEL_HEADDIMS
BWD_HEADDIMS = flash_ext.kernel_table.HEADDIMS_BY_DIRECTION["bwd"]
DTYPES = (torch.float16, torch.bfloat16)
DTYPE_IDS = {torch.float16: "fp16", torch.bfloat16: "bf16"}
NO_WINDOW = (-1, -1)
HEADS = [(4, 4), (8, 2), (6, 1)]  # MHA, GQA 8:2, MQA 6:1
# (seqlen_q, seqlen_k) per sequence.
BATCHES = {
    # odd lengths from 1 to past two K/V blocks, in one batch
    "mixed": [(1, 1), (7, 7), (113, 113), (1000, 1000), (2049, 2049)],
    # empty sequences in the middle and at the end; queries without keys (out 0, lse -inf), keys without queries
    "empty": [(300, 300), (0, 0), (77, 77), (0, 50), (129, 0), (64, 64), (0, 0)],
    # seqlen_k != seqlen_q per sequence: under causal the first rows of (113, 7) and (1000, 200) see no key
    "cross": [(7, 113), (113, 7), (200, 1000), (1000, 200), (1, 239), (511, 513)],
}
# Slots and the lengths used in them: rows past seqused_q and keys past seqused_k take no part.
SEQUSED_LENS = [(300, 400), (128, 128), (50, 60), (0, 10), (1000, 1000), (77, 0)]
SEQUSED_Q = [250, 128, 0, 0, 999, 70]
SEQUSED_K = [400, 100, 60, 5, 1, 0]
# (window, causal, softcap): a causal band, a two-sided band, softcap alone, both, one key, a look-ahead band.
MASKS = [((64, 0), True, 0.0), ((17, 5), False, 0.0), (NO_WINDOW, False, 10.0), ((100, 0), True, 5.0),
         ((0, 0), False, 0.0), ((-1, 40), False, 0.0)]
# Logits of a few units (q scaled by this) when a softcap is on, as in tests/test_window_softcap_gpu.py.
SOFTCAP_Q_SCALE = 3.0
TANH_APPROX_REL_ERR = 2.0 ** -10  # tanh.approx.f32's relative error bound, rounded up


@pytest.fixture(autouse=True)
def _require_varlen_ops():
    if not has_varlen_ops():
        pytest.skip("this flash_ext build has no varlen ops (torch.ops.flash_ext.fwd_varlen / bwd_varlen)")


def _offsets(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device="cuda")


class Batch:
    """A packed batch: q (total_q, nheads, headdim), k, v (total_k, nheads_kv, headdim), dout like q, their
    offsets and (optionally) used lengths, all fresh random values on the GPU."""

    def __init__(self, lens, nheads, nheads_kv, headdim, dtype, seed, q_scale=1.0, seqused_q=None, seqused_k=None):
        self.lens = list(lens)
        total_q, total_k = sum(a for a, _ in lens), sum(b for _, b in lens)
        gen = torch.Generator(device="cuda").manual_seed(seed)

        def randn(rows, heads):
            return torch.randn(rows, heads, headdim, device="cuda", dtype=dtype, generator=gen)

        self.q = (randn(total_q, nheads) * q_scale).to(dtype)
        self.k, self.v, self.dout = randn(total_k, nheads_kv), randn(total_k, nheads_kv), randn(total_q, nheads)
        self.cu_q, self.cu_k = _offsets(a for a, _ in lens), _offsets(b for _, b in lens)
        self.max_q, self.max_k = max((a for a, _ in lens), default=0), max((b for _, b in lens), default=0)
        self.used_q, self.used_k = seqused_q, seqused_k  # Python lists or None
        self.seqused_q = None if seqused_q is None else torch.tensor(seqused_q, dtype=torch.int32, device="cuda")
        self.seqused_k = None if seqused_k is None else torch.tensor(seqused_k, dtype=torch.int32, device="cuda")

    def args(self):
        """The varlen arguments of flash_attn_varlen_func."""
        return dict(cu_seqlens_q=self.cu_q, cu_seqlens_k=self.cu_k, max_seqlen_q=self.max_q, max_seqlen_k=self.max_k,
                    seqused_q=self.seqused_q, seqused_k=self.seqused_k)

    def op_args(self):
        """The same, positional, as the ops take them."""
        return (self.cu_q, self.cu_k, self.seqused_q, self.seqused_k, self.max_q, self.max_k)

    def ref_args(self):
        return dict(cu_seqlens_q=self.cu_q, cu_seqlens_k=self.cu_k, seqused_q=self.seqused_q,
                    seqused_k=self.seqused_k)

    def _unused(self, side):
        """Bool (total,) on the GPU: the rows (side 0, q) or keys (side 1, k/v) past each sequence's used length."""
        used = self.used_q if side == 0 else self.used_k
        flags = []
        for b, lengths in enumerate(self.lens):
            n = lengths[side]
            u = n if used is None else used[b]
            flags += [False] * u + [True] * (n - u)
        return torch.tensor(flags, dtype=torch.bool, device="cuda")

    def unused_rows(self):
        return self._unused(0)

    def unused_keys(self):
        return self._unused(1)


def _require_kernels(direction, headdim, dtype, causal, window):
    """The kernels the call may run: the causal flag's, and with a window both (a window runs on the causal
    kernel, one wider than the sequences on the non-causal one)."""
    for mask in ((False, True) if window != NO_WINDOW else (causal,)):
        if not flash_ext.has_kernel(direction, headdim, dtype, mask):
            pytest.skip(f"this build has no {DTYPE_IDS[dtype]} head dim {flash_ext.kernel_headdim(headdim, direction)} "
                        f"{'causal' if mask else 'non-causal'} {direction} kernel"
                        + (" (a window needs both)" if window != NO_WINDOW else ""))


def _forward(batch, causal, window=NO_WINDOW, softcap=0.0, **kwargs):
    return flash_ext.flash_attn_varlen_func(batch.q, batch.k, batch.v, **batch.args(), causal=causal,
                                            window_size=window, softcap=softcap, return_attn_probs=True, **kwargs)


def _lse_tol(softcap):
    return 1e-3 + softcap * TANH_APPROX_REL_ERR


def _check_forward(batch, causal, window=NO_WINDOW, softcap=0.0):
    q = batch.q
    total_q, nheads, headdim = q.shape
    _require_kernels("fwd", headdim, q.dtype, causal, window)
    poison_allocator(((total_q, nheads, headdim), q.dtype), ((nheads, total_q), torch.float32))
    out, lse = _forward(batch, causal, window, softcap)
    torch.cuda.synchronize()
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (nheads, total_q) and lse.dtype == torch.float32
    assert not out.isnan().any(), "NaN in out (unwritten or invalid elements)"
    assert not lse.isnan().any(), "NaN in lse (unwritten or invalid elements)"

    mask = dict(causal=causal, window_size=window, softcap=softcap, **batch.ref_args())
    out_ref, lse_ref = attention_varlen_ref(q, batch.k, batch.v, **mask)
    out_pt = attention_varlen_lowp(q, batch.k, batch.v, **mask)
    assert_out_within_rule(out, out_ref, out_pt, q.dtype)
    finite = assert_lse_matches(lse, lse_ref, _lse_tol(softcap))
    assert torch.all(out[~finite.T] == 0), "rows that see no key: out exactly 0"
    unused = batch.unused_rows()  # independent of the reference: from the lengths alone
    assert torch.all(out[unused] == 0) and torch.all(lse[:, unused] == -math.inf), "rows that take no part"
    return out, lse


def _reference_grads(batch, causal, window, softcap, dlse=None, upcast=True):
    dtype = torch.float64 if upcast else batch.q.dtype
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (batch.q, batch.k, batch.v)]
    out, lse = attention_varlen_autograd(*leaves, causal=causal, upcast=upcast, window_size=window, softcap=softcap,
                                         **batch.ref_args())
    outputs, grads = [out], [batch.dout.to(dtype)]
    if dlse is not None:
        outputs.append(torch.where(torch.isfinite(lse), lse, 0.0))
        grads.append(dlse.to(lse.dtype))
    return torch.autograd.grad(outputs, leaves, grads, allow_unused=True, materialize_grads=True)


def _backward(batch, out, lse, causal, window=NO_WINDOW, softcap=0.0, deterministic=False, dlse=None):
    """torch.ops.flash_ext.bwd_varlen with the default scale."""
    return torch.ops.flash_ext.bwd_varlen(batch.dout, batch.q, batch.k, batch.v, out, lse, dlse, *batch.op_args(),
                                          1.0 / math.sqrt(batch.q.shape[-1]), causal, deterministic, *window, softcap)


def _check_grads(batch, causal, window=NO_WINDOW, softcap=0.0, deterministic=False, dlse=None):
    q, k, v = batch.q, batch.k, batch.v
    _require_kernels("fwd", q.shape[-1], q.dtype, causal, window)
    _require_kernels("bwd", q.shape[-1], q.dtype, causal, window)
    out, lse = _forward(batch, causal, window, softcap)
    poison_allocator((q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype))
    dq, dk, dv = _backward(batch, out, lse, causal, window, softcap, deterministic, dlse)
    torch.cuda.synchronize()
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dq.dtype == dk.dtype == dv.dtype == q.dtype
    ref = _reference_grads(batch, causal, window, softcap, dlse, upcast=True)
    low = _reference_grads(batch, causal, window, softcap, dlse, upcast=False)
    assert_grads_within_rule((dq, dk, dv), ref, low, q.dtype)
    # Rows that see no key (lse -inf: none of their heads sees one) or take no part: dq exactly 0.
    blind = (lse == -math.inf).all(dim=0) | batch.unused_rows()
    assert torch.all(dq[blind] == 0), "rows that see no key or take no part: dq exactly 0"
    # Keys no query sees (float64 dv exactly 0 in every head: no P_ij > 0), unused ones included: dk, dv 0.
    unseen = (ref[2] == 0).flatten(1).all(dim=1)
    assert torch.all(unseen[batch.unused_keys()]), "the reference gives unused keys zero gradients"
    assert torch.all(dk[unseen] == 0) and torch.all(dv[unseen] == 0), "keys no query sees: dk, dv exactly 0"
    return dq, dk, dv


def _cases(headdims):
    """pytest.params (headdim, batch name, causal, heads): every head dim meets every batch and mask; the
    head layout rotates."""
    cases = []
    for hi, headdim in enumerate(headdims):
        for bi, name in enumerate(BATCHES):
            for causal in (False, True):
                heads = HEADS[(hi + bi + causal) % len(HEADS)]
                label = f"d{headdim}-{name}-{'causal' if causal else 'full'}-h{heads[0]}kv{heads[1]}"
                cases.append(pytest.param(headdim, name, causal, heads, id=label))
    return cases


def _mask_label(window, causal, softcap):
    label = "causal" if causal else "full"
    if window != NO_WINDOW:
        label = f"w{window[0]}_{window[1]}-{label}"
    return label + (f"-cap{softcap:g}" if softcap else "")


def _mask_cases(headdims):
    """pytest.params (headdim, window, causal, softcap, batch name, heads, dtype): every head dim with every
    mask of MASKS, the batch, heads and dtype rotating."""
    cases = []
    names = list(BATCHES)
    for hi, headdim in enumerate(headdims):
        for mi, (window, causal, softcap) in enumerate(MASKS):
            name = names[(mi + hi) % len(names)]
            heads = HEADS[(mi + 2 * hi) % len(HEADS)]
            dtype = DTYPES[(mi + hi) % len(DTYPES)]
            cases.append(pytest.param(headdim, window, causal, softcap, name, heads, dtype,
                                      id=f"d{headdim}-{_mask_label(window, causal, softcap)}-{name}"
                                         f"-h{heads[0]}kv{heads[1]}-{DTYPE_IDS[dtype]}"))
    return cases


def _seed(*parts):
    return hash(parts) % (2**31)


# ------------------------------------------------------------------------------------------------
# Forward and backward against the references
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("headdim,name,causal,heads", _cases(FWD_HEADDIMS))
def test_varlen_forward(headdim, name, causal, heads, dtype):
    batch = Batch(BATCHES[name], *heads, headdim, dtype, seed=_seed(headdim, name, causal, str(dtype)))
    _check_forward(batch, causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("headdim,name,causal,heads", _cases(BWD_HEADDIMS))
def test_varlen_backward(headdim, name, causal, heads, dtype):
    batch = Batch(BATCHES[name], *heads, headdim, dtype, seed=_seed(headdim, name, causal, str(dtype), "bwd"))
    _check_grads(batch, causal)


@pytest.mark.parametrize("headdim,window,causal,softcap,name,heads,dtype", _mask_cases(FWD_HEADDIMS))
def test_varlen_window_softcap_forward(headdim, window, causal, softcap, name, heads, dtype):
    batch = Batch(BATCHES[name], *heads, headdim, dtype, seed=_seed(headdim, window, causal, softcap, name),
                  q_scale=SOFTCAP_Q_SCALE if softcap else 1.0)
    _check_forward(batch, causal, window, softcap)


@pytest.mark.parametrize("headdim,window,causal,softcap,name,heads,dtype", _mask_cases(BWD_HEADDIMS))
def test_varlen_window_softcap_backward(headdim, window, causal, softcap, name, heads, dtype):
    batch = Batch(BATCHES[name], *heads, headdim, dtype, seed=_seed(headdim, window, causal, softcap, name, "bwd"),
                  q_scale=SOFTCAP_Q_SCALE if softcap else 1.0)
    _check_grads(batch, causal, window, softcap)


# (which of seqused_q / seqused_k are given) rotates with the head dim and the mask.
SEQUSED_VARIANTS = [("q", "k"), ("q",), ("k",)]
SEQUSED_MASKS = [(NO_WINDOW, False), (NO_WINDOW, True), ((32, 0), True)]


def _seqused_cases(headdims):
    cases = []
    for hi, headdim in enumerate(headdims):
        for mi, (window, causal) in enumerate(SEQUSED_MASKS):
            variant = SEQUSED_VARIANTS[(hi + mi) % len(SEQUSED_VARIANTS)]
            heads = HEADS[(hi + 2 * mi) % len(HEADS)]
            dtype = DTYPES[(hi + mi) % len(DTYPES)]
            cases.append(pytest.param(headdim, window, causal, variant, heads, dtype,
                                      id=f"d{headdim}-{_mask_label(window, causal, 0.0)}-seqused_{'_'.join(variant)}"
                                         f"-h{heads[0]}kv{heads[1]}-{DTYPE_IDS[dtype]}"))
    return cases


def _seqused_batch(headdim, heads, variant, dtype, seed):
    return Batch(SEQUSED_LENS, *heads, headdim, dtype, seed=seed, seqused_q=SEQUSED_Q if "q" in variant else None,
                 seqused_k=SEQUSED_K if "k" in variant else None)


@pytest.mark.parametrize("headdim,window,causal,variant,heads,dtype", _seqused_cases(FWD_HEADDIMS))
def test_varlen_seqused_forward(headdim, window, causal, variant, heads, dtype):
    """Only the first seqused[b] rows (keys) of each sequence take part; the masks align to the used block."""
    batch = _seqused_batch(headdim, heads, variant, dtype, _seed(headdim, window, causal, variant))
    _check_forward(batch, causal, window)


@pytest.mark.parametrize("headdim,window,causal,variant,heads,dtype", _seqused_cases(BWD_HEADDIMS))
def test_varlen_seqused_backward(headdim, window, causal, variant, heads, dtype):
    batch = _seqused_batch(headdim, heads, variant, dtype, _seed(headdim, window, causal, variant, "bwd"))
    _check_grads(batch, causal, window)


@pytest.mark.parametrize("headdim", [40, 136, 160, 192, 200])
def test_varlen_headdims_between_kernels(headdim):
    """Head dims without a kernel of their own run on the next size up, both ways (136..192: the d256
    backward kernel with its last head-dim box left out, hopper/head_dim_boxes.h)."""
    batch = Batch(BATCHES["cross"], 4, 2, headdim, torch.bfloat16, seed=headdim)
    _check_forward(batch, causal=True)
    _check_grads(batch, causal=False, window=(30, 20))


@pytest.mark.parametrize("headdim", [160, 192])
def test_varlen_backward_box_past_head_dim(headdim):
    """The case that faulted (illegal address) before the d256 backward kernel left out the head-dim box
    wholly past a 192-wide head: two sequences that fill their tensors, seqused given, in a fresh process
    every time. Here it runs wherever the allocator puts the tensors, and must match the reference."""
    batch = Batch([(300, 300), (300, 300)], 4, 4, headdim, torch.bfloat16, seed=headdim, seqused_q=[300, 300],
                  seqused_k=[300, 300])
    _check_grads(batch, causal=False)


_FRESH_PROCESS_CASE = """
import math, torch, flash_ext
hd = {headdim}
q, k, v, dout = (torch.randn(600, 4, hd, device="cuda", dtype=torch.bfloat16) for _ in range(4))
cu = torch.tensor([0, 300, 600], dtype=torch.int32, device="cuda")
used = torch.tensor([300, 300], dtype=torch.int32, device="cuda")
args = (cu, cu, used, used, 300, 300, 1 / math.sqrt(hd), False)
out, lse = torch.ops.flash_ext.fwd_varlen(q, k, v, *args, -1, -1, 0.0)
grads = torch.ops.flash_ext.bwd_varlen(dout, q, k, v, out, lse, None, *args, False, -1, -1, 0.0)
assert all(bool(torch.isfinite(g).all()) for g in grads)
"""


@pytest.mark.parametrize("headdim", [160, 192])
def test_varlen_backward_box_past_head_dim_fresh_process(headdim):
    """The same in a fresh process, where it faulted every time (this allocation order put a tensor where
    the TMA unit's access for the empty box failed)."""
    import subprocess
    import sys
    result = subprocess.run([sys.executable, "-c", _FRESH_PROCESS_CASE.format(headdim=headdim)], capture_output=True,
                            text=True, timeout=120, env={**os.environ, "CUDA_LAUNCH_BLOCKING": "1"})
    assert result.returncode == 0, result.stderr[-2000:]


# ------------------------------------------------------------------------------------------------
# Bitwise: equal lengths are the dense op; the deterministic backward reproduces itself
# ------------------------------------------------------------------------------------------------
def _dense_cases():
    cases = []
    for headdim in FWD_HEADDIMS:
        for causal in (False, True):
            for heads, seqlens in (((4, 4), (300, 300)), ((8, 2), (200, 333))):
                cases.append(pytest.param(headdim, causal, heads, seqlens, NO_WINDOW, 0.0,
                                          id=f"d{headdim}-{'causal' if causal else 'full'}-h{heads[0]}kv{heads[1]}"
                                             f"-sq{seqlens[0]}sk{seqlens[1]}"))
    for window, causal, softcap in (((48, 0), True, 5.0), ((16, 16), False, 0.0)):
        cases.append(pytest.param(128, causal, (8, 2), (300, 300), window, softcap,
                                  id=f"d128-{_mask_label(window, causal, softcap)}-h8kv2-sq300sk300"))
    return cases


@pytest.mark.parametrize("headdim,causal,heads,seqlens,window,softcap", _dense_cases())
def test_equal_lengths_bitwise_equal_to_dense(headdim, causal, heads, seqlens, window, softcap):
    """Three sequences of one length pair are the dense batch reshaped: out, lse, and (deterministic,
    with dlse) dq, dk, dv identical bit for bit."""
    (nheads, nheads_kv), (seqlen_q, seqlen_k), nbatch = heads, seqlens, 3
    dtype = torch.bfloat16
    _require_kernels("fwd", headdim, dtype, causal, window)
    batch = Batch([seqlens] * nbatch, nheads, nheads_kv, headdim, dtype, seed=_seed(headdim, causal, heads, seqlens),
                  q_scale=2.0)
    mask = dict(causal=causal, window_size=window, softcap=softcap)
    dense = [t.view(nbatch, -1, *t.shape[1:]) for t in (batch.q, batch.k, batch.v, batch.dout)]
    out_d, lse_d = flash_ext.forward(*dense[:3], **mask)
    out, lse = _forward(batch, causal, window, softcap)
    assert torch.equal(out, out_d.reshape(out.shape))
    assert torch.equal(lse, lse_d.transpose(0, 1).reshape(lse.shape))
    masks = (False, True) if window != NO_WINDOW else (causal,)
    if not all(flash_ext.has_kernel("bwd", headdim, dtype, m) for m in masks):
        return  # the forward's comparison stands; this build cannot run the backward
    dlse_d = torch.randn(lse_d.shape, device="cuda")
    dlse_d[torch.isinf(lse_d)] = 0.0
    grads_d = flash_ext.backward(dense[3], *dense[:3], out_d, lse_d, dlse=dlse_d, deterministic=True, **mask)
    dlse = dlse_d.transpose(0, 1).reshape(lse.shape).contiguous()
    grads = _backward(batch, out, lse, causal, window, softcap, deterministic=True, dlse=dlse)
    for name, g, g_d in zip(("dq", "dk", "dv"), grads, grads_d):
        assert torch.equal(g, g_d.reshape(g.shape)), f"{name} differs from the dense op's"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", BWD_HEADDIMS)
def test_varlen_backward_deterministic_bitwise(headdim, causal):
    """deterministic=True: five backward calls give the same bits, and so does autograd through
    flash_attn_varlen_func (dlse included); the result passes the error rule."""
    _require_kernels("fwd", headdim, torch.bfloat16, causal, NO_WINDOW)
    _require_kernels("bwd", headdim, torch.bfloat16, causal, NO_WINDOW)
    batch = Batch(BATCHES["mixed"] + BATCHES["cross"], 8, 2, headdim, torch.bfloat16, seed=_seed(headdim, causal))
    out, lse = _forward(batch, causal)
    dlse = torch.randn(lse.shape, device="cuda")
    first = _backward(batch, out, lse, causal, deterministic=True, dlse=dlse)
    for _ in range(4):
        again = _backward(batch, out, lse, causal, deterministic=True, dlse=dlse)
        for a, b in zip(first, again):
            assert torch.equal(a, b)
    leaves = [t.detach().clone().requires_grad_(True) for t in (batch.q, batch.k, batch.v)]
    out_ag, lse_ag = flash_ext.flash_attn_varlen_func(*leaves, **batch.args(), causal=causal, deterministic=True,
                                                      return_attn_probs=True)
    assert torch.equal(out_ag, out) and torch.equal(lse_ag, lse)
    grads = torch.autograd.grad([out_ag, lse_ag], leaves, [batch.dout, dlse])
    for a, b in zip(grads, first):
        assert torch.equal(a, b)
    _check_grads(batch, causal, deterministic=True, dlse=torch.where(torch.isinf(lse), 0.0, dlse))


_DECREASING_OFFSETS_CASE = """
import math, torch, flash_ext
hd, causal = {headdim}, {causal}
def i32(x):
    return torch.tensor(x, dtype=torch.int32, device="cuda")
q, dout = (torch.randn(300, 4, hd, device="cuda", dtype=torch.bfloat16) for _ in range(2))
k, v = (torch.randn(260, 2, hd, device="cuda", dtype=torch.bfloat16) for _ in range(2))
results = []
# Offsets that go back, and their running maximum: entries 1 (and 2, for k) are empty sequences.
for cu_q, cu_k in (([0, 200, 100, 250, 300], [0, 150, 20, 260, 100]), ([0, 200, 200, 250, 300], [0, 150, 150, 260, 260])):
    args = (i32(cu_q), i32(cu_k), None, None, 300, 260, 1 / math.sqrt(hd), causal, -1, -1, 0.0)
    out, lse = torch.ops.flash_ext.fwd_varlen(q, k, v, *args)
    grads = torch.ops.flash_ext.bwd_varlen(dout, q, k, v, out, lse, None, *args[:-3], True, *args[-3:])
    torch.cuda.synchronize()
    results.append((out, lse, *grads))
for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results):
    assert torch.equal(a, b), name + " differs from the running maximum's"
"""


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", BWD_HEADDIMS)
def test_decreasing_offsets_are_empty_sequences(headdim, causal):
    """Offsets that go back (which flash_attn_varlen_func rejects in eager mode, but not under torch.compile or
    graph capture) are taken as their running maximum, so that no two sequences share rows: the same bits as
    those offsets. Sequences that shared blocks of the backward's statistics made the deterministic backward
    wait forever (seen at d96: their semaphores counted by two sequences at once): run in a process of its
    own, with a time limit, so that a hang fails this test alone."""
    import subprocess
    import sys
    _require_kernels("bwd", headdim, torch.bfloat16, causal, NO_WINDOW)
    case = _DECREASING_OFFSETS_CASE.format(headdim=headdim, causal=causal)
    try:
        result = subprocess.run([sys.executable, "-c", case], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the calls with decreasing offsets did not finish in 120 s (a deterministic backward that waits forever)")
    assert result.returncode == 0, result.stderr[-2000:]


# ------------------------------------------------------------------------------------------------
# Empty batches, autograd's strided gradients, entry points
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lens", [[], [(0, 0)], [(0, 0), (0, 0)], [(0, 5)], [(3, 0)], [(0, 5), (3, 0)]],
                         ids=["batch0", "one-empty", "two-empty", "keys-only", "queries-only", "both"])
def test_varlen_empty(lens):
    """Nothing to compute: empty outputs, out = 0 and lse = -inf for rows without keys, zero gradients."""
    batch = Batch(lens, 4, 2, 64, torch.bfloat16, seed=len(lens))
    leaves = [t.detach().clone().requires_grad_(True) for t in (batch.q, batch.k, batch.v)]
    out, lse = flash_ext.flash_attn_varlen_func(*leaves, **batch.args(), causal=True, return_attn_probs=True)
    assert out.shape == batch.q.shape and lse.shape == (4, batch.q.shape[0])
    assert torch.all(out == 0) and torch.all(lse == -math.inf)
    grads = torch.autograd.grad(out.float().sum() + lse.clamp(min=0).sum(), leaves)
    for g, t in zip(grads, leaves):
        assert g.shape == t.shape and torch.all(g == 0)


def test_autograd_strided_gradients_and_no_lse():
    """A sum() hands autograd an expanded (stride 0) dout and dlse: made kernel-readable, not rejected; an
    unused lse gives no dlse. Both match the op called with dense gradients."""
    _require_kernels("bwd", 128, torch.bfloat16, True, NO_WINDOW)
    _require_kernels("fwd", 128, torch.bfloat16, True, NO_WINDOW)
    batch = Batch(BATCHES["empty"], 8, 2, 128, torch.bfloat16, seed=21)
    leaves = [t.detach().clone().requires_grad_(True) for t in (batch.q, batch.k, batch.v)]
    out, lse = flash_ext.flash_attn_varlen_func(*leaves, **batch.args(), causal=True, deterministic=True,
                                                return_attn_probs=True)
    grads = torch.autograd.grad(out.sum() + torch.where(torch.isinf(lse), 0.0, lse).sum(), leaves)
    dlse = torch.where(torch.isinf(lse), 0.0, 1.0).detach()
    batch.dout = torch.ones_like(batch.dout)
    expected = _backward(batch, out.detach(), lse.detach(), True, deterministic=True, dlse=dlse)
    for g, e in zip(grads, expected):
        assert torch.equal(g, e)
    out_only = flash_ext.flash_attn_varlen_func(*leaves, **batch.args(), causal=True, deterministic=True)
    grads = torch.autograd.grad(out_only, leaves, torch.ones_like(out_only))
    expected = _backward(batch, out.detach(), lse.detach(), True, deterministic=True)
    for g, e in zip(grads, expected):
        assert torch.equal(g, e)


def test_torch_compile_fullgraph_matches_eager():
    """torch.compile(fullgraph=True) of a model over a packed batch (the offsets a tensor input, the value
    checks skipped while tracing): forward bitwise equal to eager, gradients close, causal and with a window
    and softcap."""
    _require_kernels("bwd", 64, torch.bfloat16, True, (32, 0))
    _require_kernels("fwd", 64, torch.bfloat16, True, (32, 0))
    lens = [100, 1, 37, 250]
    cu = _offsets(lens)

    class Attention(torch.nn.Module):
        def __init__(self, **mask):
            super().__init__()
            self.mask = mask
            self.qkv = torch.nn.Linear(256, 3 * 256, dtype=torch.bfloat16)

        def forward(self, x, cu_seqlens):
            q, k, v = self.qkv(x).view(x.shape[0], 3, 4, 64).unbind(1)
            return flash_ext.flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max(lens), max(lens),
                                                    deterministic=True, **self.mask).flatten(1)

    x = torch.randn(sum(lens), 256, device="cuda", dtype=torch.bfloat16)
    for mask in (dict(causal=True), dict(causal=True, window_size=(32, 0), softcap=20.0)):
        torch.manual_seed(0)
        model = Attention(**mask).cuda()
        eager_out = model(x, cu)
        eager_out.float().square().sum().backward()
        eager_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        compiled = torch.compile(model, fullgraph=True)
        out = compiled(x, cu)
        out.float().square().sum().backward()
        assert torch.equal(out, eager_out)
        for p, g in zip(model.parameters(), eager_grads):
            torch.testing.assert_close(p.grad, g, rtol=1e-2, atol=1e-2)


def test_opcheck():
    _require_kernels("bwd", 64, torch.bfloat16, True, (16, 0))
    _require_kernels("fwd", 64, torch.bfloat16, True, (16, 0))
    batch = Batch([(70, 90), (0, 3), (33, 20)], 4, 2, 64, torch.bfloat16, seed=4, seqused_q=[60, 0, 33],
                  seqused_k=[90, 1, 19])
    scale, window, softcap = 0.125, (16, 0), 5.0
    args = (*batch.op_args(), scale, True)
    torch.library.opcheck(torch.ops.flash_ext.fwd_varlen, (batch.q, batch.k, batch.v, *args, *window, softcap))
    out, lse = torch.ops.flash_ext.fwd_varlen(batch.q, batch.k, batch.v, *args, *window, softcap)
    torch.library.opcheck(torch.ops.flash_ext.bwd_varlen,
                          (batch.dout, batch.q, batch.k, batch.v, out, lse, None, *args, True, *window, softcap))
    dlse = torch.randn(lse.shape, device="cuda")
    torch.library.opcheck(torch.ops.flash_ext.bwd_varlen,
                          (batch.dout, batch.q, batch.k, batch.v, out, lse, dlse, *args, True, *window, softcap))
    leaves = [t.detach().clone().requires_grad_(True) for t in (batch.q, batch.k, batch.v)]
    torch.library.opcheck(torch.ops.flash_ext.attention_varlen, (*leaves, *args, True, *window, softcap))


def test_cuda_graph_capture():
    """While a CUDA graph is captured the value checks (a copy to the host) are skipped: the call captures,
    and its replay gives the eager result."""
    _require_kernels("fwd", 128, torch.bfloat16, True, NO_WINDOW)
    batch = Batch(BATCHES["mixed"], 8, 2, 128, torch.bfloat16, seed=5)
    eager_out, eager_lse = _forward(batch, True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch.cuda.graphs recommends
        _forward(batch, True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = _forward(batch, True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)


def test_value_checks_on_gpu_tensors():
    """The eager checks read CUDA offsets to the host and name the argument and index."""
    batch = Batch(BATCHES["empty"], 4, 2, 64, torch.bfloat16, seed=6)
    bad = batch.cu_q.clone()
    bad[3] = bad[2] - 1
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be non-decreasing: cu_seqlens_q\[3\]"):
        flash_ext.flash_attn_varlen_func(batch.q, batch.k, batch.v, **{**batch.args(), "cu_seqlens_q": bad})
    with pytest.raises(ValueError, match=r"max_seqlen_k = 299 is smaller than the longest sequence: sequence 0"):
        flash_ext.flash_attn_varlen_func(batch.q, batch.k, batch.v, **{**batch.args(), "max_seqlen_k": 299})
    used = torch.tensor([300, 0, 78, 0, 0, 0, 0], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match=r"seqused_q\[2\] = 78 is out of range: sequence 2 has 77 rows"):
        flash_ext.flash_attn_varlen_func(batch.q, batch.k, batch.v, **{**batch.args(), "seqused_q": used})
