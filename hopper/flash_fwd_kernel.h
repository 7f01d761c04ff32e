// The warp-specialized forward kernel: warpgroup 0 produces (TMA), the others consume (GMMA + softmax)
// and store the tile. Composes the mainloop and epilogue collectives, the tile scheduler and the
// launch policy (one CTA per tile, or persistent CTAs that walk tiles).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "epilogue_fwd.h"
#include "flash.h"
#include "mainloop_fwd.h"
#include "mask.h"
#include "softmax.h"
#include "tile_scheduler.h"

namespace flash {

using namespace cute;

template <class Config>
struct FwdKernel {
  using Mainloop = FwdMainloop<Config>;
  static constexpr int kBlockM = Config::kBlockM;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr bool kIsCausal = Config::kIsCausal;
  static constexpr int kNumMmaThreads = Mainloop::kNumMmaThreads;
  static constexpr int kNumThreads = kNumMmaThreads + cutlass::NumThreadsPerWarpGroup;
  static constexpr int kMinBlocksPerSm = 1;
  // setmaxnreg moves registers between warpgroups inside what the CTA got at launch (the per-thread count
  // ptxas can give kNumThreads threads, a multiple of 8): asking for more makes the consumers' increase wait
  // forever.
  static_assert(Config::kProducerRegs * cutlass::NumThreadsPerWarpGroup + Config::kConsumerRegs * kNumMmaThreads <=
                    (65536 / kNumThreads) / 8 * 8 * kNumThreads,
                "the setmaxnreg split exceeds the CTA's registers");
  static constexpr int kSmemLimit = 227 * 1024;

  // Launch policy. Persistent launches (non-causal only: equal-cost tiles) need O staged in a buffer of its
  // own, so that the next tile's Q can land during the epilogue: +12% at 512, +5% at 1k for d64
  // (perf-notes sections 4-5). Kernels where that buffer fits beside the mainloop's compute one or more
  // tiles per CTA in a loop; the others exactly one tile per CTA with straight-line code (the loop measured
  // 3-6% slower there), staging O in Q's buffer. The host launches persistent CTAs while a tile has at most
  // kPersistentMaxBlocks K/V blocks; past that one CTA per tile is as fast.
  using EpilogueOwnBuffer = FwdEpilogue<typename Config::ElementOut, kBlockM, Config::kHeadDim,
                                        typename Mainloop::TiledMmaPV, kNumMmaThreads, /*kOwnBuffer=*/true>;
  static constexpr bool kPersistentCapable =
      !kIsCausal && int(sizeof(typename Mainloop::TensorStorage)) + EpilogueOwnBuffer::kSmemBytes + 1024 <= kSmemLimit;
  static constexpr int kPersistentMaxBlocks = 8;
  using Epilogue = FwdEpilogue<typename Config::ElementOut, kBlockM, Config::kHeadDim, typename Mainloop::TiledMmaPV,
                               kNumMmaThreads, kPersistentCapable>;
  // Without a buffer of its own, O is staged in one the mainloop no longer needs at the end of the tile:
  // Q's (16-bit), or V^T's (FP8: bf16 O is twice Q's size; GEMM1, the only reader of V^T, is done and so
  // are the transposes once the consumers reach the epilogue).
  static constexpr bool kStageOInVt = Mainloop::kTransposeV;
  static_assert(kPersistentCapable || Epilogue::kSmemBytes <= (kStageOInVt ? Mainloop::kSmemBytesVt : Mainloop::kSmemBytesQ),
                "O fits the lent buffer");
  using Scheduler = TileScheduler<kBlockM>;
  static constexpr bool kLongestFirst = kIsCausal;  // causal query blocks grow with the block index

  struct TensorsWithO {
    typename Mainloop::TensorStorage mainloop;
    typename Epilogue::TensorStorage epilogue;
  };
  struct TensorsWithoutO {
    typename Mainloop::TensorStorage mainloop;
  };
  struct SharedStorage {
    std::conditional_t<kPersistentCapable, TensorsWithO, TensorsWithoutO> tensors;
    typename Mainloop::BarrierStorage barriers;
  };
  static constexpr int kSharedStorageBytes = int(sizeof(SharedStorage));
  static_assert(kSharedStorageBytes <= kSmemLimit, "shared memory over the sm90 limit");

  struct Params {
    typename Mainloop::Params mainloop;
    typename Epilogue::Params epilogue;
    int seqlen_q, nheads, batch;
  };

  static Params to_params(FwdParams const& p) {
    return {Mainloop::to_params(p), Epilogue::to_params(p), p.seqlen_q, p.nheads, p.batch};
  }

  static dim3 grid(FwdParams const& p, int num_sms) {
    bool persistent = kPersistentCapable && ceil_div(p.seqlen_k, kBlockN) <= kPersistentMaxBlocks;
    if (p.persistent >= 0) { persistent = kPersistentCapable && p.persistent != 0; }
    return Scheduler(p.seqlen_q, p.nheads, p.batch, kLongestFirst).grid(persistent, num_sms);
  }

  __device__ static void run(Params const& params, char* smem) {
    using PipelineKV = typename Mainloop::PipelineKV;
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
    // The pipelines initialise their barriers from warp 0; the __syncthreads below publishes them.
    auto pipelines = Mainloop::make_pipelines(storage.barriers, warp_group_idx == 0, is_producer_thread);
    __syncthreads();

    Scheduler const scheduler(params.seqlen_q, params.nheads, params.batch, kLongestFirst);
    auto for_each_tile = [&](auto&& body) {
      if constexpr (kPersistentCapable) {
        int iteration = 0;
        for (int t = scheduler.first(); scheduler.valid(t); t = scheduler.next(t), ++iteration) { body(t, iteration); }
      } else {
        body(scheduler.first(), 0);
      }
    };
    auto n_block_max = [&](TileCoord const& tile) {
      return Blocks::n_block_max(tile.block, params.mainloop.seqlen_q, params.mainloop.seqlen_k);
    };

    if (warp_group_idx == 0) {
      cutlass::arch::warpgroup_reg_dealloc<Config::kProducerRegs>();
      // One thread issues the TMA loads; FP8: warps 1-3 transpose V.
      if (is_producer_thread) {
        typename Mainloop::PipelineState write_state = cutlass::make_producer_start_state<PipelineKV>();
        for_each_tile([&](int t, int iteration) {
          TileCoord const tile = scheduler.coord(t);
          Mainloop::template load<kPersistentCapable>(params.mainloop, storage.tensors.mainloop, storage.barriers, pipelines,
                                                      write_state, tile, n_block_max(tile), iteration);
        });
      } else if (Mainloop::kTransposeV && warp_idx > 0) {
        typename Mainloop::TransposeState state;
        for_each_tile([&](int t, int) {
          Mainloop::transpose_tile(storage.tensors.mainloop, storage.barriers, state, n_block_max(scheduler.coord(t)),
                                   int(threadIdx.x) - cutlass::NumThreadsPerWarp);
        });
      }
    } else {
      cutlass::arch::warpgroup_reg_alloc<Config::kConsumerRegs>();
      int const thread_idx = int(threadIdx.x) - cutlass::NumThreadsPerWarpGroup;
      typename Mainloop::PipelineState read_k;  // consumer states start at stage 0, phase 0
      typename Mainloop::PipelineStateV read_v;
      typename Config::ElementOut* smem_o;
      if constexpr (kPersistentCapable) {
        smem_o = storage.tensors.epilogue.smem_o.data();
      } else if constexpr (kStageOInVt) {
        smem_o = reinterpret_cast<typename Config::ElementOut*>(Mainloop::smem_vt(storage.tensors.mainloop));
      } else {
        smem_o = storage.tensors.mainloop.smem_q.data();
      }
      for_each_tile([&](int t, int iteration) {
        TileCoord const tile = scheduler.coord(t);
        int const n_blocks = n_block_max(tile);
        typename Mainloop::TiledMmaPV tiled_mma_pv;
        Tensor tOrO = partition_fragment_C(tiled_mma_pv, select<0, 2>(typename Mainloop::TileShapeMNK{}));
        auto const scales = Mainloop::tile_scales(params.mainloop, tile);
        Softmax<2 * decltype(size<1>(tOrO))::value, Config::kMaxOffset> softmax(scales.softmax_scale_log2);
        Mainloop::wait_q(storage.barriers, iteration);
        if (n_blocks > 0) {
          Mainloop::mma(params.mainloop, storage.tensors.mainloop, pipelines, read_k, read_v, tile, n_blocks, thread_idx,
                        tOrO, softmax);
        } else {
          clear(tOrO);  // no key visible to any row: O = 0, and finalize gives LSE = -inf
        }
        auto scores_scale = softmax.finalize(scales.o_scale);
        softmax.rescale_o(tOrO, scores_scale);
        Epilogue::store(params.epilogue, smem_o, tile, thread_idx, tOrO, softmax.row_sum,
                        [&] { Mainloop::release_q(storage.barriers); });
      });
      Epilogue::finish(thread_idx);
    }
  }
};

}  // namespace flash
