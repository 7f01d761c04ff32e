// Host-side descriptions of one call, filled by csrc/flash_api.cpp from the torch tensors.
#pragma once

#include <cstdint>

namespace flash {

// A (batch, seqlen, heads, headdim) tensor whose last dim is contiguous; strides in elements.
struct StridedTensor {
  void* ptr;
  int64_t batch_stride, row_stride, head_stride;
};

struct FwdParams {
  // q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim); o has q's shape.
  StridedTensor q, k, v, o;
  float* lse;  // (batch, nheads, seqlen_q), contiguous
  int batch, seqlen_q, seqlen_k, nheads, nheads_kv;
  int headdim;  // the real head dim; the kernel's may be larger (zero-filled by TMA, clipped on store)
  float softmax_scale;
  // Consumer warpgroup ping-pong: -1 = the configuration's default, 0 = off, 1 = on (for A/B measurements).
  int pingpong = -1;
  // Persistent launch (one CTA per SM walking tiles): -1 = by the kernel's heuristic, 0 = off, 1 = on.
  int persistent = -1;
};

struct BwdParams {
  // Inputs as in FwdParams, plus out (q's shape), dout (q's shape) and lse from the forward.
  StridedTensor q, k, v, o, dout;
  float const* lse;   // (batch, nheads, seqlen_q), contiguous
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
  bool deterministic;  // dQ contributions added in a fixed order: bitwise-reproducible gradients
};

}  // namespace flash
