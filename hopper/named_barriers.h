// Named-barrier ids of the kernels (bar.sync / bar.arrive), offset past CUTLASS's reserved ones by
// cutlass::arch::NamedBarrier. Barrier 0 of the hardware is __syncthreads.
#pragma once

#include <cstdint>

namespace flash {

enum class FwdNamedBarriers : uint32_t {
  kEpilogue = 0,
  kWarpgroupTurn0 = 1,  // + consumer warpgroup index (WarpgroupScheduler)
};

enum class BwdNamedBarriers : uint32_t {
  kdSReady = 0,   // both consumer warpgroups wrote their dS^T rows to shared memory
  kdQEmpty = 1,   // the dQ staging buffer may be written (the writer warp has read the last one)
  kdQFull = 2,    // the dQ staging buffer holds the next block's contribution
  kEpilogue = 3,  // dK/dV staging in K's and V's buffers
};

}  // namespace flash
