"""flash_attn_with_kvcache's argument checks on the CPU (no GPU or compiled extension needed): each bad input
raises before anything reaches an op, naming the argument; FA3 keywords not implemented yet raise
NotImplementedError naming them; FA3's speed hints are accepted; the values of cache_seqlens, page_table and
cache_batch_idx are checked when they can be read."""
import pytest
import torch

import flash_ext
from flash_ext import kvcache


class ReachedOp(Exception):
    """Raised instead of calling the op: the Python checks all passed."""


@pytest.fixture(autouse=True)
def no_op_calls(monkeypatch):
    def reached():
        raise ReachedOp

    monkeypatch.setattr(kvcache, "_require_varlen_ops", reached)
    monkeypatch.setattr(kvcache, "_require_extension", reached)


def _inputs(batch=2, seqlen_q=1, seqlen_cache=16, nheads=4, nheads_kv=2, headdim=64, dtype=torch.bfloat16):
    q = torch.randn(batch, seqlen_q, nheads, headdim, dtype=dtype)
    k_cache = torch.randn(batch, seqlen_cache, nheads_kv, headdim, dtype=dtype)
    return q, k_cache, torch.randn_like(k_cache)


def test_good_calls_reach_the_op():
    q, kc, vc = _inputs()
    k_new = torch.randn(2, 3, 2, 64, dtype=torch.bfloat16)
    for kwargs in (dict(), dict(cache_seqlens=5), dict(cache_seqlens=torch.tensor([3, 13], dtype=torch.int32)),
                   dict(k=k_new, v=k_new.clone(), cache_seqlens=13, causal=True, num_splits=4, pack_gqa=True,
                        sm_margin=0, return_softmax_lse=True, window_size=(8, 0), softcap=5.0)):
        with pytest.raises(ReachedOp):
            flash_ext.flash_attn_with_kvcache(q, kc, vc, **kwargs)


@pytest.mark.parametrize("name", ["cache_leftpad", "rotary_cos", "cu_seqlens_q", "qv"])
def test_not_yet_implemented_keywords(name):
    q, kc, vc = _inputs()
    with pytest.raises(NotImplementedError, match=f"{name} is not supported by flash_ext yet"):
        flash_ext.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=4, **{name: torch.zeros(2, dtype=torch.int32)})
    with pytest.raises(ReachedOp):  # their neutral value is fine
        flash_ext.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=4, **{name: None})


def test_bad_input_names_the_argument():
    q, kc, vc = _inputs()
    k_new = torch.randn(2, 3, 2, 64, dtype=torch.bfloat16)
    cases = [
        (TypeError, "unexpected keyword argument 'cache_seqlen'", dict(cache_seqlen=3)),
        (ValueError, "appending k and v needs cache_seqlens", dict(k=k_new, v=k_new)),
        (ValueError, r"cache_seqlens = 14 plus 3 new keys must fit the cache: cache_seqlens must be in \[0, 13\]",
         dict(k=k_new, v=k_new, cache_seqlens=14)),
        (ValueError, r"cache_seqlens\[1\] = 14 must be in \[0, capacity - seqlen_new = 13\]",
         dict(k=k_new, v=k_new, cache_seqlens=torch.tensor([1, 14], dtype=torch.int32))),
        (ValueError, r"cache_seqlens = 17 must fit the cache: cache_seqlens must be in \[0, 16\]", dict(cache_seqlens=17)),
        (ValueError, r"num_splits must be an int in \[0, 128\]", dict(num_splits=129)),
        (TypeError, "check_values must be a bool", dict(check_values=1)),
        (ValueError, r"cache_batch_idx\[1\] = 2 is not an entry of the cache \(0..1\)",
         dict(cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32))),
        (TypeError, "cache_batch_idx must be torch.int32", dict(cache_batch_idx=torch.tensor([0, 1]))),
        (TypeError, "cache_seqlens must be torch.int32", dict(cache_seqlens=torch.tensor([1, 2]))),
        (ValueError, r"cache_seqlens must have shape \(batch,\) = \(2,\)", dict(cache_seqlens=torch.tensor([1], dtype=torch.int32))),
        (TypeError, "cache_seqlens must be an int", dict(cache_seqlens=2.0)),
        (TypeError, "causal must be a bool", dict(causal=1)),
        (TypeError, "return_softmax_lse must be a bool", dict(return_softmax_lse=None)),
    ]
    for error, message, kwargs in cases:
        with pytest.raises(error, match=message):
            flash_ext.flash_attn_with_kvcache(q, kc, vc, **kwargs)
    with pytest.raises(ReachedOp):  # a strided cache goes to the decode kernel
        wide = torch.randn(2, 20, 2, 64, dtype=torch.bfloat16)[:, :16]
        flash_ext.flash_attn_with_kvcache(q, wide, vc)
    with pytest.raises(ValueError, match="q must have 4 dims"):
        flash_ext.flash_attn_with_kvcache(q[0], kc, vc)


def _paged(batch=2, pages=6, page_size=16, pages_per_seq=3):
    q = torch.randn(batch, 1, 4, 64, dtype=torch.bfloat16)
    k_pages = torch.randn(pages, page_size, 2, 64, dtype=torch.bfloat16)
    table = torch.arange(batch * pages_per_seq, dtype=torch.int32).reshape(batch, pages_per_seq) % pages
    return q, k_pages, torch.randn_like(k_pages), table


def test_paged_cache_checks():
    q, kp, vp, table = _paged()
    lens = torch.tensor([10, 48], dtype=torch.int32)
    with pytest.raises(ReachedOp):
        flash_ext.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, page_table=table)
    k_new = torch.randn(2, 2, 2, 64, dtype=torch.bfloat16)
    bad_slot = table.clone()
    bad_slot[0, 1] = 6
    cases = [
        (ValueError, "a paged cache needs cache_seqlens", dict(page_table=table)),
        (ValueError, r"page_table must be int32 \(batch=2, pages_per_seq\)", dict(cache_seqlens=lens, page_table=table[:1])),
        (ValueError, r"page_table must be int32", dict(cache_seqlens=lens, page_table=table.long())),
        (ValueError, r"page_table must be int32 \(batch=2, pages_per_seq\), got shape \(6,\)",
         dict(cache_seqlens=lens, page_table=table.reshape(-1))),
        (ValueError, r"page_table\[0, 1\] = 6 is not a page of the cache \(0..5\); sequence 0 uses slots 0..1",
         dict(cache_seqlens=torch.tensor([17, 0], dtype=torch.int32), page_table=bad_slot)),
        (ValueError, r"cache_seqlens\[1\] = 47 must be in \[0, capacity - seqlen_new = 46\]",
         dict(k=k_new, v=k_new, cache_seqlens=torch.tensor([0, 47], dtype=torch.int32), page_table=table)),
    ]
    for error, message, kwargs in cases:
        with pytest.raises(error, match=message):
            flash_ext.flash_attn_with_kvcache(q, kp, vp, **kwargs)
    # Slots past a sequence's keys are not read, so their values do not matter; check_values=False skips reading.
    with pytest.raises(ReachedOp):
        flash_ext.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=torch.tensor([16, 0], dtype=torch.int32),
                                          page_table=bad_slot)
    with pytest.raises(ReachedOp):
        flash_ext.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=torch.tensor([17, 0], dtype=torch.int32),
                                          page_table=bad_slot, check_values=False)
    with pytest.raises(ValueError, match="page size .* must be a positive multiple of 16"):
        flash_ext.flash_attn_with_kvcache(q, kp[:, :8], vp[:, :8], cache_seqlens=lens, page_table=table)


@pytest.fixture
def real_op(monkeypatch):
    """The op's own checks (csrc/arg_checks.cpp), reached with CPU tensors: they raise before "needs CUDA"."""
    if not flash_ext.extension_available():
        pytest.skip("the compiled extension is not built")
    monkeypatch.setattr(kvcache, "_require_extension", lambda: None)


def test_op_checks_name_the_argument(real_op):
    q, kc, vc = _inputs()
    k_new = torch.randn(2, 3, 2, 64, dtype=torch.bfloat16)
    lens = torch.tensor([1, 2], dtype=torch.int32)
    cases = [
        (ValueError, "k and v .* must be given together", dict(k=k_new, cache_seqlens=3)),
        (TypeError, r"k and v must have the caches' dtype torch.bfloat16, got k torch.float16",
         dict(k=k_new.half(), v=k_new.half(), cache_seqlens=1)),
        (ValueError, r"k and v must be \(batch, seqlen_new, nheads_kv, headdim\) = \(2, 3, 2, 64\)",
         dict(k=k_new[:, :, :1], v=k_new[:, :, :1], cache_seqlens=1)),
        (ValueError, "with page_table .* it must be None",
         dict(cache_seqlens=lens, page_table=torch.zeros(2, 1, dtype=torch.int32), cache_batch_idx=lens, check_values=False)),
        (ValueError, "needs CUDA tensors", dict(cache_seqlens=lens)),
    ]
    for error, message, kwargs in cases:
        with pytest.raises(error, match=message):
            flash_ext.flash_attn_with_kvcache(q, kc, vc, **kwargs)
    with pytest.raises(ValueError, match="k_cache and v_cache need an entry per sequence: 2 sequences, 1 entries"):
        flash_ext.flash_attn_with_kvcache(q, kc[:1], vc[:1])
    with pytest.raises(ValueError, match="k_cache and v_cache must have one shape"):
        flash_ext.flash_attn_with_kvcache(q, kc, vc[:, :8])
    with pytest.raises(TypeError, match="k_cache and v_cache must have q's dtype"):
        flash_ext.flash_attn_with_kvcache(q, kc.half(), vc.half())
    with pytest.raises(ValueError, match="head dim 36 is not supported"):
        flash_ext.flash_attn_with_kvcache(q[..., :36].contiguous(), kc[..., :36].contiguous(), vc[..., :36].contiguous())
    with pytest.raises(ValueError, match="page size .* must be a positive multiple of 16, got 8"):
        flash_ext.flash_attn_with_kvcache(q, kc[:, :8], vc[:, :8], cache_seqlens=lens,
                                          page_table=torch.zeros(2, 1, dtype=torch.int32), check_values=False)


def test_fp8_op_checks(real_op):
    """FP8 (e4m3) q and caches: the descales' rules are the forward's; every tensor in e4m3; head dims of 16."""
    fp8 = torch.float8_e4m3fn
    q, kc, vc = (t.to(fp8) for t in _inputs())
    lens = torch.tensor([1, 2], dtype=torch.int32)
    ones = torch.ones(2, 2)
    with pytest.raises(ValueError, match="needs CUDA tensors"):  # every check passed
        flash_ext.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, q_descale=ones, k_descale=ones, v_descale=ones)
    cases = [
        (ValueError, r"q_descale must have shape \(batch, nheads_kv\) = \(2, 2\), got \(2, 4\)",
         dict(q_descale=torch.ones(2, 4))),
        (TypeError, "k_descale must be torch.float32, got torch.float16", dict(k_descale=ones.half())),
    ]
    for error, message, kwargs in cases:
        with pytest.raises(error, match=message):
            flash_ext.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, **kwargs)
    q16, kc16, vc16 = _inputs()
    with pytest.raises(ValueError, match=r"v_descale is only for FP8 \(torch.float8_e4m3fn\) q, k, v; got torch.bfloat16"):
        flash_ext.flash_attn_with_kvcache(q16, kc16, vc16, cache_seqlens=lens, v_descale=ones)
    with pytest.raises(TypeError, match="k_cache and v_cache must have q's dtype torch.float8_e4m3fn"):
        flash_ext.flash_attn_with_kvcache(q, kc16, vc16, cache_seqlens=lens)
    with pytest.raises(TypeError, match="k and v must have the caches' dtype torch.float8_e4m3fn, got k torch.bfloat16"):
        k_new = torch.randn(2, 1, 2, 64, dtype=torch.bfloat16)
        flash_ext.flash_attn_with_kvcache(q, kc, vc, k_new, k_new, cache_seqlens=lens)
    with pytest.raises(ValueError, match="head dim 40 is not supported for FP8"):
        flash_ext.flash_attn_with_kvcache(q[..., :40].contiguous(), kc[..., :40].contiguous(), vc[..., :40].contiguous())
