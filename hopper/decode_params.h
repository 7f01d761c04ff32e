// Host-side description of one decode call (flash_attn_with_kvcache), filled by csrc/flash_api.cpp: its own
// header, so the decode kernels build without touching the attention kernels' flash.h users.
#pragma once

#include <cstdint>

#include "flash.h"

namespace flash {

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
