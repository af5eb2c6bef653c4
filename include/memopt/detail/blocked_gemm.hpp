// memopt/detail/blocked_gemm.hpp — an fp32 CPU GEMM on oneDNN's batch-reduce micro-kernels
// (at::native::cpublas::brgemm, the JIT kernels memopt's flash attention runs on), blocked and
// threaded here: C is cut into kMb × kNb tiles, each tile one thread's, its K walked in kKb
// slices. On 2 cores of an AMD EPYC (Zen 4) it ran the trainer's 8 × d512 shapes at 218–228
// GFLOP/s against MKL's 195–204 through at::mm (the cores' FMA peak: 232), which is why
// memopt/fp32_gemm.hpp offers it where it measures faster; elsewhere LibTorch's GEMM stays.
//   memopt::detail::blocked_gemm::takes(out, a, b)       // fp32 CPU operands this kernel runs?
//   memopt::detail::blocked_gemm::run(out, a, b, false); // out = a·b   (true: out += a·b)
// Each element of C is one thread's sum over K in a fixed order, whatever the thread count: the
// results depend on the shapes only. They differ from MKL's in the summation order (last bits).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include "memopt/detail/cpublas.hpp"
#include "memopt/detail/parallel.hpp"
#include "memopt/detail/transpose.hpp"

namespace memopt::detail::blocked_gemm {

/// The tile of C one brgemm call computes (rows, columns) and the slice of K it reduces: a
/// 128 × 512 block of A (256 KiB) stays in a Zen 4 core's 1 MiB L2 while 512 × 64 panels of B
/// stream past it. Measured on the 8 × d512 shapes: 64–256 rows and 64–128 columns were within
/// 3% of each other; 32-wide tiles and unsliced K = 4096 lost (205 and 60 GFLOP/s).
inline constexpr int64_t kMb = 128, kNb = 64, kKb = 512;

/// Products smaller than this (multiply-adds) or thinner than kMinSide go to LibTorch's GEMM:
/// the copies and the kernel calls here are not worth it there.
inline constexpr int64_t kMinMacs = int64_t{1} << 22, kMinSide = 32;

/// Rows contiguous, each ld() apart (a row-major matrix, or a slice of one).
inline bool row_major(const at::Tensor& t) {
  return t.stride(1) == 1 && (t.size(0) <= 1 || t.stride(0) >= t.size(1));
}
/// Columns contiguous (the transpose of a row-major matrix).
inline bool col_major(const at::Tensor& t) {
  return t.stride(0) == 1 && (t.size(1) <= 1 || t.stride(1) >= t.size(0));
}
inline int64_t ld(const at::Tensor& t) { return std::max(t.stride(0), t.size(1)); }

inline bool fp32_cpu_matrix(const at::Tensor& t) {
  return t.dim() == 2 && t.scalar_type() == at::kFloat && t.device().is_cpu() && t.layout() == at::kStrided &&
         !t.is_conj() && !t.is_neg();
}

inline void run(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b, bool accumulate);

/// Whether this LibTorch has the fp32 brgemm and a product through it is right here: one small
/// product, tried once per process, an error counting as no. (Where the CPU lacks the
/// micro-kernels' ISA, LibTorch 2.15 answers each call with its own GEMM instead: correct but
/// slower, which fp32_gemm's measurement finds.)
inline bool runs_here() {
  static const bool runs = [] {
    if (!MEMOPT_HAS_BRGEMM) return false;
    try {
      const auto a = torch::ones({64, 64});
      auto out = torch::empty({64, 64});
      run(out, a, a, /*accumulate=*/false);
      return torch::equal(out, torch::full({64, 64}, 64.0f));
    } catch (const c10::Error&) {
      return false;
    }
  }();
  return runs;
}

/// Whether run() takes the product a·b into a fresh row-major out: fp32 CPU matrices that fit,
/// big enough, the brgemm running here.
inline bool takes(const at::Tensor& a, const at::Tensor& b) {
  if (!fp32_cpu_matrix(a) || !fp32_cpu_matrix(b) || !runs_here()) return false;
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  return b.size(0) == k && std::min({m, k, n}) >= kMinSide && m * k * n >= kMinMacs;
}
/// ... and into this out: (m, n), row- or column-major.
inline bool takes(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  return takes(a, b) && fp32_cpu_matrix(out) && out.size(0) == a.size(0) && out.size(1) == b.size(1) &&
         (row_major(out) || col_major(out));
}

/// x itself where it is row-major, else a contiguous copy (a column-major x through the SIMD
/// transpose).
inline at::Tensor rows_of(const at::Tensor& x) {
  if (row_major(x)) return x;
  return col_major(x) ? transposed_copy(x.t()) : x.contiguous();
}

/// out (m, n) = a (m, k) · b (k, n), or out += a·b when `accumulate`. Requires takes(out, a, b).
/// brgemm wants both operands row-major: of C = A·B and Cᵀ = Bᵀ·Aᵀ the one that copies fewer
/// elements runs (a weight's gradient dyᵀ·x copies x, not dy), and a tile of a C stored the other
/// way round is transposed into place from a tile buffer.
inline void run(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b, bool accumulate) {
#if MEMOPT_HAS_BRGEMM
  const auto copies = [](const at::Tensor& x) { return row_major(x) ? int64_t{0} : x.numel(); };
  const int64_t as_is = copies(a) + copies(b), flipped = copies(b.t()) + copies(a.t());
  const bool flip = flipped < as_is || (flipped == as_is && !row_major(out));
  const auto A = rows_of(flip ? b.t() : a), B = rows_of(flip ? a.t() : b);
  const auto C = flip ? out.t() : out;  // (M, N)
  const bool c_rows = row_major(C);     // else col_major(C): tiles go through `tile`
  const int64_t M = A.size(0), K = A.size(1), N = B.size(1);
  const int64_t lda = ld(A), ldb = ld(B), ldc = c_rows ? ld(C) : std::max(C.stride(1), C.size(0));
  const float* pa = A.data_ptr<float>();
  const float* pb = B.data_ptr<float>();
  float* pc = C.data_ptr<float>();
  const int64_t tiles_n = (N + kNb - 1) / kNb, tiles = (M + kMb - 1) / kMb * tiles_n;
  parallel_chunks(tiles, 1, [&](int64_t begin, int64_t end, int64_t) {
    std::vector<float> tile(c_rows ? 0 : kMb * kNb), turned(c_rows ? 0 : kMb * kNb);
    for (int64_t t = begin; t < end; ++t) {  // row-block major: a thread's tiles share A's rows
      const int64_t m0 = t / tiles_n * kMb, n0 = t % tiles_n * kNb;
      const int64_t mb = std::min(kMb, M - m0), nb = std::min(kNb, N - n0);
      float* c = c_rows ? pc + m0 * ldc + n0 : tile.data();
      const int64_t c_ld = c_rows ? ldc : nb;
      for (int64_t k0 = 0; k0 < K; k0 += kKb) {
        const bool add = k0 > 0 || (accumulate && c_rows);
        at::native::cpublas::brgemm(mb, nb, std::min(kKb, K - k0), lda, ldb, c_ld, add, pa + m0 * lda + k0,
                                    pb + k0 * ldb + n0, c, /*is_vnni=*/false);
      }
      if (c_rows) continue;
      // C[m][n] lives at pc[m + n·ldc]: the (mb, nb) tile turned to (nb, mb) rows of C's storage.
      float* dst = pc + n0 * ldc + m0;
      if (!accumulate) {
        transpose(tile.data(), mb, nb, nb, dst, ldc);
        continue;
      }
      transpose(tile.data(), mb, nb, nb, turned.data(), mb);
      for (int64_t j = 0; j < nb; ++j)
        for (int64_t i = 0; i < mb; ++i) dst[j * ldc + i] += turned[j * mb + i];
    }
    at::native::cpublas::brgemm_release(/*is_vnni=*/false);
  });
#else
  (void)out, (void)a, (void)b, (void)accumulate;
  TORCH_CHECK(false, "memopt::detail::blocked_gemm::run: this LibTorch has no fp32 brgemm. HINT: check takes() first");
#endif
}

}  // namespace memopt::detail::blocked_gemm
