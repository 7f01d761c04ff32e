// dQ of the backward. Every CTA (one K/V block) contributes dS K to the dQ of each query block it sees;
// the contributions are added into an fp32 accumulator in global memory (workspace), which the
// postprocess kernel scales and converts to dq.
//
// The consumers stage their fragments in shared memory (consumer_store); one warp of the producer
// warpgroup adds each staged block to global memory with a bulk reduce-add (cp.reduce.async.bulk .add.f32),
// so the consumers never wait on global memory. The accumulator keeps the fragment order: value v of
// consumer thread t lands at float ((v / 4) * kNumMmaThreads + t) * 4 + v % 4 of the block (conflict-free
// 16-byte stores), and the postprocess kernel reads it back through the same TiledMma.
//
// Deterministic mode: per (batch, head, query block) a semaphore counts the K/V blocks that have added
// their contribution; K/V block n waits until it reads n, adds, waits for the add to complete, and
// writes n + 1. The K/V blocks that see a query block are always 0 .. n_max - 1 (mask.h), and CTAs start
// in block order, so every wait ends.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "named_barriers.h"

namespace flash {

using namespace cute;

template <int kBlockM, int kHeadDim, int kNumMmaThreads>
struct DqAccumulator {
  static constexpr int kBlockFloats = kBlockM * kHeadDim;
  static constexpr uint32_t kBarrierThreads = kNumMmaThreads + cutlass::NumThreadsPerWarp;  // + the writer warp

  struct TensorStorage {
    alignas(128) float smem_dq[kBlockFloats];
  };

  struct Params {
    float* accum;     // (batch, nheads, num_m_blocks, kBlockFloats), zeroed before the kernel
    int* semaphores;  // (batch, nheads, num_m_blocks), zeroed; deterministic mode only
    bool deterministic;
  };

  // Consumers, once per query block: wait for the buffer, stage the fragment, hand it to the writer.
  template <class FragdQ>
  __device__ static void consumer_store(TensorStorage& storage, FragdQ const& tdQrdQ, int thread_idx) {
    constexpr int kValues = decltype(size(tdQrdQ))::value;
    static_assert(kValues % 4 == 0);
    cutlass::arch::NamedBarrier::sync(kBarrierThreads, uint32_t(BwdNamedBarriers::kdQEmpty));
    float4* dst = reinterpret_cast<float4*>(storage.smem_dq);
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kValues / 4; ++j) {
      dst[j * kNumMmaThreads + thread_idx] = make_float4(tdQrdQ(4 * j), tdQrdQ(4 * j + 1), tdQrdQ(4 * j + 2), tdQrdQ(4 * j + 3));
    }
    cutlass::arch::fence_view_async_shared();  // generic-proxy writes, read next by the bulk copy unit
    cutlass::arch::NamedBarrier::arrive(kBarrierThreads, uint32_t(BwdNamedBarriers::kdQFull));
  }

  // The writer warp (all 32 lanes), before its first block: the buffer starts empty.
  __device__ static void writer_start() {
    cutlass::arch::NamedBarrier::arrive(kBarrierThreads, uint32_t(BwdNamedBarriers::kdQEmpty));
  }

  // The writer warp, once per query block in the consumers' order: adds the staged block to block
  // `block_index` of the accumulator. `n_block` orders the additions in deterministic mode.
  __device__ static void writer_add(Params const& params, TensorStorage& storage, int64_t block_index, int n_block,
                                    bool is_last) {
    cutlass::arch::NamedBarrier::sync(kBarrierThreads, uint32_t(BwdNamedBarriers::kdQFull));
    bool const leader = cute::elect_one_sync();
    int* semaphore = params.semaphores + block_index;
    if (leader) {
      if (params.deterministic) {
        while (load_acquire(semaphore) != n_block) {}
        asm volatile("fence.proxy.async.global;" ::: "memory");  // the bulk add follows the acquire
      }
      bulk_reduce_add(params.accum + block_index * kBlockFloats, storage.smem_dq, kBlockFloats * int(sizeof(float)));
      tma_store_arrive();   // commit the bulk group
      tma_store_wait<0>();  // ... until it has read the staging buffer
    }
    __syncwarp();
    if (!is_last) {
      cutlass::arch::NamedBarrier::arrive(kBarrierThreads, uint32_t(BwdNamedBarriers::kdQEmpty));
    }
    if (leader && params.deterministic) {
      asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // the add itself has completed
      asm volatile("fence.proxy.async.global;" ::: "memory");
      store_release(semaphore, n_block + 1);
    }
  }

 private:
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
