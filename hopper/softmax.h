// The online softmax of the forward mainloop, after the design of FlashAttention-3's hopper/softmax.h
// (README: acknowledgements).
//
// Per K/V block: max_get_scale (new row max, correction factor for the old state, row sums rescaled),
// online_softmax (P = exp2(S * scale_log2 - max_scaled): one FFMA + one EX2 per score; row sums stay
// thread-local), rescale_o (O *= correction). After the last block, finalize performs the only quad
// all-reduce of the sums, returns 1/sum for the final rescale_o, and leaves the LSE in row_sum.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "utils.h"

namespace flash {

using namespace cute;

// summary(mi) (op)= tensor(mi, ni) over this thread's columns; tensor is (rows, cols).
template <bool kZeroInit, class Engine0, class Layout0, class Engine1, class Layout1, class Operator>
__device__ __forceinline__ void thread_reduce_(Tensor<Engine0, Layout0> const& tensor, Tensor<Engine1, Layout1>& summary,
                                               Operator& op) {
  static_assert(Layout0::rank == 2 && Layout1::rank == 1);
  CUTLASS_PRAGMA_UNROLL
  for (int mi = 0; mi < size<0>(tensor); ++mi) {
    summary(mi) = kZeroInit ? tensor(mi, 0) : op(summary(mi), tensor(mi, 0));
    CUTLASS_PRAGMA_UNROLL
    for (int ni = 1; ni < size<1>(tensor); ++ni) { summary(mi) = op(summary(mi), tensor(mi, ni)); }
  }
}

// The four threads of a quad hold the same rows (different columns): combine their values.
template <class Engine0, class Layout0, class Engine1, class Layout1, class Operator>
__device__ __forceinline__ void quad_allreduce_(Tensor<Engine0, Layout0>& dst, Tensor<Engine1, Layout1> const& src,
                                                Operator& op) {
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(dst); ++i) { dst(i) = Allreduce<4>::run(src(i), op); }
}

template <bool kZeroInit, class Engine0, class Layout0, class Engine1, class Layout1>
__device__ __forceinline__ void reduce_max(Tensor<Engine0, Layout0> const& tensor, Tensor<Engine1, Layout1>& row_max) {
  MaxOp<float> max_op;
  thread_reduce_<kZeroInit>(tensor, row_max, max_op);
  quad_allreduce_(row_max, row_max, max_op);  // the max must be exact across the row before exp2
}

// Thread-local partial row sums only: the quad reduction waits until finalize.
template <bool kZeroInit, class Engine0, class Layout0, class Engine1, class Layout1>
__device__ __forceinline__ void reduce_sum_thread(Tensor<Engine0, Layout0> const& tensor, Tensor<Engine1, Layout1>& row_sum) {
  SumOp<float> sum_op;
  thread_reduce_<kZeroInit>(tensor, row_sum, sum_op);
}

// 2^x on the FMA and integer pipes instead of the MUFU unit, for P's arguments (x <= kMaxOffset; -inf gives
// 0): x = j + f with j = round(x) and |f| <= 1/2, 2^f by a cubic (relative error under 8e-5, far below the
// rounding of P to 16 bits or e4m3), j added to its exponent. Eight instructions where EX2 is one, but
// where the exponentials need as long on MUFU as the GEMMs on the tensor pipe (FP8, d64), a share of them
// moved here shortens the softmax (perf-notes section 37).
__device__ __forceinline__ float exp2_on_fma(float x) {
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23: adding it leaves round(x) in the low mantissa bits
  x = fmaxf(x, -126.f);                 // 2^j stays a (tiny) positive float; -inf becomes 2^-126 ~ 0
  float const shifted = __fadd_rn(x, kRound);
  float const f = __fsub_rn(x, __fsub_rn(shifted, kRound));
  float const p = fmaf(fmaf(fmaf(0.05517167f, f, 0.24261115f), f, 0.69326097f), f, 0.99992806f);
  // shifted's bits are 0x4B400000 + j; shifted left by 23 that is j * 2^23 (mod 2^32): j joins p's exponent.
  return __int_as_float(__float_as_int(p) + (__float_as_int(shifted) << 23));
}

// tensor(mi, ni) = exp2(tensor(mi, ni) * scale - (max(mi) * scale - kMaxOffset)): one FFMA and one EX2
// (every kExp2OnFmaEvery-th column: exp2_on_fma instead; 0 = none).
// With kCheckInf a row whose max is -inf (every score masked so far) uses 0 instead, so exp2(-inf) = 0
// rather than exp2(NaN).
template <bool kCheckInf, int kMaxOffset, int kExp2OnFmaEvery, class Engine0, class Layout0, class Engine1, class Layout1>
__device__ __forceinline__ void scale_apply_exp2(Tensor<Engine0, Layout0>& tensor, Tensor<Engine1, Layout1> const& max,
                                                 float const scale) {
  constexpr float kOffset = float(kMaxOffset);
  CUTLASS_PRAGMA_UNROLL
  for (int mi = 0; mi < size<0>(tensor); ++mi) {
    float const max_scaled =
        kCheckInf ? (max(mi) == -INFINITY ? 0.f : max(mi) * scale - kOffset) : max(mi) * scale - kOffset;
    CUTLASS_PRAGMA_UNROLL
    for (int ni = 0; ni < size<1>(tensor); ++ni) {
      float const x = tensor(mi, ni) * scale - max_scaled;
      constexpr int kEvery = kExp2OnFmaEvery > 0 ? kExp2OnFmaEvery : 1;  // (no % 0 where it is off)
      tensor(mi, ni) = kExp2OnFmaEvery > 0 && ni % kEvery == kEvery - 1 ? exp2_on_fma(x) : exp2f(x);
    }
  }
}

// kNRows: rows of the score tile this thread holds (2 per 64-row GMMA atom). kMaxOffset: P is produced
// scaled by 2^kMaxOffset (8 for FP8, to use its range); finalize divides it back out of the LSE, and
// the 1/sum it returns already includes it for O.
//
// kLazyRescale: a row keeps its old max while the block's max exceeds it by at most kLazyThreshold (log2 units),
// so that P = exp2(S * scale_log2 - max_scaled) stays below 2^(kMaxOffset + kLazyThreshold); the correction factor
// is then 1, and a warp whose rows all keep theirs skips O's rescale (rescale_o_if_changed). After a row's first
// blocks its max seldom moves that far, so most blocks skip the O rescale's FMULs (FlashAttention-4's
// conditional rescaling). The result is the same up to rounding: LSE uses the max that P used.
template <int kNRows, int kMaxOffset = 0, int kExp2OnFmaEvery = 0, bool kLazyRescale = false>
struct Softmax {
  using TensorT = decltype(make_tensor<float>(Shape<Int<kNRows>>{}));
  TensorT row_max, row_sum;
  float const softmax_scale_log2;
  // 16-bit P may grow to 2^8 (bf16/fp16 P and the fp32 sums keep their relative precision there); FP8 P,
  // already scaled by 2^kMaxOffset, may not pass e4m3's largest value, 448 = 2^8.8.
  static constexpr float kLazyThreshold = kMaxOffset > 0 ? 0.75f : 8.f;
  static_assert(kMaxOffset <= 8, "P's largest value with the lazy threshold must stay within e4m3's range");

  __device__ __forceinline__ explicit Softmax(float const softmax_scale_log2_) : softmax_scale_log2(softmax_scale_log2_) {
    reset();
  }

  // A tile that sees no key never calls max_get_scale; this state makes finalize give O = 0, LSE = -inf. (A tile's
  // first max_get_scale and online_softmax overwrite both, so chained tiles reuse one Softmax without it.)
  __device__ __forceinline__ void reset() {
    fill(row_max, -INFINITY);
    fill(row_sum, 0.f);
  }

  // Updates row_max with the block's scores and returns, per row, the factor that moves the old state
  // onto the new max; rescales the thread-local row sums by it.
  template <bool kIsFirst, bool kCheckInf = false, class Tensor0>
  __device__ __forceinline__ TensorT max_get_scale(Tensor0& acc_s) {
    Tensor scores = make_rowcol_view(acc_s);
    static_assert(decltype(size<0>(scores))::value == kNRows);
    TensorT scores_scale;
    if constexpr (kIsFirst) {
      reduce_max</*kZeroInit=*/true>(scores, row_max);
      fill(scores_scale, 1.f);
    } else {
      TensorT scores_max_prev = make_fragment_like(row_max);
      copy(row_max, scores_max_prev);
      reduce_max</*kZeroInit=*/false>(scores, row_max);
      CUTLASS_PRAGMA_UNROLL
      for (int mi = 0; mi < kNRows; ++mi) {
        float const scores_max_cur = !kCheckInf ? row_max(mi) : (row_max(mi) == -INFINITY ? 0.f : row_max(mi));
        scores_scale(mi) = exp2f((scores_max_prev(mi) - scores_max_cur) * softmax_scale_log2);
        if constexpr (kLazyRescale) {
          // False for a row still without a finite max (-inf - -inf is NaN) and for one getting its first (+inf).
          bool const keep = (row_max(mi) - scores_max_prev(mi)) * softmax_scale_log2 <= kLazyThreshold;
          if (keep) {
            row_max(mi) = scores_max_prev(mi);
            scores_scale(mi) = 1.f;
          }
        }
        row_sum(mi) *= scores_scale(mi);
      }
    }
    return scores_scale;
  }

  // acc_s becomes P = exp2(S * scale_log2 - max_scaled); its row sums are added to row_sum per thread.
  template <bool kIsFirst, bool kCheckInf = false, class Tensor0>
  __device__ __forceinline__ void online_softmax(Tensor0& acc_s) {
    Tensor scores = make_rowcol_view(acc_s);
    scale_apply_exp2<kCheckInf, kMaxOffset, kExp2OnFmaEvery>(scores, row_max, softmax_scale_log2);
    reduce_sum_thread</*kZeroInit=*/kIsFirst>(scores, row_sum);
  }

  // The one quad all-reduce of the sums. Returns final_scale / sum per row (0 for a row with sum 0 or
  // NaN: a row that saw no key) and leaves LSE = max * softmax_scale + ln(sum) in row_sum (-inf there).
  __device__ __forceinline__ TensorT finalize(float const final_scale = 1.f) {
    SumOp<float> sum_op;
    quad_allreduce_(row_sum, row_sum, sum_op);
    TensorT scores_scale;
    CUTLASS_PRAGMA_UNROLL
    for (int mi = 0; mi < kNRows; ++mi) {
      float sum = row_sum(mi);
      bool const empty = sum == 0.f || sum != sum;
      float const inv_sum = empty ? 0.f : 1.f / sum;
      scores_scale(mi) = inv_sum * final_scale;
      if constexpr (kMaxOffset != 0) {
        constexpr float kSumScale = 1.f / float(1 << kMaxOffset);
        sum *= kSumScale;
      }
      row_sum(mi) = empty ? -INFINITY : row_max(mi) * (softmax_scale_log2 * float(M_LN2)) + __logf(sum);
    }
    return scores_scale;
  }

  // rescale_o, skipped by a warp whose rows all kept their max (kLazyRescale): every factor is then 1.
  template <class Tensor1>
  __device__ __forceinline__ void rescale_o_if_changed(Tensor1& acc_o, TensorT const& scores_scale) {
    if constexpr (kLazyRescale) {
      bool changed = false;
      CUTLASS_PRAGMA_UNROLL
      for (int mi = 0; mi < kNRows; ++mi) { changed |= scores_scale(mi) != 1.f; }
      if (!__any_sync(0xffffffffu, changed)) { return; }
    }
    rescale_o(acc_o, scores_scale);
  }

  // acc_o(row, :) *= scores_scale(row).
  template <class Tensor1>
  __device__ __forceinline__ void rescale_o(Tensor1& acc_o, TensorT const& scores_scale) {
    Tensor acc_o_rowcol = make_rowcol_view(acc_o);
    static_assert(decltype(size<0>(acc_o_rowcol))::value == kNRows);
    CUTLASS_PRAGMA_UNROLL
    for (int mi = 0; mi < kNRows; ++mi) {
      CUTLASS_PRAGMA_UNROLL
      for (int ni = 0; ni < size<1>(acc_o_rowcol); ++ni) { acc_o_rowcol(mi, ni) *= scores_scale(mi); }
    }
  }
};

}  // namespace flash
