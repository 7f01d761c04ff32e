"""flash_attn_with_kvcache's argument checks on the CPU (no GPU or compiled extension needed): each bad input
raises before anything reaches the op, naming the argument; FA3 keywords not implemented yet raise
NotImplementedError naming them; FA3's speed hints are accepted."""
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


@pytest.mark.parametrize("name", ["page_table", "cache_batch_idx", "cache_leftpad", "rotary_cos", "cu_seqlens_q",
                                  "q_descale"])
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
        (ValueError, "k and v .* must be given together", dict(k=k_new, cache_seqlens=3)),
        (ValueError, "appending k and v needs cache_seqlens", dict(k=k_new, v=k_new)),
        (ValueError, r"cache_seqlens = 14 plus 3 new keys exceed seqlen_cache = 16", dict(k=k_new, v=k_new, cache_seqlens=14)),
        (ValueError, r"cache_seqlens\[1\] = 14 must be in \[0, seqlen_cache - seqlen_new = 13\]",
         dict(k=k_new, v=k_new, cache_seqlens=torch.tensor([1, 14], dtype=torch.int32))),
        (ValueError, r"cache_seqlens = 17 must be in \[0, seqlen_cache = 16\]", dict(cache_seqlens=17)),
        (TypeError, "cache_seqlens must be torch.int32", dict(cache_seqlens=torch.tensor([1, 2]))),
        (ValueError, r"cache_seqlens must have shape \(batch,\) = \(2,\)", dict(cache_seqlens=torch.tensor([1], dtype=torch.int32))),
        (TypeError, "cache_seqlens must be an int", dict(cache_seqlens=2.0)),
        (TypeError, "k and v must have the caches' dtype", dict(k=k_new.half(), v=k_new.half(), cache_seqlens=1)),
        (ValueError, r"k and v must be \(batch=2, seqlen_new, 2, 64\)", dict(k=k_new[:, :, :1], v=k_new[:, :, :1], cache_seqlens=1)),
        (TypeError, "causal must be a bool", dict(causal=1)),
        (TypeError, "return_softmax_lse must be a bool", dict(return_softmax_lse=None)),
    ]
    for error, message, kwargs in cases:
        with pytest.raises(error, match=message):
            flash_ext.flash_attn_with_kvcache(q, kc, vc, **kwargs)
    with pytest.raises(ValueError, match="k_cache and v_cache must be"):
        flash_ext.flash_attn_with_kvcache(q, kc[:1], vc[:1])
    with pytest.raises(ValueError, match="k_cache's entries must follow each other"):
        wide = torch.randn(2, 20, 2, 64, dtype=torch.bfloat16)[:, :16]
        flash_ext.flash_attn_with_kvcache(q, wide, vc)
    with pytest.raises(ValueError, match="q must have 4 dims"):
        flash_ext.flash_attn_with_kvcache(q[0], kc, vc)
