// Op registration (torch.ops.flash_ext.*) and host-side checks and dispatch for the Hopper kernels.
//
// The Python wrapper (flash_ext/interface.py) validates arguments first and gives the friendliest
// messages; the checks here repeat what a kernel needs to be safe, for callers of torch.ops directly.
#include <Python.h>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cutlass/numeric_types.h>
#include <cutlass/version.h>

#include <cmath>
#include <cstdlib>
#include <sstream>
#include <string>
#include <tuple>

#include "flash.h"
#include "flash_fwd_dispatch.h"

namespace {

constexpr int64_t kAlignBytes = 16;  // TMA: base address and non-unit strides in multiples of 16 bytes

// The kernel head dim that runs `headdim` (the next compiled size up).
int kernel_headdim(int64_t headdim) {
  for (int d : {64, 96, 128, 192, 256}) {
    if (headdim <= d) return d;
  }
  return -1;
}

// TMA wants every stride a multiple of 16 bytes; a dim of size 1 is never stepped, so its stride is free.
int64_t tma_stride(at::Tensor const& t, int dim) {
  return t.size(dim) == 1 ? kAlignBytes / int64_t(t.element_size()) : t.stride(dim);
}

void check_layout(at::Tensor const& t, char const* name) {
  TORCH_CHECK_VALUE(t.stride(-1) == 1, name, " must be contiguous in its last (headdim) dim, got strides ", t.strides());
  for (int dim = 0; dim < 3; ++dim) {
    int64_t const stride_bytes = tma_stride(t, dim) * int64_t(t.element_size());
    TORCH_CHECK_VALUE(stride_bytes > 0 && stride_bytes % kAlignBytes == 0 && stride_bytes < (int64_t(1) << 40), name,
                      " stride ", t.stride(dim), " of dim ", dim, " must be a positive multiple of ",
                      kAlignBytes / t.element_size(), " elements; call .contiguous()");
  }
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % kAlignBytes == 0, name,
                    "'s data pointer must be 16-byte aligned; call .clone()");
}

// Developer knobs for A/B measurements: FLASH_EXT_PINGPONG=0/1 forces the consumer warpgroup ping-pong,
// FLASH_EXT_PERSISTENT=0/1 the persistent launch, off/on; unset keeps each kernel's choice.
int env_override(char const* name) {
  char const* value = std::getenv(name);
  if (value == nullptr || value[0] == '\0') return -1;
  return value[0] == '0' ? 0 : 1;
}

template <class Element, int kHeadDim>
void dispatch_causal(flash::FwdParams const& params, bool causal, cudaStream_t stream) {
  if (causal) {
#ifdef FLASH_EXT_CAUSAL1
    flash::run_flash_fwd<Element, kHeadDim, true>(params, stream);
    return;
#endif
  } else {
#ifdef FLASH_EXT_CAUSAL0
    flash::run_flash_fwd<Element, kHeadDim, false>(params, stream);
    return;
#endif
  }
  TORCH_CHECK(false, "flash_ext was built without ", causal ? "causal" : "non-causal",
              " kernels (FLASH_EXT_CAUSAL); rebuild to use them");
}

template <class Element>
void dispatch_headdim(flash::FwdParams const& params, int kernel_hdim, bool causal, cudaStream_t stream) {
  switch (kernel_hdim) {
#ifdef FLASH_EXT_HDIM64
    case 64: return dispatch_causal<Element, 64>(params, causal, stream);
#endif
#ifdef FLASH_EXT_HDIM96
    case 96: return dispatch_causal<Element, 96>(params, causal, stream);
#endif
#ifdef FLASH_EXT_HDIM128
    case 128: return dispatch_causal<Element, 128>(params, causal, stream);
#endif
#ifdef FLASH_EXT_HDIM192
    case 192: return dispatch_causal<Element, 192>(params, causal, stream);
#endif
#ifdef FLASH_EXT_HDIM256
    case 256: return dispatch_causal<Element, 256>(params, causal, stream);
#endif
    default: break;
  }
  TORCH_CHECK(false, "flash_ext was built without head dim ", kernel_hdim, " kernels (FLASH_EXT_HEADDIMS); rebuild to use them");
}

std::tuple<at::Tensor, at::Tensor> mha_fwd(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v,
                                           double softmax_scale, bool causal) {
  TORCH_CHECK_VALUE(q.is_cuda() && k.is_cuda() && v.is_cuda(), "q, k, v must be CUDA tensors");
  TORCH_CHECK_VALUE(q.device() == k.device() && q.device() == v.device(), "q, k, v must be on one device");
  int major = 0, minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, q.device().index()));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, q.device().index()));
  TORCH_CHECK(major == 9 && minor == 0, "flash_ext needs an sm_90 GPU; device ", q.device().index(), " is sm_", major, minor);
  auto const dtype = q.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kHalf || dtype == at::kBFloat16, "q must be float16 or bfloat16, got ", dtype);
  TORCH_CHECK_TYPE(k.scalar_type() == dtype && v.scalar_type() == dtype, "q, k, v must share one dtype");
  TORCH_CHECK_VALUE(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be 4-D (batch, seqlen, nheads, headdim)");
  int64_t const batch = q.size(0), seqlen_q = q.size(1), nheads = q.size(2), headdim = q.size(3);
  int64_t const seqlen_k = k.size(1), nheads_kv = k.size(2);
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(), "k and v must have the same shape");
  TORCH_CHECK_VALUE(k.size(0) == batch, "k and v must have q's batch size");
  TORCH_CHECK_VALUE(k.size(3) == headdim, "k and v must have q's head dim");
  TORCH_CHECK_VALUE(batch >= 1 && nheads >= 1 && nheads_kv >= 1 && seqlen_q >= 1 && seqlen_k >= 1,
                    "batch, nheads, nheads_kv, seqlen_q and seqlen_k must be >= 1");
  TORCH_CHECK_VALUE(nheads % nheads_kv == 0, "nheads must be a multiple of nheads_kv");
  TORCH_CHECK_VALUE(headdim % 8 == 0 && headdim >= 8 && headdim <= 256, "head dim must be a multiple of 8 in [8, 256], got ",
                    headdim);
  TORCH_CHECK_VALUE(batch <= 65535 && nheads <= 65535, "batch and nheads must be <= 65535 (grid limits)");
  TORCH_CHECK_VALUE(seqlen_q < (int64_t(1) << 31) && seqlen_k < (int64_t(1) << 31), "sequence lengths must be < 2^31");
  TORCH_CHECK_VALUE(softmax_scale > 0 && std::isfinite(softmax_scale), "softmax_scale must be finite and positive");
  check_layout(q, "q");
  check_layout(k, "k");
  check_layout(v, "v");

  c10::cuda::CUDAGuard device_guard(q.device());
  at::Tensor out = at::empty({batch, seqlen_q, nheads, headdim}, q.options());
  at::Tensor lse = at::empty({batch, nheads, seqlen_q}, q.options().dtype(at::kFloat));

  flash::FwdParams params{};
  params.q_ptr = q.data_ptr();
  params.k_ptr = k.data_ptr();
  params.v_ptr = v.data_ptr();
  params.o_ptr = out.data_ptr();
  params.lse_ptr = lse.data_ptr<float>();
  params.q_batch_stride = tma_stride(q, 0), params.q_row_stride = tma_stride(q, 1), params.q_head_stride = tma_stride(q, 2);
  params.k_batch_stride = tma_stride(k, 0), params.k_row_stride = tma_stride(k, 1), params.k_head_stride = tma_stride(k, 2);
  params.v_batch_stride = tma_stride(v, 0), params.v_row_stride = tma_stride(v, 1), params.v_head_stride = tma_stride(v, 2);
  params.o_batch_stride = tma_stride(out, 0), params.o_row_stride = tma_stride(out, 1), params.o_head_stride = tma_stride(out, 2);
  params.batch = int(batch);
  params.seqlen_q = int(seqlen_q);
  params.seqlen_k = int(seqlen_k);
  params.nheads = int(nheads);
  params.nheads_kv = int(nheads_kv);
  params.headdim = int(headdim);
  params.softmax_scale = float(softmax_scale);
  params.pingpong = env_override("FLASH_EXT_PINGPONG");
  params.persistent = env_override("FLASH_EXT_PERSISTENT");

  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  int const kernel_hdim = kernel_headdim(headdim);
  if (dtype == at::kBFloat16) {
#ifdef FLASH_EXT_BF16
    dispatch_headdim<cutlass::bfloat16_t>(params, kernel_hdim, causal, stream);
#else
    TORCH_CHECK(false, "flash_ext was built without bf16 kernels (FLASH_EXT_DTYPES); rebuild to use them");
#endif
  } else {
#ifdef FLASH_EXT_FP16
    dispatch_headdim<cutlass::half_t>(params, kernel_hdim, causal, stream);
#else
    TORCH_CHECK(false, "flash_ext was built without fp16 kernels (FLASH_EXT_DTYPES); rebuild to use them");
#endif
  }
  return {out, lse};
}

std::string build_info() {
  std::ostringstream info;
  info << "headdims:";
#ifdef FLASH_EXT_HDIM64
  info << " 64";
#endif
#ifdef FLASH_EXT_HDIM96
  info << " 96";
#endif
#ifdef FLASH_EXT_HDIM128
  info << " 128";
#endif
#ifdef FLASH_EXT_HDIM192
  info << " 192";
#endif
#ifdef FLASH_EXT_HDIM256
  info << " 256";
#endif
  info << "; dtypes:";
#ifdef FLASH_EXT_FP16
  info << " fp16";
#endif
#ifdef FLASH_EXT_BF16
  info << " bf16";
#endif
  info << "; causal:";
#ifdef FLASH_EXT_CAUSAL0
  info << " no";
#endif
#ifdef FLASH_EXT_CAUSAL1
  info << " yes";
#endif
  info << "; cutlass " << CUTLASS_MAJOR << "." << CUTLASS_MINOR << "." << CUTLASS_PATCH;
  info << "; cuda " << CUDART_VERSION;
  return info.str();
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
  m.def("fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal) -> (Tensor out, Tensor lse)");
  m.def("build_info() -> str", &build_info);
}

FLASH_EXT_LIBRARY_IMPL(FLASH_EXT_OPS_NAMESPACE, CUDA, m) { m.impl("fwd", &mha_fwd); }

// `import flash_ext._C` loads this library, whose static initialisers above register the ops. The module
// itself is empty; it exists so that the stable (abi3) Python API is all this file links against.
extern "C" PyObject* FLASH_EXT_PYINIT(FLASH_EXT_MODULE_NAME)(void) {
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
