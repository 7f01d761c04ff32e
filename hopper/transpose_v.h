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
#include <utility>

#include <cute/tensor.hpp>

#include "layouts.h"

namespace flash {

using namespace cute;

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
//   4q..4q+3; stmatrix.x4 stores register i of lane group c as row c of matrix i.
// - Bank conflicts: were matrix i's rows the V^T rows 2c + i % 2, rows c and c + 4 (V^T rows 8 apart)
//   would share banks under every GMMA swizzle (it XORs with the row within an 8-row atom), two shared
//   memory wavefronts per matrix (Nsight: 12% of the kernel's). Lane groups c >= 4 therefore hand their
//   odd row to matrix 0 and their even row to matrix 1: matrix i holds the V^T rows 2c + (i % 2 ^ c / 4)
//   + 16 (i / 2), whose positions within an atom are all distinct.
// Row addresses: a thread's row in the first tile comes from the layouts once per block; every other tile's
// offset splits into an in-atom part that XORs into it (the swizzle is linear, and the 1024-byte aligned
// stage bases leave the XORed bits alone) and atom multiples (added). Each warp walks a fixed list of
// tiles, fully unrolled, so both are compile-time constants: per tile one XOR at most besides the transpose
// itself (the walk with tile indices computed at run time spent ~18 of its ~24 instructions per tile on
// addresses). With kTilesInFlight = 2 the next tile's load is issued before this one's store: a tile alone
// is a chain of load latency, permutes and store.
template <int kBlockN, int kHeadDim, class LayoutV, class LayoutVt, int kThreads, int kTilesInFlight>
struct VTransposer {
  static_assert(kTilesInFlight == 1 || kTilesInFlight == 2);
  static_assert(kHeadDim % 32 == 0 && kBlockN % 16 == 0);
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kDBlocks = kHeadDim / 32;
  static constexpr int kTiles = kDBlocks * (kBlockN / 16);
  static constexpr int kSwizzleV = k_major_swizzle_bytes<uint8_t, kHeadDim>();  // W of V's layout
  static constexpr int kSwizzleVt = k_major_swizzle_bytes<uint8_t, kBlockN>();  // W of V^T's layout

  // The V^T row (within a 32-row tile) that row `row` of stmatrix matrix `matrix` stores (see above).
  __host__ __device__ static constexpr int vt_row(int matrix, int row) {
    return 2 * row + ((matrix % 2) ^ (row / 4)) + 16 * (matrix / 2);
  }
  // Every matrix's 8 rows at distinct positions within an 8-row swizzle atom (so in distinct banks), and
  // the 4 matrices together cover the tile's 32 rows once.
  __host__ __device__ static constexpr bool stores_conflict_free() {
    uint32_t covered = 0;
    for (int matrix = 0; matrix < 4; ++matrix) {
      int positions = 0;
      for (int row = 0; row < 8; ++row) {
        positions |= 1 << (vt_row(matrix, row) % 8);
        covered |= 1u << vt_row(matrix, row);
      }
      if (positions != 0xff) { return false; }
    }
    return covered == 0xffffffffu;
  }
  static_assert(stores_conflict_free());

  // smem_v and smem_vt: 1024-byte aligned stage buffers (the XORs act on offsets from them).
  __device__ static void run(uint8_t const* smem_v, uint8_t* smem_vt, int thread_idx) {
    int const warp = thread_idx / 32, lane = thread_idx % 32;
    int const matrix = lane / 8, row = lane % 8;  // the row this lane addresses for ldmatrix / stmatrix
    uint32_t const load_row = cute::cast_smem_ptr_to_uint(smem_v) +
                              uint32_t(LayoutV{}(row + 8 * (matrix % 2), 16 * (matrix / 2)));
    uint32_t const store_row = cute::cast_smem_ptr_to_uint(smem_vt) + uint32_t(LayoutVt{}(vt_row(matrix, row), 0));
    // The byte selector giving the first register of a pair: V^T row 2c (0x6420, even bytes), or 2c + 1
    // (0x7531) for lane groups c >= 4; the second register takes the other (XOR 0x1111). One register
    // rather than two: the lean producer (24 registers) spills the loop's state with two.
    uint32_t const sel_first = lane / 4 >= 4 ? 0x7531u : 0x6420u;
    dispatch(warp, load_row, store_row, sel_first, std::make_integer_sequence<int, kWarps>{});
  }

 private:
  template <int... kWarp>
  __device__ static void dispatch(int warp, uint32_t load_row, uint32_t store_row, uint32_t sel_first,
                                  std::integer_sequence<int, kWarp...>) {
    ((warp == kWarp ? walk<kWarp>(load_row, store_row, sel_first) : void()), ...);
  }

  // Warp kWarp's tiles: kWarp, kWarp + kWarps, ...
  template <int kWarp>
  __device__ static void walk(uint32_t load_row, uint32_t store_row, uint32_t sel_first) {
    constexpr int kCount = (kTiles - kWarp + kWarps - 1) / kWarps;
    uint32_t r[kTilesInFlight][4];
    if constexpr (kTilesInFlight == 2) { load(kWarp, load_row, r[0]); }
    CUTE_UNROLL
    for (int i = 0; i < kCount; ++i) {
      int const tile = kWarp + kWarps * i;
      if constexpr (kTilesInFlight == 2) {
        if (i + 1 < kCount) { load(tile + kWarps, load_row, r[(i + 1) % 2]); }
      } else {
        load(tile, load_row, r[0]);
      }
      store(tile, store_row, r[i % kTilesInFlight], sel_first);
    }
  }

  // `tile` is a constant once the walk is unrolled: the XOR and the added offset fold into immediates.
  __device__ static void load(int tile, uint32_t load_row, uint32_t (&r)[4]) {
    int const d_first = (tile % kDBlocks) * 32, key_first = (tile / kDBlocks) * 16;
    uint32_t const addr = (load_row ^ uint32_t(d_first % kSwizzleV)) +
                          uint32_t(key_first * kSwizzleV + d_first / kSwizzleV * kBlockN * kSwizzleV);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  }
  __device__ static void store(int tile, uint32_t store_row, uint32_t const (&r)[4], uint32_t sel_first) {
    int const d_first = (tile % kDBlocks) * 32, key_first = (tile / kDBlocks) * 16;
    uint32_t const addr = (store_row ^ uint32_t(key_first % kSwizzleVt)) +
                          uint32_t(d_first * kSwizzleVt + key_first / kSwizzleVt * kHeadDim * kSwizzleVt);
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
                 "r"(__byte_perm(r[0], r[1], sel_first)), "r"(__byte_perm(r[0], r[1], sel_first ^ 0x1111u)),
                 "r"(__byte_perm(r[2], r[3], sel_first)), "r"(__byte_perm(r[2], r[3], sel_first ^ 0x1111u)));
  }
};

}  // namespace flash
