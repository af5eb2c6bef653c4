// tests/nn/linear_shared_test.cpp — memopt/nn/linear_shared.hpp: Linear layers reading one
// input as one autograd node give torch::linear's outputs and gradients (fp32, with and without
// biases, outputs of different widths; bf16 autocast within the reference's own error against
// fp64), leave frozen weights and unused outputs without gradients, make one (N, in) dX GEMM
// and no add; weight_grad's three bf16 branches (operands transposed first) stay within the
// view's own error; nn::forward_shared falls back to each layer's forward where one has an adapter.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include <memopt/detail/autocast.hpp>
#include <memopt/nn/linear.hpp>
#include <memopt/nn/linear_shared.hpp>
#include <memopt/nn/lora.hpp>

#include "support.hpp"

using memopt::test::max_abs_diff;

namespace {

struct SharedRun {
  std::vector<torch::Tensor> y, grads;  // outputs; dx, then dW_i (and db_i)
};

// sum_i sum(y_i · g_i) for y = layers(x, ws, bs), its gradients in the leaves' dtypes.
template <class Layers>
SharedRun run(Layers&& layers, const torch::Tensor& x0, const std::vector<torch::Tensor>& w0,
           const std::vector<torch::Tensor>& b0, const std::vector<torch::Tensor>& g) {
  auto x = x0.clone().requires_grad_();
  std::vector<torch::Tensor> ws, bs;
  for (const auto& w : w0) ws.push_back(w.clone().requires_grad_());
  for (const auto& b : b0) bs.push_back(b.clone().requires_grad_());
  SharedRun r;
  r.y = layers(x, ws, bs);
  torch::Tensor loss = torch::zeros({}, torch::kDouble);
  for (size_t i = 0; i < r.y.size(); ++i) loss = loss + (r.y[i].to(torch::kDouble) * g[i].to(torch::kDouble)).sum();
  loss.backward();
  r.grads.push_back(x.grad());
  for (const auto& w : ws) r.grads.push_back(w.grad());
  for (const auto& b : bs) r.grads.push_back(b.grad());
  return r;
}

const auto kApart = [](const torch::Tensor& x, const std::vector<torch::Tensor>& ws, const std::vector<torch::Tensor>& bs) {
  std::vector<torch::Tensor> y;
  for (size_t i = 0; i < ws.size(); ++i) y.push_back(torch::linear(x, ws[i], bs.empty() ? torch::Tensor() : bs[i]));
  return y;
};
const auto kShared = [](const torch::Tensor& x, const std::vector<torch::Tensor>& ws,
                        const std::vector<torch::Tensor>& bs) { return memopt::nn::linear_shared_input(x, ws, bs); };

}  // namespace

TEST_CASE("linear_shared_input gives torch::linear's outputs and gradients", "[nn][linear]") {
  torch::manual_seed(11);
  const auto x = torch::randn({2, 9, 24});
  const std::vector<torch::Tensor> w{torch::randn({32, 24}) * 0.2, torch::randn({16, 24}) * 0.2,
                                     torch::randn({16, 24}) * 0.2};  // q, k, v of grouped heads
  const std::vector<torch::Tensor> g{torch::randn({2, 9, 32}), torch::randn({2, 9, 16}), torch::randn({2, 9, 16})};
  for (const auto& b : {std::vector<torch::Tensor>{}, std::vector<torch::Tensor>{torch::randn({32}), torch::randn({16}),
                                                                                  torch::randn({16})}}) {
    INFO("biases " << b.size());
    const auto want = run(kApart, x, w, b, g), got = run(kShared, x, w, b, g);
    REQUIRE(got.y.size() == 3);
    for (size_t i = 0; i < 3; ++i) CHECK(max_abs_diff(got.y[i], want.y[i]) == 0.0);  // the same GEMMs
    REQUIRE(got.grads.size() == want.grads.size());
    for (size_t i = 0; i < want.grads.size(); ++i) {
      INFO("gradient " << i);
      REQUIRE(got.grads[i].sizes() == want.grads[i].sizes());
      // The same fp32 products, dx summed in another order: ~1e-7 of the largest entry.
      CHECK(max_abs_diff(got.grads[i], want.grads[i]) <= 1e-6 * want.grads[i].abs().max().item<double>());
    }
  }
  // The check can fail: another upstream gradient for v gives another dx.
  auto g2 = g;
  g2[2] = g2[2] * 1.01;
  CHECK(max_abs_diff(run(kShared, x, w, {}, g2).grads[0], run(kApart, x, w, {}, g).grads[0]) > 1e-4);
}

TEST_CASE("linear_shared_input under bf16 autocast: bf16 outputs, gradients within bf16's own error", "[nn][linear]") {
  torch::manual_seed(12);
  const auto x = torch::randn({3, 8, 32});
  const std::vector<torch::Tensor> w{torch::randn({48, 32}) * 0.2, torch::randn({48, 32}) * 0.2};  // gate, up
  const std::vector<torch::Tensor> g{torch::randn({3, 8, 48}), torch::randn({3, 8, 48})};
  const auto exact = run(kApart, x.to(torch::kDouble), {w[0].to(torch::kDouble), w[1].to(torch::kDouble)}, {}, g);
  SharedRun want, got;
  {
    memopt::detail::AutocastGuard bf16({c10::kCPU, true, c10::kBFloat16});
    want = run(kApart, x, w, {}, g);
    got = run(kShared, x, w, {}, g);
  }
  for (const auto& y : got.y) CHECK(y.scalar_type() == torch::kBFloat16);
  for (size_t i = 0; i < want.grads.size(); ++i) {
    CHECK(got.grads[i].scalar_type() == torch::kFloat);  // the leaves' dtype: autocast's casts are in the graph
    const double own = max_abs_diff(want.grads[i].to(torch::kDouble), exact.grads[i]);
    const double diff = max_abs_diff(got.grads[i].to(torch::kDouble), exact.grads[i]);
    INFO("gradient " << i << ": torch::linear's error " << own << ", linear_shared_input's " << diff);
    CHECK(diff <= 2 * own + 1e-6);
  }
}

TEST_CASE("linear_shared_input: frozen weights and unused outputs get no gradient, one dX GEMM, no add",
          "[nn][linear]") {
  torch::manual_seed(13);
  const auto x0 = torch::randn({4, 8});
  const auto frozen = torch::randn({6, 8});
  auto trained = torch::randn({5, 8}).requires_grad_(), unused = torch::randn({7, 8}).requires_grad_();
  auto x = x0.clone().requires_grad_();
  const auto loss = [&] {  // y[2] reaches no loss
    for (auto* t : {&x, &trained, &unused}) t->mutable_grad() = torch::Tensor();
    const auto y = memopt::nn::linear_shared_input(x, {frozen, trained, unused});
    return y[0].sum() + y[1].sum();
  };
  loss().backward();
  CHECK_FALSE(unused.grad().defined());
  CHECK(max_abs_diff(trained.grad(), torch::ones({4, 5}).t().mm(x0)) <= 1e-6);
  CHECK(max_abs_diff(x.grad(), torch::ones({4, 6}).mm(frozen) + torch::ones({4, 5}).mm(trained.detach())) <= 1e-5);
  const auto calls = [&](const char* op) {  // in backward
    const auto l = loss();
    const memopt::test::OpCalls count(op);
    l.backward();
    return count.count();
  };
  CHECK(calls("aten::mm") == 2);      // dx from y[0]'s gradient, dW of `trained`
  CHECK(calls("aten::addmm_") == 1);  // y[1]'s part of dx accumulated into it
  CHECK(calls("aten::add") == 0);     // no add of dx partials
}

TEST_CASE("forward_shared: one node for dense layers, each layer's forward where one has an adapter",
          "[nn][linear]") {
  torch::manual_seed(14);
  memopt::nn::Linear a(torch::nn::LinearOptions(8, 6).bias(false)), b(torch::nn::LinearOptions(8, 4).bias(false));
  const auto x = torch::randn({3, 8});
  const auto shared = memopt::nn::forward_shared(x, {a, b}, true);
  CHECK(shared[0].grad_fn()->name().find("SharedInputLinear") != std::string::npos);
  CHECK(max_abs_diff(shared[1], b(x)) <= 1e-6);
  CHECK(memopt::nn::forward_shared(x, {a, b}, false)[0].grad_fn()->name().find("SharedInputLinear") ==
        std::string::npos);
  b->add_adapter(memopt::nn::LoraOptions().rank(2));
  const auto apart = memopt::nn::forward_shared(x, {a, b}, true);
  CHECK(apart[0].grad_fn()->name().find("SharedInputLinear") == std::string::npos);
  CHECK(max_abs_diff(apart[1], b(x)) == 0.0);
}

TEST_CASE("weight_grad in bf16: out above, below and equal to in, within the plain product's error",
          "[nn][linear]") {
  torch::manual_seed(13);
  const int64_t m = memopt::nn::detail::kTransposedGradMin;
  for (const auto& [out, in] : std::vector<std::pair<int64_t, int64_t>>{
           {2 * m, m}, {m, 2 * m - 6}, {m, m}, {m - 2, 3 * m}}) {  // x, dy transposed; the view, twice
    DYNAMIC_SECTION("out " << out << ", in " << in) {
      const auto dy = torch::randn({70, out}).to(torch::kBFloat16), x = torch::randn({70, in}).to(torch::kBFloat16);
      const auto exact = dy.to(torch::kDouble).t().mm(x.to(torch::kDouble));  // the bf16 values, exactly
      torch::Tensor xt;
      const auto got = memopt::nn::detail::weight_grad(dy, x, xt);
      REQUIRE(got.sizes() == exact.sizes());
      CHECK(got.scalar_type() == torch::kBFloat16);
      CHECK(got.is_contiguous());
      const double own = max_abs_diff(dy.t().mm(x).to(torch::kDouble), exact);  // one bf16 rounding
      const double diff = max_abs_diff(got.to(torch::kDouble), exact);
      INFO("weight_grad's error " << diff << ", dyᵀ·x's " << own);
      CHECK(diff <= 2 * own + 1e-6);
      // xᵀ is made (once, for the weights sharing x) only where x is the smaller operand.
      CHECK(xt.defined() == (out > in && std::min(out, in) >= m && memopt::detail::bf16_tiles()));
      if (xt.defined()) CHECK(torch::equal(xt, x.t()));
    }
  }
}
