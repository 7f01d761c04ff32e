// Named-barrier ids of the kernels (bar.sync / bar.arrive), offset past CUTLASS's reserved ones by
// cutlass::arch::NamedBarrier. Barrier 0 of the hardware is __syncthreads.
#pragma once

#include <cstdint>

namespace flash {

enum class FwdNamedBarriers : uint32_t {
  kEpilogue = 0,
  kWarpgroupTurn0 = 1,  // + consumer warpgroup index (WarpgroupScheduler)
  kEpilogueWarpgroup0 = 4,  // + consumer warpgroup index: a warpgroup's own O store (OStore::kTmaPerWarpgroup)
};

enum class BwdNamedBarriers : uint32_t {
  kdSReady = 0,   // both consumer warpgroups wrote their dS^T rows to shared memory
  kEpilogue = 1,  // dK/dV staging in K's and V's buffers
  kdQEmpty0 = 2,  // + consumer warpgroup: its half of the dQ staging buffer may be written
  kdQFull0 = 4,   // + consumer warpgroup: its half of the staging buffer holds a query block's contribution
  kdQOwned = 6,   // deterministic dQ from registers: this CTA's turn to add to the accumulator block
};

}  // namespace flash
