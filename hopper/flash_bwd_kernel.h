// The warp-specialized backward kernel: one CTA per K/V block (of one K/V head and batch). Warpgroup 0:
// warp 0 loads (bwd_loads.h); warp 1 adds each query block's staged dQ to global memory (where dQ is
// staged); the other warpgroups compute (mainloop_bwd.h up to d128, mainloop_bwd_headsplit.h beyond) and
// store dK, dV (epilogue_bwd.h). A programmatic dependent of the preprocess kernel (kernel_launch.h): the
// statistics and the zeroed accumulator are the preprocess's, so the loads of the statistics and the first
// dQ adds wait for its grid; everything before (the prologue, K and V) overlaps its tail. Every CTA waits
// in some thread, so this grid completes after the preprocess's.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "bwd_loads.h"
#include "dq_accumulator.h"
#include "epilogue_bwd.h"
#include "flash.h"
#include "mainloop_bwd.h"
#include "mainloop_bwd_headsplit.h"
#include "mask.h"
#include "tile_scheduler.h"

namespace flash {

using namespace cute;

template <class Config>
struct BwdKernel {
  using Element = typename Config::Element;
  using Mainloop = std::conditional_t<Config::kHeadSplit, BwdMainloopHeadSplit<Config>, BwdMainloop<Config>>;
  using Loads = typename Mainloop::Loads;
  static constexpr int kBlockM = Config::kBlockM;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kHeadDim = Config::kHeadDim;
  static constexpr bool kIsCausal = Config::kIsCausal;
  static constexpr int kNumMmaThreads = Mainloop::kNumMmaThreads;
  static constexpr int kNumThreads = kNumMmaThreads + cutlass::NumThreadsPerWarpGroup;
  static constexpr int kMinBlocksPerSm = 1;
  static constexpr int kSmemLimit = 227 * 1024;
  static constexpr bool kDqFromRegisters = Mainloop::kDqFromRegisters;

  using DqAccum = DqAccumulator<kBlockM, kHeadDim, kNumMmaThreads, /*kStaged=*/!kDqFromRegisters>;
  using Epilogue = BwdEpilogue<Element, kBlockN, kHeadDim, typename Mainloop::SmemLayoutK, typename Mainloop::TiledMmadKV,
                               kNumMmaThreads, Mainloop::kTransposedDkv>;
  // K/V blocks in order: with a causal mask the first blocks see the most queries (longest first).
  // Deterministic mode adds each query block's dQ contributions in the order the CTAs start; causally the
  // last K/V blocks see the fewest query blocks, so they go first there (block n then waits for blocks
  // that started at nearby query blocks, not for block 0 to get there).
  using Scheduler = TileScheduler<kBlockN>;
  __host__ __device__ static bool reverse_blocks(bool deterministic) { return deterministic && kIsCausal; }

  struct NoDqStaging {};
  struct SharedStorage {
    typename Loads::TensorStorage loaded;
    typename Mainloop::TensorStorage compute;
    std::conditional_t<kDqFromRegisters, NoDqStaging, typename DqAccum::TensorStorage> dq;
    typename Loads::BarrierStorage barriers;
  };
  static constexpr int kSharedStorageBytes = int(sizeof(SharedStorage));
  static_assert(kSharedStorageBytes <= kSmemLimit, "shared memory over the sm90 limit");

  struct Params {
    typename Loads::Params loads;
    typename Epilogue::Params epilogue;
    typename DqAccum::Params dq;
    Scheduler scheduler;
    int qheads_per_kvhead;
    float softmax_scale;  // dK's factor
  };

  // Dense calls number their tiles; varlen calls walk VarlenPrepare's list (`varlen_tiles`, at most max_tiles).
  static Scheduler scheduler(BwdParams const& p, TileList varlen_tiles, int max_tiles) {
    if (p.varlen.enabled()) { return Scheduler(varlen_tiles, max_tiles); }
    return Scheduler(p.seqlen_k, p.nheads_kv, p.batch, reverse_blocks(p.deterministic));
  }

  static Params to_params(BwdParams const& p, typename Loads::Params const& loads, typename DqAccum::Params const& dq,
                          Scheduler const& scheduler) {
    return {loads, Epilogue::to_params(p), dq, scheduler, p.nheads / p.nheads_kv, p.softmax_scale};
  }

  __device__ static void run(Params const& params, char* smem) {
    using PipelineQ = typename Loads::PipelineQ;
    using PipelinedO = typename Loads::PipelinedO;
    auto& storage = *reinterpret_cast<SharedStorage*>(smem);
    // Varlen grids are sized by a bound on the tiles: a CTA past the list's end has none.
    if (!params.scheduler.valid(int(blockIdx.x))) {
      wait_for_primary_grid();
      return;
    }
    allow_dependent_launch();  // the postprocess waits for this grid's completion before its first read

    int const warp_group_idx = cutlass::canonical_warp_group_idx();
    int const warp_idx = cutlass::canonical_warp_idx_sync();
    bool const is_producer_thread = threadIdx.x == 0;

    bool const reverse = reverse_blocks(params.dq.deterministic);
    TileCoord const tile = params.scheduler.coord(int(blockIdx.x));

    if (warp_idx == 0 && cute::elect_one_sync()) {
      Loads::prefetch_descriptors(params.loads);
      Epilogue::prefetch_descriptors(params.epilogue);
      Loads::init_barriers(storage.barriers);
      // The CTA's sequence, for every thread (Loads::TensorStorage), published by the __syncthreads below.
      Sequences const& seqs = params.loads.seqs;
      SeqInfo const seq = seqs.at(tile.batch);
      storage.loaded.band = Loads::band(params.loads, seq);
      storage.loaded.k_rows = seqs.k_rows(seq, tile.batch);
      storage.loaded.stats_block0 = int(seqs.template stats_base<kBlockM>(seq, tile.batch) / kBlockM);
    }
    bool const is_producer_warpgroup = warp_group_idx == 0;
    PipelineQ pipeline_q(storage.barriers.pipeline_q,
                         Loads::template pipeline_params<PipelineQ>(Loads::tma_bytes_q(params.loads), is_producer_warpgroup, is_producer_thread),
                         Shape<_1, _1, _1>{});
    PipelinedO pipeline_do(storage.barriers.pipeline_do,
                           Loads::template pipeline_params<PipelinedO>(Loads::tma_bytes_q(params.loads), is_producer_warpgroup, is_producer_thread),
                          Shape<_1, _1, _1>{});
    Loads::zero_unloaded_boxes(params.loads, storage.loaded, int(threadIdx.x), kNumThreads);
    __syncthreads();

    Band const band = Loads::shared_band(params.loads, storage.loaded);
    BlockRange<kBlockM, kBlockN, kIsCausal> const blocks{band};
    int const m_block_min = blocks.m_block_min(tile.block);
    BwdWork const work{tile.block,
                       tile.head,
                       tile.batch,
                       params.qheads_per_kvhead,
                       m_block_min,
                       max(0, blocks.m_block_max(tile.block) - m_block_min),
                       band,
                       storage.loaded.stats_block0,
                       params.loads.stats_head_blocks};
    // The accumulator block of the i-th query block (the statistics' rows, in blocks), and this CTA's place
    // among the K/V blocks that add to it ([n_block_min, n_block_max) of that query block, in start order)
    // for deterministic mode. Both read the CTA's facts from shared memory (bwd_loads.h: TensorStorage).
    auto dq_block_index = [&](int i) {
      int const volatile& block0 = storage.loaded.stats_block0;
      return int64_t(block0 + work.head(i) * work.stats_head_blocks + work.m_block(i));
    };
    auto dq_rank = [&](int i) {
      BlockRange<kBlockM, kBlockN, kIsCausal> const shared_blocks{Loads::shared_band(params.loads, storage.loaded)};
      return reverse ? shared_blocks.n_block_max(work.m_block(i)) - 1 - work.n_block
                     : work.n_block - shared_blocks.n_block_min(work.m_block(i));
    };

    if (warp_group_idx == 0) {
      cutlass::arch::warpgroup_reg_dealloc<Config::kProducerRegs>();
      if (warp_idx == 0) {
        if (is_producer_thread) { Loads::load(params.loads, storage.loaded, storage.barriers, pipeline_q, pipeline_do, work); }
      } else if (warp_idx == 1) {
        if constexpr (!kDqFromRegisters) {
          wait_for_primary_grid();  // the accumulator is zeroed by the preprocess
          DqAccum::writer_start(work.count());
          for (int i = 0; i < work.count(); ++i) {
            DqAccum::writer_add(params.dq, storage.dq, dq_block_index(i), dq_rank(i), i, work.count());
          }
        }
      }
    } else {
      cutlass::arch::warpgroup_reg_alloc<Config::kConsumerRegs>();
      int const thread_idx = int(threadIdx.x) - cutlass::NumThreadsPerWarpGroup;
      typename Mainloop::TiledMmadKV tiled_mma_dkv;
      auto const tile_dkv = std::conditional_t<Mainloop::kTransposedDkv, Shape<Int<kHeadDim>, Int<kBlockN>>,
                                               Shape<Int<kBlockN>, Int<kHeadDim>>>{};
      Tensor tdKrdK = partition_fragment_C(tiled_mma_dkv, tile_dkv);
      Tensor tdVrdV = partition_fragment_C(tiled_mma_dkv, tile_dkv);
      Loads::wait_kv(storage.barriers);
      if constexpr (kDqFromRegisters) { wait_for_primary_grid(); }  // they add to the preprocess's zeroed accumulator
      Mainloop::mma(params.loads, storage.loaded, storage.compute, pipeline_q, pipeline_do, work, thread_idx, tdKrdK, tdVrdV,
                    [&](auto const& tdQrdQ, int i, int slice) {
                      if constexpr (kDqFromRegisters) {
                        DqAccum::template consumer_add<Mainloop::kDqSlices>(params.dq, tdQrdQ, thread_idx, dq_block_index(i),
                                                                            dq_rank(i), slice);
                      } else {
                        static_assert(Mainloop::kDqSlices == 1, "staged dQ: one fragment per query block");
                        DqAccum::consumer_store(storage.dq, tdQrdQ, thread_idx);
                      }
                    });
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(tdKrdK); ++i) { tdKrdK(i) *= params.softmax_scale; }
      TmaRows const volatile& k_rows = storage.loaded.k_rows;
      Epilogue::store(params.epilogue, storage.loaded.smem_k.data(), storage.loaded.smem_v.data(), work.n_block, work.kv_head,
                      TmaRows{k_rows.row_shift, k_rows.batch_coord}, params.loads.head_boxes, thread_idx, tdKrdK, tdVrdV);
    }
  }
};

}  // namespace flash
