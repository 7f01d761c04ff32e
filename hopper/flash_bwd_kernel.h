// The warp-specialized backward kernel: one CTA per K/V block (of one K/V head and batch). Warpgroup 0:
// warp 0 loads (TMA), warp 1 adds each query block's dQ to global memory; the other warpgroups compute
// (mainloop_bwd.h) and store dK, dV (epilogue_bwd.h).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "dq_accumulator.h"
#include "epilogue_bwd.h"
#include "flash.h"
#include "mainloop_bwd.h"
#include "mask.h"
#include "tile_scheduler.h"

namespace flash {

using namespace cute;

template <class Config>
struct BwdKernel {
  using Element = typename Config::Element;
  using Mainloop = BwdMainloop<Config>;
  static constexpr int kBlockM = Config::kBlockM;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kHeadDim = Config::kHeadDim;
  static constexpr bool kIsCausal = Config::kIsCausal;
  static constexpr int kNumMmaThreads = Mainloop::kNumMmaThreads;
  static constexpr int kNumThreads = kNumMmaThreads + cutlass::NumThreadsPerWarpGroup;
  static constexpr int kMinBlocksPerSm = 1;
  static constexpr int kSmemLimit = 227 * 1024;

  using DqAccum = DqAccumulator<kBlockM, kHeadDim, kNumMmaThreads>;
  using Epilogue = BwdEpilogue<Element, kBlockN, kHeadDim, typename Mainloop::SmemLayoutK, typename Mainloop::TiledMmadKV,
                               kNumMmaThreads>;
  // K/V blocks in order: with a causal mask the first blocks see the most queries (longest first), and
  // deterministic mode needs block n - 1 of a head to start before block n.
  using Scheduler = TileScheduler<kBlockN, /*kLongestFirst=*/false>;

  struct SharedStorage {
    typename Mainloop::TensorStorage mainloop;
    typename DqAccum::TensorStorage dq;
    typename Mainloop::BarrierStorage barriers;
  };
  static constexpr int kSharedStorageBytes = int(sizeof(SharedStorage));
  static_assert(kSharedStorageBytes <= kSmemLimit, "shared memory over the sm90 limit");

  struct Params {
    typename Mainloop::Params mainloop;
    typename Epilogue::Params epilogue;
    typename DqAccum::Params dq;
    int seqlen_q, seqlen_k, nheads_kv, batch, qheads_per_kvhead, num_m_blocks;
    float softmax_scale;  // dK's factor
  };

  static Params to_params(BwdParams const& p, typename Mainloop::Params const& mainloop, typename DqAccum::Params const& dq,
                          int num_m_blocks) {
    return {mainloop, Epilogue::to_params(p), dq, p.seqlen_q, p.seqlen_k, p.nheads_kv, p.batch, p.nheads / p.nheads_kv,
            num_m_blocks, p.softmax_scale};
  }

  static dim3 grid(BwdParams const& p) { return Scheduler(p.seqlen_k, p.nheads_kv, p.batch).grid(/*persistent=*/false, 0); }

  __device__ static void run(Params const& params, char* smem) {
    using PipelineQ = typename Mainloop::PipelineQ;
    using Blocks = BlockRange<kBlockM, kBlockN, kIsCausal>;
    auto& storage = *reinterpret_cast<SharedStorage*>(smem);

    int const warp_group_idx = cutlass::canonical_warp_group_idx();
    int const warp_idx = cutlass::canonical_warp_idx_sync();
    bool const is_producer_thread = threadIdx.x == 0;

    if (warp_idx == 0 && cute::elect_one_sync()) {
      Mainloop::prefetch_descriptors(params.mainloop);
      Epilogue::prefetch_descriptors(params.epilogue);
      Mainloop::init_barriers(storage.barriers);
    }
    auto const pipeline_params = Mainloop::pipeline_params(warp_group_idx == 0, is_producer_thread);
    PipelineQ pipeline_q(storage.barriers.pipeline_q, pipeline_params, Shape<_1, _1, _1>{});
    PipelineQ pipeline_do(storage.barriers.pipeline_do, pipeline_params, Shape<_1, _1, _1>{});
    __syncthreads();

    TileCoord const tile = Scheduler(params.seqlen_k, params.nheads_kv, params.batch).coord(int(blockIdx.x));
    int const m_block_min = Blocks::m_block_min(tile.block, params.seqlen_q, params.seqlen_k);
    BwdWork const work{tile.block,
                       tile.head,
                       tile.batch,
                       params.qheads_per_kvhead,
                       m_block_min,
                       max(0, Blocks::m_block_max(params.seqlen_q) - m_block_min)};

    if (warp_group_idx == 0) {
      cutlass::arch::warpgroup_reg_dealloc<Config::kProducerRegs>();
      if (warp_idx == 0) {
        if (is_producer_thread) {
          Mainloop::load(params.mainloop, storage.mainloop, storage.barriers, pipeline_q, pipeline_do, work);
        }
      } else if (warp_idx == 1) {
        if (work.count() > 0) { DqAccum::writer_start(); }
        for (int i = 0; i < work.count(); ++i) {
          int64_t const block_index = (int64_t(work.batch) * params.qheads_per_kvhead * params.nheads_kv + work.head(i)) *
                                          params.num_m_blocks + work.m_block(i);
          DqAccum::writer_add(params.dq, storage.dq, block_index, work.n_block, /*is_last=*/i + 1 == work.count());
        }
      }
    } else {
      cutlass::arch::warpgroup_reg_alloc<Config::kConsumerRegs>();
      int const thread_idx = int(threadIdx.x) - cutlass::NumThreadsPerWarpGroup;
      typename Mainloop::TiledMmadKV tiled_mma_dkv;
      Tensor tdKrdK = partition_fragment_C(tiled_mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
      Tensor tdVrdV = partition_fragment_C(tiled_mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
      Mainloop::wait_kv(storage.barriers);
      Mainloop::mma(params.mainloop, storage.mainloop, pipeline_q, pipeline_do, work, thread_idx, tdKrdK, tdVrdV,
                    [&](auto const& tdQrdQ) { DqAccum::consumer_store(storage.dq, tdQrdQ, thread_idx); });
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(tdKrdK); ++i) { tdKrdK(i) *= params.softmax_scale; }
      Epilogue::store(params.epilogue, storage.mainloop.smem_k.data(), storage.mainloop.smem_v.data(), work.n_block,
                      work.kv_head, work.batch, thread_idx, tdKrdK, tdVrdV);
    }
  }
};

}  // namespace flash
