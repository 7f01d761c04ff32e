// Split-KV: a sequence's keys split over several CTAs, each producing O and LSE for its part, and the merge
// of those parts: O = sum_i exp(lse_i - lse) O_i with lse = log(sum_i exp(lse_i)). The decode kernel merges
// its warps' parts with it and writes either the final output or its split's part; SplitCombine merges the
// splits (flash_ext.combine is the same merge in PyTorch, for users' own parts).
#pragma once

#include <cmath>
#include <cstdint>

#include "decode_params.h"
#include "kernel_launch.h"
#include "warp_mma.h"

namespace flash {

// Running log-sum-exp of parts' LSEs; parts with lse = -inf (no key) add nothing.
struct LseMerge {
  float max = -INFINITY, sum = 0.f;

  __device__ void add(float part_lse) {
    if (part_lse == -INFINITY) return;
    if (part_lse > max) {
      sum = sum * __expf(max - part_lse) + 1.f;
      max = part_lse;
    } else {
      sum += __expf(part_lse - max);
    }
  }
  __device__ void add(LseMerge const& other) {
    if (other.sum == 0.f) return;
    float const m = fmaxf(max, other.max);
    sum = (sum == 0.f ? 0.f : sum * __expf(max - m)) + other.sum * __expf(other.max - m);
    max = m;
  }
  __device__ float lse() const { return sum > 0.f ? max + __logf(sum) : -INFINITY; }
  // A part's weight in the merged O.
  __device__ static float weight(float part_lse, float lse) { return part_lse == -INFINITY ? 0.f : __expf(part_lse - lse); }
};

// Where a decode call's results go: the final O (q's dtype) and LSE, or a split's part in the workspace,
// fp32 O (splits, batch, seqlen_q, nheads, headdim) then LSE (splits, batch, nheads, seqlen_q).
struct SplitOutput {
  StridedTensor o;
  float* lse;
  float* o_part;
  float* lse_part;
  int batch, seqlen_q, nheads, headdim;

  static FLASH_HOST_DEVICE int64_t o_part_floats(int splits, int batch, int seqlen_q, int nheads, int headdim) {
    return int64_t(splits) * batch * seqlen_q * nheads * headdim;
  }
  static FLASH_HOST_DEVICE int64_t workspace_bytes(int splits, int batch, int seqlen_q, int nheads, int headdim) {
    if (splits <= 1) return 0;
    return (o_part_floats(splits, batch, seqlen_q, nheads, headdim) + int64_t(splits) * batch * nheads * seqlen_q) * 4;
  }
  static FLASH_HOST_DEVICE SplitOutput of(DecodeParams const& p) {
    float* const o_part = static_cast<float*>(p.workspace);
    float* const lse_part = o_part == nullptr ? nullptr : o_part + o_part_floats(p.num_splits, p.batch, p.seqlen_q, p.nheads, p.headdim);
    return {p.o, p.lse, o_part, lse_part, p.batch, p.seqlen_q, p.nheads, p.headdim};
  }

  __device__ int64_t part_row(int split, int b, int t, int h) const {
    return ((int64_t(split) * batch + b) * seqlen_q + t) * nheads + h;
  }
  __device__ int64_t part_lse_index(int split, int b, int t, int h) const {
    return ((int64_t(split) * batch + b) * nheads + h) * seqlen_q + t;
  }
  // Four values at column col of row (b, t, h), and with write_lse its LSE.
  template <class Element>
  __device__ void store_final(int b, int t, int h, int col, float4 v, float row_lse, bool write_lse) const {
    Element* const dst = static_cast<Element*>(o.ptr) + b * o.batch_stride + t * o.row_stride + h * o.head_stride + col;
    *reinterpret_cast<uint2*>(dst) = make_uint2(warp::pack_2<Element>(v.x, v.y), warp::pack_2<Element>(v.z, v.w));
    if (write_lse) { lse[(int64_t(b) * nheads + h) * seqlen_q + t] = row_lse; }
  }
  __device__ void store_part(int split, int b, int t, int h, int col, float4 v, float row_lse, bool write_lse) const {
    *reinterpret_cast<float4*>(o_part + part_row(split, b, t, h) * headdim + col) = v;
    if (write_lse) { lse_part[part_lse_index(split, b, t, h)] = row_lse; }
  }
};

// Merges the splits' parts: one warp per output row (b, t, h). Launched as a programmatic dependent of the
// decode kernel (flash_decode_launch.h), so its launch overlaps the decode kernel's tail.
template <class Element>
struct SplitCombine {
  using Params = DecodeParams;
  static constexpr int kNumThreads = 128;
  static constexpr int kMinBlocksPerSm = 1;
  static constexpr int kSharedStorageBytes = 0;
  static constexpr int kRowsPerCta = kNumThreads / 32;

  static dim3 grid(DecodeParams const& p) {
    int64_t const rows = int64_t(p.batch) * p.seqlen_q * p.nheads;
    return dim3(unsigned((rows + kRowsPerCta - 1) / kRowsPerCta));
  }

  static __device__ void run(Params const& p, char*) {
    wait_for_primary_grid();  // the parts are the decode kernel's
    int const lane = threadIdx.x % 32;
    int64_t const row = int64_t(blockIdx.x) * kRowsPerCta + threadIdx.x / 32;
    if (row >= int64_t(p.batch) * p.seqlen_q * p.nheads) return;
    int const h = int(row % p.nheads), t = int((row / p.nheads) % p.seqlen_q), b = int(row / (int64_t(p.nheads) * p.seqlen_q));
    SplitOutput const out = SplitOutput::of(p);
    LseMerge merge;
    for (int s = lane; s < p.num_splits; s += 32) { merge.add(out.lse_part[out.part_lse_index(s, b, t, h)]); }
    CUTLASS_PRAGMA_UNROLL
    for (int offset = 16; offset > 0; offset /= 2) {
      LseMerge other;
      other.max = __shfl_xor_sync(0xffffffffu, merge.max, offset);
      other.sum = __shfl_xor_sync(0xffffffffu, merge.sum, offset);
      merge.add(other);
    }
    float const lse = merge.lse();
    for (int col = lane * 4; col < p.headdim; col += 128) {
      float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int s = 0; s < p.num_splits; ++s) {
        float const weight = LseMerge::weight(out.lse_part[out.part_lse_index(s, b, t, h)], lse);
        if (weight == 0.f) continue;
        float4 const part = *reinterpret_cast<float4 const*>(out.o_part + out.part_row(s, b, t, h) * p.headdim + col);
        o.x += weight * part.x;
        o.y += weight * part.y;
        o.z += weight * part.z;
        o.w += weight * part.w;
      }
      out.store_final<Element>(b, t, h, col, o, lse, col == 0);
    }
  }
};

}  // namespace flash
