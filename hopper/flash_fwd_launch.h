// Host side of one forward kernel instantiation: parameters, grid, launch, registration. Included only by
// the generated instantiation files (hopper/instantiations/flash_fwd_*.cu).
#pragma once

#include <cuda_runtime.h>

#include "flash.h"
#include "flash_fwd_kernel.h"
#include "kernel_launch.h"
#include "kernel_registry.h"
#include "tile_size.h"

namespace flash {

template <class Element, int kHeadDim, bool kIsCausal>
struct FwdLauncher {
  using Config = FwdConfig<Element, kHeadDim, kIsCausal>;
  using Policy = FwdLaunchPolicy<Config>;

  static size_t workspace_bytes(FwdParams const& p) { return Policy::workspace_bytes(p); }

  static void run(FwdParams const& p, cudaStream_t stream) {
    int const device = current_device();
    auto const mode = Policy::launch_mode(p);
    dim3 const grid = Policy::scheduler(p).grid(mode.persistent, num_sms(device));
    if constexpr (Policy::kPersistentCapable) {
      if (mode.persistent) {
        if (mode.dynamic) { FLASH_CUDA_CHECK(cudaMemsetAsync(p.workspace, 0, Policy::workspace_bytes(p), stream)); }
        using Kernel = FwdKernel<Config, /*kPersistent=*/true>;
        launch_kernel<Kernel>(grid, Kernel::to_params(p), device, stream);
        return;
      }
    }
    using Kernel = FwdKernel<Config, /*kPersistent=*/false>;
    launch_kernel<Kernel>(grid, Kernel::to_params(p), device, stream);
  }
};

template <class Element, int kHeadDim, bool kIsCausal>
struct FwdKernelRegistration : KernelRegistration<FwdParams> {
  using Launcher = FwdLauncher<Element, kHeadDim, kIsCausal>;
  FwdKernelRegistration()
      : KernelRegistration<FwdParams>(kHeadDim, dtype_name<Element>(), kIsCausal, &Launcher::run, &Launcher::workspace_bytes) {}
};

}  // namespace flash
