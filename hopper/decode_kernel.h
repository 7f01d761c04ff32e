// The decode kernel: attention of a few new query tokens over a KV cache (flash_attn_with_kvcache), where the
// work is reading K and V once from memory at full bandwidth, not tensor-core throughput.
//
// - GQA packing: a CTA takes one KV head and 16 query rows, the (token, query head) pairs of that KV head's
//   group, so a decode step of 32 query heads over 8 KV heads fills 4 of the 16 rows with one K/V read
//   (the attention kernels' 128-row tiles would hold one).
// - Split-KV: the keys of a (sequence, KV head) are split over gridDim.x CTAs; each writes its part's O and
//   LSE in fp32 and split_combine.h merges them. Inside a CTA, each of its 4 or 8 warps takes every 4th (8th)
//   block of 16 keys with its own cp.async pipeline (no CTA-wide barrier until the end), and the warps'
//   parts are merged through shared memory the same way.
// - Any cache layout: each 16-key block is read with 16-byte cp.async copies from the cache (contiguous,
//   cache_batch_idx, or one page of a paged cache: pages hold a multiple of 16 keys) or from the new keys.
// - Per block: S = Q K^T and O += P V with m16n8k16 MMAs (warp_mma.h), masks and softcap as the attention
//   kernels define them, and softmax.h's online softmax, whose fragment layout these MMAs share.
// - FP8 (e4m3) caches are read as stored (half the bytes) and run the fp16 MMAs: K and V widened in registers
//   after their ldmatrix (Q's columns permuted to match K's, O's columns permuted as V's come out).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include <cmath>
#include <cstdint>

#include "decode_params.h"
#include "softcap.h"
#include "softmax.h"
#include "split_combine.h"
#include "warp_mma.h"

namespace flash {

// Developer knob for A/B builds (scripts/build_variant.sh): pipeline stages per warp.
#ifndef FLASH_EXT_DECODE_STAGES
#define FLASH_EXT_DECODE_STAGES 0  // 0: by head dim, below
#endif

template <class Element_, int kHeadDim_>
struct DecodeConfig {
  using Element = Element_;  // q, the caches and the new keys, as stored
  static constexpr int kHeadDim = kHeadDim_;
  // FP8 (e4m3) caches run the fp16 MMAs (sm_90 has no FP8 mma.sync: ptxas would widen both operands at every
  // use): every e4m3 value is an fp16 value, so the widening is exact and P keeps fp16's precision. K is
  // widened in registers after its ldmatrix, with Q's columns permuted to match (load_q). V is read by
  // ldmatrix.trans as pairs of bytes, which gives a lane two keys of two adjacent columns: a byte permute
  // splits them into the B fragments of an even-column and an odd-column MMA, and O's columns are put back
  // in order when it is written (v_fragments). The output is bf16, as the FP8 forward's. The kernel is bound
  // by reading the cache, which FP8 halves.
  static constexpr bool kFp8 = std::is_same_v<Element, cutlass::float_e4m3_t>;
  using MmaElement = std::conditional_t<kFp8, cutlass::half_t, Element>;
  using OutElement = std::conditional_t<kFp8, cutlass::bfloat16_t, Element>;
  // Warps per CTA, chosen per launch (blockDim.x): 4, or 8 where one CTA per SM covers the grid and its shared
  // memory fits, which halves each warp's chain of blocks (flash_decode_launch.h; perf-notes section 25).
  static constexpr int kWarps = 4;
  static constexpr int kMaxWarps = 8;
  static constexpr int kRows = 16;    // query rows of a CTA: one MMA tile
  static constexpr int kBlockN = 16;  // keys per warp step: one page of the smallest size
  // Stages per warp: ~32 KB of K/V in flight per warp at d <= 128, so that 2 CTAs per SM keep HBM busy (FP8:
  // more, smaller stages, about as many bytes in flight).
  static constexpr int kDefaultStages = kFp8 ? (kHeadDim <= 64 ? 8 : 5) : (kHeadDim <= 64 ? 4 : 3);
  static constexpr int kStages = FLASH_EXT_DECODE_STAGES > 0 ? FLASH_EXT_DECODE_STAGES : kDefaultStages;
  // Q as MMA fragments in registers (kHeadDim / 4 of them), or above d128, where they would spill beside O's,
  // in shared memory, read by ldmatrix at every block.
  static constexpr bool kQInShared = kHeadDim > 128;
  static constexpr int kElementsPerChunk = 16 / int(sizeof(Element));  // per 16-byte copy
  static constexpr int kChunks = kHeadDim / kElementsPerChunk;         // 16-byte chunks per stored K/V row
  static constexpr int kRowBytes = kHeadDim * int(sizeof(Element));
  static constexpr int kTileBytes = kBlockN * kRowBytes;  // K or V of one step, as stored
  static constexpr int kStageBytes = 2 * kTileBytes;
  static constexpr int kKSteps = kRowBytes / 32;  // K's ldmatrix steps along the head dim, 32 stored bytes each
  // Rows of the 16-bit tile of Q when it is kept in shared memory (FP8: widened).
  static constexpr int kMmaRowBytes = kHeadDim * 2;
  static constexpr int kWarpBytes = kStages * kStageBytes;
  static constexpr int kRowsPerCopy = 32 / kChunks;  // K/V rows one warp-wide 16-byte copy covers
  static constexpr int kCopiesPerTile = kBlockN / kRowsPerCopy;
  // The warps' normalised O and LSE for the final merge, fp32, rows padded by 4 floats (fewer bank conflicts).
  static constexpr int kMergeRowFloats = kHeadDim + 4;
  static constexpr int kQBytes = kQInShared ? kRows * kMmaRowBytes : 0;  // after the warps' pipelines
  static constexpr int shared_bytes(int warps) {
    int const pipeline = warps * kWarpBytes + kQBytes, merge = warps * kRows * (kMergeRowFloats + 1) * 4;
    return pipeline > merge ? pipeline : merge;
  }
  static constexpr int kSharedBytes = shared_bytes(kWarps);
  static constexpr bool kMaxWarpsFit = shared_bytes(kMaxWarps) <= 227 * 1024;
  static_assert(std::is_same_v<Element, cutlass::bfloat16_t> || std::is_same_v<Element, cutlass::half_t> || kFp8);
  static_assert(kHeadDim % 16 == 0 && kHeadDim >= 64 && kChunks <= 32 && 32 % kChunks == 0 && kRowBytes >= 64);

  // Where 16-byte chunk `chunk` of row `row` sits in a tile that ldmatrix reads (rows of row_bytes): chunks are
  // permuted by XOR so that the 8 rows of one ldmatrix matrix, at one chunk, hit 8 different bank groups.
  // 64-byte rows (FP8 d64) pair up in 128-byte lines.
  __host__ __device__ static constexpr uint32_t swizzled(int row, int chunk, int row_bytes) {
    int const rows_per_line = row_bytes >= 128 ? 1 : 128 / row_bytes;
    return uint32_t(row * row_bytes + ((chunk ^ ((row / rows_per_line) % (8 / rows_per_line))) * 16));
  }
};

// One sequence of a decode call, its lengths clamped into the cache.
struct DecodeSequence {
  int cache_len;  // keys read from the cache
  int total;      // cache_len + seqlen_new
  int entry;      // the cache entry (contiguous caches)

  __device__ static DecodeSequence make(DecodeParams const& p, int batch) {
    int const capacity = p.seqlen_k - p.seqlen_new;  // >= 0 (checked on the host)
    int const cached = min(max(p.cache_seqlens[batch], 0), capacity);
    int entry = batch;
    if (p.cache_batch_idx != nullptr) { entry = min(max(p.cache_batch_idx[batch], 0), p.cache_entries - 1); }
    return {cached, cached + p.seqlen_new, entry};
  }
};

// Where the K and V rows of one 16-key block of a sequence live in the cache (the block lies in one page).
template <class Element>
struct CacheBlock {
  Element const* k;
  Element const* v;

  __device__ static CacheBlock make(DecodeParams const& p, DecodeSequence const& seq, int batch, int kv_head, int first_key) {
    int64_t entry = seq.entry, row = first_key;  // the cache's entry (contiguous) or page (paged), and the row in it
    if (p.page_table != nullptr) {
      // The page by a multiply-high and a shift (every paged block does this), clamped into the table.
      int const slot = min(p.page_divisor.div(first_key), p.pages_per_seq - 1);
      entry = min(max(p.page_table[batch * p.page_table_batch_stride + slot], 0), p.cache_entries - 1);
      row = first_key - slot * p.page_size;
    }
    auto const at = [&](StridedTensor const& t) {
      return static_cast<Element const*>(t.ptr) + entry * t.batch_stride + row * t.row_stride + kv_head * t.head_stride;
    };
    return {at(p.k_cache), at(p.v_cache)};
  }
};

template <class Config>
struct DecodeKernel {
  using Element = typename Config::Element;
  using MmaElement = typename Config::MmaElement;
  using Params = DecodeParams;
  static constexpr int kHeadDim = Config::kHeadDim;
  static constexpr int kNumThreads = Config::kMaxWarps * 32;  // the launch bound; blockDim.x is 128 or 256
  static constexpr int kMinBlocksPerSm = 1;
  static constexpr int kSharedStorageBytes = Config::kSharedBytes;
  static constexpr int kBlockN = Config::kBlockN;

  // Accumulators in the layout of a warp's share of a GMMA accumulator, ((2, 2, N/8), 1, 1) (utils.h).
  using ScoreFrag = decltype(cute::make_tensor<float>(cute::Shape<cute::Shape<cute::_2, cute::_2, cute::_2>, cute::_1, cute::_1>{}));
  using OutFrag = decltype(cute::make_tensor<float>(
      cute::Shape<cute::Shape<cute::_2, cute::_2, cute::Int<kHeadDim / 8>>, cute::_1, cute::_1>{}));

  // The rows of this CTA: row r of the call's (seqlen_q x group) rows is token r / group, head r % group.
  struct RowTile {
    int first_row, rows, group;
  };

  // The keys the CTA's rows may see, [lo, hi), from the band (mask.h's bottom-right-aligned window).
  __device__ static void key_range(Params const& p, RowTile const& t, DecodeSequence const& seq, int& lo, int& hi) {
    int const last_row = min(t.first_row + Config::kRows, t.rows) - 1;
    int const first_token_pos = seq.total - p.seqlen_q + t.first_row / t.group;
    int const last_token_pos = seq.total - p.seqlen_q + last_row / t.group;
    lo = p.options.window_left >= 0 ? max(first_token_pos - p.options.window_left, 0) : 0;
    hi = p.options.window_right >= 0 ? min(last_token_pos + p.options.window_right + 1, seq.total) : seq.total;
  }

  // Writes the new keys and values into the cache (one CTA per sequence and KV head; every CTA reads them from
  // k_new / v_new, so no CTA waits for this).
  __device__ static void append_new(Params const& p, DecodeSequence const& seq, int batch, int kv_head) {
    int const chunks = p.seqlen_new * Config::kChunks;
    for (int i = threadIdx.x; i < chunks; i += blockDim.x) {
      int const j = i / Config::kChunks, col = (i % Config::kChunks) * Config::kElementsPerChunk;
      if (col >= p.headdim) continue;
      int const pos = seq.cache_len + j;
      CacheBlock<Element> const at = CacheBlock<Element>::make(p, seq, batch, kv_head, pos);
      int64_t const src_k = batch * p.k_new.batch_stride + j * p.k_new.row_stride + kv_head * p.k_new.head_stride + col;
      int64_t const src_v = batch * p.v_new.batch_stride + j * p.v_new.row_stride + kv_head * p.v_new.head_stride + col;
      *reinterpret_cast<uint4*>(const_cast<Element*>(at.k) + col) =
          *reinterpret_cast<uint4 const*>(static_cast<Element const*>(p.k_new.ptr) + src_k);
      *reinterpret_cast<uint4*>(const_cast<Element*>(at.v) + col) =
          *reinterpret_cast<uint4 const*>(static_cast<Element const*>(p.v_new.ptr) + src_v);
    }
  }

  // This lane's K and V sources at key 0 of a contiguous cache's entry (row lane / kChunks of a block, its
  // column, or column 0 past the head dim, where copies read nothing), so that a block wholly in the cache costs
  // a multiply-add; nullptr for a paged cache, whose blocks each look up their page.
  struct LaneSource {
    Element const* k;
    Element const* v;

    __device__ static LaneSource make(Params const& p, DecodeSequence const& seq, int kv_head) {
      if (p.page_table != nullptr) return {nullptr, nullptr};
      int const lane = threadIdx.x % 32, chunk = lane % Config::kChunks, row = lane / Config::kChunks;
      int const col = chunk * Config::kElementsPerChunk < p.headdim ? chunk * Config::kElementsPerChunk : 0;
      auto const at = [&](StridedTensor const& t) {
        return static_cast<Element const*>(t.ptr) + seq.entry * t.batch_stride + row * t.row_stride +
               kv_head * t.head_stride + col;
      };
      return {at(p.k_cache), at(p.v_cache)};
    }
  };

  // Issues the cp.async copies of one 16-key block (K then V) into a stage: rows past the sequence and
  // columns past the head dim become zeros. Rows are swizzled for ldmatrix (Config::swizzled).
  __device__ static void load_block(Params const& p, DecodeSequence const& seq, LaneSource const& lane_source, int batch,
                                    int kv_head, int block, uint32_t stage) {
    int const lane = threadIdx.x % 32;
    int const first_key = block * kBlockN;
    int const chunk = lane % Config::kChunks;
    bool const col_valid = chunk * Config::kElementsPerChunk < p.headdim;
    // Row lane / kChunks of the block, in the cache and (for the keys past cache_len) in k_new / v_new; each
    // copy steps kRowsPerCopy rows further.
    int const row0 = lane / Config::kChunks;
    int const col = chunk * Config::kElementsPerChunk;
    int64_t const k_cached_step = Config::kRowsPerCopy * p.k_cache.row_stride, v_cached_step = Config::kRowsPerCopy * p.v_cache.row_stride;
    auto const k_offset = [&](int row) { return Config::swizzled(row, chunk, Config::kRowBytes); };
    auto const v_offset = [&](int row) { return Config::kTileBytes + k_offset(row); };
    if (first_key + kBlockN <= seq.cache_len) {  // the common block: every row in the cache, no per-row choice
      Element const* k_src = lane_source.k + first_key * p.k_cache.row_stride;
      Element const* v_src = lane_source.v + first_key * p.v_cache.row_stride;
      if (lane_source.k == nullptr) {  // a paged cache: the block's page
        CacheBlock<Element> const cached = CacheBlock<Element>::make(p, seq, batch, kv_head, first_key);
        int const lane_col = col_valid ? col : 0;
        k_src = cached.k + row0 * p.k_cache.row_stride + lane_col;
        v_src = cached.v + row0 * p.v_cache.row_stride + lane_col;
      }
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < Config::kCopiesPerTile; ++i) {
        int const row = row0 + i * Config::kRowsPerCopy;
        warp::cp_async_16(stage + k_offset(row), k_src + i * k_cached_step, col_valid);
        warp::cp_async_16(stage + v_offset(row), v_src + i * v_cached_step, col_valid);
      }
      return;
    }
    CacheBlock<Element> const cached = CacheBlock<Element>::make(p, seq, batch, kv_head, min(first_key, p.seqlen_k - 1));
    int64_t const new_row0 = int64_t(first_key + row0 - seq.cache_len);
    Element const* const k_cached = cached.k + row0 * p.k_cache.row_stride + col;
    Element const* const v_cached = cached.v + row0 * p.v_cache.row_stride + col;
    Element const* const k_new = static_cast<Element const*>(p.k_new.ptr) + batch * p.k_new.batch_stride +
                                 new_row0 * p.k_new.row_stride + kv_head * p.k_new.head_stride + col;
    Element const* const v_new = static_cast<Element const*>(p.v_new.ptr) + batch * p.v_new.batch_stride +
                                 new_row0 * p.v_new.row_stride + kv_head * p.v_new.head_stride + col;
    int64_t const k_new_step = Config::kRowsPerCopy * p.k_new.row_stride, v_new_step = Config::kRowsPerCopy * p.v_new.row_stride;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < Config::kCopiesPerTile; ++i) {
      int const row = row0 + i * Config::kRowsPerCopy;
      int const pos = first_key + row;
      bool const valid = col_valid && pos < seq.total;
      bool const in_cache = pos < seq.cache_len;
      // Invalid copies read nothing; they still get an address inside the cache.
      Element const* const k_src = !valid ? cached.k : in_cache ? k_cached + i * k_cached_step : k_new + i * k_new_step;
      Element const* const v_src = !valid ? cached.v : in_cache ? v_cached + i * v_cached_step : v_new + i * v_new_step;
      warp::cp_async_16(stage + k_offset(row), k_src, valid);
      warp::cp_async_16(stage + v_offset(row), v_src, valid);
    }
  }

  // Q's 16 rows as fp16/bf16 MMA A fragments, for each 16-column step kk: (g, 2c), (g + 8, 2c), (g, 2c + 8),
  // (g + 8, 2c + 8), two values each. FP8: widened, and with the columns of each step permuted as K's
  // fragments come out of its ldmatrix (kk * 16 + 4c, +1 where 2c, +1 would be; 4c + 2, +3 for 2c + 8, +9),
  // which leaves Q K^T unchanged. Rows past the call's rows and columns past the head dim are zeros.
  __device__ static void load_q(Params const& p, RowTile const& t, int batch, int kv_head,
                                uint32_t (&q)[kHeadDim / 16][4]) {
    int const lane = threadIdx.x % 32;
    Element const* const base = static_cast<Element const*>(p.q.ptr) + batch * p.q.batch_stride;
    Element const* rows[2];
    bool valid[2];
    CUTLASS_PRAGMA_UNROLL
    for (int h = 0; h < 2; ++h) {
      int const r = t.first_row + lane / 4 + 8 * h;
      valid[h] = r < t.rows;
      int const rr = valid[h] ? r : 0;
      rows[h] = base + (rr / t.group) * p.q.row_stride + (kv_head * t.group + rr % t.group) * p.q.head_stride;
    }
    CUTLASS_PRAGMA_UNROLL
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      CUTLASS_PRAGMA_UNROLL
      for (int h = 0; h < 2; ++h) {
        if constexpr (Config::kFp8) {
          int const col = kk * 16 + (lane % 4) * 4;
          uint2 const v = valid[h] && col < p.headdim ? warp::e4m3x4_to_half4(*reinterpret_cast<uint32_t const*>(rows[h] + col))
                                                      : make_uint2(0u, 0u);
          q[kk][h] = v.x;
          q[kk][2 + h] = v.y;
        } else {
          CUTLASS_PRAGMA_UNROLL
          for (int half = 0; half < 2; ++half) {
            int const col = kk * 16 + half * 8 + (lane % 4) * 2;
            q[kk][2 * half + h] = valid[h] && col < p.headdim ? *reinterpret_cast<uint32_t const*>(rows[h] + col) : 0u;
          }
        }
      }
    }
  }

  // Q's 16 rows into shared memory (kQInShared) as the 16-bit tile of load_q's fragments (FP8: widened, columns
  // permuted), swizzled for ldmatrix; rows past the call's rows and columns past the head dim are zeros.
  __device__ static void store_q_shared(Params const& p, RowTile const& t, int batch, int kv_head, char* q_smem) {
    Element const* const base = static_cast<Element const*>(p.q.ptr) + batch * p.q.batch_stride;
    for (int i = threadIdx.x; i < Config::kRows * Config::kChunks; i += blockDim.x) {
      int const row = i / Config::kChunks, chunk = i % Config::kChunks, r = t.first_row + row;
      int const col = chunk * Config::kElementsPerChunk;
      uint4 value = make_uint4(0u, 0u, 0u, 0u);
      if (r < t.rows && col < p.headdim) {
        value = *reinterpret_cast<uint4 const*>(base + (r / t.group) * p.q.row_stride +
                                                (kv_head * t.group + r % t.group) * p.q.head_stride + col);
      }
      if constexpr (Config::kFp8) {  // 16 columns: 4c, +1 of each 4 to the first 16-bit chunk, 4c + 2, +3 to the second
        uint2 const x = warp::e4m3x4_to_half4(value.x), y = warp::e4m3x4_to_half4(value.y);
        uint2 const z = warp::e4m3x4_to_half4(value.z), w = warp::e4m3x4_to_half4(value.w);
        *reinterpret_cast<uint4*>(q_smem + Config::swizzled(row, 2 * chunk, Config::kMmaRowBytes)) = make_uint4(x.x, y.x, z.x, w.x);
        *reinterpret_cast<uint4*>(q_smem + Config::swizzled(row, 2 * chunk + 1, Config::kMmaRowBytes)) = make_uint4(x.y, y.y, z.y, w.y);
      } else {
        *reinterpret_cast<uint4*>(q_smem + Config::swizzled(row, chunk, Config::kMmaRowBytes)) = value;
      }
    }
  }

  static __device__ void run(Params const& p, char* smem) {
    int const warp_idx = threadIdx.x / 32, lane = threadIdx.x % 32;
    int const split = blockIdx.x;
    int const kv_head = blockIdx.y % p.nheads_kv;
    int const batch = blockIdx.z;
    RowTile const tile{int(blockIdx.y / p.nheads_kv) * Config::kRows, p.seqlen_q * (p.nheads / p.nheads_kv),
                       p.nheads / p.nheads_kv};
    DecodeSequence const seq = DecodeSequence::make(p, batch);
    if (p.seqlen_new > 0 && split == 0 && tile.first_row == 0) { append_new(p, seq, batch, kv_head); }
    allow_dependent_launch();  // the split combine (split_combine.h) may start launching: it waits for this grid

    // This split's blocks of 16 keys, and this warp's share: every warps-th block.
    int const warps = blockDim.x / 32;
    int key_lo, key_hi;
    key_range(p, tile, seq, key_lo, key_hi);
    int const block_lo = key_lo / kBlockN;
    int const blocks = key_hi > key_lo ? (key_hi + kBlockN - 1) / kBlockN - block_lo : 0;
    int const per_split = (blocks + p.num_splits - 1) / p.num_splits;
    int const split_first = block_lo + min(split * per_split, blocks);
    int const split_blocks = max(min(per_split, blocks - split * per_split), 0);
    int const my_blocks = max((split_blocks - warp_idx + warps - 1) / warps, 0);
    auto my_block = [&](int i) { return split_first + warp_idx + i * warps; };

    uint32_t const pipeline = warp::smem_address(smem) + warp_idx * Config::kWarpBytes;
    auto stage_address = [&](int i) { return pipeline + (i % Config::kStages) * Config::kStageBytes; };
    LaneSource const lane_source = LaneSource::make(p, seq, kv_head);
    CUTLASS_PRAGMA_UNROLL
    for (int s = 0; s < Config::kStages - 1; ++s) {
      if (s < my_blocks) { load_block(p, seq, lane_source, batch, kv_head, my_block(s), stage_address(s)); }
      warp::cp_async_commit();
    }

    uint32_t q[Config::kQInShared ? 1 : kHeadDim / 16][4];
    char* const q_smem = smem + warps * Config::kWarpBytes;
    if constexpr (Config::kQInShared) {
      store_q_shared(p, tile, batch, kv_head, q_smem);
      __syncthreads();
    } else {
      load_q(p, tile, batch, kv_head, q);
    }
    // Lane part of Q's ldmatrix address (A operand: matrices rows 0-7 / 8-15 x columns 0-7 / 8-15).
    int const q_row = lane % 8 + ((lane / 8) % 2) * 8, q_chunk_hi = lane / 16;
    uint32_t const q_tile = warp::smem_address(q_smem);
    // Per thread: rows g and g + 8 of the tile; the keys each may see (mask.h's band, clamped to the sequence).
    int visible_lo[2], visible_hi[2];
    CUTLASS_PRAGMA_UNROLL
    for (int h = 0; h < 2; ++h) {
      int const r = tile.first_row + lane / 4 + 8 * h;
      int const pos = seq.total - p.seqlen_q + r / tile.group;
      visible_lo[h] = p.options.window_left >= 0 ? pos - p.options.window_left : 0;
      visible_hi[h] = p.options.window_right >= 0 ? min(pos + p.options.window_right, seq.total - 1) : seq.total - 1;
    }
    int const visible_lo_max = max(visible_lo[0], visible_lo[1]), visible_hi_min = min(visible_hi[0], visible_hi[1]);
    // FP8: q_descale * k_descale scale the scores (in tanh's argument with softcap), v_descale the output.
    float softmax_scale_log2 = p.softmax_scale_log2, softcap_pre_scale = p.softcap_pre_scale, v_scale = 1.f;
    if constexpr (Config::kFp8) {
      float const qk = p.q_descale.at(batch, kv_head) * p.k_descale.at(batch, kv_head);
      if (softcap_pre_scale > 0.f) {
        softcap_pre_scale *= qk;
      } else {
        softmax_scale_log2 *= qk;
      }
      v_scale = p.v_descale.at(batch, kv_head);
    }
    Softmax<2> softmax(softmax_scale_log2);
    OutFrag acc_o;
    cute::clear(acc_o);

    // Lane parts of the ldmatrix addresses: K as the B operand (rows = keys), V transposed (rows = keys too).
    int const k_row = (lane / 16) * 8 + lane % 8, k_chunk_hi = (lane / 8) % 2;
    int const v_row = ((lane / 8) % 2) * 8 + lane % 8, v_chunk_hi = lane / 16;

    // Q's fragments of 16-column step kk, from registers or shared memory.
    auto const q_fragment = [&](int kk, uint32_t (&a_frag)[4]) {
      if constexpr (Config::kQInShared) {
        warp::ldmatrix_x4(a_frag, q_tile + Config::swizzled(q_row, 2 * kk + q_chunk_hi, Config::kMmaRowBytes));
      } else {
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < 4; ++r) { a_frag[r] = q[kk][r]; }
      }
    };
    for (int i = 0; i < my_blocks; ++i) {
      if (i + Config::kStages - 1 < my_blocks) {
        load_block(p, seq, lane_source, batch, kv_head, my_block(i + Config::kStages - 1),
                   stage_address(i + Config::kStages - 1));
      }
      warp::cp_async_commit();
      warp::cp_async_wait<Config::kStages - 1>();
      __syncwarp();
      uint32_t const k_tile = stage_address(i);
      uint32_t v_tile = k_tile + Config::kTileBytes;

      ScoreFrag acc_s;
      cute::clear(acc_s);
      CUTLASS_PRAGMA_UNROLL
      for (int step = 0; step < Config::kKSteps; ++step) {
        // K's 16 keys x 32 stored bytes: per key tile (keys 0-7, 8-15), the B fragments of one 16-bit k-step, or
        // of two e4m3 ones (4 bytes at 4c and at 16 + 4c, each widened to two fp16 pairs: see load_q).
        uint32_t b[4];
        warp::ldmatrix_x4(b, k_tile + Config::swizzled(k_row, 2 * step + k_chunk_hi, Config::kRowBytes));
        if constexpr (Config::kFp8) {
          CUTLASS_PRAGMA_UNROLL
          for (int half = 0; half < 2; ++half) {
            uint32_t a_frag[4];
            q_fragment(2 * step + half, a_frag);
            uint2 const keys_lo = warp::e4m3x4_to_half4(b[half]), keys_hi = warp::e4m3x4_to_half4(b[2 + half]);
            warp::mma_16816<MmaElement>(acc_s(0), acc_s(1), acc_s(2), acc_s(3), a_frag, keys_lo.x, keys_lo.y);
            warp::mma_16816<MmaElement>(acc_s(4), acc_s(5), acc_s(6), acc_s(7), a_frag, keys_hi.x, keys_hi.y);
          }
        } else {
          uint32_t a_frag[4];
          q_fragment(step, a_frag);
          warp::mma_16816<MmaElement>(acc_s(0), acc_s(1), acc_s(2), acc_s(3), a_frag, b[0], b[1]);
          warp::mma_16816<MmaElement>(acc_s(4), acc_s(5), acc_s(6), acc_s(7), a_frag, b[2], b[3]);
        }
      }
      if (softcap_pre_scale > 0.f) { apply_softcap(acc_s, softcap_pre_scale); }
      int const first_key = my_block(i) * kBlockN;
      if (first_key < visible_lo_max || first_key + kBlockN - 1 > visible_hi_min) {  // a block at an edge
        CUTLASS_PRAGMA_UNROLL
        for (int e = 0; e < 8; ++e) {
          int const key = first_key + (e / 4) * 8 + (lane % 4) * 2 + e % 2, h = (e / 2) % 2;
          if (key < visible_lo[h] || key > visible_hi[h]) { acc_s(e) = -INFINITY; }
        }
      }
      auto const correction = softmax.template max_get_scale</*kIsFirst=*/false, /*kCheckInf=*/true>(acc_s);
      softmax.template online_softmax</*kIsFirst=*/false, /*kCheckInf=*/true>(acc_s);
      // After the first blocks a row's max rarely moves: O's rescale (kHeadDim / 2 multiplies per thread) is
      // skipped when it would multiply every row of the warp by 1.
      if (!__all_sync(0xffffffffu, correction(0) == 1.f && correction(1) == 1.f)) { softmax.rescale_o(acc_o, correction); }

      uint32_t const a[4] = {warp::pack_2<MmaElement>(acc_s(0), acc_s(1)), warp::pack_2<MmaElement>(acc_s(2), acc_s(3)),
                             warp::pack_2<MmaElement>(acc_s(4), acc_s(5)), warp::pack_2<MmaElement>(acc_s(6), acc_s(7))};
      if constexpr (Config::kFp8) {
        // 16 keys x 32 stored columns per ldmatrix: matrices (keys 0-7 | 8-15) x (columns 16j .. +15, j = 2 * step,
        // 2 * step + 1) of byte pairs, transposed: a lane holds keys 2c, 2c + 1 of columns 16j + 2g, + 1.
        // O's 8 registers of j: the MMA over the even columns 16j + 2n, then the one over the odd ones.
        CUTLASS_PRAGMA_UNROLL
        for (int step = 0; step < Config::kRowBytes / 32; ++step) {
          uint32_t b[4];
          warp::ldmatrix_x4_trans(b, v_tile + Config::swizzled(v_row, 2 * step + v_chunk_hi, Config::kRowBytes));
          CUTLASS_PRAGMA_UNROLL
          for (int half = 0; half < 2; ++half) {
            int const j = 2 * step + half;
            uint2 const keys_lo = warp::e4m3_column_pairs_to_half(b[2 * half]);
            uint2 const keys_hi = warp::e4m3_column_pairs_to_half(b[2 * half + 1]);
            warp::mma_16816<MmaElement>(acc_o(8 * j), acc_o(8 * j + 1), acc_o(8 * j + 2), acc_o(8 * j + 3), a, keys_lo.x,
                                        keys_hi.x);
            warp::mma_16816<MmaElement>(acc_o(8 * j + 4), acc_o(8 * j + 5), acc_o(8 * j + 6), acc_o(8 * j + 7), a,
                                        keys_lo.y, keys_hi.y);
          }
        }
      } else {
        CUTLASS_PRAGMA_UNROLL
        for (int nd = 0; nd < kHeadDim / 16; ++nd) {
          uint32_t b[4];
          warp::ldmatrix_x4_trans(b, v_tile + Config::swizzled(v_row, 2 * nd + v_chunk_hi, Config::kMmaRowBytes));
          warp::mma_16816<MmaElement>(acc_o(8 * nd), acc_o(8 * nd + 1), acc_o(8 * nd + 2), acc_o(8 * nd + 3), a, b[0], b[1]);
          warp::mma_16816<MmaElement>(acc_o(8 * nd + 4), acc_o(8 * nd + 5), acc_o(8 * nd + 6), acc_o(8 * nd + 7), a, b[2], b[3]);
        }
      }
      __syncwarp();  // every lane's read of this stage is done before it is rewritten
    }

    // Each warp's part, normalised, with its LSE (-inf for a warp that saw no key).
    auto const inv_sum = softmax.finalize();
    softmax.rescale_o(acc_o, inv_sum);
    warp::cp_async_wait<0>();
    __syncthreads();  // the pipeline's shared memory becomes the merge buffer
    float* const merge_o = reinterpret_cast<float*>(smem);
    float* const merge_lse = merge_o + warps * Config::kRows * Config::kMergeRowFloats;
    float* const warp_o = merge_o + warp_idx * Config::kRows * Config::kMergeRowFloats;
    if constexpr (Config::kFp8) {  // columns 16j + 4c .. + 3: even, odd, even, odd MMA column (see the PV loop)
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kHeadDim / 16; ++j) {
        CUTLASS_PRAGMA_UNROLL
        for (int h = 0; h < 2; ++h) {
          int const row = lane / 4 + 8 * h, col = j * 16 + (lane % 4) * 4;
          *reinterpret_cast<float4*>(warp_o + row * Config::kMergeRowFloats + col) =
              make_float4(acc_o(8 * j + 2 * h), acc_o(8 * j + 4 + 2 * h), acc_o(8 * j + 2 * h + 1), acc_o(8 * j + 4 + 2 * h + 1));
        }
      }
    } else {
      CUTLASS_PRAGMA_UNROLL
      for (int n = 0; n < kHeadDim / 8; ++n) {
        CUTLASS_PRAGMA_UNROLL
        for (int h = 0; h < 2; ++h) {
          int const row = lane / 4 + 8 * h, col = n * 8 + (lane % 4) * 2;
          *reinterpret_cast<float2*>(warp_o + row * Config::kMergeRowFloats + col) =
              make_float2(acc_o(4 * n + 2 * h), acc_o(4 * n + 2 * h + 1));
        }
      }
    }
    if (lane % 4 == 0) {
      merge_lse[warp_idx * Config::kRows + lane / 4] = softmax.row_sum(0);
      merge_lse[warp_idx * Config::kRows + lane / 4 + 8] = softmax.row_sum(1);
    }
    __syncthreads();

    // The warps' parts merged by their LSE (split_combine.h) and written out: the final O and LSE, or this
    // split's part for the combine kernel.
    constexpr int kQuads = kHeadDim / 4;
    for (int item = threadIdx.x; item < Config::kRows * kQuads; item += blockDim.x) {
      int const row = item / kQuads, col = (item % kQuads) * 4;
      int const r = tile.first_row + row;
      if (r >= tile.rows || col >= p.headdim) continue;
      LseMerge merge;
      for (int w = 0; w < warps; ++w) { merge.add(merge_lse[w * Config::kRows + row]); }
      float const lse = merge.lse();
      float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int w = 0; w < warps; ++w) {
        float const weight = LseMerge::weight(merge_lse[w * Config::kRows + row], lse);
        if (weight == 0.f) continue;  // a part without keys (its O is 0, never NaN, but skip the reads)
        float4 const part = *reinterpret_cast<float4 const*>(merge_o + (w * Config::kRows + row) * Config::kMergeRowFloats + col);
        o.x += weight * part.x;
        o.y += weight * part.y;
        o.z += weight * part.z;
        o.w += weight * part.w;
      }
      if constexpr (Config::kFp8) {
        o.x *= v_scale;
        o.y *= v_scale;
        o.z *= v_scale;
        o.w *= v_scale;
      }
      int const token = r / tile.group, head = kv_head * tile.group + r % tile.group;
      SplitOutput const out = SplitOutput::of(p);
      if (p.num_splits == 1) {
        out.store_final<typename Config::OutElement>(batch, token, head, col, o, lse, col == 0);
      } else {
        out.store_part(split, batch, token, head, col, o, lse, col == 0);
      }
    }
  }
};

}  // namespace flash
