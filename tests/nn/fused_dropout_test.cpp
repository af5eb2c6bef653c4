// tests/nn/fused_dropout_test.cpp — memopt/nn/fused_dropout.hpp: dropout fused into the residual
// add keeps 1 − p of the elements scaled by 1 / (1 − p), regenerates in backward exactly the
// forward's mask, repeats under torch::manual_seed, shows a dropped NaN, keeps no noise tensor,
// and a LLaMA with fused kernels and dropout gets the same gradients under checkpointing.
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include <torch/torch.h>

#include <memopt/memory/tracker.hpp>
#include <memopt/models/llama.hpp>
#include <memopt/nn/fused_dropout.hpp>
#include <memopt/policies/recompute.hpp>

#include "nn/fixtures.hpp"
#include "support.hpp"

using memopt::nn::fused_dropout_add;

TEST_CASE("fused_dropout_add is x + r in evaluation and at p = 0", "[nn][fused][dropout]") {
  const auto x = torch::randn({4, 9}), r = torch::randn({4, 9});
  CHECK(torch::equal(fused_dropout_add(x, r, 0.3, /*training=*/false), x + r));
  CHECK(torch::equal(fused_dropout_add(x, r, 0.0, true), x + r));
  memopt::test::require_error([&] { fused_dropout_add(x, r, 1.0, true); }, "memopt::nn::fused_dropout_add",
                              {"p must be in [0, 1)", "(got 1)"});
}

TEST_CASE("fused_dropout_add keeps 1 - p scaled by 1 / (1 - p), and backward regenerates the same mask",
          "[nn][fused][dropout]") {
  const double p = 0.1;
  const int64_t n = int64_t{1} << 20;
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    DYNAMIC_SECTION(c10::toString(dtype)) {
      auto x = torch::zeros({n / 512, 512}, dtype).requires_grad_();
      auto r = torch::ones({n / 512, 512}, dtype).requires_grad_();
      torch::manual_seed(21);
      auto y = fused_dropout_add(x, r, p, true);  // 0 or 1 / (1 - p)
      const auto kept = y.detach().ne(0);
      const double rate = kept.to(torch::kDouble).mean().item<double>();
      INFO("kept " << rate);
      CHECK(std::abs(rate - (1 - p)) <= 5 * std::sqrt(p * (1 - p) / static_cast<double>(n)));
      const auto scale = torch::full({}, 1.0 / (1.0 - p)).to(dtype);
      CHECK(torch::equal(y.detach().masked_select(kept), scale.expand({kept.sum().item<int64_t>()})));
      y.backward(torch::ones_like(y));
      CHECK(torch::equal(r.grad(), y.detach()));  // d/dr = mask / (1 - p): the forward's mask again
      CHECK(torch::equal(x.grad(), torch::ones_like(x)));
    }
  }
}

TEST_CASE("fused_dropout_add repeats under manual_seed, draws anew each call, and shows a dropped NaN",
          "[nn][fused][dropout]") {
  const auto x = torch::zeros({64, 64}), r = torch::ones({64, 64});
  torch::manual_seed(3);
  const auto first = fused_dropout_add(x, r, 0.5, true);
  const auto second = fused_dropout_add(x, r, 0.5, true);
  torch::manual_seed(3);
  CHECK(torch::equal(fused_dropout_add(x, r, 0.5, true), first));
  CHECK_FALSE(torch::equal(first, second));
  // A NaN where the mask drops: still NaN in the output (a multiply by 0, as LibTorch's CPU dropout).
  const int64_t dropped = first.reshape({-1}).eq(0).nonzero()[0][0].item<int64_t>();
  auto with_nan = r.clone();
  with_nan.view({-1})[dropped] = std::nanf("");
  torch::manual_seed(3);
  CHECK(std::isnan(fused_dropout_add(x, with_nan, 0.5, true).reshape({-1})[dropped].item<float>()));
}

TEST_CASE("fused_dropout_add keeps no noise tensor for backward", "[nn][fused][dropout]") {
  auto& tracker = memopt::memory::Tracker::instance();
  const auto x = torch::randn({32, 256}).requires_grad_(), r = torch::randn({32, 256}).requires_grad_();
  auto kept = [&](auto&& f) {
    const int64_t before = tracker.live_bytes();
    auto y = f();
    return tracker.live_bytes() - before;  // y and what the graph saved
  };
  const int64_t composite = kept([&] { return x + torch::dropout(r, 0.1, true); });
  const int64_t fused = kept([&] { return fused_dropout_add(x, r, 0.1, true); });
  CHECK(composite - fused == r.numel() * 4);  // LibTorch keeps the fp32 noise
}

TEST_CASE("a LLaMA with fused kernels and dropout gets the same gradients with every block checkpointed",
          "[nn][fused][dropout][llama]") {
  using namespace memopt::test::nn;  // NOLINT: the fixtures of the nn tests
  torch::manual_seed(15);
  memopt::models::Llama model(small_llama(true).dropout(0.1).fused_kernels(true));
  const auto batch = small_batch(2, 40, 97);
  auto grads = [&](const auto& ckpt, uint64_t seed) {
    model->zero_grad();
    torch::manual_seed(seed);
    model->loss_sum(batch, ckpt).backward();
    std::vector<torch::Tensor> out;
    for (const auto& p : model->parameters()) out.push_back(p.grad().clone());
    return out;
  };
  const auto plain = grads(memopt::recompute::None{}, 77);
  const auto checkpointed = grads(memopt::recompute::EveryBlock{}, 77);
  const auto other = grads(memopt::recompute::None{}, 78);  // other masks, other gradients (the test can fail)
  double same = 0, different = 0;
  for (size_t i = 0; i < plain.size(); ++i) {
    same = std::max(same, max_abs_diff(checkpointed[i], plain[i]));
    different = std::max(different, max_abs_diff(other[i], plain[i]));
  }
  CHECK(same <= 1e-6);
  CHECK(different > 1e-4);
}
