// tests/nn/rmsnorm_test.cpp — memopt/nn/rmsnorm.hpp: RMSNorm is x · rsqrt(mean(x²) + eps) · w
// over the last dimension (hand-computed cases, the formula in LibTorch ops, its gradients),
// in fp32 for bf16 inputs, returning the input's dtype when the weight has it too.
#include <catch2/catch.hpp>

#include <utility>

#include <torch/torch.h>

#include <memopt/nn/rmsnorm.hpp>

#include "support.hpp"

using memopt::nn::RMSNorm;
using memopt::nn::RMSNormOptions;
using memopt::test::max_abs_diff;

namespace {

torch::Tensor rmsnorm_reference(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  return x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps) * w;
}

}  // namespace

TEST_CASE("RMSNorm on hand-computed rows: the root mean square, eps and the weight", "[nn][rmsnorm]") {
  RMSNorm norm(RMSNormOptions(4).eps(0.0));
  CHECK(norm->weight.sizes() == torch::IntArrayRef({4}));
  CHECK((norm->weight == 1).all().item<bool>());  // initialised to ones
  {
    torch::NoGradGuard no_grad;
    norm->weight.copy_(torch::tensor({1.0F, 2.0F, 3.0F, 4.0F}));
  }
  // mean(x²) = 4: y = x / 2 · w.
  auto y = norm(torch::tensor({{2.0F, -2.0F, 2.0F, -2.0F}, {4.0F, 4.0F, -4.0F, 4.0F}}));
  CHECK(torch::allclose(y, torch::tensor({{1.0F, -2.0F, 3.0F, -4.0F}, {1.0F, 2.0F, -3.0F, 4.0F}}), 1e-6, 1e-7));
  // eps counts: ones with eps 3 give 1 / sqrt(1 + 3) = 0.5.
  RMSNorm with_eps(RMSNormOptions(4).eps(3.0));
  CHECK(torch::allclose(with_eps(torch::ones({1, 4})), torch::full({1, 4}, 0.5F), 1e-6, 1e-7));
  CHECK(RMSNormOptions(8).eps() == 1e-5);  // the default
}

TEST_CASE("RMSNorm equals the formula in LibTorch ops, values and gradients", "[nn][rmsnorm]") {
  torch::manual_seed(1);
  const double eps = 1e-2;  // large enough to matter for the small rows below
  RMSNorm norm(RMSNormOptions(16).eps(eps));
  {
    torch::NoGradGuard no_grad;
    norm->weight.copy_(torch::randn({16}));
  }
  auto x = (torch::randn({3, 5, 16}) * torch::rand({3, 5, 1})).requires_grad_();  // some rows near 0
  auto w = norm->weight.detach().clone().requires_grad_();
  auto x_ref = x.detach().clone().requires_grad_();
  const auto y = norm(x);
  const auto y_ref = rmsnorm_reference(x_ref, w, eps);
  REQUIRE(y.sizes() == x.sizes());
  // fp32, the same ops in the same order: a few ulps at most (magnitudes ~1).
  CHECK(max_abs_diff(y, y_ref) <= 1e-6);

  const auto grad_out = torch::randn_like(y);
  y.backward(grad_out);
  y_ref.backward(grad_out);
  // Rows near 0 have gradients up to ~1 / sqrt(eps) = 10: relative to the largest entry.
  for (const auto& [got, want] : {std::pair{x.grad(), x_ref.grad()}, std::pair{norm->weight.grad(), w.grad()}}) {
    REQUIRE(got.defined());
    CHECK(max_abs_diff(got, want) <= 1e-6 * want.abs().max().item<double>());
  }
}

TEST_CASE("RMSNorm normalises bf16 inputs in fp32 and returns bf16 with a bf16 weight", "[nn][rmsnorm]") {
  torch::manual_seed(2);
  RMSNorm norm(RMSNormOptions(32));
  {
    torch::NoGradGuard no_grad;
    norm->weight.copy_(torch::rand({32}) + 0.5);
  }
  norm->to(torch::kBFloat16);
  const auto x = (torch::randn({4, 32}) * 10).to(torch::kBFloat16);
  const auto y = norm(x);
  CHECK(y.scalar_type() == torch::kBFloat16);
  const auto reference = rmsnorm_reference(x.to(torch::kFloat), norm->weight.to(torch::kFloat), 1e-5);
  // Two bf16 roundings (the normalised value, the product with w), each <= 2^-9 relative:
  // 1e-2 relative to the largest output (~3) leaves room for both and fails on a wrong scale.
  const double scale = reference.abs().max().item<double>();
  CHECK(max_abs_diff(y, reference) <= 1e-2 * scale);
}
