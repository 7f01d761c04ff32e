"""CPU tests of the variable-length entry point and references (no GPU, no compiled extension needed):

- flash_attn_varlen_func's argument checks: FA3 keywords, Python types, the ranks, dtypes and lengths of
  the offsets, and in eager mode their values (read to the host): each bad input raises before anything
  reaches the op (the no_op_calls fixture fails the test otherwise), naming the argument and the index;
- the value checks are skipped while torch.compile traces and for meta tensors;
- the varlen references (attention_varlen_ref / _lowp / _autograd) against the dense ones on equal lengths,
  and against a naive per-sequence computation on mixed lengths, empty sequences and seqused.
"""
import math

import pytest
import torch

import flash_ext
from flash_ext import fa3_compat, reference
from flash_ext.reference import attention_varlen_autograd, attention_varlen_lowp, attention_varlen_ref

# (seqlen_q, seqlen_k) per sequence: keys longer and shorter than queries, and a sequence without queries.
LENS = [(5, 7), (0, 3), (9, 9), (4, 2)]


class ReachedOp(Exception):
    """Raised instead of calling the op: the Python checks all passed."""


@pytest.fixture
def no_op_calls(monkeypatch):
    def reached():
        raise ReachedOp

    monkeypatch.setattr(fa3_compat, "_require_varlen_ops", reached)


def offsets(lengths, dtype=torch.int32):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=dtype)


def make(lens=LENS, nheads=4, nheads_kv=2, headdim=64, dtype=torch.float16, **kwargs):
    """Valid arguments of flash_attn_varlen_func (CPU tensors), then the given changes."""
    cu_q, cu_k = offsets([a for a, _ in lens]), offsets([b for _, b in lens])
    args = dict(
        q=torch.randn(int(cu_q[-1]), nheads, headdim).to(dtype),
        k=torch.randn(int(cu_k[-1]), nheads_kv, headdim).to(dtype),
        v=torch.randn(int(cu_k[-1]), nheads_kv, headdim).to(dtype),
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        max_seqlen_q=max((a for a, _ in lens), default=0), max_seqlen_k=max((b for _, b in lens), default=0),
    )
    args.update(kwargs)
    return args


def call(**kwargs):
    return flash_ext.flash_attn_varlen_func(**make(**kwargs))


def test_valid_arguments_reach_the_op(no_op_calls):
    seqused = dict(seqused_q=torch.tensor([5, 0, 0, 4], dtype=torch.int32),
                   seqused_k=torch.tensor([0, 3, 9, 1], dtype=torch.int32))
    for kwargs in (dict(), dict(causal=True, window_size=(3, 0), softcap=5.0, deterministic=True), seqused,
                   dict(max_seqlen_q=100, max_seqlen_k=10**6), dict(lens=[]), dict(lens=[(0, 0), (0, 0)]),
                   dict(lens=[(3, 0)]), dict(return_attn_probs=True, softmax_scale=0.1),
                   # FA3's keywords at their neutral values
                   dict(qv=None, attention_chunk=0, num_splits=1, pack_gqa=None, sm_margin=0, q_descale=None,
                        window_size=[-1, -1])):
        with pytest.raises(ReachedOp):
            call(**kwargs)


# ------------------------------------------------------------------------------------------------
# Offsets: types, ranks, lengths (checked on every call), then values (eager)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["cu_seqlens_q", "cu_seqlens_k"])
def test_offsets_dtype_int64(name, no_op_calls):
    with pytest.raises(TypeError, match=rf"{name} must be torch.int32, got torch.int64"):
        call(**{name: make()[name].long()})


@pytest.mark.parametrize("name", ["cu_seqlens_q", "cu_seqlens_k"])
def test_offsets_not_1d(name, no_op_calls):
    with pytest.raises(ValueError, match=rf"{name} must be 1-D \(batch \+ 1,\), got shape \(1, 5\)"):
        call(**{name: make()[name][None]})


def test_offsets_not_a_tensor(no_op_calls):
    with pytest.raises(TypeError, match=r"cu_seqlens_k must be a torch.Tensor, got list"):
        call(cu_seqlens_k=[0, 7, 10, 19, 21])


def test_offsets_lengths_differ(no_op_calls):
    with pytest.raises(ValueError, match=r"cu_seqlens_q and cu_seqlens_k must have the same length \(batch \+ 1\), "
                                         r"got 5 and 4"):
        call(cu_seqlens_k=offsets([7, 3, 11]))


def test_offsets_empty(no_op_calls):
    empty = torch.zeros(0, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must have batch \+ 1 >= 1 entries"):
        call(cu_seqlens_q=empty, cu_seqlens_k=empty)


@pytest.mark.parametrize("name", ["cu_seqlens_q", "cu_seqlens_k"])
def test_offsets_first_entry_not_zero(name, no_op_calls):
    bad = make()[name] + 1
    with pytest.raises(ValueError, match=rf"{name}\[0\] must be 0, got 1"):
        call(**{name: bad})


def test_offsets_decreasing(no_op_calls):
    # k's offsets 0, 7, 10, 19, 21 with entry 2 moved below entry 1
    with pytest.raises(ValueError, match=r"cu_seqlens_k must be non-decreasing: cu_seqlens_k\[2\] = 6 < "
                                         r"cu_seqlens_k\[1\] = 7"):
        call(cu_seqlens_k=torch.tensor([0, 7, 6, 19, 21], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be non-decreasing: cu_seqlens_q\[4\] = 13 < "
                                         r"cu_seqlens_q\[3\] = 14"):
        call(cu_seqlens_q=torch.tensor([0, 5, 5, 14, 13], dtype=torch.int32))


def test_offsets_last_entry_not_the_total(no_op_calls):
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] \(index 4\) = 17 must equal q.shape\[0\] = 18, the total "
                                         r"number of q rows"):
        call(cu_seqlens_q=torch.tensor([0, 5, 5, 14, 17], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cu_seqlens_k\[-1\] \(index 4\) = 22 must equal k.shape\[0\] = 21"):
        call(cu_seqlens_k=torch.tensor([0, 7, 10, 19, 22], dtype=torch.int32))


def test_max_seqlen_too_small(no_op_calls):
    with pytest.raises(ValueError, match=r"max_seqlen_q = 8 is smaller than the longest sequence: sequence 2 has 9 "
                                         r"rows \(cu_seqlens_q\[3\] - cu_seqlens_q\[2\]\)"):
        call(max_seqlen_q=8)
    with pytest.raises(ValueError, match=r"max_seqlen_k = 0 is smaller than the longest sequence: sequence 2 has 9"):
        call(max_seqlen_k=0)


@pytest.mark.parametrize("name", ["max_seqlen_q", "max_seqlen_k"])
def test_max_seqlen_type_and_sign(name, no_op_calls):
    for bad in (9.0, True, None, torch.tensor(9), "9"):
        with pytest.raises(TypeError, match=rf"{name} must be an int, got"):
            call(**{name: bad})
    with pytest.raises(ValueError, match=rf"{name} must be >= 0, got -1"):
        call(**{name: -1})


@pytest.mark.parametrize("side", ["q", "k"])
def test_seqused_out_of_range(side, no_op_calls):
    name = f"seqused_{side}"
    lengths = [a if side == "q" else b for a, b in LENS]
    too_long = torch.tensor(lengths, dtype=torch.int32)
    too_long[1] += 1
    with pytest.raises(ValueError, match=rf"{name}\[1\] = {lengths[1] + 1} is out of range: sequence 1 has "
                                         rf"{lengths[1]} rows \(cu_seqlens_{side}\[2\] - cu_seqlens_{side}\[1\]\)"):
        call(**{name: too_long})
    negative = torch.tensor(lengths, dtype=torch.int32)
    negative[3] = -1
    with pytest.raises(ValueError, match=rf"{name}\[3\] = -1 is out of range"):
        call(**{name: negative})


@pytest.mark.parametrize("name", ["seqused_q", "seqused_k"])
def test_seqused_dtype_rank_and_length(name, no_op_calls):
    good = torch.tensor([1, 0, 1, 1], dtype=torch.int32)
    with pytest.raises(TypeError, match=rf"{name} must be torch.int32, got torch.int64"):
        call(**{name: good.long()})
    with pytest.raises(ValueError, match=rf"{name} must be 1-D \(batch,\)"):
        call(**{name: good[None]})
    with pytest.raises(ValueError, match=rf"{name} must have shape \(batch,\) = \(4,\), got \(5,\)"):
        call(**{name: torch.ones(5, dtype=torch.int32)})
    with pytest.raises(TypeError, match=rf"{name} must be a torch.Tensor, got list"):
        call(**{name: [1, 0, 1, 1]})


# ------------------------------------------------------------------------------------------------
# FA3's keywords, FP8, the tensors' ranks and the Python-typed arguments
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,value", [("attention_chunk", 64), ("num_splits", 0), ("num_splits", 4),
                                        ("pack_gqa", True), ("pack_gqa", False), ("sm_margin", 8)])
def test_unsupported_fa3_keywords(name, value, no_op_calls):
    with pytest.raises(NotImplementedError, match=rf"flash_attn_varlen_func: {name}={value!r} is not supported by "
                                                  "flash_ext yet"):
        call(**{name: value})


def test_qv_unsupported(no_op_calls):
    with pytest.raises(NotImplementedError, match=r"flash_attn_varlen_func: qv=.* is not supported"):
        call(qv=torch.zeros(18, 4, 64).half())


@pytest.mark.parametrize("name", ["q_descale", "k_descale", "v_descale"])
def test_fp8_descales_unsupported(name, no_op_calls):
    with pytest.raises(NotImplementedError, match=rf"flash_attn_varlen_func: {name} is not supported: flash_ext has no "
                                                  "FP8 variable-length attention"):
        call(**{name: torch.ones(4, 2)})


def test_fp8_inputs_unsupported(no_op_calls):
    args = make()
    for name in ("q", "k", "v"):
        args[name] = args[name].to(torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match=r"FP8 .* not supported for variable-length batches"):
        flash_ext.flash_attn_varlen_func(**args)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_inputs_must_be_3d(name, no_op_calls):
    bad = make()[name][None]
    with pytest.raises(ValueError, match=rf"flash_attn_varlen_func: {name} must have 3 dims .*got shape \(1, "):
        call(**{name: bad})


def test_inputs_must_be_tensors(no_op_calls):
    with pytest.raises(TypeError, match=r"v must be a torch.Tensor, got NoneType"):
        call(v=None)


@pytest.mark.parametrize("kwargs,exc,message", [
    (dict(causal=1), TypeError, r"causal must be a bool"),
    (dict(deterministic="yes"), TypeError, r"deterministic must be a bool"),
    (dict(return_attn_probs=None), TypeError, r"return_attn_probs must be a bool"),
    (dict(softmax_scale="0.1"), TypeError, r"softmax_scale must be a float or None"),
    (dict(window_size=5), TypeError, r"window_size must be a tuple \(left, right\) of two ints"),
    (dict(window_size=(1, 2, 3)), ValueError, r"window_size must be a tuple \(left, right\) of two ints"),
    (dict(softcap="x"), TypeError, r"softcap must be a float \(0 = off\)"),
], ids=lambda x: str(x) if isinstance(x, dict) else "")
def test_python_typed_arguments(kwargs, exc, message, no_op_calls):
    with pytest.raises(exc, match=message):
        call(**kwargs)


# ------------------------------------------------------------------------------------------------
# When the values are read
# ------------------------------------------------------------------------------------------------
BAD_VALUES = [dict(cu_seqlens_q=torch.tensor([0, 5, 5, 14, 17], dtype=torch.int32)), dict(max_seqlen_k=1),
              dict(seqused_q=torch.tensor([9, 9, 9, 9], dtype=torch.int32))]


@pytest.mark.parametrize("kwargs", BAD_VALUES, ids=["offsets", "max_seqlen", "seqused"])
def test_values_not_read_while_compiling(kwargs, no_op_calls, monkeypatch):
    """Under torch.compile (and CUDA graph capture) the values are the caller's responsibility: no host read,
    the call goes straight to the op. The metadata checks still run."""
    with pytest.raises(ValueError):
        call(**kwargs)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(ReachedOp):
        call(**kwargs)
    with pytest.raises(TypeError, match=r"cu_seqlens_q must be torch.int32"):
        call(cu_seqlens_q=make()["cu_seqlens_q"].long())


def test_values_not_read_from_meta_tensors(no_op_calls):
    args = {n: t.to("meta") if isinstance(t, torch.Tensor) else t for n, t in make(max_seqlen_k=0).items()}  # too small
    with pytest.raises(ReachedOp):
        flash_ext.flash_attn_varlen_func(**args)


def test_host_lists_one_copy_per_device():
    a, b, c = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor(
        [7], dtype=torch.int32)
    assert fa3_compat._host_lists([a, b, c]) == [[0, 3], [0, 1, 2], [7]]
    assert fa3_compat._host_lists([a]) == [[0, 3]]


def test_without_varlen_ops(monkeypatch):
    """A build without the varlen ops (or none at all) says so once the arguments are checked."""
    monkeypatch.setattr(fa3_compat, "_require_extension", lambda: None)
    monkeypatch.setattr(fa3_compat, "has_varlen_ops", lambda: False)
    with pytest.raises(RuntimeError, match=r"no variable-length ops \(torch.ops.flash_ext.fwd_varlen"):
        call()
    if not flash_ext.extension_available():
        monkeypatch.undo()
        with pytest.raises(RuntimeError, match=r"extension is not built"):
            call()


@pytest.mark.skipif(not (flash_ext.extension_available() and flash_ext.ops.has_varlen_ops()),
                    reason="the tensor rules are the C++ op's: flash_ext._C is not built or has no varlen ops")
def test_valid_cpu_tensors_reach_the_op_device_check():
    with pytest.raises(ValueError, match=r"q is on cpu.*needs CUDA"):
        call(causal=True)


# ------------------------------------------------------------------------------------------------
# The references
# ------------------------------------------------------------------------------------------------
def _packed(seed, lens, nheads, nheads_kv, headdim, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    tq, tk = sum(a for a, _ in lens), sum(b for _, b in lens)
    q = torch.randn(tq, nheads, headdim, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(tk, nheads_kv, headdim, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(tk, nheads_kv, headdim, generator=gen, dtype=torch.float64).to(dtype)
    return q, k, v, offsets([a for a, _ in lens]), offsets([b for _, b in lens])


@pytest.mark.parametrize("mask", [dict(), dict(causal=True), dict(window_size=(3, 2)), dict(causal=True, softcap=2.0)],
                         ids=["full", "causal", "window", "causal-softcap"])
@pytest.mark.parametrize("seqlens", [(13, 13), (9, 17), (17, 9)], ids=lambda s: f"sq{s[0]}sk{s[1]}")
def test_varlen_ref_equals_dense_on_equal_lengths(seqlens, mask):
    """A batch of equal lengths is the dense problem reshaped: out (b*s, h, d), lse (h, b*s)."""
    batch, (sq, sk) = 3, seqlens
    q, k, v, cu_q, cu_k = _packed(sq + sk, [seqlens] * batch, 6, 2, 16)
    dense = [t.reshape(batch, -1, *t.shape[1:]) for t in (q, k, v)]
    out, lse = attention_varlen_ref(q, k, v, cu_q, cu_k, softmax_scale=0.3, **mask)
    out_d, lse_d = reference.attention_ref(*dense, softmax_scale=0.3, **mask)
    assert out.shape == q.shape and lse.shape == (6, batch * sq) and out.dtype == lse.dtype == torch.float64
    torch.testing.assert_close(out, out_d.reshape(q.shape), atol=1e-12, rtol=0)
    lse_dense = lse_d.transpose(0, 1).reshape(6, -1)
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_dense))
    torch.testing.assert_close(lse[torch.isfinite(lse)], lse_dense[torch.isfinite(lse)], atol=1e-12, rtol=0)
    low = [t.bfloat16() for t in (q, k, v)]
    torch.testing.assert_close(attention_varlen_lowp(*low, cu_q, cu_k, softmax_scale=0.3, **mask),
                               reference.attention_lowp(*(t.reshape(batch, -1, *t.shape[1:]) for t in low),
                                                        softmax_scale=0.3, **mask).reshape(q.shape), atol=0, rtol=0)
    # Gradients: the same loss through both differentiable references.
    dout = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ag, _ = attention_varlen_autograd(*leaves, cu_q, cu_k, softmax_scale=0.3, **mask)
    grads = torch.autograd.grad(out_ag, leaves, dout)
    dense_leaves = [t.reshape(batch, -1, *t.shape[1:]).clone().requires_grad_() for t in (q, k, v)]
    out_dag, _ = reference.attention_autograd(*dense_leaves, softmax_scale=0.3, **mask)
    dense_grads = torch.autograd.grad(out_dag, dense_leaves, dout.reshape(out_dag.shape))
    for g, gd in zip(grads, dense_grads):
        torch.testing.assert_close(g, gd.reshape(g.shape), atol=1e-12, rtol=0)


def _naive(q, k, v, scale, causal, window=(-1, -1)):
    """One sequence, explicit loops over the band: out (sq, h, d), lse (h, sq); no key: 0, -inf."""
    sq, h, d = q.shape
    sk, hkv = k.shape[0], k.shape[1]
    out = torch.zeros(sq, h, d, dtype=torch.float64)
    lse = torch.full((h, sq), -math.inf, dtype=torch.float64)
    left, right = window
    right = 0 if causal else right
    for i in range(sq):
        diag = i + sk - sq
        keys = [j for j in range(sk) if (right < 0 or j <= diag + right) and (left < 0 or j >= diag - left)]
        if not keys:
            continue
        for hh in range(h):
            kv = hh // (h // hkv)
            s = torch.stack([q[i, hh] @ k[j, kv] for j in keys]) * scale
            lse[hh, i] = torch.logsumexp(s, 0)
            out[i, hh] = torch.softmax(s, 0) @ v[keys, kv]
    return out, lse


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (2, 1)), (True, (4, 0))])
def test_varlen_ref_mixed_lengths_empty_sequences_and_seqused(causal, window):
    """Every sequence is its own bottom-right-aligned problem (of its used lengths); sequences without
    queries produce nothing, those without keys and the rows past seqused_q give 0 and -inf."""
    lens = [(1, 1), (0, 4), (7, 3), (3, 7), (5, 0), (6, 6), (0, 0)]
    q, k, v, cu_q, cu_k = _packed(7, lens, 4, 2, 8)
    seqused_q = torch.tensor([1, 0, 5, 3, 2, 6, 0], dtype=torch.int32)
    seqused_k = torch.tensor([1, 4, 3, 6, 0, 2, 0], dtype=torch.int32)
    for used_q, used_k in ((None, None), (seqused_q, None), (None, seqused_k), (seqused_q, seqused_k)):
        out, lse = attention_varlen_ref(q, k, v, cu_q, cu_k, softmax_scale=0.5, causal=causal, window_size=window,
                                        seqused_q=used_q, seqused_k=used_k)
        expected_out = torch.zeros_like(out)
        expected_lse = torch.full_like(lse, -math.inf)
        for b, (q0, k0) in enumerate(zip(cu_q[:-1].tolist(), cu_k[:-1].tolist())):
            nq = lens[b][0] if used_q is None else int(used_q[b])
            nk = lens[b][1] if used_k is None else int(used_k[b])
            o, l = _naive(q[q0:q0 + nq], k[k0:k0 + nk], v[k0:k0 + nk], 0.5, causal, window)
            expected_out[q0:q0 + nq], expected_lse[:, q0:q0 + nq] = o, l
        torch.testing.assert_close(out, expected_out, atol=1e-12, rtol=0)
        assert torch.equal(torch.isinf(lse), torch.isinf(expected_lse))
        torch.testing.assert_close(lse[torch.isfinite(lse)], expected_lse[torch.isfinite(lse)], atol=1e-12, rtol=0)
        # The differentiable reference agrees, and gives zero gradients to the rows and keys that take no part.
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out_ag, lse_ag = attention_varlen_autograd(*leaves, cu_q, cu_k, softmax_scale=0.5, causal=causal,
                                                   window_size=window, seqused_q=used_q, seqused_k=used_k)
        torch.testing.assert_close(out_ag, expected_out, atol=1e-12, rtol=0)
        assert torch.equal(torch.isinf(lse_ag), torch.isinf(expected_lse))
        dq, dk, dv = torch.autograd.grad(out_ag, leaves, torch.randn_like(out_ag))
        sees_nothing = (expected_lse == -math.inf).all(dim=0)
        assert (dq[sees_nothing] == 0).all()
        if used_k is not None:
            for b, k0 in enumerate(cu_k[:-1].tolist()):
                unused = slice(k0 + int(used_k[b]), k0 + lens[b][1])
                assert (dk[unused] == 0).all() and (dv[unused] == 0).all()
        low = attention_varlen_lowp(*(t.bfloat16() for t in (q, k, v)), cu_q, cu_k, softmax_scale=0.5, causal=causal,
                                    window_size=window, seqused_q=used_q, seqused_k=used_k)
        assert low.dtype == torch.bfloat16 and (low[sees_nothing] == 0).all()
        torch.testing.assert_close(low.double(), expected_out, atol=5e-2, rtol=0)


def test_varlen_ref_empty_batch_and_no_rows():
    q, k, v, cu_q, cu_k = _packed(3, [], 2, 2, 8)
    out, lse = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True)
    assert out.shape == (0, 2, 8) and lse.shape == (2, 0)
    q, k, v, cu_q, cu_k = _packed(3, [(0, 5), (0, 0)], 2, 2, 8)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention_varlen_autograd(*leaves, cu_q, cu_k)
    assert out.shape == (0, 2, 8) and lse.shape == (2, 0)
    grads = torch.autograd.grad(out.sum(), leaves, allow_unused=True, materialize_grads=True)
    assert all((g == 0).all() for g in grads)


@pytest.mark.parametrize("bad", [
    dict(cu_seqlens_q=torch.tensor([0, 3, 2, 8], dtype=torch.int32)),
    dict(cu_seqlens_q=torch.tensor([1, 3, 5, 8], dtype=torch.int32)),
    dict(cu_seqlens_k=torch.tensor([0, 3, 8], dtype=torch.int32)),
    dict(cu_seqlens_k=torch.tensor([0, 3, 5, 9], dtype=torch.int32)),
    dict(seqused_q=torch.tensor([4, 0, 0], dtype=torch.int32)),
    dict(seqused_k=torch.tensor([1, 1], dtype=torch.int32)),
    dict(window_size=(-2, 0)),
    dict(causal=True, window_size=(1, 1)),
    dict(softcap=-1.0),
], ids=["decreasing", "first", "batch", "total", "seqused_q", "seqused_k", "window", "causal-window", "softcap"])
def test_varlen_refs_reject_what_has_no_meaning(bad):
    q, k, v, cu_q, cu_k = _packed(4, [(3, 3), (2, 2), (3, 3)], 2, 2, 8)
    args = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    args.update(bad)
    for fn in (attention_varlen_ref, attention_varlen_lowp, attention_varlen_autograd):
        with pytest.raises(ValueError):
            fn(q, k, v, **args)
