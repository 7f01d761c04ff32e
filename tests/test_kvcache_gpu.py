"""flash_attn_with_kvcache on the GPU against the float64 KV-cache reference (reference.attention_kvcache_ref)
with FlashAttention's error rule (2x the error of PyTorch's attention in the inputs' dtype on each entry's
keys, plus rounding noise): decoding one token and appending several, ragged cache lengths, GQA/MQA, causal,
window and softcap, an entry without keys; the new keys land in the caches in place and nothing else there
changes; CUDA graph capture and replay with new values."""
import math

import pytest
import torch

import flash_ext
from flash_ext.reference import attention_kvcache_ref, attention_lowp
from gpu_helpers import assert_lse_matches, assert_out_within_rule

pytestmark = pytest.mark.gpu


def _require(headdim, dtype, causal, window):
    for mask in ((False, True) if window != (-1, -1) else (causal,)):
        if not flash_ext.has_kernel("fwd", headdim, dtype, mask):
            pytest.skip(f"this build has no {dtype} head dim {headdim} forward kernel for causal={mask}")


def _lowp(q, k_cache, v_cache, lens, causal, window, softcap):
    """attention_lowp on each entry's keys (the caches after the append)."""
    out = torch.zeros_like(q)
    for b, n in enumerate(lens):
        if n:
            out[b:b + 1] = attention_lowp(q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n], causal=causal,
                                          window_size=window, softcap=softcap)
    return out


CASES = [  # (seqlen_q = seqlen_new, cache lengths before the append, heads, causal, window, softcap)
    (1, [4095, 100, 0, 2047], (32, 8), True, (-1, -1), 0.0),
    (1, [513, 7, 1000], (16, 1), False, (-1, -1), 0.0),
    (5, [300, 0, 1500], (8, 2), True, (-1, -1), 0.0),
    (3, [700, 64], (8, 8), True, (128, 0), 10.0),
]


@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("seqlen_new,lens,heads,causal,window,softcap", CASES)
def test_decode_and_append(seqlen_new, lens, heads, causal, window, softcap, headdim):
    dtype = torch.bfloat16
    _require(headdim, dtype, causal, window)
    batch, (nheads, nheads_kv), seqlen_cache = len(lens), heads, 4096
    gen = torch.Generator(device="cuda").manual_seed(headdim + seqlen_new)
    randn = lambda *s: torch.randn(*s, device="cuda", dtype=dtype, generator=gen)
    q = randn(batch, seqlen_new, nheads, headdim)
    k_cache, v_cache = randn(batch, seqlen_cache, nheads_kv, headdim), randn(batch, seqlen_cache, nheads_kv, headdim)
    k_new, v_new = randn(batch, seqlen_new, nheads_kv, headdim), randn(batch, seqlen_new, nheads_kv, headdim)
    cache_seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out_ref, lse_ref, k_after, v_after = attention_kvcache_ref(q, k_cache, v_cache, k_new, v_new, cache_seqlens,
                                                               causal=causal, window_size=window, softcap=softcap)
    out, lse = flash_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens, causal=causal,
                                                 window_size=window, softcap=softcap, return_softmax_lse=True)
    torch.cuda.synchronize()
    assert torch.equal(k_cache, k_after) and torch.equal(v_cache, v_after), "the caches after the append"
    total = [n + seqlen_new for n in lens]
    assert_out_within_rule(out, out_ref, _lowp(q, k_cache, v_cache, total, causal, window, softcap), dtype)
    assert_lse_matches(lse, lse_ref, 1e-3 + softcap * 2.0 ** -10)


def test_entry_without_keys_and_full_cache():
    q = torch.randn(2, 1, 4, 64, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(2, 256, 4, 64, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    out, lse = flash_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor(
        [0, 256], dtype=torch.int32, device="cuda"), return_softmax_lse=True)
    assert torch.all(out[0] == 0) and torch.all(lse[0] == -math.inf)
    full, lse_full = flash_ext.flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True)
    dense, lse_dense = flash_ext.forward(q, k_cache, v_cache)
    assert torch.equal(full, dense) and torch.equal(lse_full, lse_dense)
    assert torch.equal(out[1], dense[1])


def test_cuda_graph_replay_with_new_values():
    """Captured once, replayed with new q, new keys and new lengths: no host synchronisation inside."""
    batch, nheads, nheads_kv, headdim, seqlen_cache = 4, 16, 4, 128, 1024
    q = torch.randn(batch, 1, nheads, headdim, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(batch, seqlen_cache, nheads_kv, headdim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    k_new = torch.randn(batch, 1, nheads_kv, headdim, device="cuda", dtype=torch.bfloat16)
    v_new = torch.randn_like(k_new)
    lens = torch.tensor([10, 500, 1000, 0], dtype=torch.int32, device="cuda")
    step = lambda: flash_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, lens, causal=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for trial in range(2):
        q.normal_()
        k_new.normal_()
        v_new.normal_()
        lens.copy_(torch.tensor([20 + trial, 600, 3, 1022], dtype=torch.int32))
        k_before, v_before = k_cache.clone(), v_cache.clone()
        graph.replay()
        torch.cuda.synchronize()
        expected, _, k_after, v_after = attention_kvcache_ref(q, k_before, v_before, k_new, v_new, lens, causal=True)
        assert torch.equal(k_cache, k_after) and torch.equal(v_cache, v_after)
        low = _lowp(q, k_cache, v_cache, [n + 1 for n in lens.tolist()], True, (-1, -1), 0.0)
        assert_out_within_rule(out, expected, low, torch.bfloat16)
