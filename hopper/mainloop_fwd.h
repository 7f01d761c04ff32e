// The forward mainloop collective: owns Q, K and V in shared memory, their TMA descriptors and barriers,
// the producer's loads and the consumers' GEMMs + online softmax.
//
// Producer (one thread of warpgroup 0): Q once, then K and V of every needed block, last block first,
// into kStages-deep pipelines (mbarriers with transaction counts; separate K and V pipelines so GEMM0 of
// a block can start before its V lands). FP8: V lands in a staging buffer, and warps 1-3 of the producer
// warpgroup transpose it (transpose_v.h) into the K-major buffer GEMM1 reads, publishing it through a
// third pipeline; the TMA runs up to kStages blocks ahead of them.
//
// Consumers (each warpgroup owns 64 rows): per K/V block, in the order of the seed's mainloop,
//   GEMM0 S = Q K^T, mask, max_get_scale, online_softmax, rescale_o, GEMM1 O += P V,
// with intra-warpgroup overlap: GEMM0 of block n and GEMM1 of block n+1 (the previous one) are issued
// together, so that the softmax of block n can run while GEMM1 is still on the tensor cores. ptxas issues
// GEMM1's wait ahead of the exponentials unless Config::kSoftmaxUnderGemm1 makes it follow them (measured
// per configuration: perf-notes sections 19 and 21); the ping-pong of the warpgroups hides the softmax
// under the other warpgroup's GEMMs either way.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/fast_math.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "flash.h"
#include "gmma_select.h"
#include "mask.h"
#include "layouts.h"
#include "softcap.h"
#include "softmax.h"
#include "tile_scheduler.h"
#include "transpose_v.h"
#include "utils.h"
#include "varlen.h"
#include "warpgroup_scheduler.h"

namespace flash {

using namespace cute;

template <class Config>
struct FwdMainloop {
  using Element = typename Config::Element;
  using ElementAccum = float;
  static constexpr int kHeadDim = Config::kHeadDim;
  static constexpr int kBlockM = Config::kBlockM;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kStages = Config::kStages;
  static constexpr int kStagesQ = Config::kStagesQ;  // 2 for chained tiles: the next tile's Q lands during this one
  // Chained tiles: the next tile's Q issued kNextQLeadBlocks blocks before the tile's last K/V block, not after it.
  static constexpr int kNextQLeadBlocks = Config::kNextQLeadBlocks;
  static constexpr bool kNextQEarly = kStagesQ == 2 && kNextQLeadBlocks >= 0;
  static constexpr bool kIsCausal = Config::kIsCausal;
  static constexpr int kNumMmaWarpGroups = Config::kNumMmaWarpGroups;
  static constexpr int kNumMmaThreads = kNumMmaWarpGroups * cutlass::NumThreadsPerWarpGroup;

  using TileShapeMNK = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;
  using AtomLayoutMNK = Layout<Shape<Int<kNumMmaWarpGroups>, _1, _1>>;
  // GEMM0: S = Q K^T, both operands from shared memory, K-major.
  using TiledMmaQK = decltype(make_tiled_mma(ss_gmma<Element, ElementAccum, TileShapeMNK>(),
                                             AtomLayoutMNK{}));
  // GEMM1: O += P V, P from registers. 16-bit V is stored as loaded (head dim contiguous) and read
  // MN-major as V^T; 8-bit GMMA takes K-major operands only, so FP8 transposes V in shared memory.
  // (FP8 V given column-major, its keys contiguous: GEMM1 reads it as loaded.)
  static constexpr bool kVColMajor = Config::kVColMajor;
  static constexpr bool kTransposeV = sizeof(Element) == 1 && !kVColMajor;
  static constexpr GMMA::Major kVMajor = sizeof(Element) == 1 ? GMMA::Major::K : GMMA::Major::MN;
  using TiledMmaPV = decltype(make_tiled_mma(
      rs_gmma<Element, ElementAccum, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>,
                           GMMA::Major::K, kVMajor>(),
      AtomLayoutMNK{}));

  using SmemLayoutQ = decltype(smem_layout_k_major<Element>(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutK = decltype(smem_layout_k_major<Element>(Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  // V^T tiles (headdim, kBlockN, stages), K-major: what GEMM1 reads where V arrives with the keys contiguous.
  using SmemLayoutVtKMajor = decltype(smem_layout_k_major<Element>(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{}));
  // V as the TMA writes it: (keys, headdim) with the head dim contiguous (FP8: the staging buffer), or the
  // K-major V^T tiles viewed as (keys, headdim) (kVColMajor).
  using SmemLayoutV =
      std::conditional_t<kVColMajor, decltype(transposed_view(SmemLayoutVtKMajor{})), SmemLayoutK>;
  // FP8: stages of transposed V. A third one, where shared memory allows, lets the transposing warps run a
  // block further ahead of GEMM1: 690 -> 723 TFLOP/s at d128 8k (perf-notes section 14). (One staging stage
  // for three V^T stages at d256 measured 5% slower than two and two: perf-notes section 20.)
  static constexpr int kStagesVt =
      kTransposeV && (kBlockM + kBlockN * (2 * kStages + 3)) * kHeadDim + 2 * 1024 <= 227 * 1024 ? 3 : kStages;
  // V^T (headdim, kBlockN, stages) for GEMM1's B operand: 16-bit, the same bytes as V viewed transposed;
  // FP8, a buffer of its own with the keys contiguous (K-major).
  using SmemLayoutVtTransposed =
      decltype(smem_layout_k_major<Element>(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStagesVt>>{}));
  using SmemLayoutVt = std::conditional_t<
      kTransposeV, SmemLayoutVtTransposed,
      std::conditional_t<kVColMajor, SmemLayoutVtKMajor, decltype(transposed_view(SmemLayoutK{}))>>;
  // Warps 1-3 of the producer warpgroup; warp 0 holds the TMA thread. Two tiles in flight per warp need
  // more than the 24 registers of a lean producer (ptxas spilled the loop's state there).
  static constexpr int kNumTransposeThreads = cutlass::NumThreadsPerWarpGroup - cutlass::NumThreadsPerWarp;
#ifdef FLASH_EXT_TRANSPOSE_TILES_IN_FLIGHT  // variant builds (A/B)
  static constexpr int kTransposeTilesInFlight = FLASH_EXT_TRANSPOSE_TILES_IN_FLIGHT;
#else
  static constexpr int kTransposeTilesInFlight = Config::kProducerRegs >= 32 ? 2 : 1;
#endif
  template <int kTilesInFlight = kTransposeTilesInFlight>
  using Transposer = VTransposer<kBlockN, kHeadDim, decltype(take<0, 2>(SmemLayoutV{})),
                                 decltype(take<0, 2>(SmemLayoutVtTransposed{})), kNumTransposeThreads, kTilesInFlight>;

  using PipelineKV = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename PipelineKV::PipelineState;
  // FP8: transposed V blocks, from the transposing warps (every thread arrives) to the consumers.
  using PipelineVt = cutlass::PipelineAsync<kStagesVt>;
  // The pipeline GEMM1 waits on for V^T.
  using PipelineGemmV = std::conditional_t<kTransposeV, PipelineVt, PipelineKV>;
  using PipelineStateV = typename PipelineGemmV::PipelineState;  // the consumers' place in it
  using BarrierQ = cutlass::arch::ClusterTransactionBarrier;
  using BarrierQEmpty = cutlass::arch::ClusterBarrier;

  struct TensorStorage16 {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ> * kStagesQ, 1024> smem_q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> smem_k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutV>, 1024> smem_v;
  };
  struct TensorStorageFp8 : TensorStorage16 {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutVt>, 1024> smem_vt;
  };
  using TensorStorage = std::conditional_t<kTransposeV, TensorStorageFp8, TensorStorage16>;
  static constexpr int kSmemBytesQ = int(cosize_v<SmemLayoutQ> * sizeof(Element));  // one Q buffer
  static_assert(kSmemBytesQ % 1024 == 0, "Q buffers keep the swizzle phase");
  // Q buffer `stage` (tile iteration % kStagesQ).
  __device__ static Element* smem_q(TensorStorage& tensors, int stage) {
    return tensors.smem_q.data() + stage * int(cosize_v<SmemLayoutQ>);
  }
  static constexpr int kSmemBytesVt = int(cosize_v<SmemLayoutVt> * sizeof(Element));  // FP8's own buffer
  struct BarrierStorage16 {
    // Per Q buffer (tile iteration % kStagesQ; phase = (tile iteration / kStagesQ) & 1): Q landed, and the
    // buffer may be overwritten with a later tile's Q.
    alignas(16) BarrierQ barrier_q[kStagesQ];
    alignas(16) BarrierQEmpty barrier_q_empty[kStagesQ];
    // Kernels that stage O over V's stages (persistent d256 causal): the previous tile's store of O has read them,
    // so the next tile's V may land (phase = tile iteration & 1).
    alignas(16) BarrierQEmpty barrier_o_read;
    alignas(16) typename PipelineKV::SharedStorage pipeline_k;
    alignas(16) typename PipelineKV::SharedStorage pipeline_v;
  };
  struct BarrierStorageFp8 : BarrierStorage16 {
    alignas(16) typename PipelineVt::SharedStorage pipeline_vt;
  };
  using BarrierStorage = std::conditional_t<kTransposeV, BarrierStorageFp8, BarrierStorage16>;

  // GEMM1's V^T in shared memory: where the consumers read it.
  __device__ static Element* smem_vt(TensorStorage& tensors) {
    if constexpr (kTransposeV) {
      return tensors.smem_vt.data();
    } else {
      return tensors.smem_v.data();
    }
  }

  static constexpr uint32_t kTmaBytesQ = uint32_t(size(SmemLayoutQ{}) * sizeof(Element));
  static constexpr uint32_t kTmaBytesKV = uint32_t(size(take<0, 2>(SmemLayoutK{})) * sizeof(Element));

  // Global tensors as the TMA units see them: (seqlen, headdim, heads, batch), head dim contiguous.
  using GmemTensor = decltype(make_gmem_bshd(static_cast<Element const*>(nullptr), GmemShape{}, 0, 0, 0));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutQ{}, select<0, 2>(TileShapeMNK{}), _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutK{}),
                                       select<1, 2>(TileShapeMNK{}), _1{}));
  // kVColMajor: V (seqlen, headdim, heads, batch) with the keys contiguous (dense calls only; the host checks).
  using GmemStrideVColMajor = Stride<_1, int64_t, int64_t, int64_t>;
  using GmemTensorV = std::conditional_t<
      kVColMajor,
      decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemShape{}, GmemStrideVColMajor{})),
      GmemTensor>;
  using TmaV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensorV{}, take<0, 2>(SmemLayoutV{}),
                                      select<1, 2>(TileShapeMNK{}), _1{}));

  // Everything the device needs, built on the host from the call's FwdParams.
  struct Params {
    GmemShape shape_q, shape_k;
    TmaQ tma_q;
    TmaKV tma_k;
    TmaV tma_v;
    Sequences seqs;  // each sequence's lengths and rows (varlen.h)
    int band_left, band_right;  // the window's sides (Band::side): read by the causal kernels (band())
    cutlass::FastDivmod qheads_per_kvhead;  // query heads per K/V head, divided by without a division
    ScoreScales scales;  // softmax scale and softcap (softcap.h)
    bool pingpong;  // consumer warpgroups take turns issuing GEMMs (WarpgroupScheduler)
    DescaleTensor q_descale, k_descale, v_descale;  // FP8 only
  };

  // The scales of one tile: the softmax's (log2 domain), softcap's (0 = off) and O's final one. FP8 folds
  // q_descale * k_descale into the first one that S meets (softcap's, where on) and v_descale into O's (per
  // batch and KV head).
  struct TileScales {
    float softmax_scale_log2, softcap_pre_scale, o_scale;
  };
  __device__ static TileScales tile_scales(Params const& params, TileCoord const& tile) {
    ScoreScales const& s = params.scales;
    if constexpr (Config::kIsFp8) {
      int const head_kv = params.qheads_per_kvhead.div(tile.head);
      float const qk = params.q_descale.at(tile.batch, head_kv) * params.k_descale.at(tile.batch, head_kv);
      bool const softcap = s.softcap_pre_scale > 0.f;
      return {softcap ? s.softmax_scale_log2 : s.softmax_scale_log2 * qk, s.softcap_pre_scale * qk,
              params.v_descale.at(tile.batch, head_kv)};
    } else {
      return {s.softmax_scale_log2, s.softcap_pre_scale, 1.f};
    }
  }

  // `packed`: where VarlenPrepare writes the sequences of a varlen call.
  static Params to_params(FwdParams const& p, SeqInfo const* packed) {
    bool const varlen = p.varlen.enabled();
    auto const mQ = make_gmem_rows<Element const>(p.q, p.seqlen_q, p.headdim, p.nheads, p.batch, varlen, p.varlen.total_q);
    auto const mK = make_gmem_rows<Element const>(p.k, p.seqlen_k, p.headdim, p.nheads_kv, p.batch, varlen, p.varlen.total_k);
    auto const mV = [&] {
      if constexpr (kVColMajor) {  // v.row_stride holds the head dim's stride (FwdParams::v_colmajor)
        return make_tensor(make_gmem_ptr(static_cast<Element const*>(p.v.ptr)),
                           make_shape(p.seqlen_k, p.headdim, p.nheads_kv, p.batch),
                           GmemStrideVColMajor{_1{}, p.v.row_stride, p.v.head_stride, p.v.batch_stride});
      } else {
        return make_gmem_rows<Element const>(p.v, p.seqlen_k, p.headdim, p.nheads_kv, p.batch, varlen, p.varlen.total_k);
      }
    }();
    return {mQ.shape(),
            mK.shape(),
            make_tma_copy(SM90_TMA_LOAD{}, mQ, SmemLayoutQ{}, select<0, 2>(TileShapeMNK{}), _1{}),
            make_tma_copy(SM90_TMA_LOAD{}, mK, take<0, 2>(SmemLayoutK{}), select<1, 2>(TileShapeMNK{}), _1{}),
            make_tma_copy(SM90_TMA_LOAD{}, mV, take<0, 2>(SmemLayoutV{}), select<1, 2>(TileShapeMNK{}), _1{}),
            Sequences::make(p, packed),
            Band::side(p.options.window_left),
            Band::side(p.options.window_right),
            cutlass::FastDivmod(p.nheads / p.nheads_kv),
            ScoreScales::make(p.softmax_scale, p.options.softcap),
            p.pingpong < 0 ? Config::kPingPong : (Config::kPingPong && p.pingpong != 0),
            p.q_descale,
            p.k_descale,
            p.v_descale};
  }

  // The keys each query of sequence `seq` sees (mask.h).
  __device__ static Band band(Params const& params, SeqInfo const& seq) {
    return Band{seq.seqlen_q, seq.seqlen_k, params.band_left, params.band_right};
  }

  __device__ static void prefetch_descriptors(Params const& params) {
    prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
    prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
  }

  // Called by one thread before the CTA-wide barrier that publishes the barriers.
  __device__ static void init_barriers(BarrierStorage& barriers) {
    for (int s = 0; s < kStagesQ; ++s) {
      barriers.barrier_q[s].init(/*arrive_count=*/1);
      barriers.barrier_q_empty[s].init(/*arrive_count=*/kNumMmaWarpGroups);
    }
    barriers.barrier_o_read.init(/*arrive_count=*/1);
  }

  // The pipelines of one CTA, constructed by every thread (warp 0 initialises their barriers; a
  // CTA-wide barrier must publish them). K: TMA -> consumers. V: TMA -> consumers (16-bit), or TMA ->
  // the transposing warps -> (vt) consumers (FP8). The transposing warps use the V and vt barriers
  // directly (transpose_tile): the pipeline objects' state would cost them registers.
  struct Pipelines {
    PipelineKV k, v;
    std::conditional_t<kTransposeV, PipelineVt, cute::tuple<>> vt;
    __device__ PipelineGemmV& gemm_v() {
      if constexpr (kTransposeV) { return vt; } else { return v; }
    }
  };
  __device__ static Pipelines make_pipelines(BarrierStorage& barriers, bool is_producer_warpgroup, bool is_leader) {
    using Category = typename PipelineKV::ThreadCategory;
    typename PipelineKV::Params k_params;
    k_params.transaction_bytes = kTmaBytesKV;
    k_params.role = is_producer_warpgroup ? Category::Producer : Category::Consumer;
    k_params.is_leader = is_leader;
    k_params.num_consumers = kNumMmaThreads;
    typename PipelineKV::Params v_params = k_params;
    if constexpr (kTransposeV) {
      // The staging buffer's consumers are the transposing threads, each arriving once per block.
      v_params.role = is_producer_warpgroup ? Category::Producer : Category::NonParticipant;
      v_params.num_consumers = kNumTransposeThreads;
      typename PipelineVt::Params vt_params;
      vt_params.role = is_producer_warpgroup ? PipelineVt::ThreadCategory::NonParticipant : PipelineVt::ThreadCategory::Consumer;
      vt_params.producer_arv_count = kNumTransposeThreads;
      vt_params.consumer_arv_count = kNumMmaThreads;
      return {PipelineKV(barriers.pipeline_k, k_params, Shape<_1, _1, _1>{}),
              PipelineKV(barriers.pipeline_v, v_params, Shape<_1, _1, _1>{}), PipelineVt(barriers.pipeline_vt, vt_params)};
    } else {
      return {PipelineKV(barriers.pipeline_k, k_params, Shape<_1, _1, _1>{}),
              PipelineKV(barriers.pipeline_v, v_params, Shape<_1, _1, _1>{}), {}};
    }
  }

  // Every consumer thread, once its warpgroup's GEMM0s of the tile are complete: one thread per warpgroup
  // arrives, and the producer may load the next tile's Q while the consumers finish the tile (the last
  // softmax, GEMM1 and the epilogue). Persistent kernels only, whose O is not staged in Q's buffer.
  __device__ static void release_q(BarrierStorage& barriers, int thread_idx, int tile_iteration) {
    if (thread_idx % cutlass::NumThreadsPerWarpGroup == 0) { barriers.barrier_q_empty[tile_iteration % kStagesQ].arrive(); }
  }
  // The producer, before tile `tile_iteration`'s Q: the tile kStagesQ before it no longer reads that buffer.
  __device__ static void wait_q_empty(BarrierStorage& barriers, int tile_iteration) {
    if (tile_iteration >= kStagesQ) {
      barriers.barrier_q_empty[tile_iteration % kStagesQ].wait((tile_iteration / kStagesQ - 1) & 1);
    }
  }

  // The thread slice GEMM operand descriptors are taken from: the warpgroup's, broadcast (utils.h's
  // warpgroup_slice_idx), where Config::kUniformQDescriptors, else the thread's own.
  __device__ static int descriptor_slice_idx(int thread_idx) {
    return Config::kUniformQDescriptors ? warpgroup_slice_idx(thread_idx) : thread_idx;
  }

  // FP8, transposing warps (thread_idx 0 .. kNumTransposeThreads - 1): every staged V block of one tile,
  // in the TMA's order, into V^T, each handed to the consumers as soon as it is written. The stages and
  // phases of both buffers follow from the count of blocks transposed before (`blocks_before`: the CTA's
  // earlier tiles; both buffers start at stage 0, and the staging buffer's producer is the TMA, which starts
  // at phase 1 of its empty barriers): fewer live registers than two pipeline states, which the lean
  // producer (24 registers) would spill.
  template <int kTilesInFlight = kTransposeTilesInFlight>
  __device__ static void transpose_tile(TensorStorage& tensors, BarrierStorage& barriers, int num_blocks,
                                        int thread_idx, uint32_t blocks_before = 0) {
    if constexpr (kTransposeV) {
      constexpr int kStageBytes = int(size(take<0, 2>(SmemLayoutV{})) * sizeof(Element));
      static_assert(kStageBytes % 1024 == 0, "stage offsets keep the swizzle phase");
      auto const* staged_base = reinterpret_cast<uint8_t const*>(tensors.smem_v.data());
      auto* transposed_base = reinterpret_cast<uint8_t*>(tensors.smem_vt.data());
      for (uint32_t block = blocks_before; block < blocks_before + uint32_t(num_blocks); ++block) {
        uint32_t const staged = block % kStages, vt = block % kStagesVt;
        // Consumer of the staging buffer: its full barrier's phase starts at 0. Producer of V^T: its empty
        // barrier's starts at 1 (the buffer begins empty).
        barriers.pipeline_v.full_barrier_[staged].wait((block / kStages) & 1);
        barriers.pipeline_vt.empty_barrier_[vt].wait(((block / kStagesVt) & 1) ^ 1);
        Transposer<kTilesInFlight>::run(staged_base + staged * kStageBytes, transposed_base + vt * kStageBytes, thread_idx);
        cutlass::arch::fence_view_async_shared();  // generic-proxy writes, read next by GMMA
        barriers.pipeline_vt.full_barrier_[vt].arrive();
        barriers.pipeline_v.empty_barrier_[staged].arrive();  // this thread's reads are done
      }
    }
  }

  // Loads one tile: Q and its K/V blocks [n_block_min, n_block_max), last block first. When CTAs loop over
  // tiles (kLoopsOverTiles) the first K block goes before Q, whose buffer the previous tile may still hold:
  // that K load overlaps the previous tile's end; `publish_tile` runs once the consumers' GEMM0s of the
  // previous tile are complete (release_q) and before Q's barrier is armed (they read the tile's coordinates
  // after waiting for Q). A tile that sees no key still gets its Q, so that the Q barriers stay in step with
  // the consumers. kOOverV: the previous tile's O is staged over V's stages, so the tile's first V waits for
  // its store (release_o_over_v); its Q and first K do not. Called by the TMA thread.
  // Which of a tile's loads one call issues: all (CTAs that loop over tiles), or, for one CTA per tile, Q and
  // the first K/V block (kHead, issued before the CTA-wide barrier, so that they fly while the CTA starts up)
  // and then the remaining blocks (kTail). Both stages are free at the start, so kHead never waits.
  enum class LoadPart { kWhole, kHead, kTail };

  // Tile `tile_iteration`'s Q: once the tile kStagesQ before it no longer reads the buffer (CTAs that loop over
  // tiles), the tile published (publish_tile) and Q's barrier armed, the copy. TMA thread.
  template <bool kLoopsOverTiles, class PublishTile>
  __device__ static void load_q(Params const& params, TensorStorage& tensors, BarrierStorage& barriers,
                                TileCoord const& tile, SeqInfo const& seq, int tile_iteration, PublishTile&& publish_tile) {
    if constexpr (kLoopsOverTiles) {
      wait_q_empty(barriers, tile_iteration);
      publish_tile();
    }
    Tensor sQ = make_tensor(make_smem_ptr(smem_q(tensors, tile_iteration % kStagesQ)), SmemLayoutQ{});
    TmaRows const q_rows = params.seqs.q_rows(seq, tile.batch);
    Tensor mQ = sequence_slice(params.tma_q.get_tma_tensor(params.shape_q), q_rows, tile.head);
    Tensor gQ = local_tile(mQ, select<0, 2>(TileShapeMNK{}), make_coord(tile.block, _0{}));  // (M, D)
    auto [tQgQ, tQsQ] = tma_partition(params.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    using BarrierType = typename BarrierQ::ValueType;
    BarrierQ& barrier_q = barriers.barrier_q[tile_iteration % kStagesQ];
    barrier_q.arrive_and_expect_tx(kTmaBytesQ);
    copy(params.tma_q.with(reinterpret_cast<BarrierType&>(barrier_q), 0), tQgQ, tQsQ);
  }

  // q_loaded: the tile's Q was issued by the previous tile's load (kNextQEarly). next_q: issues the next tile's Q
  // (or the end), called once where kNextQEarly, kNextQLeadBlocks before the tile's last block or at its end.
  template <bool kLoopsOverTiles, bool kOOverV, LoadPart kPart = LoadPart::kWhole, class PublishTile, class NextQ>
  __device__ static void load(Params const& params, TensorStorage& tensors, BarrierStorage& barriers,
                              Pipelines& pipelines, PipelineState& write_state, TileCoord const& tile, SeqInfo const& seq,
                              int n_block_min, int n_block_max, int tile_iteration, PublishTile&& publish_tile,
                              bool q_loaded, NextQ&& next_q) {
    PipelineKV& pipeline_k = pipelines.k;
    PipelineKV& pipeline_v = pipelines.v;
    Tensor sK = make_tensor(make_smem_ptr(tensors.smem_k.data()), SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(tensors.smem_v.data()), SmemLayoutV{});

    int const head_kv = params.qheads_per_kvhead.div(tile.head);
    TmaRows const k_rows = params.seqs.k_rows(seq, tile.batch);
    Tensor mK = sequence_slice(params.tma_k.get_tma_tensor(params.shape_k), k_rows, head_kv);
    Tensor mV = sequence_slice(params.tma_v.get_tma_tensor(params.shape_k), k_rows, head_kv);
    Tensor gK = local_tile(mK, select<1, 2>(TileShapeMNK{}), make_coord(_, _0{}));          // (N, D, n)
    Tensor gV = local_tile(mV, select<1, 2>(TileShapeMNK{}), make_coord(_, _0{}));          // (N, D, n)
    // (TMA, n blocks) and (TMA, stages); named tensors rather than structured bindings, which C++17
    // lambdas cannot capture.
    auto const k_parts = tma_partition(params.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto const v_parts = tma_partition(params.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    Tensor tKgK = get<0>(k_parts);
    Tensor tKsK = get<1>(k_parts);
    Tensor tVgV = get<0>(v_parts);
    Tensor tVsV = get<1>(v_parts);

    auto load_k = [&](int n_block) {
      pipeline_k.producer_acquire(write_state);
      copy(params.tma_k.with(*pipeline_k.producer_get_barrier(write_state), 0), tKgK(_, n_block),
           tKsK(_, write_state.index()));
    };
    auto load_v = [&](int n_block) {
      pipeline_v.producer_acquire(write_state);
      copy(params.tma_v.with(*pipeline_v.producer_get_barrier(write_state), 0), tVgV(_, n_block),
           tVsV(_, write_state.index()));
      ++write_state;
    };

    static_assert(kPart == LoadPart::kWhole || !kLoopsOverTiles, "split loads: one CTA per tile");
    if constexpr (kPart != LoadPart::kTail) {
      bool const has_keys = n_block_max > n_block_min;
      if constexpr (kLoopsOverTiles) {
        if (has_keys) { load_k(n_block_max - 1); }
      }
      if (!q_loaded) { load_q<kLoopsOverTiles>(params, tensors, barriers, tile, seq, tile_iteration, publish_tile); }
      if (!has_keys) {
        if constexpr (kNextQEarly) { next_q(); }
        return;
      }
      if constexpr (!kLoopsOverTiles) { load_k(n_block_max - 1); }
      if constexpr (kOOverV) {
        // A parity wait: the consumers are never two tiles ahead of it (their arrival for a tile comes after
        // the next tile's Q, and the tile after needs this tile's V).
        if (tile_iteration > 0) { barriers.barrier_o_read.wait((tile_iteration - 1) & 1); }
      }
      load_v(n_block_max - 1);
    }
    if constexpr (kPart != LoadPart::kHead) {
      // The block before whose loads the next tile's Q goes (kNextQEarly); none in the loop: after it.
      [[maybe_unused]] int const next_q_block = min(n_block_max - 2, n_block_min + kNextQLeadBlocks);
      // Not unrolled: the producer has 32 registers beside three consumer warpgroups, and the unrolled loop's
      // precomputed addresses spilled there (64 bytes at d64, persistent).
#pragma unroll 1
      for (int n_block = n_block_max - 2; n_block >= n_block_min; --n_block) {
        if constexpr (kNextQEarly) {
          if (n_block == next_q_block) { next_q(); }
        }
        load_k(n_block);
        load_v(n_block);
      }
      if constexpr (kNextQEarly) {
        if (next_q_block < n_block_min) { next_q(); }
      }
    }
  }

  // CTAs that loop over tiles: instead of a further tile's Q, completes Q's barrier with no data once the
  // consumers are done with the last tile; they find no tile after `publish_end` and stop. TMA thread.
  // kNextQEarly: the last tile's next_q calls it.
  template <class PublishEnd>
  __device__ static void load_end(BarrierStorage& barriers, int tile_iteration, PublishEnd&& publish_end) {
    wait_q_empty(barriers, tile_iteration);
    publish_end();
    barriers.barrier_q[tile_iteration % kStagesQ].arrive();
  }

  __device__ static void wait_q(BarrierStorage& barriers, int tile_iteration) {
    barriers.barrier_q[tile_iteration % kStagesQ].wait((tile_iteration / kStagesQ) & 1);
  }

  // O staged over V's stages (see load): the thread that issued the store, once the store has read them.
  __device__ static void release_o_over_v(BarrierStorage& barriers) { barriers.barrier_o_read.arrive(); }

  // One K/V block in the warpgroups' turns, the step of both block loops (mma's and WarpgroupMma::other_blocks'):
  // GEMM0 of block n issued with GEMM1 of block n + 1, so that the softmax of block n runs while GEMM1 is still
  // on the tensor cores. Forced inline: ptxas must see the GEMMs and their waits in one function. (Both loops
  // compile to the same SASS as when each had its own copy of these statements: scripts/sass_diff.py.)
  template <bool kMasked, class FragQ, class FragK, class FragV, class FragS, class FragP, class FragO, class MaskT,
            class SoftmaxT, class QRead>
  CUTE_DEVICE static void kv_step(Pipelines& pipelines, PipelineState& read_k, PipelineStateV& read_v,
                                  WarpgroupScheduler<kNumMmaWarpGroups> const& scheduler, FragQ const& tSrQ,
                                  FragK const& tSrK, FragV const& tOrV, FragS& tSrS, FragP& tOrP, FragO& tOrO,
                                  bool& zero_init_o, MaskT const& mask, SoftmaxT& softmax, bool softcap,
                                  float softcap_pre_scale, int m_block, int n_block, int n_block_min, QRead& q_read) {
    PipelineKV& pipeline_k = pipelines.k;
    PipelineGemmV& pipeline_v = pipelines.gemm_v();
    TiledMmaQK tiled_mma_qk;
    TiledMmaPV tiled_mma_pv;
    pipeline_k.consumer_wait(read_k);
    scheduler.wait_turn();
    warpgroup_gemm<-1>(tiled_mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), tSrS, /*zero_init=*/true);
    pipeline_v.consumer_wait(read_v);
    warpgroup_gemm<-1>(tiled_mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO, zero_init_o);
    scheduler.pass_turn();
    warpgroup_wait<1>();  // S is ready; GEMM1 still runs
    warpgroup_fence_operand(tSrS);
    pipeline_k.consumer_release(read_k);
    ++read_k;
    if (n_block == n_block_min) { q_read(); }
    if (softcap) { apply_softcap(tSrS, softcap_pre_scale); }
    if constexpr (kMasked) { mask.template apply</*kSeqlenKMask=*/false, /*kBandMask=*/true>(tSrS, m_block, n_block); }
    auto scores_scale = softmax.template max_get_scale</*kIsFirst=*/false, /*kCheckInf=*/kMasked>(tSrS);
    softmax.template online_softmax</*kIsFirst=*/false, /*kCheckInf=*/kMasked>(tSrS);
    if constexpr (Config::kSoftmaxUnderGemm1) { warpgroup_wait_all_after(softmax.row_sum); }
    warpgroup_wait<0>();  // GEMM1 done: O can be rescaled and P overwritten
    warpgroup_fence_operand(tOrO);
    pipeline_v.consumer_release(read_v);
    ++read_v;
    softmax.rescale_o_if_changed(tOrO, scores_scale);
    convert_p(tSrS, tOrP);
    zero_init_o = false;
  }

  // Chained tiles (Config::kChainTiles): one consumer warpgroup's GEMMs and online softmax over a persistent CTA's
  // tiles back to back, in parts that FwdKernel's tile loop calls; S and P are held from one tile to the next. The
  // parts follow mma's order of operations and share its step (kv_step). (mma is not built from these parts: so
  // built, ptxas ordered the step loops differently, and d128 non-causal lost 4% at 8k keys; perf-notes sections
  // 46 and 47.) softcap_pre_scale is the tile's
  // (TileScales); `softcap` says whether to apply it: a bool, or cute::true_type / false_type where the kernel
  // compiles the two cases apart. q_read() is called by every thread once its warpgroup's last GEMM0 of the tile
  // is complete (Q is no longer read).
  struct WarpgroupMma {
    using FragS = decltype(partition_fragment_C(TiledMmaQK{}, select<0, 1>(TileShapeMNK{})));
    using FragP = decltype(make_tensor<Element>(acc_layout_to_a_regs<Element>(FragS{}.layout())));
    TensorStorage& tensors;
    Pipelines& pipelines;
    PipelineState& read_k;
    PipelineStateV& read_v;
    int const thread_idx;
    WarpgroupScheduler<kNumMmaWarpGroups> const scheduler;
    FragS tSrS;
    FragP tOrP;  // P in the input type, laid out as GEMM1's register A operand
    bool zero_init_o = true;  // the tile's first GEMM1 writes O instead of accumulating

    CUTE_DEVICE WarpgroupMma(Params const& params, TensorStorage& tensors_, Pipelines& pipelines_, PipelineState& read_k_,
                            PipelineStateV& read_v_, int thread_idx_)
        : tensors(tensors_), pipelines(pipelines_), read_k(read_k_), read_v(read_v_), thread_idx(thread_idx_),
          scheduler(thread_idx_ / cutlass::NumThreadsPerWarpGroup, Config::kPingPong && params.pingpong) {}

    // GEMM operands in shared memory, as descriptors: Q buffer `q_stage`, K's and V^T's stages.
    CUTE_DEVICE auto frag_q(int q_stage) const {
      Tensor sQ = make_tensor(make_smem_ptr(smem_q(tensors, q_stage)), SmemLayoutQ{});
      return TiledMmaQK{}.get_thread_slice(descriptor_slice_idx(thread_idx)).partition_fragment_A(sQ);
    }
    CUTE_DEVICE auto frag_k() const {  // (MMA, MMA_N, MMA_K, stages)
      Tensor sK = make_tensor(make_smem_ptr(tensors.smem_k.data()), SmemLayoutK{});
      return TiledMmaQK{}.get_thread_slice(descriptor_slice_idx(thread_idx)).partition_fragment_B(sK);
    }
    CUTE_DEVICE auto frag_vt() const {  // (MMA, MMA_N, MMA_K, stages)
      Tensor sVt = make_tensor(make_smem_ptr(smem_vt(tensors)), SmemLayoutVt{});
      return TiledMmaPV{}.get_thread_slice(descriptor_slice_idx(thread_idx)).partition_fragment_B(sVt);
    }

    // The scores of a tile's first block (the last in key order: the only one that can be partial in seqlen_k),
    // complete in tSrS: softcap, mask, the softmax's first step, P.
    template <class SoftmaxT, class Softcapped>
    CUTE_DEVICE void first_scores(TileCoord const& tile, Band const& band, int n_block, SoftmaxT& softmax,
                                 float softcap_pre_scale, Softcapped softcapped) {
      // Softcap's tanh comes before the mask (-inf stays -inf) and the softmax.
      if (bool(softcapped)) { apply_softcap(tSrS, softcap_pre_scale); }
      Mask<kBlockM, kBlockN, kIsCausal, TiledMmaQK>(thread_idx, band)
          .template apply</*kSeqlenKMask=*/true, kIsCausal>(tSrS, tile.block, n_block);
      softmax.template max_get_scale</*kIsFirst=*/true, /*kCheckInf=*/true>(tSrS);
      softmax.template online_softmax</*kIsFirst=*/true, /*kCheckInf=*/true>(tSrS);
      convert_p(tSrS, tOrP);
      zero_init_o = true;
    }

    // GEMM0 of a tile's first block, outside the warpgroups' turns, and its scores.
    template <class SoftmaxT, class Softcapped, class QRead>
    CUTE_DEVICE void first_block(int q_stage, TileCoord const& tile, Band const& band, int n_block_min, int n_block_max,
                                SoftmaxT& softmax, float softcap_pre_scale, Softcapped softcapped, QRead&& q_read) {
      TiledMmaQK tiled_mma_qk;
      pipelines.k.consumer_wait(read_k);
      warpgroup_gemm<0>(tiled_mma_qk, frag_q(q_stage), frag_k()(_, _, _, read_k.index()), tSrS, /*zero_init=*/true);
      pipelines.k.consumer_release(read_k);
      ++read_k;
      if (n_block_max - 1 == n_block_min) { q_read(); }
      first_scores(tile, band, n_block_max - 1, softmax, softcap_pre_scale, softcapped);
    }

    // The tile's other blocks, in the warpgroups' turns: GEMM0 of block n issued with GEMM1 of block n + 1, so
    // that the softmax of block n runs while GEMM1 is still on the tensor cores.
    template <class FragO, class SoftmaxT, class Softcapped, class QRead>
    CUTE_DEVICE void other_blocks(int q_stage, TileCoord const& tile, Band const& band, int n_block_min, int n_block_max,
                                 FragO& tOrO, SoftmaxT& softmax, float softcap_pre_scale, Softcapped softcapped,
                                 QRead&& q_read) {
      BlockRange<kBlockM, kBlockN, kIsCausal> const blocks{band};
      int const m_block = tile.block;
      Tensor tSrQ = frag_q(q_stage);
      Tensor tSrK = frag_k();
      Tensor tOrV = frag_vt();
      Mask<kBlockM, kBlockN, kIsCausal, TiledMmaQK> mask(thread_idx, band);
      bool const softcap = bool(softcapped);
      // Forced inline: ptxas must see the GEMMs and their waits in one function, or it injects waits of its own.
      auto step = [&](int n_block, auto masked) __attribute__((always_inline)) {
        kv_step<decltype(masked)::value>(pipelines, read_k, read_v, scheduler, tSrQ, tSrK, tOrV, tSrS, tOrP, tOrO,
                                         zero_init_o, mask, softmax, softcap, softcap_pre_scale, m_block, n_block,
                                         n_block_min, q_read);
      };

      blocks.for_each_block_down(n_block_max - 2, n_block_min, m_block, step);
    }

    // GEMM1 of the tile's last block, waited for (a tile followed by none, or by one that sees no key).
    template <class FragO>
    CUTE_DEVICE void last_gemm1(FragO& tOrO) {
      PipelineGemmV& pipeline_v = pipelines.gemm_v();
      TiledMmaPV tiled_mma_pv;
      pipeline_v.consumer_wait(read_v);
      warpgroup_gemm<0>(tiled_mma_pv, tOrP, frag_vt()(_, _, _, read_v.index()), tOrO, zero_init_o);
      pipeline_v.consumer_release(read_v);
      ++read_v;
    }

    // In one turn: GEMM1 of this tile's last block, then GEMM0 of the next tile's first block (Q
    // buffer `next_q_stage`). Returns once GEMM1 is complete (O may be finalized and stored while GEMM0 runs);
    // next_scores then waits for S.
    template <class FragO>
    CUTE_DEVICE void last_gemm1_with_next_gemm0(int next_q_stage, FragO& tOrO) {
      PipelineGemmV& pipeline_v = pipelines.gemm_v();
      TiledMmaQK tiled_mma_qk;
      TiledMmaPV tiled_mma_pv;
      pipelines.k.consumer_wait(read_k);
      scheduler.wait_turn();
      pipeline_v.consumer_wait(read_v);
      warpgroup_gemm<-1>(tiled_mma_pv, tOrP, frag_vt()(_, _, _, read_v.index()), tOrO, zero_init_o);
      warpgroup_gemm<-1>(tiled_mma_qk, frag_q(next_q_stage), frag_k()(_, _, _, read_k.index()), tSrS, /*zero_init=*/true);
      scheduler.pass_turn();
      warpgroup_wait<1>();  // O is complete; S still runs
      warpgroup_fence_operand(tOrO);
      pipeline_v.consumer_release(read_v);
      ++read_v;
    }
    template <class SoftmaxT, class Softcapped, class QRead>
    CUTE_DEVICE void next_scores(TileCoord const& tile, Band const& band, int n_block_min, int n_block_max, SoftmaxT& softmax,
                                float softcap_pre_scale, Softcapped softcapped, QRead&& q_read) {
      warpgroup_wait<0>();
      warpgroup_fence_operand(tSrS);
      pipelines.k.consumer_release(read_k);
      ++read_k;
      if (n_block_max - 1 == n_block_min) { q_read(); }
      first_scores(tile, band, n_block_max - 1, softmax, softcap_pre_scale, softcapped);
    }
  };

  // Computes the un-normalised O of one tile into tOrO and leaves the softmax state ready for finalize (kernels that
  // do not chain tiles). Requires n_block_max > n_block_min and Q in shared memory (wait_q; Q buffer 0). With kHoldLastV consumer thread 0
  // keeps the V stage the last GEMM1 read (the epilogue stages O there) until release_v_stage. softcap_pre_scale
  // is the tile's (TileScales); `softcapped` says whether to apply it: a bool, or cute::true_type /
  // false_type where the kernel compiles the two cases apart. q_read() is called by every thread once its
  // warpgroup's last GEMM0 of the tile is complete (Q is no longer read). Forced inline: with FwdKernel::run
  // inlined, ptxas called it as a function in d128 causal (one CTA per tile) and FP8 d128 causal (persistent),
  // serializing the wgmma pipeline at the call (C7510) on a 464-528 byte stack.
  template <bool kHoldLastV, class FragO, class SoftmaxT, class Softcapped, class QRead>
  CUTE_DEVICE static void mma(Params const& params, TensorStorage& tensors, Pipelines& pipelines,
                             PipelineState& read_k, PipelineStateV& read_v, TileCoord const& tile, Band const& band,
                             int n_block_min, int n_block_max, int thread_idx, FragO& tOrO, SoftmaxT& softmax,
                             float softcap_pre_scale, Softcapped softcapped, QRead&& q_read) {
    PipelineKV& pipeline_k = pipelines.k;
    PipelineGemmV& pipeline_v = pipelines.gemm_v();
    BlockRange<kBlockM, kBlockN, kIsCausal> const blocks{band};
    int const m_block = tile.block;
    Tensor sQ = make_tensor(make_smem_ptr(smem_q(tensors, 0)), SmemLayoutQ{});  // one CTA per tile: buffer 0
    Tensor sK = make_tensor(make_smem_ptr(tensors.smem_k.data()), SmemLayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(smem_vt(tensors)), SmemLayoutVt{});

    TiledMmaQK tiled_mma_qk;
    TiledMmaPV tiled_mma_pv;
    // Slices for the shared-memory operands' descriptors only (descriptor_slice_idx).
    auto thread_mma_qk = tiled_mma_qk.get_thread_slice(descriptor_slice_idx(thread_idx));
    auto thread_mma_pv = tiled_mma_pv.get_thread_slice(descriptor_slice_idx(thread_idx));
    Tensor tSrQ = thread_mma_qk.partition_fragment_A(sQ);    // descriptors
    Tensor tSrK = thread_mma_qk.partition_fragment_B(sK);    // (MMA, MMA_N, MMA_K, stages)
    Tensor tOrV = thread_mma_pv.partition_fragment_B(sVt);   // (MMA, MMA_N, MMA_K, stages)
    Tensor tSrS = partition_fragment_C(tiled_mma_qk, select<0, 1>(TileShapeMNK{}));
    // P in the input type, laid out as GEMM1's register A operand.
    Tensor tOrP = make_tensor<Element>(acc_layout_to_a_regs<Element>(tSrS.layout()));

    Mask<kBlockM, kBlockN, kIsCausal, TiledMmaQK> mask(thread_idx, band);
    // Softcap's tanh comes before the mask (-inf stays -inf) and the softmax: a uniform branch, or none where
    // `softcapped` is a compile-time constant.
    bool const softcap = bool(softcapped);
    WarpgroupScheduler<kNumMmaWarpGroups> scheduler(thread_idx / cutlass::NumThreadsPerWarpGroup,
                                                    Config::kPingPong && params.pingpong);

    // First block (the last in key order): the only one that can be partial in seqlen_k.
    int n_block = n_block_max - 1;
    pipeline_k.consumer_wait(read_k);
    warpgroup_gemm<0>(tiled_mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), tSrS, /*zero_init=*/true);
    pipeline_k.consumer_release(read_k);
    ++read_k;
    if (n_block == n_block_min) { q_read(); }
    if (softcap) { apply_softcap(tSrS, softcap_pre_scale); }
    mask.template apply</*kSeqlenKMask=*/true, kIsCausal>(tSrS, m_block, n_block);
    softmax.template max_get_scale</*kIsFirst=*/true, /*kCheckInf=*/true>(tSrS);
    softmax.template online_softmax</*kIsFirst=*/true, /*kCheckInf=*/true>(tSrS);
    convert_p(tSrS, tOrP);

    bool zero_init_o = true;  // the first GEMM1 writes O instead of accumulating
    auto step = [&](int n_block, auto masked) {
      kv_step<decltype(masked)::value>(pipelines, read_k, read_v, scheduler, tSrQ, tSrK, tOrV, tSrS, tOrP, tOrO,
                                       zero_init_o, mask, softmax, softcap, softcap_pre_scale, m_block, n_block,
                                       n_block_min, q_read);
    };

    --n_block;
    scheduler.start();
    blocks.for_each_block_down(n_block, n_block_min, m_block, step);
    scheduler.finish();

    // GEMM1 of the last block.
    pipeline_v.consumer_wait(read_v);
    warpgroup_gemm<0>(tiled_mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO, zero_init_o);
    // The stage is free once every consumer thread has arrived; thread 0's arrival can wait for O's store.
    if (!kHoldLastV || thread_idx != 0) { pipeline_v.consumer_release(read_v); }
    ++read_v;
  }

  // P from GEMM0's accumulator in GEMM1's A-operand registers: FP8 in the key order of transpose_v.h, or in the
  // keys' natural order where V arrives with them contiguous (kVColMajor).
  template <class Acc, class FragP>
  __device__ static void convert_p(Acc const& acc, FragP& p) {
    if constexpr (kVColMajor) {
      convert_acc_to_a_regs_natural_fp8(acc, p);
    } else {
      convert_acc_to_a_regs(acc, p);
    }
  }

  // 16-bit V: the first element of a stage, and the held stage handed back (consumer thread 0).
  __device__ static Element* smem_v_stage(TensorStorage& tensors, int stage) {
    return tensors.smem_v.data() + stage * int(size(take<0, 2>(SmemLayoutV{})));
  }
  __device__ static void release_v_stage(Pipelines& pipelines, int stage) {
    pipelines.v.consumer_release(PipelineState(stage, 0, 0));
  }
  static constexpr int kSmemBytesVStage = int(size(take<0, 2>(SmemLayoutV{})) * sizeof(Element));
};

}  // namespace flash
