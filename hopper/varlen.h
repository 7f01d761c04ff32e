// Variable-length batches (flash.h: VarlenArgs): where each sequence's rows are, for both directions.
//
// - Sequences (device): the lengths and first rows of one batch entry. Dense calls answer from the call's
//   sizes; varlen calls read the per-sequence facts VarlenPrepare wrote (one 16-byte load).
// - The TMA view of a packed tensor (make_gmem_rows, on the host, and TmaRows on the device): the rows of
//   all sequences are addressed as (row within the sequence, ..., end row of the sequence) with the last
//   mode's stride equal to the row stride, and the base moved back by max_seqlen rows. Row r of a sequence
//   that starts at row s and has n rows then has coordinates (r + max_seqlen - n, ..., s + n) and address
//   base + (s + r) * row_stride, and the TMA unit's bounds check on the first mode (extent max_seqlen)
//   stops at the sequence's end: loads past it are zero-filled and stores clipped, as at the end of a dense
//   sequence, and no tile reaches into its neighbour. (The same device as CUTLASS example 77's variable
//   sequence lengths.)
// - VarlenPrepare, a one-CTA kernel launched before the main kernel: sanitises the per-sequence values
//   (offsets made nondecreasing and clamped into the packed tensors, lengths into the caller's maxima, so
//   that no value makes a kernel access memory out of bounds, nor two sequences share a row), and writes
//   the list of tiles the main kernel walks: longest sequences first (the tile scheduler's longest-first
//   order across a mixed batch), each sequence's blocks in the scheduler's block order, heads fastest. Tiles of empty blocks do not exist, so no CTA is spent on them. The forward lists
//   no tile of a sequence without keys: VarlenPrepare writes its rows itself (O = 0, LSE = -inf), since a
//   persistent kernel staging O in V's buffer needs a K/V block in every tile.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include <cub/block/block_scan.cuh>
#include <cute/tensor.hpp>

#include "flash.h"
#include "layouts.h"
#include "tile_scheduler.h"
#include "utils.h"

namespace flash {

using namespace cute;

// One sequence: its lengths and first rows in the packed q (and o) and k (and v). Dense: start 0.
struct alignas(16) SeqInfo {
  int seqlen_q, seqlen_k, start_q, start_k;
};

// Coordinates of a sequence's rows in a TMA tensor (seqlen, headdim, heads, batch) made by make_gmem_rows.
struct TmaRows {
  int row_shift;    // added to the row within the sequence
  int batch_coord;  // the last mode's coordinate
};

// The (rows, headdim) slice of one head of one sequence, in the TMA's coordinates.
template <class TmaTensor>
__device__ __forceinline__ auto sequence_slice(TmaTensor const& m, TmaRows const& rows, int head) {
  return domain_offset(make_coord(rows.row_shift, _0{}), m(_, _, head, rows.batch_coord));
}

struct Sequences {
  SeqInfo const* packed;  // varlen: per batch entry (VarlenPrepare's); nullptr: dense
  int seqlen_q, seqlen_k;  // dense: the lengths; varlen: the callers' maxima (the TMA tensors' row extents)
  int batch, nheads, total_q;

  // Host: from a call's parameters and, varlen, where VarlenPrepare writes the per-sequence facts.
  template <class Params>
  static Sequences make(Params const& p, SeqInfo const* packed) {
    return {p.varlen.enabled() ? packed : nullptr, p.seqlen_q, p.seqlen_k, p.batch, p.nheads, p.varlen.total_q};
  }

  __host__ __device__ __forceinline__ bool varlen() const { return packed != nullptr; }
  __device__ __forceinline__ SeqInfo at(int b) const { return varlen() ? packed[b] : SeqInfo{seqlen_q, seqlen_k, 0, 0}; }
  __device__ __forceinline__ TmaRows q_rows(SeqInfo const& s, int b) const {
    return varlen() ? TmaRows{seqlen_q - s.seqlen_q, s.start_q + s.seqlen_q} : TmaRows{0, b};
  }
  __device__ __forceinline__ TmaRows k_rows(SeqInfo const& s, int b) const {
    return varlen() ? TmaRows{seqlen_k - s.seqlen_k, s.start_k + s.seqlen_k} : TmaRows{0, b};
  }
  // Index of (b, head)'s first row in the forward's LSE: (batch, nheads, seqlen_q), or varlen (nheads, total_q).
  __device__ __forceinline__ int64_t lse_row0(SeqInfo const& s, int b, int head) const {
    return varlen() ? int64_t(head) * total_q + s.start_q : (int64_t(b) * nheads + head) * seqlen_q;
  }

  // The backward's per-row statistics and dQ accumulator come in whole blocks of kBlockM query rows: dense
  // (batch, nheads, seqlen_q rounded up); varlen (nheads, stats_rows_per_head) with sequence b's blocks
  // from row round_down(start_q + b * kBlockM, kBlockM): the extra block per sequence keeps every
  // sequence's blocks apart (each ends at most kBlockM - 1 rows past its last row).
  template <int kBlockM>
  __host__ __device__ __forceinline__ static int64_t stats_rows_per_head(bool varlen, int seqlen_q, int batch, int total_q) {
    return varlen ? (int64_t(total_q) + int64_t(batch + 1) * kBlockM + kBlockM - 1) / kBlockM * kBlockM
                  : int64_t(ceil_div(seqlen_q, kBlockM)) * kBlockM;
  }
  template <int kBlockM>
  __host__ __device__ __forceinline__ int64_t stats_rows_per_head() const {
    return stats_rows_per_head<kBlockM>(varlen(), seqlen_q, batch, total_q);
  }
  template <int kBlockM>
  __host__ __device__ __forceinline__ static int padded_start(int start_q, int b) {
    return int((int64_t(start_q) + int64_t(b) * kBlockM) / kBlockM * kBlockM);
  }
  // Row of (b, head)'s first statistic: stats_base + head * stats_head_stride.
  template <int kBlockM>
  __device__ __forceinline__ int64_t stats_base(SeqInfo const& s, int b) const {
    return varlen() ? int64_t(padded_start<kBlockM>(s.start_q, b)) : int64_t(b) * nheads * stats_rows_per_head<kBlockM>();
  }
  template <int kBlockM>
  __device__ __forceinline__ int64_t stats_head_stride() const { return stats_rows_per_head<kBlockM>(); }
  // Blocks of kBlockM rows per head of the statistics (the varlen postprocess and preprocess walk them all).
  template <int kBlockM>
  __host__ __device__ __forceinline__ int stats_blocks_per_head() const { return int(stats_rows_per_head<kBlockM>() / kBlockM); }

  // The backward's pre- and postprocess grids: a CTA per block of kBlockM query rows, dense (blocks, heads,
  // batch); varlen, every block of a head's statistics (those of no sequence return at once).
  template <int kBlockM>
  dim3 stats_grid() const {
    return dim3(unsigned(stats_blocks_per_head<kBlockM>()), unsigned(nheads), varlen() ? 1u : unsigned(batch));
  }
  // The block of such a CTA: its batch entry (< 0: the block is no sequence's), the sequence, the row of its
  // head 0's first statistic (stats_base) and its query block within the sequence.
  struct StatsBlock {
    int batch;
    SeqInfo seq;
    int64_t stats_base;
    int m_block;
  };
  // stats_block_batch: varlen, the batch entry of each block (VarlenPrepare's).
  template <int kBlockM>
  __device__ __forceinline__ StatsBlock stats_block(int const* stats_block_batch) const {
    int const b = varlen() ? stats_block_batch[blockIdx.x] : int(blockIdx.z);
    if (b < 0) { return {b, SeqInfo{0, 0, 0, 0}, 0, 0}; }
    SeqInfo const seq = at(b);
    int64_t const base = stats_base<kBlockM>(seq, b);
    return {b, seq, base, int(blockIdx.x) - (varlen() ? int(base / kBlockM) : 0)};
  }
};

// Host: the TMA's view of q, k, v, o or a gradient ((seqlen, headdim, heads, batch), layouts.h) with
// `seqlen` rows per sequence: dense, the tensor itself; varlen (total_rows >= 0), the view described at the
// top of this file, with seqlen the longest sequence.
template <class Element>
auto make_gmem_rows(StridedTensor const& t, int seqlen, int headdim, int heads, int batch, bool varlen, int total_rows) {
  using Ptr = Element*;
  if (!varlen) {
    return make_gmem_bshd(static_cast<Ptr>(t.ptr), make_shape(seqlen, headdim, heads, batch), t.row_stride, t.head_stride,
                          t.batch_stride);
  }
  // Moved back by seqlen rows: never dereferenced there (coordinates start at row_shift >= 0).
  Ptr const base = static_cast<Ptr>(t.ptr) - int64_t(seqlen) * t.row_stride;
  return make_gmem_bshd(base, make_shape(seqlen, headdim, heads, total_rows + 1), t.row_stride, t.head_stride, t.row_stride);
}

// VarlenPrepare: one CTA. Its scratch and outputs live in the caller's workspace (VarlenWorkspace).
struct VarlenPrepare {
  static constexpr int kNumThreads = 512;
  static constexpr int kMinBlocksPerSm = 1;
  static constexpr int kSharedStorageBytes = 0;
  static constexpr int kMaxSortedBatch = 4096;  // longer batches keep their order (the sort is quadratic)

  struct Params {
    VarlenArgs args;
    int batch, max_seqlen_q, max_seqlen_k;
    SeqInfo* seqs;       // (batch)
    int* offsets_q;      // (batch + 1) scratch: cu_seqlens_q made nondecreasing and clamped
    int* offsets_k;      // (batch + 1) scratch: the same for cu_seqlens_k
    int* keys;           // (batch) scratch: the sort key
    int* order;          // (batch) scratch: batch entries, longest first
    int* tile_start;     // (batch + 1) scratch: first tile of each entry of `order`
    TileCoord* tiles;    // (max_tiles)
    int* num_tiles;      // (1)
    int max_tiles;
    int block;           // rows per tile of the tiled side
    bool tile_keys;      // tiles over keys (the backward) or over queries (the forward)
    int nheads;          // heads of a tile list
    bool reverse;        // blocks last first within a sequence (TileScheduler::reverse)
    // The forward: out and lse, for the rows of sequences without keys (o.ptr nullptr: the backward).
    StridedTensor o;
    float* lse;
    int headdim;
    // The backward's pre- and postprocess: per block of the varlen statistics (Sequences::stats_base with
    // kBlockM = stats_block), the batch entry it belongs to, or -1. nullptr: not wanted.
    int* stats_block_batch;
    int stats_blocks, stats_block;
  };

  __device__ static int clamp(int x, int lo, int hi) { return min(max(x, lo), hi); }

  using OffsetScan = cub::BlockScan<int, kNumThreads>;

  // out[i] = clamp(max(in[0..i]), 0, total) for i < n: the running maximum makes decreasing offsets (which
  // the Python API rejects, but torch.compile and graph capture skip that check) describe empty sequences
  // instead of sequences that overlap earlier ones. Overlapping sequences would share blocks of the
  // backward's statistics, whose deterministic-mode semaphores two sequences would then count at once:
  // a wait that never ends. Valid offsets are unchanged. Each thread takes a run of entries; one block
  // scan gives each run the maximum of the runs before it.
  __device__ static void monotone_offsets(int const* in, int n, int total, int* out, typename OffsetScan::TempStorage& scan) {
    int const tid = int(threadIdx.x);
    int const per_thread = ceil_div(n, kNumThreads);
    int const first = tid * per_thread, last = min(first + per_thread, n);
    auto const maximum = [](int x, int y) { return max(x, y); };
    int run = INT_MIN;
    for (int i = first; i < last; ++i) { run = max(run, in[i]); }
    OffsetScan(scan).ExclusiveScan(run, run, INT_MIN, maximum);
    for (int i = first; i < last; ++i) {
      run = max(run, in[i]);
      out[i] = clamp(run, 0, total);
    }
  }

  __device__ static void run(Params const& p, char* /*smem*/) {
    int const tid = int(threadIdx.x);
    VarlenArgs const& a = p.args;
    // 0. The offsets, nondecreasing and inside the packed tensors.
    __shared__ typename OffsetScan::TempStorage scan;
    monotone_offsets(a.cu_seqlens_q, p.batch + 1, a.total_q, p.offsets_q, scan);
    __syncthreads();  // the scan's storage is used again
    monotone_offsets(a.cu_seqlens_k, p.batch + 1, a.total_k, p.offsets_k, scan);
    __syncthreads();
    // 1. Per sequence: lengths and first rows, inside the packed tensors and the maxima; the sort key is the
    // length of the side each tile walks (the tile's work).
    for (int b = tid; b < p.batch; b += kNumThreads) {
      int const start_q = p.offsets_q[b];
      int const start_k = p.offsets_k[b];
      int len_q = p.offsets_q[b + 1] - start_q;
      int len_k = p.offsets_k[b + 1] - start_k;
      if (a.seqused_q != nullptr) { len_q = clamp(a.seqused_q[b], 0, len_q); }
      if (a.seqused_k != nullptr) { len_k = clamp(a.seqused_k[b], 0, len_k); }
      len_q = min(len_q, p.max_seqlen_q);
      len_k = min(len_k, p.max_seqlen_k);
      p.seqs[b] = SeqInfo{len_q, len_k, start_q, start_k};
      p.keys[b] = p.tile_keys ? len_q : len_k;
    }
    __syncthreads();
    // 2. Longest first: entry b goes to the place of the entries with a larger key (ties by index).
    bool const sort = p.batch <= kMaxSortedBatch;
    for (int b = tid; b < p.batch; b += kNumThreads) {
      int rank = b;
      if (sort) {
        int const key = p.keys[b];
        rank = 0;
        for (int j = 0; j < p.batch; ++j) {
          int const other = p.keys[j];
          rank += (other > key || (other == key && j < b)) ? 1 : 0;
        }
      }
      p.order[rank] = b;
    }
    __syncthreads();
    // 3. First tile of each sequence in that order: an exclusive scan of its tile counts (thread 0; the
    // batch is short next to the main kernel's work).
    if (tid == 0) {
      int64_t total = 0;
      for (int j = 0; j < p.batch; ++j) {
        p.tile_start[j] = int(min<int64_t>(total, p.max_tiles));
        SeqInfo const s = p.seqs[p.order[j]];
        int const rows = p.tile_keys ? s.seqlen_k : (s.seqlen_k > 0 ? s.seqlen_q : 0);
        total += int64_t(ceil_div(rows, p.block)) * p.nheads;
      }
      p.tile_start[p.batch] = int(min<int64_t>(total, p.max_tiles));
      *p.num_tiles = p.tile_start[p.batch];
    }
    if (p.stats_block_batch != nullptr) {
      for (int i = tid; i < p.stats_blocks; i += kNumThreads) { p.stats_block_batch[i] = -1; }
    }
    __syncthreads();
    // 4. The tiles, a warp per sequence; and the statistics blocks' owners.
    int const warp = tid / 32, lane = tid % 32;
    for (int j = warp; j < p.batch; j += kNumThreads / 32) {
      int const b = p.order[j];
      int const first = p.tile_start[j], count = p.tile_start[j + 1] - first;
      int const blocks = count / p.nheads;
      for (int t = lane; t < count; t += 32) {
        int const level = t / p.nheads;
        p.tiles[first + t] = TileCoord{p.reverse ? blocks - 1 - level : level, t - level * p.nheads, b};
      }
    }
    if (p.o.ptr != nullptr) {  // the rows of sequences without keys, a warp per (sequence, head)
      for (int bh = warp; bh < p.batch * p.nheads; bh += kNumThreads / 32) {
        int const b = bh / p.nheads, head = bh - b * p.nheads;
        SeqInfo const s = p.seqs[b];
        if (s.seqlen_k > 0) { continue; }
        for (int r = 0; r < s.seqlen_q; ++r) {
          auto* row = static_cast<uint16_t*>(p.o.ptr) + int64_t(s.start_q + r) * p.o.row_stride + int64_t(head) * p.o.head_stride;
          for (int d = lane; d < p.headdim; d += 32) { row[d] = 0; }  // +0 in fp16 and bf16
          if (lane == 0) { p.lse[int64_t(head) * a.total_q + s.start_q + r] = -INFINITY; }
        }
      }
    }
    if (p.stats_block_batch != nullptr) {
      for (int b = tid; b < p.batch; b += kNumThreads) {
        SeqInfo const s = p.seqs[b];
        int const first = int((int64_t(s.start_q) + int64_t(b) * p.stats_block) / p.stats_block);
        int const end = min(first + ceil_div(s.seqlen_q, p.stats_block), p.stats_blocks);
        for (int i = first; i < end; ++i) { p.stats_block_batch[i] = b; }
      }
    }
  }
};

// The workspace VarlenPrepare writes, carved from the front of a launch's workspace.
struct VarlenWorkspace {
  static constexpr size_t kAlign = 256;
  int batch, max_tiles, stats_blocks;
  size_t seqs_at, offsets_q_at, offsets_k_at, keys_at, order_at, tile_start_at, num_tiles_at, tiles_at, stats_at, bytes;

  static size_t aligned(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

  // max_tiles: heads * (rows / block + batch) bounds the tiles of any lengths that fit in `rows` (each
  // sequence's last block may be partial). stats_blocks: blocks of the backward's statistics per head, or 0.
  VarlenWorkspace(int batch_, int64_t rows, int block, int nheads, int stats_blocks_) : batch(batch_), stats_blocks(stats_blocks_) {
    int64_t const tiles = int64_t(nheads) * (rows / block + batch_);
    max_tiles = int(tiles < (int64_t(1) << 31) ? tiles : (int64_t(1) << 31) - 1);
    size_t at = 0;
    auto take = [&](size_t n) { size_t const here = at; at += aligned(n); return here; };
    seqs_at = take(sizeof(SeqInfo) * size_t(batch_));
    offsets_q_at = take(sizeof(int) * size_t(batch_ + 1));
    offsets_k_at = take(sizeof(int) * size_t(batch_ + 1));
    keys_at = take(sizeof(int) * size_t(batch_));
    order_at = take(sizeof(int) * size_t(batch_));
    tile_start_at = take(sizeof(int) * size_t(batch_ + 1));
    num_tiles_at = take(sizeof(int));
    tiles_at = take(sizeof(TileCoord) * size_t(max_tiles));
    stats_at = take(sizeof(int) * size_t(stats_blocks_));
    bytes = at;
  }

  template <class T>
  static T* at(void* base, size_t offset) { return reinterpret_cast<T*>(static_cast<char*>(base) + offset); }
  SeqInfo* seqs(void* base) const { return at<SeqInfo>(base, seqs_at); }
  TileList tiles(void* base) const { return {at<TileCoord>(base, tiles_at), at<int>(base, num_tiles_at)}; }
  int* stats_block_batch(void* base) const { return stats_blocks > 0 ? at<int>(base, stats_at) : nullptr; }

  VarlenPrepare::Params params(VarlenArgs const& args, int max_seqlen_q, int max_seqlen_k, void* base, int block,
                               bool tile_keys, int nheads, bool reverse, StridedTensor o, float* lse, int headdim,
                               int stats_block) const {
    return {args,
            batch,
            max_seqlen_q,
            max_seqlen_k,
            seqs(base),
            at<int>(base, offsets_q_at),
            at<int>(base, offsets_k_at),
            at<int>(base, keys_at),
            at<int>(base, order_at),
            at<int>(base, tile_start_at),
            at<TileCoord>(base, tiles_at),
            at<int>(base, num_tiles_at),
            max_tiles,
            block,
            tile_keys,
            nheads,
            reverse,
            o,
            lse,
            headdim,
            stats_block_batch(base),
            stats_blocks,
            stats_block};
  }
};

}  // namespace flash
