// Host side of one forward kernel instantiation: parameters, grid, launch, registration. Included only by
// the generated instantiation files (hopper/instantiations/flash_fwd_*.cu).
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "flash.h"
#include "flash_fwd_kernel.h"
#include "kernel_launch.h"
#include "kernel_registry.h"
#include "tile_size.h"
#include "varlen.h"

namespace flash {

template <class Element, int kHeadDim, bool kIsCausal, bool kVColMajor = false>
struct FwdLauncher {
  using Config = FwdConfig<Element, kHeadDim, kIsCausal, FwdTiles::kBase, kVColMajor>;
  using Policy = FwdLaunchPolicy<Config>;  // decides the launch form, and the workspace, for every configuration
  // Taller or wider tiles for one CTA per tile, where tile_size.h gives them (kBlockMLong, kBlockNLong): dense
  // calls that Policy does not run persistent. Varlen calls keep Config's tiles, which VarlenPrepare's tile
  // list is made of, except where Policy::kVarlenByKeyLimit, whose long tiles have the same rows.
  using LongConfig = FwdConfig<Element, kHeadDim, kIsCausal, FwdTiles::kLong, kVColMajor>;
  static_assert(!Policy::kVarlenByKeyLimit || LongConfig::kBlockM == Config::kBlockM, "varlen: one tile list");
  // Config's tiles with more K/V stages and no chaining, persistent, for dense calls of mid-length keys where
  // tile_size.h gives them (kStagesMid). Non-causal only: no tile counter in the workspace.
  using MidConfig = FwdConfig<Element, kHeadDim, kIsCausal, FwdTiles::kMid, kVColMajor>;

  static size_t workspace_bytes(FwdParams const& p) { return Policy::workspace_bytes(p); }

  static void run(FwdParams const& p, cudaStream_t stream) {
    // The layout of V is this kernel's template parameter: a V in the other one would be read wrong, silently.
    if (p.v_colmajor != kVColMajor) {
      throw std::invalid_argument(std::string("flash_ext: v given ") + (p.v_colmajor ? "column" : "row") +
                                  "-major to a forward kernel compiled for the other layout");
    }
    int const device = current_device();
    auto const mode = Policy::launch_mode(p);
    // The kernel's parameters hold the tile scheduler, which also gives the grid: built once per call.
    auto launch = [&](auto kernel) {
      using Kernel = decltype(kernel);
      auto const params = Kernel::to_params(p);
      launch_kernel<Kernel>(params.scheduler.grid(mode.persistent, num_sms(device)), params, device, stream);
    };
    if (p.varlen.enabled()) { launch_kernel<VarlenPrepare>(dim3(1), Policy::varlen_prepare(p), device, stream); }
    if constexpr (Config::kHasLongTiles) {
      // Never persistent: FwdLaunchPolicy<LongConfig> finds at least as many keys per tile (its tiles are
      // as tall or taller) against the same limit, so its scheduler agrees that this launch is one CTA per
      // tile.
      if (mode.tiles == FwdTiles::kLong) {
        launch(FwdKernel<LongConfig, /*kPersistent=*/false>{});
        return;
      }
    }
    if constexpr (Config::kHasMidTiles) {
      if (mode.tiles == FwdTiles::kMid) {  // persistent (mode.persistent), a static walk
        launch(FwdKernel<MidConfig, /*kPersistent=*/true>{});
        return;
      }
    }
    if constexpr (Policy::kPersistentCapable) {
      if (mode.persistent) {
        if (mode.dynamic) { FLASH_CUDA_CHECK(cudaMemsetAsync(Policy::counter(p), 0, sizeof(int), stream)); }
        launch(FwdKernel<Config, /*kPersistent=*/true>{});
        return;
      }
    }
    launch(FwdKernel<Config, /*kPersistent=*/false>{});
  }
};

template <class Element, int kHeadDim, bool kIsCausal, bool kVColMajor = false>
struct FwdKernelRegistration : KernelRegistration<FwdParams> {
  using Launcher = FwdLauncher<Element, kHeadDim, kIsCausal, kVColMajor>;
  FwdKernelRegistration()
      : KernelRegistration<FwdParams>(kHeadDim, dtype_name<Element>(), kIsCausal, &Launcher::run, &Launcher::workspace_bytes,
                                      kVColMajor) {}
};

}  // namespace flash
