// The warp-specialized forward kernel: warpgroup 0 produces (TMA), the others consume (GMMA + softmax)
// and store the tile. Composes the mainloop and epilogue collectives and the tile scheduler, in two
// launch forms: one CTA per tile (straight-line code), or persistent CTAs that walk tiles.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "epilogue_fwd.h"
#include "flash.h"
#include "kernel_launch.h"
#include "mainloop_fwd.h"
#include "mask.h"
#include "softmax.h"
#include "tile_scheduler.h"
#include "tile_size.h"  // FwdTiles
#include "varlen.h"

namespace flash {

using namespace cute;

// Launch policy of one configuration, decided per call on the host (perf-notes sections 4, 5 and 15).
//
// Persistent CTAs (one per SM, looping over tiles) hide the fixed per-tile costs that dominate short
// sequences: the producer loads the next tile's first K/V block and Q while the consumers finish the tile
// (Q once every consumer warpgroup's last GEMM0 of the tile is complete: the last softmax, GEMM1 and the
// epilogue hide the load).
// That needs O to leave without holding up the next Q: staged in a buffer of its own where one fits beside
// the mainloop's storage, else (non-causal 16-bit, kBlockN >= kBlockM) in the V stage the tile's last GEMM1
// read (the next tile's first K/V block goes to the other stage; the consumers hand this one back once the
// store has read it), else (d192, FP8 up to d192) written from registers straight to global memory, else
// (16-bit d256) over both V stages. FP8's transposing warps walk the tiles with the consumers. FP8 d256 keeps
// one tile per CTA (its persistent form spilled and ran slower).
// Causal tiles differ in length: persistent causal CTAs draw tiles from a counter, longest first over groups
// of heads (tile_scheduler.h), so the SMs finish together; non-causal ones walk equal tiles statically.
//
// Long sequences run one CTA per tile with straight-line code, a kernel of its own: the tile loop (and the
// producer registers it needs) cost 2-5% there, and persistence gains nothing once a tile has many blocks.
template <class Config>
struct FwdLaunchPolicy {
  using Mainloop = FwdMainloop<Config>;
  static constexpr int kSmemLimit = 227 * 1024;
  using EpilogueAsync = FwdEpilogue<typename Config::ElementOut, Config::kBlockM, Config::kHeadDim,
                                    typename Mainloop::TiledMmaPV, Mainloop::kNumMmaThreads, OStore::kTmaAsync>;
#ifndef FLASH_EXT_FORCE_DIRECT_O  // variant builds (A/B): every 16-bit kernel gets a persistent form writing O directly
#define FLASH_EXT_FORCE_DIRECT_O 0
#endif
  static constexpr bool kOwnOBuffer =
      !FLASH_EXT_FORCE_DIRECT_O && !Config::kIsFp8 &&
      int(sizeof(typename Mainloop::TensorStorage)) + EpilogueAsync::kSmemBytes + 1024 <= kSmemLimit;
  // O in V's last stage: no default tile since d128 non-causal moved to 128x128 (perf-notes section 46); tile
  // variant builds (FLASH_EXT_TILE_N, e.g. d128 at 128x176) still take it.
  static constexpr bool kOInVStage = !FLASH_EXT_FORCE_DIRECT_O && !kOwnOBuffer && !Config::kIsFp8 &&
                                     !Config::kIsCausal && EpilogueAsync::kSmemBytes <= Mainloop::kSmemBytesVStage;
  // O written from registers (FwdEpilogue, OStore::kDirect): d192, +5-10% at 512 keys and +1-6% at 1k over one
  // CTA per tile. d256 only within noise that way (+1.5-2% at 512, -2% at 1k; its persistent consumers spill 36
  // bytes, perf-notes section 28): d256 causal stages O over V instead (kOOverV below).
  // FP8 up to d192 too (its O, bf16, is twice Q's size and shared memory is full of V's two copies); FP8 d256 has
  // no persistent form: its consumers need all 240 registers, and the form spilled 72 bytes and ran 4-15% slower
  // from 2k keys (perf-notes section 41); with V column-major, 88-108 bytes and 2-20% slower (section 43).
  static constexpr bool kODirect = !kOwnOBuffer && !kOInVStage && (FLASH_EXT_FORCE_DIRECT_O || Config::kHeadDim <= 192);
  // O staged over both V stages (d256, whose O is larger than one stage): the next tile's first V waits for the
  // store, its Q and first K do not (FwdMainloop::load). Causal +10% at 512 keys, +4% at 1k over one CTA per
  // tile (perf-notes section 35); non-causal, on 128x64 tiles, +8.6% at 512, +2% at 640-768, equal at 1k
  // (section 50; on 128x80 tiles O spans 80 KB, and its consumers spilled).
  static constexpr bool kOOverV = !FLASH_EXT_FORCE_DIRECT_O && !kOwnOBuffer && !kOInVStage && !kODirect &&
                                  !Config::kIsFp8 &&
                                  EpilogueAsync::kSmemBytes <= Mainloop::kStages * Mainloop::kSmemBytesVStage;
  static constexpr bool kPersistentCapable = kOwnOBuffer || kOInVStage || kODirect || kOOverV;
  // Persistent while a tile spans at most this many keys; beyond, one CTA per tile. Both forms timed in one
  // process (perf-notes sections 15, 32, 39 and 47): persistent wins through 8k keys at d64 non-causal (+3%),
  // d128 causal (+2.8% at 8k since chaining, equal at 16k) and d192 causal (+5-8%), through 16k at d96 (chained:
  // +4-9% from 4k to 8k, +1-4% at 16k), through 4k at d128 non-causal (+2%; the chained base tiles through 2k since
  // section 52, the mid-length set from 2k to 4k: kMidMaxKeys) and at d64 and d256 causal (+1-5% at
  // 4k once the L2 groups are equal, section 39), through 1k at d256 non-causal (equal at 1k, section 50), and
  // loses from 2k on at d192 non-causal (-1 to -4%); beyond those, the one-CTA-per-tile forms of d64 and d256
  // and of d128 non-causal have taller or wider tiles (sections 30, 36, 46 and 50), which win. Elsewhere 16
  // K/V blocks.
  static constexpr int persistent_max_keys() {
    if constexpr (Config::kIsFp8) {
      // FP8 (d256 has no persistent form; perf-notes section 41): persistent wins 11-25% at 512 keys and
      // through 8k in causal calls (+3-7% at 8k; d64 +3% at 16k), and non-causal through 8k at d64 and d192;
      // at d96 and d128 it loses 1% from 4k-8k on.
      if (Config::kIsCausal) { return Config::kHeadDim == 64 ? 16384 : 8192; }
      return Config::kHeadDim == 96 || Config::kHeadDim == 128 ? 2048 : 8192;
    }
    switch (Config::kHeadDim) {
      case 64: return Config::kIsCausal ? 4096 : 8192;
      case 96: return 16384;
      case 128: return Config::kIsCausal ? 8192 : (Config::kHasMidTiles ? 2048 : 4096);
      case 192: return Config::kIsCausal ? 8192 : 16 * Config::kBlockN;
      case 256: return Config::kIsCausal ? 4096 : 1024;
      default: return 16 * Config::kBlockN;
    }
  }
  static constexpr int kPersistentMaxKeys = persistent_max_keys();
  // Key spans past kPersistentMaxKeys and up to this many run the mid-length set (FwdTiles::kMid, persistent)
  // where the configuration has one. d128 non-causal: +2-3% at 4k over the chained form, +1% at 3k, equal at 2k;
  // beyond 4k the 128x176 tiles of one CTA per tile, 1.7% faster at 6k, equal at 8k (perf-notes section 52).
  static constexpr int kMidMaxKeys = Config::kHasMidTiles ? 4096 : 0;
  static_assert(!Config::kHasMidTiles || !Config::kIsCausal, "the mid-length set walks its tiles statically: non-causal");

  // Varlen calls decided by their longest sequence against kPersistentMaxKeys, as dense calls by their length,
  // and beyond it run the long tiles one CTA per tile (their rows are the persistent form's, so VarlenPrepare's
  // tile list serves both): where the persistent form's tiles suit short sequences only. d256 non-causal, whose
  // persistent 64-key blocks ran the benchmark's varlen batch (16 sequences of 698..5702 keys) at 0.92x the
  // TFLOP/s of the dense kernel on the same work (perf-notes section 50).
  static constexpr bool kVarlenByKeyLimit = !Config::kIsFp8 && Config::kHeadDim == 256 && !Config::kIsCausal;

  using Scheduler = TileScheduler<Config::kBlockM>;
  static constexpr bool kLongestFirst = Config::kIsCausal;  // causal query blocks grow with the block index

  struct LaunchMode {
    bool persistent, dynamic;
    // kLong: one CTA per tile on LongConfig's tiles where the configuration has them (else on the base tiles);
    // kMid: persistent on MidConfig's (FwdLauncher).
    FwdTiles tiles;
  };
  static LaunchMode launch_mode(FwdParams const& p) {
    // The keys a tile spans: all of them, or a window's width.
    int key_span = p.seqlen_k;
    if constexpr (Config::kIsCausal) {
      Band const band = Band::make(p.seqlen_q, p.seqlen_k, p.options.window_left, p.options.window_right);
      key_span = std::min<int64_t>(p.seqlen_k, int64_t(band.left) + band.right + Config::kBlockM);
    }
    // Varlen tiles differ in length like causal ones, whatever the longest sequence: persistent CTAs drawing
    // them longest first (d128 causal, 16 sequences of 418..6467 keys: 0.90x -> 0.98x the TFLOP/s of a dense
    // batch of the same work; perf-notes section 23), except where kVarlenByKeyLimit.
    bool persistent = kPersistentCapable && ((p.varlen.enabled() && !kVarlenByKeyLimit) || key_span <= kPersistentMaxKeys);
    // A grid of one wave or less gains nothing from persistence and pays for it: the tile counter's
    // memset and the tile loop (b1 h1 s128, FP8 d128 causal: 8.0 us against 5.9; perf-notes section 41).
    // It keeps the tiles of the persistent form, which suit short sequences (and give the bits of a varlen
    // call of the same sequences).
    bool const one_wave = !p.varlen.enabled() && p.persistent < 0 &&
                          int64_t(ceil_div(p.seqlen_q, Config::kBlockM)) * p.nheads * p.batch <= num_sms(current_device());
    if (one_wave) { persistent = false; }
    if (p.persistent >= 0) { persistent = kPersistentCapable && p.persistent != 0; }
    bool const past_base = !persistent && !one_wave && (!p.varlen.enabled() || kVarlenByKeyLimit);
    FwdTiles tiles = past_base ? FwdTiles::kLong : FwdTiles::kBase;
    // The mid-length set: dense calls only (varlen calls keep the base tiles VarlenPrepare's list is made of);
    // FLASH_EXT_PERSISTENT=2 forces it.
    if (Config::kHasMidTiles && !p.varlen.enabled() &&
        (p.persistent == 2 || (p.persistent < 0 && past_base && key_span <= kMidMaxKeys))) {
      return {true, false, FwdTiles::kMid};
    }
    return {persistent, persistent && (Config::kIsCausal || p.varlen.enabled()), tiles};
  }
  // Workspace: varlen calls' sequences and tile list (VarlenPrepare's), then the tile counter of dynamic
  // launches.
  static VarlenWorkspace varlen_workspace(FwdParams const& p) {
    return VarlenWorkspace(p.batch, p.varlen.total_q, Config::kBlockM, p.nheads, /*stats_blocks=*/0);
  }
  static size_t counter_offset(FwdParams const& p) { return p.varlen.enabled() ? varlen_workspace(p).bytes : 0; }
  static size_t workspace_bytes(FwdParams const& p) {
    return counter_offset(p) + (launch_mode(p).dynamic ? sizeof(int) : 0);
  }
  static int* counter(FwdParams const& p) {
    return launch_mode(p).dynamic ? VarlenWorkspace::at<int>(p.workspace, counter_offset(p)) : nullptr;
  }
  static SeqInfo const* packed_sequences(FwdParams const& p) {
    return p.varlen.enabled() ? varlen_workspace(p).seqs(p.workspace) : nullptr;
  }
  // VarlenPrepare's parameters: tiles over query blocks, in the kernel's block order.
  static VarlenPrepare::Params varlen_prepare(FwdParams const& p) {
    return varlen_workspace(p).params(p.varlen, p.seqlen_q, p.seqlen_k, p.workspace, Config::kBlockM, /*tile_keys=*/false,
                                      p.nheads, kLongestFirst, p.o, p.lse, p.headdim, /*stats_block=*/Config::kBlockM);
  }

  // Causal: longest first. Persistent CTAs draw from the counter, over groups of heads whose K/V fit in L2;
  // one CTA per tile keeps one head's blocks together (grouping measured 2-6% slower there at 8k-16k:
  // perf-notes section 15).
  static Scheduler scheduler(FwdParams const& p) {
    auto const mode = launch_mode(p);
    if (p.varlen.enabled()) {  // longest sequences first, each in the block order below
      VarlenWorkspace const ws = varlen_workspace(p);
      return Scheduler(ws.tiles(p.workspace), ws.max_tiles, counter(p));
    }
    int64_t const kv_bytes_per_head = int64_t(p.seqlen_k) * Config::kHeadDim * 2 * int(sizeof(typename Config::Element));
    int const heads_per_group = kLongestFirst && mode.persistent
                                    ? Scheduler::l2_heads_per_group(kv_bytes_per_head, p.nheads / p.nheads_kv, p.nheads * p.batch)
                                    : 1;
    return Scheduler(p.seqlen_q, p.nheads, p.batch, kLongestFirst, heads_per_group, counter(p));
  }
};

template <class Config, bool kPersistent>
struct FwdKernel {
  using Policy = FwdLaunchPolicy<Config>;
  static_assert(!kPersistent || Policy::kPersistentCapable, "no persistent form without a place for O");
  using Mainloop = FwdMainloop<Config>;
  static constexpr int kBlockM = Config::kBlockM;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr bool kIsCausal = Config::kIsCausal;
  static constexpr int kNumMmaThreads = Mainloop::kNumMmaThreads;
  static constexpr int kNumThreads = kNumMmaThreads + cutlass::NumThreadsPerWarpGroup;
  static constexpr int kMinBlocksPerSm = 1;

  // Register split (setmaxnreg). setmaxnreg moves registers between warpgroups inside what the CTA got at
  // launch (the per-thread count ptxas can give kNumThreads threads, a multiple of 8): asking for more makes
  // the consumers' increase wait forever. The tile loop's state does not fit a producer of 24 registers
  // (ptxas spilled it): persistent kernels take 8 from each consumer warpgroup, and their producer gets all
  // that the consumers leave (with a window's first block in the loop, 32 spilled at d64 causal).
  static constexpr int kCtaRegs = (65536 / kNumThreads) / 8 * 8 * kNumThreads;
  static constexpr int kConsumerRegs = Config::kConsumerRegs - (kPersistent && Config::kProducerRegs < 32 ? 8 : 0);
  static constexpr int kProducerRegs =
      kPersistent ? cute::min(56, (kCtaRegs - kConsumerRegs * kNumMmaThreads) / cutlass::NumThreadsPerWarpGroup / 8 * 8)
                  : Config::kProducerRegs;
  static_assert(!kPersistent || kProducerRegs >= 32, "the tile loop needs 32 registers in the producer");
  static_assert(kProducerRegs * cutlass::NumThreadsPerWarpGroup + kConsumerRegs * kNumMmaThreads <= kCtaRegs,
                "the setmaxnreg split exceeds the CTA's registers");

  // Where O is staged (Policy): persistent, its own buffer, V's last stage, V's two stages or nowhere; one tile
  // per CTA, a buffer the mainloop no longer needs at the end of the tile: Q's (16-bit), or V^T's (FP8: bf16 O
  // is twice Q's size; GEMM1, the only reader of V^T, is done and so are the transposes once the consumers
  // reach the epilogue).
  static constexpr bool kOwnOBuffer = kPersistent && Policy::kOwnOBuffer;
  static constexpr bool kOInVStage = kPersistent && Policy::kOInVStage;
  static constexpr bool kODirect = kPersistent && Policy::kODirect;
  static constexpr bool kOOverV = kPersistent && Policy::kOOverV;
  static constexpr bool kStageOInVt = !kPersistent && Config::kIsFp8;  // (column-major V: V's own stages)
  // Chained tiles (Config::kChainTiles): the persistent form's warpgroups each run the CTA's tiles as one stream
  // of K/V blocks and store their own rows of O.
  static constexpr bool kChainTiles = kPersistent && Config::kChainTiles;
  static_assert(!kChainTiles || (kOwnOBuffer && !Config::kIsFp8), "chained tiles: 16-bit, O in a buffer of its own");
  using Epilogue = FwdEpilogue<
      typename Config::ElementOut, kBlockM, Config::kHeadDim, typename Mainloop::TiledMmaPV, kNumMmaThreads,
      kODirect ? OStore::kDirect
               : (kChainTiles ? OStore::kTmaPerWarpgroup : (kPersistent ? OStore::kTmaAsync : OStore::kTmaWaited))>;
  static_assert(kPersistent || Epilogue::kSmemBytes <= (kStageOInVt ? Mainloop::kSmemBytesVt : Mainloop::kSmemBytesQ),
                "O fits the lent buffer");
  using Scheduler = typename Policy::Scheduler;

  struct TensorsWithO {
    typename Mainloop::TensorStorage mainloop;
    typename Epilogue::TensorStorage epilogue;
  };
  struct TensorsWithoutO {
    typename Mainloop::TensorStorage mainloop;
  };
  struct SharedStorage {
    std::conditional_t<kOwnOBuffer, TensorsWithO, TensorsWithoutO> tensors;
    typename Mainloop::BarrierStorage barriers;
    // Persistent CTAs: the producer publishes each tile here (double-buffered by tile iteration) before
    // arming Q's barrier; block -1 ends the walk.
    TileCoord tile_slots[2];
  };
  static constexpr int kSharedStorageBytes = int(sizeof(SharedStorage));
  static_assert(kSharedStorageBytes <= Policy::kSmemLimit, "shared memory over the sm90 limit");

  struct Params {
    typename Mainloop::Params mainloop;
    typename Epilogue::Params epilogue;
    // Built on the host: the device reads its fields from the parameter bank instead of holding them in
    // registers.
    Scheduler scheduler;
  };

  static Params to_params(FwdParams const& p) {
    SeqInfo const* packed = Policy::packed_sequences(p);
    return {Mainloop::to_params(p, packed), Epilogue::to_params(p, packed), Policy::scheduler(p)};
  }

  // Forced inline into device_kernel: ptxas called it as a function in the chained kernels at d96 and d128 causal,
  // and serialized the wgmma pipeline across the call (perf-notes section 46).
  CUTE_DEVICE static void run(Params const& params, char* smem) {
    using PipelineKV = typename Mainloop::PipelineKV;
    auto& storage = *reinterpret_cast<SharedStorage*>(smem);
    Scheduler const& scheduler = params.scheduler;
    // Varlen grids are sized by a bound on the tiles: a CTA past the list's end has none.
    if (!kPersistent && !scheduler.valid(scheduler.first())) { return; }

    int const warp_group_idx = cutlass::canonical_warp_group_idx();
    int const warp_idx = cutlass::canonical_warp_idx_sync();
    bool const is_producer_thread = threadIdx.x == 0;

    if (warp_idx == 0 && cute::elect_one_sync()) {
      Mainloop::prefetch_descriptors(params.mainloop);
      Epilogue::prefetch_descriptors(params.epilogue);
      Mainloop::init_barriers(storage.barriers);
    }
    // The pipelines initialise their barriers from warp 0; the __syncthreads below publishes them.
    auto pipelines = Mainloop::make_pipelines(storage.barriers, warp_group_idx == 0, is_producer_thread);

    // The K/V blocks [min, max) a tile needs.
    struct KeyBlocks {
      int min, max;
    };
    auto key_blocks = [&](TileCoord const& tile, SeqInfo const& seq) {
      BlockRange<kBlockM, kBlockN, kIsCausal> const blocks{Mainloop::band(params.mainloop, seq)};
      return KeyBlocks{blocks.n_block_min(tile.block), blocks.n_block_max(tile.block)};
    };
    auto sequence = [&](TileCoord const& tile) { return params.mainloop.seqs.at(tile.batch); };

    // One CTA per tile: the TMA thread issues Q and the first K/V block before the CTA-wide barrier, on
    // barriers its own warp has just initialised (__syncwarp orders that). The CTA's start (the barrier,
    // setmaxnreg) then overlaps their flight instead of preceding it (perf-notes sections 38 and 40).
    using LoadPart = typename Mainloop::LoadPart;
    typename Mainloop::PipelineState write_state = cutlass::make_producer_start_state<PipelineKV>();
    // One part of the one tile's loads. The tile is worked out again for each part (cheap: the divisors are the
    // host's), so that nothing is held in registers across the barrier and setmaxnreg.
    auto load_single_tile = [&](auto part) {
      TileCoord const tile = scheduler.coord(scheduler.first());
      SeqInfo const seq = sequence(tile);
      KeyBlocks const blocks = key_blocks(tile, seq);
      Mainloop::template load</*kLoopsOverTiles=*/false, /*kOOverV=*/false, decltype(part)::value>(
          params.mainloop, storage.tensors.mainloop, storage.barriers, pipelines, write_state, tile, seq, blocks.min,
          blocks.max, 0, [] {}, /*q_loaded=*/false, [] {});
    };
    if constexpr (!kPersistent) {
      if (warp_idx == 0) {
        __syncwarp();
        if (is_producer_thread) { load_single_tile(std::integral_constant<LoadPart, LoadPart::kHead>{}); }
      }
    }
    __syncthreads();

    if (warp_group_idx == 0) {
      cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
      // One thread issues the TMA loads; FP8: warps 1-3 transpose V.
      if (is_producer_thread) {
        if constexpr (kPersistent) {
          int iteration = 0;
          auto publish_end = [&storage](int iteration) {
            return [&storage, slot = iteration & 1] { storage.tile_slots[slot] = TileCoord{-1, 0, 0}; };
          };
          for (int t = scheduler.first(); scheduler.valid(t); ++iteration) {
            int const t_next = scheduler.next(t);  // a dynamic draw's latency hides behind this tile's loads
            TileCoord const tile = scheduler.coord(t);
            SeqInfo const seq = sequence(tile);
            KeyBlocks const blocks = key_blocks(tile, seq);
            // Mainloop::kNextQEarly: the next tile's Q (or the end) from within this tile's loads.
            auto next_q = [&] {
              if (scheduler.valid(t_next)) {
                TileCoord const next = scheduler.coord(t_next);
                Mainloop::template load_q</*kLoopsOverTiles=*/true>(
                    params.mainloop, storage.tensors.mainloop, storage.barriers, next, sequence(next), iteration + 1,
                    [&storage, slot = (iteration + 1) & 1, next] { storage.tile_slots[slot] = next; });
              } else {
                Mainloop::load_end(storage.barriers, iteration + 1, publish_end(iteration + 1));
              }
            };
            Mainloop::template load</*kLoopsOverTiles=*/true, kOOverV>(
                params.mainloop, storage.tensors.mainloop, storage.barriers, pipelines, write_state, tile, seq, blocks.min,
                blocks.max, iteration, [&storage, slot = iteration & 1, tile] { storage.tile_slots[slot] = tile; },
                /*q_loaded=*/Mainloop::kNextQEarly && iteration > 0, next_q);
            t = t_next;
          }
          if (!Mainloop::kNextQEarly || iteration == 0) {
            Mainloop::load_end(storage.barriers, iteration, publish_end(iteration));
          }
        } else {
          load_single_tile(std::integral_constant<LoadPart, LoadPart::kTail>{});
        }
      } else if (Mainloop::kTransposeV && warp_idx > 0) {
        int const transpose_idx = int(threadIdx.x) - cutlass::NumThreadsPerWarp;
        if constexpr (kPersistent) {
          // The tiles as the consumers learn them: published with Q (the slot is not reused before the
          // consumers finish the tile, which needs this tile's transposes).
          uint32_t blocks_before = 0;
          for (int iteration = 0;; ++iteration) {
            Mainloop::wait_q(storage.barriers, iteration);
            TileCoord const volatile& slot = storage.tile_slots[iteration & 1];
            TileCoord const tile{slot.block, slot.head, slot.batch};
            if (tile.block < 0) { break; }
            KeyBlocks const blocks = key_blocks(tile, sequence(tile));
            int const num_blocks = max(0, blocks.max - blocks.min);
            // Beside three consumer warpgroups (32 registers), one 8x8 tile in flight per warp: with two and the
            // tile loop's state, ptxas spilled addresses inside the block loop (d64).
            constexpr int kTilesInFlight = kProducerRegs > 32 ? Mainloop::kTransposeTilesInFlight : 1;
            Mainloop::template transpose_tile<kTilesInFlight>(storage.tensors.mainloop, storage.barriers, num_blocks,
                                                              transpose_idx, blocks_before);
            blocks_before += uint32_t(num_blocks);
          }
        } else {
          TileCoord const tile = scheduler.coord(scheduler.first());
          KeyBlocks const blocks = key_blocks(tile, sequence(tile));
          Mainloop::transpose_tile(storage.tensors.mainloop, storage.barriers, max(0, blocks.max - blocks.min),
                                   transpose_idx);
        }
      }
    } else {
      cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
      int const thread_idx = int(threadIdx.x) - cutlass::NumThreadsPerWarpGroup;
      typename Mainloop::PipelineState read_k;  // consumer states start at stage 0, phase 0
      typename Mainloop::PipelineStateV read_v;
      using ElementOut = typename Config::ElementOut;
      // kOInVStage: the V stage of the tile's last GEMM1, the one before read_v's.
      auto last_v_stage = [&] { return (read_v.index() + Mainloop::kStages - 1) % Mainloop::kStages; };
      // Where O is staged.
      auto smem_o = [&] {
        if constexpr (kODirect) {
          return static_cast<ElementOut*>(nullptr);  // written from registers
        } else if constexpr (kOwnOBuffer) {
          return storage.tensors.epilogue.smem_o.data();
        } else if constexpr (kOInVStage) {
          return reinterpret_cast<ElementOut*>(Mainloop::smem_v_stage(storage.tensors.mainloop, last_v_stage()));
        } else if constexpr (kOOverV) {
          return reinterpret_cast<ElementOut*>(Mainloop::smem_v_stage(storage.tensors.mainloop, 0));
        } else if constexpr (kStageOInVt) {
          return reinterpret_cast<ElementOut*>(Mainloop::smem_vt(storage.tensors.mainloop));
        } else {
          return Mainloop::smem_q(storage.tensors.mainloop, 0);
        }
      };
      // One tile whose Q has landed.
      auto compute_tile = [&](TileCoord const& tile, SeqInfo const& seq, int iteration, auto softcapped) {
        // The thread index read again per tile: ptxas otherwise hoists per-thread offsets out of the tile
        // loop and spills them (d128 non-causal, 8 bytes).
        int const tidx = kPersistent ? opaque_thread_idx() : thread_idx;
        Band const band = Mainloop::band(params.mainloop, seq);
        KeyBlocks const blocks = key_blocks(tile, seq);
        typename Mainloop::TiledMmaPV tiled_mma_pv;
        Tensor tOrO = partition_fragment_C(tiled_mma_pv, select<0, 2>(typename Mainloop::TileShapeMNK{}));
        auto const scales = Mainloop::tile_scales(params.mainloop, tile);
        Softmax<2 * decltype(size<1>(tOrO))::value, Config::kMaxOffset, Config::kExp2OnFmaEvery, Config::kLazyRescale>
            softmax(scales.softmax_scale_log2);
        // Persistent CTAs: the next tile's Q may land once every warpgroup's last GEMM0 is complete. One CTA
        // per tile loads no further Q (and may stage O in Q's buffer).
        auto q_read = [&] {
          if constexpr (kPersistent) { Mainloop::release_q(storage.barriers, tidx, iteration); }
        };
        if (blocks.max > blocks.min) {
          Mainloop::template mma<kOInVStage>(params.mainloop, storage.tensors.mainloop, pipelines, read_k, read_v, tile,
                                              band, blocks.min, blocks.max, tidx, tOrO, softmax, scales.softcap_pre_scale,
                                              softcapped, q_read);
        } else {
          q_read();
          // kOInVStage needs a GEMM1 in every tile: non-causal tiles see a key (VarlenPrepare lists no tile of a
          // sequence without keys).
          static_assert(!kOInVStage || !kIsCausal);
          clear(tOrO);  // no key visible to any row: O = 0, and finalize gives LSE = -inf
        }
        auto scores_scale = softmax.finalize(scales.o_scale);
        softmax.rescale_o(tOrO, scores_scale);
        Epilogue::store(params.epilogue, smem_o(), tile, seq, tidx, tOrO, softmax.row_sum);
      };
      // Softcap, a call's option, costs 2-6% as a branch skipped in every step (perf-notes sections 33-34):
      // tiles up to d128 with two consumer warpgroups (16-bit, and FP8 d128) are compiled with and without
      // it. Elsewhere the registers do not allow it: three consumer warpgroups (160 registers) spilled Q's
      // descriptors in the softcap path, d256 non-causal spilled 40 bytes and d192 causal's persistent form
      // got a 608-byte stack frame.
      static constexpr bool kSoftcapCompiledApart = Config::kNumMmaWarpGroups == 2 && Config::kHeadDim <= 128;
      auto run_tile = [&](TileCoord const& tile, SeqInfo const& seq, int iteration) {
        bool const softcap = params.mainloop.scales.softcap_pre_scale > 0.f;
        if constexpr (kSoftcapCompiledApart) {
          if (softcap) {
            compute_tile(tile, seq, iteration, cute::true_type{});
          } else {
            compute_tile(tile, seq, iteration, cute::false_type{});
          }
        } else {
          compute_tile(tile, seq, iteration, softcap);
        }
      };

      // Chained tiles: each warpgroup's GEMMs run from one tile into the next. A tile's last GEMM1 is issued with
      // the next tile's first GEMM0 (its Q in the other buffer), in one ping-pong turn; the tile's O is finalized
      // and stored by the warpgroup while that GEMM0 runs; the turns run on across tiles. (16-bit: one softmax
      // scale for every tile.)
      // Forced inline: called once per softcap case, and an outlined call would serialize the wgmma pipeline and put
      // the captures in local memory.
      auto run_chained = [&](auto softcapped) __attribute__((always_inline)) {
        struct TileState {
          TileCoord tile;
          SeqInfo seq;
          Band band;
          KeyBlocks blocks;
          __device__ bool valid() const { return tile.block >= 0; }
          __device__ bool has_keys() const { return blocks.max > blocks.min; }
        };
        auto tile_state = [&](int iteration) {  // after Q's barrier, which also publishes the tile (or the end)
          Mainloop::wait_q(storage.barriers, iteration);
          TileCoord const volatile& slot = storage.tile_slots[iteration & 1];
          TileState s{{slot.block, slot.head, slot.batch}, {}, {}, {0, 0}};
          if (s.valid()) {
            s.seq = sequence(s.tile);
            s.band = Mainloop::band(params.mainloop, s.seq);
            s.blocks = key_blocks(s.tile, s.seq);
          }
          return s;
        };
        auto q_read = [&](int iteration) {
          return [&storage, thread_idx, iteration] { Mainloop::release_q(storage.barriers, thread_idx, iteration); };
        };
        float const softcap_pre_scale = params.mainloop.scales.softcap_pre_scale;
        typename Mainloop::WarpgroupMma wg(params.mainloop, storage.tensors.mainloop, pipelines, read_k, read_v, thread_idx);
        typename Mainloop::TiledMmaPV tiled_mma_pv;
        Tensor tOrO = partition_fragment_C(tiled_mma_pv, select<0, 2>(typename Mainloop::TileShapeMNK{}));
        Softmax<2 * decltype(size<1>(tOrO))::value, Config::kMaxOffset, Config::kExp2OnFmaEvery, Config::kLazyRescale>
            softmax(params.mainloop.scales.softmax_scale_log2);
        auto store_tile = [&](TileState const& s) {
          auto scores_scale = softmax.finalize();
          softmax.rescale_o(tOrO, scores_scale);
          Epilogue::store(params.epilogue, smem_o(), s.tile, s.seq, thread_idx, tOrO, softmax.row_sum);
        };

        TileState cur = tile_state(0);
        if (!cur.valid()) { return; }
        if (cur.has_keys()) {
          wg.first_block(0, cur.tile, cur.band, cur.blocks.min, cur.blocks.max, softmax, softcap_pre_scale, softcapped,
                         q_read(0));
        }
        wg.scheduler.start();
        for (int iteration = 0;; ++iteration) {
          if (cur.has_keys()) {
            wg.other_blocks(iteration % Mainloop::kStagesQ, cur.tile, cur.band, cur.blocks.min, cur.blocks.max, tOrO,
                            softmax, softcap_pre_scale, softcapped, q_read(iteration));
          }
          TileState const next = tile_state(iteration + 1);
          int const next_q_stage = (iteration + 1) % Mainloop::kStagesQ;
          bool const next_has_keys = next.valid() && next.has_keys();
          if (cur.has_keys() && next_has_keys) {
            wg.last_gemm1_with_next_gemm0(next_q_stage, tOrO);
            store_tile(cur);
            wg.next_scores(next.tile, next.band, next.blocks.min, next.blocks.max, softmax, softcap_pre_scale,
                           softcapped, q_read(iteration + 1));
          } else {
            if (cur.has_keys()) {
              wg.last_gemm1(tOrO);
            } else {
              q_read(iteration)();
              softmax.reset();
              clear(tOrO);  // no key visible to any row: O = 0, and finalize gives LSE = -inf
            }
            store_tile(cur);
            if (next_has_keys) {
              wg.first_block(next_q_stage, next.tile, next.band, next.blocks.min, next.blocks.max, softmax,
                             softcap_pre_scale, softcapped, q_read(iteration + 1));
            }
          }
          if (!next.valid()) { break; }
          cur = next;
        }
        wg.scheduler.finish();
      };

      if constexpr (kChainTiles) {
        bool const softcap = params.mainloop.scales.softcap_pre_scale > 0.f;
        if constexpr (kSoftcapCompiledApart) {
          if (softcap) {
            run_chained(cute::true_type{});
          } else {
            run_chained(cute::false_type{});
          }
        } else {
          run_chained(softcap);
        }
      } else if constexpr (kPersistent) {
        for (int iteration = 0;; ++iteration) {
          Mainloop::wait_q(storage.barriers, iteration);  // also publishes the tile (or the end)
          if (kOInVStage && iteration > 0 && thread_idx == 0) {
            // The previous tile's O stage, once its store has read it (it had the time of this Q load).
            tma_store_wait<0>();
            Mainloop::release_v_stage(pipelines, last_v_stage());
          }
          if (kOOverV && iteration > 0 && thread_idx == 0) {  // the same for O over both V stages
            tma_store_wait<0>();
            Mainloop::release_o_over_v(storage.barriers);
          }
          TileCoord const volatile& slot = storage.tile_slots[iteration & 1];
          TileCoord const tile{slot.block, slot.head, slot.batch};
          if (tile.block < 0) { break; }
          // Its sequence read by the consumers themselves (publishing it too cost the producer's 32 registers
          // 64 bytes of spills at d64): the load's latency hides behind the tile's first GEMM.
          run_tile(tile, sequence(tile), iteration);
        }
      } else {
        TileCoord const tile = scheduler.coord(scheduler.first());
        SeqInfo const seq = sequence(tile);  // loaded while Q is
        Mainloop::wait_q(storage.barriers, 0);
        run_tile(tile, seq, 0);
      }
      Epilogue::finish(thread_idx);
    }
  }
};

}  // namespace flash
