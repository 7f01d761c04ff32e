// Declaration of the per-configuration launchers defined in hopper/instantiations/*.cu.
#pragma once

#include <cuda_runtime.h>

#include "flash.h"

namespace flash {

template <class Element, int kHeadDim, bool kIsCausal>
void run_flash_fwd(FwdParams const& params, cudaStream_t stream);

}  // namespace flash
