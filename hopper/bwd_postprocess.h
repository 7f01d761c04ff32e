// Backward postprocess kernel: dq = softmax_scale * (the fp32 dQ accumulator), converted to the input
// dtype. The accumulator holds each query block in the dQ GEMM's fragment order (dq_accumulator.h); each
// thread here reads the values that consumer thread of the same index held (coalesced 16-byte loads) and
// places them in shared memory through the same TiledMma's coordinates; the block then leaves by whole
// 16-byte row chunks. (Storing each value from its fragment coordinates straight to global memory, two
// bytes at a time, made this kernel 3x slower: perf-notes section 17.) A programmatic dependent of the main
// kernel (kernel_launch.h): its launch overlaps the main kernel's tail; it waits for that grid before its
// first read (dq's memory holds the statistics the main kernel reads).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>

#include "flash.h"
#include "kernel_launch.h"
#include "varlen.h"

namespace flash {

using namespace cute;

// TiledMmadQ: the main kernel's dQ GEMM, (queries, head dim), or one slice of the head dim wide beyond d128 (a
// thread's fragment of the block is then its slices' one after the other). DqAccum: the main kernel's
// DqAccumulator, whose float4_index says where each thread's values lie.
template <class Element, int kBlockM, int kHeadDim, class TiledMmadQ, int kNumMmaThreads, class DqAccum>
struct BwdPostprocess {
  static constexpr int kNumThreads = kNumMmaThreads;
  static constexpr int kMinBlocksPerSm = 2;
  static constexpr int kBlockFloats = kBlockM * kHeadDim;
  static constexpr int kChunk = 16 / int(sizeof(Element));  // elements per 16-byte store
  static constexpr int kRowPitch = kHeadDim + kChunk;        // padded rows: fewer bank conflicts, chunks aligned
  static constexpr int kSharedStorageBytes = kBlockM * kRowPitch * int(sizeof(Element));

  struct Params {
    float const* accum;  // blocks of kBlockFloats, one per block of the statistics' rows (Sequences::stats_base)
    StridedTensor dq;    // 16-byte aligned rows (arg_checks: check_layout)
    Sequences seqs;
    int const* stats_block_batch;  // varlen: the batch entry of each block of a head's statistics (varlen.h)
    int headdim;
    float softmax_scale;
  };

  // A CTA per block of kBlockM query rows (Sequences::stats_grid).
  static dim3 grid(Sequences const& seqs) { return seqs.stats_grid<kBlockM>(); }

  __device__ static void run(Params const& params, char* smem) {
    wait_for_primary_grid();
    int const head = blockIdx.y;
    auto const block = params.seqs.template stats_block<kBlockM>(params.stats_block_batch);
    if (block.batch < 0) { return; }
    int const batch = block.batch, m_block = block.m_block;
    SeqInfo const& seq = block.seq;
    int64_t const stats_base = block.stats_base;
    int const thread_idx = threadIdx.x;
    int64_t const block_index = (stats_base + head * params.seqs.template stats_head_stride<kBlockM>()) / kBlockM + m_block;
    auto const* src = reinterpret_cast<float4 const*>(params.accum + block_index * kBlockFloats);
    auto* tile = reinterpret_cast<Element*>(smem);  // (kBlockM, kRowPitch)

    TiledMmadQ tiled_mma;
    auto const tile_dq = Shape<Int<kBlockM>, Int<kHeadDim>>{};  // (queries, head dim)
    Tensor coords = tiled_mma.get_thread_slice(thread_idx).partition_C(make_identity_tensor(tile_dq));
    constexpr int kValues = decltype(size(coords))::value;
    static_assert(kValues * kNumThreads == kBlockFloats);
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kValues / 4; ++j) {
      float4 const v = src[DqAccum::float4_index(j, thread_idx)];
      float const values[4] = {v.x, v.y, v.z, v.w};
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < 4; ++e) {
        int const row = int(get<0>(coords(4 * j + e)));
        int const col = int(get<1>(coords(4 * j + e)));
        tile[row * kRowPitch + col] = Element(values[e] * params.softmax_scale);
      }
    }
    __syncthreads();

    auto* dq = static_cast<Element*>(params.dq.ptr) + batch * params.dq.batch_stride + head * params.dq.head_stride +
               seq.start_q * params.dq.row_stride;
    int const rows = min(kBlockM, seq.seqlen_q - m_block * kBlockM);
    int const chunks_per_row = params.headdim / kChunk;  // the head dim is a multiple of 8 (arg_checks)
    for (int c = thread_idx; c < rows * chunks_per_row; c += kNumThreads) {
      int const row = c / chunks_per_row, col = (c - row * chunks_per_row) * kChunk;
      *reinterpret_cast<uint4*>(dq + int64_t(m_block * kBlockM + row) * params.dq.row_stride + col) =
          *reinterpret_cast<uint4 const*>(tile + row * kRowPitch + col);
    }
  }
};

}  // namespace flash
