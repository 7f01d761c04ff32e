#include "arg_checks.h"

#include <c10/core/ScalarType.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <cmath>
#include <sstream>
#include <string>

#if !defined(FLASH_EXT_FWD_HEADDIMS) || !defined(FLASH_EXT_BWD_HEADDIMS) || !defined(FLASH_EXT_DECODE_HEADDIMS)
#error "setup.py passes FLASH_EXT_{FWD,BWD,DECODE}_HEADDIMS from flash_ext/kernel_table.py"
#endif

namespace flash_api {
namespace {

constexpr int kFwdHeadDims[] = {FLASH_EXT_FWD_HEADDIMS};
constexpr int kBwdHeadDims[] = {FLASH_EXT_BWD_HEADDIMS};
constexpr int kDecodeHeadDims[] = {FLASH_EXT_DECODE_HEADDIMS};
constexpr int kMaxHeadDim = kFwdHeadDims[sizeof(kFwdHeadDims) / sizeof(int) - 1];

// Messages speak Python: torch.float16, (1, 8, 2, 64).
std::string torch_name(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kShort: return "torch.int16";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kBool: return "torch.bool";
    case at::kFloat8_e4m3fn: return "torch.float8_e4m3fn";
    case at::kFloat8_e5m2: return "torch.float8_e5m2";
    default: return std::string("torch.") + c10::toString(t);
  }
}

std::string tuple_str(at::IntArrayRef v) {
  std::ostringstream s;
  s << "(";
  for (size_t i = 0; i < v.size(); ++i) { s << (i ? ", " : "") << v[i]; }
  s << (v.size() == 1 ? ",)" : ")");
  return s.str();
}

// Dense tensors are (batch, seqlen, nheads, headdim); varlen ones (total, nheads, headdim).
void check_rank_and_dtype(at::Tensor const& t, char const* name, char const* op, bool allow_fp8, bool varlen = false) {
  if (varlen) {
    TORCH_CHECK_VALUE(t.dim() == 3, name, " must have 3 dims (total_tokens, nheads, headdim) for ", op, ", got ", t.dim(),
                      " dims with shape ", tuple_str(t.sizes()));
  } else {
    TORCH_CHECK_VALUE(t.dim() == 4, name, " must have 4 dims (batch, seqlen, nheads, headdim), got ", t.dim(),
                      " dims with shape ", tuple_str(t.sizes()));
  }
  at::ScalarType const dtype = t.scalar_type();
  if (allow_fp8) {
    TORCH_CHECK_TYPE(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat8_e4m3fn, name, " has dtype ",
                     torch_name(dtype), "; ", op, " supports torch.float16, torch.bfloat16 and torch.float8_e4m3fn");
  } else {
    TORCH_CHECK_TYPE(dtype == at::kHalf || dtype == at::kBFloat16, name, " has dtype ", torch_name(dtype), "; ", op,
                     " supports torch.float16 and torch.bfloat16",
                     dtype == at::kFloat8_e4m3fn ? " (FP8 is forward-only)" : "");
  }
}

void check_layout(at::Tensor const& t, char const* name) {
  TORCH_CHECK_VALUE(t.stride(-1) == 1, name, " must be contiguous in its last (headdim) dim, got strides ",
                    tuple_str(t.strides()), "; call .contiguous()");
  int64_t const elem = int64_t(t.element_size());
  for (int dim = 0; dim < t.dim() - 1; ++dim) {
    int64_t const stride_bytes = tma_stride(t, dim) * elem;
    TORCH_CHECK_VALUE(stride_bytes > 0 && stride_bytes % kAlignBytes == 0 && stride_bytes < (int64_t(1) << 40), name,
                      " stride ", t.stride(dim), " of dim ", dim, " must be a positive multiple of ", kAlignBytes / elem,
                      " elements (", kAlignBytes, " bytes) for the TMA loads (expanded or oddly strided views are not); "
                      "call .contiguous()");
  }
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % kAlignBytes == 0, name, "'s data pointer is not ",
                    kAlignBytes, "-byte aligned (a view at an odd offset?); call .clone()");
}

// A column-major FP8 v (is_v_colmajor): its other strides and its pointer as the TMA loads need them.
void check_layout_v_colmajor(at::Tensor const& v) {
  for (int dim : {0, 2, 3}) {
    int64_t const stride = tma_stride(v, dim);  // elements are bytes
    TORCH_CHECK_VALUE(stride > 0 && stride % kAlignBytes == 0 && stride < (int64_t(1) << 40), "v (column-major: its "
                      "sequence dim contiguous) stride ", v.stride(dim), " of dim ", dim, " must be a positive multiple of ",
                      kAlignBytes, " elements for the TMA loads; call .contiguous()");
  }
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(v.data_ptr()) % kAlignBytes == 0, "v's data pointer is not ", kAlignBytes,
                    "-byte aligned (a view at an odd offset?); call .clone()");
}

// sm_90 is checked once per device.
void check_sm90(at::Device device) {
  static std::atomic<bool> checked[64] = {};
  int const index = device.index();
  TORCH_CHECK(index >= 0 && index < 64, "flash_ext supports device indices below 64");
  if (checked[index].load(std::memory_order_relaxed)) return;
  int major = 0, minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, index));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, index));
  TORCH_CHECK(major == 9 && minor == 0, "flash_ext's kernels need an sm_90 (Hopper H100/H200) GPU; device ", index,
              " is sm_", major, minor);
  checked[index].store(true, std::memory_order_relaxed);
}

}  // namespace

bool is_v_colmajor(at::Tensor const& v) {
  return v.scalar_type() == at::kFloat8_e4m3fn && v.dim() == 4 && v.stride(-1) != 1 && v.stride(1) == 1;
}

int64_t tma_stride(at::Tensor const& t, int dim) {
  return t.size(dim) == 1 ? kAlignBytes / int64_t(t.element_size()) : t.stride(dim);
}

namespace {
template <size_t N>
int next_kernel_headdim(int const (&headdims)[N], int64_t headdim) {
  for (int d : headdims) {
    if (headdim <= d) return d;
  }
  return -1;
}
}  // namespace

int kernel_headdim(int64_t headdim, Direction direction) {
  switch (direction) {
    case Direction::kFwd: return next_kernel_headdim(kFwdHeadDims, headdim);
    case Direction::kBwd: return next_kernel_headdim(kBwdHeadDims, headdim);
    default: return next_kernel_headdim(kDecodeHeadDims, headdim);
  }
}

namespace {
// The rules q, k, v share in both layouts, once `s` holds their sizes.
void check_qkv_common(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, AttentionShape const& s,
                      double softmax_scale);
}  // namespace

AttentionShape check_qkv(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, double softmax_scale,
                         char const* op, bool allow_fp8) {
  check_rank_and_dtype(q, "q", op, allow_fp8);
  check_rank_and_dtype(k, "k", op, allow_fp8);
  check_rank_and_dtype(v, "v", op, allow_fp8);
  TORCH_CHECK_TYPE(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
                   "q, k, v must share one dtype, got q ", torch_name(q.scalar_type()), ", k ", torch_name(k.scalar_type()),
                   ", v ", torch_name(v.scalar_type()));
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(), "k and v must have the same shape, got k ", tuple_str(k.sizes()), " and v ",
                    tuple_str(v.sizes()));
  AttentionShape const s{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3)};
  TORCH_CHECK_VALUE(k.size(0) == s.batch, "batch mismatch: q has batch ", s.batch, ", k and v have ", k.size(0));
  check_qkv_common(q, k, v, s, softmax_scale);
  return s;
}

VarlenShape check_qkv_varlen(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, at::Tensor const& cu_seqlens_q,
                             at::Tensor const& cu_seqlens_k, std::optional<at::Tensor> const& seqused_q,
                             std::optional<at::Tensor> const& seqused_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                             double softmax_scale, char const* op) {
  check_rank_and_dtype(q, "q", op, /*allow_fp8=*/false, /*varlen=*/true);
  check_rank_and_dtype(k, "k", op, false, true);
  check_rank_and_dtype(v, "v", op, false, true);
  TORCH_CHECK_TYPE(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
                   "q, k, v must share one dtype, got q ", torch_name(q.scalar_type()), ", k ", torch_name(k.scalar_type()),
                   ", v ", torch_name(v.scalar_type()));
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(), "k and v must have the same shape, got k ", tuple_str(k.sizes()), " and v ",
                    tuple_str(v.sizes()));
  for (auto const& [t, name] : {std::pair{&cu_seqlens_q, "cu_seqlens_q"}, {&cu_seqlens_k, "cu_seqlens_k"}}) {
    TORCH_CHECK_TYPE(t->scalar_type() == at::kInt, name, " must be torch.int32, got ", torch_name(t->scalar_type()));
    TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) >= 1, name, " must be 1-D (batch + 1,), got shape ", tuple_str(t->sizes()));
    TORCH_CHECK_VALUE(t->stride(0) == 1, name, " must be contiguous; call .contiguous()");
  }
  TORCH_CHECK_VALUE(cu_seqlens_q.size(0) == cu_seqlens_k.size(0), "cu_seqlens_q and cu_seqlens_k must have the same length "
                    "(batch + 1), got ", cu_seqlens_q.size(0), " and ", cu_seqlens_k.size(0));
  int64_t const batch = cu_seqlens_q.size(0) - 1;
  for (auto const& [t, name] : {std::pair{&seqused_q, "seqused_q"}, {&seqused_k, "seqused_k"}}) {
    if (!t->has_value()) { continue; }
    at::Tensor const& u = **t;
    TORCH_CHECK_TYPE(u.scalar_type() == at::kInt, name, " must be torch.int32, got ", torch_name(u.scalar_type()));
    TORCH_CHECK_VALUE(u.dim() == 1 && u.size(0) == batch, name, " must have shape (batch,) = (", batch, ",), got ",
                      tuple_str(u.sizes()));
    TORCH_CHECK_VALUE(u.stride(0) == 1 || batch <= 1, name, " must be contiguous; call .contiguous()");
  }
  TORCH_CHECK_VALUE(max_seqlen_q >= 0 && max_seqlen_k >= 0, "max_seqlen_q and max_seqlen_k must be >= 0, got ",
                    max_seqlen_q, " and ", max_seqlen_k);
  // The longest sequence cannot exceed its packed tensor: a larger maximum only costs grid size.
  max_seqlen_q = std::min(max_seqlen_q, q.size(0));
  max_seqlen_k = std::min(max_seqlen_k, k.size(0));
  VarlenShape vs;
  vs.shape = AttentionShape{batch, max_seqlen_q, max_seqlen_k, q.size(1), k.size(1), q.size(2)};
  vs.total_q = q.size(0);
  vs.total_k = k.size(0);
  TORCH_CHECK_VALUE(vs.total_q < (int64_t(1) << 31) - 1 && vs.total_k < (int64_t(1) << 31) - 1,
                    "problem too large: q and k must have fewer than 2^31 - 1 rows, got ", vs.total_q, " and ", vs.total_k);
  check_qkv_common(q, k, v, vs.shape, softmax_scale);
  return vs;
}

namespace {
void check_qkv_common(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, AttentionShape const& s,
                      double softmax_scale) {
  TORCH_CHECK_VALUE(k.size(-1) == s.headdim, "head dim mismatch: q has ", s.headdim, ", k and v have ", k.size(-1));
  TORCH_CHECK_VALUE(s.batch >= 0 && s.nheads >= 1 && s.nheads_kv >= 1, "head counts must be >= 1, got q ",
                    tuple_str(q.sizes()), ", k ", tuple_str(k.sizes()));
  // batch, seqlen_q and seqlen_k may be 0: the ops return empty outputs (or, with no key, out = 0 and
  // lse = -inf) without a launch (is_empty).
  TORCH_CHECK_VALUE(s.nheads % s.nheads_kv == 0, "nheads (", s.nheads, ") must be a multiple of nheads_kv (", s.nheads_kv,
                    ") for MQA/GQA");
  TORCH_CHECK_VALUE(s.headdim % 8 == 0 && s.headdim >= 8 && s.headdim <= kMaxHeadDim, "head dim ", s.headdim,
                    " is not supported: it must be a multiple of 8 in [8, ", kMaxHeadDim, "] (kernels for ",
                    tuple_str(at::IntArrayRef(std::vector<int64_t>(std::begin(kFwdHeadDims), std::end(kFwdHeadDims)))),
                    "; others run on the next size up)");
  // TMA rows are whole multiples of 16 bytes.
  TORCH_CHECK_VALUE(q.scalar_type() != at::kFloat8_e4m3fn || s.headdim % 16 == 0, "head dim ", s.headdim,
                    " is not supported for FP8: it must be a multiple of 16 (16-byte rows)");
  // The kernels index rows, tiles and heads with 32-bit integers (tiles of at least 64 rows).
  TORCH_CHECK_VALUE(s.seqlen_q < (int64_t(1) << 31) && s.seqlen_k < (int64_t(1) << 31) &&
                        s.batch * s.nheads * ((std::max(s.seqlen_q, s.seqlen_k) + 63) / 64) < (int64_t(1) << 31),
                    "problem too large: batch * nheads * seqlen / 64 must stay below 2^31, got q ", tuple_str(q.sizes()),
                    ", k ", tuple_str(k.sizes()));
  // The kernels' band arithmetic (mask.h) adds the two lengths and a tile.
  TORCH_CHECK_VALUE(s.seqlen_q + s.seqlen_k < (int64_t(1) << 29), "problem too large: seqlen_q + seqlen_k must stay below "
                    "2^29, got ", s.seqlen_q, " + ", s.seqlen_k);
  TORCH_CHECK_VALUE(std::isfinite(softmax_scale) && softmax_scale > 0, "softmax_scale must be a finite positive number, got ",
                    softmax_scale);
  if (!s.is_empty()) {  // nothing is loaded from an empty problem, whose strides may be 0
    check_layout(q, "q");
    check_layout(k, "k");
    if (is_v_colmajor(v)) {
      check_layout_v_colmajor(v);
    } else {
      check_layout(v, "v");
    }
  }
}
}  // namespace

void check_on_gpu(std::vector<std::pair<at::Tensor const*, char const*>> const& tensors, char const* op) {
  at::Tensor const& first = *tensors.begin()->first;
  for (auto const& [t, name] : tensors) {
    TORCH_CHECK_VALUE(t->is_cuda(), name, " is on ", t->device().str(), "; ", op, " needs CUDA tensors on an sm_90 GPU");
  }
  for (auto const& [t, name] : tensors) {
    TORCH_CHECK_VALUE(t->device() == first.device(), "all tensors must be on one device: ", tensors.begin()->second,
                      " is on ", first.device().str(), ", ", name, " on ", t->device().str());
  }
  check_sm90(first.device());
}

void check_tensor_like(at::Tensor const& t, char const* name, at::IntArrayRef sizes, at::ScalarType dtype,
                       char const* like) {
  TORCH_CHECK_VALUE(t.sizes() == sizes, name, " must have the shape of ", like, " ", tuple_str(sizes), ", got ",
                    tuple_str(t.sizes()));
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, name, " must have the dtype of ", like, " (", torch_name(dtype), "), got ",
                   torch_name(t.scalar_type()));
  if (t.numel() > 0) { check_layout(t, name); }
}

void check_descale(at::Tensor const& t, char const* name, AttentionShape const& s, at::ScalarType qkv_dtype) {
  TORCH_CHECK_VALUE(qkv_dtype == at::kFloat8_e4m3fn, name, " is only for FP8 (torch.float8_e4m3fn) q, k, v; got ",
                    torch_name(qkv_dtype), " inputs");
  std::vector<int64_t> const sizes{s.batch, s.nheads_kv};
  TORCH_CHECK_VALUE(t.sizes() == at::IntArrayRef(sizes), name, " must have shape (batch, nheads_kv) = ", tuple_str(sizes),
                    ", got ", tuple_str(t.sizes()));
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, name, " must be torch.float32, got ", torch_name(t.scalar_type()));
}

ScoreOptionsChecked check_score_options(bool causal, int64_t window_left, int64_t window_right, double softcap,
                                        AttentionShape const& s) {
  TORCH_CHECK_VALUE(window_left >= -1 && window_right >= -1, "window_size must be (left, right) with each -1 (unbounded) "
                    "or >= 0, got (", window_left, ", ", window_right, ")");
  TORCH_CHECK_VALUE(!causal || window_right <= 0, "window_size (", window_left, ", ", window_right, ") with causal=True: "
                    "causal attention is the window (left, 0), so right must be -1 or 0");
  TORCH_CHECK_VALUE(std::isfinite(softcap) && softcap >= 0, "softcap must be a finite number >= 0 (0 = off), got ", softcap);
  // Query i sees keys j <= i + seqlen_k - seqlen_q + right and j >= i + seqlen_k - seqlen_q - left: a bound that
  // holds for every query and key is no bound (so a window wider than the sequences runs the non-causal kernel).
  if (window_left >= s.seqlen_k - 1) { window_left = -1; }
  if (causal) { window_right = 0; }
  if (window_right >= s.seqlen_q - 1 && !causal) { window_right = -1; }
  bool const banded = causal || window_left >= 0 || window_right >= 0;
  return {int(window_left), int(window_right), float(softcap), banded};
}

void check_lse(at::Tensor const& t, char const* name, AttentionShape const& s, int64_t varlen_total_q) {
  bool const varlen = varlen_total_q >= 0;
  std::vector<int64_t> const sizes = varlen ? std::vector<int64_t>{s.nheads, varlen_total_q}
                                            : std::vector<int64_t>{s.batch, s.nheads, s.seqlen_q};
  TORCH_CHECK_VALUE(t.sizes() == at::IntArrayRef(sizes), name, " must have shape ",
                    varlen ? "(nheads, total_q) = " : "(batch, nheads, seqlen_q) = ", tuple_str(sizes),
                    " (the forward's lse for these q, k, v), got ", tuple_str(t.sizes()));
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, name, " must be torch.float32 (as the forward returns it), got ",
                   torch_name(t.scalar_type()));
}

namespace {
// An int32 index tensor of exactly `sizes`, its last dim contiguous (the kernel reads it with that stride).
void check_index(at::Tensor const& t, char const* name, std::vector<int64_t> const& sizes, char const* shape_name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kInt, name, " must be torch.int32, got ", torch_name(t.scalar_type()));
  TORCH_CHECK_VALUE(t.sizes() == at::IntArrayRef(sizes), name, " must have shape ", shape_name, " = ", tuple_str(sizes),
                    ", got ", tuple_str(t.sizes()));
  TORCH_CHECK_VALUE(t.numel() == 0 || t.size(-1) == 1 || t.stride(-1) == 1, name, " must be contiguous in its last dim, "
                    "got strides ", tuple_str(t.strides()), "; call .contiguous()");
}
}  // namespace

DecodeShape check_decode(at::Tensor const& q, at::Tensor const& k_cache, at::Tensor const& v_cache,
                         std::optional<at::Tensor> const& k_new, std::optional<at::Tensor> const& v_new,
                         at::Tensor const& cache_seqlens, std::optional<at::Tensor> const& cache_batch_idx,
                         std::optional<at::Tensor> const& page_table, double softmax_scale, int64_t num_splits,
                         char const* op) {
  check_rank_and_dtype(q, "q", op, /*allow_fp8=*/true);
  check_rank_and_dtype(k_cache, "k_cache", op, /*allow_fp8=*/true);
  check_rank_and_dtype(v_cache, "v_cache", op, /*allow_fp8=*/true);
  TORCH_CHECK_TYPE(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
                   "k_cache and v_cache must have q's dtype ", torch_name(q.scalar_type()), ", got ",
                   torch_name(k_cache.scalar_type()), " and ", torch_name(v_cache.scalar_type()));
  TORCH_CHECK_VALUE(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache must have one shape, got ",
                    tuple_str(k_cache.sizes()), " and ", tuple_str(v_cache.sizes()));
  DecodeShape d{};
  AttentionShape& s = d.shape;
  s.batch = q.size(0);
  s.seqlen_q = q.size(1);
  s.nheads = q.size(2);
  s.headdim = q.size(3);
  s.nheads_kv = k_cache.size(2);
  TORCH_CHECK_VALUE(k_cache.size(3) == s.headdim, "head dim mismatch: q has ", s.headdim, ", k_cache and v_cache have ",
                    k_cache.size(3));
  TORCH_CHECK_VALUE(s.nheads >= 1 && s.nheads_kv >= 1 && s.nheads % s.nheads_kv == 0, "nheads (", s.nheads,
                    ") must be a multiple of the caches' nheads_kv (", s.nheads_kv, ")");
  int const max_headdim = kDecodeHeadDims[sizeof(kDecodeHeadDims) / sizeof(int) - 1];
  TORCH_CHECK_VALUE(s.headdim % 8 == 0 && s.headdim >= 8 && s.headdim <= max_headdim, "head dim ", s.headdim,
                    " is not supported: it must be a multiple of 8 in [8, ", max_headdim, "]");
  TORCH_CHECK_VALUE(q.scalar_type() != at::kFloat8_e4m3fn || s.headdim % 16 == 0, "head dim ", s.headdim,
                    " is not supported for FP8 (torch.float8_e4m3fn) caches: it must be a multiple of 16");
  d.cache_entries = k_cache.size(0);
  if (page_table.has_value()) {
    TORCH_CHECK_VALUE(!cache_batch_idx.has_value(), "cache_batch_idx selects entries of a contiguous cache; with "
                      "page_table (a paged cache) it must be None");
    TORCH_CHECK_VALUE(page_table->dim() == 2, "page_table must have 2 dims (batch, pages_per_seq), got shape ",
                      tuple_str(page_table->sizes()));
    d.pages_per_seq = page_table->size(1);
    check_index(*page_table, "page_table", {s.batch, d.pages_per_seq}, "(batch, pages_per_seq)");
    d.page_size = k_cache.size(1);
    TORCH_CHECK_VALUE(d.page_size > 0 && d.page_size % 16 == 0, "a paged cache's page size (k_cache.shape[1]) must be a "
                      "positive multiple of 16, got ", d.page_size);
    s.seqlen_k = d.pages_per_seq * d.page_size;
    TORCH_CHECK_VALUE(s.seqlen_k == 0 || d.cache_entries >= 1, "page_table lists pages of an empty cache");
  } else {
    s.seqlen_k = k_cache.size(1);
    if (cache_batch_idx.has_value()) {
      check_index(*cache_batch_idx, "cache_batch_idx", {s.batch}, "(batch,)");
      TORCH_CHECK_VALUE(s.batch == 0 || d.cache_entries >= 1, "cache_batch_idx selects entries of an empty cache");
    } else {
      TORCH_CHECK_VALUE(d.cache_entries >= s.batch, "k_cache and v_cache need an entry per sequence: ", s.batch,
                        " sequences, ", d.cache_entries, " entries (or pass cache_batch_idx)");
    }
  }
  check_index(cache_seqlens, "cache_seqlens", {s.batch}, "(batch,)");
  TORCH_CHECK_VALUE(k_new.has_value() == v_new.has_value(), "k and v (the new keys and values) must be given together");
  if (k_new.has_value()) {
    TORCH_CHECK_VALUE(k_new->dim() == 4, "k must have 4 dims (batch, seqlen_new, nheads_kv, headdim), got shape ",
                      tuple_str(k_new->sizes()));
    d.seqlen_new = k_new->size(1);
    std::vector<int64_t> const sizes{s.batch, d.seqlen_new, s.nheads_kv, s.headdim};
    for (auto const& [t, name] : {std::pair{&*k_new, "k"}, std::pair{&*v_new, "v"}}) {
      TORCH_CHECK_VALUE(t->sizes() == at::IntArrayRef(sizes), "k and v must be (batch, seqlen_new, nheads_kv, headdim) = ",
                        tuple_str(sizes), " (the caches' heads and head dim), got ", name, " ", tuple_str(t->sizes()));
      TORCH_CHECK_TYPE(t->scalar_type() == q.scalar_type(), "k and v must have the caches' dtype ",
                       torch_name(q.scalar_type()), ", got ", name, " ", torch_name(t->scalar_type()));
      if (t->numel() > 0) { check_layout(*t, name); }
    }
    TORCH_CHECK_VALUE(d.seqlen_new <= s.seqlen_k, "k and v hold ", d.seqlen_new, " new keys per sequence, more than the "
                      "cache holds (", s.seqlen_k, ")");
  }
  // 32-bit key positions with room for a block (decode_kernel.h).
  TORCH_CHECK_VALUE(s.seqlen_k < (int64_t(1) << 30) && s.seqlen_q < (int64_t(1) << 30) && s.batch < 65536,
                    "problem too large: cache capacity and seqlen_q must stay below 2^30 and batch below 65536");
  // The grid's y: one CTA per 16 query rows of each KV head's group.
  TORCH_CHECK_VALUE((s.seqlen_q * (s.nheads / s.nheads_kv) + 15) / 16 * s.nheads_kv < 65536, "problem too large: "
                    "seqlen_q * nheads / 16 must stay below 65536 for the decode kernel, got seqlen_q = ", s.seqlen_q,
                    ", nheads = ", s.nheads);
  TORCH_CHECK_VALUE(std::isfinite(softmax_scale) && softmax_scale > 0, "softmax_scale must be a finite positive number, got ",
                    softmax_scale);
  TORCH_CHECK_VALUE(num_splits >= 0 && num_splits <= 128, "num_splits must be in [0, 128] (0 = chosen per call), got ",
                    num_splits);
  if (s.batch > 0 && s.seqlen_q > 0) { check_layout(q, "q"); }
  if (k_cache.numel() > 0) {
    check_layout(k_cache, "k_cache");
    check_layout(v_cache, "v_cache");
  }
  return d;
}

}  // namespace flash_api
