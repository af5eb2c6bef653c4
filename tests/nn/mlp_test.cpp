// tests/nn/mlp_test.cpp — memopt/nn/mlp.hpp: SwiGLU is down(silu(gate x) · up x) with HF's
// parameter names and no biases: values and every gradient against the formula written with
// matmuls and a sigmoid, the same under recompute::Selective (which recomputes the product).
#include <catch2/catch.hpp>

#include <cstdint>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memopt/nn/mlp.hpp>
#include <memopt/policies/recompute.hpp>

#include "support.hpp"

using memopt::nn::SwiGLU;
using memopt::nn::SwiGLUOptions;
using memopt::test::max_abs_diff;

namespace {

constexpr int64_t kC = 12, kF = 20;

struct Grads {
  torch::Tensor y, dx, dgate, dup, ddown;
};

// The module's output and gradients for `x` and `grad_out`, under `ckpt`.
template <class Recompute>
Grads run(SwiGLU& mlp, const torch::Tensor& x0, const torch::Tensor& grad_out, const Recompute& ckpt) {
  mlp->zero_grad();
  auto x = x0.clone().requires_grad_();
  auto y = mlp->forward(x, ckpt);
  y.backward(grad_out);
  return {y.detach(), x.grad(), mlp->gate_proj->weight.grad().clone(), mlp->up_proj->weight.grad().clone(),
          mlp->down_proj->weight.grad().clone()};
}

// The formula on copies of the weights: silu(z) = z · sigmoid(z), a Linear is x · Wᵀ.
Grads reference(SwiGLU& mlp, const torch::Tensor& x0, const torch::Tensor& grad_out) {
  auto copy = [](const torch::Tensor& w) { return w.detach().clone().requires_grad_(); };
  auto wg = copy(mlp->gate_proj->weight), wu = copy(mlp->up_proj->weight), wd = copy(mlp->down_proj->weight);
  auto x = x0.clone().requires_grad_();
  const auto gate = x.matmul(wg.t());
  const auto y = (gate * torch::sigmoid(gate) * x.matmul(wu.t())).matmul(wd.t());
  y.backward(grad_out);
  return {y.detach(), x.grad(), wg.grad(), wu.grad(), wd.grad()};
}

// max |got - want| of each part, relative to want's largest entry.
void check_close(const Grads& got, const Grads& want, double rtol) {
  const std::vector<std::pair<const char*, torch::Tensor Grads::*>> parts{
      {"output", &Grads::y}, {"dx", &Grads::dx}, {"dgate", &Grads::dgate}, {"dup", &Grads::dup},
      {"ddown", &Grads::ddown}};
  for (const auto& [name, part] : parts) {
    REQUIRE((got.*part).defined());
    REQUIRE((got.*part).sizes() == (want.*part).sizes());
    const double scale = (want.*part).abs().max().item<double>();
    const double diff = max_abs_diff(got.*part, want.*part);
    INFO(name << ": max abs diff " << diff << ", largest entry " << scale);
    CHECK(diff <= rtol * scale);
  }
}

}  // namespace

TEST_CASE("SwiGLU has HF's three bias-free projections", "[nn][mlp]") {
  SwiGLU mlp(SwiGLUOptions(kC, kF));
  const auto params = mlp->named_parameters();
  CHECK(params.size() == 3);
  CHECK(params["gate_proj.weight"].sizes() == torch::IntArrayRef({kF, kC}));
  CHECK(params["up_proj.weight"].sizes() == torch::IntArrayRef({kF, kC}));
  CHECK(params["down_proj.weight"].sizes() == torch::IntArrayRef({kC, kF}));
}

TEST_CASE("SwiGLU equals down(silu(gate x) · up x): values and every gradient", "[nn][mlp]") {
  torch::manual_seed(6);
  SwiGLU mlp(SwiGLUOptions(kC, kF));
  const auto x = torch::randn({2, 7, kC});
  const auto grad_out = torch::randn({2, 7, kC});
  const Grads want = reference(mlp, x, grad_out);
  // fp32 matmuls of 12 and 20 terms, possibly in another kernel or order than the reference's:
  // ~1e-7 relative; 1e-5 of the largest entry fails on a missing or swapped factor.
  check_close(run(mlp, x, grad_out, memopt::recompute::None{}), want, 1e-5);
  check_close(run(mlp, x, grad_out, memopt::recompute::Selective{}), want, 1e-5);
  // forward(x) without a policy is forward(x, None).
  CHECK(max_abs_diff(mlp->forward(x), want.y) <= 1e-5 * want.y.abs().max().item<double>());

  // The formula can fail: up and gate swapped gives another output.
  auto swapped = mlp->up_proj->weight.detach().clone();
  {
    torch::NoGradGuard no_grad;
    mlp->up_proj->weight.copy_(mlp->gate_proj->weight);
    mlp->gate_proj->weight.copy_(swapped);
  }
  CHECK(max_abs_diff(mlp->forward(x), want.y) > 1e-3);
}
