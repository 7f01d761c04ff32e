// Which tiles (block, head, batch) a CTA computes. A tile is one block of kBlock rows of the dimension the
// kernel is parallel over: query blocks in the forward, K/V blocks in the backward.
//
// Tile order. (head, batch) pairs are taken in groups of `heads_per_group` (head fastest, so query heads
// sharing a K/V head are neighbours); within a group the block index is the slowest: every pair's first
// block, then every pair's second, ... With one pair per group this is "blocks of one head together",
// which keeps that head's K/V hot in L2. `reverse` numbers the blocks last first: the forward's causal
// query blocks grow with the block index, so the longest tiles of a whole group come first; persistent
// causal launches size the groups equally, so that a group's K/V stays in L2 (l2_heads_per_group).
//
// Launch modes (the host picks the grid size):
//  - one CTA per tile: CTA c computes tile c; the hardware hands CTAs to SMs as they free up;
//  - persistent, one CTA per SM: CTA c starts with tile c and takes its next one either statically
//    (c + gridDim.x, + 2 gridDim.x, ...: equal tiles) or dynamically from a global counter (`counter`,
//    zeroed before the launch: uneven causal tiles, taken longest first, so the SMs finish together). The
//    producer loads the next tile while the consumers finish the last one, which hides the fixed per-tile
//    costs that dominate short sequences.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include <cutlass/fast_math.h>

#include "utils.h"

namespace flash {

struct TileCoord {
  int block, head, batch;
};

// A device-side tile list (varlen.h).
struct TileList {
  TileCoord const* tiles = nullptr;  // nullptr: no list, the tiles are numbered as above
  int const* count = nullptr;
};

template <int kBlock>
struct TileScheduler {
  int const num_blocks, nheads, num_head_batch, num_tiles;
  bool const reverse;
  int const heads_per_group;  // (head, batch) pairs per group; 1 = one head's blocks together
  int* const counter;         // persistent launches with a dynamic tile order; nullptr = static
  TileList const list;        // varlen: the tiles, of which num_tiles is a bound

  // Divisors made on the host (a multiply-high and a shift on the device): a CTA's first loads wait for its
  // tile's coordinates, and three signed divisions took a few hundred cycles there (perf-notes section 38).
  cutlass::FastDivmod const tiles_per_group_div, group_div, last_group_div, nheads_div;
  __host__ __device__ static constexpr int positive(int n) { return n > 0 ? n : 1; }  // empty launches

  __host__ __device__ TileScheduler(int seqlen, int nheads_, int batch, bool reverse_, int heads_per_group_ = 1,
                                    int* counter_ = nullptr)
      : num_blocks(ceil_div(seqlen, kBlock)),
        nheads(nheads_),
        num_head_batch(nheads_ * batch),
        num_tiles(num_blocks * nheads_ * batch),
        reverse(reverse_),
        heads_per_group(heads_per_group_),
        counter(counter_),
        list(),
        tiles_per_group_div(positive(heads_per_group_ * num_blocks)),
        group_div(positive(heads_per_group_)),
        last_group_div(positive(num_head_batch - (ceil_div(num_head_batch, positive(heads_per_group_)) - 1) * heads_per_group_)),
        nheads_div(positive(nheads_)) {}
  // Varlen: the tiles of `list`, at most max_tiles.
  __host__ __device__ TileScheduler(TileList list_, int max_tiles, int* counter_ = nullptr)
      : num_blocks(0), nheads(1), num_head_batch(1), num_tiles(max_tiles), reverse(false), heads_per_group(1),
        counter(counter_), list(list_), tiles_per_group_div(1), group_div(1), last_group_div(1), nheads_div(1) {}

  dim3 grid(bool persistent, int num_sms) const {
    return dim3(unsigned(persistent ? std::min(num_tiles, num_sms) : num_tiles));
  }

  // (head, batch) pairs per group: groups whose K and V (kv_bytes_per_head each pair's K/V head) fit in
  // 32 MB of L2 (the H100/H200 have 50 MB), made equal in size. Each group starts with its longest tiles, so
  // a small last group puts long tiles at the end of the launch: with 24 MB and the remainder left to the
  // last group, d256 causal 1k-2k ran 5-7% slower (perf-notes section 39). Sizes stay multiples of the
  // query heads that share a K/V head.
  static int l2_heads_per_group(int64_t kv_bytes_per_head, int qheads_per_kvhead, int num_head_batch) {
    constexpr int64_t kL2Budget = int64_t(32) << 20;
    int64_t const kv_heads = std::max<int64_t>(1, kL2Budget / std::max<int64_t>(1, kv_bytes_per_head));
    int const most = int(std::min<int64_t>(kv_heads * qheads_per_kvhead, num_head_batch));
    int const groups = ceil_div(num_head_batch, most);
    int const equal = ceil_div(ceil_div(num_head_batch, groups), qheads_per_kvhead) * qheads_per_kvhead;
    return std::min(equal, num_head_batch);
  }

  __device__ __forceinline__ int first() const { return int(blockIdx.x); }
  __device__ __forceinline__ bool valid(int tile) const {
    return list.tiles != nullptr ? tile < *list.count : tile < num_tiles;
  }
  // The tile after `tile` for this CTA (persistent launches). The dynamic draw is an atomic: issue it early
  // and read its result late. Each CTA stops drawing at its first invalid tile, so a launch draws exactly
  // num_tiles times.
  __device__ __forceinline__ int next(int tile) const {
    return counter != nullptr ? int(gridDim.x) + atomicAdd(counter, 1) : tile + int(gridDim.x);
  }

  __device__ __forceinline__ TileCoord coord(int tile) const {
    if (list.tiles != nullptr) { return list.tiles[tile]; }
    int group, in_group, level, in_level, batch, head;
    tiles_per_group_div(group, in_group, tile);
    int const group_start = group * heads_per_group;
    // Only the last group may be smaller.
    (heads_per_group < num_head_batch - group_start ? group_div : last_group_div)(level, in_level, in_group);
    nheads_div(batch, head, group_start + in_level);
    return {reverse ? num_blocks - 1 - level : level, head, batch};
  }
};

}  // namespace flash
