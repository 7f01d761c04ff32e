// Ping-pong between the consumer warpgroups: they take turns issuing their GEMMs (round robin, through
// named barriers), so one warpgroup's softmax runs while the tensor cores execute another's GEMMs.
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>

#include "named_barriers.h"

namespace flash {

template <int kNumMmaWarpGroups>
struct WarpgroupScheduler {
  static constexpr uint32_t kTurnThreads = 2 * cutlass::NumThreadsPerWarpGroup;  // the waiter and the one handing over
  int const warpgroup;  // consumer warpgroup index, 0 .. kNumMmaWarpGroups - 1
  bool const enabled;

  __device__ __forceinline__ WarpgroupScheduler(int warpgroup_, bool enabled_) : warpgroup(warpgroup_), enabled(enabled_) {}

  static __device__ __forceinline__ uint32_t barrier(int wg) { return uint32_t(FwdNamedBarriers::kWarpgroupTurn0) + wg; }

  // Warpgroup 0 takes the first turn: the last one hands it over before anyone starts.
  __device__ __forceinline__ void start() const {
    if (enabled && warpgroup == kNumMmaWarpGroups - 1) { cutlass::arch::NamedBarrier::arrive(kTurnThreads, barrier(0)); }
  }
  __device__ __forceinline__ void wait_turn() const {
    if (enabled) { cutlass::arch::NamedBarrier::sync(kTurnThreads, barrier(warpgroup)); }
  }
  __device__ __forceinline__ void pass_turn() const {
    if (enabled) { cutlass::arch::NamedBarrier::arrive(kTurnThreads, barrier((warpgroup + 1) % kNumMmaWarpGroups)); }
  }
  // Warpgroup 0 receives one hand-over more than it waits for in the loop (the one from start or the last
  // turn): consume it so every barrier phase completes before the CTA moves on.
  __device__ __forceinline__ void finish() const {
    if (enabled && warpgroup == 0) { cutlass::arch::NamedBarrier::sync(kTurnThreads, barrier(0)); }
  }
};

}  // namespace flash
