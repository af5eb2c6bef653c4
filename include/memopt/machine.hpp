// memopt/machine.hpp — what this machine computes fast, measured rather than assumed: a short
// fp32-vs-bf16 GEMM probe run once per process, and the precision choice that follows from it
// (`--precision auto` in the examples). The CPU kind itself is memopt::cpu_kind() (runtime.hpp).
//
// Why measure: the same bf16 autocast step is ~1.6x faster than fp32 on an AMD EPYC with
// avx512_bf16, ~5x on a Xeon with AMX, and a bf16 matmul was 37x SLOWER than fp32 on an
// AVX2-only CPU (LibTorch 1.13). No ratio holds across machines.
#pragma once

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "memopt/memory/tracker.hpp"
#include "memopt/runtime.hpp"

namespace memopt::machine {

/// GEMM speed in GFLOP/s for fp32 and bf16 at this process's thread count.
struct MatmulSpeed {
  int64_t size = 0;  // n of the n x n x n product timed
  int threads = 0;
  double fp32_gflops = 0, bf16_gflops = 0;
  double bf16_over_fp32() const { return fp32_gflops > 0 ? bf16_gflops / fp32_gflops : 0; }
};

namespace detail {
/// A rows x cols operand of normal values for a speed probe, drawn from a generator of its own: a
/// probe never moves the global RNG (a Trainer probes when built, after the user's seed).
inline torch::Tensor probe_operand(int64_t rows, int64_t cols, torch::Dtype dtype, uint64_t seed) {
  return torch::randn({rows, cols}, at::detail::createCPUGenerator(seed)).to(dtype);
}

/// GFLOP/s of the fastest of `reps` (m x k)·(k x n) products `product(a, b)` of operands in
/// `dtype` (one untimed warm-up): the fastest, not the median, so another process briefly on the
/// cores does not decide it. Its tensors stay out of the tracked peaks (memory::ExcludedFromPeaks).
template <class Product>
double gemm_gflops(int64_t m, int64_t k, int64_t n, torch::Dtype dtype, int reps, Product product) {
  memory::ExcludedFromPeaks probe;
  torch::NoGradGuard no_grad;
  auto a = probe_operand(m, k, dtype, 1), b = probe_operand(k, n, dtype, 2);
  auto c = product(a, b);
  std::vector<double> seconds;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    c = product(a, b);
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return 2.0 * static_cast<double>(m * k * n) / std::max(*std::min_element(seconds.begin(), seconds.end()), 1e-9) /
         1e9;
}
}  // namespace detail

/// GFLOP/s of an (m x k)·(k x n) torch::mm in `dtype` at this process's thread count, the
/// fastest of `reps`: what a model's GEMM of that shape runs at here (the peak an MFU divides by;
/// a bf16 product on the CPU runs the kernel memopt::bf16_gemm chose, once it is enabled).
inline double gemm_gflops(int64_t m, int64_t k, int64_t n, torch::Dtype dtype, int reps = 3) {
  return detail::gemm_gflops(m, k, n, dtype, reps,
                             [](const torch::Tensor& a, const torch::Tensor& b) { return torch::mm(a, b); });
}

/// Measures fp32 and bf16 GEMM speed (512^3, fastest of 5; ~0.1 s, ~0.5 s where bf16 is slow).
/// The first call measures; later calls return the same figures.
inline const MatmulSpeed& matmul_speed() {
  static const MatmulSpeed speed = [] {
    MatmulSpeed s;
    s.size = 512;
    s.threads = at::get_num_threads();
    s.fp32_gflops = gemm_gflops(s.size, s.size, s.size, torch::kFloat32, 5);
    s.bf16_gflops = gemm_gflops(s.size, s.size, s.size, torch::kBFloat16, 5);
    return s;
  }();
  return speed;
}

/// The precision `auto` resolves to, and why (one line for the log).
struct PrecisionChoice {
  std::string precision;  // "bf16" (autocast) or "fp32"
  std::string reason;
};

/// bf16 autocast when a bf16 GEMM is at least `min_ratio` times as fast as fp32 here (autocast
/// pays for casts and keeps fp32 master weights, so a bf16 matmul only a little faster is no
/// win), fp32 otherwise. On a CUDA device: bf16 (every GPU memopt targets has bf16 tensor cores).
inline PrecisionChoice choose_precision(const torch::Device& device = torch::kCPU, double min_ratio = 1.2) {
  if (device.is_cuda()) return {"bf16", "CUDA device: bf16 autocast on tensor cores"};
  const auto& s = matmul_speed();
  const bool bf16 = s.bf16_over_fp32() >= min_ratio;
  return {bf16 ? "bf16" : "fp32",
          fmt::format("measured bf16 matmul at {:.2f}x fp32 ({:.0f} vs {:.0f} GFLOP/s, {}^3, {} threads) on a {} CPU: "
                      "{} (bf16 needs >= {:.1f}x)",
                      s.bf16_over_fp32(), s.bf16_gflops, s.fp32_gflops, s.size, s.threads, memopt::cpu_kind(),
                      bf16 ? "bf16 autocast" : "fp32", min_ratio)};
}

/// Resolves a --precision flag value: "auto" becomes choose_precision()'s answer; anything
/// else is kept, with "given on the command line" as its reason.
inline PrecisionChoice resolve_precision(const std::string& flag, const torch::Device& device = torch::kCPU) {
  if (flag == "auto") return choose_precision(device);
  return {flag, "given on the command line"};
}

}  // namespace memopt::machine
