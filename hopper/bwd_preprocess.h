// Backward preprocess kernel, per query row: dPsum = rowsum(dO * O) in fp32, minus dLSE when the loss
// also depends on the LSE (dL/dS gains dLSE * P: the same form as the dPsum term); LSE into the log2
// domain. The padding rows up to a whole query block are written too (the main kernel loads whole
// blocks): there, and for rows that see no key (LSE = -inf), LSE_log2 = +inf, so that the main kernel's
// P = exp2(S * scale_log2 - LSE_log2) is exactly 0. It also zeroes the block's dQ accumulator (and its
// semaphore in deterministic mode; dq_accumulator.h) for the main kernel's adds: no memset of its own, whose
// 134 MB at 16k tokens (hidden 2048) took 30 us and a launch (perf-notes section 54). The main kernel is
// its programmatic dependent (kernel_launch.h): it may start loading K and V while this kernel's last CTAs
// run, and waits for this grid before its first statistics and its first add.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include "flash.h"
#include "kernel_launch.h"
#include "varlen.h"

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
    float const* lse;   // the forward's: (batch, nheads, seqlen_q), varlen (nheads, total_q)
    float const* dlse;  // likewise, or nullptr
    float* lse_log2;    // per query row, in blocks (Sequences::stats_base)
    float* dpsum;       // likewise
    Sequences seqs;
    int const* stats_block_batch;  // varlen: the batch entry of each block of a head's statistics (varlen.h)
    int headdim;
    float* accum;                // the dQ accumulator: blocks of accum_block_floats, one per block of statistics
    int accum_block_floats;      // kBlockM x the kernel's head dim (a multiple of 4)
    int* semaphores;             // one per block, deterministic mode only (else nullptr)
  };

  // A CTA per block of kBlockM query rows (Sequences::stats_grid).
  static dim3 grid(Sequences const& seqs) { return seqs.stats_grid<kBlockM>(); }

  __device__ static void run(Params const& params, char* /*smem*/) {
    allow_dependent_launch();  // the main kernel waits for this grid's completion before it reads our output
    int const head = blockIdx.y;
    auto const block = params.seqs.template stats_block<kBlockM>(params.stats_block_batch);
    if (block.batch < 0) { return; }
    int const batch = block.batch, m_block = block.m_block;
    SeqInfo const& seq = block.seq;
    int64_t const stats_base = block.stats_base;
    int const warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int64_t const stats_row0 = stats_base + head * params.seqs.template stats_head_stride<kBlockM>();
    int64_t const block_index = stats_row0 / kBlockM + m_block;  // as the main kernel and the postprocess count it
    auto* accum = reinterpret_cast<float4*>(params.accum + block_index * params.accum_block_floats);
    for (int i = int(threadIdx.x); i < params.accum_block_floats / 4; i += kNumThreads) { accum[i] = make_float4(0.f, 0.f, 0.f, 0.f); }
    if (params.semaphores != nullptr && threadIdx.x == 0) { params.semaphores[block_index] = 0; }
    int64_t const lse_row0 = params.seqs.lse_row0(seq, batch, head);
    auto const* o = static_cast<Element const*>(params.o.ptr) + batch * params.o.batch_stride + head * params.o.head_stride +
                    seq.start_q * params.o.row_stride;
    auto const* dout = static_cast<Element const*>(params.dout.ptr) + batch * params.dout.batch_stride +
                       head * params.dout.head_stride + seq.start_q * params.dout.row_stride;
    cutlass::NumericArrayConverter<float, Element, kChunk> to_float;
    // A group of lanes per row, as many as the head dim has chunks (rounded up to a power of two): one
    // row per warp left three quarters of the lanes idle at d64.
    int const chunks = params.headdim / kChunk;
    int const lanes_per_row = chunks <= 8 ? 8 : (chunks <= 16 ? 16 : 32);
    int const rows_per_warp = 32 / lanes_per_row;
    int const chunk = lane % lanes_per_row;
    int const block_end = (m_block + 1) * kBlockM;
    // The loop bound is the warp's first row, so that every lane of a warp takes part in each shuffle.
    for (int warp_row = m_block * kBlockM + warp * rows_per_warp; warp_row < block_end; warp_row += kNumWarps * rows_per_warp) {
      int const row = warp_row + lane / lanes_per_row;
      bool const in_block = row < block_end;
      float dot = 0.f;
      if (in_block && row < seq.seqlen_q && chunk < chunks) {
        auto const o_chunk = to_float(*reinterpret_cast<cutlass::Array<Element, kChunk> const*>(o + row * params.o.row_stride + chunk * kChunk));
        auto const do_chunk = to_float(*reinterpret_cast<cutlass::Array<Element, kChunk> const*>(dout + row * params.dout.row_stride + chunk * kChunk));
        CUTLASS_PRAGMA_UNROLL
        for (int e = 0; e < kChunk; ++e) { dot += o_chunk[e] * do_chunk[e]; }
      }
      for (int offset = lanes_per_row / 2; offset > 0; offset /= 2) { dot += __shfl_xor_sync(0xffffffffu, dot, offset); }
      if (in_block && chunk == 0) {
        float lse_log2 = INFINITY, dpsum = 0.f;
        if (row < seq.seqlen_q) {
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
