// Layout helpers shared by the collectives: swizzled shared-memory layouts for GMMA/TMA tiles, their
// transposed views, and the global tensors as the TMA units see them.
#pragma once

#include <cute/tensor.hpp>

namespace flash {

using namespace cute;

// Bytes of the contiguous dim one swizzle atom spans for a K-major tile of kExtent elements: the widest
// swizzle (128, 64 or 32 bytes) that divides it, else 16 (no swizzle). An atom is 8 rows of that.
template <class Element, int kExtent>
CUTE_HOST_DEVICE constexpr int k_major_swizzle_bytes() {
  constexpr int kBytes = kExtent * int(sizeof(Element));
  return kBytes % 128 == 0 ? 128 : kBytes % 64 == 0 ? 64 : kBytes % 32 == 0 ? 32 : 16;
}

// K-major shared-memory atom for a tile whose contiguous extent is kExtent elements (see above).
template <class Element, int kExtent>
CUTE_HOST_DEVICE constexpr auto smem_layout_atom_k_major() {
  constexpr int kBytes = kExtent * int(sizeof(Element));
  if constexpr (kBytes % 128 == 0) {
    return GMMA::Layout_K_SW128_Atom<Element>{};
  } else if constexpr (kBytes % 64 == 0) {
    return GMMA::Layout_K_SW64_Atom<Element>{};
  } else if constexpr (kBytes % 32 == 0) {
    return GMMA::Layout_K_SW32_Atom<Element>{};
  } else {
    static_assert(kBytes % 16 == 0, "the contiguous extent must be a multiple of 16 bytes");
    return GMMA::Layout_K_INTER_Atom<Element>{};  // unswizzled: 8 x 16-byte rows
  }
}

// A (rows, cols[, stages]) tile with cols contiguous, tiled by the atom above.
template <class Element, class TileShape>
CUTE_HOST_DEVICE constexpr auto smem_layout_k_major(TileShape const& shape) {
  constexpr int kCols = decltype(size<1>(shape))::value;
  return tile_to_shape(smem_layout_atom_k_major<Element, kCols>(), shape);
}

// The same bytes as a (rows, cols, stages) layout, viewed as (cols, rows, stages): e.g. V stored with the
// head dim contiguous read as V^T, an MN-major GMMA operand.
template <class Layout>
CUTE_HOST_DEVICE constexpr auto transposed_view(Layout const& layout) {
  static_assert(decltype(rank(layout))::value == 2 || decltype(rank(layout))::value == 3);
  if constexpr (decltype(rank(layout))::value == 3) {
    auto const shape_t = make_shape(size<1>(layout), size<0>(layout), size<2>(layout));
    return composition(layout, make_ordered_layout(shape_t, Step<_2, _1, _3>{}));
  } else {
    auto const shape_t = make_shape(size<1>(layout), size<0>(layout));
    return composition(layout, make_ordered_layout(shape_t, Step<_2, _1>{}));
  }
}

// (seqlen, headdim, heads, batch) with the head dim contiguous: q, k, v, o and their gradients.
using GmemShape = Shape<int32_t, int32_t, int32_t, int32_t>;
using GmemStride = Stride<int64_t, _1, int64_t, int64_t>;

template <class Element>
CUTE_HOST_DEVICE auto make_gmem_bshd(Element* ptr, GmemShape const& shape, int64_t row_stride, int64_t head_stride,
                                     int64_t batch_stride) {
  return make_tensor(make_gmem_ptr(ptr), shape, GmemStride{row_stride, _1{}, head_stride, batch_stride});
}

// The same from a host-side StridedTensor (flash.h), with the element type the kernel reads or writes.
template <class Element, class Strided>
CUTE_HOST_DEVICE auto make_gmem_bshd(Strided const& t, GmemShape const& shape) {
  return make_gmem_bshd(static_cast<Element*>(t.ptr), shape, t.row_stride, t.head_stride, t.batch_stride);
}

}  // namespace flash
