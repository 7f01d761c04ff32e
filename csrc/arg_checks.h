// The argument rules of the ops, written once: the ops run them before every launch, so a call through
// torch.ops.flash_ext.* directly is as safe as one through the Python API, which adds only the checks of
// its own Python-typed arguments. Violations raise ValueError / TypeError (TORCH_CHECK_VALUE / _TYPE)
// naming the argument; a wrong GPU raises RuntimeError.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <vector>
#include <utility>

namespace flash_api {

// TMA: base addresses and every stepped stride must be multiples of 16 bytes.
constexpr int64_t kAlignBytes = 16;

// The sizes of an attention problem, read from q (batch, seqlen_q, nheads, headdim) and
// k, v (batch, seqlen_k, nheads_kv, headdim).
struct AttentionShape {
  int64_t batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim;
  // No (query, key) pair: the ops return without a launch.
  bool is_empty() const { return batch == 0 || seqlen_q == 0 || seqlen_k == 0; }
};

// q, k, v as the kernels need them (all but their device: check_on_gpu); `op` names the public function in
// messages (e.g. "flash_ext.forward"). fp16 and bf16, and with allow_fp8 (the forward) float8_e4m3fn.
AttentionShape check_qkv(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, double softmax_scale,
                         char const* op, bool allow_fp8 = false);

// Varlen calls (flash_attn_varlen_func): q (total_q, nheads, headdim), k, v (total_k, nheads_kv, headdim),
// cu_seqlens_q / _k int32 (batch + 1,), seqused_q / _k int32 (batch,) or None; 16-bit only. `shape` holds
// the sequence count and the callers' maxima (clamped to the packed lengths). Only shapes, dtypes and
// layouts are checked here: the values live on the GPU (the Python API checks them in eager mode, and
// the kernels stay in bounds whatever they are: hopper/varlen.h).
struct VarlenShape {
  AttentionShape shape;
  int64_t total_q, total_k;
  bool is_empty() const { return shape.batch == 0 || total_q == 0 || shape.seqlen_q == 0; }
  bool has_no_keys() const { return total_k == 0 || shape.seqlen_k == 0; }
};
VarlenShape check_qkv_varlen(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, at::Tensor const& cu_seqlens_q,
                             at::Tensor const& cu_seqlens_k, std::optional<at::Tensor> const& seqused_q,
                             std::optional<at::Tensor> const& seqused_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                             double softmax_scale, char const* op);

// An FP8 descale factor (q_descale, k_descale or v_descale): float32 (batch, nheads_kv), any strides; only
// with FP8 q, k, v.
void check_descale(at::Tensor const& t, char const* name, AttentionShape const& s, at::ScalarType qkv_dtype);

// A tensor the op reads or writes beside q, k, v: `name` must have exactly `sizes` and `dtype` and (for TMA)
// the strided layout rules of q, k, v; `like` names what it must match in messages.
void check_tensor_like(at::Tensor const& t, char const* name, at::IntArrayRef sizes, at::ScalarType dtype,
                       char const* like);

// lse (or its gradient dlse) of a forward call: float32 (batch, nheads, seqlen_q), or for varlen calls
// (varlen_total_q >= 0) (nheads, total_q).
void check_lse(at::Tensor const& t, char const* name, AttentionShape const& s, int64_t varlen_total_q = -1);

// The window and softcap arguments (FlashAttention's window_size = (left, right), -1 = unbounded) as the
// kernels take them: values checked (ValueError naming window_size / softcap), bounds past the sequences
// made unbounded, and causal (the band (-1, 0)) folded in. `banded` says whether the call needs a banded
// (causal) kernel.
struct ScoreOptionsChecked {
  int window_left, window_right;
  float softcap;
  bool banded;
};
ScoreOptionsChecked check_score_options(bool causal, int64_t window_left, int64_t window_right, double softcap,
                                        AttentionShape const& s);

// Last, so that shape and dtype errors are reported for CPU tensors too: every tensor on one CUDA
// device, an sm_90 one.
void check_on_gpu(std::vector<std::pair<at::Tensor const*, char const*>> const& tensors, char const* op);

// The stride the TMA descriptor gets for a dim: a dim of size 1 is never stepped, so any stride will do.
int64_t tma_stride(at::Tensor const& t, int dim);

// An FP8 v (batch, seqlen_k, nheads_kv, headdim) given column-major: its sequence dim contiguous rather than its
// head dim (FA3's V_colmajor, e.g. flash_ext.fp8.quantize_qkv(..., v_colmajor=True)). The FP8 forward reads it
// as it is where kernels for that layout are compiled (flash_ext/kernel_table.py), else from a row-major copy.
bool is_v_colmajor(at::Tensor const& v);

// flash_attn_with_kvcache (the decode op): q (batch, seqlen_q, nheads, headdim); caches contiguous,
// (entries, seqlen_cache, nheads_kv, headdim), or with page_table (batch, pages_per_seq) int32 paged,
// (num_pages, page_size, nheads_kv, headdim), page_size a multiple of 16; k_new, v_new (batch, seqlen_new,
// nheads_kv, headdim) or both None; cache_seqlens int32 (batch,); cache_batch_idx int32 (batch,) or None
// (contiguous caches only). fp16 / bf16, or FP8 (e4m3) q, caches and new keys alike (head dims multiples of
// 16; descales checked by the caller with check_descale). As for varlen calls, the values of the index tensors are not read
// here (the kernel clamps them: hopper/decode_kernel.h).
struct DecodeShape {
  AttentionShape shape;  // seqlen_k: the keys a sequence can hold (seqlen_cache, or pages_per_seq * page_size)
  int64_t seqlen_new, page_size, pages_per_seq, cache_entries;
};
DecodeShape check_decode(at::Tensor const& q, at::Tensor const& k_cache, at::Tensor const& v_cache,
                         std::optional<at::Tensor> const& k_new, std::optional<at::Tensor> const& v_new,
                         at::Tensor const& cache_seqlens, std::optional<at::Tensor> const& cache_batch_idx,
                         std::optional<at::Tensor> const& page_table, double softmax_scale, int64_t num_splits,
                         char const* op);

enum class Direction { kFwd, kBwd, kDecode };

// The smallest kernel head dim >= headdim of a direction (flash_ext/kernel_table.py's HEADDIMS_BY_DIRECTION).
int kernel_headdim(int64_t headdim, Direction direction);

}  // namespace flash_api
