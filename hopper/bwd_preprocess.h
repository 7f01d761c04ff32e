// Backward preprocess kernel, per query row: dPsum = rowsum(dO * O) in fp32, minus dLSE when the loss
// also depends on the LSE (dL/dS gains dLSE * P: the same form as the dPsum term); LSE into the log2
// domain. The padding rows up to a whole query block are written too (the main kernel loads whole
// blocks): there, and for rows that see no key (LSE = -inf), LSE_log2 = +inf, so that the main kernel's
// P = exp2(S * scale_log2 - LSE_log2) is exactly 0.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include "flash.h"

namespace flash {

template <class Element, int kBlockM>
struct BwdPreprocess {
  static constexpr int kNumThreads = 256;
  static constexpr int kMinBlocksPerSm = 2;
  static constexpr int kSharedStorageBytes = 0;
  static constexpr int kNumWarps = kNumThreads / 32;
  static constexpr int kChunk = 8;  // elements per 16-byte load; 32 lanes x 8 covers head dims up to 256

  struct Params {
    StridedTensor o, dout;
    float const* lse;   // (batch, nheads, seqlen_q)
    float const* dlse;  // likewise, or nullptr
    float* lse_log2;    // (batch, nheads, seqlen_q_rounded)
    float* dpsum;       // likewise
    int seqlen_q, seqlen_q_rounded, nheads, headdim;
  };

  static dim3 grid(int seqlen_q_rounded, int nheads, int batch) {
    return dim3(unsigned(seqlen_q_rounded / kBlockM), unsigned(nheads), unsigned(batch));
  }

  __device__ static void run(Params const& params, char* /*smem*/) {
    int const head = blockIdx.y, batch = blockIdx.z;
    int const warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int64_t const stats_row0 = (int64_t(batch) * params.nheads + head) * params.seqlen_q_rounded;
    int64_t const lse_row0 = (int64_t(batch) * params.nheads + head) * params.seqlen_q;
    auto const* o = static_cast<Element const*>(params.o.ptr) + batch * params.o.batch_stride + head * params.o.head_stride;
    auto const* dout = static_cast<Element const*>(params.dout.ptr) + batch * params.dout.batch_stride + head * params.dout.head_stride;
    cutlass::NumericArrayConverter<float, Element, kChunk> to_float;
    for (int row = blockIdx.x * kBlockM + warp; row < (blockIdx.x + 1) * kBlockM; row += kNumWarps) {
      float dot = 0.f;
      if (row < params.seqlen_q && lane * kChunk < params.headdim) {
        auto const o_chunk = to_float(*reinterpret_cast<cutlass::Array<Element, kChunk> const*>(o + row * params.o.row_stride + lane * kChunk));
        auto const do_chunk = to_float(*reinterpret_cast<cutlass::Array<Element, kChunk> const*>(dout + row * params.dout.row_stride + lane * kChunk));
        CUTLASS_PRAGMA_UNROLL
        for (int e = 0; e < kChunk; ++e) { dot += o_chunk[e] * do_chunk[e]; }
      }
      CUTLASS_PRAGMA_UNROLL
      for (int offset = 16; offset > 0; offset /= 2) { dot += __shfl_xor_sync(0xffffffffu, dot, offset); }
      if (lane == 0) {
        float lse_log2 = INFINITY, dpsum = 0.f;
        if (row < params.seqlen_q) {
          float const lse = params.lse[lse_row0 + row];
          lse_log2 = lse == -INFINITY ? INFINITY : lse * float(M_LOG2E);
          dpsum = dot - (params.dlse != nullptr ? params.dlse[lse_row0 + row] : 0.f);
        }
        params.lse_log2[stats_row0 + row] = lse_log2;
        params.dpsum[stats_row0 + row] = dpsum;
      }
    }
  }
};

}  // namespace flash
