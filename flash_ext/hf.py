"""flash_ext as an attention implementation of Hugging Face transformers (optional: transformers is not a
dependency of flash_ext; this module imports it only when register() is called).

    import flash_ext.hf
    flash_ext.hf.register()  # once per process: adds "hopper_ext" to transformers' attention implementations
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16, attn_implementation="hopper_ext").cuda()
    model.generate(**inputs)  # or model.set_attn_implementation("hopper_ext") on a loaded model

The name holds no "flash": transformers takes any implementation whose name contains "flash" for a
FlashAttention kernel to import or download, and refuses it otherwise.

What runs where (transformers hands the attention (batch, heads, seqlen, headdim) tensors; they are read as
strided views, not copied):
- prefill and any call with more than 64 query rows per KV head: flash_ext.flash_attn_func (causal masks
  align to the bottom-right corner, as a cache needs);
- decoding steps (few query rows per KV head): flash_ext.flash_attn_with_kvcache over the model's own cache
  tensors as a full cache (the decode kernel: GQA packing, split keys);
- batches with padding (a 2D attention mask, as transformers' FlashAttention integrations receive it): the
  kept tokens packed and run by flash_ext.flash_attn_varlen_func (one host synchronisation per call, for the
  longest sequence), padded rows of the output zero.
sliding_window and softcap (Mistral, Gemma 2) map to window_size and softcap. Attention dropout during
training and output_attentions are not supported and raise.
"""
import torch

NAME = "hopper_ext"

# Query rows per KV head up to which decoding steps go to the decode kernel (flash_ext.kvcache's rule).
_DECODE_MAX_ROWS = 64


def register(name=NAME):
    """Registers flash_ext's attention (and transformers' FlashAttention mask format: None or a 2D padding
    mask) under `name` in transformers' AttentionInterface and AttentionMaskInterface."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                      softcap=None, is_causal=None, **kwargs):
    """transformers' attention-function signature: query (batch, nheads, seqlen_q, headdim), key and value
    (batch, nheads_kv, seqlen_k, headdim); returns (out (batch, seqlen_q, nheads, headdim), None)."""
    import flash_ext

    if dropout:
        raise NotImplementedError(f"flash_ext attention has no dropout (got dropout={dropout}); use model.eval() or "
                                  f"attention_dropout=0")
    if kwargs.get("output_attentions"):
        raise NotImplementedError("flash_ext attention does not return attention weights (output_attentions=True)")
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        raise NotImplementedError("flash_ext attention does not take transformers' packed-sequence arguments "
                                  "(cu_seq_lens_q / cu_seq_lens_k); pass an attention_mask instead")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    window = (-1, -1)
    if sliding_window is not None:
        window = (sliding_window - 1, 0 if causal else sliding_window - 1)
    options = dict(softmax_scale=scaling, causal=causal, window_size=window, softcap=float(softcap or 0.0))
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # (batch, seqlen, heads, headdim)
    batch, seqlen_q, nheads, _ = q.shape
    nheads_kv = k.shape[2]
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(f"flash_ext attention takes a 2D (batch, seqlen_k) padding mask (register() installs "
                             f"that mask format), got shape {tuple(attention_mask.shape)}")
        return _padded(q, k, v, attention_mask, options), None
    if seqlen_q * nheads <= _DECODE_MAX_ROWS * nheads_kv:
        out = flash_ext.flash_attn_with_kvcache(q, k, v, **options)
    else:
        out = flash_ext.flash_attn_func(q, k, v, **options)
    return out, None


def _padded(q, k, v, attention_mask, options):
    """A batch with padding: its kept tokens packed into a varlen call. The queries are the last seqlen_q
    positions of the mask (prefill: all of them), so each sequence's queries end where its keys end."""
    import torch.nn.functional as F

    import flash_ext

    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    keep_k = attention_mask.bool()
    keep_q = keep_k[:, -seqlen_q:]
    lens_q, lens_k = keep_q.sum(1, dtype=torch.int32), keep_k.sum(1, dtype=torch.int32)
    cu_q = F.pad(lens_q.cumsum(0, dtype=torch.int32), (1, 0))
    cu_k = F.pad(lens_k.cumsum(0, dtype=torch.int32), (1, 0))
    rows_q = keep_q.reshape(-1).nonzero().squeeze(1)
    rows_k = keep_k.reshape(-1).nonzero().squeeze(1)
    max_q, max_k = (int(x) for x in torch.stack([lens_q.max(), lens_k.max()]).tolist())
    out_packed = flash_ext.flash_attn_varlen_func(
        q.reshape(batch * seqlen_q, nheads, headdim)[rows_q], k.reshape(batch * seqlen_k, nheads_kv, headdim)[rows_k],
        v.reshape(batch * seqlen_k, nheads_kv, headdim)[rows_k], cu_q, cu_k, max_q, max_k, **options)
    out = out_packed.new_zeros(batch * seqlen_q, nheads, headdim)
    out[rows_q] = out_packed
    return out.view(batch, seqlen_q, nheads, headdim)
