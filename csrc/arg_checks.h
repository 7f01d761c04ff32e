// The argument rules of the ops, written once: the ops run them before every launch, so a call through
// torch.ops.flash_ext.* directly is as safe as one through the Python API, which adds only the checks of
// its own Python-typed arguments. Violations raise ValueError / TypeError (TORCH_CHECK_VALUE / _TYPE)
// naming the argument; a wrong GPU raises RuntimeError.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace flash_api {

// TMA: base addresses and every stepped stride must be multiples of 16 bytes.
constexpr int64_t kAlignBytes = 16;

// The sizes of an attention problem, read from q (batch, seqlen_q, nheads, headdim) and
// k, v (batch, seqlen_k, nheads_kv, headdim).
struct AttentionShape {
  int64_t batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim;
};

// q, k, v as the kernels need them; `op` names the public function in messages (e.g. "flash_ext.forward").
AttentionShape check_qkv(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, double softmax_scale,
                         char const* op);

// The stride the TMA descriptor gets for a dim: a dim of size 1 is never stepped, so any stride will do.
int64_t tma_stride(at::Tensor const& t, int dim);

// The smallest kernel head dim >= headdim (flash_ext/kernel_table.py's KERNEL_HEADDIMS).
int kernel_headdim(int64_t headdim);

}  // namespace flash_api
