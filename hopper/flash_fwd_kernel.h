// The warp-specialized forward kernel: warpgroup 0 produces (TMA), the others consume (GMMA + softmax)
// and store the tile.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "epilogue_fwd.h"
#include "kernel_traits.h"
#include "mainloop_fwd.h"
#include "softmax.h"
#include "tile_scheduler.h"

namespace flash {

using namespace cute;

// Everything the device needs: TMA descriptors (built on the host) and the problem sizes.
template <class Traits>
struct FwdKernelParams {
  using Element = typename Traits::Element;
  using TileShapeMNK = typename Traits::TileShapeMNK;
  using ShapeT = Shape<int32_t, int32_t, int32_t, int32_t>;  // (seqlen, headdim, heads, batch)
  using StrideT = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemTensorIn = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeT{}, StrideT{}));
  using GmemTensorOut = decltype(make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), ShapeT{}, StrideT{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensorIn{}, typename Traits::SmemLayoutQ{},
                                      select<0, 2>(TileShapeMNK{}), _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensorIn{}, take<0, 2>(typename Traits::SmemLayoutK{}),
                                       select<1, 2>(TileShapeMNK{}), _1{}));
  using TmaO = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensorOut{}, typename Traits::SmemLayoutO{},
                                      select<0, 2>(TileShapeMNK{}), _1{}));

  ShapeT shape_q;  // also O's
  ShapeT shape_k;  // also V's
  TmaQ tma_q;
  TmaKV tma_k;
  TmaKV tma_v;
  TmaO tma_o;
  float* lse;
  int batch, seqlen_q, seqlen_k, nheads, qheads_per_kvhead;
  float softmax_scale_log2;
  bool pingpong;  // consumer warpgroups take turns issuing GEMMs (WarpgroupScheduler)
};

template <class Traits>
__global__ void __launch_bounds__(Traits::kNumThreads, 1)
    flash_fwd_kernel(CUTE_GRID_CONSTANT FwdKernelParams<Traits> const params) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using PipelineKV = typename Traits::PipelineKV;
  using Mainloop = FwdMainloop<Traits>;
  using Epilogue = FwdEpilogue<Traits>;
  using Scheduler = TileScheduler<Traits::kBlockM, Traits::kIsCausal>;
  using Blocks = BlockRange<Traits::kBlockM, Traits::kBlockN, Traits::kIsCausal>;

  extern __shared__ char smem_buf[];
  auto& storage = *reinterpret_cast<typename Traits::SharedStorage*>(smem_buf);

  int const warp_group_idx = cutlass::canonical_warp_group_idx();
  int const warp_idx = cutlass::canonical_warp_idx_sync();
  bool const is_producer_thread = threadIdx.x == 0;

  if (warp_idx == 0 && cute::elect_one_sync()) {
    prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
    prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
    prefetch_tma_descriptor(params.tma_o.get_tma_descriptor());
    storage.barrier_q.init(/*arrive_count=*/1);
    storage.barrier_q_empty.init(/*arrive_count=*/1);
  }

  typename PipelineKV::Params pipeline_params;
  pipeline_params.transaction_bytes = Traits::kTmaBytesKV;
  pipeline_params.role = warp_group_idx == 0 ? PipelineKV::ThreadCategory::Producer : PipelineKV::ThreadCategory::Consumer;
  pipeline_params.is_leader = is_producer_thread;
  pipeline_params.num_consumers = Traits::kNumMmaThreads;
  // Both pipelines initialise their barriers from warp 0; the __syncthreads below publishes them.
  PipelineKV pipeline_k(storage.pipeline_k, pipeline_params, Shape<_1, _1, _1>{});
  PipelineKV pipeline_v(storage.pipeline_v, pipeline_params, Shape<_1, _1, _1>{});
  __syncthreads();

  Scheduler const scheduler(params.seqlen_q, params.nheads, params.batch);

  // Kernels that can run persistent walk tiles in a loop; the others compute exactly one tile per CTA
  // with straight-line code (the loop measured 3-6% slower there, docs/perf-notes.md section 5).
  auto for_each_tile = [&](auto&& body) {
    if constexpr (Traits::kPersistentCapable) {
      int iteration = 0;
      for (int t = scheduler.first(); scheduler.valid(t); t = scheduler.next(t), ++iteration) { body(t, iteration); }
    } else {
      body(scheduler.first(), 0);
    }
  };

  if (warp_group_idx == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (is_producer_thread) {
      typename Traits::PipelineState write_state = cutlass::make_producer_start_state<PipelineKV>();
      for_each_tile([&](int t, int iteration) {
        TileCoord const tile = scheduler.coord(t);
        int const n_block_max = Blocks::n_block_max(tile.m_block, params.seqlen_q, params.seqlen_k);
        Mainloop::load(params, storage, pipeline_k, pipeline_v, write_state, tile, Blocks::n_block_min(), n_block_max,
                       iteration);
      });
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    int const thread_idx = int(threadIdx.x) - cutlass::NumThreadsPerWarpGroup;
    typename Traits::PipelineState read_k, read_v;  // consumer states start at stage 0, phase 0
    for_each_tile([&](int t, int iteration) {
      TileCoord const tile = scheduler.coord(t);
      int const n_block_min = Blocks::n_block_min();
      int const n_block_max = Blocks::n_block_max(tile.m_block, params.seqlen_q, params.seqlen_k);
      typename Traits::TiledMmaPV tiled_mma_pv;
      Tensor tOrO = partition_fragment_C(tiled_mma_pv, select<0, 2>(typename Traits::TileShapeMNK{}));
      Softmax<2 * decltype(size<1>(tOrO))::value, /*kMaxOffset=*/0> softmax(params.softmax_scale_log2);
      storage.barrier_q.wait(iteration & 1);
      if (n_block_max > n_block_min) {
        Mainloop::mma(params, storage, pipeline_k, pipeline_v, read_k, read_v, tile, n_block_min, n_block_max,
                      thread_idx, tOrO, softmax);
      } else {
        clear(tOrO);  // no key visible to any row: O = 0, and finalize gives LSE = -inf
      }
      auto scores_scale = softmax.finalize();
      softmax.rescale_o(tOrO, scores_scale);
      Epilogue::store(params, storage, tile, thread_idx, tOrO, softmax.row_sum);
    });
    Epilogue::finish(thread_idx);
  }
#endif
}

}  // namespace flash
