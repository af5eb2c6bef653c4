// memopt/detail/cpublas.hpp — what LibTorch's CPU BLAS layer (at::native::cpublas) offers in
// this build and on this CPU: the batch-reduce GEMM (MEMOPT_HAS_BRGEMM: oneDNN's micro-kernels,
// which nn/attention_flash*.hpp run on), and whether oneDNN multiplies bf16 on AMX tiles
// (bf16_tiles: flash_supported and nn/linear_shared.hpp's weight_grad ask it).
#pragma once

#include <ATen/native/CPUBlas.h>

#if defined(CPUBLAS_BRGEMM_BF16BF16F32) && defined(CPUBLAS_BRGEMM_F32F32F32)
#define MEMOPT_HAS_BRGEMM 1
#else
#define MEMOPT_HAS_BRGEMM 0
#endif

namespace memopt::detail {

/// Whether oneDNN multiplies bf16 on the CPU's AMX tiles (cpublas::could_pack, in LibTorch
/// builds that have the query): asked once per process.
inline bool bf16_tiles() {
#if defined(CPUBLAS_BRGEMM_BF16BF16F32)
  static const bool tiles = at::native::cpublas::could_pack(at::kBFloat16);
  return tiles;
#else
  return false;
#endif
}

}  // namespace memopt::detail
