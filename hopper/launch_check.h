// Turns a failed CUDA runtime call on the host into a C++ exception (surfaced in Python as RuntimeError).
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#define FLASH_CUDA_CHECK(call)                                                                          \
  do {                                                                                                 \
    cudaError_t const flash_cuda_status_ = (call);                                                      \
    if (flash_cuda_status_ != cudaSuccess) {                                                            \
      throw std::runtime_error(std::string("flash_ext CUDA error: ") + cudaGetErrorString(flash_cuda_status_) + \
                               " at " __FILE__ ":" + std::to_string(__LINE__) + " (" #call ")");        \
    }                                                                                                  \
  } while (0)
