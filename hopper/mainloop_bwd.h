// The backward mainloop collective for head dims up to 128. A CTA owns one K/V block (kBlockN keys of one
// K/V head; 64 keys per consumer warpgroup) and walks the query blocks that see it (BwdWork), for every
// query head of the K/V head's group, so dK and dV are summed over the group in registers. The producer
// side (K, V, Q + LSE_log2, dO + dPsum loads) is BwdLoads (bwd_loads.h).
//
// Consumers, per query block, with the operands swapped so that the products the dK/dV GEMMs need come
// out of the GEMMs already in the layout of a register A operand:
//   S^T = K Q^T and dP^T = V dO^T (SS-GMMA, issued together);
//   P^T = exp2(S^T * scale_log2 - LSE_log2) while dP^T runs (no second online softmax: the forward's LSE
//   normalises); dS^T = P^T * (dP^T - dPsum);
//   dV += P^T dO and dK += dS^T Q (RS-GMMA: P^T, dS^T from registers, dO and Q read MN-major);
//   dS^T -> shared memory, then dQ = dS K (SS-GMMA, both operands MN-major; the warpgroups split the head
//   dim), handed to the dQ accumulator (dq_accumulator.h).
// dK is scaled by the softmax scale once after the loop (by the kernel); dQ by the postprocess kernel.
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
struct BwdMainloop {
  using Element = typename Config::Element;
  using ElementAccum = float;
  static constexpr int kHeadDim = Config::kHeadDim;
  static constexpr int kBlockM = Config::kBlockM;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kStagesQ = Config::kStagesQ;
  static constexpr int kStagesdO = Config::kStagesdO;
  static constexpr int kStagesdS = Config::kStagesdS;  // dS^T buffers, used with Q's stages in turn
  static constexpr bool kIsCausal = Config::kIsCausal;
  static constexpr int kNumMmaWarpGroups = Config::kNumMmaWarpGroups;
  static constexpr int kNumMmaThreads = kNumMmaWarpGroups * cutlass::NumThreadsPerWarpGroup;
  static_assert(kBlockN == 64 * kNumMmaWarpGroups, "each consumer warpgroup owns 64 keys");

  // S^T = K Q^T and dP^T = V dO^T: (keys, queries) over the head dim, split over the warpgroups by keys.
  using TiledMmaSdP = decltype(make_tiled_mma(
      ss_gmma<Element, ElementAccum, Shape<Int<kBlockN>, Int<kBlockM>, Int<kHeadDim>>>(),
      Layout<Shape<Int<kNumMmaWarpGroups>, _1, _1>>{}));
  // dV += P^T dO and dK += dS^T Q: (keys, head dim) over the queries; A from registers, B MN-major.
  using TiledMmadKV = decltype(make_tiled_mma(
      rs_gmma<Element, ElementAccum, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kBlockM>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<Int<kNumMmaWarpGroups>, _1, _1>>{}));
  // dQ = dS K: (queries, head dim) over the keys, both operands MN-major; the warpgroups split the head dim.
  // The postprocess reads the accumulator back through it.
  static constexpr int kHeadDimPerWarpGroup = kHeadDim / kNumMmaWarpGroups;
  static_assert(kBlockM % 64 == 0, "query blocks in multiples of 64: dQ's GEMM has the queries as GMMA's M");
  using TiledMmadQ = decltype(make_tiled_mma(
      ss_gmma<Element, ElementAccum, Shape<Int<kBlockM>, Int<kHeadDimPerWarpGroup>, Int<kBlockN>>,
                           GMMA::Major::MN, GMMA::Major::MN>(),
      Layout<Shape<_1, Int<kNumMmaWarpGroups>, _1>>{}));

  // K's swizzle atom spans at most one warpgroup's share of the head dim, so that each warpgroup's half of
  // K^T (dQ's B operand) starts on an atom. V shares the layout: dK and dV are staged in these buffers.
  using SmemLayoutK = decltype(tile_to_shape(smem_layout_atom_k_major<Element, kHeadDimPerWarpGroup>(),
                                             Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutV = SmemLayoutK;
  using SmemLayoutKt = decltype(transposed_view(SmemLayoutK{}));  // (head dim, keys)
  using SmemLayoutQ = decltype(smem_layout_k_major<Element>(Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStagesQ>>{}));
  using SmemLayoutdO = decltype(smem_layout_k_major<Element>(Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStagesdO>>{}));
  using SmemLayoutQt = decltype(transposed_view(SmemLayoutQ{}));  // (head dim, queries, stages)
  using SmemLayoutdOt = decltype(transposed_view(SmemLayoutdO{}));
  // dS^T as the consumers write it (keys, queries, buffers), and viewed as dS (queries, keys, buffers): dQ's
  // MN-major A.
  using SmemLayoutdS = decltype(smem_layout_k_major<Element>(Shape<Int<kBlockN>, Int<kBlockM>, Int<kStagesdS>>{}));
  using SmemLayoutdSt = decltype(transposed_view(SmemLayoutdS{}));
  using Loads = BwdLoads<Element, kBlockM, kBlockN, kHeadDim, kNumMmaThreads, SmemLayoutQ, SmemLayoutdO, SmemLayoutK>;
  using PipelineQ = typename Loads::PipelineQ;
  using PipelinedO = typename Loads::PipelinedO;
  static constexpr bool kDqFromRegisters = false;  // dQ is staged in shared memory for the writer warp
  static constexpr int kDqSlices = 1;               // one GEMM computes a query block's dQ
  static constexpr bool kTransposedDkv = false;    // dK, dV accumulators are (keys, head dim)

  struct TensorStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutdS>, 1024> smem_ds;
  };

  // The consumers: accumulates dK (unscaled) and dV of the CTA's K/V block over its work; hands each query
  // block's dQ fragment to store_dq. Requires K and V in shared memory (Loads::wait_kv).
  template <class FragdKV, class StoreDq>
  __device__ static void mma(typename Loads::Params const& params, typename Loads::TensorStorage& loaded, TensorStorage& tensors,
                             PipelineQ& pipeline_q, PipelinedO& pipeline_do, BwdWork const& work, int thread_idx,
                             FragdKV& tdKrdK, FragdKV& tdVrdV, StoreDq&& store_dq) {
    Tensor sK = make_tensor(make_smem_ptr(loaded.smem_k.data()), SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(loaded.smem_v.data()), SmemLayoutV{});
    Tensor sKt = make_tensor(make_smem_ptr(loaded.smem_k.data()), SmemLayoutKt{});
    Tensor sQ = make_tensor(make_smem_ptr(loaded.smem_q.data()), SmemLayoutQ{});
    Tensor sQt = make_tensor(make_smem_ptr(loaded.smem_q.data()), SmemLayoutQt{});
    Tensor sdO = make_tensor(make_smem_ptr(loaded.smem_do.data()), SmemLayoutdO{});
    Tensor sdOt = make_tensor(make_smem_ptr(loaded.smem_do.data()), SmemLayoutdOt{});
    Tensor sdS = make_tensor(make_smem_ptr(tensors.smem_ds.data()), SmemLayoutdS{});
    Tensor sdSt = make_tensor(make_smem_ptr(tensors.smem_ds.data()), SmemLayoutdSt{});
    Tensor sLSE = make_tensor(make_smem_ptr(loaded.smem_lse), typename Loads::SmemLayoutLSE{});
    Tensor sdPsum = make_tensor(make_smem_ptr(loaded.smem_dpsum), typename Loads::SmemLayoutdPsum{});

    TiledMmaSdP tiled_mma_sdp;
    TiledMmadKV tiled_mma_dkv;
    TiledMmadQ tiled_mma_dq;
    auto thread_mma_sdp = tiled_mma_sdp.get_thread_slice(thread_idx);
    auto thread_mma_dkv = tiled_mma_dkv.get_thread_slice(thread_idx);
    auto thread_mma_dq = tiled_mma_dq.get_thread_slice(thread_idx);
    Tensor tSrK = thread_mma_sdp.partition_fragment_A(sK);      // descriptors
    Tensor tSrQ = thread_mma_sdp.partition_fragment_B(sQ);      // (MMA, MMA_N, MMA_K, stages)
    Tensor tdPrV = thread_mma_sdp.partition_fragment_A(sV);
    Tensor tdPrdO = thread_mma_sdp.partition_fragment_B(sdO);
    Tensor tdVrdO = thread_mma_dkv.partition_fragment_B(sdOt);  // (MMA, MMA_N, MMA_K, stages)
    Tensor tdKrQ = thread_mma_dkv.partition_fragment_B(sQt);
    Tensor tdQrdS = thread_mma_dq.partition_fragment_A(sdSt);  // (MMA, MMA_M, MMA_K, buffers)
    Tensor tdQrKt = thread_mma_dq.partition_fragment_B(sKt);

    auto const tile_sdp = Shape<Int<kBlockN>, Int<kBlockM>>{};
    Tensor tSrS = partition_fragment_C(tiled_mma_sdp, tile_sdp);    // S^T, then P^T in place
    Tensor tdPrdP = partition_fragment_C(tiled_mma_sdp, tile_sdp);  // dP^T, then dS^T in place
    // P^T and dS^T in 16 bits: in the accumulator layout (for the dS^T store) and viewed as the register
    // A operand of the dV / dK GEMMs (same registers, same order).
    Tensor tSrP16 = make_tensor_like<Element>(tSrS);
    Tensor tdPrdS16 = make_tensor_like<Element>(tdPrdP);
    Tensor tdVrP = make_tensor(tSrP16.data(), acc_layout_to_a_regs<Element>(tSrP16.layout()));
    Tensor tdKrdS = make_tensor(tdPrdS16.data(), acc_layout_to_a_regs<Element>(tdPrdS16.layout()));
    Tensor tdQrdQ = partition_fragment_C(tiled_mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});

    auto smem_tiled_copy_ds = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, tiled_mma_sdp);
    auto smem_thread_copy_ds = smem_tiled_copy_ds.get_thread_slice(thread_idx);
    Tensor tdSrdS_copy = smem_thread_copy_ds.retile_S(tdPrdS16);
    Tensor tdSsdS = smem_thread_copy_ds.partition_D(sdS);  // (CPY, CPY_M, CPY_N, buffers)

    // The query (column) of each of this thread's accumulator columns, for LSE and dPsum.
    Tensor coords = thread_mma_sdp.partition_C(make_identity_tensor(tile_sdp));
    Tensor coords_rc = make_tensor(coords.data(), acc_layout_rowcol(coords.layout()));
    constexpr int kCols = decltype(size<1>(coords_rc))::value;
    auto query_of_col = [&](int ni) { return int(get<1>(coords_rc(0, ni))); };

    // The mask is made where it is applied: its band read from shared memory (Loads::shared_band), its
    // per-thread offsets from an opaque thread index (held through the loop, they cost d128 its GEMMs'
    // overlap: ptxas serialised them; perf-notes section 23).
    using MaskT = Mask<kBlockM, kBlockN, kIsCausal, TiledMmaSdP, /*kKeysInRows=*/true>;
    auto mask = [&]() { return MaskT(opaque_thread_idx(), Loads::shared_band(params, loaded)); };
    float const softcap_pre_scale = params.scales.softcap_pre_scale;  // > 0: softcap on (a uniform branch)

    // Q and dO advance together here (one state: a second one cost ptxas an 8-byte spill at d128).
    static_assert(kStagesQ == kStagesdO);
    static_assert(kStagesdS == kStagesQ, "dS^T buffers follow Q's stages");
    typename Loads::PipelineStateQ read_state;
    bool zero_init_dkv = true;
    auto step = [&](int i, auto masked) __attribute__((always_inline)) {
      constexpr bool kMasked = decltype(masked)::value;
      int const m_block = work.m_block(i);
      int const stage = read_state.index();
      pipeline_q.consumer_wait(read_state);
      warpgroup_gemm<-1>(tiled_mma_sdp, tSrK, tSrQ(_, _, _, stage), tSrS, /*zero_init=*/true);
      pipeline_do.consumer_wait(read_state);
      warpgroup_gemm<-1>(tiled_mma_sdp, tdPrV, tdPrdO(_, _, _, stage), tdPrdP, /*zero_init=*/true);
      warpgroup_wait<1>();  // S^T is ready; dP^T still runs
      warpgroup_fence_operand(tSrS);
      Tensor scores = make_rowcol_view(tSrS);  // (keys, queries)
      Tensor dP = make_rowcol_view(tdPrdP);
      float const scale_log2 = params.scales.softmax_scale_log2;
      bool const softcap = softcap_pre_scale > 0.f;
      if (softcap) { apply_softcap(tSrS, softcap_pre_scale); }  // t = tanh(S^T * pre_scale) replaces S^T
      if constexpr (kMasked && kIsCausal) {
        mask().template apply</*kSeqlenKMask=*/true, true>(tSrS, m_block, work.n_block);
      }
      CUTLASS_PRAGMA_UNROLL
      for (int ni = 0; ni < kCols; ++ni) {
        float const lse_log2 = sLSE(query_of_col(ni), stage);
        CUTLASS_PRAGMA_UNROLL
        for (int mi = 0; mi < size<0>(scores); ++mi) { scores(mi, ni) = exp2f(scores(mi, ni) * scale_log2 - lse_log2); }
      }
      // Without the band mask, the keys past the end (zero rows of K and V: TMA fills them) are masked in
      // P^T instead of S^T: the same result, and masking S^T there made ptxas spill at d64 (kBlockM = 128).
      if constexpr (kMasked && !kIsCausal) {
        mask().template apply</*kSeqlenKMask=*/true, false>(tSrS, m_block, work.n_block, 0.f);
      }
      warpgroup_wait<0>();  // dP^T is ready
      warpgroup_fence_operand(tdPrdP);
      if (!softcap) {
        CUTLASS_PRAGMA_UNROLL
        for (int ni = 0; ni < kCols; ++ni) {
          float const dpsum = sdPsum(query_of_col(ni), stage);
          CUTLASS_PRAGMA_UNROLL
          for (int mi = 0; mi < size<0>(dP); ++mi) { dP(mi, ni) = scores(mi, ni) * (dP(mi, ni) - dpsum); }
        }
      } else {
        // t is recovered from P (softcap.h): keeping it beside P^T and dP^T made ptxas spill at d64.
        CUTLASS_PRAGMA_UNROLL
        for (int ni = 0; ni < kCols; ++ni) {
          float const dpsum = sdPsum(query_of_col(ni), stage);
          float const lse_log2 = sLSE(query_of_col(ni), stage);
          CUTLASS_PRAGMA_UNROLL
          for (int mi = 0; mi < size<0>(dP); ++mi) {
            float const p = scores(mi, ni);
            dP(mi, ni) = p * (dP(mi, ni) - dpsum) * softcap_grad_factor_from_p(p, lse_log2, scale_log2);
          }
        }
      }
      // P^T is converted only now, after its last fp32 use: S^T, dP^T and the 16-bit copies are never all live.
      convert_into(tSrS, tSrP16);
      convert_into(tdPrdP, tdPrdS16);
      // dV's GEMM is issued only now: issued before the dP^T wait, to overlap the dS math, it measured
      // 2-6% slower (perf-notes section 12). It runs while dS^T is stored and both warpgroups meet.
      warpgroup_gemm<-1>(tiled_mma_dkv, tdVrP, tdVrdO(_, _, _, stage), tdVrdV, zero_init_dkv);
      // This dS^T buffer is free: its last reader, the dQ GEMM two blocks back, is done in both warpgroups
      // (each waited for it before the last kdSReady).
      copy(smem_tiled_copy_ds, tdSrdS_copy, tdSsdS(_, _, _, stage));
      cutlass::arch::fence_view_async_shared();  // dS^T written by stmatrix, read next by GMMA
      cutlass::arch::NamedBarrier::sync(kNumMmaThreads, uint32_t(BwdNamedBarriers::kdSReady));
      // dQ before dK, so that dQ is handed over while dK's GEMM runs.
      warpgroup_gemm<-1>(tiled_mma_dq, tdQrdS(_, _, _, stage), tdQrKt, tdQrdQ, /*zero_init=*/true);
      warpgroup_gemm<-1>(tiled_mma_dkv, tdKrdS, tdKrQ(_, _, _, stage), tdKrdK, zero_init_dkv);
      zero_init_dkv = false;
      warpgroup_wait<1>();  // dV and dQ done: this stage of dO is read
      warpgroup_fence_operand(tdQrdQ);
      pipeline_do.consumer_release(read_state);
      store_dq(tdQrdQ, i, /*slice=*/0);
      warpgroup_wait<0>();  // dK done: this stage of Q is read
      warpgroup_fence_operand(tdVrdV);
      warpgroup_fence_operand(tdKrdK);
      pipeline_q.consumer_release(read_state);
      ++read_state;
    };

    work.template for_each_block<kBlockM, kBlockN, kIsCausal>(step);
    if (work.count() == 0) {  // no query sees these keys: dK = dV = 0
      clear(tdKrdK);
      clear(tdVrdV);
    }
  }
};

}  // namespace flash
