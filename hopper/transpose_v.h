// The FP8 forward's V transpose in shared memory. 8-bit GMMA reads both operands K-major, so GEMM1
// (O += P V, K = keys) needs V^T with the keys contiguous, while V arrives by TMA with the head dim
// contiguous. Warps 1-3 of the producer warpgroup rewrite each V block into a (headdim, keys) buffer while
// the consumers run their GEMMs (mainloop_fwd.h).
//
// Key order. An 8-bit register A operand holds, per thread q of a quad and 32-key step, the keys
// 4q..4q+3 and 16+4q..16+4q+3, while the GEMM0 accumulator gives the thread the columns 2q, 2q+1, 8+2q,
// 9+2q (and +16). Rather than moving P between threads, GEMM1 runs over a permuted key order: logical key
// 16h + 4q + i (i < 4) of each 32-key step is actual key 16h + 8(i/2) + 2q + i%2. P's registers are then
// only renamed (convert_acc_to_a_regs in utils.h), and this transpose writes V^T in the same logical order.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "layouts.h"

namespace flash {

using namespace cute;

// The actual key (within its 16-key half step) at a logical position 4q + i.
__host__ __device__ constexpr int fp8_key_of_logical(int logical) {
  int const q = (logical % 16) / 4, i = logical % 4;
  return (logical / 16) * 16 + 8 * (i / 2) + 2 * q + i % 2;
}

// kThreads threads transpose one (kBlockN keys, kHeadDim) block of bytes, laid out as LayoutV (head dim
// contiguous, TMA's layout), into LayoutVt (kHeadDim, kBlockN) (keys contiguous in logical order, GMMA's
// K-major layout). Both are K-major layouts of 8-row swizzle atoms (layouts.h): offset(r, c) =
// swizzle((r % 8) * W + c % W) + (r / 8) * 8W + (c / W) * rows * W, where the swizzle XORs bits inside an
// atom only.
//
// A warp moves a tile of 16 keys x 32 head-dim bytes per step, 16 bytes per thread:
// - ldmatrix.x4.trans reads it as four 8x8 matrices of 16-bit pairs (keys 0-7 / 8-15 x head-dim bytes
//   0-15 / 16-31). Thread t = 4c + q receives from each the 2x2 bytes (keys 2q, 2q+1) x (head-dim bytes
//   2c, 2c+1): with the keys 8 further from the second matrix, exactly the logical keys 4q..4q+3 of the
//   permuted order above.
// - Two byte permutes per register pair give the V^T rows 2c and 2c+1 (and 16+2c, 17+2c) at logical keys
//   4q..4q+3, which is the fragment stmatrix.x4 stores: matrix i, row c <- V^T row 2c + i % 2 + 16 (i / 2).
// Row addresses: each thread's part inside the tile comes from the layouts once; the tile's offset splits
// into atom multiples (added) and an in-atom part that XORs into the thread's part (the swizzle is
// linear). Both sides read and write 16-byte rows of 8 distinct rows per matrix.
template <int kBlockN, int kHeadDim, class LayoutV, class LayoutVt, int kThreads>
struct VTransposer {
  static_assert(kHeadDim % 32 == 0 && kBlockN % 16 == 0);
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kDBlocks = kHeadDim / 32;
  static constexpr int kTiles = kDBlocks * (kBlockN / 16);
  static constexpr int kSwizzleV = k_major_swizzle_bytes<uint8_t, kHeadDim>();  // W of V's layout
  static constexpr int kSwizzleVt = k_major_swizzle_bytes<uint8_t, kBlockN>();  // W of V^T's layout

  // smem_v and smem_vt: 1024-byte aligned stage buffers (the XORs act on offsets from them).
  __device__ static void run(uint8_t const* smem_v, uint8_t* smem_vt, int thread_idx) {
    LayoutV layout_v;
    LayoutVt layout_vt;
    int const warp = thread_idx / 32, lane = thread_idx % 32;
    int const matrix = lane / 8, row = lane % 8;  // the row this lane addresses for ldmatrix / stmatrix
    uint32_t const load_part = uint32_t(layout_v(row + 8 * (matrix % 2), 16 * (matrix / 2)));
    uint32_t const store_part = uint32_t(layout_vt(2 * row + matrix % 2 + 16 * (matrix / 2), 0));
    uint32_t const base_v = cute::cast_smem_ptr_to_uint(smem_v);
    uint32_t const base_vt = cute::cast_smem_ptr_to_uint(smem_vt);
    // Unsigned tile arithmetic: the divisions by powers of two become shifts and masks (signed ones cost
    // ptxas three instructions each for the rounding toward zero: half of this loop's instructions).
#pragma unroll 2
    for (uint32_t tile = uint32_t(warp); tile < uint32_t(kTiles); tile += uint32_t(kWarps)) {
      uint32_t const d_first = (tile % kDBlocks) * 32, key_first = (tile / kDBlocks) * 16;
      uint32_t const load_addr = base_v + (key_first / 8 * 8 * kSwizzleV + d_first / kSwizzleV * kBlockN * kSwizzleV) +
                                 (load_part ^ (d_first % kSwizzleV));
      uint32_t const store_addr = base_vt + (d_first / 8 * 8 * kSwizzleVt + key_first / kSwizzleVt * kHeadDim * kSwizzleVt) +
                                  (store_part ^ (key_first % kSwizzleVt));
      uint32_t r[4];
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                   : "r"(load_addr));
      asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(store_addr),
                   "r"(__byte_perm(r[0], r[1], 0x6420)), "r"(__byte_perm(r[0], r[1], 0x7531)),
                   "r"(__byte_perm(r[2], r[3], 0x6420)), "r"(__byte_perm(r[2], r[3], 0x7531)));
    }
  }
};

}  // namespace flash
