// Host side of one backward instantiation: the workspace, the three launches (preprocess, main kernel,
// postprocess; the second and third as programmatic dependents of the one before: kernel_launch.h),
// registration. Included only by the generated files hopper/instantiations/flash_bwd_*.cu.
#pragma once

#include <cuda_runtime.h>

#include "bwd_postprocess.h"
#include "bwd_preprocess.h"
#include "flash.h"
#include "flash_bwd_kernel.h"
#include "kernel_launch.h"
#include "kernel_registry.h"
#include "tile_size.h"
#include "varlen.h"

namespace flash {

// The scratch memory of one call: the fp32 dQ accumulator and, in deterministic mode only, its semaphores
// (both zeroed by the preprocess kernel, block by block), and VarlenPrepare's region for varlen calls, carved from
// BwdParams::workspace; and LSE_log2 and dPsum per query row, which live in dq's own memory when it can hold
// them (dq is written only by the postprocess, after the main kernel's last read of them), else in the
// workspace too. So the backward's peak memory is its outputs plus the accumulator. The accumulator and the
// statistics come in blocks of kBlockM query rows (varlen.h: Sequences::stats_base).
template <int kBlockM, int kBlockN, int kHeadDim>
struct BwdWorkspace {
  static constexpr size_t kAlign = 256;
  bool varlen;
  int64_t stats_rows;  // rows of LSE_log2 (and of dPsum, and of the accumulator)
  size_t accum_bytes, semaphore_bytes, varlen_bytes;
  bool stats_in_dq;
  VarlenWorkspace varlen_ws;

  static size_t aligned(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

  explicit BwdWorkspace(BwdParams const& p)
      : varlen(p.varlen.enabled()),
        stats_rows(Sequences::stats_rows_per_head<kBlockM>(varlen, p.seqlen_q, p.batch, p.varlen.total_q) * p.nheads *
                   (varlen ? 1 : p.batch)),
        accum_bytes(aligned(size_t(stats_rows) * kHeadDim * sizeof(float))),
        semaphore_bytes(p.deterministic ? aligned(size_t(stats_rows / kBlockM) * sizeof(int)) : 0),
        // Tiles over K/V blocks, in the kernel's block order; the statistics' blocks of one head.
        varlen_ws(p.batch, p.varlen.total_k, kBlockN, p.nheads_kv,
                  varlen ? int(Sequences::stats_rows_per_head<kBlockM>(true, p.seqlen_q, p.batch, p.varlen.total_q) / kBlockM) : 0) {
    varlen_bytes = varlen ? varlen_ws.bytes : 0;
    stats_in_dq = 2 * size_t(stats_rows) * sizeof(float) <= size_t(p.dq_scratch_bytes);
  }

  size_t accum_region_bytes() const { return accum_bytes + semaphore_bytes; }
  size_t total() const { return accum_region_bytes() + varlen_bytes + (stats_in_dq ? 0 : 2 * size_t(stats_rows) * sizeof(float)); }
  static char* base(BwdParams const& p) { return static_cast<char*>(p.workspace); }
  float* accum(BwdParams const& p) const { return reinterpret_cast<float*>(base(p)); }
  int* semaphores(BwdParams const& p) const { return p.deterministic ? reinterpret_cast<int*>(base(p) + accum_bytes) : nullptr; }
  void* varlen_base(BwdParams const& p) const { return base(p) + accum_region_bytes(); }
  SeqInfo const* packed(BwdParams const& p) const { return varlen ? varlen_ws.seqs(varlen_base(p)) : nullptr; }
  int const* stats_block_batch(BwdParams const& p) const { return varlen ? varlen_ws.stats_block_batch(varlen_base(p)) : nullptr; }
  float* lse_log2(BwdParams const& p) const {
    return stats_in_dq ? static_cast<float*>(p.dq.ptr) : reinterpret_cast<float*>(base(p) + accum_region_bytes() + varlen_bytes);
  }
  float* dpsum(BwdParams const& p) const { return lse_log2(p) + stats_rows; }
};

template <class Element, int kHeadDim, bool kIsCausal>
struct BwdLauncher {
  using Config = BwdConfig<Element, kHeadDim, kIsCausal>;
  using Kernel = BwdKernel<Config>;
  using Workspace = BwdWorkspace<Config::kBlockM, Config::kBlockN, kHeadDim>;
  using Preprocess = BwdPreprocess<Element, Config::kBlockM>;
  using Postprocess = BwdPostprocess<Element, Config::kBlockM, kHeadDim, typename Kernel::Mainloop::TiledMmadQ,
                                     Kernel::kNumMmaThreads, typename Kernel::DqAccum>;

  static size_t workspace_bytes(BwdParams const& p) { return Workspace(p).total(); }

  static void run(BwdParams const& p, cudaStream_t stream) {
    int const device = current_device();
    Workspace const ws(p);
    if (ws.varlen) {
      StridedTensor const no_out{nullptr, 0, 0, 0};
      auto const prepare = ws.varlen_ws.params(p.varlen, p.seqlen_q, p.seqlen_k, ws.varlen_base(p), Config::kBlockN,
                                               /*tile_keys=*/true, p.nheads_kv, Kernel::reverse_blocks(p.deterministic),
                                               no_out, nullptr, p.headdim, Config::kBlockM);
      launch_kernel<VarlenPrepare>(dim3(1), prepare, device, stream);
    }
    Sequences const seqs = Sequences::make(p, ws.packed(p));

    typename Preprocess::Params const pre{p.o, p.dout, p.lse, p.dlse, ws.lse_log2(p), ws.dpsum(p), seqs, ws.stats_block_batch(p),
                                          p.headdim, ws.accum(p), Kernel::DqAccum::kBlockFloats, ws.semaphores(p)};
    launch_kernel<Preprocess>(Preprocess::grid(seqs), pre, device, stream);

    auto const loads = Kernel::Loads::to_params(p, ws.lse_log2(p), ws.dpsum(p), ws.packed(p));
    typename Kernel::DqAccum::Params const dq{ws.accum(p), ws.semaphores(p), p.deterministic};
    auto const scheduler = Kernel::scheduler(p, ws.varlen_ws.tiles(ws.varlen_base(p)), ws.varlen_ws.max_tiles);
    launch_kernel<Kernel>(scheduler.grid(/*persistent=*/false, 0), Kernel::to_params(p, loads, dq, scheduler), device, stream,
                          /*dependent=*/true);

    typename Postprocess::Params const post{ws.accum(p), p.dq, seqs, ws.stats_block_batch(p), p.headdim, p.softmax_scale};
    launch_kernel<Postprocess>(Postprocess::grid(seqs), post, device, stream, /*dependent=*/true);
  }
};

template <class Element, int kHeadDim, bool kIsCausal>
struct BwdKernelRegistration : KernelRegistration<BwdParams> {
  using Launcher = BwdLauncher<Element, kHeadDim, kIsCausal>;
  BwdKernelRegistration()
      : KernelRegistration<BwdParams>(kHeadDim, dtype_name<Element>(), kIsCausal, &Launcher::run, &Launcher::workspace_bytes) {}
};

}  // namespace flash
