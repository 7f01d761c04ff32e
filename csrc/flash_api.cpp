// Op registration (torch.ops.flash_ext.*) and the host side of each op: argument checks (arg_checks.h),
// the kernel's parameters, and the look-up of the compiled kernel in the registry.
#include <Python.h>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cutlass/version.h>

#include <cmath>
#include <cstdlib>
#include <sstream>
#include <string>
#include <optional>
#include <tuple>

#include "arg_checks.h"
#include "decode_params.h"
#include "flash.h"
#include "kernel_registry.h"

namespace {

using flash_api::tma_stride;

// (batch, seqlen, heads, headdim), or varlen's (total, heads, headdim): no batch stride.
flash::StridedTensor strided(at::Tensor const& t) {
  if (t.dim() == 3) { return {t.data_ptr(), 0, tma_stride(t, 0), tma_stride(t, 1)}; }
  return {t.data_ptr(), tma_stride(t, 0), tma_stride(t, 1), tma_stride(t, 2)};
}

// A varlen call's sequences (flash.h: VarlenArgs).
flash::VarlenArgs varlen_args(flash_api::VarlenShape const& vs, at::Tensor const& cu_seqlens_q, at::Tensor const& cu_seqlens_k,
                              std::optional<at::Tensor> const& seqused_q, std::optional<at::Tensor> const& seqused_k) {
  flash::VarlenArgs a;
  a.cu_seqlens_q = cu_seqlens_q.data_ptr<int>();
  a.cu_seqlens_k = cu_seqlens_k.data_ptr<int>();
  a.seqused_q = seqused_q.has_value() ? seqused_q->data_ptr<int>() : nullptr;
  a.seqused_k = seqused_k.has_value() ? seqused_k->data_ptr<int>() : nullptr;
  a.total_q = int(vs.total_q);
  a.total_k = int(vs.total_k);
  return a;
}

// The tensors of a call that must share its GPU: the named ones plus the optional ones present.
using NamedTensors = std::vector<std::pair<at::Tensor const*, char const*>>;
void add_present(NamedTensors& list, std::optional<at::Tensor> const& t, char const* name) {
  if (t.has_value()) { list.push_back({&*t, name}); }
}
// The tensors of a varlen call's offsets and used lengths.
// The FP8 descale factors of a call (None = 1), checked against q's dtype and the shape, listed for the
// device check.
void add_descales(NamedTensors& list, std::optional<at::Tensor> const& q_descale, std::optional<at::Tensor> const& k_descale,
                  std::optional<at::Tensor> const& v_descale, flash_api::AttentionShape const& s, at::ScalarType dtype) {
  for (auto const& [t, name] : {std::pair{&q_descale, "q_descale"}, {&k_descale, "k_descale"}, {&v_descale, "v_descale"}}) {
    if (t->has_value()) {
      flash_api::check_descale(**t, name, s, dtype);
      list.push_back({&**t, name});
    }
  }
}
void add_varlen(NamedTensors& list, at::Tensor const& cu_seqlens_q, at::Tensor const& cu_seqlens_k,
                std::optional<at::Tensor> const& seqused_q, std::optional<at::Tensor> const& seqused_k) {
  list.push_back({&cu_seqlens_q, "cu_seqlens_q"});
  list.push_back({&cu_seqlens_k, "cu_seqlens_k"});
  add_present(list, seqused_q, "seqused_q");
  add_present(list, seqused_k, "seqused_k");
}

// The problem sizes and score options every direction's parameters carry (decode: seqlen_k = the cache's capacity).
template <class Params>
void set_sizes(Params& params, flash_api::AttentionShape const& s, double softmax_scale,
               flash_api::ScoreOptionsChecked const& options) {
  params.options.window_left = options.window_left;
  params.options.window_right = options.window_right;
  params.options.softcap = options.softcap;
  params.batch = int(s.batch);
  params.seqlen_q = int(s.seqlen_q);
  params.seqlen_k = int(s.seqlen_k);
  params.nheads = int(s.nheads);
  params.nheads_kv = int(s.nheads_kv);
  params.headdim = int(s.headdim);
  params.softmax_scale = float(softmax_scale);
}

// Developer knobs for A/B measurements: FLASH_EXT_PINGPONG=0/1 forces the consumer warpgroup ping-pong,
// FLASH_EXT_PERSISTENT=0/1 the persistent launch, off/on (=2: the mid-length tiles, persistent, where a forward
// configuration has them: FwdLaunchPolicy); unset keeps each kernel's choice.
int env_override(char const* name) {
  char const* value = std::getenv(name);
  if (value == nullptr || value[0] == '\0') return -1;
  return value[0] == '0' ? 0 : value[0] == '2' ? 2 : 1;
}

// The registry's names (hopper/kernel_registry.h).
char const* dtype_name(at::ScalarType dtype) {
  return dtype == at::kBFloat16 ? "bf16" : dtype == at::kFloat8_e4m3fn ? "e4m3" : "fp16";
}

flash::DescaleTensor descale_tensor(std::optional<at::Tensor> const& t) {
  if (!t.has_value()) return {};
  return {t->data_ptr<float>(), t->stride(0), t->stride(1)};
}

// `banded`: the causal kernel, which also runs sliding windows (hopper/mask.h).
template <class Params>
typename flash::KernelRegistry<Params>::Entry const& find_kernel(char const* direction, int kernel_hdim,
                                                                 at::ScalarType dtype, bool causal, bool banded) {
  auto const* entry = flash::KernelRegistry<Params>::find(kernel_hdim, dtype_name(dtype), banded);
  TORCH_CHECK(entry != nullptr, "flash_ext was built without the ", dtype_name(dtype), " head dim ", kernel_hdim, " ",
              causal ? "causal" : banded ? "causal (which runs sliding windows)" : "non-causal", " ", direction,
              " kernel (build switches FLASH_EXT_HEADDIMS / FLASH_EXT_DTYPES / FLASH_EXT_CAUSAL / FLASH_EXT_BACKWARD, "
              "or no such kernel yet: flash_ext/kernel_table.py); rebuild to use it");
  return *entry;
}

// The forward's parameters shared by the dense and varlen ops.
flash::FwdParams fwd_params(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, at::Tensor& out, at::Tensor& lse,
                            flash_api::AttentionShape const& s, double softmax_scale,
                            flash_api::ScoreOptionsChecked const& options) {
  flash::FwdParams params{};
  params.q = strided(q);
  params.k = strided(k);
  params.v = strided(v);
  params.o = strided(out);
  params.lse = lse.data_ptr<float>();
  set_sizes(params, s, softmax_scale, options);
  params.pingpong = env_override("FLASH_EXT_PINGPONG");
  params.persistent = env_override("FLASH_EXT_PERSISTENT");
  return params;
}

// The scratch memory a registry entry asks for (its workspace_bytes), from PyTorch's caching allocator, set
// into params; the returned tensor keeps it alive until the launch is queued.
template <class Entry, class Params>
at::Tensor attach_workspace(Entry const& kernel, Params& params, at::Tensor const& like) {
  size_t const bytes = kernel.workspace_bytes != nullptr ? kernel.workspace_bytes(params) : 0;
  if (bytes == 0) return {};
  at::Tensor workspace = at::empty({int64_t(bytes)}, like.options().dtype(at::kByte));
  params.workspace = workspace.data_ptr();
  return workspace;
}

// The backward's parameters shared by the dense and varlen ops (lse_c / dlse_c: contiguous copies that outlive
// the launch).
flash::BwdParams bwd_params(at::Tensor const& dout, at::Tensor const& q, at::Tensor const& k, at::Tensor const& v,
                            at::Tensor const& out, at::Tensor const& lse_c, std::optional<at::Tensor> const& dlse_c,
                            at::Tensor& dq, at::Tensor& dk, at::Tensor& dv, flash_api::AttentionShape const& s,
                            double softmax_scale,
                            flash_api::ScoreOptionsChecked const& options, bool deterministic) {
  flash::BwdParams params{};
  params.q = strided(q);
  params.k = strided(k);
  params.v = strided(v);
  params.o = strided(out);
  params.dout = strided(dout);
  params.lse = lse_c.data_ptr<float>();
  params.dlse = dlse_c.has_value() ? dlse_c->data_ptr<float>() : nullptr;
  params.dq = strided(dq);
  params.dk = strided(dk);
  params.dv = strided(dv);
  set_sizes(params, s, softmax_scale, options);
  params.deterministic = deterministic;
  return params;
}

// FP8 (e4m3) q, k, v give a bf16 out; the descales (None = 1) exist only for them.
std::tuple<at::Tensor, at::Tensor> mha_fwd(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v,
                                           double softmax_scale, bool causal, std::optional<at::Tensor> const& q_descale,
                                           std::optional<at::Tensor> const& k_descale,
                                           std::optional<at::Tensor> const& v_descale, int64_t window_left,
                                           int64_t window_right, double softcap) {
  char const* op = "flash_ext.forward";
  auto const s = flash_api::check_qkv(q, k, v, softmax_scale, op, /*allow_fp8=*/true);
  auto const options = flash_api::check_score_options(causal, window_left, window_right, softcap, s);
  NamedTensors on_gpu{{&q, "q"}, {&k, "k"}, {&v, "v"}};
  add_descales(on_gpu, q_descale, k_descale, v_descale, s, q.scalar_type());
  flash_api::check_on_gpu(on_gpu, op);
  auto const& kernel = find_kernel<flash::FwdParams>("forward", flash_api::kernel_headdim(s.headdim, flash_api::Direction::kFwd),
                                                     q.scalar_type(), causal, options.banded);

  c10::cuda::CUDAGuard device_guard(q.device());
  bool const fp8 = q.scalar_type() == at::kFloat8_e4m3fn;
  at::Tensor out = at::empty({s.batch, s.seqlen_q, s.nheads, s.headdim}, q.options().dtype(fp8 ? at::kBFloat16 : q.scalar_type()));
  at::Tensor lse = at::empty({s.batch, s.nheads, s.seqlen_q}, q.options().dtype(at::kFloat));
  if (s.is_empty()) {  // empty outputs; with no key (seqlen_k = 0), rows that see no key: out = 0, lse = -inf
    out.zero_();
    lse.fill_(-INFINITY);
    return {out, lse};
  }

  // A column-major FP8 v runs on the kernels compiled for it; at other head dims, from a row-major copy.
  bool const v_colmajor = flash_api::is_v_colmajor(v);
  auto const* colmajor_kernel = v_colmajor ? flash::KernelRegistry<flash::FwdParams>::find(
                                                 kernel.headdim, kernel.dtype, kernel.causal, /*v_colmajor=*/true)
                                           : nullptr;
  at::Tensor const v_rowmajor = v_colmajor && colmajor_kernel == nullptr ? v.contiguous() : at::Tensor();
  flash::FwdParams params = fwd_params(q, k, v_rowmajor.defined() ? v_rowmajor : v, out, lse, s, softmax_scale, options);
  if (colmajor_kernel != nullptr) {
    params.v = {v.data_ptr(), flash_api::tma_stride(v, 0), /*row_stride: the head dim's*/ flash_api::tma_stride(v, 3),
                flash_api::tma_stride(v, 2)};
    params.v_colmajor = true;
  }
  auto const& launcher = colmajor_kernel != nullptr ? *colmajor_kernel : kernel;
  params.q_descale = descale_tensor(q_descale);
  params.k_descale = descale_tensor(k_descale);
  params.v_descale = descale_tensor(v_descale);
  at::Tensor const workspace = attach_workspace(launcher, params, q);
  launcher.launch(params, c10::cuda::getCurrentCUDAStream(q.device().index()).stream());
  return {out, lse};
}

// flash_attn_with_kvcache: attention of q over a KV cache after appending k_new / v_new to it in place
// (hopper/decode_kernel.h; flash_ext/kvcache.py picks this op or the varlen kernels). FP8 (e4m3) q and
// caches give a bf16 out, with descales (None = 1) as for the forward.
std::tuple<at::Tensor, at::Tensor> mha_decode(at::Tensor const& q, at::Tensor k_cache, at::Tensor v_cache,
                                              std::optional<at::Tensor> const& k_new, std::optional<at::Tensor> const& v_new,
                                              at::Tensor const& cache_seqlens, std::optional<at::Tensor> const& cache_batch_idx,
                                              std::optional<at::Tensor> const& page_table, double softmax_scale, bool causal,
                                              int64_t window_left, int64_t window_right, double softcap, int64_t num_splits,
                                              std::optional<at::Tensor> const& q_descale,
                                              std::optional<at::Tensor> const& k_descale,
                                              std::optional<at::Tensor> const& v_descale) {
  char const* op = "flash_ext.flash_attn_with_kvcache";
  auto const d = flash_api::check_decode(q, k_cache, v_cache, k_new, v_new, cache_seqlens, cache_batch_idx, page_table,
                                         softmax_scale, num_splits, op);
  auto const& s = d.shape;
  auto const options = flash_api::check_score_options(causal, window_left, window_right, softcap, s);
  NamedTensors on_gpu{{&q, "q"}, {&k_cache, "k_cache"}, {&v_cache, "v_cache"}, {&cache_seqlens, "cache_seqlens"}};
  add_present(on_gpu, k_new, "k");
  add_present(on_gpu, v_new, "v");
  add_present(on_gpu, cache_batch_idx, "cache_batch_idx");
  add_present(on_gpu, page_table, "page_table");
  add_descales(on_gpu, q_descale, k_descale, v_descale, s, q.scalar_type());
  flash_api::check_on_gpu(on_gpu, op);
  auto const& kernel = find_kernel<flash::DecodeParams>("decode", flash_api::kernel_headdim(s.headdim, flash_api::Direction::kDecode),
                                                        q.scalar_type(), false, false);

  c10::cuda::CUDAGuard device_guard(q.device());
  bool const fp8 = q.scalar_type() == at::kFloat8_e4m3fn;
  at::Tensor out = at::empty({s.batch, s.seqlen_q, s.nheads, s.headdim}, q.options().dtype(fp8 ? at::kBFloat16 : q.scalar_type()));
  at::Tensor lse = at::empty({s.batch, s.nheads, s.seqlen_q}, q.options().dtype(at::kFloat));
  if (s.batch == 0 || (s.seqlen_q == 0 && d.seqlen_new == 0)) { return {out, lse}; }

  flash::DecodeParams params{};
  params.q = strided(q);
  params.o = strided(out);
  params.lse = lse.data_ptr<float>();
  params.k_cache = strided(k_cache);
  params.v_cache = strided(v_cache);
  params.q_descale = descale_tensor(q_descale);
  params.k_descale = descale_tensor(k_descale);
  params.v_descale = descale_tensor(v_descale);
  if (k_new.has_value() && d.seqlen_new > 0) {
    params.k_new = strided(*k_new);
    params.v_new = strided(*v_new);
  }
  params.cache_seqlens = cache_seqlens.data_ptr<int>();
  params.cache_batch_idx = cache_batch_idx.has_value() ? cache_batch_idx->data_ptr<int>() : nullptr;
  params.page_table = page_table.has_value() ? page_table->data_ptr<int>() : nullptr;
  params.page_table_batch_stride = page_table.has_value() ? page_table->stride(0) : 0;
  params.page_size = int(d.page_size);
  if (page_table.has_value()) { params.page_divisor = flash::FastDivisor::of(int(d.page_size)); }
  params.pages_per_seq = int(d.pages_per_seq);
  params.cache_entries = int(d.cache_entries);
  params.seqlen_new = int(d.seqlen_new);
  set_sizes(params, s, softmax_scale, options);
  params.num_splits = int(num_splits);
  at::Tensor const workspace = attach_workspace(kernel, params, q);
  kernel.launch(params, c10::cuda::getCurrentCUDAStream(q.device().index()).stream());
  return {out, lse};
}

// The backward into given dq, dk, dv (checked here), any strides the layout rules allow.
void mha_bwd_out(at::Tensor const& dout, at::Tensor const& q, at::Tensor const& k, at::Tensor const& v,
                 at::Tensor const& out, at::Tensor const& lse, std::optional<at::Tensor> const& dlse, double softmax_scale,
                 bool causal, bool deterministic, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv, int64_t window_left,
                 int64_t window_right, double softcap) {
  char const* op = "flash_ext.backward";
  auto const s = flash_api::check_qkv(q, k, v, softmax_scale, op);
  auto const options = flash_api::check_score_options(causal, window_left, window_right, softcap, s);
  flash_api::check_tensor_like(dout, "dout", q.sizes(), q.scalar_type(), "q");
  flash_api::check_tensor_like(out, "out", q.sizes(), q.scalar_type(), "q");
  flash_api::check_lse(lse, "lse", s);
  if (dlse.has_value()) { flash_api::check_lse(*dlse, "dlse", s); }
  flash_api::check_tensor_like(dq, "dq", q.sizes(), q.scalar_type(), "q");
  flash_api::check_tensor_like(dk, "dk", k.sizes(), k.scalar_type(), "k");
  flash_api::check_tensor_like(dv, "dv", v.sizes(), v.scalar_type(), "v");
  if (dlse.has_value()) {
    flash_api::check_on_gpu({{&q, "q"}, {&k, "k"}, {&v, "v"}, {&dout, "dout"}, {&out, "out"}, {&lse, "lse"}, {&*dlse, "dlse"},
                             {&dq, "dq"}, {&dk, "dk"}, {&dv, "dv"}}, op);
  } else {
    flash_api::check_on_gpu({{&q, "q"}, {&k, "k"}, {&v, "v"}, {&dout, "dout"}, {&out, "out"}, {&lse, "lse"}, {&dq, "dq"},
                             {&dk, "dk"}, {&dv, "dv"}}, op);
  }
  at::Device const device = q.device();
  auto const& kernel = find_kernel<flash::BwdParams>("backward", flash_api::kernel_headdim(s.headdim, flash_api::Direction::kBwd),
                                                     q.scalar_type(), causal, options.banded);

  c10::cuda::CUDAGuard device_guard(device);
  if (s.is_empty()) {  // no (query, key) pair: every gradient is 0
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return;
  }
  at::Tensor const lse_c = lse.contiguous();
  std::optional<at::Tensor> const dlse_c = dlse.has_value() ? std::optional<at::Tensor>(dlse->contiguous()) : std::nullopt;

  flash::BwdParams params = bwd_params(dout, q, k, v, out, lse_c, dlse_c, dq, dk, dv, s, softmax_scale, options, deterministic);
  params.dq_scratch_bytes = dq.is_contiguous() ? int64_t(dq.nbytes()) : 0;
  at::Tensor const workspace = attach_workspace(kernel, params, q);
  kernel.launch(params, c10::cuda::getCurrentCUDAStream(device.index()).stream());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> mha_bwd(at::Tensor const& dout, at::Tensor const& q, at::Tensor const& k,
                                                       at::Tensor const& v, at::Tensor const& out, at::Tensor const& lse,
                                                       std::optional<at::Tensor> const& dlse, double softmax_scale,
                                                       bool causal, bool deterministic, int64_t window_left,
                                                       int64_t window_right, double softcap) {
  // Allocated like q, k, v when those are valid; mha_bwd_out checks everything before any launch.
  at::Tensor dq = at::empty_like(q, at::MemoryFormat::Contiguous);
  at::Tensor dk = at::empty_like(k, at::MemoryFormat::Contiguous);
  at::Tensor dv = at::empty_like(v, at::MemoryFormat::Contiguous);
  mha_bwd_out(dout, q, k, v, out, lse, dlse, softmax_scale, causal, deterministic, dq, dk, dv, window_left, window_right,
              softcap);
  return {dq, dk, dv};
}

// Variable-length batches (flash_attn_varlen_func): q (total_q, nheads, d), k, v (total_k, nheads_kv, d), the
// sequences given by cu_seqlens_* (and seqused_*); out like q, lse (nheads, total_q). Rows outside every
// sequence's used rows are not written by the kernels: they are 0 (out) and -inf (lse) when seqused_q says
// some rows are unused (with valid cu_seqlens every other row belongs to a sequence).
std::tuple<at::Tensor, at::Tensor> mha_fwd_varlen(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v,
                                                  at::Tensor const& cu_seqlens_q, at::Tensor const& cu_seqlens_k,
                                                  std::optional<at::Tensor> const& seqused_q,
                                                  std::optional<at::Tensor> const& seqused_k, int64_t max_seqlen_q,
                                                  int64_t max_seqlen_k, double softmax_scale, bool causal,
                                                  int64_t window_left, int64_t window_right, double softcap) {
  char const* op = "flash_ext.flash_attn_varlen_func";
  auto const vs = flash_api::check_qkv_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                                              max_seqlen_k, softmax_scale, op);
  auto const& s = vs.shape;
  auto const options = flash_api::check_score_options(causal, window_left, window_right, softcap, s);
  NamedTensors on_gpu{{&q, "q"}, {&k, "k"}, {&v, "v"}};
  add_varlen(on_gpu, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k);
  flash_api::check_on_gpu(on_gpu, op);
  auto const& kernel = find_kernel<flash::FwdParams>("forward", flash_api::kernel_headdim(s.headdim, flash_api::Direction::kFwd),
                                                     q.scalar_type(), causal, options.banded);

  c10::cuda::CUDAGuard device_guard(q.device());
  at::Tensor out = at::empty({vs.total_q, s.nheads, s.headdim}, q.options());
  at::Tensor lse = at::empty({s.nheads, vs.total_q}, q.options().dtype(at::kFloat));
  if (vs.is_empty() || vs.has_no_keys() || seqused_q.has_value()) {
    out.zero_();
    lse.fill_(-INFINITY);
    if (vs.is_empty() || vs.has_no_keys()) { return {out, lse}; }
  }

  flash::FwdParams params = fwd_params(q, k, v, out, lse, s, softmax_scale, options);
  params.varlen = varlen_args(vs, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k);
  at::Tensor const workspace = attach_workspace(kernel, params, q);
  kernel.launch(params, c10::cuda::getCurrentCUDAStream(q.device().index()).stream());
  return {out, lse};
}

// The varlen backward: gradients like q, k, v; the rows no sequence uses get 0.
std::tuple<at::Tensor, at::Tensor, at::Tensor> mha_bwd_varlen(
    at::Tensor const& dout, at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, at::Tensor const& out,
    at::Tensor const& lse, std::optional<at::Tensor> const& dlse, at::Tensor const& cu_seqlens_q,
    at::Tensor const& cu_seqlens_k, std::optional<at::Tensor> const& seqused_q, std::optional<at::Tensor> const& seqused_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale, bool causal, bool deterministic, int64_t window_left,
    int64_t window_right, double softcap) {
  char const* op = "flash_ext.flash_attn_varlen_func (backward)";
  auto const vs = flash_api::check_qkv_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                                              max_seqlen_k, softmax_scale, op);
  auto const& s = vs.shape;
  auto const options = flash_api::check_score_options(causal, window_left, window_right, softcap, s);
  flash_api::check_tensor_like(dout, "dout", q.sizes(), q.scalar_type(), "q");
  flash_api::check_tensor_like(out, "out", q.sizes(), q.scalar_type(), "q");
  flash_api::check_lse(lse, "lse", s, vs.total_q);
  if (dlse.has_value()) { flash_api::check_lse(*dlse, "dlse", s, vs.total_q); }
  NamedTensors on_gpu{{&q, "q"}, {&k, "k"}, {&v, "v"}, {&dout, "dout"}, {&out, "out"}, {&lse, "lse"}};
  add_present(on_gpu, dlse, "dlse");
  add_varlen(on_gpu, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k);
  flash_api::check_on_gpu(on_gpu, op);
  auto const& kernel = find_kernel<flash::BwdParams>("backward", flash_api::kernel_headdim(s.headdim, flash_api::Direction::kBwd),
                                                     q.scalar_type(), causal, options.banded);

  c10::cuda::CUDAGuard device_guard(q.device());
  // The kernels write the rows of used sequences only.
  bool const some_rows_unused = seqused_q.has_value() || seqused_k.has_value();
  auto allocate = [&](at::Tensor const& like) {
    return some_rows_unused ? at::zeros(like.sizes(), like.options()) : at::empty(like.sizes(), like.options());
  };
  at::Tensor dq = allocate(q), dk = allocate(k), dv = allocate(v);
  if (vs.is_empty() || vs.has_no_keys()) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return {dq, dk, dv};
  }
  at::Tensor const lse_c = lse.contiguous();
  std::optional<at::Tensor> const dlse_c = dlse.has_value() ? std::optional<at::Tensor>(dlse->contiguous()) : std::nullopt;

  flash::BwdParams params = bwd_params(dout, q, k, v, out, lse_c, dlse_c, dq, dk, dv, s, softmax_scale, options, deterministic);
  params.varlen = varlen_args(vs, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k);
  params.dq_scratch_bytes = int64_t(dq.nbytes());  // contiguous, allocated here
  at::Tensor const workspace = attach_workspace(kernel, params, q);
  kernel.launch(params, c10::cuda::getCurrentCUDAStream(q.device().index()).stream());
  return {dq, dk, dv};
}

// A JSON object: the registered kernels and the library versions (flash_ext.build_info() parses it).
template <class Params>
void append_kernels(std::ostringstream& json, char const* direction, bool& first) {
  for (auto const& e : flash::KernelRegistry<Params>::entries()) {
    json << (first ? "" : ", ") << "{\"direction\": \"" << direction << "\", \"headdim\": " << e.headdim
         << ", \"dtype\": \"" << e.dtype << "\", \"causal\": " << (e.causal ? "true" : "false")
         << ", \"v_colmajor\": " << (e.v_colmajor ? "true" : "false") << "}";
    first = false;
  }
}

std::string build_info() {
  std::ostringstream json;
  json << "{\"kernels\": [";
  bool first = true;
  append_kernels<flash::FwdParams>(json, "fwd", first);
  append_kernels<flash::BwdParams>(json, "bwd", first);
  append_kernels<flash::DecodeParams>(json, "decode", first);
  json << "], \"fp8_max_offset\": " << flash::kFp8MaxOffset << ", \"cutlass\": \"" << CUTLASS_MAJOR << "." << CUTLASS_MINOR << "." << CUTLASS_PATCH << "\", \"cuda\": \""
       << CUDART_VERSION / 1000 << "." << (CUDART_VERSION % 1000) / 10 << "\"}";
  return json.str();
}

}  // namespace

// The op namespace and module name are flash_ext / _C, except in side-by-side variant builds
// (scripts/build_variant.sh), which load next to the main build under their own names.
#ifndef FLASH_EXT_OPS_NAMESPACE
#define FLASH_EXT_OPS_NAMESPACE flash_ext
#endif
#ifndef FLASH_EXT_MODULE_NAME
#define FLASH_EXT_MODULE_NAME _C
#endif
#define FLASH_EXT_STRINGIFY_(x) #x
#define FLASH_EXT_STRINGIFY(x) FLASH_EXT_STRINGIFY_(x)
#define FLASH_EXT_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define FLASH_EXT_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)
#define FLASH_EXT_PYINIT_(name) PyInit_##name
#define FLASH_EXT_PYINIT(name) FLASH_EXT_PYINIT_(name)

FLASH_EXT_LIBRARY(FLASH_EXT_OPS_NAMESPACE, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, Tensor? q_descale=None, "
      "Tensor? k_descale=None, Tensor? v_descale=None, int window_left=-1, int window_right=-1, float softcap=0.0) "
      "-> (Tensor out, Tensor lse)");
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, float softmax_scale, "
      "bool causal, bool deterministic, int window_left=-1, int window_right=-1, float softcap=0.0) "
      "-> (Tensor dq, Tensor dk, Tensor dv)");
  m.def(
      "bwd_out(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, float softmax_scale, "
      "bool causal, bool deterministic, Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, int window_left=-1, "
      "int window_right=-1, float softcap=0.0) -> ()");
  m.def(
      "fwd_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, Tensor? seqused_q, "
      "Tensor? seqused_k, int max_seqlen_q, int max_seqlen_k, float softmax_scale, bool causal, int window_left=-1, "
      "int window_right=-1, float softcap=0.0) -> (Tensor out, Tensor lse)");
  m.def(
      "bwd_varlen(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, Tensor cu_seqlens_q, "
      "Tensor cu_seqlens_k, Tensor? seqused_q, Tensor? seqused_k, int max_seqlen_q, int max_seqlen_k, float softmax_scale, "
      "bool causal, bool deterministic, int window_left=-1, int window_right=-1, float softcap=0.0) "
      "-> (Tensor dq, Tensor dk, Tensor dv)");
  m.def(
      "decode(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k_new, Tensor? v_new, Tensor cache_seqlens, "
      "Tensor? cache_batch_idx, Tensor? page_table, float softmax_scale, bool causal, int window_left=-1, "
      "int window_right=-1, float softcap=0.0, int num_splits=0, Tensor? q_descale=None, Tensor? k_descale=None, "
      "Tensor? v_descale=None) -> (Tensor out, Tensor lse)");
  m.def("build_info() -> str", &build_info);
}

// The same functions serve both dispatch keys: CUDA runs the kernels; CPU tensors get the same argument
// checks, which end in "needs CUDA tensors".
static void impl_ops(torch::Library& m) {
  m.impl("fwd", &mha_fwd);
  m.impl("bwd", &mha_bwd);
  m.impl("bwd_out", &mha_bwd_out);
  m.impl("fwd_varlen", &mha_fwd_varlen);
  m.impl("bwd_varlen", &mha_bwd_varlen);
  m.impl("decode", &mha_decode);
}
FLASH_EXT_LIBRARY_IMPL(FLASH_EXT_OPS_NAMESPACE, CUDA, m) { impl_ops(m); }
FLASH_EXT_LIBRARY_IMPL(FLASH_EXT_OPS_NAMESPACE, CPU, m) { impl_ops(m); }

// `import flash_ext._C` loads this library, whose static initialisers above register the ops. The module
// itself is empty; it exists so that the stable (abi3) Python API is all this file links against. It is
// the library's only exported symbol (-fvisibility=hidden), so a variant build loaded beside the main one
// keeps its own kernel registry.
PyMODINIT_FUNC FLASH_EXT_PYINIT(FLASH_EXT_MODULE_NAME)(void) {
  static PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      FLASH_EXT_STRINGIFY(FLASH_EXT_MODULE_NAME),  // m_name
      nullptr,  // m_doc
      -1,       // m_size
      nullptr,  // m_methods
      nullptr,  // m_slots
      nullptr,  // m_traverse
      nullptr,  // m_clear
      nullptr,  // m_free
  };
  return PyModule_Create(&module_def);
}
