// Named-barrier ids of the kernels (bar.sync / bar.arrive), offset past CUTLASS's reserved ones by
// cutlass::arch::NamedBarrier. Barrier 0 of the hardware is __syncthreads.
#pragma once

#include <cstdint>

namespace flash {

enum class FwdNamedBarriers : uint32_t {
  kEpilogue = 0,
  kWarpgroupTurn0 = 1,  // + consumer warpgroup index (WarpgroupScheduler)
};

}  // namespace flash
