// The compiled kernels register themselves here: each generated instantiation file
// (hopper/instantiations/*.cu, listed in flash_ext/kernel_table.py) holds one static registration, so the
// set of kernels a build contains is exactly the set of files it compiled. The host dispatch looks
// launchers up by (head dim, dtype, causal); build_info() lists them.
#pragma once

#include <cuda_runtime.h>

#include <cutlass/numeric_types.h>

#include <cstring>
#include <vector>

namespace flash {

template <class Element>
constexpr char const* dtype_name();
template <> constexpr char const* dtype_name<cutlass::half_t>() { return "fp16"; }
template <> constexpr char const* dtype_name<cutlass::bfloat16_t>() { return "bf16"; }

// One registry per launcher signature (i.e. per direction: the forward takes FwdParams).
template <class Params>
struct KernelRegistry {
  using Launcher = void (*)(Params const&, cudaStream_t);
  struct Entry {
    int headdim;
    char const* dtype;
    bool causal;
    Launcher launch;
  };

  static std::vector<Entry>& entries() {
    static std::vector<Entry> registered;  // filled by static initialisers when the library loads
    return registered;
  }

  static Launcher find(int headdim, char const* dtype, bool causal) {
    for (Entry const& e : entries()) {
      if (e.headdim == headdim && e.causal == causal && std::strcmp(e.dtype, dtype) == 0) { return e.launch; }
    }
    return nullptr;
  }
};

// `static KernelRegistration<Params> const r{...};` in an instantiation file adds its launcher.
template <class Params>
struct KernelRegistration {
  using Registry = KernelRegistry<Params>;
  KernelRegistration(int headdim, char const* dtype, bool causal, typename Registry::Launcher launch) {
    Registry::entries().push_back({headdim, dtype, causal, launch});
  }
};

}  // namespace flash
