// memopt/detail/transpose.hpp — transposes on the CPU: fbgemm's SIMD transpose where LibTorch
// ships it (its CPU flash attention transposes with it), else 16-row tiles; a matrix's
// contiguous transpose through it (at::contiguous on a transposed bf16 view took 16 ms for a
// 4096 × 4096 matrix on 2 AMX Xeon threads, these tiles 6.6). -DMEMOPT_FBGEMM_TRANSPOSE=0
// builds the plain loops instead.
//   memopt::detail::transpose(src, rows, cols, rs, dst, ld);   // raw rows of 16- or 32-bit elements
//   auto xt = memopt::detail::transposed_copy(x);              // (R, C) -> contiguous (C, R)
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <torch/torch.h>

#include "memopt/detail/parallel.hpp"

#ifndef MEMOPT_FBGEMM_TRANSPOSE
#if __has_include(<fbgemm/Utils.h>) && defined(__x86_64__)
#define MEMOPT_FBGEMM_TRANSPOSE 1
#else
#define MEMOPT_FBGEMM_TRANSPOSE 0
#endif
#endif
#if MEMOPT_FBGEMM_TRANSPOSE
#include <fbgemm/Utils.h>
#endif

namespace memopt::detail {

/// dst (cols × rows, leading dimension ld) = the transpose of a rows × cols src (row stride rs)
/// of 32-bit (fp32, or bf16 pairs as one word) or 16-bit elements, moved bit for bit: fbgemm's
/// SIMD transpose where LibTorch ships it (on the trainer's 8 × d512 attention the 16 × 16
/// scalar tiles below took 12% of the flash kernel's time in fp32), else those tiles.
template <class E>
void transpose(const E* src, int64_t rows, int64_t cols, int64_t rs, E* dst, int64_t ld) {
  static_assert(sizeof(E) == 4 || sizeof(E) == 2, "32- or 16-bit elements");
#if MEMOPT_FBGEMM_TRANSPOSE
  using Bits = std::conditional_t<sizeof(E) == 4, float, uint16_t>;  // fbgemm's instantiations
  fbgemm::transpose_simd<Bits>(rows, cols, reinterpret_cast<const Bits*>(src), rs, reinterpret_cast<Bits*>(dst), ld);
#else
  constexpr int64_t kTile = 16;  // a column-wise walk would touch a new cache line with every element
  for (int64_t r0 = 0; r0 < rows; r0 += kTile)
    for (int64_t c = 0; c < cols; ++c)
      for (int64_t r = r0; r < std::min(rows, r0 + kTile); ++r) dst[c * ld + r] = src[r * rs + c];
#endif
}

/// The contiguous (C, R) transpose of a 2-D (R, C) x of 16- or 32-bit elements (columns
/// contiguous, else a contiguous copy first), in 64 × 64 tiles over LibTorch's threads (a
/// 4096 × 1408 bf16 matrix: 1.7 ms on 2 AMX Xeon threads, against 2.7 in column strips).
inline torch::Tensor transposed_copy(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && (x.element_size() == 2 || x.element_size() == 4),
              "memopt::detail::transposed_copy: a 2-D tensor of 16- or 32-bit elements (got ", x.sizes(), " ",
              x.scalar_type(), "). HINT: reshape to (rows, cols) first.");
  const auto src = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t R = src.size(0), C = src.size(1), rs = src.stride(0);
  auto out = torch::empty({C, R}, src.options());
  constexpr int64_t kTile = 64;
  auto run = [&](auto element) {
    using E = decltype(element);
    const E* s = static_cast<const E*>(src.data_ptr());
    E* d = static_cast<E*>(out.data_ptr());
    parallel_chunks((R + kTile - 1) / kTile, 1, [&](int64_t begin, int64_t end, int64_t) {
      for (int64_t r0 = begin * kTile; r0 < std::min(R, end * kTile); r0 += kTile)
        for (int64_t c0 = 0; c0 < C; c0 += kTile)
          transpose(s + r0 * rs + c0, std::min(kTile, R - r0), std::min(kTile, C - c0), rs, d + c0 * R + r0, R);
    });
  };
  if (src.element_size() == 2) run(uint16_t{});
  else run(float{});
  return out;
}

}  // namespace memopt::detail
