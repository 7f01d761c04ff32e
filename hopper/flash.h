// Host-side description of one forward call, filled by csrc/flash_api.cpp from the torch tensors.
#pragma once

#include <cstdint>

namespace flash {

struct FwdParams {
  // q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim); the last dim is
  // contiguous, the other strides are in elements. o has q's shape; lse is (batch, nheads, seqlen_q) float.
  void const* q_ptr;
  void const* k_ptr;
  void const* v_ptr;
  void* o_ptr;
  float* lse_ptr;
  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int batch, seqlen_q, seqlen_k, nheads, nheads_kv;
  int headdim;  // the real head dim; the kernel's may be larger (zero-filled by TMA, clipped on store)
  float softmax_scale;
  // Consumer warpgroup ping-pong: -1 = the configuration's default, 0 = off, 1 = on (for A/B measurements).
  int pingpong = -1;
  // Persistent launch (one CTA per SM walking tiles): -1 = by the kernel's heuristic, 0 = off, 1 = on.
  int persistent = -1;
};

}  // namespace flash
