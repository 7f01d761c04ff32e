// The compiled kernels register themselves here: each generated instantiation file
// (hopper/instantiations/*.cu, listed in flash_ext/kernel_table.py) holds one static registration, so the
// set of kernels a build contains is exactly the set of files it compiled. The host dispatch looks
// kernels up by (head dim, dtype, causal, and for the FP8 forward V's layout); build_info() lists them.
#pragma once

#include <cuda_runtime.h>

#include <cutlass/numeric_types.h>

#include <cstddef>
#include <cstring>
#include <vector>

namespace flash {

template <class Element>
constexpr char const* dtype_name();
template <> constexpr char const* dtype_name<cutlass::half_t>() { return "fp16"; }
template <> constexpr char const* dtype_name<cutlass::bfloat16_t>() { return "bf16"; }
template <> constexpr char const* dtype_name<cutlass::float_e4m3_t>() { return "e4m3"; }

// One registry per parameter type, i.e. per direction (FwdParams, BwdParams).
template <class Params>
struct KernelRegistry {
  struct Entry {
    int headdim;
    char const* dtype;
    bool causal;
    void (*launch)(Params const&, cudaStream_t);
    size_t (*workspace_bytes)(Params const&);  // scratch memory the launch needs; nullptr: none
    bool v_colmajor;  // FP8 forward: reads a V whose sequence dim is contiguous (FwdParams::v_colmajor)
  };

  static std::vector<Entry>& entries() {
    static std::vector<Entry> registered;  // filled by static initialisers when the library loads
    return registered;
  }

  static Entry const* find(int headdim, char const* dtype, bool causal, bool v_colmajor = false) {
    for (Entry const& e : entries()) {
      if (e.headdim == headdim && e.causal == causal && e.v_colmajor == v_colmajor && std::strcmp(e.dtype, dtype) == 0) {
        return &e;
      }
    }
    return nullptr;
  }
};

// `static XxxKernelRegistration<...> const r;` in an instantiation file adds its kernel.
template <class Params>
struct KernelRegistration {
  using Entry = typename KernelRegistry<Params>::Entry;
  KernelRegistration(int headdim, char const* dtype, bool causal, decltype(Entry::launch) launch,
                     decltype(Entry::workspace_bytes) workspace_bytes = nullptr, bool v_colmajor = false) {
    KernelRegistry<Params>::entries().push_back({headdim, dtype, causal, launch, workspace_bytes, v_colmajor});
  }
};

}  // namespace flash
