// Warp-level tensor-core building blocks (the SM80 instruction set, which Hopper keeps): cp.async copies into
// shared memory, ldmatrix, and the m16n8k16 MMA with fp32 accumulators. Used by the decode kernel
// (decode_kernel.h), whose tiles are too small for warpgroup GMMA.
//
// Fragment layouts are PTX's ("Matrix fragments for mma.m16n8k16"). With g = lane / 4 and c = lane % 4, a
// thread's accumulator of one 16x8 tile holds (row g, cols 2c, 2c+1) then (row g + 8, the same cols): the
// pattern of a warp's share of a GMMA accumulator, so softmax.h's Softmax runs on it unchanged.
#pragma once

#include <cstdint>

#include <cutlass/numeric_types.h>

namespace flash::warp {

__device__ __forceinline__ uint32_t smem_address(void const* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// 16 bytes global -> shared, past L1. With valid = false it writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async_16(uint32_t dst, void const* src, bool valid) {
  int const src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// 16 bytes from / to shared memory.
__device__ __forceinline__ uint4 lds_128(uint32_t address) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(address) : "memory");
  return v;
}
__device__ __forceinline__ void sts_128(uint32_t address, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(address), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// e4m3 values widened to fp16 (exact), the value at the lower address in the low half.
__device__ __forceinline__ uint32_t e4m3x2_to_half2(uint16_t pair) {
  uint32_t r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(r) : "h"(pair));
  return r;
}
__device__ __forceinline__ uint2 e4m3x4_to_half4(uint32_t quad) {
  uint2 r;
  asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %2;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n cvt.rn.f16x2.e4m3x2 %1, hi;\n}\n"
      : "=r"(r.x), "=r"(r.y)
      : "r"(quad));
  return r;
}

// A register of ldmatrix.trans over e4m3 byte pairs: (key k, columns 2g, 2g + 1), then (key k + 1, the same
// columns). Returns the fp16 pairs (key k, key k + 1) of column 2g (.x) and of column 2g + 1 (.y), each as an
// MMA B register holds them (the lower key in the low half): one byte permute, then the widening.
__device__ __forceinline__ uint2 e4m3_column_pairs_to_half(uint32_t pairs) {
  return e4m3x4_to_half4(__byte_perm(pairs, 0u, 0x3120));
}

// Four 8x8 matrices of 16-bit values; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address)
               : "memory");
}
// The same, each matrix transposed on the way (rows become columns).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address)
               : "memory");
}

// acc (4 floats, one 16x8 tile) += A (16x16, 4 registers) * B (16x8, 2 registers).
template <class Element>
__device__ __forceinline__ void mma_16816(float& d0, float& d1, float& d2, float& d3, uint32_t const (&a)[4], uint32_t b0,
                                          uint32_t b1) {
  static_assert(std::is_same_v<Element, cutlass::bfloat16_t> || std::is_same_v<Element, cutlass::half_t>);
  if constexpr (std::is_same_v<Element, cutlass::bfloat16_t>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats rounded to 16 bits, `lo` in the low half (the element with the lower index).
template <class Element>
__device__ __forceinline__ uint32_t pack_2(float lo, float hi) {
  uint32_t r;
  if constexpr (std::is_same_v<Element, cutlass::bfloat16_t>) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
}

}  // namespace flash::warp
