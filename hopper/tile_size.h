// Tile sizes and register split per (dtype, head dim, mask): the numbers that performance measurements
// choose (docs/perf-notes.md). Layouts live with the collectives that own them (mainloop_*.h,
// epilogue_*.h); the launch policy with the kernel.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>

#include "flash.h"

namespace flash {

// A forward kernel's tile: kBlockM x kBlockN, and kBlockMLong x kBlockNLong for the one-CTA-per-tile kernel
// of long sequences where that differs (FwdLauncher's LongConfig; the persistent kernel keeps the first).
// kStagesMid: where nonzero, a third configuration for mid-length keys (FwdLauncher's MidConfig): the base
// tile, persistent, unchained, with that many K/V stages (the room the second Q and O's buffer held).
template <int kBlockM_, int kBlockN_, int kBlockMLong_ = kBlockM_, int kBlockNLong_ = kBlockN_, int kStagesMid_ = 0>
struct FwdTile {
  static constexpr int kBlockM = kBlockM_, kBlockN = kBlockN_, kBlockMLong = kBlockMLong_, kBlockNLong = kBlockNLong_;
  static constexpr int kStagesMid = kStagesMid_;
};

// Which of a forward configuration's tile sets a kernel runs (FwdLauncher): the base tiles (persistent, chained
// where they fit, and every one-wave grid and varlen call), the mid-length set (kStagesMid), or the long tiles
// of one CTA per tile (kBlockMLong x kBlockNLong).
enum class FwdTiles { kBase, kMid, kLong };

// 16-bit forward tiles per head dim. Shared memory: Q (kBlockM x d) + 2 stages each of K and V (kBlockN x d)
// must stay under 227 KB.
// Causal kernels carry the mask's extra live registers: d192 causal at kBlockN = 112 and d256 causal at
// kBlockN = 80 once spilled; both compile clean now but pay only on long sequences (perf-notes sections 32
// and 36). d128 non-causal: 128x176 is 3-5% faster from 4k on than 128x128 (perf-notes section 5), so the
// one-CTA-per-tile kernel of long sequences keeps it; the persistent kernel (and one-wave grids) takes 128x128,
// which leaves room for O's own buffer and a second Q (chained tiles): +4% at 512 keys, +2% at 1k, equal at
// 2k-4k and at 16k in one wave (perf-notes section 46).
// Long tiles: d64 causal 192-row tiles (three consumer warpgroups) are 7-11% faster from 4k keys on, 10-11%
// slower at 512-1k (a third of the last tile empty, more masked blocks per tile), and their persistent
// form's producer spills (perf-notes section 30); d256 causal 80-key blocks are 3-4% faster from 4k keys on
// and 3-6% slower at 512-1k, in either form (perf-notes section 36). Since the equal L2 groups of section
// 39, the persistent kernel with the base tiles matches or beats both at 4k: they run beyond 4k keys.
// d128 non-causal past 2k keys up to 4k: the 128x128 tiles unchained with three K/V stages, persistent (O in V's
// last stage), +2-3% at 4k over the chained two-stage form; chaining is worth 1.4-2.8% more at 512-1k, the
// 128x176 tiles as much or more from 6k on (perf-notes sections 51 and 52; FwdLaunchPolicy::kMidMaxKeys).
// d256 non-causal: 128x64 for the persistent form (O staged over both V stages, 64 KB: it fits 64-key stages
// exactly), 128x80 for one CTA per tile; 512 keys are 6.4 blocks of 80 but 8 of 64 (perf-notes section 50).
template <int kHeadDim, bool kIsCausal>
struct FwdTileSize16;
template <bool C> struct FwdTileSize16<64, C> : FwdTile<C ? 128 : 192, 128, 192> {};
template <bool C> struct FwdTileSize16<96, C> : FwdTile<128, 128> {};
template <bool C> struct FwdTileSize16<128, C> : FwdTile<128, 128, 128, C ? 128 : 176, C ? 0 : 3> {};
template <bool C> struct FwdTileSize16<192, C> : FwdTile<128, C ? 96 : 112> {};
template <bool C> struct FwdTileSize16<256, C> : FwdTile<128, 64, 128, 80> {};

// FP8 (e4m3) tiles: twice the GEMM rate per byte of shared memory, so longer K/V blocks; V also needs a
// transposed copy (mainloop_fwd.h), which the 16-bit kernels do not. d128 causal at kBlockN = 224 spilled
// in the main loop (the mask's registers), so it takes 192.
template <int kHeadDim, bool kIsCausal>
struct FwdTileSizeFp8;
template <bool C> struct FwdTileSizeFp8<64, C> : FwdTile<192, 160> {};
template <bool C> struct FwdTileSizeFp8<96, C> : FwdTile<192, 128> {};
template <bool C> struct FwdTileSizeFp8<128, C> : FwdTile<128, C ? 192 : 224> {};
template <bool C> struct FwdTileSizeFp8<192, C> : FwdTile<128, 160> {};
template <bool C> struct FwdTileSizeFp8<256, C> : FwdTile<128, 128> {};

// The static configuration of one forward kernel. kTiles: which tile set (FwdTiles); FwdLauncher instantiates
// the kMid and kLong configurations only where kHasMidTiles and kHasLongTiles.
template <class Element_, int kHeadDim_, bool kIsCausal_, FwdTiles kTiles_ = FwdTiles::kBase, bool kVColMajor_ = false>
struct FwdConfig {
  static_assert(sizeof(Element_) == 2 || sizeof(Element_) == 1, "16-bit or FP8 (e4m3) inputs");
  static constexpr bool kIsFp8 = sizeof(Element_) == 1;
  using Element = Element_;  // Q, K, V
  using ElementOut = std::conditional_t<kIsFp8, cutlass::bfloat16_t, Element_>;  // O
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kIsCausal = kIsCausal_;
  static constexpr FwdTiles kTiles = kTiles_;
  static constexpr bool kLongTiles = kTiles_ == FwdTiles::kLong;
  using TileSize = std::conditional_t<kIsFp8, FwdTileSizeFp8<kHeadDim, kIsCausal>, FwdTileSize16<kHeadDim, kIsCausal>>;
#if defined(FLASH_EXT_TILE_M) && defined(FLASH_EXT_TILE_N)
  // Tile experiments in side-by-side variant builds (scripts/build_variant.sh) only.
  static constexpr int kBlockM = FLASH_EXT_TILE_M;
  static constexpr int kBlockN = FLASH_EXT_TILE_N;
  static constexpr bool kHasLongTiles = false;
  static constexpr bool kHasMidTiles = false;
#else
  static constexpr int kBlockM = kLongTiles ? TileSize::kBlockMLong : TileSize::kBlockM;
  static constexpr int kBlockN = kLongTiles ? TileSize::kBlockNLong : TileSize::kBlockN;
  static constexpr bool kHasLongTiles = TileSize::kBlockMLong != TileSize::kBlockM || TileSize::kBlockNLong != TileSize::kBlockN;
  static constexpr bool kHasMidTiles = TileSize::kStagesMid != 0;
#endif
  // K/V pipeline depth: a third stage where shared memory holds it beside the chained tiles (16-bit d64 and
  // d96): at 512 keys d64 +4-6% non-causal, +7-8% causal, d96 +10% / +5%; at 1k-4k d64 causal and d96 +1-6%, d64
  // non-causal within 1.5% either way; 8k-16k within 2% (perf-notes sections 50 and 51). d128's and d192's
  // chained tiles leave no room (d128 unchained fits three stages and loses 1-13% at 512-1k, section 51); FP8
  // (V's transposed copy) is untimed.
  // The mid-length set (kTiles == kMid) takes TileSize::kStagesMid.
  static constexpr int kDefaultStages =
      kTiles_ == FwdTiles::kMid ? TileSize::kStagesMid : (!kIsFp8 && (kHeadDim == 64 || kHeadDim == 96) ? 3 : 2);
#ifdef FLASH_EXT_FWD_STAGES  // variant builds (A/B): the base tiles; MidConfig and LongConfig keep their default
  static constexpr int kStages = kTiles_ == FwdTiles::kBase ? FLASH_EXT_FWD_STAGES : kDefaultStages;
#else
  static constexpr int kStages = kDefaultStages;
#endif
  // Chained tiles (16-bit persistent kernels whose shared memory holds a second Q beside O's own buffer: d64, d96,
  // d128): each consumer warpgroup runs its CTA's tiles as one stream of K/V blocks, the last GEMM1 of a
  // tile issued with the first GEMM0 of the next (whose Q lands in the second buffer), the tile's epilogue under
  // them, its O stored by the warpgroup on its own; the ping-pong turns run on across tiles (FwdKernel). d64:
  // +4-13% non-causal, +3-6% causal from 512 to 4k keys; d96 causal +5% at 512, d96 non-causal within 1%; d128
  // causal +5% at 512, +2% at 1k; d128 non-causal (128x128 tiles) +4% at 512 (perf-notes section 46).
#ifdef FLASH_EXT_CHAIN_TILES  // variant builds (A/B)
  static constexpr bool kChainTilesWanted = FLASH_EXT_CHAIN_TILES;
#else
  static constexpr bool kChainTilesWanted = true;
#endif
  static constexpr bool kChainTiles =
      kChainTilesWanted && !kIsFp8 && kTiles_ == FwdTiles::kBase &&
      ((3 * kBlockM + 2 * kStages * kBlockN) * kHeadDim * int(sizeof(Element_)) + 2048 <= 227 * 1024);
  static constexpr int kStagesQ = kChainTiles ? 2 : 1;  // Q buffers
  // Chained tiles: the producer issues the next tile's Q this many K/V blocks before the tile's last one (its
  // buffer is free since the previous tile's last GEMM0), instead of after the tile's last K/V block, where it
  // waited behind them; < 0: after. d128: +1-4% at 512-2k keys, both masks (5 blocks; 2: +1-2%); d64 lost 6-7%
  // at two shapes of eight with either lead, also when Q waited for no buffer (perf-notes section 56).
#ifdef FLASH_EXT_NEXT_Q_LEAD  // variant builds (A/B)
  static constexpr int kNextQLeadBlocks = FLASH_EXT_NEXT_Q_LEAD;
#else
  static constexpr int kNextQLeadBlocks = kHeadDim == 128 ? 5 : -1;
#endif
  // FP8 V given column-major, its keys (sequence dim) contiguous (FA3's V_colmajor): GEMM1 reads it as the
  // TMA loads it, and P's registers are exchanged within each quad into the keys' natural order
  // (convert_acc_to_a_regs_natural_fp8 in utils.h) instead of V being transposed in shared memory.
  static constexpr bool kVColMajor = kVColMajor_;
  static_assert(!kVColMajor || kIsFp8, "column-major V: FP8 only (16-bit GEMMs read V either way)");
  static constexpr int kMaxOffset = kIsFp8 ? kFp8MaxOffset : 0;  // flash.h

  // Warpgroup 0 loads (and, for FP8, transposes V); each further warpgroup owns 64 rows of the tile.
  static constexpr int kNumMmaWarpGroups = kBlockM / 64;
  static_assert(kNumMmaWarpGroups == 2 || kNumMmaWarpGroups == 3);
  // setmaxnreg split of the registers the CTA got at launch (FwdKernel checks the sum): the producer keeps
  // few, the consumers hold S, P and O. The FP8 producer warpgroup also transposes V: it takes 40 where the
  // consumers can give 8 each (232 suffice up to d192); FP8 d256's consumers need all 240.
  static constexpr bool kLeanProducer = !kIsFp8 || kHeadDim > 192;
  static constexpr int kProducerRegs = kNumMmaWarpGroups == 2 ? (kLeanProducer ? 24 : 40) : 32;
  static constexpr int kConsumerRegs = kNumMmaWarpGroups == 2 ? (kLeanProducer ? 240 : 232) : 160;
  // Warpgroup ping-pong (WarpgroupScheduler): +5-14% at d64/d128 on the H200, +1-4% at d256 non-causal
  // (perf-notes section 2); compiled out of d192/d256 causal, where its extra live registers made ptxas
  // spill, and out of FP8 with three consumer warpgroups (d64, d96), which run 4-9% faster without it
  // (perf-notes section 37). Where compiled in, FLASH_EXT_PINGPONG=0/1 switches it at run time for A/B
  // measurements.
  static constexpr bool kPingPong = (kHeadDim <= 128 || !kIsCausal) && !(kIsFp8 && kNumMmaWarpGroups == 3);
  // Every kExp2OnFmaEvery-th exponential of a thread's row computed on the FMA pipe (softmax.h's
  // exp2_on_fma) instead of MUFU; 0 = none. FP8 non-causal d128 and d192, where the exponentials need
  // about as long on MUFU as the GEMMs on the tensor pipe: every 12th (7% of them) is 3-5% faster (d128:
  // every 8th +3%, every 4th -3%; d256 +-1%). FP8 causal kernels, whose mask already crowds the registers,
  // lose 8-14% (they spill with it), and 16-bit kernels 2-10% (perf-notes section 37).
#ifdef FLASH_EXT_EXP2_ON_FMA_EVERY  // variant builds (A/B)
  static constexpr int kExp2OnFmaEvery = FLASH_EXT_EXP2_ON_FMA_EVERY;
#else
  static constexpr int kExp2OnFmaEvery = kIsFp8 && !kIsCausal && kNumMmaWarpGroups == 2 && kHeadDim <= 192 ? 12 : 0;
#endif
  // Each block's softmax held under the warpgroup's own GEMM1 as well as under the other warpgroup's GEMMs
  // (GEMM1's wait made to follow the exponentials; ptxas otherwise issues it first: perf-notes section 19).
  // 16-bit d256 non-causal on one CTA per tile (128x80): +0-6% from 512 to 16k; d192 non-causal 2-8% slower, d256
  // causal mixed (-3% to +5%), FP8 and d128 3-6% slower (perf-notes sections 19 and 21); d256 non-causal's
  // persistent 128x64 tiles 2-3% slower (section 50).
#ifdef FLASH_EXT_SOFTMAX_UNDER_GEMM1  // variant builds (A/B)
  static constexpr bool kSoftmaxUnderGemm1 = FLASH_EXT_SOFTMAX_UNDER_GEMM1;
#else
  static constexpr bool kSoftmaxUnderGemm1 = !kIsFp8 && kHeadDim == 256 && !kIsCausal && kLongTiles;
#endif
  // GEMM0's Q descriptors from a warpgroup index the compiler knows is uniform (utils.h's warpgroup_slice_idx), so
  // that they stay in uniform registers instead of regular ones moved there before each GEMM (R2UR). FP8 d128: its
  // 32-byte spill (those descriptors, reloaded every block) and its softcapped tiles' 12 bytes are gone, at the same
  // speed (-1% to +2%). Elsewhere it measured -1% to -3% (16-bit d64), +1-3% at 1k-4k and -2% from 8k (16-bit d128
  // non-causal); FP8 d256 causal spilled 40 bytes with it instead of 4 (perf-notes section 57). FP8 d256
  // non-causal: its spill, reloaded in the step loop, 56 -> 4 bytes (column-major V: 16 -> 0), +0.4% to +3%
  // (perf-notes section 58). FP8 d256 causal with column-major V: its 24-byte spill gone, at the same speed (-2% to
  // +2%, outputs bitwise equal; perf-notes section 59); with V row-major (transposed) it would spill 40 bytes.
  // 16-bit d128 non-causal, chained and mid-length tiles: +2-3% at 2k, +0.4-2.4% at 3k-4k, level at 512-1k, and the
  // chained kernel's 8-byte spill gone; the long 128x176 tiles lose 1-3% with it (perf-notes section 59).
#ifdef FLASH_EXT_UNIFORM_Q_DESCRIPTORS  // variant builds (A/B)
  static constexpr bool kUniformQDescriptors = FLASH_EXT_UNIFORM_Q_DESCRIPTORS;
#else
  static constexpr bool kUniformQDescriptors =
      kIsFp8 ? kHeadDim == 128 || (kHeadDim == 256 && (!kIsCausal || kVColMajor))
             : kHeadDim == 128 && !kIsCausal && kTiles_ != FwdTiles::kLong;
#endif
  // O rescaled only where a row's max moved by more than softmax.h's kLazyThreshold (Softmax::kLazyRescale).
  // It pays where O's rescale is largest against the rest of a step: 16-bit d256 +2-5% in both masks, FP8 causal
  // d128 +2-4% and d256 (V transposed) -1% to +3%. 16-bit d64 and d128 lose 1-4% (the vote and the branch cost
  // more than 32-64 FMULs), FP8 non-causal d128 5% at 2k, FP8 causal d256 with column-major V 1-3%, whose quad
  // exchange of P already fills the step (perf-notes section 45).
#ifdef FLASH_EXT_LAZY_RESCALE  // variant builds (A/B)
  static constexpr bool kLazyRescale = FLASH_EXT_LAZY_RESCALE;
#else
  static constexpr bool kLazyRescale =
      kIsFp8 ? kIsCausal && !kVColMajor && (kHeadDim == 128 || kHeadDim == 256) : kHeadDim == 256;
#endif
};

}  // namespace flash

namespace flash {

// The static configuration of one backward kernel. A CTA owns kBlockN keys and walks the query blocks of
// kBlockM rows that see them. Up to d128 each consumer warpgroup owns 64 keys (mainloop_bwd.h); beyond,
// dK and dV of 64 keys no longer fit a warpgroup's registers, so the warpgroups split the head dim
// (mainloop_bwd_headsplit.h) over a block of 80 keys.
template <class Element_, int kHeadDim_, bool kIsCausal_>
struct BwdConfig {
  static_assert(sizeof(Element_) == 2, "16-bit backward");
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kIsCausal = kIsCausal_;
  static constexpr bool kHeadSplit = kHeadDim > 128;
#if defined(FLASH_EXT_BWD_TILE_M)
  static constexpr int kBlockM = FLASH_EXT_BWD_TILE_M;  // tile experiments in variant builds only
#else
  // Queries per step. d64: 128, twice the GEMM work per barrier and per load (+5% non-causal, +8% causal
  // at 8k). Otherwise 64: the dK/dV accumulators leave no registers for larger S^T and dP^T tiles (perf-notes
  // section 16). d128 non-causal ran 80 (+0-4% at 8k, +7% at 2k against 64 then), until 64 with dQ staged per
  // warpgroup beat it by 2-7% at 512-8k (section 56), after which 80-row blocks (dQ computed transposed) were
  // removed: dQ's GEMM has the queries as GMMA's M, so blocks are multiples of 64 (mainloop_bwd.h).
  static constexpr int kBlockM = kHeadDim <= 64 ? 128 : 64;
#endif
#if defined(FLASH_EXT_BWD_TILE_N)
  static constexpr int kBlockN = FLASH_EXT_BWD_TILE_N;  // tile experiments in variant builds only
#else
  // Keys per CTA. Beyond d128: 80 (FA3's tile; dK and dV take 160 registers a thread, dQ is computed in
  // slices): the dQ adds, which bound that kernel, are 20% fewer per FLOP than with 64 keys (+7-10% at
  // 8k, perf-notes section 17).
  static constexpr int kBlockN = kHeadSplit ? 80 : 128;
#endif
  // Q and dO pipeline depths. With 80 keys of d256, two dO stages no longer fit shared memory; dO is
  // released as soon as dV's GEMM has read it.
  static constexpr int kStagesQ = 2;
#if defined(FLASH_EXT_BWD_STAGES_DO)
  static constexpr int kStagesdO = FLASH_EXT_BWD_STAGES_DO;
#else
  static constexpr int kStagesdO = kHeadSplit ? 1 : 2;
#endif
  static constexpr int kNumMmaWarpGroups = 2;
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  // dS^T buffers up to d128 (mainloop_bwd.h), one per Q stage: dQ is staged per consumer warpgroup
  // (dq_accumulator.h), each warpgroup's part added, and handed back, on its own, so a warpgroup may write the
  // next block's dS^T while the other's dQ GEMM still reads this one. Against staging the whole block with one
  // dS^T buffer: d64 +3-5%, d96 +3-5%, d128 causal +1-2% (perf-notes section 55), d128 non-causal +1-3%
  // (section 56). (Beyond d128 dQ goes from registers; the head-split mainloop has its own dS buffers.)
  static constexpr int kStagesdS = kStagesQ;
};

}  // namespace flash
