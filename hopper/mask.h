// Which (query, key) pairs attention sees, for both directions: a query i sees key j when j < seqlen_k
// and, for causal attention, j <= i + seqlen_k - seqlen_q (aligned to the bottom-right corner).
//
// BlockRange answers it per block: the forward asks which K/V blocks a query block needs, the backward
// which query blocks a K/V block contributes to, and both which blocks straddle the causal diagonal.
// Mask answers it per score of a GMMA accumulator tile; the mainloops apply it only where BlockRange says.
#pragma once

#include <cute/tensor.hpp>

#include "utils.h"

namespace flash {

using namespace cute;

template <int kBlockM, int kBlockN, bool kIsCausal>
struct BlockRange {
  // Forward: query block m_block needs the K/V blocks [0, n_block_max).
  __device__ __forceinline__ static int n_block_max(int m_block, int seqlen_q, int seqlen_k) {
    int n_max = ceil_div(seqlen_k, kBlockN);
    if constexpr (kIsCausal) {
      // The block's last row, (m_block + 1) * kBlockM - 1, sees keys up to that row + seqlen_k - seqlen_q.
      int const last_key_end = (m_block + 1) * kBlockM + seqlen_k - seqlen_q;
      n_max = min(n_max, last_key_end > 0 ? ceil_div(last_key_end, kBlockN) : 0);
    }
    return n_max;
  }
  // Forward, causal: the K/V blocks from this one on hold a key that some row of m_block may not see:
  // block n with (n + 1) * kBlockN - 1 > m_block * kBlockM + seqlen_k - seqlen_q.
  __device__ __forceinline__ static int n_block_causal_min(int m_block, int seqlen_q, int seqlen_k) {
    return floor_div(m_block * kBlockM + seqlen_k - seqlen_q + 1, kBlockN);
  }

  // Backward: K/V block n_block contributes to the query blocks [m_block_min, m_block_max).
  __device__ __forceinline__ static int m_block_max(int seqlen_q) { return ceil_div(seqlen_q, kBlockM); }
  __device__ __forceinline__ static int m_block_min(int n_block, int seqlen_q, int seqlen_k) {
    if constexpr (!kIsCausal) {
      return 0;
    } else {
      // The first query that sees key n_block * kBlockN is n_block * kBlockN - (seqlen_k - seqlen_q).
      return max(0, floor_div(n_block * kBlockN - seqlen_k + seqlen_q, kBlockM));
    }
  }
  // Backward, causal: from this query block on, every query sees every key of n_block (no causal mask):
  // the block's first query m * kBlockM sees the block's last key (n_block + 1) * kBlockN - 1.
  __device__ __forceinline__ static int m_block_causal_end(int n_block, int seqlen_q, int seqlen_k) {
    return max(0, ceil_div((n_block + 1) * kBlockN - 1 - seqlen_k + seqlen_q, kBlockM));
  }
};

// Masks a score tile S held in GMMA accumulators: rows are queries and columns keys (kKeysInRows = false,
// S = Q K^T), or the transpose (kKeysInRows = true, S^T = K Q^T in the backward). Masked scores become -inf
// (or the fill a caller gives).
template <int kBlockM, int kBlockN, bool kIsCausal, class TiledMma, bool kKeysInRows = false>
struct Mask {
  int const thread_idx;  // index within the consumer warpgroups
  int const seqlen_q, seqlen_k;

  __device__ __forceinline__ Mask(int thread_idx_, int seqlen_q_, int seqlen_k_)
      : thread_idx(thread_idx_), seqlen_q(seqlen_q_), seqlen_k(seqlen_k_) {}

  // kSeqlenKMask: keys >= seqlen_k (only the last K/V block has them). kCausalMask: keys past the diagonal.
  // Masked scores become `fill`: -inf before the exponential, or 0 when applied to probabilities.
  template <bool kSeqlenKMask, bool kCausalMask, class Engine, class Layout>
  __device__ __forceinline__ void apply(Tensor<Engine, Layout>& acc_s, int m_block, int n_block, float fill = -INFINITY) const {
    static_assert(!kCausalMask || kIsCausal);
    if constexpr (!kSeqlenKMask && !kCausalMask) { return; }
    using TileRowsCols = std::conditional_t<kKeysInRows, Shape<Int<kBlockN>, Int<kBlockM>>, Shape<Int<kBlockM>, Int<kBlockN>>>;
    TiledMma tiled_mma;
    auto thread_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor coords = thread_mma.partition_C(make_identity_tensor(TileRowsCols{}));
    Tensor coords_rc = make_tensor(coords.data(), acc_layout_rowcol(coords.layout()));
    Tensor scores = make_rowcol_view(acc_s);
    // Key limits relative to this block's first key, and the causal diagonal: key_local <= query_local + offset.
    int const seqlen_k_limit = seqlen_k - n_block * kBlockN;
    int const diagonal_offset = m_block * kBlockM + seqlen_k - seqlen_q - n_block * kBlockN;
    if constexpr (!kKeysInRows) {
      CUTLASS_PRAGMA_UNROLL
      for (int mi = 0; mi < size<0>(scores); ++mi) {
        int col_limit = kSeqlenKMask ? seqlen_k_limit : kBlockN;
        if constexpr (kCausalMask) { col_limit = min(col_limit, int(get<0>(coords_rc(mi, 0))) + diagonal_offset + 1); }
        CUTLASS_PRAGMA_UNROLL
        for (int ni = 0; ni < size<1>(scores); ++ni) {
          if (int(get<1>(coords_rc(mi, ni))) >= col_limit) { scores(mi, ni) = fill; }
        }
      }
    } else {
      // Row = key: the whole row is masked past seqlen_k; causally, queries with
      // query_local < key_local - diagonal_offset do not see it.
      CUTLASS_PRAGMA_UNROLL
      for (int mi = 0; mi < size<0>(scores); ++mi) {
        int const key_local = int(get<0>(coords_rc(mi, 0)));
        int col_min = kCausalMask ? key_local - diagonal_offset : 0;
        if constexpr (kSeqlenKMask) { col_min = key_local >= seqlen_k_limit ? kBlockM : col_min; }
        CUTLASS_PRAGMA_UNROLL
        for (int ni = 0; ni < size<1>(scores); ++ni) {
          if (int(get<1>(coords_rc(mi, ni))) < col_min) { scores(mi, ni) = fill; }
        }
      }
    }
  }
};

}  // namespace flash
