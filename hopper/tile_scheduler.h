// Which output tile (m_block, head, batch) a CTA computes, and which K/V blocks that tile needs.
//
// One CTA per tile (no persistence yet). The grid is (m blocks, heads, batch) with m fastest, so CTAs
// running together share a head's K/V in L2. Causal tiles differ in cost, so they are issued longest
// first (the last m block sees the most keys).
#pragma once

#include <cuda_runtime.h>

#include "utils.h"

namespace flash {

struct TileCoord {
  int m_block, head, batch;
};

template <int kBlockM, bool kIsCausal>
struct StaticTileScheduler {
  static dim3 grid(int seqlen_q, int nheads, int batch) {
    return dim3(unsigned(ceil_div(seqlen_q, kBlockM)), unsigned(nheads), unsigned(batch));
  }

  __device__ __forceinline__ static TileCoord tile() {
    int const m_block = kIsCausal ? int(gridDim.x - 1 - blockIdx.x) : int(blockIdx.x);
    return {m_block, int(blockIdx.y), int(blockIdx.z)};
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
