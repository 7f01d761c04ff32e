// The forward epilogue collective: O (fp32 registers) -> ElementOut -> shared memory (stmatrix) -> one
// TMA store of the tile (rows past seqlen_q and columns past the real head dim are clipped by the TMA
// unit); or, where no shared memory is free for O, straight from registers to global memory; LSE straight
// from registers, one thread per row.
//
// How O leaves (OStore): staged in a buffer the tile ends without waiting for (kTmaAsync: the epilogue's
// own, waited for at the next tile's store, or one the mainloop lends until the store has read it, V's last
// stage, which the kernel hands back itself); staged in a buffer the mainloop no longer needs, in a CTA that
// computes one tile (kTmaWaited: Q's, which no GEMM reads once the tile's last S is computed; FP8 uses V^T's);
// staged in a buffer of its own and stored by each warpgroup for its 64 rows, with no barrier across warpgroups
// (kTmaPerWarpgroup: chained tiles, whose warpgroups reach a tile's end at different times);
// or written by each thread (kDirect: 16-byte stores of 8 adjacent columns after a transpose across the quad,
// bounds checked per row and column; persistent kernels with no buffer to spare). Q's buffer is the
// mainloop's business: persistent kernels release it after each warpgroup's last GEMM0 of the tile.
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

enum class OStore { kTmaWaited, kTmaAsync, kTmaPerWarpgroup, kDirect };

template <class ElementOut, int kBlockM, int kHeadDim, class TiledMmaPV, int kNumMmaThreads, OStore kOStore>
struct FwdEpilogue {
  static constexpr bool kPerWarpgroup = kOStore == OStore::kTmaPerWarpgroup;
  static constexpr bool kAsyncStore = kOStore == OStore::kTmaAsync || kPerWarpgroup;
  static constexpr bool kDirect = kOStore == OStore::kDirect;
  using TileShapeMD = Shape<Int<kBlockM>, Int<kHeadDim>>;
  // What one TMA store writes: the tile, or a warpgroup's 64 rows of it (kPerWarpgroup), each with its own
  // layout in the buffer.
  static constexpr int kStoreRows = kPerWarpgroup ? 64 : kBlockM;
  static constexpr int kStoresPerTile = kBlockM / kStoreRows;
  using StoreShape = Shape<Int<kStoreRows>, Int<kHeadDim>>;
  using SmemLayoutO = decltype(smem_layout_k_major<ElementOut>(StoreShape{}));
  static constexpr int kSmemBytes = int(cosize_v<SmemLayoutO> * kStoresPerTile * sizeof(ElementOut));
  static constexpr int kStoreThreads = kPerWarpgroup ? cutlass::NumThreadsPerWarpGroup : kNumMmaThreads;
  // The MMA that partitions one store's rows among its threads.
  using TiledMmaStore = std::conditional_t<
      kPerWarpgroup, decltype(make_tiled_mma(typename TiledMmaPV::Atom{}, Layout<Shape<_1, _1, _1>>{})), TiledMmaPV>;

  // Part of the kernel's shared storage when O has a buffer of its own.
  struct TensorStorage {
    alignas(1024) cute::array_aligned<ElementOut, cosize_v<SmemLayoutO> * kStoresPerTile, 1024> smem_o;
  };

  using GmemTensor = decltype(make_gmem_bshd(static_cast<ElementOut*>(nullptr), GmemShape{}, 0, 0, 0));
  using TmaO = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensor{}, SmemLayoutO{}, StoreShape{}, _1{}));

  struct Params {
    GmemShape shape_o;
    TmaO tma_o;
    GmemTensor o;  // the same rows without the TMA unit (kDirect)
    float* lse;  // (batch, nheads, seqlen_q); varlen (nheads, total_q)
    Sequences seqs;
  };

  static Params to_params(FwdParams const& p, SeqInfo const* packed) {
    auto const mO = make_gmem_rows<ElementOut>(p.o, p.seqlen_q, p.headdim, p.nheads, p.batch, p.varlen.enabled(),
                                               p.varlen.total_q);
    return {mO.shape(), make_tma_copy(SM90_TMA_STORE{}, mO, SmemLayoutO{}, StoreShape{}, _1{}), mO, p.lse,
            Sequences::make(p, packed)};
  }

  __device__ static void prefetch_descriptors(Params const& params) { prefetch_tma_descriptor(params.tma_o.get_tma_descriptor()); }

  template <class FragO, class FragLse>
  __device__ static void store(Params const& params, ElementOut* smem_o, TileCoord const& tile, SeqInfo const& seq, int thread_idx,
                               FragO const& tOrO, FragLse const& lse) {
    int const m_block = tile.block;
    Tensor tOrO_out = make_tensor_like<ElementOut>(tOrO);
    convert_into(tOrO, tOrO_out);
    TiledMmaPV tiled_mma_pv;
    auto thread_mma_pv = tiled_mma_pv.get_thread_slice(thread_idx);
    // Each value's (row, column) in the tile, as rows x columns of this thread's fragment.
    Tensor coords = thread_mma_pv.partition_C(make_identity_tensor(TileShapeMD{}));
    Tensor coords_rc = make_tensor(coords.data(), acc_layout_rowcol(coords.layout()));
    static_assert(decltype(size<0>(coords_rc))::value == decltype(size(lse))::value);

    if constexpr (kDirect) {
      Tensor mO = sequence_slice(params.o, params.seqs.q_rows(seq, tile.batch), tile.head);
      Tensor gO = local_tile(mO, TileShapeMD{}, make_coord(m_block, _0{}));
      Tensor tOgO = thread_mma_pv.partition_C(gO);
      Tensor gO_rc = make_tensor(tOgO.data(), acc_layout_rowcol(tOgO.layout()));
      Tensor out_rc = make_tensor(tOrO_out.data(), acc_layout_rowcol(tOrO_out.layout()));
      // A thread holds columns 8j + 2t, 8j + 2t + 1 of its rows (t = its lane in the quad, j = 0 .. d/8 - 1).
      // Written as they lie, 4 bytes per store, they made 512-key tiles 10-17% slower than a TMA store of O
      // (perf-notes section 28): the quad transposes each 4 x 4 block of 32-bit words instead, so that thread
      // t holds the 8 columns 8(4g + t) .. + 7 and writes them as one 16-byte store (the head dim is a
      // multiple of 8; row stride and base are 16-byte aligned, as the TMA loads require).
      constexpr int kWords = decltype(size<1>(out_rc))::value / 2;  // 32-bit words (column pairs) per row
      static_assert(kWords % 4 == 0);
      int const headdim = get<1>(params.shape_o);
      int const quad_lane = thread_idx % 4;
      CUTLASS_PRAGMA_UNROLL
      for (int mi = 0; mi < size<0>(out_rc); ++mi) {
        bool const row_in = m_block * kBlockM + int(get<0>(coords_rc(mi, 0))) < seq.seqlen_q;
        CUTLASS_PRAGMA_UNROLL
        for (int g = 0; g < kWords / 4; ++g) {
          uint32_t in[4], out[4];
          CUTLASS_PRAGMA_UNROLL
          for (int u = 0; u < 4; ++u) {
            cutlass::Array<ElementOut, 2> pair;
            pair[0] = out_rc(mi, 2 * (4 * g + u));
            pair[1] = out_rc(mi, 2 * (4 * g + u) + 1);
            in[u] = reinterpret_cast<uint32_t const&>(pair);
          }
          quad_transpose(in, out, quad_lane);
          int const col = int(get<1>(coords_rc(mi, 2 * 4 * g))) + 6 * quad_lane;  // 8(4g + t): own column 8 * 4g + 2t
          if (row_in && col < headdim) {
            auto* dst = reinterpret_cast<uint4*>(&gO_rc(mi, 2 * 4 * g) + 6 * quad_lane);
            *dst = make_uint4(out[0], out[1], out[2], out[3]);
          }
        }
      }
      store_lse(params, tile, seq, coords_rc, lse);
      return;
    }

    // This thread's store: the tile's, or its warpgroup's rows.
    int const store_idx = kPerWarpgroup ? thread_idx / kStoreThreads : 0;
    int const store_thread = kPerWarpgroup ? thread_idx % kStoreThreads : thread_idx;
    Tensor sO = make_tensor(make_smem_ptr(smem_o + store_idx * int(cosize_v<SmemLayoutO>)), SmemLayoutO{});
    auto smem_tiled_copy_o = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, ElementOut>{}, TiledMmaStore{});
    auto smem_thread_copy_o = smem_tiled_copy_o.get_thread_slice(store_thread);
    Tensor taccOrO = smem_thread_copy_o.retile_S(tOrO_out);
    Tensor taccOsO = smem_thread_copy_o.partition_D(sO);
    uint32_t const barrier = kPerWarpgroup ? uint32_t(FwdNamedBarriers::kEpilogueWarpgroup0) + store_idx
                                           : uint32_t(FwdNamedBarriers::kEpilogue);

    // An own buffer is free again once the previous tile's store has read it.
    if constexpr (kAsyncStore) {
      if (store_thread == 0) { tma_store_wait<0>(); }
    }
    // The buffer is free (and, where it is Q's, every warpgroup is past its last GEMM0).
    cutlass::arch::NamedBarrier::sync(kStoreThreads, barrier);
    copy(smem_tiled_copy_o, taccOrO, taccOsO);
    cutlass::arch::fence_view_async_shared();  // generic-proxy writes, read next by the TMA unit

    store_lse(params, tile, seq, coords_rc, lse);

    cutlass::arch::NamedBarrier::sync(kStoreThreads, barrier);
    if (store_thread == 0) {
      Tensor mO = sequence_slice(params.tma_o.get_tma_tensor(params.shape_o), params.seqs.q_rows(seq, tile.batch), tile.head);
      Tensor gO = local_tile(mO, StoreShape{}, make_coord(m_block * kStoresPerTile + store_idx, _0{}));
      auto [tOgO, tOsO] = tma_partition(params.tma_o, _0{}, Layout<_1>{}, group_modes<0, 2>(sO), group_modes<0, 2>(gO));
      copy(params.tma_o, tOsO, tOgO);
      tma_store_arrive();  // waited for at the next tile's store (kTmaAsync) or in finish()
    }
  }

  // out[u] = in[t] of quad lane u, for the quad lane t of this thread (a 4 x 4 transpose across the quad): the
  // word for lane t ^ r travels in round r, chosen and placed with selects (registers cannot be indexed).
  __device__ static void quad_transpose(uint32_t const (&in)[4], uint32_t (&out)[4], int t) {
    auto pick = [&](int i) { return i == 0 ? in[0] : i == 1 ? in[1] : i == 2 ? in[2] : in[3]; };
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < 4; ++r) {
      int const partner = t ^ r;
      uint32_t const v = r == 0 ? pick(t) : __shfl_xor_sync(0xffffffff, pick(partner), r);
      CUTLASS_PRAGMA_UNROLL
      for (int u = 0; u < 4; ++u) {
        if (u == partner) { out[u] = v; }
      }
    }
  }

  // LSE: the thread holding column 0 of a row writes it.
  template <class Coords, class FragLse>
  __device__ static void store_lse(Params const& params, TileCoord const& tile, SeqInfo const& seq, Coords const& coords_rc,
                                   FragLse const& lse) {
    float* lse_row0 = params.lse + params.seqs.lse_row0(seq, tile.batch, tile.head);
    CUTLASS_PRAGMA_UNROLL
    for (int mi = 0; mi < size(lse); ++mi) {
      int const row = tile.block * kBlockM + int(get<0>(coords_rc(mi, 0)));
      if (int(get<1>(coords_rc(mi, 0))) == 0 && row < seq.seqlen_q) { lse_row0[row] = lse(mi); }
    }
  }

  // Shared memory must outlive the TMA unit's reads of the last tile's O.
  __device__ static void finish(int thread_idx) {
    if (!kDirect && thread_idx % kStoreThreads == 0) { tma_store_wait<0>(); }
  }
};

}  // namespace flash
