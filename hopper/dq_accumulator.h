// dQ of the backward. Every CTA (one K/V block) contributes dS K to the dQ of each query block it sees;
// the contributions are added into an fp32 accumulator in global memory (workspace), which the
// postprocess kernel scales and converts to dq.
//
// Two ways in, by what shared memory allows:
// - staged (consumer_store; up to d128): each consumer warpgroup stages its half of the block in shared
//   memory; one warp of the producer warpgroup adds each half to global memory with a bulk reduce-add
//   (cp.reduce.async.bulk .add.f32) as soon as it is staged, and hands it back as soon as it is read, so the
//   consumers never wait on global memory, nor the warpgroups for each other (FA3's order; +1-5% over staging
//   the whole block, perf-notes sections 55 and 56);
// - from registers (consumer_add): float4 reductions straight from the consumers' registers, where no
//   shared memory is left for staging (d256); `red`, which returns nothing, not `atom` (atomicAdd): +17%
//   at d256 (perf-notes section 16), the adds being bound by the L2 traffic.
// The accumulator keeps the fragment order (float4_index): from registers, value v of consumer thread t lands
// at float ((v / 4) * kNumMmaThreads + t) * 4 + v % 4 of the block; staged, at that place in its warpgroup's
// half, counting the threads of one warpgroup instead (conflict-free 16-byte accesses either way); the
// postprocess kernel reads it back through the same TiledMma and float4_index.
//
// Deterministic mode: per (batch, head, query block) a semaphore counts the K/V blocks that have added
// their contribution; the K/V block of rank r (its place among the blocks that see the query block, in
// the order the CTAs start; the kernel computes it) waits until it reads r, adds, waits for the add to
// complete, and writes r + 1 (from registers: the consumers own the block between the two and add with
// plain loads and stores). Every wait is for CTAs that started earlier, so every wait ends.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "named_barriers.h"

namespace flash {

using namespace cute;

template <int kBlockM, int kHeadDim, int kNumMmaThreads, bool kStaged_>
struct DqAccumulator {
  static constexpr int kBlockFloats = kBlockM * kHeadDim;
  static constexpr bool kStaged = kStaged_;  // false: from registers (the mainloop's kDqFromRegisters)
  static constexpr int kWarpgroups = kNumMmaThreads / cutlass::NumThreadsPerWarpGroup;
  static_assert(!kStaged || kWarpgroups == 2, "staged dQ: a barrier pair for each of two warpgroups (named_barriers.h)");
  static constexpr uint32_t kHalfBarrierThreads = cutlass::NumThreadsPerWarpGroup + cutlass::NumThreadsPerWarp;  // + the writer warp
  // Where float4 j of consumer thread t lives in a block (global memory and the staging buffer alike), in
  // float4s. Staged: each warpgroup's half contiguous, so that it is added on its own.
  __host__ __device__ static constexpr int float4_index(int j, int t) {
    if constexpr (kStaged) {
      return (t / cutlass::NumThreadsPerWarpGroup) * (kBlockFloats / 4 / kWarpgroups) + j * cutlass::NumThreadsPerWarpGroup +
             t % cutlass::NumThreadsPerWarpGroup;
    } else {
      return j * kNumMmaThreads + t;
    }
  }

  struct TensorStorage {
    alignas(128) float smem_dq[kBlockFloats];  // one buffer: two measured no faster (perf-notes sections 12, 17)
  };

  struct Params {
    float* accum;     // (batch, nheads, num_m_blocks, kBlockFloats), zeroed by the preprocess kernel (bwd_preprocess.h)
    int* semaphores;  // (batch, nheads, num_m_blocks), zeroed; deterministic mode only
    bool deterministic;
  };

  static __device__ __forceinline__ uint32_t empty_barrier(int wg) { return uint32_t(BwdNamedBarriers::kdQEmpty0) + wg; }
  static __device__ __forceinline__ uint32_t full_barrier(int wg) { return uint32_t(BwdNamedBarriers::kdQFull0) + wg; }

  // Consumers, per query block: wait for their warpgroup's half of the buffer, stage the fragment, hand the half
  // to the writer.
  template <class FragdQ>
  __device__ static void consumer_store(TensorStorage& storage, FragdQ const& tdQrdQ, int thread_idx) {
    constexpr int kValues = decltype(size(tdQrdQ))::value;
    static_assert(kValues % 4 == 0);
    int const wg = thread_idx / cutlass::NumThreadsPerWarpGroup;
    cutlass::arch::NamedBarrier::sync(kHalfBarrierThreads, empty_barrier(wg));
    float4* dst = reinterpret_cast<float4*>(storage.smem_dq);
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kValues / 4; ++j) {
      dst[float4_index(j, thread_idx)] = make_float4(tdQrdQ(4 * j), tdQrdQ(4 * j + 1), tdQrdQ(4 * j + 2), tdQrdQ(4 * j + 3));
    }
    cutlass::arch::fence_view_async_shared();  // generic-proxy writes, read next by the bulk copy unit
    cutlass::arch::NamedBarrier::arrive(kHalfBarrierThreads, full_barrier(wg));
  }

  // The writer warp (all 32 lanes), before its first block of `count`: both halves start empty.
  __device__ static void writer_start(int count) {
    if (count > 0) {
      for (int wg = 0; wg < kWarpgroups; ++wg) { cutlass::arch::NamedBarrier::arrive(kHalfBarrierThreads, empty_barrier(wg)); }
    }
  }

  // Deterministic mode, the writer's leader lane: the additions to one accumulator block take turns by rank (the
  // semaphore holds the next rank); wait_turn before this rank's bulk adds, pass_turn once they have completed.
  __device__ static void wait_turn(Params const& params, int const* semaphore, int rank) {
    if (params.deterministic) {
      while (load_acquire(semaphore) != rank) {}
      asm volatile("fence.proxy.async.global;" ::: "memory");  // the bulk adds follow the acquire
    }
  }
  __device__ static void pass_turn(Params const& params, int* semaphore, int rank) {
    if (params.deterministic) {
      asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // the adds themselves have completed
      asm volatile("fence.proxy.async.global;" ::: "memory");
      store_release(semaphore, rank + 1);
    }
  }

  // The writer warp, for the i-th of `count` query blocks, in the consumers' order: adds the staged block to
  // block `block_index` of the accumulator, each warpgroup's half as soon as that warpgroup has staged it, and
  // hands each half back as soon as it is read: the warpgroups do not wait for each other here (FA3's order).
  // `rank` orders the additions in deterministic mode.
  __device__ static void writer_add(Params const& params, TensorStorage& storage, int64_t block_index, int rank, int i,
                                    int count) {
    constexpr int kPartFloats = kBlockFloats / kWarpgroups;
    bool const leader = cute::elect_one_sync();
    int* semaphore = params.semaphores + block_index;
    if (leader) { wait_turn(params, semaphore, rank); }
    CUTLASS_PRAGMA_UNROLL
    for (int wg = 0; wg < kWarpgroups; ++wg) {
      cutlass::arch::NamedBarrier::sync(kHalfBarrierThreads, full_barrier(wg));
      if (leader) {
        bulk_reduce_add(params.accum + block_index * kBlockFloats + wg * kPartFloats, storage.smem_dq + wg * kPartFloats,
                        kPartFloats * int(sizeof(float)));
        tma_store_arrive();
      }
    }
    CUTLASS_PRAGMA_UNROLL
    for (int wg = 0; wg < kWarpgroups; ++wg) {
      if (leader) {
        if (wg == 0) { tma_store_wait<kWarpgroups - 1>(); } else { tma_store_wait<0>(); }
      }
      __syncwarp();
      if (i + 1 < count) { cutlass::arch::NamedBarrier::arrive(kHalfBarrierThreads, empty_barrier(wg)); }
    }
    if (leader) { pass_turn(params, semaphore, rank); }
  }

  // Consumers, from registers: adds the fragment of dQ slice `slice` (of kSlices, computed in turn) to block
  // `block_index` of the accumulator. A thread's fragment of the block is its slices' fragments one after
  // the other, so slice j starts j slices' worth of floats into the block.
  template <int kSlices, class FragdQ>
  __device__ static void consumer_add(Params const& params, FragdQ const& tdQrdQ, int thread_idx, int64_t block_index,
                                      int rank, int slice) {
    constexpr int kValues = decltype(size(tdQrdQ))::value;
    static_assert(kValues % 4 == 0 && kSlices * kValues * kNumMmaThreads == kBlockFloats);
    float4* dst = reinterpret_cast<float4*>(params.accum + block_index * kBlockFloats);
    int const j0 = slice * (kValues / 4);
    if (!params.deterministic) {
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kValues / 4; ++j) {
        red_add(dst + float4_index(j0 + j, thread_idx), tdQrdQ(4 * j), tdQrdQ(4 * j + 1), tdQrdQ(4 * j + 2), tdQrdQ(4 * j + 3));
      }
      return;
    }
    // Deterministic: the consumers own the block from before the first slice's adds to after the last's.
    int* semaphore = params.semaphores + block_index;
    if (slice == 0) {
      if (thread_idx == 0) {
        while (load_acquire(semaphore) != rank) {}
      }
      cutlass::arch::NamedBarrier::sync(kNumMmaThreads, uint32_t(BwdNamedBarriers::kdQOwned));
    }
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kValues / 4; ++j) {
      float4 v = __ldcg(dst + float4_index(j0 + j, thread_idx));  // from L2: this SM's L1 may hold an older copy
      v.x += tdQrdQ(4 * j), v.y += tdQrdQ(4 * j + 1), v.z += tdQrdQ(4 * j + 2), v.w += tdQrdQ(4 * j + 3);
      dst[float4_index(j0 + j, thread_idx)] = v;
    }
    if (slice == kSlices - 1) {
      __threadfence();
      cutlass::arch::NamedBarrier::sync(kNumMmaThreads, uint32_t(BwdNamedBarriers::kdQOwned));
      if (thread_idx == 0) { store_release(semaphore, rank + 1); }
    }
  }

 private:
  // A reduction without a return value (red, not atom): the SM does not wait for the old value.
  __device__ static void red_add(float4* gmem, float x, float y, float z, float w) {
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" : : "l"(gmem), "f"(x), "f"(y), "f"(z), "f"(w) : "memory");
  }
  __device__ static void bulk_reduce_add(float* gmem, float const* smem, int bytes) {
    uint32_t const smem_addr = cute::cast_smem_ptr_to_uint(smem);
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                 :
                 : "l"(gmem), "r"(smem_addr), "r"(bytes)
                 : "memory");
  }
  __device__ static int load_acquire(int const* ptr) {
    int value;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
    return value;
  }
  __device__ static void store_release(int* ptr, int value) {
    asm volatile("st.release.gpu.global.b32 [%0], %1;" : : "l"(ptr), "r"(value) : "memory");
  }
};

}  // namespace flash
