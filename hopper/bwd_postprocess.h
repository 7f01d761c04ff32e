// Backward postprocess kernel: dq = softmax_scale * (the fp32 dQ accumulator), converted to the input
// dtype. The accumulator holds each query block in the dQ GEMM's fragment order (dq_accumulator.h); each
// thread here reads the values that consumer thread of the same index held and places them through the
// same TiledMma's coordinates.
#pragma once

#include <cute/tensor.hpp>

#include "flash.h"

namespace flash {

using namespace cute;

// DqTile: dQ's tile as the main kernel's GEMM computed it, (queries, head dim) or, kTransposed, (head dim,
// queries).
template <class Element, int kBlockM, int kHeadDim, class TiledMmadQ, class DqTile, bool kTransposed, int kNumMmaThreads>
struct BwdPostprocess {
  static constexpr int kNumThreads = kNumMmaThreads;
  static constexpr int kMinBlocksPerSm = 2;
  static constexpr int kSharedStorageBytes = 0;
  static constexpr int kBlockFloats = kBlockM * kHeadDim;

  struct Params {
    float const* accum;  // (batch, nheads, num_m_blocks, kBlockFloats)
    StridedTensor dq;
    int seqlen_q, nheads, num_m_blocks, headdim;
    float softmax_scale;
  };

  static dim3 grid(int num_m_blocks, int nheads, int batch) { return dim3(unsigned(num_m_blocks), unsigned(nheads), unsigned(batch)); }

  __device__ static void run(Params const& params, char* /*smem*/) {
    int const m_block = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
    int const thread_idx = threadIdx.x;
    int64_t const block_index = (int64_t(batch) * params.nheads + head) * params.num_m_blocks + m_block;
    auto const* src = reinterpret_cast<float4 const*>(params.accum + block_index * kBlockFloats);
    auto* dq = static_cast<Element*>(params.dq.ptr) + batch * params.dq.batch_stride + head * params.dq.head_stride;

    TiledMmadQ tiled_mma;
    Tensor coords = tiled_mma.get_thread_slice(thread_idx).partition_C(make_identity_tensor(DqTile{}));
    constexpr int kValues = decltype(size(coords))::value;
    static_assert(kValues * kNumThreads == kBlockFloats);
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kValues / 4; ++j) {
      float4 const v = src[j * kNumThreads + thread_idx];
      float const values[4] = {v.x, v.y, v.z, v.w};
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < 4; ++e) {
        int const row = m_block * kBlockM + int(get<kTransposed ? 1 : 0>(coords(4 * j + e)));
        int const col = int(get<kTransposed ? 0 : 1>(coords(4 * j + e)));
        if (row < params.seqlen_q && col < params.headdim) { dq[row * params.dq.row_stride + col] = Element(values[e] * params.softmax_scale); }
      }
    }
  }
};

}  // namespace flash
