// tests/detail/blocked_gemm_test.cpp — memopt/detail/blocked_gemm.hpp: the blocked brgemm GEMM is
// the product within the error LibTorch's own fp32 GEMM makes against an fp64 one, for every
// operand layout (a weight's transpose in the forward, dyᵀ in a weight's gradient), ragged tiles,
// K in several slices, overwriting or accumulating into a row- or column-major out; its results
// do not depend on the thread count; what it does not take, it says so.
#include <catch2/catch.hpp>

#include <string>
#include <utility>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <torch/torch.h>

#include <memopt/detail/blocked_gemm.hpp>

#include "support.hpp"

namespace {

namespace bg = memopt::detail::blocked_gemm;

double max_error(const torch::Tensor& x, const torch::Tensor& exact) {
  return (x.to(torch::kFloat64) - exact).abs().max().item<double>();
}

}  // namespace

TEST_CASE("blocked_gemm: each layout within LibTorch's own fp32 error of the fp64 product", "[detail][blocked_gemm]") {
  if (!memopt::detail::blocked_gemm::runs_here()) return memopt::test::skip_case("no fp32 brgemm here");
  torch::manual_seed(3);
  // 200 x 1100 x 300: ragged 128 x 64 tiles, K in three slices of at most 512.
  const int64_t m = 200, k = 1100, n = 300;
  const auto a = torch::randn({m, k}), b = torch::randn({k, n});
  const auto a_cols = a.t().contiguous().t(), b_cols = b.t().contiguous().t();  // the same values, columns contiguous
  const auto exact = a.to(torch::kFloat64).mm(b.to(torch::kFloat64));
  const double native = max_error(at::cpu::mm(a, b), exact);
  const std::vector<std::pair<std::string, std::pair<torch::Tensor, torch::Tensor>>> layouts{
      {"rows · rows (dX = dy·W)", {a, b}},
      {"rows · columns (y = x·Wᵀ)", {a, b_cols}},
      {"columns · rows (dW = dyᵀ·x)", {a_cols, b}},
      {"columns · columns", {a_cols, b_cols}},
      {"a slice of a wider matrix", {torch::cat({a, a}, 1).narrow(1, k, k), b}}};
  for (const auto& [name, ops] : layouts) {
    for (const bool out_rows : {true, false}) {
      DYNAMIC_SECTION(name << (out_rows ? ", row-major out" : ", column-major out")) {
        const auto& [x, y] = ops;
        REQUIRE(bg::takes(x, y));
        auto out = out_rows ? torch::full({m, n}, 7.0f) : torch::full({n, m}, 7.0f).t();
        REQUIRE(bg::takes(out, x, y));
        bg::run(out, x, y, /*accumulate=*/false);
        INFO("blocked error " << max_error(out, exact) << ", LibTorch's " << native);
        CHECK(max_error(out, exact) <= 2 * native);
        const auto bias = torch::randn({m, n});
        auto acc = out_rows ? bias.clone() : bias.t().contiguous().t();
        bg::run(acc, x, y, /*accumulate=*/true);
        CHECK(max_error(acc, exact + bias.to(torch::kFloat64)) <= 2 * native + 1e-5);
      }
    }
  }
}

TEST_CASE("blocked_gemm: the results are the same bits on 1 thread and on 2", "[detail][blocked_gemm]") {
  if (!memopt::detail::blocked_gemm::runs_here()) return memopt::test::skip_case("no fp32 brgemm here");
  torch::manual_seed(4);
  const auto dy = torch::randn({520, 140}), x = torch::randn({520, 96});
  const auto product = [&] {
    auto out = torch::empty({140, 96});
    bg::run(out, dy.t(), x, false);  // a weight's gradient: flipped, tiles turned
    return out;
  };
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const auto one = product();
  at::set_num_threads(std::max(2, threads));
  const auto two = product();
  at::set_num_threads(threads);
  CHECK(torch::equal(one, two));
}

TEST_CASE("blocked_gemm: small, thin, non-fp32 and mismatched operands are not taken", "[detail][blocked_gemm]") {
  const auto a = torch::randn({256, 256}), b = torch::randn({256, 256});
  CHECK(bg::takes(a, b) == bg::runs_here());
  CHECK_FALSE(bg::takes(torch::randn({64, 64}), torch::randn({64, 64})));   // 2^18 multiply-adds
  CHECK_FALSE(bg::takes(torch::randn({4096, 16}), torch::randn({16, 4096})));  // a side under kMinSide
  CHECK_FALSE(bg::takes(a.to(torch::kDouble), b.to(torch::kDouble)));
  CHECK_FALSE(bg::takes(a.to(torch::kBFloat16), b.to(torch::kBFloat16)));
  CHECK_FALSE(bg::takes(a, torch::randn({255, 256})));
  CHECK_FALSE(bg::takes(torch::empty({256, 256, 2}).select(2, 0), a, b));  // out: neither rows nor columns contiguous
  CHECK_FALSE(bg::takes(torch::empty({255, 256}), a, b));                  // out of another shape
}
