// tests/nn/fused_test.cpp — memopt/nn/fused.hpp: the fused RMSNorm, RoPE and SwiGLU equal their
// ATen composites (values and gradients; fp32 within 1e-6 of the largest entry, bf16 within
// the composite's own rounding error against fp64), keep less for backward, fall back to the
// composite where the kernel does not apply, and a LLaMA with fused_kernels trains as one
// without. Its exp is within 2 ulp of std::exp.
#include <catch2/catch.hpp>

#include <cmath>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memopt/detail/autocast.hpp>
#include <memopt/memory/tracker.hpp>
#include <memopt/models/llama.hpp>
#include <memopt/nn/fused.hpp>
#include <memopt/nn/mlp.hpp>
#include <memopt/nn/rmsnorm.hpp>
#include <memopt/nn/rope.hpp>
#include <memopt/policies/recompute.hpp>

#include "nn/fixtures.hpp"
#include "support.hpp"

using memopt::test::max_abs_diff;
using namespace memopt::test::nn;  // NOLINT: the fixtures of the nn tests (check_fused_fp32, ...)

TEST_CASE("fused exp is within 2 ulp of std::exp, clamps |x| at 87 and keeps NaN", "[nn][fused]") {
  double worst = 0;
  for (float x = -87.f; x <= 87.f; x += 0.01317f) {
    const double want = std::exp(static_cast<double>(x));
    worst = std::max(worst, std::abs(memopt::detail::fused::exp(x) - want) / want);
  }
  INFO("max relative error " << worst);
  CHECK(worst <= 2 * 5.97e-8);  // 2 ulp (2^-24 relative each)
  CHECK(memopt::detail::fused::exp(-1000.f) == memopt::detail::fused::exp(-87.f));
  CHECK(std::isfinite(memopt::detail::fused::exp(1000.f)));
  CHECK(std::isnan(memopt::detail::fused::exp(std::nanf(""))));  // a NaN must reach the loss
  CHECK(std::isnan(memopt::detail::fused::exp(-std::nanf(""))));
}

TEST_CASE("fused_rms_norm equals the composite RMSNorm, values and gradients", "[nn][fused]") {
  torch::manual_seed(11);
  const double eps = 0.1;  // ~1% of mean(x²) here: a dropped or misplaced eps fails
  auto fused = [eps](const torch::Tensor& x, const torch::Tensor& w) { return memopt::nn::fused_rms_norm(x, w, eps); };
  auto composite = [eps](const torch::Tensor& x, const torch::Tensor& w) {
    return memopt::nn::rms_norm_composite(x, w, eps);
  };
  // Rows of 37 and 5 (not multiples of the 16 lanes) and 512; 3-D; enough rows for both threads.
  // (Not C = 1: there dx is all cancellation, eps · g / (x² + eps), and only its sign is robust.)
  for (const auto& shape : std::vector<std::vector<int64_t>>{{50, 37}, {3, 40, 512}, {4, 5}}) {
    DYNAMIC_SECTION("shape " << torch::IntArrayRef(shape)) {
      const auto x = torch::randn(shape) * 3;
      const auto w = torch::rand({shape.back()}) + 0.5;
      const auto dy = torch::randn(shape);
      check_fused_fp32(run_both(fused, x, w, dy), run_both(composite, x, w, dy));
      // bf16 input with an fp32 weight (fp32 result), and with a bf16 weight (bf16 result).
      const auto exact = run_both(composite, x.to(torch::kBFloat16).to(torch::kDouble), w.to(torch::kDouble), dy);
      const auto xb = x.to(torch::kBFloat16);
      check_fused_bf16(run_both(fused, xb, w, dy), run_both(composite, xb, w, dy), exact);
      const auto exact_bw =
          run_both(composite, xb.to(torch::kDouble), w.to(torch::kBFloat16).to(torch::kDouble), dy);
      check_fused_bf16(run_both(fused, xb, w.to(torch::kBFloat16), dy),
                       run_both(composite, xb, w.to(torch::kBFloat16), dy), exact_bw);
      CHECK(memopt::nn::fused_rms_norm(xb, w, eps).scalar_type() == torch::kFloat);
      CHECK(memopt::nn::fused_rms_norm(xb, w.to(torch::kBFloat16), eps).scalar_type() == torch::kBFloat16);
    }
  }
  SECTION("an output rounded to bf16 (autocast_output): the composite's cast, and its gradients") {
    const auto x = torch::randn({3, 40, 512}) * 3, w = torch::rand({512}) + 0.5, dy = torch::randn({3, 40, 512});
    auto fused_bf16 = [eps](const torch::Tensor& a, const torch::Tensor& b) {
      return memopt::nn::fused_rms_norm(a, b, eps, torch::kBFloat16);
    };
    auto cast = [eps](const torch::Tensor& a, const torch::Tensor& b) {
      return memopt::nn::rms_norm_composite(a, b, eps).to(torch::kBFloat16);
    };
    const auto got = run_both(fused_bf16, x, w, dy), want = run_both(cast, x, w, dy);
    // One rounding of fp32 values ≤ 1e-6 apart: at most one bf16 step apart, mostly equal.
    CHECK(max_abs_diff(got.y, want.y) <= std::ldexp(want.y.abs().max().item<double>(), -7));
    CHECK(fused_rel_diff(got.da, want.da) <= kFusedFp32Rel);  // the same bf16 gradient, then fp32 math
    CHECK(fused_rel_diff(got.db, want.db) <= kFusedFp32Rel);
    memopt::nn::RMSNorm norm(memopt::nn::RMSNormOptions(512).fused(true).autocast_output(true));
    CHECK(norm(x).scalar_type() == torch::kFloat);  // no autocast: promote(x, w)
    memopt::detail::AutocastGuard bf16({c10::kCPU, true, c10::kBFloat16});
    CHECK(norm(x).scalar_type() == torch::kBFloat16);
    memopt::nn::RMSNorm plain_norm(memopt::nn::RMSNormOptions(512).fused(true));
    CHECK(plain_norm(x).scalar_type() == torch::kFloat);  // the option is off
  }
  SECTION("the module's fused option runs it") {
    memopt::nn::RMSNorm plain(memopt::nn::RMSNormOptions(24)), fast(memopt::nn::RMSNormOptions(24).fused(true));
    const auto x = torch::randn({5, 24});
    CHECK(max_abs_diff(fast(x), plain(x)) <= kFusedFp32Rel * plain(x).abs().max().item<double>());
  }
}

TEST_CASE("fused_swiglu equals silu(g) · u, values and gradients, keeping one tensor less", "[nn][fused]") {
  torch::manual_seed(12);
  auto fused = [](const torch::Tensor& g, const torch::Tensor& u) { return memopt::nn::fused_swiglu(g, u); };
  auto composite = [](const torch::Tensor& g, const torch::Tensor& u) { return torch::silu(g) * u; };
  for (const auto& shape : std::vector<std::vector<int64_t>>{{7, 33}, {2, 64, 352}}) {
    DYNAMIC_SECTION("shape " << torch::IntArrayRef(shape)) {
      const auto g = torch::randn(shape) * 4, u = torch::randn(shape), dy = torch::randn(shape);
      check_fused_fp32(run_both(fused, g, u, dy), run_both(composite, g, u, dy));
      const auto gb = g.to(torch::kBFloat16), ub = u.to(torch::kBFloat16), dyb = dy.to(torch::kBFloat16);
      check_fused_bf16(run_both(fused, gb, ub, dyb), run_both(composite, gb, ub, dyb),
                       run_both(composite, gb.to(torch::kDouble), ub.to(torch::kDouble), dyb.to(torch::kDouble)));
    }
  }
  SECTION("saturated inputs: silu(±90) and its gradient as ATen's") {
    const auto g = torch::tensor({-90.f, -30.f, 0.f, 30.f, 90.f}), u = torch::ones({5}), dy = torch::ones({5});
    const auto got = run_both(fused, g, u, dy), want = run_both(composite, g, u, dy);
    CHECK(max_abs_diff(got.y, want.y) <= 1e-5);
    CHECK(max_abs_diff(got.da, want.da) <= 1e-6);
  }
  SECTION("backward keeps g and u only: one (…, F) tensor less than the composite") {
    auto& tracker = memopt::memory::Tracker::instance();
    const auto g = torch::randn({16, 256}).requires_grad_(), u = torch::randn({16, 256}).requires_grad_();
    auto kept = [&](auto&& f) {
      const int64_t before = tracker.live_bytes();
      auto y = f(g, u);
      return tracker.live_bytes() - before;  // y and what the graph saved
    };
    const int64_t tensor_bytes = g.numel() * 4;
    CHECK(kept(composite) - kept(fused) == tensor_bytes);
  }
  SECTION("fp16, fp64, non-contiguous and mixed inputs run the composite") {
    const auto g = torch::randn({6, 10}), u = torch::randn({6, 10});
    CHECK(torch::equal(memopt::nn::fused_swiglu(g, u.to(torch::kBFloat16)), composite(g, u.to(torch::kBFloat16))));
    for (const auto dtype : {torch::kHalf, torch::kDouble}) {
      CHECK(torch::equal(memopt::nn::fused_swiglu(g.to(dtype), u.to(dtype)), composite(g.to(dtype), u.to(dtype))));
    }
    CHECK(torch::equal(memopt::nn::fused_swiglu(g.t(), u.t()), composite(g.t(), u.t())));
    const auto x = torch::randn({10, 6});
    CHECK(torch::equal(memopt::nn::fused_rms_norm(x.t(), torch::ones({10}), 1e-5),
                       memopt::nn::rms_norm_composite(x.t(), torch::ones({10}), 1e-5)));
  }
}

TEST_CASE("fused_rope equals apply_rope on q and k together, values and gradients", "[nn][fused]") {
  torch::manual_seed(13);
  const int64_t B = 2, T = 9, H = 4, KV = 2, D = 16;
  const auto [cos, sin] = memopt::nn::rope_tables(T, D, 10000.0, torch::kCPU);  // (T, D)
  // Both outputs, flattened into one: q (B, H, T, D) then k (B, KV, T, D).
  auto joined = [](const std::pair<torch::Tensor, torch::Tensor>& qk) {
    return torch::cat({qk.first.reshape({-1}), qk.second.reshape({-1})});
  };
  auto fused = [&](const torch::Tensor& q, const torch::Tensor& k) {
    return joined(memopt::nn::fused_rope(q, k, cos, sin));
  };
  auto composite = [&](const torch::Tensor& q, const torch::Tensor& k) {
    return joined({memopt::nn::apply_rope(q.transpose(1, 2), cos, sin),
                   memopt::nn::apply_rope(k.transpose(1, 2), cos, sin)});
  };
  const auto q = torch::randn({B, T, H, D}), k = torch::randn({B, T, KV, D});  // as the projections make them
  const auto dy = torch::randn({(H + KV) * B * T * D});
  check_fused_fp32(run_both(fused, q, k, dy), run_both(composite, q, k, dy));
  const auto qb = q.to(torch::kBFloat16), kb = k.to(torch::kBFloat16);
  check_fused_bf16(run_both(fused, qb, kb, dy), run_both(composite, qb, kb, dy),
                   run_both(composite, qb.to(torch::kDouble), kb.to(torch::kDouble), dy));
  SECTION("the outputs are (B, H, T, D) views, as attention takes them") {
    const auto [rq, rk] = memopt::nn::fused_rope(q, k, cos, sin);
    CHECK(rq.sizes() == torch::IntArrayRef({B, H, T, D}));
    CHECK(rk.sizes() == torch::IntArrayRef({B, KV, T, D}));
    CHECK(rq.strides() == memopt::nn::apply_rope(q.transpose(1, 2), cos, sin).strides());
  }
  SECTION("other layouts and dtypes run apply_rope") {
    const auto qt = q.transpose(1, 2).contiguous().transpose(1, 2);  // (B, T, H, D) strided
    CHECK(torch::equal(fused(qt, k), composite(qt, k)));
    CHECK(torch::equal(fused(q.to(torch::kDouble), k.to(torch::kDouble)),
                       composite(q.to(torch::kDouble), k.to(torch::kDouble))));
  }
}

TEST_CASE("a LLaMA with fused_kernels trains as one without", "[nn][fused][llama]") {
  using namespace memopt::test::nn;  // NOLINT: the fixtures of the nn tests
  torch::manual_seed(14);
  memopt::models::Llama plain(small_llama(true));
  auto fused = copy_of(plain, small_llama(true).fused_kernels(true));
  const auto batch = small_batch(2, 40, 97);
  check_same_training(fused, plain, batch, memopt::recompute::None{});
  check_same_training(fused, plain, batch, memopt::recompute::Selective{});
  SECTION("under bf16 autocast (the block norms return bf16): within the composites' own bf16 error") {
    auto grads_of = [&](memopt::models::Llama& model, bool autocast) {
      model->zero_grad();
      std::optional<memopt::detail::AutocastGuard> bf16;
      if (autocast) bf16.emplace(memopt::detail::AutocastState{c10::kCPU, true, c10::kBFloat16});
      const double loss = [&] {
        auto l = model->loss_sum(batch, memopt::recompute::None{});
        l.backward();
        return l.item<double>();
      }();
      std::vector<torch::Tensor> g{torch::full({1}, loss, torch::kDouble)};
      for (const auto& p : model->parameters()) g.push_back(p.grad().to(torch::kDouble));
      return g;
    };
    const auto exact = grads_of(plain, false);  // fp32: the reference for both bf16 runs
    const auto composite = grads_of(plain, true), fast = grads_of(fused, true);
    for (size_t i = 0; i < exact.size(); ++i) {
      const double scale = exact[i].abs().max().item<double>();
      const double own = max_abs_diff(composite[i], exact[i]) / scale, got = max_abs_diff(fast[i], exact[i]) / scale;
      INFO((i == 0 ? "loss" : "gradient " + std::to_string(i)) << ": composites' bf16 error " << own << ", fused "
                                                                 << got);
      CHECK(got <= 2 * own + 1e-3);
    }
  }
  SECTION("with the chunked loss: its fused row kernels too") {
    auto plain_chunked = copy_of(plain, small_llama(true).loss_chunk_size(24));  // 80 rows: ragged chunks
    auto fused_chunked = copy_of(plain, small_llama(true).loss_chunk_size(24).fused_kernels(true));
    check_same_training(fused_chunked, plain_chunked, batch, memopt::recompute::None{});
  }
}

TEST_CASE("CUDA: a LLaMA with fused_kernels on the GPU (the composites) gives the CPU kernels' loss and gradients",
          "[nn][fused][llama][cuda]") {
  MEMOPT_REQUIRE_CUDA();
  using namespace memopt::test::nn;  // NOLINT: the fixtures of the nn tests
  const torch::Device cuda(torch::kCUDA, 0);
  // fp32 on both devices (TF32 off, LibTorch's default); the GPU sums in other orders.
  constexpr double kTolerance = 1e-5;
  torch::manual_seed(15);
  const auto config = small_llama(true).fused_kernels(true).loss_chunk_size(24);
  memopt::models::Llama cpu(config);
  auto gpu = copy_of(cpu, config);
  gpu->to(cuda);
  const auto batch = small_batch(2, 40, 97);
  const memopt::Batch on_gpu{batch.inputs.to(cuda), batch.targets.to(cuda)};
  const auto loss_cpu = cpu->loss_sum(batch, memopt::recompute::Selective{});
  const auto loss_gpu = gpu->loss_sum(on_gpu, memopt::recompute::Selective{});
  loss_cpu.backward();
  loss_gpu.backward();
  CHECK(std::abs(loss_gpu.item<double>() - loss_cpu.item<double>()) <= kTolerance * std::abs(loss_cpu.item<double>()));
  const auto want = cpu->named_parameters();
  for (const auto& item : gpu->named_parameters()) {
    INFO(item.key());
    REQUIRE(item.value().grad().is_cuda());
    const auto g = item.value().grad().cpu(), w = want[item.key()].grad();
    CHECK(max_abs_diff(g, w) <= kTolerance * std::max(w.abs().max().item<double>(), 1e-12));
  }
}
