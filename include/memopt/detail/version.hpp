// memopt/detail/version.hpp — not API. LibTorch version and build feature macros that
// the version adapters in detail/ switch on (memopt targets LibTorch 2.11 - 2.15).
#pragma once

#include <torch/version.h>

#define MEMOPT_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

#if defined(USE_CUDA) || defined(MEMOPT_WITH_CUDA)
#if __has_include(<c10/cuda/CUDACachingAllocator.h>)
#define MEMOPT_HAS_CUDA 1
#endif
#endif
#ifndef MEMOPT_HAS_CUDA
#define MEMOPT_HAS_CUDA 0
#endif
