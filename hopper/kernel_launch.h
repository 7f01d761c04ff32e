// Host side of launching a kernel class (a struct with Params, kNumThreads, kSharedStorageBytes and a
// device run()): the __global__ entry point, CUDA error checks, and the per-device facts a launch needs,
// looked up once per device rather than on every call.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <stdexcept>
#include <string>

#include <cute/tensor.hpp>

// Turns a failed CUDA runtime call on the host into a C++ exception (surfaced in Python as RuntimeError).
#define FLASH_CUDA_CHECK(call)                                                                          \
  do {                                                                                                 \
    cudaError_t const flash_cuda_status_ = (call);                                                      \
    if (flash_cuda_status_ != cudaSuccess) {                                                            \
      throw std::runtime_error(std::string("flash_ext CUDA error: ") + cudaGetErrorString(flash_cuda_status_) + \
                               " at " __FILE__ ":" + std::to_string(__LINE__) + " (" #call ")");        \
    }                                                                                                  \
  } while (0)

namespace flash {

// The one __global__ function of every kernel class: the parameters live in the kernel's constant bank
// (TMA descriptors must), shared memory is all dynamic.
template <class Kernel>
__global__ void __launch_bounds__(Kernel::kNumThreads, Kernel::kMinBlocksPerSm)
    device_kernel(CUTE_GRID_CONSTANT typename Kernel::Params const params) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ char smem[];
  Kernel::run(params, smem);
#endif
}

constexpr int kMaxDevices = 64;

inline int current_device() {
  int device = 0;
  FLASH_CUDA_CHECK(cudaGetDevice(&device));
  if (device >= kMaxDevices) { throw std::runtime_error("flash_ext supports device indices below 64"); }
  return device;
}

// Multiprocessor count of a device, read once.
inline int num_sms(int device) {
  static std::atomic<int> cached[kMaxDevices] = {};
  int n = cached[device].load(std::memory_order_relaxed);
  if (n == 0) {
    FLASH_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    cached[device].store(n, std::memory_order_relaxed);
  }
  return n;
}

// Launches Kernel on the current device and stream; the dynamic shared-memory limit (a per-device
// attribute of the function) is raised on the first launch on each device.
template <class Kernel>
void launch_kernel(dim3 grid, typename Kernel::Params const& params, int device, cudaStream_t stream) {
  static std::atomic<bool> attribute_set[kMaxDevices] = {};
  auto kernel = &device_kernel<Kernel>;
  constexpr int kSmemBytes = Kernel::kSharedStorageBytes;
  if (!attribute_set[device].load(std::memory_order_acquire)) {
    FLASH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    attribute_set[device].store(true, std::memory_order_release);
  }
  kernel<<<grid, Kernel::kNumThreads, kSmemBytes, stream>>>(params);
  FLASH_CUDA_CHECK(cudaGetLastError());
}

}  // namespace flash
