// Host-side description of one decode call (flash_attn_with_kvcache), filled by csrc/flash_api.cpp: its own
// header, so the decode kernels build without touching the attention kernels' flash.h users.
#pragma once

#include <cstdint>

#include "flash.h"

namespace flash {

// n / divisor for 0 <= n < 2^31 as a multiply-high and a shift (the round-up magic number of Granlund and
// Montgomery): with s = ceil(log2 d) and m = ceil(2^(31 + s) / d) < 2^32, n / d = (n * m) >> (31 + s), exact
// because m * d - 2^(31 + s) < d <= 2^s. The arithmetic of cutlass::FastDivmod (which the attention kernels'
// schedulers make in nvcc-compiled launch code), written out here because DecodeParams is filled in
// csrc/flash_api.cpp, which g++ compiles: cutlass/fast_math.h there would pull in CUDA's libcu++ headers
// (another include path, and CUTLASS's platform headers with their deprecation warnings) for 15 lines.
struct FastDivisor {
  int divisor = 1;
  uint32_t multiplier = 0, shift = 0;

  static FastDivisor of(int d) {
    FastDivisor f;
    f.divisor = d;
    if (d > 1) {
      uint32_t s = 0;
      while ((1u << s) < uint32_t(d)) ++s;
      f.multiplier = uint32_t(((uint64_t(1) << (31 + s)) + uint64_t(d) - 1) / uint64_t(d));
      f.shift = s - 1;  // after the multiply-high's 32
    }
    return f;
  }
#ifdef __CUDACC__
  __device__ __forceinline__ int div(int n) const {
    return divisor == 1 ? n : int(__umulhi(uint32_t(n), multiplier) >> shift);
  }
#endif
};

// Decoding from a KV cache (flash_attn_with_kvcache; decode_kernel.h). q holds seqlen_q new tokens per
// sequence; the keys of sequence b are the cache_seqlens[b] cached ones followed by its seqlen_new new ones
// (k_new, v_new), which the kernel also writes into the cache. The caches are either contiguous,
// (entries, seqlen_cache, nheads_kv, headdim) with cache_batch_idx[b] (or b) the entry of sequence b, or
// paged, (num_pages, page_size, nheads_kv, headdim) with page_table[b] listing sequence b's pages. The
// kernel clamps every index and length it reads from device memory into range, so no value makes it
// access memory outside the tensors.
struct DecodeParams {
  StridedTensor q, o;          // (batch, seqlen_q, nheads, headdim); o in q's dtype (bf16 for FP8)
  float* lse;                  // (batch, nheads, seqlen_q), contiguous
  StridedTensor k_cache, v_cache;  // batch_stride steps entries, or pages when page_table is set
  StridedTensor k_new, v_new;      // (batch, seqlen_new, nheads_kv, headdim); ptr nullptr when seqlen_new = 0
  DescaleTensor q_descale, k_descale, v_descale;  // FP8 (e4m3) q and caches only
  int const* cache_seqlens;        // (batch,)
  int const* cache_batch_idx;      // (batch,) or nullptr
  int const* page_table;           // (batch, pages_per_seq) or nullptr
  int64_t page_table_batch_stride;
  int page_size, pages_per_seq;
  FastDivisor page_divisor;  // page_size, for a key's page without an integer division
  int cache_entries;   // entries (contiguous) or pages (paged): the bound of cache_batch_idx / page_table values
  int seqlen_new;
  // Sizes as the attention kernels' parameters hold them (flash_api.cpp's set_sizes); seqlen_k is the keys a
  // sequence can hold: seqlen_cache, or pages_per_seq * page_size.
  int batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim;
  float softmax_scale;
  ScoreOptions options;  // causal folded in as the window (-1, 0)
  int num_splits;        // 0: the launcher's heuristic; else the key range of a sequence is split this many ways
  void* workspace;       // the registry entry's workspace_bytes(): the splits' partial O and LSE
  // Set by the launcher (softcap.h's ScoreScales): tanh's pre-scale (0: no softcap) and the exp2 scale.
  float softcap_pre_scale, softmax_scale_log2;
};

}  // namespace flash
