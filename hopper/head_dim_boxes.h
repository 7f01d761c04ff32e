// The head-dim boxes of the backward's TMA copies: which boxes of a tile a call loads and stores.
#pragma once

#include <cute/tensor.hpp>

#include "layouts.h"

namespace flash {

using namespace cute;

// The head-dim boxes of the backward's TMA copies (q, k, v, dO in; dK, dV out): one swizzle atom wide.
// The d256 backward kernel also runs head dims 136..192 (there is no d192 backward kernel), whose last box
// lies wholly past the head dim. Such a box is neither loaded nor stored, and its shared memory is zeroed
// once instead (BwdLoads::zero_unloaded_boxes), so the GEMMs add zeros there: a TMA load of a box wholly
// out of bounds in the head dim, from the packed (varlen) view of a tensor, faulted on the H200 with an
// illegal address, depending on where the tensor lay (perf-notes section 24). Kernels up to d128 serve
// head dims that reach their last box, and keep whole-tile copies.
template <class Element, int kHeadDim>
struct HeadDimBoxes {
  static constexpr int kCols = k_major_swizzle_bytes<Element, kHeadDim>() / int(sizeof(Element));
  static constexpr int kCount = kHeadDim / kCols;
  static constexpr bool kMaySkip = kHeadDim > 128;
  // Boxes that hold part of a `headdim`-wide head.
  CUTE_HOST_DEVICE static constexpr int used(int headdim) {
    return kMaySkip ? (headdim + kCols - 1) / kCols : kCount;
  }
};

// A TMA copy of a tile that tma_partition split into ((TMA, box)) (boxes along the head dim), leaving out
// the boxes wholly past the head dim where Boxes::kMaySkip (head_boxes = Boxes::used(headdim)).
template <class Boxes, class TmaCopy, class Src, class Dst>
CUTE_DEVICE void copy_head_boxes(int head_boxes, TmaCopy const& tma, Src const& src, Dst dst) {  // dst: a view
  if constexpr (Boxes::kMaySkip) {
    static_assert(decltype(rank(src))::value == 1 && decltype(size<0, 1>(src))::value == Boxes::kCount,
                  "((TMA, box)): one TMA box per head-dim box");
    CUTE_UNROLL
    for (int j = 0; j < Boxes::kCount; ++j) {
      if (j < head_boxes) { copy(tma, src(make_coord(make_coord(_, j))), dst(make_coord(make_coord(_, j)))); }
    }
  } else {
    copy(tma, src, dst);
  }
}

}  // namespace flash
