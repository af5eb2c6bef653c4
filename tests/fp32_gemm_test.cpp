// tests/fp32_gemm_test.cpp — memopt/fp32_gemm.hpp: in Blocked mode fp32 mm, addmm and addmm_ (and
// so torch::linear and its backward) run the blocked kernel and equal LibTorch's products within
// LibTorch's own error; Native mode is LibTorch's kernel bit for bit; products the blocked kernel
// does not take (small, other dtypes, other scalars) and bad operands go to LibTorch; the
// environment variable picks a mode or measures, and a bad value is an error with a HINT.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <string>

#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <torch/torch.h>

#include <memopt/fp32_gemm.hpp>
#include <memopt/policies/precision.hpp>

#include "support.hpp"

namespace {

namespace fgemm = memopt::fp32_gemm;

int64_t blocked_calls() { return fgemm::detail::blocked_count().load(); }

/// Largest |x - exact| for an fp64 `exact`.
double fp32_gemm_error(const torch::Tensor& x, const torch::Tensor& exact) {
  return (x.to(torch::kFloat64) - exact).abs().max().item<double>();
}

}  // namespace

TEST_CASE("Blocked mode: mm, mm_out, addmm and addmm_ run blocked, within LibTorch's own error", "[fp32_gemm]") {
  if (!memopt::detail::blocked_gemm::runs_here()) return memopt::test::skip_case("no fp32 brgemm here");
  fgemm::ScopedMode blocked(fgemm::Mode::Blocked);
  torch::manual_seed(5);
  const auto x = torch::randn({384, 256}), w = torch::randn({320, 256}), bias = torch::randn({320});
  const auto x64 = x.to(torch::kFloat64), w64 = w.to(torch::kFloat64);
  const auto exact = x64.mm(w64.t());
  const double native = fp32_gemm_error(at::cpu::mm(x, w.t()), exact);

  auto before = blocked_calls();
  const auto y = torch::mm(x, w.t());
  CHECK(blocked_calls() == before + 1);
  CHECK(fp32_gemm_error(y, exact) <= 2 * native);

  before = blocked_calls();
  const auto yb = torch::addmm(bias, x, w.t());
  CHECK(blocked_calls() == before + 1);
  CHECK(fp32_gemm_error(yb, exact + bias.to(torch::kFloat64)) <= 2 * native + 1e-5);

  const auto g0 = torch::randn({320, 256});  // a gradient accumulated: g += dyᵀ·x
  const auto dy = torch::randn({384, 320});
  const auto g_exact = g0.to(torch::kFloat64) + dy.to(torch::kFloat64).t().mm(x64);
  auto g_native = g0.clone();
  at::cpu::addmm_(g_native, dy.t(), x);
  auto g = g0.clone();
  before = blocked_calls();
  g.addmm_(dy.t(), x);
  CHECK(blocked_calls() == before + 1);
  CHECK(fp32_gemm_error(g, g_exact) <= 2 * fp32_gemm_error(g_native, g_exact) + 1e-5);

  // mm_out (the fused loss head's): into an empty out it resizes, and into a slice of rows; the
  // same bits as mm's blocked product.
  auto resized = torch::empty({0});
  auto rows = torch::zeros({400, 320});
  auto rows_view = rows.narrow(0, 8, 384);
  before = blocked_calls();
  torch::mm_out(resized, x, w.t());
  torch::mm_out(rows_view, x, w.t());
  CHECK(blocked_calls() == before + 2);
  CHECK(torch::equal(resized, y));
  CHECK(torch::equal(rows.narrow(0, 8, 384), y));
  CHECK(torch::equal(rows.narrow(0, 0, 8), torch::zeros({8, 320})));

  SECTION("other scalars, small products and other dtypes go to LibTorch") {
    before = blocked_calls();
    const auto half = torch::addmm(bias, x, w.t(), /*beta=*/0.5, /*alpha=*/1);
    CHECK(torch::equal(half, at::cpu::addmm(bias, x, w.t(), 0.5, 1)));
    const auto small = torch::randn({16, 16});
    CHECK(torch::equal(torch::mm(small, small), at::cpu::mm(small, small)));
    const auto d = x.to(torch::kDouble);
    CHECK(torch::allclose(torch::mm(d, d.t()), x64.mm(x64.t())));
    CHECK(blocked_calls() == before);
  }
}

TEST_CASE("Blocked mode: a linear layer's gradients equal Native mode's within fp32 error", "[fp32_gemm]") {
  if (!memopt::detail::blocked_gemm::runs_here()) return memopt::test::skip_case("no fp32 brgemm here");
  torch::manual_seed(6);
  const auto x0 = torch::randn({4, 96, 256}), w0 = torch::randn({384, 256}) * 0.05;
  const auto run = [&](fgemm::Mode mode) {
    fgemm::ScopedMode scoped(mode);
    auto x = x0.clone().requires_grad_(), w = w0.clone().requires_grad_();
    auto y = torch::linear(x, w);  // (4, 96, 384)
    (y * y).sum().backward();
    return std::tuple{y.detach(), x.grad(), w.grad()};
  };
  const auto before = blocked_calls();
  const auto [y1, dx1, dw1] = run(fgemm::Mode::Blocked);
  CHECK(blocked_calls() >= before + 3);  // y, dX and dW
  const auto [y0, dx0, dw0] = run(fgemm::Mode::Native);
  for (const auto& [got, want] : {std::pair{y1, y0}, std::pair{dx1, dx0}, std::pair{dw1, dw0}}) {
    const double scale = want.abs().max().item<double>();
    CHECK((got - want).abs().max().item<double>() <= 1e-5 * scale);
  }
}

TEST_CASE("Native mode is LibTorch's fp32 kernel bit for bit", "[fp32_gemm]") {
  fgemm::ScopedMode native(fgemm::Mode::Native);
  torch::manual_seed(7);
  const auto a = torch::randn({300, 200}), b = torch::randn({200, 260});
  const auto before = blocked_calls();
  CHECK(torch::equal(torch::mm(a, b), at::cpu::mm(a, b)));
  CHECK(blocked_calls() == before);
}

TEST_CASE("Blocked mode: bad products get LibTorch's own errors", "[fp32_gemm]") {
  fgemm::ScopedMode blocked(fgemm::Mode::Blocked);
  CHECK_THROWS_WITH(torch::mm(torch::randn({256, 256}), torch::randn({255, 256})),
                    Catch::Contains("cannot be multiplied"));
  auto g = torch::randn({255, 256});
  CHECK_THROWS(g.addmm_(torch::randn({256, 256}), torch::randn({256, 256})));
}

TEST_CASE("MEMOPT_FP32_GEMM picks a mode or measures, a bad value is an error with a HINT", "[fp32_gemm]") {
  CHECK(fgemm::detail::decide("native").mode == fgemm::Mode::Native);
  CHECK(std::string(fgemm::mode_name(fgemm::Mode::Native)) == "native");  // as MEMOPT_FP32_GEMM spells it
  CHECK(std::string(fgemm::mode_name(fgemm::Mode::Blocked)) == "blocked");
  if (memopt::detail::blocked_gemm::runs_here()) {
    CHECK(fgemm::detail::decide("blocked").mode == fgemm::Mode::Blocked);
  } else {
    CHECK_THROWS_WITH(fgemm::detail::decide("blocked"), Catch::Contains("HINT"));
  }
  CHECK_THROWS_WITH(fgemm::detail::decide("mkl"), Catch::Contains("'mkl'") && Catch::Contains("HINT"));
  const auto measured = fgemm::detail::decide(nullptr);
  INFO(measured.reason);
  CHECK_THAT(measured.reason, Catch::Contains("GFLOP/s") || Catch::Contains("no fp32 brgemm"));
  CHECK_THAT(measured.reason, Catch::Contains(memopt::cpu_kind()) || Catch::Contains("no fp32 brgemm"));
}

TEST_CASE("Every precision policy enables fp32_gemm when a Trainer prepares the CPU", "[fp32_gemm]") {
  fgemm::ScopedMode keep(fgemm::mode());
  memopt::precision::Fp32{}.prepare(c10::kCPU);
  CHECK(fgemm::enabled());
}
