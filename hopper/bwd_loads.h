// The backward's producer collective, shared by both consumer layouts (mainloop_bwd.h,
// mainloop_bwd_headsplit.h): K and V of the CTA's block once (one transaction barrier); then per query
// block Q with its LSE_log2, and dO with its dPsum (both from the preprocess kernel), through two TMA
// pipelines, as deep as their layouts have stages (dO's may be shallower where shared memory is short).
// (Consumers reading the forward's LSE from global memory instead measured 20-30% slower: perf-notes
// section 9.)
// It owns those buffers, their TMA descriptors and barriers, and the list of query blocks a CTA walks.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "flash.h"
#include "head_dim_boxes.h"
#include "kernel_launch.h"
#include "layouts.h"
#include "mask.h"
#include "softcap.h"
#include "varlen.h"

namespace flash {

using namespace cute;

// The query blocks a backward CTA walks: for each query head of its K/V head's group, one head after the
// other, the blocks [m_block_min, m_block_min + num_m_blocks).
struct BwdWork {
  int n_block, kv_head, batch;
  int group;  // query heads per K/V head
  int m_block_min, num_m_blocks;
  Band band;  // the keys each query of the batch entry's sequence sees (mask.h)
  // Block (of kBlockM rows) of the first statistics of query head 0 (Sequences::stats_base / kBlockM); each
  // further head's start stats_head_blocks later. (Blocks, not rows: fewer registers for the consumers.)
  int stats_block0, stats_head_blocks;
  __device__ __forceinline__ int stats_block(int i) const { return stats_block0 + head(i) * stats_head_blocks + m_block(i); }
  __device__ __forceinline__ int count() const { return group * num_m_blocks; }
  __device__ __forceinline__ int head(int i) const { return kv_head * group + i / num_m_blocks; }
  __device__ __forceinline__ int m_block(int i) const { return m_block_min + i % num_m_blocks; }

  // Calls step(i, masked) for every query block in order; masked is cute::true_type for the blocks whose
  // scores need the mask (an edge of the band or the end of the keys crosses them), so the consumers
  // compile one masked and one unmasked path.
  template <int kBlockM, int kBlockN, bool kBanded, class Step>
  __device__ __forceinline__ void for_each_block(Step&& step) const {
    BlockRange<kBlockM, kBlockN, kBanded> const blocks{band};
    bool const partial_n_block = (n_block + 1) * kBlockN > band.seqlen_k;
    int const m_block_right_unmasked = kBanded ? blocks.m_block_right_unmasked(n_block) : 0;
    int const m_block_left_masked = kBanded ? blocks.m_block_left_masked(n_block) : 0;
    for (int i = 0; i < count(); ++i) {
      if (partial_n_block || (kBanded && (m_block(i) < m_block_right_unmasked || m_block(i) >= m_block_left_masked))) {
        step(i, cute::true_type{});
      } else {
        step(i, cute::false_type{});
      }
    }
  }
};

// SmemLayoutQ / SmemLayoutdO: (kBlockM, head dim, stages); SmemLayoutK: (kBlockN, head dim), for K and V.
template <class Element, int kBlockM, int kBlockN, int kHeadDim, int kNumMmaThreads, class SmemLayoutQ, class SmemLayoutdO,
          class SmemLayoutK>
struct BwdLoads {
  static constexpr int kStagesQ = decltype(size<2>(SmemLayoutQ{}))::value;
  static constexpr int kStagesdO = decltype(size<2>(SmemLayoutdO{}))::value;
  using SmemLayoutLSE = Layout<Shape<Int<kBlockM>, Int<kStagesQ>>>;     // LSE_log2 per query, with Q's stages
  using SmemLayoutdPsum = Layout<Shape<Int<kBlockM>, Int<kStagesdO>>>;  // dPsum per query, with dO's stages
  using PipelineQ = cutlass::PipelineTmaAsync<kStagesQ>;                // Q + LSE_log2
  using PipelinedO = cutlass::PipelineTmaAsync<kStagesdO>;              // dO + dPsum
  using PipelineStateQ = typename PipelineQ::PipelineState;
  using PipelineStatedO = typename PipelinedO::PipelineState;
  using BarrierKV = cutlass::arch::ClusterTransactionBarrier;
  using Boxes = HeadDimBoxes<Element, kHeadDim>;  // head_dim_boxes.h: boxes wholly past the head dim are skipped

  struct TensorStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> smem_k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> smem_v;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> smem_q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutdO>, 1024> smem_do;
    alignas(128) float smem_lse[cosize_v<SmemLayoutLSE>];
    alignas(128) float smem_dpsum[cosize_v<SmemLayoutdPsum>];
    // Facts of the CTA's K/V block the consumers read back where they need them (shared_band) rather than
    // hold in registers through the mainloop: d128 non-causal ran out of registers with its sequence's
    // lengths in them (ptxas serialised its GEMMs: -10%). Written before the CTA's first barrier.
    Band band;
    TmaRows k_rows;
    int stats_block0;
  };

  struct BarrierStorage {
    alignas(16) BarrierKV barrier_kv;
    alignas(16) typename PipelineQ::SharedStorage pipeline_q;
    alignas(16) typename PipelinedO::SharedStorage pipeline_do;
  };

  static constexpr uint32_t kTmaBytesKV = uint32_t(cosize_v<SmemLayoutK> * sizeof(Element));
  static constexpr uint32_t kRowStatBytes = uint32_t(kBlockM * sizeof(float));
  static constexpr uint32_t kTmaBytesQ = uint32_t(size(take<0, 2>(SmemLayoutQ{})) * sizeof(Element)) + kRowStatBytes;

  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using TileK = Shape<Int<kBlockN>, Int<kHeadDim>>;
  using GmemTensor = decltype(make_gmem_bshd(static_cast<Element const*>(nullptr), GmemShape{}, 0, 0, 0));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutQ{}), TileQ{}, _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutK{}, TileK{}, _1{}));

  struct Params {
    GmemShape shape_q, shape_k;  // dO has q's shape, V k's
    TmaQ tma_q, tma_do;
    TmaKV tma_k, tma_v;
    float const* lse_log2;  // per query row, in blocks (Sequences::stats_base): the preprocess kernel's
    float const* dpsum;     // likewise
    Sequences seqs;         // each sequence's lengths and rows (varlen.h)
    int stats_head_blocks;  // Sequences::stats_head_stride / kBlockM, a kernel parameter rather than a register
    int band_left, band_right;  // the window's sides (Band::side): read by the causal kernels (band())
    ScoreScales scales;  // softmax scale and softcap (softcap.h)
    int head_boxes;      // the head-dim boxes loaded and stored (HeadDimBoxes::used)
  };

  // `packed`: where VarlenPrepare writes the sequences of a varlen call.
  static Params to_params(BwdParams const& p, float const* lse_log2, float const* dpsum, SeqInfo const* packed) {
    bool const varlen = p.varlen.enabled();
    auto rows_q = [&](StridedTensor const& t) {
      return make_gmem_rows<Element const>(t, p.seqlen_q, p.headdim, p.nheads, p.batch, varlen, p.varlen.total_q);
    };
    auto rows_k = [&](StridedTensor const& t) {
      return make_gmem_rows<Element const>(t, p.seqlen_k, p.headdim, p.nheads_kv, p.batch, varlen, p.varlen.total_k);
    };
    return {rows_q(p.q).shape(),
            rows_k(p.k).shape(),
            make_tma_copy(SM90_TMA_LOAD{}, rows_q(p.q), take<0, 2>(SmemLayoutQ{}), TileQ{}, _1{}),
            make_tma_copy(SM90_TMA_LOAD{}, rows_q(p.dout), take<0, 2>(SmemLayoutQ{}), TileQ{}, _1{}),
            make_tma_copy(SM90_TMA_LOAD{}, rows_k(p.k), SmemLayoutK{}, TileK{}, _1{}),
            make_tma_copy(SM90_TMA_LOAD{}, rows_k(p.v), SmemLayoutK{}, TileK{}, _1{}),
            lse_log2,
            dpsum,
            Sequences::make(p, packed),
            int(Sequences::make(p, packed).template stats_rows_per_head<kBlockM>() / kBlockM),
            Band::side(p.options.window_left),
            Band::side(p.options.window_right),
            ScoreScales::make(p.softmax_scale, p.options.softcap),
            Boxes::used(p.headdim)};
  }

  // The bytes a K (or V) load brings, and a Q (or dO: the same sizes) load with its row statistics: the
  // boxes loaded.
  __device__ static uint32_t tma_bytes_kv(Params const& params) {
    return Boxes::kMaySkip ? kTmaBytesKV / Boxes::kCount * params.head_boxes : kTmaBytesKV;
  }
  __device__ static uint32_t tma_bytes_q(Params const& params) {
    return Boxes::kMaySkip ? (kTmaBytesQ - kRowStatBytes) / Boxes::kCount * params.head_boxes + kRowStatBytes : kTmaBytesQ;
  }

  // All threads, before the CTA's first barrier: zeros in the head-dim boxes that no TMA load writes
  // (head_dim_boxes.h), for every GEMM operand the loads fill.
  __device__ static void zero_unloaded_boxes(Params const& params, TensorStorage& tensors, int thread, int num_threads) {
    if constexpr (Boxes::kMaySkip) {
      int const col0 = params.head_boxes * Boxes::kCols;
      if (col0 >= kHeadDim) { return; }
      int const cols = kHeadDim - col0;
      auto zero = [&](auto tensor) {  // (rows, head dim, stages)
        int const rows = size<0>(tensor), stages = size<2>(tensor);
        for (int i = thread; i < rows * cols * stages; i += num_threads) {
          int const s = i / (rows * cols), rc = i - s * rows * cols;
          tensor(rc / cols, col0 + rc % cols, s) = Element(0);
        }
      };
      auto with_stage = [](auto const& layout) { return append<3>(layout, Layout<_1>{}); };
      zero(make_tensor(make_smem_ptr(tensors.smem_k.data()), with_stage(SmemLayoutK{})));
      zero(make_tensor(make_smem_ptr(tensors.smem_v.data()), with_stage(SmemLayoutK{})));
      zero(make_tensor(make_smem_ptr(tensors.smem_q.data()), SmemLayoutQ{}));
      zero(make_tensor(make_smem_ptr(tensors.smem_do.data()), SmemLayoutdO{}));
      cutlass::arch::fence_view_async_shared();  // generic-proxy writes, read next by the GEMMs (async proxy)
    }
  }

  // The keys each query of sequence `seq` sees (mask.h).
  __device__ static Band band(Params const& params, SeqInfo const& seq) {
    return Band{seq.seqlen_q, seq.seqlen_k, params.band_left, params.band_right};
  }
  // The same for the CTA's sequence, read back from shared memory (TensorStorage::band).
  __device__ static Band shared_band(Params const& params, TensorStorage const& t) {
    Band const volatile& b = t.band;
    return Band{b.seqlen_q, b.seqlen_k, params.band_left, params.band_right};
  }

  __device__ static void prefetch_descriptors(Params const& params) {
    prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
    prefetch_tma_descriptor(params.tma_do.get_tma_descriptor());
    prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
  }

  // Called by one thread before the CTA-wide barrier that publishes the barriers.
  __device__ static void init_barriers(BarrierStorage& barriers) { barriers.barrier_kv.init(/*arrive_count=*/1); }

  template <class Pipeline>
  __device__ static typename Pipeline::Params pipeline_params(uint32_t transaction_bytes, bool is_producer_warpgroup,
                                                              bool is_leader) {
    typename Pipeline::Params pipeline_params;
    pipeline_params.transaction_bytes = transaction_bytes;
    pipeline_params.role = is_producer_warpgroup ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
    pipeline_params.is_leader = is_leader;
    pipeline_params.num_consumers = kNumMmaThreads;
    return pipeline_params;
  }

  // A TMA copy of a tile partitioned by tma_partition, ((TMA, box)), without the boxes wholly past the
  // head dim (head_dim_boxes.h). The epilogue's stores take the same path.
  template <class TmaCopy, class Src, class Dst>
  __device__ static void copy_boxes(Params const& params, TmaCopy const& tma, Src const& src, Dst const& dst) {
    copy_head_boxes<Boxes>(params.head_boxes, tma, src, dst);
  }

  // One thread of the producer warp.
  __device__ static void load(Params const& params, TensorStorage& tensors, BarrierStorage& barriers, PipelineQ& pipeline_q,
                              PipelinedO& pipeline_do, BwdWork const& work) {
    Tensor sK = make_tensor(make_smem_ptr(tensors.smem_k.data()), SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(tensors.smem_v.data()), SmemLayoutK{});
    Tensor sQ = make_tensor(make_smem_ptr(tensors.smem_q.data()), SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(tensors.smem_do.data()), SmemLayoutdO{});

    SeqInfo const seq = params.seqs.at(work.batch);
    TmaRows const k_rows = params.seqs.k_rows(seq, work.batch);
    Tensor gK = local_tile(sequence_slice(params.tma_k.get_tma_tensor(params.shape_k), k_rows, work.kv_head), TileK{},
                           make_coord(work.n_block, _0{}));
    Tensor gV = local_tile(sequence_slice(params.tma_v.get_tma_tensor(params.shape_k), k_rows, work.kv_head), TileK{},
                           make_coord(work.n_block, _0{}));
    auto [tKgK, tKsK] = tma_partition(params.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto [tVgV, tVsV] = tma_partition(params.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    using BarrierType = typename BarrierKV::ValueType;
    barriers.barrier_kv.arrive_and_expect_tx(2 * tma_bytes_kv(params));
    copy_boxes(params, params.tma_k.with(reinterpret_cast<BarrierType&>(barriers.barrier_kv), 0), tKgK, tKsK);
    copy_boxes(params, params.tma_v.with(reinterpret_cast<BarrierType&>(barriers.barrier_kv), 0), tVgV, tVsV);

    PipelineStateQ write_state_q = cutlass::make_producer_start_state<PipelineQ>();
    // dO keeps a state of its own only where its depth differs from Q's: a second state is two more of the
    // producer's 24 registers.
    PipelineStatedO write_state_do_own = cutlass::make_producer_start_state<PipelinedO>();
    auto& write_state_do = [&]() -> PipelineStatedO& {
      if constexpr (kStagesQ == kStagesdO) {
        return write_state_q;
      } else {
        return write_state_do_own;
      }
    }();
    TmaRows const q_rows = params.seqs.q_rows(seq, work.batch);
    // K and V are inputs; the statistics are the preprocess kernel's, which may still run (kernel_launch.h).
    wait_for_primary_grid();
    for (int i = 0; i < work.count(); ++i) {
      int const head = work.head(i);
      int const m_block = work.m_block(i);
      Tensor gQ = local_tile(sequence_slice(params.tma_q.get_tma_tensor(params.shape_q), q_rows, head), TileQ{},
                             make_coord(m_block, _0{}));
      Tensor gdO = local_tile(sequence_slice(params.tma_do.get_tma_tensor(params.shape_q), q_rows, head), TileQ{},
                              make_coord(m_block, _0{}));
      auto [tQgQ, tQsQ] = tma_partition(params.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      auto [tdOgdO, tdOsdO] = tma_partition(params.tma_do, _0{}, Layout<_1>{}, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
      int64_t const row_stats = int64_t(work.stats_block(i)) * kBlockM;
      int const stage_q = write_state_q.index();
      int const stage_do = write_state_do.index();

      pipeline_q.producer_acquire(write_state_q);
      BarrierType* barrier_q = pipeline_q.producer_get_barrier(write_state_q);
      copy_boxes(params, params.tma_q.with(*barrier_q, 0), tQgQ, tQsQ(_, stage_q));
      SM90_BULK_COPY_G2S::copy(params.lse_log2 + row_stats, barrier_q, tensors.smem_lse + stage_q * kBlockM, kRowStatBytes);

      pipeline_do.producer_acquire(write_state_do);
      BarrierType* barrier_do = pipeline_do.producer_get_barrier(write_state_do);
      copy_boxes(params, params.tma_do.with(*barrier_do, 0), tdOgdO, tdOsdO(_, stage_do));
      SM90_BULK_COPY_G2S::copy(params.dpsum + row_stats, barrier_do, tensors.smem_dpsum + stage_do * kBlockM, kRowStatBytes);
      ++write_state_q;
      if constexpr (kStagesQ != kStagesdO) { ++write_state_do; }
    }
  }

  __device__ static void wait_kv(BarrierStorage& barriers) { barriers.barrier_kv.wait(0); }

};

}  // namespace flash
