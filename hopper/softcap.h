// Softcap (Gemma 2): a score s becomes c * tanh(s * softmax_scale / c) before the softmax. The kernels fold it
// into the scaling they already do: t = tanh(s * softmax_scale / c) in place of s, and the softmax takes t
// with the scale c instead of softmax_scale (its exponent is t * c * log2(e)). The backward's chain rule
// adds d(c tanh(s * softmax_scale / c))/ds = softmax_scale * (1 - t^2): softmax_scale is applied to dQ and
// dK as without softcap, so dS gains the factor 1 - t^2.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

namespace flash {

// The scales of a call's scores: with softcap, pre_scale > 0 maps S to tanh's argument.
struct ScoreScales {
  float softcap_pre_scale;   // softmax_scale / softcap; 0 = no softcap
  float softmax_scale_log2;  // of S, or of t with softcap (softcap * log2(e))

  static ScoreScales make(float softmax_scale, float softcap) {
    if (softcap > 0.f) { return {softmax_scale / softcap, float(softcap * M_LOG2E)}; }
    return {0.f, float(softmax_scale * M_LOG2E)};
  }
};

__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// acc = tanh(acc * pre_scale), every element of a score accumulator.
template <class Engine, class Layout>
__device__ __forceinline__ void apply_softcap(cute::Tensor<Engine, Layout>& acc, float pre_scale) {
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < cute::size(acc); ++i) { acc(i) = tanh_approx(acc(i) * pre_scale); }
}

// Backward: the factor 1 - t^2 that softcap's chain rule puts on dS, with t recovered from
// P = exp2(t * scale_log2 - lse_log2) (one more MUFU op rather than t's registers beside P and dP, which made
// ptxas spill). Where P = 0 (masked, or underflowed) t comes out -inf, or NaN in rows with LSE_log2 = +inf
// (no key seen, or padding), and fmaxf gives 0 for both, so dS = 0.
__device__ __forceinline__ float softcap_grad_factor_from_p(float p, float lse_log2, float scale_log2) {
  float const t = (__log2f(p) + lse_log2) * (1.f / scale_log2);
  return fmaxf(1.f - t * t, 0.f);
}

}  // namespace flash
