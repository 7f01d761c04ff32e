// Tile sizes and register split per (dtype, head dim, mask): the numbers that performance measurements
// choose (docs/perf-notes.md). Layouts live with the collectives that own them (mainloop_*.h,
// epilogue_*.h); the launch policy with the kernel.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

namespace flash {

// kBlockM x kBlockN per head dim for 16-bit forward kernels. Shared memory: Q (kBlockM x d) + 2 stages each
// of K and V (kBlockN x d) must stay under 227 KB.
// Causal kernels carry the mask's extra live registers: d64 causal with three consumer warpgroups (160
// registers each), d192 causal at kBlockN = 112 and d256 causal at kBlockN = 80 spilled, so they use
// smaller tiles. d128 non-causal: 128x176 is 3-5% faster from 4k on than 128x128; 128x128 would leave room
// for the separate O buffer of persistent launches (+13% at 512): long sequences won (perf-notes section 5).
template <int kHeadDim, bool kIsCausal>
struct FwdTileSize16;
template <bool C> struct FwdTileSize16<64, C>  { static constexpr int kBlockM = C ? 128 : 192, kBlockN = 128; };
template <bool C> struct FwdTileSize16<96, C>  { static constexpr int kBlockM = 128, kBlockN = 128; };
template <bool C> struct FwdTileSize16<128, C> { static constexpr int kBlockM = 128, kBlockN = C ? 128 : 176; };
template <bool C> struct FwdTileSize16<192, C> { static constexpr int kBlockM = 128, kBlockN = C ? 96 : 112; };
template <bool C> struct FwdTileSize16<256, C> { static constexpr int kBlockM = 128, kBlockN = C ? 64 : 80; };

// The static configuration of one forward kernel.
template <class Element_, int kHeadDim_, bool kIsCausal_>
struct FwdConfig {
  static_assert(sizeof(Element_) == 2, "16-bit forward configuration; FP8 adds its own");
  using Element = Element_;  // Q, K, V
  using ElementOut = Element_;  // O
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kIsCausal = kIsCausal_;
#if defined(FLASH_EXT_TILE_M) && defined(FLASH_EXT_TILE_N)
  // Tile experiments in side-by-side variant builds (scripts/build_variant.sh) only.
  static constexpr int kBlockM = FLASH_EXT_TILE_M;
  static constexpr int kBlockN = FLASH_EXT_TILE_N;
#else
  static constexpr int kBlockM = FwdTileSize16<kHeadDim, kIsCausal>::kBlockM;
  static constexpr int kBlockN = FwdTileSize16<kHeadDim, kIsCausal>::kBlockN;
#endif
  static constexpr int kStages = 2;  // K/V pipeline depth

  // Warpgroup 0 loads; each further warpgroup owns 64 rows of the tile.
  static constexpr int kNumMmaWarpGroups = kBlockM / 64;
  static_assert(kNumMmaWarpGroups == 2 || kNumMmaWarpGroups == 3);
  // setmaxnreg split of the 64K registers: the producer keeps few, the consumers hold S, P and O.
  static constexpr int kProducerRegs = kNumMmaWarpGroups == 2 ? 24 : 32;
  static constexpr int kConsumerRegs = kNumMmaWarpGroups == 2 ? 240 : 160;
  // Warpgroup ping-pong (WarpgroupScheduler): +5-14% at d64/d128 on the H200, +1-4% at d256 non-causal
  // (perf-notes section 2); compiled out of d192/d256 causal, where its extra live registers made ptxas
  // spill. Where compiled in, FLASH_EXT_PINGPONG=0/1 switches it at run time for A/B measurements.
  static constexpr bool kPingPong = kHeadDim <= 128 || !kIsCausal;
};

}  // namespace flash

namespace flash {

// The static configuration of one backward kernel. A CTA owns kBlockN keys and walks the query blocks of
// kBlockM rows that see them. Up to d128 each consumer warpgroup owns 64 keys (mainloop_bwd.h); beyond,
// dK and dV of 64 keys no longer fit a warpgroup's registers, so the warpgroups split the head dim
// (mainloop_bwd_headsplit.h) over smaller K/V blocks.
template <class Element_, int kHeadDim_, bool kIsCausal_>
struct BwdConfig {
  static_assert(sizeof(Element_) == 2, "16-bit backward");
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kIsCausal = kIsCausal_;
  static constexpr bool kHeadSplit = kHeadDim > 128;
  static constexpr int kBlockM = 64;
  static constexpr int kBlockN = kHeadSplit ? 64 : 128;
  static constexpr int kStages = 2;  // Q and dO pipeline depth
  static constexpr int kNumMmaWarpGroups = 2;
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
};

}  // namespace flash
