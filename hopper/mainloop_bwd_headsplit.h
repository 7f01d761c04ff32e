// The backward mainloop collective for large head dims (d256; d192 runs on it zero-padded), where dK and dV
// of 64 keys do not fit one warpgroup's registers (64 x 256 x 2 fp32 = 256 registers a thread). The
// consumer warpgroups split the head dim instead: each accumulates its share of dK^T and dV^T
// (head dim x keys) over the query blocks. The producer, the work list and the dQ accumulation are the
// other backward mainloop's (mainloop_bwd.h).
//
// Consumers, per query block (kBlockM queries x kBlockN keys):
//   S = Q K^T and dP = dO V^T (SS-GMMA, the warpgroups split the keys);
//   P = exp2(S * scale_log2 - LSE_log2), dS = P * (dP - dPsum) -> shared memory (both halves);
//   dV^T += dO^T P and dK^T += Q^T dS (SS-GMMA, every operand read MN-major; the warpgroups split the head
//   dim); dQ = dS K (SS-GMMA, the warpgroups split the head dim) in slices of the head dim, each handed to
//   the dQ accumulator while the next GEMM runs: dK and dV of 80 keys (160 registers a thread) leave room
//   for half of a warpgroup's dQ at a time, not all of it.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "flash.h"
#include "gmma_select.h"
#include "layouts.h"
#include "mask.h"
#include "softcap.h"
#include "named_barriers.h"
#include "bwd_loads.h"
#include "utils.h"

namespace flash {

using namespace cute;

template <class Config>
struct BwdMainloopHeadSplit {
  using Element = typename Config::Element;
  using ElementAccum = float;
  static constexpr int kHeadDim = Config::kHeadDim;
  static constexpr int kBlockM = Config::kBlockM;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kStagesQ = Config::kStagesQ;
  static constexpr int kStagesdO = Config::kStagesdO;
  static constexpr bool kIsCausal = Config::kIsCausal;
  static constexpr int kNumMmaWarpGroups = Config::kNumMmaWarpGroups;
  static constexpr int kNumMmaThreads = kNumMmaWarpGroups * cutlass::NumThreadsPerWarpGroup;
  static constexpr int kHeadDimPerWarpGroup = kHeadDim / kNumMmaWarpGroups;
  static_assert(kBlockM == 64 && kHeadDimPerWarpGroup % 64 == 0);

  // S = Q K^T and dP = dO V^T: (queries, keys) over the head dim; the warpgroups split the keys.
  using TiledMmaSdP = decltype(make_tiled_mma(
      ss_gmma<Element, ElementAccum, Shape<Int<kBlockM>, Int<kBlockN / kNumMmaWarpGroups>, Int<kHeadDim>>>(),
      Layout<Shape<_1, Int<kNumMmaWarpGroups>, _1>>{}));
  // dV^T += dO^T P and dK^T += Q^T dS: (head dim, keys) over the queries, both operands MN-major; the
  // warpgroups split the head dim.
  using TiledMmadKV = decltype(make_tiled_mma(
      ss_gmma<Element, ElementAccum, Shape<Int<kHeadDim>, Int<kBlockN>, Int<kBlockM>>,
                           GMMA::Major::MN, GMMA::Major::MN>(),
      Layout<Shape<Int<kNumMmaWarpGroups>, _1, _1>>{}));
  // dQ = dS K: (queries, head dim) over the keys; dS K-major, K^T MN-major; one slice of the head dim per
  // GEMM (kDqSlices of them), which the warpgroups split.
  static constexpr int kDqSlices = 2;
  static constexpr int kDqSliceCols = kHeadDim / kDqSlices;
  static_assert(kDqSliceCols % (64 * kNumMmaWarpGroups) == 0);
  using TiledMmadQ = decltype(make_tiled_mma(
      ss_gmma<Element, ElementAccum, Shape<Int<kBlockM>, Int<kDqSliceCols / kNumMmaWarpGroups>, Int<kBlockN>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<_1, Int<kNumMmaWarpGroups>, _1>>{}));
  // Through TiledMmadQ (one slice wide) a thread's fragment of the whole (queries, head dim) tile is its
  // fragments of the slices one after the other: the order in which they reach the accumulator, and in which
  // the postprocess reads them back.
  using DqSliceTile = Shape<Int<kBlockM>, Int<kDqSliceCols>>;
  // The accumulators of dK and dV are (head dim, keys): the epilogue writes them transposed.
  static constexpr bool kTransposedDkv = true;

  using SmemLayoutK = decltype(smem_layout_k_major<Element>(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutV = SmemLayoutK;
  using SmemLayoutKt = decltype(transposed_view(SmemLayoutK{}));  // (head dim, keys)
  using SmemLayoutQ = decltype(smem_layout_k_major<Element>(Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStagesQ>>{}));
  using SmemLayoutdO = decltype(smem_layout_k_major<Element>(Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStagesdO>>{}));
  using SmemLayoutQt = decltype(transposed_view(SmemLayoutQ{}));  // (head dim, queries, stages)
  using SmemLayoutdOt = decltype(transposed_view(SmemLayoutdO{}));
  // P and dS as computed (queries, keys), and viewed as (keys, queries): the dK/dV GEMMs' MN-major B. Two
  // buffers used in turn: a warpgroup writes the next query block's while the other may still read these.
  // The atom spans at most one warpgroup's columns (kKeysPerWarpGroup), so that each warpgroup's half starts
  // on an atom (unswizzled where that is 40 keys: kBlockN = 80).
  static constexpr int kPBuffers = 2;
  static constexpr int kKeysPerWarpGroup = kBlockN / kNumMmaWarpGroups;
  using SmemLayoutP = decltype(tile_to_shape(smem_layout_atom_k_major<Element, kKeysPerWarpGroup>(),
                                             Shape<Int<kBlockM>, Int<kBlockN>, Int<kPBuffers>>{}));
  using SmemLayoutPt = decltype(transposed_view(SmemLayoutP{}));
  using Loads = BwdLoads<Element, kBlockM, kBlockN, kHeadDim, kNumMmaThreads, SmemLayoutQ, SmemLayoutdO, SmemLayoutK>;
  using PipelineQ = typename Loads::PipelineQ;
  using PipelinedO = typename Loads::PipelinedO;
  // dQ goes from registers straight to the fp32 accumulator (atomic float4 adds): shared memory holds two
  // stages of Q and dO instead of a staging buffer.
  static constexpr bool kDqFromRegisters = true;

  struct TensorStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutP>, 1024> smem_p;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutP>, 1024> smem_ds;
  };

  // The consumers: accumulates dK^T (unscaled) and dV^T of the CTA's K/V block over its work; hands each
  // query block's dQ to store_dq(fragment, i, slice), slice by slice. Requires K and V in shared memory
  // (Loads::wait_kv).
  template <class FragdKV, class StoreDq>
  __device__ static void mma(typename Loads::Params const& params, typename Loads::TensorStorage& loaded, TensorStorage& tensors,
                             PipelineQ& pipeline_q, PipelinedO& pipeline_do, BwdWork const& work, int thread_idx,
                             FragdKV& tdKrdK, FragdKV& tdVrdV, StoreDq&& store_dq) {
    Tensor sK = make_tensor(make_smem_ptr(loaded.smem_k.data()), SmemLayoutK{});
    Tensor sKt = make_tensor(make_smem_ptr(loaded.smem_k.data()), SmemLayoutKt{});
    Tensor sV = make_tensor(make_smem_ptr(loaded.smem_v.data()), SmemLayoutV{});
    Tensor sQ = make_tensor(make_smem_ptr(loaded.smem_q.data()), SmemLayoutQ{});
    Tensor sQt = make_tensor(make_smem_ptr(loaded.smem_q.data()), SmemLayoutQt{});
    Tensor sdO = make_tensor(make_smem_ptr(loaded.smem_do.data()), SmemLayoutdO{});
    Tensor sdOt = make_tensor(make_smem_ptr(loaded.smem_do.data()), SmemLayoutdOt{});
    Tensor sLSE = make_tensor(make_smem_ptr(loaded.smem_lse), typename Loads::SmemLayoutLSE{});
    Tensor sdPsum = make_tensor(make_smem_ptr(loaded.smem_dpsum), typename Loads::SmemLayoutdPsum{});
    Tensor sP = make_tensor(make_smem_ptr(tensors.smem_p.data()), SmemLayoutP{});
    Tensor sPt = make_tensor(make_smem_ptr(tensors.smem_p.data()), SmemLayoutPt{});
    Tensor sdS = make_tensor(make_smem_ptr(tensors.smem_ds.data()), SmemLayoutP{});
    Tensor sdSt = make_tensor(make_smem_ptr(tensors.smem_ds.data()), SmemLayoutPt{});

    TiledMmaSdP tiled_mma_sdp;
    TiledMmadKV tiled_mma_dkv;
    TiledMmadQ tiled_mma_dq;
    auto thread_mma_sdp = tiled_mma_sdp.get_thread_slice(thread_idx);
    auto thread_mma_dkv = tiled_mma_dkv.get_thread_slice(thread_idx);
    auto thread_mma_dq = tiled_mma_dq.get_thread_slice(thread_idx);
    Tensor tSrQ = thread_mma_sdp.partition_fragment_A(sQ);      // (MMA, MMA_M, MMA_K, stages)
    Tensor tSrK = thread_mma_sdp.partition_fragment_B(sK);
    Tensor tdPrdO = thread_mma_sdp.partition_fragment_A(sdO);
    Tensor tdPrV = thread_mma_sdp.partition_fragment_B(sV);
    Tensor tdVrdOt = thread_mma_dkv.partition_fragment_A(sdOt);  // (MMA, MMA_M, MMA_K, stages)
    Tensor tdVrPt = thread_mma_dkv.partition_fragment_B(sPt);   // (MMA, MMA_N, MMA_K, buffers)
    Tensor tdKrQt = thread_mma_dkv.partition_fragment_A(sQt);
    Tensor tdKrdSt = thread_mma_dkv.partition_fragment_B(sdSt);
    Tensor tdQrdS = thread_mma_dq.partition_fragment_A(sdS);    // (MMA, MMA_M, MMA_K, buffers)
    // K^T's rows of dQ slice j (its B operand).
    auto dq_slice_b = [&](int j) {
      return thread_mma_dq.partition_fragment_B(local_tile(sKt, Shape<Int<kDqSliceCols>, Int<kBlockN>>{}, make_coord(j, _0{})));
    };

    auto const tile_sdp = Shape<Int<kBlockM>, Int<kBlockN>>{};
    Tensor tSrS = partition_fragment_C(tiled_mma_sdp, tile_sdp);    // S, then P in place
    Tensor tdPrdP = partition_fragment_C(tiled_mma_sdp, tile_sdp);  // dP, then dS in place
    Tensor tSrP16 = make_tensor_like<Element>(tSrS);
    Tensor tdPrdS16 = make_tensor_like<Element>(tdPrdP);
    Tensor tdQrdQ = partition_fragment_C(tiled_mma_dq, DqSliceTile{});  // one slice at a time

    // stmatrix of four 8x8 matrices where a warpgroup's keys are a multiple of 16, two otherwise.
    using StsmOp = std::conditional_t<kKeysPerWarpGroup % 16 == 0, SM90_U32x4_STSM_N, SM90_U32x2_STSM_N>;
    auto smem_tiled_copy_p = make_tiled_copy_C(Copy_Atom<StsmOp, Element>{}, tiled_mma_sdp);
    auto smem_thread_copy_p = smem_tiled_copy_p.get_thread_slice(thread_idx);
    Tensor tPrP_copy = smem_thread_copy_p.retile_S(tSrP16);
    Tensor tPsP = smem_thread_copy_p.partition_D(sP);  // (CPY, CPY_M, CPY_N, buffers)
    Tensor tdSrdS_copy = smem_thread_copy_p.retile_S(tdPrdS16);
    Tensor tdSsdS = smem_thread_copy_p.partition_D(sdS);

    // The query (row) of each of this thread's accumulator rows, for LSE and dPsum.
    Tensor coords = thread_mma_sdp.partition_C(make_identity_tensor(tile_sdp));
    Tensor coords_rc = make_tensor(coords.data(), acc_layout_rowcol(coords.layout()));
    constexpr int kRows = decltype(size<0>(coords_rc))::value;
    auto query_of_row = [&](int mi) { return int(get<0>(coords_rc(mi, 0))); };

    typename Loads::PipelineStateQ read_state_q;
    typename Loads::PipelineStatedO read_state_do;
    bool zero_init_dkv = true;
    auto step = [&](int i, auto masked) __attribute__((always_inline)) {
      constexpr bool kMasked = decltype(masked)::value;
      int const m_block = work.m_block(i);
      int const stage_q = read_state_q.index();
      int const stage_do = read_state_do.index();
      int const buffer = i % kPBuffers;
      pipeline_q.consumer_wait(read_state_q);
      warpgroup_gemm<-1>(tiled_mma_sdp, tSrQ(_, _, _, stage_q), tSrK, tSrS, /*zero_init=*/true);
      pipeline_do.consumer_wait(read_state_do);
      warpgroup_gemm<-1>(tiled_mma_sdp, tdPrdO(_, _, _, stage_do), tdPrV, tdPrdP, /*zero_init=*/true);
      warpgroup_wait<1>();  // S is ready; dP still runs
      warpgroup_fence_operand(tSrS);
      // Softcap (a uniform branch): t = tanh(S * pre_scale) replaces S, before the mask.
      float const softcap_pre_scale = params.scales.softcap_pre_scale;
      bool const softcap = softcap_pre_scale > 0.f;
      if (softcap) { apply_softcap(tSrS, softcap_pre_scale); }
      if constexpr (kMasked) {
        // Built here, not before the loop: its fields are then not live across the unmasked steps (at 80
        // keys ptxas otherwise spilled a register of the loop).
        Mask<kBlockM, kBlockN, kIsCausal, TiledMmaSdP> mask(thread_idx, Loads::shared_band(params, loaded));
        mask.template apply</*kSeqlenKMask=*/true, kIsCausal>(tSrS, m_block, work.n_block);
      }
      Tensor scores = make_rowcol_view(tSrS);  // (queries, keys)
      Tensor dP = make_rowcol_view(tdPrdP);
      float const scale_log2 = params.scales.softmax_scale_log2;
      CUTLASS_PRAGMA_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        float const lse_log2 = sLSE(query_of_row(mi), stage_q);
        CUTLASS_PRAGMA_UNROLL
        for (int ni = 0; ni < size<1>(scores); ++ni) { scores(mi, ni) = exp2f(scores(mi, ni) * scale_log2 - lse_log2); }
      }
      convert_into(tSrS, tSrP16);
      // This buffer was last read by the GEMMs of query block i - 2, which both warpgroups finished before
      // they met at the kdSReady barrier of block i - 1.
      copy(smem_tiled_copy_p, tPrP_copy, tPsP(_, _, _, buffer));
      warpgroup_wait<0>();  // dP is ready
      warpgroup_fence_operand(tdPrdP);
      CUTLASS_PRAGMA_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        float const dpsum = sdPsum(query_of_row(mi), stage_do);
        if (!softcap) {
          CUTLASS_PRAGMA_UNROLL
          for (int ni = 0; ni < size<1>(dP); ++ni) { dP(mi, ni) = scores(mi, ni) * (dP(mi, ni) - dpsum); }
        } else {
          float const lse_log2 = sLSE(query_of_row(mi), stage_q);
          CUTLASS_PRAGMA_UNROLL
          for (int ni = 0; ni < size<1>(dP); ++ni) {
            float const p = scores(mi, ni);
            dP(mi, ni) = p * (dP(mi, ni) - dpsum) * softcap_grad_factor_from_p(p, lse_log2, scale_log2);
          }
        }
      }
      convert_into(tdPrdP, tdPrdS16);
      copy(smem_tiled_copy_p, tdSrdS_copy, tdSsdS(_, _, _, buffer));
      cutlass::arch::fence_view_async_shared();  // P and dS written by stmatrix, read next by GMMA
      cutlass::arch::NamedBarrier::sync(kNumMmaThreads, uint32_t(BwdNamedBarriers::kdSReady));
      // dV first, so that dO's stage is released early; dQ's first slice is handed over while dK's GEMM
      // runs, its second while the next query block's S and dP GEMMs run.
      static_assert(kDqSlices == 2);
      warpgroup_gemm<-1>(tiled_mma_dkv, tdVrdOt(_, _, _, stage_do), tdVrPt(_, _, _, buffer), tdVrdV, zero_init_dkv);
      warpgroup_gemm<-1>(tiled_mma_dq, tdQrdS(_, _, _, buffer), dq_slice_b(0), tdQrdQ, /*zero_init=*/true);
      warpgroup_gemm<-1>(tiled_mma_dkv, tdKrQt(_, _, _, stage_q), tdKrdSt(_, _, _, buffer), tdKrdK, zero_init_dkv);
      zero_init_dkv = false;
      warpgroup_wait<2>();  // dV done: this stage of dO is read
      warpgroup_fence_operand(tdVrdV);
      pipeline_do.consumer_release(read_state_do);
      warpgroup_wait<1>();  // dQ's first slice done
      warpgroup_fence_operand(tdQrdQ);
      store_dq(tdQrdQ, i, 0);
      warpgroup_gemm<-1>(tiled_mma_dq, tdQrdS(_, _, _, buffer), dq_slice_b(1), tdQrdQ, /*zero_init=*/true);
      warpgroup_wait<1>();  // dK done: this stage of Q is read
      warpgroup_fence_operand(tdKrdK);
      pipeline_q.consumer_release(read_state_q);
      warpgroup_wait<0>();  // dQ's second slice done
      warpgroup_fence_operand(tdQrdQ);
      store_dq(tdQrdQ, i, 1);
      ++read_state_q;
      ++read_state_do;
    };

    work.template for_each_block<kBlockM, kBlockN, kIsCausal>(step);
    if (work.count() == 0) {  // no query sees these keys: dK = dV = 0
      clear(tdKrdK);
      clear(tdVrdV);
    }
  }
};

}  // namespace flash
