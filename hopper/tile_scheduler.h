// Which output tiles (m_block, head, batch) a CTA computes, and which K/V blocks a tile needs.
//
// Tiles are numbered with m fastest, then head, then batch, so CTAs running together share a head's K/V in
// L2; causal tiles are numbered longest first (the last m block sees the most keys). The grid is 1-D and
// CTA c computes tiles c, c + gridDim.x, ...; the host picks the grid size:
//  - one CTA per tile: the hardware hands tiles to SMs as they free up, which balances uneven (causal)
//    tiles and run-to-run SM speed differences; best for long sequences;
//  - persistent, one CTA per SM: the producer loads the next tile while the consumers finish the last one,
//    which hides the fixed per-tile costs that dominate short sequences.
#pragma once

#include <cuda_runtime.h>

#include "utils.h"

namespace flash {

struct TileCoord {
  int m_block, head, batch;
};

template <int kBlockM, bool kIsCausal>
struct TileScheduler {
  int const num_m_blocks, nheads, num_tiles;

  __host__ __device__ TileScheduler(int seqlen_q, int nheads_, int batch)
      : num_m_blocks(ceil_div(seqlen_q, kBlockM)), nheads(nheads_), num_tiles(num_m_blocks * nheads_ * batch) {}

  dim3 grid(bool persistent, int num_sms) const {
    return dim3(unsigned(persistent ? min(num_tiles, num_sms) : num_tiles));
  }

  __device__ __forceinline__ int first() const { return int(blockIdx.x); }
  __device__ __forceinline__ int next(int tile) const { return tile + int(gridDim.x); }
  __device__ __forceinline__ bool valid(int tile) const { return tile < num_tiles; }

  __device__ __forceinline__ TileCoord coord(int tile) const {
    int const m = tile % num_m_blocks;
    int const head_batch = tile / num_m_blocks;
    return {kIsCausal ? num_m_blocks - 1 - m : m, head_batch % nheads, head_batch / nheads};
  }
};

// The K/V blocks [n_block_min, n_block_max) that hold keys visible to some row of an M tile.
template <int kBlockM, int kBlockN, bool kIsCausal>
struct BlockRange {
  __device__ __forceinline__ static int n_block_max(int m_block, int seqlen_q, int seqlen_k) {
    int n_max = ceil_div(seqlen_k, kBlockN);
    if constexpr (kIsCausal) {
      // The tile's last row, (m_block + 1) * kBlockM - 1, sees keys up to that row + seqlen_k - seqlen_q.
      int const last_key_end = (m_block + 1) * kBlockM + seqlen_k - seqlen_q;
      n_max = min(n_max, last_key_end > 0 ? ceil_div(last_key_end, kBlockN) : 0);
    }
    return n_max;
  }
  __device__ __forceinline__ static int n_block_min() { return 0; }
};

}  // namespace flash
