"""flash_ext: exact attention for NVIDIA Hopper (sm_90a).

    out, lse = flash_ext.forward(q, k, v, softmax_scale=None, causal=False)
    dq, dk, dv = flash_ext.backward(dout, q, k, v, out, lse, softmax_scale=None, causal=False)
    out, lse = flash_ext.forward(q, k, v, causal=True, window_size=(1024, 0), softcap=30.0)  # sliding window, softcap
    out = flash_ext.flash_attn_func(q, k, v, causal=True)   # FlashAttention-3's signature, differentiable
    out = flash_ext.flash_attn_qkvpacked_func(qkv, causal=True)  # q, k, v stacked, as FA3 takes them
    out = flash_ext.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                           causal=True)  # variable-length sequences packed without padding
    out = flash_ext.sdpa(query, key, value, is_causal=True)   # F.scaled_dot_product_attention's signature
    q8, k8, v8, qd, kd, vd = flash_ext.fp8.quantize_qkv(q, k, v)  # FP8 forward: e4m3 in, bf16 out
    out, lse = flash_ext.forward(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
    out, lse = flash_ext.combine(out_parts, lse_parts)  # attentions over disjoint parts of the keys, merged
    out = flash_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lens)  # decoding

q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim), fp16 or bf16 on an
sm_90 GPU (flash_attn_varlen_func: the sequences packed, q (total_q, nheads, headdim), k, v (total_k,
nheads_kv, headdim), with int32 offsets cu_seqlens_q, cu_seqlens_k of shape (batch + 1,)).
`flash_ext.reference` holds the float64 references and the CPU emulation of the kernel's online softmax;
`flash_ext.kernel_table` the list of kernels a full build compiles.
"""
from . import fp8, kernel_table, reference
from .combine import combine
from .fa3_compat import flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func
from .kvcache import flash_attn_with_kvcache
from .interface import attention, backward, build_info, extension_available, forward, has_kernel, kernel_headdim
from .kernel_table import KERNEL_HEADDIMS
from .reference import attention_ref
from .sdpa_compat import sdpa

__version__ = "0.1.0"

__all__ = [
    "forward",
    "backward",
    "attention",
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "sdpa",
    "combine",
    "attention_ref",
    "reference",
    "fp8",
    "kernel_table",
    "build_info",
    "has_kernel",
    "extension_available",
    "kernel_headdim",
    "KERNEL_HEADDIMS",
    "__version__",
]
