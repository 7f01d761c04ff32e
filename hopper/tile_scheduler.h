// Which tiles (block, head, batch) a CTA computes. A tile is one block of kBlock rows of the dimension the
// kernel is parallel over: query blocks in the forward, K/V blocks in the backward.
//
// Tiles are numbered with the block fastest, then head, then batch, so CTAs running together share a
// head's data in L2; `reverse` numbers the blocks last first (the forward's causal query blocks grow with
// the block index, so it starts the longest first). The grid is 1-D and CTA c computes tiles c,
// c + gridDim.x, ...; the host picks the grid size:
//  - one CTA per tile: the hardware hands tiles to SMs as they free up, which balances uneven (causal)
//    tiles and run-to-run SM speed differences; best for long sequences;
//  - persistent, one CTA per SM: the producer loads the next tile while the consumers finish the last one,
//    which hides the fixed per-tile costs that dominate short sequences.
#pragma once

#include <cuda_runtime.h>

#include "utils.h"

namespace flash {

struct TileCoord {
  int block, head, batch;
};

template <int kBlock>
struct TileScheduler {
  int const num_blocks, nheads, num_tiles;
  bool const reverse;

  __host__ __device__ TileScheduler(int seqlen, int nheads_, int batch, bool reverse_)
      : num_blocks(ceil_div(seqlen, kBlock)), nheads(nheads_), num_tiles(num_blocks * nheads_ * batch), reverse(reverse_) {}

  dim3 grid(bool persistent, int num_sms) const {
    return dim3(unsigned(persistent ? min(num_tiles, num_sms) : num_tiles));
  }

  __device__ __forceinline__ int first() const { return int(blockIdx.x); }
  __device__ __forceinline__ int next(int tile) const { return tile + int(gridDim.x); }
  __device__ __forceinline__ bool valid(int tile) const { return tile < num_tiles; }

  __device__ __forceinline__ TileCoord coord(int tile) const {
    int const block = tile % num_blocks;
    int const head_batch = tile / num_blocks;
    return {reverse ? num_blocks - 1 - block : block, head_batch % nheads, head_batch / nheads};
  }
};

}  // namespace flash
