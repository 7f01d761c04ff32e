// Masking of the score tile S (kBlockM x kBlockN) for one K/V block: keys past seqlen_k, and for causal
// attention keys after the query's diagonal, aligned to the bottom-right corner (query i sees keys
// j <= i + seqlen_k - seqlen_q). Applied only on the blocks that need it; the mainloop knows which.
#pragma once

#include <cute/tensor.hpp>

#include "utils.h"

namespace flash {

using namespace cute;

template <int kBlockM, int kBlockN, bool kIsCausal, class TiledMma>
struct Mask {
  int const thread_idx;  // index within the consumer warpgroups
  int const seqlen_q, seqlen_k;

  __device__ __forceinline__ Mask(int thread_idx_, int seqlen_q_, int seqlen_k_)
      : thread_idx(thread_idx_), seqlen_q(seqlen_q_), seqlen_k(seqlen_k_) {}

  // The first K/V block this M tile must mask causally: every block n with
  // (n + 1) * kBlockN - 1 > m_block * kBlockM + seqlen_k - seqlen_q holds a key some row may not see.
  __device__ __forceinline__ int first_causal_masked_block(int m_block) const {
    return floor_div(m_block * kBlockM + seqlen_k - seqlen_q + 1, kBlockN);
  }

  // Sets masked scores of acc_s (this thread's GMMA accumulator) to -inf.
  template <bool kSeqlenKMask, bool kCausalMask, class Engine, class Layout>
  __device__ __forceinline__ void apply(Tensor<Engine, Layout>& acc_s, int m_block, int n_block) const {
    static_assert(!kCausalMask || kIsCausal);
    if constexpr (!kSeqlenKMask && !kCausalMask) { return; }
    TiledMma tiled_mma;
    auto thread_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor coords = thread_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
    Tensor coords_rc = make_tensor(coords.data(), acc_layout_rowcol(coords.layout()));
    Tensor scores = make_rowcol_view(acc_s);
    // Column limits relative to this block's first key.
    int const seqlen_k_limit = seqlen_k - n_block * kBlockN;
    int const diagonal_offset = m_block * kBlockM + seqlen_k - seqlen_q - n_block * kBlockN + 1;
    CUTLASS_PRAGMA_UNROLL
    for (int mi = 0; mi < size<0>(scores); ++mi) {
      int col_limit = kSeqlenKMask ? seqlen_k_limit : kBlockN;
      if constexpr (kCausalMask) { col_limit = min(col_limit, int(get<0>(coords_rc(mi, 0))) + diagonal_offset); }
      CUTLASS_PRAGMA_UNROLL
      for (int ni = 0; ni < size<1>(scores); ++ni) {
        if (int(get<1>(coords_rc(mi, ni))) >= col_limit) { scores(mi, ni) = -INFINITY; }
      }
    }
  }
};

}  // namespace flash
