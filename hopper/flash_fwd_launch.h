// Host side of one forward kernel instantiation: TMA descriptors, grid, shared memory, launch.
// Included only by the generated instantiation files (hopper/instantiations/*.cu).
#pragma once

#include <cuda_runtime.h>

#include <cute/tensor.hpp>

#include "flash.h"
#include "flash_fwd_kernel.h"
#include "kernel_traits.h"
#include "launch_check.h"
#include "tile_scheduler.h"

namespace flash {

template <class Element, int kHeadDim, bool kIsCausal>
void run_flash_fwd(FwdParams const& p, cudaStream_t stream) {
  using Traits = FwdKernelTraits<Element, kHeadDim, kIsCausal>;
  using KernelParams = FwdKernelParams<Traits>;
  using TileShapeMNK = typename Traits::TileShapeMNK;

  auto const shape_q = make_shape(p.seqlen_q, p.headdim, p.nheads, p.batch);
  auto const shape_k = make_shape(p.seqlen_k, p.headdim, p.nheads_kv, p.batch);
  auto gmem = [](auto* ptr, auto const& shape, int64_t row_stride, int64_t head_stride, int64_t batch_stride) {
    return make_tensor(make_gmem_ptr(ptr), shape, make_stride(row_stride, _1{}, head_stride, batch_stride));
  };
  auto mQ = gmem(static_cast<Element const*>(p.q_ptr), shape_q, p.q_row_stride, p.q_head_stride, p.q_batch_stride);
  auto mK = gmem(static_cast<Element const*>(p.k_ptr), shape_k, p.k_row_stride, p.k_head_stride, p.k_batch_stride);
  auto mV = gmem(static_cast<Element const*>(p.v_ptr), shape_k, p.v_row_stride, p.v_head_stride, p.v_batch_stride);
  auto mO = gmem(static_cast<Element*>(p.o_ptr), shape_q, p.o_row_stride, p.o_head_stride, p.o_batch_stride);

  KernelParams const kernel_params{
      shape_q,
      shape_k,
      make_tma_copy(SM90_TMA_LOAD{}, mQ, typename Traits::SmemLayoutQ{}, select<0, 2>(TileShapeMNK{}), _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, mK, take<0, 2>(typename Traits::SmemLayoutK{}), select<1, 2>(TileShapeMNK{}), _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, mV, take<0, 2>(typename Traits::SmemLayoutV{}), select<1, 2>(TileShapeMNK{}), _1{}),
      make_tma_copy(SM90_TMA_STORE{}, mO, typename Traits::SmemLayoutO{}, select<0, 2>(TileShapeMNK{}), _1{}),
      p.lse_ptr,
      p.batch,
      p.seqlen_q,
      p.seqlen_k,
      p.nheads,
      p.nheads / p.nheads_kv,
      float(p.softmax_scale * M_LOG2E),
      p.pingpong < 0 ? Traits::kPingPongDefault : p.pingpong != 0,
  };

  int device = 0, num_sms = 0;
  FLASH_CUDA_CHECK(cudaGetDevice(&device));
  FLASH_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  bool persistent = Traits::kPersistentCapable && ceil_div(p.seqlen_k, Traits::kBlockN) <= Traits::kPersistentMaxBlocks;
  if (p.persistent >= 0) { persistent = Traits::kPersistentCapable && p.persistent != 0; }
  dim3 const grid = TileScheduler<Traits::kBlockM, kIsCausal>(p.seqlen_q, p.nheads, p.batch).grid(persistent, num_sms);
  int const smem_bytes = Traits::kSharedStorageBytes;
  auto kernel = &flash_fwd_kernel<Traits>;
  FLASH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  kernel<<<grid, Traits::kNumThreads, smem_bytes, stream>>>(kernel_params);
  FLASH_CUDA_CHECK(cudaGetLastError());
}

}  // namespace flash
