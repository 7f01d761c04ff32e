// Small device helpers shared by the kernels: warp reductions, accumulator layout views,
// register type conversion and the warpgroup GEMM wrapper.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

namespace flash {

using namespace cute;

template <typename T>
struct MaxOp {
  __device__ __forceinline__ T operator()(T const& x, T const& y) const { return x > y ? x : y; }
};
template <>
struct MaxOp<float> {
  // fmaxf returns the non-NaN operand and compiles to one FMNMX.
  __device__ __forceinline__ float operator()(float const& x, float const& y) const { return fmaxf(x, y); }
};

template <typename T>
struct SumOp {
  __device__ __forceinline__ T operator()(T const& x, T const& y) const { return x + y; }
};

// Butterfly all-reduce over groups of kThreads consecutive lanes (xor kThreads/2, ..., 1).
template <int kThreads>
struct Allreduce {
  static_assert(kThreads == 32 || kThreads == 16 || kThreads == 8 || kThreads == 4 || kThreads == 2);
  template <typename T, typename Operator>
  static __device__ __forceinline__ T run(T x, Operator& op) {
    constexpr int kOffset = kThreads / 2;
    x = op(x, __shfl_xor_sync(uint32_t(-1), x, kOffset));
    return Allreduce<kOffset>::run(x, op);
  }
};
template <>
struct Allreduce<2> {
  template <typename T, typename Operator>
  static __device__ __forceinline__ T run(T x, Operator& op) {
    return op(x, __shfl_xor_sync(uint32_t(-1), x, 1));
  }
};

// The SM90 GMMA accumulator of one thread has layout ((2, 2, N/8), MMA_M, MMA_N): value mode 0 walks two
// adjacent columns, mode 1 the row 8 below, mode 2 the next group of 8 columns. View it as (rows, cols).
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_layout_rowcol(Layout const& acc) {
  static_assert(decltype(rank(acc))::value == 3);
  static_assert(decltype(rank<0>(acc))::value == 3);
  return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)),
                     make_layout(get<0, 0>(acc), get<0, 2>(acc), get<2>(acc)));
}

template <class Engine, class Layout>
CUTE_DEVICE auto make_rowcol_view(Tensor<Engine, Layout>& t) {
  return make_tensor(t.data(), acc_layout_rowcol(t.layout()));
}

// The A operand of a register-sourced GMMA, for the accumulator layout above.
// 16-bit: per K step of 32 bytes (16 values) a thread holds the values of two consecutive 8-column groups
// of the accumulator, ((2, 2, 2), MMA_M, K/16); its linear register order is the accumulator's, so
// converting P needs no data movement, only this layout.
// 8-bit: per K step of 32 values a thread holds 4 consecutive k at row r, the same at row r + 8, then both
// again 16 k further: ((4, 2, 2), MMA_M, K/32), compact. Its registers are filled by convert_acc_to_a_regs
// in the FP8 mainloop's permuted key order (transpose_v.h).
template <class Element, class Layout>
CUTE_HOST_DEVICE constexpr auto acc_layout_to_a_regs(Layout const& acc) {
  static_assert(decltype(rank(acc))::value == 3);
  constexpr int kColGroups = decltype(size<0, 2>(acc))::value;
  if constexpr (sizeof(Element) == 2) {
    static_assert(kColGroups % 2 == 0, "the GEMM0 tile N must be a multiple of 16");
    auto groups = logical_divide(get<0, 2>(acc), Int<2>{});  // (2, N/16)
    return make_layout(make_layout(get<0, 0>(acc), get<0, 1>(acc), get<0>(groups)), get<1>(acc),
                       coalesce(make_layout(get<1>(groups), get<2>(acc))));
  } else {
    static_assert(sizeof(Element) == 1);
    static_assert(kColGroups % 4 == 0 && decltype(size<2>(acc))::value == 1, "8-bit: one N atom, a multiple of 32");
    return make_layout(make_shape(Shape<_4, _2, _2>{}, shape<1>(acc), Int<kColGroups / 4>{}));
  }
}

// The accumulator as the 8-bit A operand sees it in the permuted key order of transpose_v.h: position
// (i + 4 * (row + 8), k + 16, step) of thread q holds logical key 32 * step + 16 * h + 4q + i, which is
// actual column 32 * step + 16 * h + 8 * (i / 2) + 2q + i % 2: accumulator value (i % 2, row, 4 * step +
// 2 * h + i / 2). Every index is thread-local: no shuffles.
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_layout_as_a_regs_fp8(Layout const& acc) {
  auto halves = logical_divide(get<0, 2>(acc), Int<2>{});          // (i / 2, N/16)
  auto steps = logical_divide(get<1>(halves), Int<2>{});           // (h, N/32)
  return make_layout(make_layout(make_layout(get<0, 0>(acc), get<0>(halves)), get<0, 1>(acc), get<0>(steps)),
                     get<1>(acc), get<1>(steps));
}

// Converts a register tensor element-wise into `dst` (same number of elements, any layout), using the
// packed converters (e.g. one cvt.rn.bf16x2.f32 per pair).
template <class EngineIn, class LayoutIn, class EngineOut, class LayoutOut>
CUTE_DEVICE void convert_into(Tensor<EngineIn, LayoutIn> const& src, Tensor<EngineOut, LayoutOut>& dst) {
  using From = typename EngineIn::value_type;
  using To = typename EngineOut::value_type;
  constexpr int kNumel = decltype(size(src))::value;
  static_assert(kNumel == decltype(size(dst))::value);
  cutlass::NumericArrayConverter<To, From, kNumel> converter;
  *reinterpret_cast<cutlass::Array<To, kNumel>*>(dst.data()) =
      converter(*reinterpret_cast<cutlass::Array<From, kNumel> const*>(src.data()));
}

// Issues one warpgroup GEMM C (+)= A * B over the whole K extent of the fragments, then waits until at
// most kWaitGroups GEMM batches are still in flight (-1: do not wait). A may be shared-memory
// descriptors (SS) or registers (RS). The operand fences keep the compiler from moving register reads
// or writes of A and C across the asynchronous GMMA.
template <int kWaitGroups, class TiledMma, class TensorA, class TensorB, class TensorC>
CUTE_DEVICE void warpgroup_gemm(TiledMma& tiled_mma, TensorA const& tCrA, TensorB const& tCrB, TensorC& tCrC,
                                bool zero_init) {
  // SS GEMMs pass shared-memory descriptors as A; RS GEMMs pass registers that need fencing.
  constexpr bool kARegs = !is_same_v<typename TensorA::iterator, GMMA::DescriptorIterator>;
  if constexpr (kARegs) { warpgroup_fence_operand(const_cast<TensorA&>(tCrA)); }
  warpgroup_fence_operand(tCrC);
  warpgroup_arrive();
  tiled_mma.accumulate_ = zero_init ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < size<2>(tCrA); ++k) {
    cute::gemm(tiled_mma, tCrA(_, _, k), tCrB(_, _, k), tCrC);
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if constexpr (kWaitGroups >= 0) { warpgroup_wait<kWaitGroups>(); }
  warpgroup_fence_operand(tCrC);
  if constexpr (kARegs) { warpgroup_fence_operand(const_cast<TensorA&>(tCrA)); }
}

// wgmma.wait_group 0 that cannot issue before `nonnegative` (floats with the sign bit clear, e.g. row sums)
// is computed: predicated on their bits, so always taken. ptxas issues an input-less wait as early as it
// can, ahead of work that does not need it (perf-notes section 19); this one follows that work.
template <class Tensor>
CUTE_DEVICE void warpgroup_wait_all_after(Tensor const& nonnegative) {
  uint32_t bits = 0;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(nonnegative); ++i) { bits |= __float_as_uint(nonnegative(i)); }
  asm volatile("{\n.reg .pred p;\nsetp.ge.s32 p, %0, 0;\n@p wgmma.wait_group.sync.aligned 0;\n}\n" ::"r"(bits) : "memory");
}

// P (the fp32 GEMM0 accumulator after the softmax) into GEMM1's register A operand of the input type.
template <class EngineAcc, class LayoutAcc, class EngineP, class LayoutP>
CUTE_DEVICE void convert_acc_to_a_regs(Tensor<EngineAcc, LayoutAcc> const& acc, Tensor<EngineP, LayoutP>& p) {
  if constexpr (sizeof(typename EngineP::value_type) == 2) {
    convert_into(acc, p);
  } else {
    Tensor acc_as_a = make_tensor(acc.data(), acc_layout_as_a_regs_fp8(acc.layout()));
    Tensor ordered = make_tensor<float>(make_layout(shape(p)));
    static_assert(decltype(size(acc_as_a))::value == decltype(size(ordered))::value);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(ordered); ++i) { ordered(i) = acc_as_a(i); }  // register renaming only
    convert_into(ordered, p);
  }
}

// FP8 P in the keys' natural order, for a V given column-major (FwdConfig::kVColMajor): GEMM1 then reads key 16g + 4q + i of each 16-key group g from byte i of word r + 2g of thread q
// (row lane / 4 + 8r), while GEMM0's accumulator gives thread p the keys 2p, 2p + 1, 8 + 2p, 9 + 2p of each
// group. Every word gathers two bytes from each of two threads of its quad. Words are exchanged in pairs
// (r = 0 and 1 of one group), so that one shuffle carries a half of each: even threads of a quad send their
// low halves first and their high halves second, odd threads the reverse, and thread q reads its first word
// from quad thread (2 (q % 2) + q / 2) and its second from that one's neighbour. Per pair of words: 2 byte
// permutes to send, 2 shuffles, 2 byte permutes to assemble. (Checked by a simulation of the 32 lanes.)
template <class EngineAcc, class LayoutAcc, class EngineP, class LayoutP>
CUTE_DEVICE void convert_acc_to_a_regs_natural_fp8(Tensor<EngineAcc, LayoutAcc> const& acc, Tensor<EngineP, LayoutP>& p) {
  static_assert(sizeof(typename EngineP::value_type) == 1);
  constexpr int kColGroups = decltype(size<0, 2>(acc))::value;  // 8-key column groups (c)
  static_assert(decltype(size<0, 0>(acc))::value == 2 && decltype(size<0, 1>(acc))::value == 2 && kColGroups % 2 == 0 &&
                decltype(size(acc))::value == 4 * kColGroups);
  constexpr int kWords = kColGroups;  // 4 bytes each: (r, g) for 16-key groups g
  static_assert(decltype(size(p))::value == 4 * kWords);
  // Accumulator value (j, r, c) is acc(j + 2 r + 4 c); word r + 2g in accumulator order: (0, r, 2g),
  // (1, r, 2g), (0, r, 2g + 1), (1, r, 2g + 1).
  Tensor ordered = make_tensor<float>(Shape<Int<4 * kWords>>{});
  CUTLASS_PRAGMA_UNROLL
  for (int w = 0; w < kWords; ++w) {
    int const r = w % 2, g = w / 2;
    CUTLASS_PRAGMA_UNROLL
    for (int b = 0; b < 4; ++b) { ordered(4 * w + b) = acc((b % 2) + 2 * r + 4 * (2 * g + b / 2)); }
  }
  Tensor bytes = make_tensor<typename EngineP::value_type>(Shape<Int<4 * kWords>>{});
  convert_into(ordered, bytes);
  uint32_t const* own = reinterpret_cast<uint32_t const*>(bytes.data());
  uint32_t* out = reinterpret_cast<uint32_t*>(p.data());
  int const lane = int(threadIdx.x) % cutlass::NumThreadsPerWarp, q = lane % 4;
  int const first_source = (lane & ~3) | ((q % 2) << 1) | (q / 2);
  uint32_t const send_first = q % 2 == 0 ? 0x5410u : 0x7632u;  // low halves of both words, or high
  uint32_t const take_r0 = q < 2 ? 0x5410u : 0x1054u;         // the two low (high) halves in key order
  CUTLASS_PRAGMA_UNROLL
  for (int g = 0; g < kWords / 2; ++g) {
    uint32_t const w0 = own[2 * g], w1 = own[2 * g + 1];
    uint32_t const a = __shfl_sync(0xffffffffu, __byte_perm(w0, w1, send_first), first_source);
    uint32_t const b = __shfl_sync(0xffffffffu, __byte_perm(w0, w1, send_first ^ 0x2222u), first_source ^ 1);
    out[2 * g] = __byte_perm(a, b, take_r0);
    out[2 * g + 1] = __byte_perm(a, b, take_r0 ^ 0x2222u);
  }
}

// threadIdx.x - 128 (the consumer index of kernels whose warpgroup 0 produces), which the compiler cannot
// move across loop iterations: per-thread offsets derived from it are recomputed where used instead of
// hoisted out of a loop and held (or spilled) through it.
__device__ __forceinline__ int opaque_thread_idx() {
  int tid;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  return tid - cutlass::NumThreadsPerWarpGroup;
}

// A GMMA thread slice index for shared-memory operands: the first thread of the caller's warpgroup, from a
// warpgroup index broadcast from lane 0, so that ptxas knows it is the same across the warp. The descriptors a
// warpgroup's slice yields (one per warpgroup) are then uniform values; sliced by the thread's own index, the
// A operand's (split over the warpgroups) were held in regular registers and moved to uniform ones before every
// GMMA (R2UR), and spilled in FP8 d128 (perf-notes section 57). FA3 slices the same way.
__device__ __forceinline__ int warpgroup_slice_idx(int thread_idx) {
  return __shfl_sync(0xffffffffu, thread_idx / cutlass::NumThreadsPerWarpGroup, 0) * cutlass::NumThreadsPerWarpGroup;
}

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Floor division that is right for negative numerators too.
__host__ __device__ constexpr int floor_div(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

}  // namespace flash
