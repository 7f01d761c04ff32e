// Op registration (torch.ops.flash_ext.*) and the host side of each op: argument checks (arg_checks.h),
// the kernel's parameters, and the look-up of the compiled kernel in the registry.
#include <Python.h>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cutlass/version.h>

#include <cstdlib>
#include <sstream>
#include <string>
#include <tuple>

#include "arg_checks.h"
#include "flash.h"
#include "kernel_registry.h"

namespace {

using flash_api::tma_stride;

// Developer knobs for A/B measurements: FLASH_EXT_PINGPONG=0/1 forces the consumer warpgroup ping-pong,
// FLASH_EXT_PERSISTENT=0/1 the persistent launch, off/on; unset keeps each kernel's choice.
int env_override(char const* name) {
  char const* value = std::getenv(name);
  if (value == nullptr || value[0] == '\0') return -1;
  return value[0] == '0' ? 0 : 1;
}

char const* dtype_name(at::ScalarType dtype) { return dtype == at::kBFloat16 ? "bf16" : "fp16"; }

template <class Params>
typename flash::KernelRegistry<Params>::Launcher find_kernel(char const* direction, int kernel_hdim, at::ScalarType dtype,
                                                              bool causal) {
  auto launch = flash::KernelRegistry<Params>::find(kernel_hdim, dtype_name(dtype), causal);
  TORCH_CHECK(launch != nullptr, "flash_ext was built without the ", dtype_name(dtype), " head dim ", kernel_hdim, " ",
              causal ? "causal" : "non-causal", " ", direction,
              " kernel (build switches FLASH_EXT_HEADDIMS / FLASH_EXT_DTYPES / FLASH_EXT_CAUSAL); rebuild to use it");
  return launch;
}

std::tuple<at::Tensor, at::Tensor> mha_fwd(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v,
                                           double softmax_scale, bool causal) {
  auto const s = flash_api::check_qkv(q, k, v, softmax_scale, "flash_ext.forward");
  auto launch = find_kernel<flash::FwdParams>("forward", flash_api::kernel_headdim(s.headdim), q.scalar_type(), causal);

  c10::cuda::CUDAGuard device_guard(q.device());
  at::Tensor out = at::empty({s.batch, s.seqlen_q, s.nheads, s.headdim}, q.options());
  at::Tensor lse = at::empty({s.batch, s.nheads, s.seqlen_q}, q.options().dtype(at::kFloat));

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
  params.batch = int(s.batch);
  params.seqlen_q = int(s.seqlen_q);
  params.seqlen_k = int(s.seqlen_k);
  params.nheads = int(s.nheads);
  params.nheads_kv = int(s.nheads_kv);
  params.headdim = int(s.headdim);
  params.softmax_scale = float(softmax_scale);
  params.pingpong = env_override("FLASH_EXT_PINGPONG");
  params.persistent = env_override("FLASH_EXT_PERSISTENT");

  launch(params, c10::cuda::getCurrentCUDAStream(q.device().index()).stream());
  return {out, lse};
}

// A JSON object: the registered kernels and the library versions (flash_ext.build_info() parses it).
template <class Params>
void append_kernels(std::ostringstream& json, char const* direction, bool& first) {
  for (auto const& e : flash::KernelRegistry<Params>::entries()) {
    json << (first ? "" : ", ") << "{\"direction\": \"" << direction << "\", \"headdim\": " << e.headdim
         << ", \"dtype\": \"" << e.dtype << "\", \"causal\": " << (e.causal ? "true" : "false") << "}";
    first = false;
  }
}

std::string build_info() {
  std::ostringstream json;
  json << "{\"kernels\": [";
  bool first = true;
  append_kernels<flash::FwdParams>(json, "fwd", first);
  json << "], \"cutlass\": \"" << CUTLASS_MAJOR << "." << CUTLASS_MINOR << "." << CUTLASS_PATCH << "\", \"cuda\": \""
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
  m.def("fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal) -> (Tensor out, Tensor lse)");
  m.def("build_info() -> str", &build_info);
}

// CUDA runs the kernels; CPU tensors get the same argument checks, which end in "needs CUDA tensors".
FLASH_EXT_LIBRARY_IMPL(FLASH_EXT_OPS_NAMESPACE, CUDA, m) { m.impl("fwd", &mha_fwd); }
FLASH_EXT_LIBRARY_IMPL(FLASH_EXT_OPS_NAMESPACE, CPU, m) { m.impl("fwd", &mha_fwd); }

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
