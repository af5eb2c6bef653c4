// tests/nn/linear_unread_test.cpp — memopt/nn/linear_unread.hpp: the Linear node without its
// product gives torch::linear's gradients (fp32 with and without a bias, bf16 autocast within the
// reference's own error against fp64) and runs no GEMM in forward; nn::Linear::forward_to_output
// skips the product only in a checkpointed block's recompute (detail::replaying()).
#include <catch2/catch.hpp>

#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include <memopt/detail/autocast.hpp>
#include <memopt/detail/checkpoint_function.hpp>
#include <memopt/nn/linear.hpp>
#include <memopt/nn/linear_unread.hpp>

#include "support.hpp"

using memopt::test::max_abs_diff;

namespace {

// dx, dW (and db) of sum(y · g) for y = linear(x, w, b), in the dtypes of x, w and b.
template <class Linear>
std::vector<torch::Tensor> grads(Linear&& linear, const torch::Tensor& x0, const torch::Tensor& w0,
                                 const torch::Tensor& b0, const torch::Tensor& g) {
  auto x = x0.clone().requires_grad_(), w = w0.clone().requires_grad_();
  auto b = b0.defined() ? b0.clone().requires_grad_() : torch::Tensor();
  auto y = linear(x, w, b);
  y.backward(g.to(y.scalar_type()));
  std::vector<torch::Tensor> out{x.grad(), w.grad()};
  if (b.defined()) out.push_back(b.grad());
  return out;
}

const auto kTorchLinear = [](const auto& x, const auto& w, const auto& b) { return torch::linear(x, w, b); };
const auto kUnread = [](const auto& x, const auto& w, const auto& b) { return memopt::nn::linear_unread(x, w, b); };

}  // namespace

TEST_CASE("linear_unread gives torch::linear's gradients, with and without a bias", "[nn][linear]") {
  torch::manual_seed(3);
  const auto x = torch::randn({2, 9, 24}), w = torch::randn({40, 24}) * 0.2, g = torch::randn({2, 9, 40});
  for (const auto& b : {torch::Tensor(), torch::randn({40})}) {
    INFO("bias " << b.defined());
    const auto want = grads(kTorchLinear, x, w, b, g), got = grads(kUnread, x, w, b, g);
    REQUIRE(got.size() == want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      REQUIRE(got[i].sizes() == want[i].sizes());
      // The same fp32 products in another summation order: ~1e-7 of the largest entry.
      CHECK(max_abs_diff(got[i], want[i]) <= 1e-6 * want[i].abs().max().item<double>());
    }
  }
  // The check can fail: another upstream gradient gives other gradients.
  const auto other = grads(kUnread, x, w, torch::Tensor(), g * 1.01);
  CHECK(max_abs_diff(other[1], grads(kTorchLinear, x, w, torch::Tensor(), g)[1]) > 1e-3);
}

TEST_CASE("linear_unread under bf16 autocast: bf16 output, gradients within bf16 linear's own error", "[nn][linear]") {
  torch::manual_seed(4);
  const auto x = torch::randn({3, 8, 32}), w = torch::randn({48, 32}) * 0.2, g = torch::randn({3, 8, 48});
  const auto exact = grads(kTorchLinear, x.to(torch::kDouble), w.to(torch::kDouble), torch::Tensor(), g);
  std::vector<torch::Tensor> want, got;
  {
    memopt::detail::AutocastGuard bf16({c10::kCPU, true, c10::kBFloat16});
    CHECK(memopt::nn::linear_unread(x, w).scalar_type() == torch::kBFloat16);
    want = grads(kTorchLinear, x, w, torch::Tensor(), g);
    got = grads(kUnread, x, w, torch::Tensor(), g);
  }
  for (size_t i = 0; i < want.size(); ++i) {
    CHECK(got[i].scalar_type() == torch::kFloat);  // the leaves' dtype: autocast's casts are in the graph
    const double own = max_abs_diff(want[i].to(torch::kDouble), exact[i]);
    const double diff = max_abs_diff(got[i].to(torch::kDouble), exact[i]);
    INFO("gradient " << i << ": torch::linear's error " << own << ", linear_unread's " << diff);
    CHECK(diff <= 2 * own + 1e-6);
  }
}

TEST_CASE("linear_unread runs no GEMM, and Linear::forward_to_output skips it only in a recompute", "[nn][linear]") {
  torch::manual_seed(5);
  memopt::nn::Linear layer(torch::nn::LinearOptions(16, 24).bias(false));
  const auto x = torch::randn({4, 16}).requires_grad_();
  {
    memopt::test::OpCalls mm("aten::mm");
    auto y = memopt::nn::linear_unread(x, layer->weight);
    CHECK(y.sizes() == torch::IntArrayRef({4, 24}));
    CHECK(mm.count() == 0);
    y.sum().backward();  // dx and dW: two products
    CHECK(mm.count() == 2);
  }
  // Outside a recompute the value is computed.
  CHECK(max_abs_diff(layer->forward_to_output(x), layer->forward(x)) == 0);
  memopt::test::OpCalls mm("aten::mm");
  {
    memopt::detail::Replaying recompute(true);
    (void)layer->forward_to_output(x);
  }
  CHECK(mm.count() == 0);
  (void)layer->forward_to_output(x);  // the guard is gone: computed again
  CHECK(mm.count() == 1);
}
