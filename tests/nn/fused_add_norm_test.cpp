// tests/nn/fused_add_norm_test.cpp — memopt/nn/fused_add_norm.hpp: the residual add with its
// dropout and the RMSNorm after it, as one node, equals the ATen composite (x + dropout(r), then
// RMSNorm): h, y and the gradients of x, r and the weight (fp32 within 1e-6 of the largest entry;
// bf16 and autocast's fp32 + bf16 within twice the composite's own error against fp64), with the
// dropout's mask that fused_dropout_add draws from the same seed, regenerated in backward; it
// keeps no more than the fused RMSNorm alone, and falls back where the kernel does not apply.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memopt/memory/tracker.hpp>
#include <memopt/nn/fused.hpp>
#include <memopt/nn/fused_add_norm.hpp>
#include <memopt/nn/fused_dropout.hpp>

#include "nn/fixtures.hpp"
#include "support.hpp"

using memopt::test::max_abs_diff;
using namespace memopt::test::nn;  // NOLINT: the fixtures of the nn tests (run_both, check_fused_fp32, ...)

namespace {

constexpr double kEps = 0.1;  // ~1% of mean(h²) here: a dropped or misplaced eps fails

// (h, y) flattened into one output, so run_both compares both and the gradients of x and r.
auto both_outputs(const torch::Tensor& w, double p, bool fused) {
  return [w, p, fused](const torch::Tensor& x, const torch::Tensor& r) {
    const auto [h, y] = fused ? memopt::nn::fused_add_rms_norm(x, r, w, kEps, p, true)
                              : memopt::nn::add_rms_norm_composite(x, r, w, kEps, p, true);
    return torch::cat({h.reshape({-1}).to(y.scalar_type()), y.reshape({-1})});
  };
}

}  // namespace

TEST_CASE("fused_add_rms_norm equals x + r then RMSNorm: values and the gradients of x, r and w", "[nn][fused]") {
  torch::manual_seed(21);
  for (const auto& shape : std::vector<std::vector<int64_t>>{{50, 37}, {3, 40, 512}, {4, 5}}) {
    DYNAMIC_SECTION("shape " << torch::IntArrayRef(shape)) {
      const auto x = torch::randn(shape) * 2, r = torch::randn(shape);
      const auto w = torch::rand({shape.back()}) + 0.5;
      const auto dy = torch::randn({2 * x.numel()});
      check_fused_fp32(run_both(both_outputs(w, 0, true), x, r, dy), run_both(both_outputs(w, 0, false), x, r, dy));

      // The weight's gradient: y alone as a function of (x, w), r fixed.
      auto norm_of = [&](bool fused) {
        return [r, fused](const torch::Tensor& xa, const torch::Tensor& wa) {
          return fused ? memopt::nn::fused_add_rms_norm(xa, r, wa, kEps, 0, true).second
                       : memopt::nn::add_rms_norm_composite(xa, r, wa, kEps, 0, true).second;
        };
      };
      const auto dy_half = dy.slice(0, 0, x.numel()).view(shape);
      check_fused_fp32(run_both(norm_of(true), x, w, dy_half), run_both(norm_of(false), x, w, dy_half));

      // bf16 x and r (bf16 h), and autocast's fp32 residual stream with a bf16 branch (fp32 h).
      const auto xb = x.to(torch::kBFloat16), rb = r.to(torch::kBFloat16);
      for (const auto& xin : {xb, x}) {
        INFO("x " << xin.scalar_type() << ", r bf16");
        const auto exact = run_both(both_outputs(w.to(torch::kDouble), 0, false),
                                    xin.to(torch::kDouble), rb.to(torch::kDouble), dy);
        check_fused_bf16(run_both(both_outputs(w, 0, true), xin, rb, dy),
                         run_both(both_outputs(w, 0, false), xin, rb, dy), exact);
        const auto [h, y] = memopt::nn::fused_add_rms_norm(xin, rb, w, kEps, 0, true);
        CHECK(h.scalar_type() == at::promote_types(xin.scalar_type(), torch::kBFloat16));
        CHECK(y.scalar_type() == torch::kFloat);
      }
      // y rounded to bf16 (a block norm under autocast): the composite's y cast once, its gradients.
      auto cast_y = [&](bool fused) {
        return [w, fused](const torch::Tensor& xa, const torch::Tensor& ra) {
          const auto [h, y] = fused ? memopt::nn::fused_add_rms_norm(xa, ra, w, kEps, 0, true, torch::kBFloat16)
                                    : memopt::nn::add_rms_norm_composite(xa, ra, w, kEps, 0, true);
          return torch::cat({h.reshape({-1}), y.to(torch::kBFloat16).to(h.scalar_type()).reshape({-1})});
        };
      };
      const auto got = run_both(cast_y(true), x, rb, dy), want = run_both(cast_y(false), x, rb, dy);
      CHECK(max_abs_diff(got.y, want.y) <= std::ldexp(want.y.abs().max().item<double>(), -7));
      CHECK(fused_rel_diff(got.da, want.da) <= kFusedFp32Rel);
      CHECK(fused_rel_diff(got.db, want.db) <= 2 * std::ldexp(1.0, -8));  // dr: cast to r's bf16 on both sides
    }
  }
}

TEST_CASE("fused_add_rms_norm's dropout: fused_dropout_add's mask, regenerated in backward", "[nn][fused][dropout]") {
  torch::manual_seed(22);
  const double p = 0.25;
  const auto x = torch::randn({64, 96}), r = torch::randn({64, 96}), w = torch::rand({96}) + 0.5;
  const auto dy = torch::randn({2 * x.numel()});
  // The mask the seed gives: fused_dropout_add of ones draws the same seed from the generator.
  torch::manual_seed(5);
  const auto noise = memopt::nn::fused_dropout_add(torch::zeros_like(r), torch::ones_like(r), p, true);  // 0 or 1/(1-p)
  const double kept = (noise > 0).to(torch::kDouble).mean().item<double>();
  CHECK(std::abs(kept - (1 - p)) < 5 * std::sqrt(p * (1 - p) / static_cast<double>(r.numel())));
  // The reference: the composite with that noise as an explicit multiply.
  auto with_noise = [&](const torch::Tensor& xa, const torch::Tensor& ra) {
    const auto [h, y] = memopt::nn::add_rms_norm_composite(xa, ra * noise, w, kEps, 0, true);
    return torch::cat({h.reshape({-1}), y.reshape({-1})});
  };
  auto fused = [&](const torch::Tensor& xa, const torch::Tensor& ra) {
    torch::manual_seed(5);
    return both_outputs(w, p, true)(xa, ra);
  };
  check_fused_fp32(run_both(fused, x, r, dy), run_both(with_noise, x, r, dy));
  // Another seed draws another mask (the comparison can fail).
  auto other = [&](const torch::Tensor& xa, const torch::Tensor& ra) {
    torch::manual_seed(6);
    return both_outputs(w, p, true)(xa, ra);
  };
  CHECK(max_abs_diff(run_both(other, x, r, dy).db, run_both(with_noise, x, r, dy).db) > 1e-3);
  // Outside training: no dropout.
  CHECK(max_abs_diff(memopt::nn::fused_add_rms_norm(x, r, w, kEps, p, false).first, x + r) <= 1e-6);
}

TEST_CASE("fused_add_rms_norm keeps h and a rstd per row: no more than the fused RMSNorm alone", "[nn][fused]") {
  constexpr int64_t rows = 256, C = 128;
  auto& tracker = memopt::memory::Tracker::instance();
  const auto x = torch::randn({rows, C}).requires_grad_(), r = torch::randn({rows, C}).requires_grad_();
  const auto w = (torch::rand({C}) + 0.5).requires_grad_();
  auto kept = [&](bool fused, double p) {
    const int64_t before = tracker.live_bytes();
    torch::manual_seed(1);
    const auto out = fused ? memopt::nn::fused_add_rms_norm(x, r, w, kEps, p, true)
                           : memopt::nn::add_rms_norm_composite(x, r, w, kEps, p, true);
    return tracker.live_bytes() - before;  // h, y and what the graph saved (out is alive here)
  };
  const int64_t tensor = rows * C * 4;
  INFO("fused " << kept(true, 0.1) << " B, composite " << kept(false, 0.1) << " B");
  CHECK(kept(true, 0.1) <= 2 * tensor + rows * 4 + 64);  // h and y (h doubles as the saved input) and rstd
  CHECK(kept(false, 0.1) >= 3 * tensor);                  // the composite keeps the noise and x·rsqrt too
}

TEST_CASE("fused_add_rms_norm falls back where the kernel does not apply, and checks p", "[nn][fused]") {
  torch::manual_seed(23);
  const auto x = torch::randn({6, 16}), r = torch::randn({16, 6}).t(), w = torch::rand({16}) + 0.5;  // r strided
  const auto [h, y] = memopt::nn::fused_add_rms_norm(x, r, w, kEps, 0, true);
  const auto [hc, yc] = memopt::nn::add_rms_norm_composite(x, r, w, kEps, 0, true);
  CHECK(max_abs_diff(h, hc) == 0);
  CHECK(max_abs_diff(y, yc) <= 1e-6);
  CHECK_THROWS_WITH(memopt::nn::fused_add_rms_norm(x, x, w, kEps, 1.0, true),
                    Catch::Contains("p must be in [0, 1) (got 1)") && Catch::Contains("HINT"));
}
