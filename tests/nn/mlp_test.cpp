// tests/nn/mlp_test.cpp — memopt/nn/mlp.hpp: SwiGLU is down(silu(gate x) · up x) with HF's
// parameter names and no biases: values and every gradient against the formula written with
// matmuls and a sigmoid, the same under recompute::Selective (which recomputes the product) and
// in row tiles (each recomputed: no (B, T, F) tensor kept; LoRA dropout replayed tile by tile).
#include <catch2/catch.hpp>

#include <cstdint>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memopt/detail/checkpoint_function.hpp>
#include <memopt/memory/tracker.hpp>
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

TEST_CASE("SwiGLU in row tiles equals the formula: values and every gradient, under each policy", "[nn][mlp]") {
  torch::manual_seed(7);
  for (const bool fused : {false, true}) {
    SwiGLU mlp(SwiGLUOptions(kC, kF).fused(fused).row_tiles(3));  // 14 rows: tiles of 5, 5 and 4
    const auto x = torch::randn({2, 7, kC});
    const auto grad_out = torch::randn({2, 7, kC});
    const Grads want = reference(mlp, x, grad_out);
    INFO("fused " << fused);
    check_close(run(mlp, x, grad_out, memopt::recompute::None{}), want, 1e-5);
    check_close(run(mlp, x, grad_out, memopt::recompute::Selective{}), want, 1e-5);
    // More tiles than rows: one row each.
    mlp->options.row_tiles(20);
    check_close(run(mlp, x, grad_out, memopt::recompute::None{}), want, 1e-5);
    // Without grad mode (a checkpointed block's forward, evaluation): the tiles run plainly.
    torch::NoGradGuard no_grad;
    CHECK(max_abs_diff(mlp->forward(x), want.y) <= 1e-5 * want.y.abs().max().item<double>());
  }
}

TEST_CASE("SwiGLU in row tiles keeps no (B, T, F) tensor for backward", "[nn][mlp]") {
  constexpr int64_t C = 32, F = 256, rows = 64;
  auto& tracker = memopt::memory::Tracker::instance();
  const auto x = torch::randn({1, rows, C}).requires_grad_();
  auto kept = [&](int64_t tiles) {
    SwiGLU mlp(SwiGLUOptions(C, F).row_tiles(tiles));
    const int64_t before = tracker.live_bytes();
    auto y = mlp->forward(x);
    return tracker.live_bytes() - before;  // y and what the graph saved
  };
  const int64_t whole = kept(1), tiled = kept(4);
  INFO("whole " << whole << " B, tiled " << tiled << " B");
  CHECK(whole >= 3 * rows * F * 4 + rows * C * 4);  // gate, up, silu(gate) · up, and the output
  CHECK(tiled < rows * F * 4);                       // the output and 4 RNG states: less than one (B, T, F)
}

TEST_CASE("SwiGLU row tiles with LoRA adapters: a checkpointed block gets the same gradients, dropout included",
          "[nn][mlp][lora]") {
  for (const double dropout : {0.5, 0.0}) {  // 0: the block's forward (no grad mode) runs the rows whole
    INFO("LoRA dropout " << dropout);
    torch::manual_seed(8);
    SwiGLU mlp(SwiGLUOptions(kC, kF).row_tiles(4));
    for (auto* layer : {&mlp->gate_proj, &mlp->up_proj, &mlp->down_proj})
      (*layer)->add_adapter(memopt::nn::LoraOptions().rank(4).alpha(8).dropout(dropout));
    CHECK(mlp->draws_masks() == (dropout > 0));
    {
      torch::NoGradGuard no_grad;  // nonzero B: the adapters' gradients depend on every mask
      for (auto* layer : {&mlp->gate_proj, &mlp->up_proj, &mlp->down_proj})
        (*layer)->lora_B->weight.normal_(0, 0.1);
    }
    const auto x = torch::randn({2, 9, kC}), grad_out = torch::randn({2, 9, kC});
    // The adapters' gradients after one backward from the same seed: plain, or the whole MLP as a
    // checkpointed block (its forward without grad mode, its tiles recomputed inside its backward).
    auto grads = [&](bool outer_checkpoint, uint64_t seed) {
      mlp->zero_grad();
      auto leaf = x.clone().requires_grad_();
      torch::manual_seed(seed);
      const auto self = mlp.ptr();
      auto y = outer_checkpoint ? memopt::detail::checkpointed(
                                      [self](const std::vector<torch::Tensor>& in) { return self->forward(in[0]); },
                                      {leaf}, mlp->parameters())
                                : mlp->forward(leaf);
      y.backward(grad_out);
      std::vector<torch::Tensor> g{leaf.grad()};
      for (const auto& p : mlp->parameters())
        if (p.requires_grad()) g.push_back(p.grad().clone());
      return g;
    };
    const auto plain = grads(false, 99), nested = grads(true, 99);
    REQUIRE(plain.size() == 7);  // dx and 3 adapters' A and B
    for (size_t i = 0; i < plain.size(); ++i) {
      INFO("gradient " << i);
      CHECK(max_abs_diff(nested[i], plain[i]) <= 1e-6 * plain[i].abs().max().item<double>());
    }
    // The masks matter: another seed gives other gradients (with dropout on).
    const double other = max_abs_diff(grads(false, 100)[0], plain[0]);
    if (dropout > 0) CHECK(other > 1e-4);
    else CHECK(other == 0);
  }
}

TEST_CASE("SwiGLU rejects row_tiles below 1", "[nn][mlp]") {
  memopt::test::require_error([] { SwiGLU(SwiGLUOptions(kC, kF).row_tiles(0)); }, "memopt::nn::SwiGLU",
                              {"row_tiles", "0"});
}
