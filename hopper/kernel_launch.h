// Host side of launching a kernel class (a struct with Params, kNumThreads, kSharedStorageBytes and a
// device run()): the __global__ entry point, CUDA error checks, the per-device facts a launch needs,
// looked up once per device rather than on every call, and programmatic dependent launches.
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

// Programmatic dependent launch: a kernel launched with `dependent` may start while the kernel before it in
// the stream (the primary) still runs, once every CTA of the primary has called allow_dependent_launch (or
// exited). It must call wait_for_primary_grid before it reads or writes anything the primary writes or reads;
// the wait returns when the primary has completed and its memory is visible. Not CUTLASS's
// launch_dependent_grids / wait_on_dependent_grids: theirs carry no "memory" clobber, so the compiler could
// move loads above the wait.
__device__ __forceinline__ void allow_dependent_launch() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }
__device__ __forceinline__ void wait_for_primary_grid() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

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
// attribute of the function) is raised on the first launch on each device. `dependent`: a programmatic
// dependent launch (above).
template <class Kernel>
void launch_kernel(dim3 grid, typename Kernel::Params const& params, int device, cudaStream_t stream,
                   bool dependent = false) {
  static std::atomic<bool> attribute_set[kMaxDevices] = {};
  auto kernel = &device_kernel<Kernel>;
  constexpr int kSmemBytes = Kernel::kSharedStorageBytes;
  if (!attribute_set[device].load(std::memory_order_acquire)) {
    FLASH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    attribute_set[device].store(true, std::memory_order_release);
  }
  if (!dependent) {
    kernel<<<grid, Kernel::kNumThreads, kSmemBytes, stream>>>(params);
    FLASH_CUDA_CHECK(cudaGetLastError());
    return;
  }
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(Kernel::kNumThreads);
  config.dynamicSmemBytes = kSmemBytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  FLASH_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, params));
}

}  // namespace flash
