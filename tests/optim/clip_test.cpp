// tests/optim/clip_test.cpp — memopt/optim/clip.hpp: grad_norms are the per-gradient L2 norms,
// clip_grad_norm_ returns the global norm and scales the gradients as LibTorch's
// torch::nn::utils::clip_grad_norm_ does, leaves them alone under max_norm or when max_norm
// is <= 0, and skips parameters without a gradient.
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include <torch/torch.h>

#include <memopt/optim/clip.hpp>

#include "support.hpp"

using memopt::test::max_abs_diff;

namespace {

// Parameters of several shapes with the given gradients (clones of `grads`).
std::vector<torch::Tensor> with_grads(const std::vector<torch::Tensor>& grads) {
  std::vector<torch::Tensor> params;
  for (const auto& g : grads) {
    auto p = torch::zeros_like(g).requires_grad_();
    p.mutable_grad() = g.clone();
    params.push_back(p);
  }
  return params;
}

std::vector<torch::Tensor> random_grads() {
  torch::manual_seed(8);
  return {torch::randn({5, 7}) * 3, torch::randn({11}), torch::randn({2, 3, 4}) * 0.1};
}

}  // namespace

TEST_CASE("grad_norms and the global norm on hand-computed gradients", "[optim][clip]") {
  // Norms 5 and 12 (3-4-5, 5-12-13): the global norm is 13.
  auto params = with_grads({torch::tensor({3.0F, 4.0F}), torch::tensor({{12.0F}})});
  params.push_back(torch::ones({3}).requires_grad_());  // no gradient: not counted
  CHECK(torch::allclose(memopt::optim::grad_norms(params), torch::tensor({5.0F, 12.0F})));
  CHECK(memopt::optim::grad_norms({}).numel() == 0);

  // Clipped to 6.5: every gradient halved (6.5 / (13 + 1e-6)).
  const auto norm = memopt::optim::clip_grad_norm_(params, 6.5);
  CHECK(norm.dim() == 0);
  CHECK(norm.scalar_type() == torch::kFloat);
  CHECK(norm.item<double>() == Approx(13.0).epsilon(1e-7));
  CHECK(torch::allclose(params[0].grad(), torch::tensor({1.5F, 2.0F}), 1e-6, 0));
  CHECK(torch::allclose(params[1].grad(), torch::tensor({{6.0F}}), 1e-6, 0));
  CHECK_FALSE(params[2].grad().defined());
}

TEST_CASE("clip_grad_norm_ scales as torch::nn::utils::clip_grad_norm_ and returns the norm before", "[optim][clip]") {
  const auto grads = random_grads();
  // The global norm as the square root of all squared entries, in double.
  double squares = 0;
  for (const auto& g : grads) squares += g.to(torch::kDouble).pow(2).sum().item<double>();
  const double global = std::sqrt(squares);
  REQUIRE(global > 2.0);  // so that max_norm 1 clips

  for (const double max_norm : {1.0, 0.5 * global, 2.0 * global}) {
    INFO("max_norm " << max_norm << ", norm " << global);
    auto ours = with_grads(grads), theirs = with_grads(grads);
    const double norm = memopt::optim::clip_grad_norm_(ours, max_norm).item<double>();
    const double torch_norm = torch::nn::utils::clip_grad_norm_(theirs, max_norm);
    CHECK(norm == Approx(global).epsilon(1e-6));  // fp32 sums of ~100 squares
    CHECK(norm == Approx(torch_norm).epsilon(1e-6));
    for (size_t i = 0; i < grads.size(); ++i) {
      // The same coefficient min(1, max_norm / (norm + 1e-6)) on fp32 gradients: ~1 ulp apart.
      CHECK(max_abs_diff(ours[i].grad(), theirs[i].grad()) <= 1e-6 * grads[i].abs().max().item<double>());
      if (max_norm >= global) CHECK(torch::equal(ours[i].grad(), grads[i]));  // not clipped: untouched
    }
    // After clipping, the global norm is at most max_norm (up to the 1e-6 in the coefficient).
    CHECK(memopt::optim::grad_norms(ours).norm().item<double>() <= max_norm * (1 + 1e-5));
  }
}

TEST_CASE("clip_grad_norm_ with max_norm <= 0 only measures", "[optim][clip]") {
  const auto grads = random_grads();
  for (const double max_norm : {0.0, -1.0}) {
    auto params = with_grads(grads);
    const double norm = memopt::optim::clip_grad_norm_(params, max_norm).item<double>();
    CHECK(norm > 1.0);
    for (size_t i = 0; i < grads.size(); ++i) CHECK(torch::equal(params[i].grad(), grads[i]));
  }
  // No gradients at all: norm 0, nothing to scale.
  std::vector<torch::Tensor> none{torch::ones({2}).requires_grad_()};
  CHECK(memopt::optim::clip_grad_norm_(none, 1.0).item<double>() == 0.0);
  CHECK_FALSE(none[0].grad().defined());
}
