"""torch.library registrations around the C++ ops, so that torch.compile traces them without graph breaks:

- fake (meta) implementations of flash_ext::fwd (16-bit and FP8), ::bwd and ::bwd_out (shapes only);
- flash_ext::attention, the differentiable forward: a custom op whose implementation is ::fwd and whose
  autograd formula calls ::bwd with the same softmax scale, mask (causal, window) and softcap, with the
  gradient of lse (dlse) passed through exactly;
- the fake of flash_ext::decode (flash_attn_with_kvcache's kernel), which writes the caches in place;
- the same pair for variable-length batches, when the build has the varlen ops: fakes of
  flash_ext::fwd_varlen and ::bwd_varlen, and flash_ext::attention_varlen (::fwd_varlen, differentiated by
  ::bwd_varlen with the same offsets, used lengths, maximum lengths, scale, mask and softcap, dlse included).
"""
import torch

_ALIGN_BYTES = 16


def _kernel_readable(t):
    """A gradient handed over by autograd, in a layout the kernels read: autograd's are often expanded or
    strided (the ones of a sum() have stride 0). contiguous() is a no-op on a contiguous tensor; a view
    that starts off a 16-byte boundary is copied. Only sizes, strides and offsets are read, never data
    pointers, so that this traces under torch.compile."""
    t = t.contiguous()
    if t.storage_offset() * t.element_size() % _ALIGN_BYTES != 0:
        t = t.clone()
    return t


_RANK_LAYOUTS = {3: "(total_tokens, nheads, headdim)", 4: "(batch, seqlen, nheads, headdim)"}


def _require_rank(t, name, rank, op=None):
    """The rank check the C++ op makes first (csrc/arg_checks.cpp, same message), made here too: a fake runs
    in its place under torch.compile and would otherwise fail unpacking the shape."""
    if t.dim() != rank:
        shape = tuple(t.shape)
        layout = _RANK_LAYOUTS[rank] + (f" for {op}" if op else "")
        raise ValueError(f"{name} must have {rank} dims {layout}, got {t.dim()} dims with shape {shape}")


def register():
    @torch.library.register_fake("flash_ext::fwd")
    def _fwd_fake(q, k, v, softmax_scale, causal, q_descale=None, k_descale=None, v_descale=None, window_left=-1,
                  window_right=-1, softcap=0.0):
        for t, name in ((q, "q"), (k, "k"), (v, "v")):
            _require_rank(t, name, 4)
        b, sq, h, _ = q.shape
        out_dtype = torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype  # FP8 in, bf16 out
        out = torch.empty_like(q, dtype=out_dtype, memory_format=torch.contiguous_format)
        return out, q.new_empty((b, h, sq), dtype=torch.float32)

    @torch.library.register_fake("flash_ext::bwd")
    def _bwd_fake(dout, q, k, v, out, lse, dlse, softmax_scale, causal, deterministic, window_left=-1,
                  window_right=-1, softcap=0.0):
        return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))

    @torch.library.register_fake("flash_ext::bwd_out")
    def _bwd_out_fake(dout, q, k, v, out, lse, dlse, softmax_scale, causal, deterministic, dq, dk, dv, window_left=-1,
                      window_right=-1, softcap=0.0):
        return None

    @torch.library.custom_op("flash_ext::attention", mutates_args=())
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool,
                  deterministic: bool, window_left: int = -1, window_right: int = -1,
                  softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.flash_ext.fwd(q, k, v, softmax_scale, causal, None, None, None, window_left, window_right, softcap)

    @attention.register_fake
    def _attention_fake(q, k, v, softmax_scale, causal, deterministic, window_left=-1, window_right=-1, softcap=0.0):
        return _fwd_fake(q, k, v, softmax_scale, causal)

    def setup_context(ctx, inputs, output):
        q, k, v, softmax_scale, causal, deterministic, window_left, window_right, softcap = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
        ctx.mask = (window_left, window_right, softcap)

    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else _kernel_readable(dout)
        dq, dk, dv = torch.ops.flash_ext.bwd(dout, q, k, v, out, lse, dlse, ctx.softmax_scale, ctx.causal,
                                             ctx.deterministic, *ctx.mask)
        return dq, dk, dv, None, None, None, None, None, None

    attention.register_autograd(backward, setup_context=setup_context)

    # A build made before the varlen ops (or one that left them out) still gets the dense ones.
    if has_varlen_ops():
        _register_varlen()
    if hasattr(torch.ops.flash_ext, "decode"):
        _register_decode()


def _register_decode():
    @torch.library.register_fake("flash_ext::decode")
    def _decode_fake(q, k_cache, v_cache, k_new, v_new, cache_seqlens, cache_batch_idx, page_table, softmax_scale,
                     causal, window_left=-1, window_right=-1, softcap=0.0, num_splits=0, q_descale=None, k_descale=None,
                     v_descale=None):
        for t, name in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache")):
            _require_rank(t, name, 4)
        b, sq, h, _ = q.shape  # the caches are written in place (the schema's Tensor(a!) / (b!)); nothing returned
        dtype = torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype  # FP8 caches give bf16
        out = torch.empty_like(q, dtype=dtype, memory_format=torch.contiguous_format)
        return out, q.new_empty((b, h, sq), dtype=torch.float32)


def has_varlen_ops():
    """Whether the loaded library defines flash_ext::fwd_varlen and ::bwd_varlen."""
    return hasattr(torch.ops.flash_ext, "fwd_varlen") and hasattr(torch.ops.flash_ext, "bwd_varlen")


def _register_varlen():
    @torch.library.register_fake("flash_ext::fwd_varlen")
    def _fwd_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                         softmax_scale, causal, window_left=-1, window_right=-1, softcap=0.0):
        for t, name in ((q, "q"), (k, "k"), (v, "v")):
            _require_rank(t, name, 3, op="flash_ext.flash_attn_varlen_func")
        total_q, h, _ = q.shape
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        return out, q.new_empty((h, total_q), dtype=torch.float32)  # lse (nheads, total_q), FA3's varlen layout

    @torch.library.register_fake("flash_ext::bwd_varlen")
    def _bwd_varlen_fake(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                         max_seqlen_q, max_seqlen_k, softmax_scale, causal, deterministic, window_left=-1,
                         window_right=-1, softcap=0.0):
        return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))

    @torch.library.custom_op("flash_ext::attention_varlen", mutates_args=())
    def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         cu_seqlens_k: torch.Tensor, seqused_q: torch.Tensor | None, seqused_k: torch.Tensor | None,
                         max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool, deterministic: bool,
                         window_left: int = -1, window_right: int = -1,
                         softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.flash_ext.fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                                              max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap)

    @attention_varlen.register_fake
    def _attention_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale, causal, deterministic, window_left=-1, window_right=-1, softcap=0.0):
        return _fwd_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                                softmax_scale, causal)

    def setup_context(ctx, inputs, output):
        (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
         deterministic, window_left, window_right, softcap) = inputs
        out, lse = output
        # The offsets and used lengths are saved as tensors (None where absent): the backward reads the same
        # sequences the forward did.
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
        ctx.max_seqlens = (max_seqlen_q, max_seqlen_k)
        ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
        ctx.mask = (window_left, window_right, softcap)

    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else _kernel_readable(dout)
        # dlse as autograd hands it over may be expanded (the gradient of lse.sum() has stride 0): made dense.
        dlse = None if dlse is None else dlse.contiguous()
        dq, dk, dv = torch.ops.flash_ext.bwd_varlen(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k,
                                                    seqused_q, seqused_k, *ctx.max_seqlens, ctx.softmax_scale,
                                                    ctx.causal, ctx.deterministic, *ctx.mask)
        return dq, dk, dv, *([None] * 12)

    attention_varlen.register_autograd(backward, setup_context=setup_context)
