// Host-side descriptions of one call, filled by csrc/flash_api.cpp from the torch tensors.
#pragma once

#include <cstdint>

namespace flash {

// A (batch, seqlen, heads, headdim) tensor whose last dim is contiguous; strides in elements.
struct StridedTensor {
  void* ptr;
  int64_t batch_stride, row_stride, head_stride;
};

// FP8 kernels produce P as exp2(... + kFp8MaxOffset) (the seed, section 6): [0, 2^8] uses e4m3's range.
// -DFLASH_EXT_FP8_MAX_OFFSET=0 builds the plain variant, to measure what the offset buys (docs/fp8.md);
// flash_ext.build_info() reports the value.
#ifndef FLASH_EXT_FP8_MAX_OFFSET
#define FLASH_EXT_FP8_MAX_OFFSET 8
#endif
constexpr int kFp8MaxOffset = FLASH_EXT_FP8_MAX_OFFSET;

#if defined(__CUDACC__)
#define FLASH_HOST_DEVICE __host__ __device__
#else
#define FLASH_HOST_DEVICE
#endif

// What a call adds to plain attention, set by the host (csrc/flash_api.cpp) for both directions:
//  - a sliding window (mask.h): window_left / window_right keys left / right of the bottom-right-aligned
//    diagonal, -1 = unbounded; read by the causal kernels only (causal is the window (-1, 0), and the host
//    sends every other window there too);
//  - softcap > 0: the scores become softcap * tanh(score * softmax_scale / softcap) (softcap.h); 0 = off.
struct ScoreOptions {
  int window_left = -1, window_right = -1;
  float softcap = 0.f;
};

// Variable-length batches (flash_attn_varlen_func): the sequences are packed along the rows of q, k, v, o
// ((total, heads, headdim) tensors, batch_stride unused); sequence b owns rows cu_seqlens[b] .. cu_seqlens[b+1]
// (int32, device memory), of which the first seqused[b] take part where seqused is given. The kernels read
// the values on the device (varlen.h sanitises them, so that no value makes them access memory out of
// bounds); FwdParams / BwdParams::seqlen_q / seqlen_k then hold the callers' maxima, and lse is
// (nheads, total_q).
struct VarlenArgs {
  int const* cu_seqlens_q = nullptr;  // nullptr: a dense call
  int const* cu_seqlens_k = nullptr;
  int const* seqused_q = nullptr;  // optional
  int const* seqused_k = nullptr;
  int total_q = 0, total_k = 0;  // rows of the packed tensors
  FLASH_HOST_DEVICE bool enabled() const { return cu_seqlens_q != nullptr; }
};

// FP8 descale factors: float32 (batch, nheads_kv), strides in elements; no tensor means 1.
struct DescaleTensor {
  float const* ptr = nullptr;
  int64_t batch_stride = 0, head_stride = 0;
  FLASH_HOST_DEVICE float at(int batch, int head_kv) const {
    return ptr == nullptr ? 1.f : ptr[batch * batch_stride + head_kv * head_stride];
  }
};

struct FwdParams {
  // q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim); o has q's shape
  // (bf16 for FP8 inputs).
  StridedTensor q, k, v, o;
  float* lse;  // (batch, nheads, seqlen_q), contiguous; varlen: (nheads, total_q)
  DescaleTensor q_descale, k_descale, v_descale;  // FP8 inputs only
  int batch, seqlen_q, seqlen_k, nheads, nheads_kv;
  int headdim;  // the real head dim; the kernel's may be larger (zero-filled by TMA, clipped on store)
  float softmax_scale;
  ScoreOptions options;
  VarlenArgs varlen;
  // Consumer warpgroup ping-pong: -1 = the configuration's default, 0 = off, 1 = on (for A/B measurements).
  int pingpong = -1;
  // Persistent launch (one CTA per SM walking tiles): -1 = by the kernel's heuristic, 0 = off, 1 = on, 2 = on
  // with the mid-length tiles where the configuration has them (FwdLaunchPolicy).
  int persistent = -1;
  // Workspace of the registry entry's workspace_bytes() (the tile counter of dynamic persistent launches),
  // allocated by the caller; the launcher clears it.
  void* workspace = nullptr;
  // FP8 v given column-major, its sequence dim contiguous (stride 1): v.row_stride then holds the head dim's
  // stride, and the kernels compiled for that layout run (FwdConfig::kVColMajor; FwdLauncher::run refuses a
  // mismatch).
  bool v_colmajor = false;
};

struct BwdParams {
  // Inputs as in FwdParams, plus out (q's shape), dout (q's shape) and lse from the forward.
  StridedTensor q, k, v, o, dout;
  float const* lse;   // (batch, nheads, seqlen_q), contiguous; varlen: (nheads, total_q)
  float const* dlse;  // the gradient flowing into lse, same layout; nullptr when there is none
  // Outputs: dq like q; dk, dv like k, v (already summed over each group of query heads).
  StridedTensor dq, dk, dv;
  // Workspace of workspace_bytes(), allocated by the caller; the launcher carves and clears it.
  void* workspace;
  // Bytes of dq's memory the launcher may borrow as scratch until the postprocess writes dq: dq's size when
  // it is one contiguous block, else 0.
  int64_t dq_scratch_bytes;
  int batch, seqlen_q, seqlen_k, nheads, nheads_kv;
  int headdim;
  float softmax_scale;
  ScoreOptions options;
  VarlenArgs varlen;
  bool deterministic;  // dQ contributions added in a fixed order: bitwise-reproducible gradients
};

}  // namespace flash
