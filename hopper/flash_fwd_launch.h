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
void run_flash_fwd(FwdParams const& p, cudaStream_t stream) {
  using Kernel = FwdKernel<FwdConfig<Element, kHeadDim, kIsCausal>>;
  int const device = current_device();
  launch_kernel<Kernel>(Kernel::grid(p, num_sms(device)), Kernel::to_params(p), device, stream);
}

template <class Element, int kHeadDim, bool kIsCausal>
struct FwdKernelRegistration : KernelRegistration<FwdParams> {
  FwdKernelRegistration()
      : KernelRegistration<FwdParams>(kHeadDim, dtype_name<Element>(), kIsCausal, &run_flash_fwd<Element, kHeadDim, kIsCausal>) {}
};

}  // namespace flash
