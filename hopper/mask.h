// Which (query, key) pairs attention sees, for both directions. Query i sees key j when j < seqlen_k and,
// in banded kernels (the causal ones), j lies in i's band around the diagonal aligned to the bottom-right
// corner (offset = seqlen_k - seqlen_q):
//   i + offset - left <= j <= i + offset + right.
// Causal attention is the band (unbounded, 0); a sliding window (FlashAttention's window_size) any other.
// The band's sizes are run-time values, so one causal kernel computes every window.
//
// BlockRange answers it per block: the forward asks which K/V blocks a query block needs, the backward
// which query blocks a K/V block contributes to, and both which blocks straddle an edge of the band.
// Mask answers it per score of a GMMA accumulator tile; the mainloops apply it only where BlockRange says.
#pragma once

#include <cute/tensor.hpp>

#include "utils.h"

namespace flash {

using namespace cute;

// An unbounded side of the band: past every key of any sequence (the host keeps seqlen_q + seqlen_k below
// it, csrc/arg_checks.cpp), and small enough that the band arithmetic below stays within int.
constexpr int kUnboundedWindow = 1 << 29;

struct Band {
  int seqlen_q, seqlen_k;
  int left, right;  // the window's sizes; an unbounded side holds kUnboundedWindow

  // A window side as the kernels hold it: -1 (unbounded, the host's normalised window: flash.h) becomes
  // kUnboundedWindow. Done on the host, so that the sides stay kernel parameters rather than registers.
  __host__ __device__ static int side(int window) { return window < 0 ? kUnboundedWindow : window; }
  __host__ __device__ static Band make(int seqlen_q, int seqlen_k, int window_left, int window_right) {
    return {seqlen_q, seqlen_k, side(window_left), side(window_right)};
  }
  __host__ __device__ __forceinline__ int offset() const { return seqlen_k - seqlen_q; }
};

template <int kBlockM, int kBlockN, bool kBanded>
struct BlockRange {
  Band const band;

  // Forward: query block m_block needs the K/V blocks [n_block_min, n_block_max).
  __device__ __forceinline__ int n_block_max(int m_block) const {
    int n_max = ceil_div(band.seqlen_k, kBlockN);
    if constexpr (kBanded) {
      // The block's last row, (m_block + 1) * kBlockM - 1, sees keys up to that row + offset + right.
      int const last_key_end = (m_block + 1) * kBlockM + band.offset() + band.right;
      n_max = min(n_max, last_key_end > 0 ? ceil_div(last_key_end, kBlockN) : 0);
    }
    return n_max;
  }
  __device__ __forceinline__ int n_block_min(int m_block) const {
    // The block's first row sees keys from m_block * kBlockM + offset - left on.
    return kBanded ? max(0, floor_div(m_block * kBlockM + band.offset() - band.left, kBlockN)) : 0;
  }
  // Forward, banded: the K/V blocks from this one on hold a key right of some row's band: block n with
  // (n + 1) * kBlockN - 1 > m_block * kBlockM + offset + right.
  __device__ __forceinline__ int n_block_right_masked(int m_block) const {
    return floor_div(m_block * kBlockM + band.offset() + band.right + 1, kBlockN);
  }
  // Forward, banded: the K/V blocks below this one hold a key left of some row's band: block n with
  // n * kBlockN < (m_block + 1) * kBlockM - 1 + offset - left.
  __device__ __forceinline__ int n_block_left_unmasked(int m_block) const {
    return ceil_div(max(0, (m_block + 1) * kBlockM - 1 + band.offset() - band.left), kBlockN);
  }
  // Forward: step(n, masked) for the K/V blocks n = n_block down to n_block_min, masked a cute::true_type
  // where the block holds a key outside some row's band. Banded: the blocks crossing the band's right edge,
  // those inside it, then those crossing its left edge, as two passes over one masked and one unmasked loop,
  // so that the caller's step is compiled once of each kind. Not banded: every block down to 0, unmasked.
  template <class Step>
  __device__ __forceinline__ void for_each_block_down(int n_block, int n_block_min, int m_block, Step&& step) const {
    if constexpr (kBanded) {
      int masked_end = max(n_block_min, n_block_right_masked(m_block));
      int const unmasked_end = max(n_block_min, n_block_left_unmasked(m_block));
#pragma unroll 1
      for (int pass = 0; pass < 2; ++pass) {
        for (; n_block >= masked_end; --n_block) { step(n_block, cute::true_type{}); }
        for (; n_block >= unmasked_end; --n_block) { step(n_block, cute::false_type{}); }
        masked_end = n_block_min;
      }
    } else {
      for (; n_block >= 0; --n_block) { step(n_block, cute::false_type{}); }
    }
  }

  // Backward: K/V block n_block contributes to the query blocks [m_block_min, m_block_max).
  __device__ __forceinline__ int m_block_min(int n_block) const {
    // The first query that sees key n_block * kBlockN is that key - offset - right.
    return kBanded ? max(0, floor_div(n_block * kBlockN - band.offset() - band.right, kBlockM)) : 0;
  }
  __device__ __forceinline__ int m_block_max(int n_block) const {
    int const m_max = ceil_div(band.seqlen_q, kBlockM);
    if constexpr (!kBanded) {
      return m_max;
    } else {
      // The last query that sees key (n_block + 1) * kBlockN - 1 is that key - offset + left.
      return min(m_max, max(0, floor_div((n_block + 1) * kBlockN - 1 - band.offset() + band.left, kBlockM) + 1));
    }
  }
  // Backward, banded: from this query block on, no query has a key of n_block right of its band: the
  // block's first query m * kBlockM sees the block's last key (n_block + 1) * kBlockN - 1.
  __device__ __forceinline__ int m_block_right_unmasked(int n_block) const {
    return max(0, ceil_div((n_block + 1) * kBlockN - 1 - band.offset() - band.right, kBlockM));
  }
  // Backward, banded: from this query block on, some query has key n_block * kBlockN left of its band:
  // (m + 1) * kBlockM - 1 + offset - left > n_block * kBlockN.
  __device__ __forceinline__ int m_block_left_masked(int n_block) const {
    return floor_div(n_block * kBlockN - band.offset() + band.left + 1, kBlockM);
  }
};

// Masks a score tile S held in GMMA accumulators: rows are queries and columns keys (kKeysInRows = false,
// S = Q K^T), or the transpose (kKeysInRows = true, S^T = K Q^T in the backward). Masked scores become -inf
// (or the fill a caller gives).
template <int kBlockM, int kBlockN, bool kBanded, class TiledMma, bool kKeysInRows = false>
struct Mask {
  int const thread_idx;  // index within the consumer warpgroups
  Band const band;

  __device__ __forceinline__ Mask(int thread_idx_, Band const& band_) : thread_idx(thread_idx_), band(band_) {}

  // kSeqlenKMask: keys >= seqlen_k (only the last K/V block has them). kBandMask: keys outside the band.
  // Masked scores become `fill`: -inf before the exponential, or 0 when applied to probabilities.
  template <bool kSeqlenKMask, bool kBandMask, class Engine, class Layout>
  __device__ __forceinline__ void apply(Tensor<Engine, Layout>& acc_s, int m_block, int n_block, float fill = -INFINITY) const {
    static_assert(!kBandMask || kBanded);
    if constexpr (!kSeqlenKMask && !kBandMask) { return; }
    using TileRowsCols = std::conditional_t<kKeysInRows, Shape<Int<kBlockN>, Int<kBlockM>>, Shape<Int<kBlockM>, Int<kBlockN>>>;
    TiledMma tiled_mma;
    auto thread_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor coords = thread_mma.partition_C(make_identity_tensor(TileRowsCols{}));
    Tensor coords_rc = make_tensor(coords.data(), acc_layout_rowcol(coords.layout()));
    Tensor scores = make_rowcol_view(acc_s);
    // Key limits relative to this block's first key, and the diagonal: key_local = query_local + diagonal_offset.
    int const seqlen_k_limit = band.seqlen_k - n_block * kBlockN;
    int const diagonal_offset = m_block * kBlockM + band.offset() - n_block * kBlockN;
    if constexpr (!kKeysInRows) {
      // Row = query: it sees the keys [col_min, col_limit).
      CUTLASS_PRAGMA_UNROLL
      for (int mi = 0; mi < size<0>(scores); ++mi) {
        int const query_local = int(get<0>(coords_rc(mi, 0)));
        int col_limit = kSeqlenKMask ? seqlen_k_limit : kBlockN;
        int col_min = 0;
        if constexpr (kBandMask) {
          col_limit = min(col_limit, query_local + diagonal_offset + band.right + 1);
          col_min = query_local + diagonal_offset - band.left;
        }
        // One unsigned compare per score: col in [col_min, col_limit).
        uint32_t const width = uint32_t(max(col_limit - col_min, 0));
        CUTLASS_PRAGMA_UNROLL
        for (int ni = 0; ni < size<1>(scores); ++ni) {
          int const col = int(get<1>(coords_rc(mi, ni)));
          if (uint32_t(col - col_min) >= width) { scores(mi, ni) = fill; }
        }
      }
    } else {
      // Row = key: the queries [col_min, col_end) see it; none does past seqlen_k.
      CUTLASS_PRAGMA_UNROLL
      for (int mi = 0; mi < size<0>(scores); ++mi) {
        int const key_local = int(get<0>(coords_rc(mi, 0)));
        int col_min = kBandMask ? key_local - diagonal_offset - band.right : 0;
        int const col_end = kBandMask ? key_local - diagonal_offset + band.left + 1 : kBlockM;
        if constexpr (kSeqlenKMask) { col_min = key_local >= seqlen_k_limit ? kBlockM : col_min; }
        CUTLASS_PRAGMA_UNROLL
        for (int ni = 0; ni < size<1>(scores); ++ni) {
          int const col = int(get<1>(coords_rc(mi, ni)));
          if (col < col_min || (kBandMask && col >= col_end)) { scores(mi, ni) = fill; }
        }
      }
    }
  }
};

}  // namespace flash
