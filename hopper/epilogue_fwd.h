// The forward epilogue: O (fp32 registers) -> 16-bit -> shared memory (stmatrix, into Q's buffer) -> one
// TMA store of the tile (rows past seqlen_q and columns past the real head dim are clipped by the TMA
// unit); LSE straight from registers, one thread per row.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "tile_scheduler.h"
#include "utils.h"
#include "warpgroup_scheduler.h"

namespace flash {

using namespace cute;

template <class Traits>
struct FwdEpilogue {
  using Element = typename Traits::Element;
  using TileShapeMNK = typename Traits::TileShapeMNK;
  static constexpr int kBlockM = Traits::kBlockM;

  template <class Params, class FragO, class FragLse>
  __device__ static void store(Params const& params, typename Traits::SharedStorage& storage, TileCoord const& tile,
                               int thread_idx, FragO const& tOrO, FragLse const& lse) {
    using TiledMmaPV = typename Traits::TiledMmaPV;
    Tensor sO = make_tensor(make_smem_ptr(storage.smem_o_ptr()), typename Traits::SmemLayoutO{});

    Tensor tOrO_out = make_tensor_like<Element>(tOrO);
    convert_into(tOrO, tOrO_out);

    auto smem_tiled_copy_o = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, TiledMmaPV{});
    auto smem_thread_copy_o = smem_tiled_copy_o.get_thread_slice(thread_idx);
    Tensor taccOrO = smem_thread_copy_o.retile_S(tOrO_out);
    Tensor taccOsO = smem_thread_copy_o.partition_D(sO);

    // O's own buffer is free again once the previous tile's store has read it.
    if constexpr (Traits::kSeparateO) {
      if (thread_idx == 0) { tma_store_wait<0>(); }
    }
    // Every consumer warpgroup is past its last GEMM0 (which reads Q) and the buffer is free.
    cutlass::arch::NamedBarrier::sync(Traits::kNumMmaThreads, uint32_t(FwdNamedBarriers::kEpilogue));
    if constexpr (Traits::kSeparateO) {
      if (thread_idx == 0) { storage.barrier_q_empty.arrive(); }  // the producer may load the next Q now
    }
    copy(smem_tiled_copy_o, taccOrO, taccOsO);
    cutlass::arch::fence_view_async_shared();  // generic-proxy writes, read next by the TMA unit

    // LSE: the thread holding column 0 of a row writes it.
    TiledMmaPV tiled_mma_pv;
    auto thread_mma_pv = tiled_mma_pv.get_thread_slice(thread_idx);
    Tensor coords = thread_mma_pv.partition_C(make_identity_tensor(select<0, 2>(TileShapeMNK{})));
    Tensor coords_rc = make_tensor(coords.data(), acc_layout_rowcol(coords.layout()));
    static_assert(decltype(size<0>(coords_rc))::value == decltype(size(lse))::value);
    float* lse_row0 = params.lse + (int64_t(tile.batch) * params.nheads + tile.head) * params.seqlen_q;
    CUTLASS_PRAGMA_UNROLL
    for (int mi = 0; mi < size(lse); ++mi) {
      int const row = tile.m_block * kBlockM + int(get<0>(coords_rc(mi, 0)));
      if (int(get<1>(coords_rc(mi, 0))) == 0 && row < params.seqlen_q) { lse_row0[row] = lse(mi); }
    }

    cutlass::arch::NamedBarrier::sync(Traits::kNumMmaThreads, uint32_t(FwdNamedBarriers::kEpilogue));
    if (thread_idx == 0) {
      Tensor mO = params.tma_o.get_tma_tensor(params.shape_q)(_, _, tile.head, tile.batch);
      Tensor gO = local_tile(mO, select<0, 2>(TileShapeMNK{}), make_coord(tile.m_block, _0{}));
      auto [tOgO, tOsO] = tma_partition(params.tma_o, _0{}, Layout<_1>{}, group_modes<0, 2>(sO), group_modes<0, 2>(gO));
      copy(params.tma_o, tOsO, tOgO);
      tma_store_arrive();
      if constexpr (!Traits::kSeparateO) {
        tma_store_wait<0>();                  // O sits in Q's buffer: the next Q waits for the store to read it
        storage.barrier_q_empty.arrive();
      }
    }
  }

  // Shared memory must outlive the TMA unit's reads of the last tile's O.
  __device__ static void finish(int thread_idx) {
    if (thread_idx == 0) { tma_store_wait<0>(); }
  }
};

}  // namespace flash
