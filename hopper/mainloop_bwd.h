// The backward mainloop collective. A CTA owns one K/V block (kBlockN keys of one K/V head; 64 keys per
// consumer warpgroup) and walks the query blocks that see it (BwdWork), for every query head of the K/V
// head's group, so dK and dV are summed over the group in registers.
//
// Producer (one thread of warpgroup 0): K and V once; then per query block Q with its LSE (log2 domain)
// and dO with its dPsum = rowsum(dO * O) - dLSE, through two kStages-deep TMA pipelines.
//
// Consumers, per query block, with the operands swapped so that the products the dK/dV GEMMs need come
// out of the GEMMs already in the layout of a register A operand:
//   S^T = K Q^T and dP^T = V dO^T (SS-GMMA, issued together);
//   P^T = exp2(S^T * scale_log2 - LSE_log2)  (no second online softmax: the forward's LSE normalises);
//   dS^T = P^T * (dP^T - dPsum);
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
#include "layouts.h"
#include "mask.h"
#include "named_barriers.h"
#include "utils.h"

namespace flash {

using namespace cute;

// The query blocks a backward CTA walks: for each query head of its K/V head's group (head fastest is
// not needed: one head after the other), the blocks [m_block_min, m_block_min + num_m_blocks).
struct BwdWork {
  int n_block, kv_head, batch;
  int group;  // query heads per K/V head
  int m_block_min, num_m_blocks;
  __device__ __forceinline__ int count() const { return group * num_m_blocks; }
  __device__ __forceinline__ int head(int i) const { return kv_head * group + i / num_m_blocks; }
  __device__ __forceinline__ int m_block(int i) const { return m_block_min + i % num_m_blocks; }
};

template <class Config>
struct BwdMainloop {
  using Element = typename Config::Element;
  using ElementAccum = float;
  static constexpr int kHeadDim = Config::kHeadDim;
  static constexpr int kBlockM = Config::kBlockM;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kStages = Config::kStages;
  static constexpr bool kIsCausal = Config::kIsCausal;
  static constexpr int kNumMmaWarpGroups = Config::kNumMmaWarpGroups;
  static constexpr int kNumMmaThreads = kNumMmaWarpGroups * cutlass::NumThreadsPerWarpGroup;
  static_assert(kBlockN == 64 * kNumMmaWarpGroups, "each consumer warpgroup owns 64 keys");

  // S^T = K Q^T and dP^T = V dO^T: (keys, queries) over the head dim, split over the warpgroups by keys.
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, ElementAccum, Shape<Int<kBlockN>, Int<kBlockM>, Int<kHeadDim>>>(),
      Layout<Shape<Int<kNumMmaWarpGroups>, _1, _1>>{}));
  // dV += P^T dO and dK += dS^T Q: (keys, head dim) over the queries; A from registers, B MN-major.
  using TiledMmadKV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, ElementAccum, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kBlockM>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<Int<kNumMmaWarpGroups>, _1, _1>>{}));
  // dQ = dS K: (queries, head dim) over the keys, both operands MN-major; the warpgroups split the head dim.
  static constexpr int kHeadDimPerWarpGroup = kHeadDim / kNumMmaWarpGroups;
  using TiledMmadQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, ElementAccum, Shape<Int<kBlockM>, Int<kHeadDimPerWarpGroup>, Int<kBlockN>>,
                           GMMA::Major::MN, GMMA::Major::MN>(),
      Layout<Shape<_1, Int<kNumMmaWarpGroups>, _1>>{}));

  // K's swizzle atom spans at most one warpgroup's share of the head dim, so that each warpgroup's half of
  // K^T (dQ's B operand) starts on an atom. V shares the layout: dK and dV are staged in these buffers.
  using SmemLayoutK = decltype(tile_to_shape(smem_layout_atom_k_major<Element, kHeadDimPerWarpGroup>(),
                                             Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutV = SmemLayoutK;
  using SmemLayoutKt = decltype(transposed_view(SmemLayoutK{}));  // (head dim, keys)
  using SmemLayoutQ = decltype(smem_layout_k_major<Element>(Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutdO = SmemLayoutQ;
  using SmemLayoutQt = decltype(transposed_view(SmemLayoutQ{}));  // (head dim, queries, stages)
  using SmemLayoutdOt = SmemLayoutQt;
  // dS^T as the consumers write it (keys, queries), and viewed as dS (queries, keys): dQ's MN-major A.
  using SmemLayoutdS = decltype(smem_layout_k_major<Element>(Shape<Int<kBlockN>, Int<kBlockM>>{}));
  using SmemLayoutdSt = decltype(transposed_view(SmemLayoutdS{}));
  using SmemLayoutRowStats = Layout<Shape<Int<kBlockM>, Int<kStages>>>;  // LSE_log2 and dPsum per query

  using PipelineQ = cutlass::PipelineTmaAsync<kStages>;  // Q + LSE, and dO + dPsum
  using PipelineState = typename PipelineQ::PipelineState;
  using BarrierKV = cutlass::arch::ClusterTransactionBarrier;

  struct TensorStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> smem_k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutV>, 1024> smem_v;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> smem_q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutdO>, 1024> smem_do;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutdS>, 1024> smem_ds;
    alignas(128) float smem_lse[kBlockM * kStages];
    alignas(128) float smem_dpsum[kBlockM * kStages];
  };
  struct BarrierStorage {
    alignas(16) BarrierKV barrier_kv;
    alignas(16) typename PipelineQ::SharedStorage pipeline_q;
    alignas(16) typename PipelineQ::SharedStorage pipeline_do;
  };

  static constexpr uint32_t kTmaBytesKV = uint32_t(cosize_v<SmemLayoutK> * sizeof(Element));
  static constexpr uint32_t kRowStatBytes = uint32_t(kBlockM * sizeof(float));
  static constexpr uint32_t kTmaBytesQ = uint32_t(size(take<0, 2>(SmemLayoutQ{})) * sizeof(Element)) + kRowStatBytes;

  using GmemTensor = decltype(make_gmem_bshd(static_cast<Element const*>(nullptr), GmemShape{}, 0, 0, 0));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutQ{}),
                                      Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutK{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));

  struct Params {
    GmemShape shape_q, shape_k;  // dO has q's shape, V k's
    TmaQ tma_q, tma_do;
    TmaKV tma_k, tma_v;
    float const* lse_log2;  // (batch, nheads, seqlen_q_rounded): the preprocess kernel's
    float const* dpsum;     // likewise
    int seqlen_q, seqlen_k, seqlen_q_rounded, nheads;
    float softmax_scale_log2;
  };

  static Params to_params(BwdParams const& p, float const* lse_log2, float const* dpsum, int seqlen_q_rounded) {
    GmemShape const shape_q = make_shape(p.seqlen_q, p.headdim, p.nheads, p.batch);
    GmemShape const shape_k = make_shape(p.seqlen_k, p.headdim, p.nheads_kv, p.batch);
    auto const tile_q = Shape<Int<kBlockM>, Int<kHeadDim>>{};
    auto const tile_k = Shape<Int<kBlockN>, Int<kHeadDim>>{};
    return {shape_q,
            shape_k,
            make_tma_copy(SM90_TMA_LOAD{}, make_gmem_bshd<Element const>(p.q, shape_q), take<0, 2>(SmemLayoutQ{}), tile_q, _1{}),
            make_tma_copy(SM90_TMA_LOAD{}, make_gmem_bshd<Element const>(p.dout, shape_q), take<0, 2>(SmemLayoutQ{}), tile_q, _1{}),
            make_tma_copy(SM90_TMA_LOAD{}, make_gmem_bshd<Element const>(p.k, shape_k), SmemLayoutK{}, tile_k, _1{}),
            make_tma_copy(SM90_TMA_LOAD{}, make_gmem_bshd<Element const>(p.v, shape_k), SmemLayoutK{}, tile_k, _1{}),
            lse_log2,
            dpsum,
            p.seqlen_q,
            p.seqlen_k,
            seqlen_q_rounded,
            p.nheads,
            float(p.softmax_scale * M_LOG2E)};
  }

  __device__ static void prefetch_descriptors(Params const& params) {
    prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
    prefetch_tma_descriptor(params.tma_do.get_tma_descriptor());
    prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
  }

  // Called by one thread before the CTA-wide barrier that publishes the barriers.
  __device__ static void init_barriers(BarrierStorage& barriers) { barriers.barrier_kv.init(/*arrive_count=*/1); }

  __device__ static typename PipelineQ::Params pipeline_params(bool is_producer_warpgroup, bool is_leader) {
    typename PipelineQ::Params pipeline_params;
    pipeline_params.transaction_bytes = kTmaBytesQ;  // dO + dPsum: the same sizes
    pipeline_params.role = is_producer_warpgroup ? PipelineQ::ThreadCategory::Producer : PipelineQ::ThreadCategory::Consumer;
    pipeline_params.is_leader = is_leader;
    pipeline_params.num_consumers = kNumMmaThreads;
    return pipeline_params;
  }

  // One thread of the producer warp.
  __device__ static void load(Params const& params, TensorStorage& tensors, BarrierStorage& barriers, PipelineQ& pipeline_q,
                              PipelineQ& pipeline_do, BwdWork const& work) {
    Tensor sK = make_tensor(make_smem_ptr(tensors.smem_k.data()), SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(tensors.smem_v.data()), SmemLayoutV{});
    Tensor sQ = make_tensor(make_smem_ptr(tensors.smem_q.data()), SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(tensors.smem_do.data()), SmemLayoutdO{});
    auto const tile_q = Shape<Int<kBlockM>, Int<kHeadDim>>{};
    auto const tile_k = Shape<Int<kBlockN>, Int<kHeadDim>>{};

    Tensor gK = local_tile(params.tma_k.get_tma_tensor(params.shape_k)(_, _, work.kv_head, work.batch), tile_k,
                           make_coord(work.n_block, _0{}));
    Tensor gV = local_tile(params.tma_v.get_tma_tensor(params.shape_k)(_, _, work.kv_head, work.batch), tile_k,
                           make_coord(work.n_block, _0{}));
    auto [tKgK, tKsK] = tma_partition(params.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto [tVgV, tVsV] = tma_partition(params.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    using BarrierType = typename BarrierKV::ValueType;
    barriers.barrier_kv.arrive_and_expect_tx(2 * kTmaBytesKV);
    copy(params.tma_k.with(reinterpret_cast<BarrierType&>(barriers.barrier_kv), 0), tKgK, tKsK);
    copy(params.tma_v.with(reinterpret_cast<BarrierType&>(barriers.barrier_kv), 0), tVgV, tVsV);

    PipelineState write_state = cutlass::make_producer_start_state<PipelineQ>();
    for (int i = 0; i < work.count(); ++i) {
      int const head = work.head(i);
      int const m_block = work.m_block(i);
      Tensor gQ = local_tile(params.tma_q.get_tma_tensor(params.shape_q)(_, _, head, work.batch), tile_q, make_coord(m_block, _0{}));
      Tensor gdO = local_tile(params.tma_do.get_tma_tensor(params.shape_q)(_, _, head, work.batch), tile_q, make_coord(m_block, _0{}));
      auto [tQgQ, tQsQ] = tma_partition(params.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      auto [tdOgdO, tdOsdO] = tma_partition(params.tma_do, _0{}, Layout<_1>{}, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
      int64_t const row_stats = (int64_t(work.batch) * params.nheads + head) * params.seqlen_q_rounded + m_block * kBlockM;
      int const stage = write_state.index();

      pipeline_q.producer_acquire(write_state);
      BarrierType* barrier_q = pipeline_q.producer_get_barrier(write_state);
      copy(params.tma_q.with(*barrier_q, 0), tQgQ, tQsQ(_, stage));
      SM90_BULK_COPY_G2S::copy(params.lse_log2 + row_stats, barrier_q, tensors.smem_lse + stage * kBlockM, kRowStatBytes);

      pipeline_do.producer_acquire(write_state);
      BarrierType* barrier_do = pipeline_do.producer_get_barrier(write_state);
      copy(params.tma_do.with(*barrier_do, 0), tdOgdO, tdOsdO(_, stage));
      SM90_BULK_COPY_G2S::copy(params.dpsum + row_stats, barrier_do, tensors.smem_dpsum + stage * kBlockM, kRowStatBytes);
      ++write_state;
    }
  }

  __device__ static void wait_kv(BarrierStorage& barriers) { barriers.barrier_kv.wait(0); }

  // The consumers: accumulates dK (unscaled) and dV of the CTA's K/V block over its work; hands each query
  // block's dQ fragment to store_dq. Requires K and V in shared memory (wait_kv).
  template <class FragdKV, class StoreDq>
  __device__ static void mma(Params const& params, TensorStorage& tensors, PipelineQ& pipeline_q, PipelineQ& pipeline_do,
                             BwdWork const& work, int thread_idx, FragdKV& tdKrdK, FragdKV& tdVrdV, StoreDq&& store_dq) {
    using Blocks = BlockRange<kBlockM, kBlockN, kIsCausal>;
    Tensor sK = make_tensor(make_smem_ptr(tensors.smem_k.data()), SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(tensors.smem_v.data()), SmemLayoutV{});
    Tensor sKt = make_tensor(make_smem_ptr(tensors.smem_k.data()), SmemLayoutKt{});
    Tensor sQ = make_tensor(make_smem_ptr(tensors.smem_q.data()), SmemLayoutQ{});
    Tensor sQt = make_tensor(make_smem_ptr(tensors.smem_q.data()), SmemLayoutQt{});
    Tensor sdO = make_tensor(make_smem_ptr(tensors.smem_do.data()), SmemLayoutdO{});
    Tensor sdOt = make_tensor(make_smem_ptr(tensors.smem_do.data()), SmemLayoutdOt{});
    Tensor sdS = make_tensor(make_smem_ptr(tensors.smem_ds.data()), SmemLayoutdS{});
    Tensor sdSt = make_tensor(make_smem_ptr(tensors.smem_ds.data()), SmemLayoutdSt{});
    Tensor sLSE = make_tensor(make_smem_ptr(tensors.smem_lse), SmemLayoutRowStats{});
    Tensor sdPsum = make_tensor(make_smem_ptr(tensors.smem_dpsum), SmemLayoutRowStats{});

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
    Tensor tdQrdS = thread_mma_dq.partition_fragment_A(sdSt);
    Tensor tdQrK = thread_mma_dq.partition_fragment_B(sKt);

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
    Tensor tdSsdS = smem_thread_copy_ds.partition_D(sdS);

    // The query (column) of each of this thread's accumulator columns, for LSE and dPsum.
    Tensor coords = thread_mma_sdp.partition_C(make_identity_tensor(tile_sdp));
    Tensor coords_rc = make_tensor(coords.data(), acc_layout_rowcol(coords.layout()));

    Mask<kBlockM, kBlockN, kIsCausal, TiledMmaSdP, /*kKeysInRows=*/true> mask(thread_idx, params.seqlen_q, params.seqlen_k);
    bool const partial_n_block = (work.n_block + 1) * kBlockN > params.seqlen_k;
    int const m_block_causal_end = kIsCausal ? Blocks::m_block_causal_end(work.n_block, params.seqlen_q, params.seqlen_k) : 0;

    PipelineState read_state;  // Q and dO advance together
    bool zero_init_dkv = true;
    auto step = [&](int m_block, auto masked) {
      constexpr bool kMasked = decltype(masked)::value;
      int const stage = read_state.index();
      pipeline_q.consumer_wait(read_state);
      warpgroup_gemm<-1>(tiled_mma_sdp, tSrK, tSrQ(_, _, _, stage), tSrS, /*zero_init=*/true);
      pipeline_do.consumer_wait(read_state);
      warpgroup_gemm<-1>(tiled_mma_sdp, tdPrV, tdPrdO(_, _, _, stage), tdPrdP, /*zero_init=*/true);
      warpgroup_wait<1>();  // S^T is ready; dP^T still runs
      warpgroup_fence_operand(tSrS);
      if constexpr (kMasked) { mask.template apply</*kSeqlenKMask=*/true, kIsCausal>(tSrS, m_block, work.n_block); }
      Tensor scores = make_rowcol_view(tSrS);  // (keys, queries)
      CUTLASS_PRAGMA_UNROLL
      for (int ni = 0; ni < size<1>(scores); ++ni) {
        float const lse_log2 = sLSE(int(get<1>(coords_rc(0, ni))), stage);
        CUTLASS_PRAGMA_UNROLL
        for (int mi = 0; mi < size<0>(scores); ++mi) {
          scores(mi, ni) = exp2f(scores(mi, ni) * params.softmax_scale_log2 - lse_log2);
        }
      }
      warpgroup_wait<0>();  // dP^T is ready
      warpgroup_fence_operand(tdPrdP);
      Tensor dP = make_rowcol_view(tdPrdP);
      CUTLASS_PRAGMA_UNROLL
      for (int ni = 0; ni < size<1>(dP); ++ni) {
        float const dpsum = sdPsum(int(get<1>(coords_rc(0, ni))), stage);
        CUTLASS_PRAGMA_UNROLL
        for (int mi = 0; mi < size<0>(dP); ++mi) { dP(mi, ni) = scores(mi, ni) * (dP(mi, ni) - dpsum); }
      }
      convert_into(tSrS, tSrP16);
      convert_into(tdPrdP, tdPrdS16);
      warpgroup_gemm<-1>(tiled_mma_dkv, tdVrP, tdVrdO(_, _, _, stage), tdVrdV, zero_init_dkv);
      copy(smem_tiled_copy_ds, tdSrdS_copy, tdSsdS);  // sdS is free: both warpgroups are past the last dQ GEMM
      warpgroup_gemm<-1>(tiled_mma_dkv, tdKrdS, tdKrQ(_, _, _, stage), tdKrdK, zero_init_dkv);
      zero_init_dkv = false;
      cutlass::arch::fence_view_async_shared();  // dS^T written by stmatrix, read next by GMMA
      cutlass::arch::NamedBarrier::sync(kNumMmaThreads, uint32_t(BwdNamedBarriers::kdSReady));
      warpgroup_gemm<-1>(tiled_mma_dq, tdQrdS, tdQrK, tdQrdQ, /*zero_init=*/true);
      warpgroup_wait<0>();  // dV, dK and dQ GEMMs done: this stage of Q and dO, and sdS, are read
      warpgroup_fence_operand(tdVrdV);
      warpgroup_fence_operand(tdKrdK);
      warpgroup_fence_operand(tdQrdQ);
      pipeline_q.consumer_release(read_state);
      pipeline_do.consumer_release(read_state);
      ++read_state;
      store_dq(tdQrdQ);  // its barrier also keeps sdS from being overwritten before both dQ GEMMs are done
    };

    for (int i = 0; i < work.count(); ++i) {
      int const m_block = work.m_block(i);
      if (partial_n_block || (kIsCausal && m_block < m_block_causal_end)) {
        step(m_block, cute::true_type{});
      } else {
        step(m_block, cute::false_type{});
      }
    }
    if (work.count() == 0) {  // no query sees these keys: dK = dV = 0
      clear(tdKrdK);
      clear(tdVrdV);
    }
  }
};

}  // namespace flash
