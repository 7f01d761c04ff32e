// The forward mainloop: the producer's TMA loads and the consumers' GEMMs + online softmax.
//
// Producer (one thread of warpgroup 0): Q once, then K and V of every needed block, last block first,
// into kStages-deep pipelines (mbarriers with transaction counts; separate K and V pipelines so GEMM0 of
// a block can start before its V lands).
//
// Consumers (each warpgroup owns 64 rows): per K/V block, in the order of the seed's mainloop,
//   GEMM0 S = Q K^T, mask, max_get_scale, online_softmax, rescale_o, GEMM1 O += P V,
// with intra-warpgroup overlap: GEMM0 of block n and GEMM1 of block n+1 (the previous one) are issued
// together; the softmax of block n runs while GEMM1 is still on the tensor cores.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "mask.h"
#include "softmax.h"
#include "tile_scheduler.h"
#include "utils.h"
#include "warpgroup_scheduler.h"

namespace flash {

using namespace cute;

template <class Traits>
struct FwdMainloop {
  using Element = typename Traits::Element;
  using TileShapeMNK = typename Traits::TileShapeMNK;
  using PipelineKV = typename Traits::PipelineKV;
  using PipelineState = typename Traits::PipelineState;
  using SharedStorage = typename Traits::SharedStorage;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr bool kIsCausal = Traits::kIsCausal;

  // Loads one tile: Q and its K/V blocks, last block first. In a persistent CTA the first K block goes
  // before Q, whose buffer the previous tile may still hold: that K load overlaps the previous epilogue.
  // A tile that sees no key still gets its Q, so that the Q barriers stay in step with the consumers.
  template <class Params>
  __device__ static void load(Params const& params, SharedStorage& storage, PipelineKV& pipeline_k,
                              PipelineKV& pipeline_v, PipelineState& write_state, TileCoord const& tile,
                              int n_block_min, int n_block_max, int tile_iteration) {
    Tensor sQ = make_tensor(make_smem_ptr(storage.smem_q.data()), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(storage.smem_k.data()), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(storage.smem_v.data()), typename Traits::SmemLayoutV{});

    int const head_kv = tile.head / params.qheads_per_kvhead;
    Tensor mQ = params.tma_q.get_tma_tensor(params.shape_q)(_, _, tile.head, tile.batch);
    Tensor mK = params.tma_k.get_tma_tensor(params.shape_k)(_, _, head_kv, tile.batch);
    Tensor mV = params.tma_v.get_tma_tensor(params.shape_k)(_, _, head_kv, tile.batch);
    Tensor gQ = local_tile(mQ, select<0, 2>(TileShapeMNK{}), make_coord(tile.m_block, _0{}));  // (M, D)
    Tensor gK = local_tile(mK, select<1, 2>(TileShapeMNK{}), make_coord(_, _0{}));             // (N, D, n)
    Tensor gV = local_tile(mV, select<1, 2>(TileShapeMNK{}), make_coord(_, _0{}));             // (N, D, n)

    auto [tQgQ, tQsQ] = tma_partition(params.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    // (TMA, n blocks) and (TMA, stages); named tensors rather than structured bindings, which C++17
    // lambdas cannot capture.
    auto const k_parts = tma_partition(params.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto const v_parts = tma_partition(params.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    Tensor tKgK = get<0>(k_parts);
    Tensor tKsK = get<1>(k_parts);
    Tensor tVgV = get<0>(v_parts);
    Tensor tVsV = get<1>(v_parts);

    auto load_k = [&](int n_block) {
      pipeline_k.producer_acquire(write_state);
      copy(params.tma_k.with(*pipeline_k.producer_get_barrier(write_state), 0), tKgK(_, n_block),
           tKsK(_, write_state.index()));
    };
    auto load_v = [&](int n_block) {
      pipeline_v.producer_acquire(write_state);
      copy(params.tma_v.with(*pipeline_v.producer_get_barrier(write_state), 0), tVgV(_, n_block),
           tVsV(_, write_state.index()));
      ++write_state;
    };

    bool const has_keys = n_block_max > n_block_min;
    if constexpr (Traits::kPersistentCapable) {
      if (has_keys) { load_k(n_block_max - 1); }
      if (tile_iteration > 0) { storage.barrier_q_empty.wait((tile_iteration - 1) & 1); }
    }
    using BarrierType = typename Traits::BarrierQ::ValueType;
    storage.barrier_q.arrive_and_expect_tx(Traits::kTmaBytesQ);
    copy(params.tma_q.with(reinterpret_cast<BarrierType&>(storage.barrier_q), 0), tQgQ, tQsQ);
    if (!has_keys) { return; }
    if constexpr (!Traits::kPersistentCapable) { load_k(n_block_max - 1); }
    load_v(n_block_max - 1);
    for (int n_block = n_block_max - 2; n_block >= n_block_min; --n_block) {
      load_k(n_block);
      load_v(n_block);
    }
  }

  // Computes the un-normalised O of the tile into tOrO and leaves the softmax state ready for finalize.
  // Requires n_block_max > n_block_min and Q in shared memory (barrier_q waited on).
  template <class Params, class FragO, class SoftmaxT>
  __device__ static void mma(Params const& params, SharedStorage& storage, PipelineKV& pipeline_k,
                             PipelineKV& pipeline_v, PipelineState& read_k, PipelineState& read_v,
                             TileCoord const& tile, int n_block_min, int n_block_max, int thread_idx, FragO& tOrO,
                             SoftmaxT& softmax) {
    using TiledMmaQK = typename Traits::TiledMmaQK;
    using TiledMmaPV = typename Traits::TiledMmaPV;
    Tensor sQ = make_tensor(make_smem_ptr(storage.smem_q.data()), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(storage.smem_k.data()), typename Traits::SmemLayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(storage.smem_v.data()), typename Traits::SmemLayoutVt{});

    TiledMmaQK tiled_mma_qk;
    TiledMmaPV tiled_mma_pv;
    auto thread_mma_qk = tiled_mma_qk.get_thread_slice(thread_idx);
    auto thread_mma_pv = tiled_mma_pv.get_thread_slice(thread_idx);
    Tensor tSrQ = thread_mma_qk.partition_fragment_A(sQ);    // descriptors
    Tensor tSrK = thread_mma_qk.partition_fragment_B(sK);    // (MMA, MMA_N, MMA_K, stages)
    Tensor tOrV = thread_mma_pv.partition_fragment_B(sVt);   // (MMA, MMA_N, MMA_K, stages)
    Tensor tSrS = partition_fragment_C(tiled_mma_qk, select<0, 1>(TileShapeMNK{}));
    // P in 16 bits, laid out as GEMM1's register A operand.
    Tensor tOrP = make_tensor<Element>(acc_layout_to_a_regs(tSrS.layout()));

    Mask<kBlockM, kBlockN, kIsCausal, TiledMmaQK> mask(thread_idx, params.seqlen_q, params.seqlen_k);
    WarpgroupScheduler<Traits::kNumMmaWarpGroups> scheduler(thread_idx / cutlass::NumThreadsPerWarpGroup,
                                                            Traits::kPingPongCompiled && params.pingpong);

    // First block (the last in key order): the only one that can be partial in seqlen_k.
    int n_block = n_block_max - 1;
    pipeline_k.consumer_wait(read_k);
    warpgroup_gemm<0>(tiled_mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), tSrS, /*zero_init=*/true);
    pipeline_k.consumer_release(read_k);
    ++read_k;
    mask.template apply</*kSeqlenKMask=*/true, kIsCausal>(tSrS, tile.m_block, n_block);
    softmax.template max_get_scale</*kIsFirst=*/true, /*kCheckInf=*/true>(tSrS);
    softmax.template online_softmax</*kIsFirst=*/true, /*kCheckInf=*/true>(tSrS);
    convert_into(tSrS, tOrP);

    bool zero_init_o = true;  // the first GEMM1 writes O instead of accumulating
    // One K/V block with GEMM0 of block n overlapping GEMM1 of block n + 1.
    auto step = [&](int n_block, auto masked) {
      constexpr bool kMasked = decltype(masked)::value;
      pipeline_k.consumer_wait(read_k);
      scheduler.wait_turn();
      warpgroup_gemm<-1>(tiled_mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), tSrS, /*zero_init=*/true);
      pipeline_v.consumer_wait(read_v);
      warpgroup_gemm<-1>(tiled_mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO, zero_init_o);
      scheduler.pass_turn();
      warpgroup_wait<1>();  // S is ready; GEMM1 still runs
      warpgroup_fence_operand(tSrS);
      pipeline_k.consumer_release(read_k);
      ++read_k;
      if constexpr (kMasked) { mask.template apply</*kSeqlenKMask=*/false, /*kCausalMask=*/true>(tSrS, tile.m_block, n_block); }
      auto scores_scale = softmax.template max_get_scale</*kIsFirst=*/false, /*kCheckInf=*/kMasked>(tSrS);
      softmax.template online_softmax</*kIsFirst=*/false, /*kCheckInf=*/kMasked>(tSrS);
      warpgroup_wait<0>();  // GEMM1 done: O can be rescaled and P overwritten
      warpgroup_fence_operand(tOrO);
      pipeline_v.consumer_release(read_v);
      ++read_v;
      softmax.rescale_o(tOrO, scores_scale);
      convert_into(tSrS, tOrP);
      zero_init_o = false;
    };

    --n_block;
    scheduler.start();
    if constexpr (kIsCausal) {
      int const n_block_unmasked_end = max(n_block_min, mask.first_causal_masked_block(tile.m_block));
      for (; n_block >= n_block_unmasked_end; --n_block) { step(n_block, cute::true_type{}); }
    }
    for (; n_block >= n_block_min; --n_block) { step(n_block, cute::false_type{}); }
    scheduler.finish();

    // GEMM1 of the last block.
    pipeline_v.consumer_wait(read_v);
    warpgroup_gemm<0>(tiled_mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO, zero_init_o);
    pipeline_v.consumer_release(read_v);
    ++read_v;
  }
};

}  // namespace flash
