// The forward epilogue collective: O (fp32 registers) -> ElementOut -> shared memory (stmatrix) -> one
// TMA store of the tile (rows past seqlen_q and columns past the real head dim are clipped by the TMA
// unit); LSE straight from registers, one thread per row.
//
// The staging buffer is the epilogue's own, one the mainloop lends until the store has read it (V's last
// stage: the kernel hands that back itself), or Q's (which no GEMM reads once the tile's last S is
// computed). With kAsyncStore (the first two) the tile ends without waiting for its store: an own buffer is
// waited for at the next tile's store. release_input_buffer() (Q's) is called by one thread once the
// consumers are past the mainloop and, when Q's buffer stages O, once the TMA store has read it: from then
// on the producer may load the next tile's Q.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "flash.h"
#include "layouts.h"
#include "named_barriers.h"
#include "tile_scheduler.h"
#include "utils.h"
#include "varlen.h"

namespace flash {

using namespace cute;

template <class ElementOut, int kBlockM, int kHeadDim, class TiledMmaPV, int kNumMmaThreads, bool kAsyncStore>
struct FwdEpilogue {
  using TileShapeMD = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using SmemLayoutO = decltype(smem_layout_k_major<ElementOut>(TileShapeMD{}));
  static constexpr int kSmemBytes = int(cosize_v<SmemLayoutO> * sizeof(ElementOut));

  // Part of the kernel's shared storage when O has a buffer of its own.
  struct TensorStorage {
    alignas(1024) cute::array_aligned<ElementOut, cosize_v<SmemLayoutO>, 1024> smem_o;
  };

  using GmemTensor = decltype(make_gmem_bshd(static_cast<ElementOut*>(nullptr), GmemShape{}, 0, 0, 0));
  using TmaO = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensor{}, SmemLayoutO{}, TileShapeMD{}, _1{}));

  struct Params {
    GmemShape shape_o;
    TmaO tma_o;
    float* lse;  // (batch, nheads, seqlen_q); varlen (nheads, total_q)
    Sequences seqs;
  };

  static Params to_params(FwdParams const& p, SeqInfo const* packed) {
    auto const mO = make_gmem_rows<ElementOut>(p.o, p.seqlen_q, p.headdim, p.nheads, p.batch, p.varlen.enabled(),
                                               p.varlen.total_q);
    return {mO.shape(), make_tma_copy(SM90_TMA_STORE{}, mO, SmemLayoutO{}, TileShapeMD{}, _1{}), p.lse,
            Sequences::make(p, packed)};
  }

  __device__ static void prefetch_descriptors(Params const& params) { prefetch_tma_descriptor(params.tma_o.get_tma_descriptor()); }

  template <class FragO, class FragLse, class ReleaseInputBuffer>
  __device__ static void store(Params const& params, ElementOut* smem_o, TileCoord const& tile, SeqInfo const& seq, int thread_idx,
                               FragO const& tOrO, FragLse const& lse, ReleaseInputBuffer&& release_input_buffer) {
    int const m_block = tile.block;
    Tensor sO = make_tensor(make_smem_ptr(smem_o), SmemLayoutO{});

    Tensor tOrO_out = make_tensor_like<ElementOut>(tOrO);
    convert_into(tOrO, tOrO_out);

    auto smem_tiled_copy_o = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, ElementOut>{}, TiledMmaPV{});
    auto smem_thread_copy_o = smem_tiled_copy_o.get_thread_slice(thread_idx);
    Tensor taccOrO = smem_thread_copy_o.retile_S(tOrO_out);
    Tensor taccOsO = smem_thread_copy_o.partition_D(sO);

    // An own buffer is free again once the previous tile's store has read it.
    if constexpr (kAsyncStore) {
      if (thread_idx == 0) { tma_store_wait<0>(); }
    }
    // Every consumer warpgroup is past its last GEMM0 (which reads Q) and the buffer is free.
    cutlass::arch::NamedBarrier::sync(kNumMmaThreads, uint32_t(FwdNamedBarriers::kEpilogue));
    if constexpr (kAsyncStore) {
      if (thread_idx == 0) { release_input_buffer(); }
    }
    copy(smem_tiled_copy_o, taccOrO, taccOsO);
    cutlass::arch::fence_view_async_shared();  // generic-proxy writes, read next by the TMA unit

    // LSE: the thread holding column 0 of a row writes it.
    TiledMmaPV tiled_mma_pv;
    auto thread_mma_pv = tiled_mma_pv.get_thread_slice(thread_idx);
    Tensor coords = thread_mma_pv.partition_C(make_identity_tensor(TileShapeMD{}));
    Tensor coords_rc = make_tensor(coords.data(), acc_layout_rowcol(coords.layout()));
    static_assert(decltype(size<0>(coords_rc))::value == decltype(size(lse))::value);
    float* lse_row0 = params.lse + params.seqs.lse_row0(seq, tile.batch, tile.head);
    CUTLASS_PRAGMA_UNROLL
    for (int mi = 0; mi < size(lse); ++mi) {
      int const row = m_block * kBlockM + int(get<0>(coords_rc(mi, 0)));
      if (int(get<1>(coords_rc(mi, 0))) == 0 && row < seq.seqlen_q) { lse_row0[row] = lse(mi); }
    }

    cutlass::arch::NamedBarrier::sync(kNumMmaThreads, uint32_t(FwdNamedBarriers::kEpilogue));
    if (thread_idx == 0) {
      Tensor mO = sequence_slice(params.tma_o.get_tma_tensor(params.shape_o), params.seqs.q_rows(seq, tile.batch), tile.head);
      Tensor gO = local_tile(mO, TileShapeMD{}, make_coord(m_block, _0{}));
      auto [tOgO, tOsO] = tma_partition(params.tma_o, _0{}, Layout<_1>{}, group_modes<0, 2>(sO), group_modes<0, 2>(gO));
      copy(params.tma_o, tOsO, tOgO);
      tma_store_arrive();
      if constexpr (!kAsyncStore) {
        tma_store_wait<0>();  // Q's buffer is needed back: wait until the store has read it
        release_input_buffer();
      }
    }
  }

  // Shared memory must outlive the TMA unit's reads of the last tile's O.
  __device__ static void finish(int thread_idx) {
    if (thread_idx == 0) { tma_store_wait<0>(); }
  }
};

}  // namespace flash
