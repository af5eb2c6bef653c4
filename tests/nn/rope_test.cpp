// tests/nn/rope_test.cpp — memopt/nn/rope.hpp: the cos/sin tables are cos/sin of t · θ^(-2j/D)
// repeated over both halves (HF's layout), rotate_half maps (x1, x2) to (-x2, x1), and apply_rope
// rotates each pair (x_j, x_{j+D/2}) by its angle: values and gradients against the rotation
// written out in double, norms kept, q·k depending only on the positions' difference.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>

#include <torch/torch.h>

#include <memopt/nn/rope.hpp>

#include "support.hpp"

using memopt::test::max_abs_diff;

namespace {

// angle[t][j] = t · θ^(-2j / D) for j < D / 2, in double: (T, D/2).
torch::Tensor angles(int64_t T, int64_t D, double theta) {
  auto opts = torch::TensorOptions().dtype(torch::kDouble);
  auto j = torch::arange(D / 2, opts);
  return torch::arange(T, opts).unsqueeze(1) * torch::exp(-(2.0 * j / static_cast<double>(D)) * std::log(theta));
}

// x (…, T, D) with each pair (x_j, x_{j+D/2}) at position t rotated by sign · angle[t][j].
torch::Tensor rotate_pairs(const torch::Tensor& x, const torch::Tensor& angle, double sign) {
  const int64_t half = x.size(-1) / 2;
  const auto x1 = x.narrow(-1, 0, half).to(torch::kDouble), x2 = x.narrow(-1, half, half).to(torch::kDouble);
  const auto c = angle.cos(), s = angle.sin() * sign;
  return torch::cat({x1 * c - x2 * s, x2 * c + x1 * s}, -1);
}

}  // namespace

TEST_CASE("rope_tables are cos and sin of t · theta^(-2j/D), the same over both halves", "[nn][rope]") {
  const int64_t T = 16, D = 8;
  for (const double theta : {10000.0, 500000.0, 2.0}) {
    INFO("theta " << theta);
    const auto [cos, sin] = memopt::nn::rope_tables(T, D, theta, torch::kCPU);
    REQUIRE(cos.sizes() == torch::IntArrayRef({T, D}));
    REQUIRE(sin.sizes() == torch::IntArrayRef({T, D}));
    CHECK(cos.scalar_type() == torch::kFloat);
    CHECK(sin.scalar_type() == torch::kFloat);
    const auto angle = angles(T, D, theta);
    // fp32 angles up to 15 rad carry ~15 · 2^-24 ≈ 1e-6 of error; a wrong frequency or
    // layout moves entries by far more than 1e-5.
    CHECK(max_abs_diff(cos, torch::cat({angle, angle}, -1).cos()) <= 1e-5);
    CHECK(max_abs_diff(sin, torch::cat({angle, angle}, -1).sin()) <= 1e-5);
  }
  // By hand: position 0 does not rotate; position 1's first frequency is 1 rad.
  const auto [cos, sin] = memopt::nn::rope_tables(2, 4, 10000.0, torch::kCPU);
  CHECK(torch::equal(cos[0], torch::ones({4})));
  CHECK(torch::equal(sin[0], torch::zeros({4})));
  CHECK(cos[1][0].item<double>() == Approx(std::cos(1.0)).epsilon(1e-6));
  CHECK(sin[1][2].item<double>() == Approx(std::sin(1.0)).epsilon(1e-6));
  CHECK(sin[1][1].item<double>() == Approx(std::sin(0.01)).epsilon(1e-5));  // 10000^(-2/4)
}

TEST_CASE("rotate_half maps the halves (x1, x2) to (-x2, x1)", "[nn][rope]") {
  CHECK(torch::equal(memopt::nn::rotate_half(torch::tensor({1.0F, 2.0F, 3.0F, 4.0F})),
                     torch::tensor({-3.0F, -4.0F, 1.0F, 2.0F})));
  const auto x = torch::arange(12, torch::kFloat).view({2, 6});
  CHECK(torch::equal(memopt::nn::rotate_half(x), torch::tensor({{-3.0F, -4.0F, -5.0F, 0.0F, 1.0F, 2.0F},
                                                                {-9.0F, -10.0F, -11.0F, 6.0F, 7.0F, 8.0F}})));
}

TEST_CASE("apply_rope rotates each pair of halves by its angle: values, gradients, norms", "[nn][rope]") {
  torch::manual_seed(4);
  const int64_t B = 2, H = 3, T = 12, D = 16;
  const double theta = 10000.0;
  const auto [cos, sin] = memopt::nn::rope_tables(T, D, theta, torch::kCPU);
  const auto angle = angles(T, D, theta);
  auto x = torch::randn({B, H, T, D}).requires_grad_();
  const auto y = memopt::nn::apply_rope(x, cos, sin);
  REQUIRE(y.sizes() == x.sizes());
  CHECK(y.scalar_type() == torch::kFloat);
  // Inputs ~1, angles up to 11 rad: the tables' ~1e-6 error plus fp32 rounding.
  CHECK(max_abs_diff(y, rotate_pairs(x.detach(), angle, 1.0)) <= 1e-5);
  // A rotation keeps every vector's length (squared lengths ~16: fp32 sums to ~1e-5).
  CHECK(max_abs_diff(y.pow(2).sum(-1), x.detach().pow(2).sum(-1)) <= 1e-4);
  // The gradient of a rotation is the rotation back (its transpose).
  const auto grad_out = torch::randn_like(y);
  y.backward(grad_out);
  CHECK(max_abs_diff(x.grad(), rotate_pairs(grad_out, angle, -1.0)) <= 1e-5);

  // bf16 in, bf16 out (the tables stay fp32).
  CHECK(memopt::nn::apply_rope(x.detach().to(torch::kBFloat16), cos, sin).scalar_type() == torch::kBFloat16);
}

TEST_CASE("after apply_rope, q · k depends on the positions' difference only", "[nn][rope]") {
  torch::manual_seed(5);
  const int64_t T = 10, D = 8;
  const auto [cos, sin] = memopt::nn::rope_tables(T, D, 10000.0, torch::kCPU);
  // One q and one k, placed at every position.
  const auto q = memopt::nn::apply_rope(torch::randn({1, 1, 1, D}).expand({1, 1, T, D}), cos, sin)[0][0];
  const auto k = memopt::nn::apply_rope(torch::randn({1, 1, 1, D}).expand({1, 1, T, D}), cos, sin)[0][0];
  const auto scores = q.matmul(k.t());  // (T, T): scores[m][n] = q_m · k_n
  for (int64_t shift = 1; shift < 4; ++shift) {
    INFO("shift " << shift);
    // (m, n) and (m + shift, n + shift) see the same offset; magnitudes ~D, fp32 error ~1e-5.
    const auto a = scores.narrow(0, 0, T - shift).narrow(1, 0, T - shift);
    const auto b = scores.narrow(0, shift, T - shift).narrow(1, shift, T - shift);
    CHECK(max_abs_diff(a, b) <= 1e-4);
  }
  // …and it does depend on the offset (the diagonal 0 differs from offset 3).
  CHECK(std::abs(scores[0][0].item<double>() - scores[0][3].item<double>()) > 1e-3);
}
