// Host side of one backward instantiation: the workspace, the three launches (preprocess, main kernel,
// postprocess), registration. Included only by the generated files hopper/instantiations/flash_bwd_*.cu.
#pragma once

#include <cuda_runtime.h>

#include "bwd_postprocess.h"
#include "bwd_preprocess.h"
#include "flash.h"
#include "flash_bwd_kernel.h"
#include "kernel_launch.h"
#include "kernel_registry.h"
#include "tile_size.h"

namespace flash {

// The scratch memory of one call: the fp32 dQ accumulator and, in deterministic mode only, its semaphores
// (both zeroed before the main kernel), carved from BwdParams::workspace; and LSE_log2 and dPsum per query
// row, which live in dq's own memory when it can hold them (dq is written only by the postprocess, after
// the main kernel's last read of them), else in the workspace too. So the backward's peak memory is its
// outputs plus the accumulator.
template <int kBlockM, int kHeadDim>
struct BwdWorkspace {
  static constexpr size_t kAlign = 256;
  int num_m_blocks, seqlen_q_rounded;
  size_t accum_bytes, semaphore_bytes, stats_floats;
  bool stats_in_dq;

  static size_t aligned(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

  explicit BwdWorkspace(BwdParams const& p)
      : num_m_blocks(ceil_div(p.seqlen_q, kBlockM)),
        seqlen_q_rounded(num_m_blocks * kBlockM),
        accum_bytes(aligned(size_t(p.batch) * p.nheads * seqlen_q_rounded * kHeadDim * sizeof(float))),
        semaphore_bytes(p.deterministic ? aligned(size_t(p.batch) * p.nheads * num_m_blocks * sizeof(int)) : 0),
        stats_floats(size_t(p.batch) * p.nheads * seqlen_q_rounded),
        stats_in_dq(2 * stats_floats * sizeof(float) <= size_t(p.dq_scratch_bytes)) {}

  size_t zeroed_bytes() const { return accum_bytes + semaphore_bytes; }
  size_t total() const { return zeroed_bytes() + (stats_in_dq ? 0 : 2 * stats_floats * sizeof(float)); }
  static char* base(BwdParams const& p) { return static_cast<char*>(p.workspace); }
  float* accum(BwdParams const& p) const { return reinterpret_cast<float*>(base(p)); }
  int* semaphores(BwdParams const& p) const { return p.deterministic ? reinterpret_cast<int*>(base(p) + accum_bytes) : nullptr; }
  float* lse_log2(BwdParams const& p) const {
    return stats_in_dq ? static_cast<float*>(p.dq.ptr) : reinterpret_cast<float*>(base(p) + zeroed_bytes());
  }
  float* dpsum(BwdParams const& p) const { return lse_log2(p) + stats_floats; }
};

template <class Element, int kHeadDim, bool kIsCausal>
struct BwdLauncher {
  using Config = BwdConfig<Element, kHeadDim, kIsCausal>;
  using Kernel = BwdKernel<Config>;
  using Workspace = BwdWorkspace<Config::kBlockM, kHeadDim>;
  using Preprocess = BwdPreprocess<Element, Config::kBlockM>;
  using Postprocess = BwdPostprocess<Element, Config::kBlockM, kHeadDim, typename Kernel::Mainloop::TiledMmadQ,
                                     typename Kernel::Mainloop::DqTile, Kernel::Mainloop::kDqTransposed,
                                     Kernel::kNumMmaThreads>;

  static size_t workspace_bytes(BwdParams const& p) { return Workspace(p).total(); }

  static void run(BwdParams const& p, cudaStream_t stream) {
    int const device = current_device();
    Workspace const ws(p);
    FLASH_CUDA_CHECK(cudaMemsetAsync(p.workspace, 0, ws.zeroed_bytes(), stream));

    typename Preprocess::Params const pre{p.o, p.dout, p.lse, p.dlse, ws.lse_log2(p), ws.dpsum(p), p.seqlen_q,
                                          ws.seqlen_q_rounded, p.nheads, p.headdim};
    launch_kernel<Preprocess>(Preprocess::grid(ws.seqlen_q_rounded, p.nheads, p.batch), pre, device, stream);

    auto const loads = Kernel::Loads::to_params(p, ws.lse_log2(p), ws.dpsum(p), ws.seqlen_q_rounded);
    typename Kernel::DqAccum::Params const dq{ws.accum(p), ws.semaphores(p), p.deterministic};
    launch_kernel<Kernel>(Kernel::grid(p), Kernel::to_params(p, loads, dq, ws.num_m_blocks), device, stream);

    typename Postprocess::Params const post{ws.accum(p), p.dq, p.seqlen_q, p.nheads, ws.num_m_blocks, p.headdim,
                                            p.softmax_scale};
    launch_kernel<Postprocess>(Postprocess::grid(ws.num_m_blocks, p.nheads, p.batch), post, device, stream);
  }
};

template <class Element, int kHeadDim, bool kIsCausal>
struct BwdKernelRegistration : KernelRegistration<BwdParams> {
  using Launcher = BwdLauncher<Element, kHeadDim, kIsCausal>;
  BwdKernelRegistration()
      : KernelRegistration<BwdParams>(kHeadDim, dtype_name<Element>(), kIsCausal, &Launcher::run, &Launcher::workspace_bytes) {}
};

}  // namespace flash
