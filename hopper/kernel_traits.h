// Compile-time configuration of one forward kernel: tile sizes, warpgroup roles and register split,
// GMMA tiled MMAs, shared-memory layouts and the shared storage.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "utils.h"

namespace flash {

using namespace cute;

// K-major shared-memory atom for a tile whose contiguous extent is kExtent elements: the widest
// swizzle that divides it (128-byte swizzle needs 64 16-bit elements).
template <class Element, int kExtent>
CUTE_HOST_DEVICE constexpr auto smem_layout_atom_k_major() {
  if constexpr (kExtent % 64 == 0) {
    return GMMA::Layout_K_SW128_Atom<Element>{};
  } else if constexpr (kExtent % 32 == 0) {
    return GMMA::Layout_K_SW64_Atom<Element>{};
  } else {
    static_assert(kExtent % 16 == 0, "head dim must be a multiple of 16");
    return GMMA::Layout_K_SW32_Atom<Element>{};
  }
}

// Tile sizes per head dim (16-bit): kBlockM x kBlockN, and how many consumer warpgroups share kBlockM.
// Shared memory: Q (kBlockM x d) + 2 stages each of K and V (kBlockN x d) must stay under 227 KB.
template <int kHeadDim, bool kIsCausal>
struct FwdTileSize;
// Causal kernels carry the mask's extra live registers: d64 causal with three consumer warpgroups (160
// registers each), d192 causal at kBlockN = 112 and d256 causal at kBlockN = 80 spilled, so they use
// smaller tiles. d128 non-causal: 128x176 is 3-5% faster from 4k on than 128x128; 128x128 would leave room
// for the separate O buffer of persistent launches (+13% at 512): long sequences won (section 5).
template <bool C> struct FwdTileSize<64, C>  { static constexpr int kBlockM = C ? 128 : 192, kBlockN = 128; };
template <bool C> struct FwdTileSize<96, C>  { static constexpr int kBlockM = 128, kBlockN = 128; };
template <bool C> struct FwdTileSize<128, C> { static constexpr int kBlockM = 128, kBlockN = C ? 128 : 176; };
template <bool C> struct FwdTileSize<192, C> { static constexpr int kBlockM = 128, kBlockN = C ? 96 : 112; };
template <bool C> struct FwdTileSize<256, C> { static constexpr int kBlockM = 128, kBlockN = C ? 64 : 80; };

template <class Element_, int kHeadDim_, bool kIsCausal_>
struct FwdKernelTraits {
  using Element = Element_;
  using ElementAccum = float;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kIsCausal = kIsCausal_;
#if defined(FLASH_EXT_TILE_M) && defined(FLASH_EXT_TILE_N)
  // Tile experiments in side-by-side variant builds (scripts/build_variant.sh) only.
  static constexpr int kBlockM = FLASH_EXT_TILE_M;
  static constexpr int kBlockN = FLASH_EXT_TILE_N;
#else
  static constexpr int kBlockM = FwdTileSize<kHeadDim, kIsCausal>::kBlockM;
  static constexpr int kBlockN = FwdTileSize<kHeadDim, kIsCausal>::kBlockN;
#endif
  static constexpr int kStages = 2;

  // Warpgroup 0 loads (one thread issues every TMA); each further warpgroup owns 64 rows of the tile.
  static constexpr int kNumMmaWarpGroups = kBlockM / 64;
  static constexpr int kNumMmaThreads = kNumMmaWarpGroups * cutlass::NumThreadsPerWarpGroup;
  static constexpr int kNumThreads = kNumMmaThreads + cutlass::NumThreadsPerWarpGroup;
  static_assert(kNumMmaWarpGroups == 2 || kNumMmaWarpGroups == 3);
  // setmaxnreg split of the 64K registers: the producer keeps few, the consumers hold S, P and O.
  static constexpr int kProducerRegs = kNumMmaWarpGroups == 2 ? 24 : 32;
  static constexpr int kConsumerRegs = kNumMmaWarpGroups == 2 ? 240 : 160;
  // Warpgroup ping-pong (WarpgroupScheduler): +5-14% at d64/d128 on the H200, +1-4% at d256 non-causal
  // (docs/perf-notes.md); compiled out of d192/d256 causal, where its extra live registers made ptxas
  // spill. Where compiled in, FLASH_EXT_PINGPONG=0/1 switches it at run time for A/B measurements.
  static constexpr bool kPingPongCompiled = kHeadDim <= 128 || !kIsCausal;
  static constexpr bool kPingPongDefault = kPingPongCompiled;

  using TileShapeMNK = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;
  using AtomLayoutMNK = Layout<Shape<Int<kNumMmaWarpGroups>, _1, _1>>;
  // GEMM0: S = Q K^T, both operands from shared memory, K-major.
  using TiledMmaQK = decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, ElementAccum, TileShapeMNK>(),
                                             AtomLayoutMNK{}));
  // GEMM1: O += P V, P from registers, V^T read MN-major (V is stored with headdim contiguous).
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, ElementAccum, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      AtomLayoutMNK{}));

  using SmemLayoutAtom = decltype(smem_layout_atom_k_major<Element, kHeadDim>());
  using SmemLayoutQ = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutK = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutV = SmemLayoutK;
  // The same bytes as V viewed as (headdim, kBlockN, stages): V^T for GEMM1's B operand.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutV{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{}, Step<_2, _1, _3>{})));
  // O is staged in shared memory for the TMA store: in a buffer of its own in kernels that can run
  // persistent (then the next tile's Q lands during the epilogue), else in Q's buffer (no GEMM reads Q
  // once the tile's last S is computed).
  using SmemLayoutO = SmemLayoutQ;
  static constexpr int kSmemBytesQ = int(cosize_v<SmemLayoutQ> * sizeof(Element));
  static constexpr int kSmemBytesKV = int(2 * cosize_v<SmemLayoutK> * sizeof(Element));
  static constexpr int kSmemLimit = 227 * 1024;
  // Persistent launches (non-causal only: equal-cost tiles) need the separate O buffer to pay off:
  // +12% at 512, +5% at 1k for d64 (docs/perf-notes.md sections 4-5). The host launches them while a tile
  // has at most kPersistentMaxBlocks K/V blocks; past that one CTA per tile is as fast.
  static constexpr bool kPersistentCapable = !kIsCausal && 2 * kSmemBytesQ + kSmemBytesKV + 1024 <= kSmemLimit;
  static constexpr bool kSeparateO = kPersistentCapable;
  static constexpr int kPersistentMaxBlocks = 8;

  using PipelineKV = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename PipelineKV::PipelineState;
  using BarrierQ = cutlass::arch::ClusterTransactionBarrier;
  using BarrierQEmpty = cutlass::arch::ClusterBarrier;

  struct NoBuffer {};
  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> smem_q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> smem_k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutV>, 1024> smem_v;
    alignas(1024) std::conditional_t<kSeparateO, cute::array_aligned<Element, cosize_v<SmemLayoutO>, 1024>, NoBuffer> smem_o;
    alignas(16) BarrierQ barrier_q;             // Q landed (phase = tile iteration & 1)
    alignas(16) BarrierQEmpty barrier_q_empty;  // Q's buffer may be overwritten with the next tile's Q
    alignas(16) typename PipelineKV::SharedStorage pipeline_k;
    alignas(16) typename PipelineKV::SharedStorage pipeline_v;

    __device__ __forceinline__ Element* smem_o_ptr() {
      if constexpr (kSeparateO) {
        return smem_o.data();
      } else {
        return smem_q.data();
      }
    }
  };
  static constexpr int kSharedStorageBytes = int(sizeof(SharedStorage));
  static_assert(kSharedStorageBytes <= kSmemLimit, "shared memory over the sm90 limit");

  static constexpr uint32_t kTmaBytesQ = uint32_t(size(SmemLayoutQ{}) * sizeof(Element));
  static constexpr uint32_t kTmaBytesKV = uint32_t(size(take<0, 2>(SmemLayoutK{})) * sizeof(Element));
};

}  // namespace flash
