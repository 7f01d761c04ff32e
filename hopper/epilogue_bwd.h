// The backward epilogue collective: dK (scaled by the softmax scale) and dV of the CTA's K/V block, from
// fp32 registers -> Element -> shared memory (into K's and V's buffers, which no GEMM reads any more) ->
// TMA stores (rows past seqlen_k and columns past the real head dim are clipped). Accumulators laid out
// (keys, head dim) go to shared memory by stmatrix; transposed ones (head dim, keys: kTransposedAcc) value
// by value through their coordinates.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "flash.h"
#include "head_dim_boxes.h"
#include "layouts.h"
#include "named_barriers.h"
#include "utils.h"
#include "varlen.h"

namespace flash {

using namespace cute;

template <class Element, int kBlockN, int kHeadDim, class SmemLayoutKV, class TiledMmadKV, int kNumMmaThreads,
          bool kTransposedAcc>
struct BwdEpilogue {
  using TileShapeND = Shape<Int<kBlockN>, Int<kHeadDim>>;
  using GmemTensor = decltype(make_gmem_bshd(static_cast<Element*>(nullptr), GmemShape{}, 0, 0, 0));
  using TmadKV = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensor{}, SmemLayoutKV{}, TileShapeND{}, _1{}));

  struct Params {
    GmemShape shape_k;
    TmadKV tma_dk, tma_dv;
  };

  static Params to_params(BwdParams const& p) {
    auto rows_k = [&](StridedTensor const& t) {
      return make_gmem_rows<Element>(t, p.seqlen_k, p.headdim, p.nheads_kv, p.batch, p.varlen.enabled(), p.varlen.total_k);
    };
    return {rows_k(p.dk).shape(), make_tma_copy(SM90_TMA_STORE{}, rows_k(p.dk), SmemLayoutKV{}, TileShapeND{}, _1{}),
            make_tma_copy(SM90_TMA_STORE{}, rows_k(p.dv), SmemLayoutKV{}, TileShapeND{}, _1{})};
  }

  __device__ static void prefetch_descriptors(Params const& params) {
    prefetch_tma_descriptor(params.tma_dk.get_tma_descriptor());
    prefetch_tma_descriptor(params.tma_dv.get_tma_descriptor());
  }

  // All consumer threads. smem_k / smem_v: K's and V's buffers, free once every consumer is past its last GEMM.
  template <class FragdKV>
  // k_rows: where the K/V block's sequence is (varlen.h); head_boxes: the head-dim boxes stored (head_dim_boxes.h).
  __device__ static void store(Params const& params, Element* smem_k, Element* smem_v, int n_block, int kv_head,
                               TmaRows const& k_rows, int head_boxes, int thread_idx, FragdKV const& tdKrdK,
                               FragdKV const& tdVrdV) {
    Tensor sdK = make_tensor(make_smem_ptr(smem_k), SmemLayoutKV{});
    Tensor sdV = make_tensor(make_smem_ptr(smem_v), SmemLayoutKV{});
    Tensor tdKrdK_out = make_tensor_like<Element>(tdKrdK);
    Tensor tdVrdV_out = make_tensor_like<Element>(tdVrdV);
    convert_into(tdKrdK, tdKrdK_out);
    convert_into(tdVrdV, tdVrdV_out);

    // Every consumer warpgroup is past its last GEMM, which read K and V.
    cutlass::arch::NamedBarrier::sync(kNumMmaThreads, uint32_t(BwdNamedBarriers::kEpilogue));
    if constexpr (!kTransposedAcc) {
      auto smem_tiled_copy = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, TiledMmadKV{});
      auto smem_thread_copy = smem_tiled_copy.get_thread_slice(thread_idx);
      copy(smem_tiled_copy, smem_thread_copy.retile_S(tdKrdK_out), smem_thread_copy.partition_D(sdK));
      copy(smem_tiled_copy, smem_thread_copy.retile_S(tdVrdV_out), smem_thread_copy.partition_D(sdV));
    } else {
      Tensor coords = TiledMmadKV{}.get_thread_slice(thread_idx).partition_C(
          make_identity_tensor(Shape<Int<kHeadDim>, Int<kBlockN>>{}));  // (head dim, key) of each value
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(tdKrdK_out); ++i) {
        int const d = int(get<0>(coords(i))), key = int(get<1>(coords(i)));
        sdK(key, d) = tdKrdK_out(i);
        sdV(key, d) = tdVrdV_out(i);
      }
    }
    cutlass::arch::fence_view_async_shared();  // generic-proxy writes, read next by the TMA unit
    cutlass::arch::NamedBarrier::sync(kNumMmaThreads, uint32_t(BwdNamedBarriers::kEpilogue));
    if (thread_idx == 0) {
      Tensor gdK = local_tile(sequence_slice(params.tma_dk.get_tma_tensor(params.shape_k), k_rows, kv_head), TileShapeND{},
                              make_coord(n_block, _0{}));
      Tensor gdV = local_tile(sequence_slice(params.tma_dv.get_tma_tensor(params.shape_k), k_rows, kv_head), TileShapeND{},
                              make_coord(n_block, _0{}));
      auto [tdKgdK, tdKsdK] = tma_partition(params.tma_dk, _0{}, Layout<_1>{}, group_modes<0, 2>(sdK), group_modes<0, 2>(gdK));
      auto [tdVgdV, tdVsdV] = tma_partition(params.tma_dv, _0{}, Layout<_1>{}, group_modes<0, 2>(sdV), group_modes<0, 2>(gdV));
      using Boxes = HeadDimBoxes<Element, kHeadDim>;  // boxes wholly past the head dim are not stored
      copy_head_boxes<Boxes>(head_boxes, params.tma_dk, tdKsdK, tdKgdK);
      copy_head_boxes<Boxes>(head_boxes, params.tma_dv, tdVsdV, tdVgdV);
      tma_store_arrive();
      tma_store_wait<0>();  // shared memory must outlive the TMA unit's reads
    }
  }
};

}  // namespace flash
