// Host side of one decode kernel instantiation (decode_kernel.h): the split count, the launches (the decode
// kernel, then SplitCombine when the keys were split) and the registration. Included only by the generated
// instantiation files (hopper/instantiations/flash_decode_*.cu).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>

#include "decode_kernel.h"
#include "decode_params.h"
#include "kernel_launch.h"
#include "kernel_registry.h"
#include "split_combine.h"

namespace flash {

// The most splits a call may ask for (num_splits); the heuristic stays far below.
constexpr int kMaxDecodeSplits = 128;

template <class Element, int kHeadDim>
struct DecodeLauncher {
  using Config = DecodeConfig<Element, kHeadDim>;
  using Kernel = DecodeKernel<Config>;

  static int row_tiles(DecodeParams const& p) {
    int const rows = p.seqlen_q * (p.nheads / p.nheads_kv);
    return std::max((rows + Config::kRows - 1) / Config::kRows, 1);  // one, to append, even without queries
  }

  // CTAs of 4 warps an SM holds, read once per device (which also raises the kernel's shared-memory limit to
  // what 8 warps need).
  static int ctas_per_sm(int device) {
    static std::atomic<int> cached[kMaxDevices] = {};
    int n = cached[device].load(std::memory_order_relaxed);
    if (n == 0) {
      int const limit = Config::shared_bytes(Config::kMaxWarpsFit ? Config::kMaxWarps : Config::kWarps);
      FLASH_CUDA_CHECK(cudaFuncSetAttribute(&device_kernel<Kernel>, cudaFuncAttributeMaxDynamicSharedMemorySize, limit));
      FLASH_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, &device_kernel<Kernel>, Config::kWarps * 32,
                                                                     Config::kSharedBytes));
      n = std::max(n, 1);
      cached[device].store(n, std::memory_order_relaxed);
    }
    return n;
  }

  static constexpr int kMinBlocksPerWarp = 4;
  static constexpr int kMaxHeuristicSplits = 32;
  // 16-bit caches: no split where the unsplit grid already covers this share of the SMs (in percent) and a
  // sequence holds at most kOneSplitMaxKeys keys: half the SMs, each reading its whole sequence, already read
  // at about 90% of the GPU's bandwidth, and a split's fixed cost (the parts written and read back, the
  // combine) is about 5 us. h32/kv8 d128 b8 (64 CTAs) L1k / 2k / 4k: 16.4 / 24.3 / 39.8 us unsplit against
  // 19.5 / 27.5 / 42.2 in two; from 16k keys two splits win (130.7 against 137.0); 32 CTAs want splits at
  // any length. Not FP8 caches, whose CTAs widen every element before its MMA and read less per SM:
  // b8 L4096 35.1 us unsplit against 29.4 (docs/perf-notes.md section 48).
  static constexpr int kOneSplitMinSmPercent = 40;
  static constexpr int kOneSplitMaxKeys = 4096;

  // How a call runs: CTAs of 8 warps (one per SM) when the (sequence, KV head, row tile) triples fit in one
  // CTA per SM, else of 4 warps (two per SM, so that one CTA's loads overlap another's epilogue); the splits
  // are then num_splits, or with 0 the heuristic, from the shapes alone (no device values are read, so CUDA
  // graphs replay with any lengths): none where the grid covers enough SMs for short sequences (above),
  // else enough CTAs for one full wave of the GPU, each warp at least kMinBlocksPerWarp blocks of 16 keys of
  // the cache's capacity (fewer and a split's fixed costs, its pipeline's first loads and the combine,
  // outweigh the parallelism: docs/perf-notes.md section 25).
  struct Plan {
    int warps, splits;
  };
  static Plan plan(DecodeParams const& p) {
    int const device = current_device();
    int64_t const sms = num_sms(device);
    int64_t const ctas = std::max<int64_t>(int64_t(p.batch) * p.nheads_kv * row_tiles(p), 1);
    bool const eight = Config::kMaxWarpsFit && (p.num_splits > 0 ? ctas * p.num_splits : ctas) <= sms;
    int const warps = eight ? Config::kMaxWarps : Config::kWarps;
    if (p.num_splits > 0) return {warps, std::min(p.num_splits, kMaxDecodeSplits)};
    if (!Config::kFp8 && ctas * 100 >= sms * kOneSplitMinSmPercent && p.seqlen_k <= kOneSplitMaxKeys) {
      return {warps, 1};
    }
    int64_t const slots = eight ? sms : sms * ctas_per_sm(device);
    int const key_blocks = (p.seqlen_k + Config::kBlockN - 1) / Config::kBlockN;
    int64_t const useful = std::max(key_blocks / (kMinBlocksPerWarp * warps), 1);
    int64_t const fill = std::max<int64_t>(slots / ctas, 1);
    return {warps, int(std::min<int64_t>({fill, useful, int64_t(kMaxHeuristicSplits)}))};
  }

  static size_t workspace_bytes(DecodeParams const& p) {
    return size_t(SplitOutput::workspace_bytes(plan(p).splits, p.batch, p.seqlen_q, p.nheads, p.headdim));
  }

  // p.workspace must hold workspace_bytes(p).
  static void run(DecodeParams const& p, cudaStream_t stream) {
    int const device = current_device();
    DecodeParams params = p;
    Plan const how = plan(p);
    params.num_splits = how.splits;
    ScoreScales const scales = ScoreScales::make(p.softmax_scale, p.options.softcap);
    params.softcap_pre_scale = scales.softcap_pre_scale;
    params.softmax_scale_log2 = scales.softmax_scale_log2;
    ctas_per_sm(device);  // raises the shared-memory limit on this device before the first launch
    dim3 const grid(params.num_splits, row_tiles(p) * p.nheads_kv, p.batch);
    device_kernel<Kernel><<<grid, how.warps * 32, Config::shared_bytes(how.warps), stream>>>(params);
    FLASH_CUDA_CHECK(cudaGetLastError());
    if (params.num_splits > 1) {  // a programmatic dependent launch: it overlaps the decode kernel's tail
      using Combine = SplitCombine<typename Config::OutElement>;
      static_assert(Combine::kSharedStorageBytes == 0);
      launch_kernel<Combine>(Combine::grid(params), params, device, stream, /*dependent=*/true);
    }
  }
};

template <class Element, int kHeadDim>
struct DecodeKernelRegistration : KernelRegistration<DecodeParams> {
  using Launcher = DecodeLauncher<Element, kHeadDim>;
  // The registry's causal key is unused: the decode kernels take every mask at run time.
  DecodeKernelRegistration()
      : KernelRegistration<DecodeParams>(kHeadDim, dtype_name<Element>(), false, &Launcher::run, &Launcher::workspace_bytes) {}
};

}  // namespace flash
