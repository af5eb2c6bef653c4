// Tests for memopt/nn/cross_entropy.hpp: the chunked cross-entropy against the full
// logits' (values, gradients, ignored targets), its errors, and the LLaMA loss with chunks.
#include <catch2/catch.hpp>

#include <cmath>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <memopt/batch.hpp>
#include <memopt/detail/autocast.hpp>
#include <memopt/detail/deferred_checks.hpp>
#include <memopt/memory/tracker.hpp>
#include <memopt/models/llama.hpp>
#include <memopt/nn/attention.hpp>
#include <memopt/nn/cross_entropy.hpp>
#include <memopt/policies/recompute.hpp>

#include "nn/fixtures.hpp"
#include "support.hpp"

using namespace memopt::test::nn;  // NOLINT: the fixtures of these tests

TEST_CASE("chunked_cross_entropy_sum equals the full logits' cross-entropy", "[cross_entropy]") {
  torch::manual_seed(5);
  const int64_t N = 50, C = 16, V = 37;
  const auto hidden0 = torch::randn({N, C});
  const auto weight0 = torch::randn({V, C}) * 0.5;
  auto targets = torch::randint(V, {N});
  targets.index_put_({torch::rand({N}) < 0.2}, memopt::kIgnoreIndex);
  targets[0] = memopt::kIgnoreIndex;
  for (const int64_t chunk : {int64_t{1}, int64_t{8}, int64_t{50}, int64_t{1000}}) for (const bool fused : {false, true}) {
    DYNAMIC_SECTION("chunk " << chunk << (fused ? ", fused row kernels" : "")) {
      auto h_full = hidden0.clone().requires_grad_(), w_full = weight0.clone().requires_grad_();
      auto h = hidden0.clone().requires_grad_(), w = weight0.clone().requires_grad_();
      const auto want = full_cross_entropy_sum(h_full, w_full, targets);
      const auto got = memopt::nn::chunked_cross_entropy_sum(
          h, w, targets, memopt::nn::ChunkedCrossEntropyOptions().chunk_size(chunk).fused(fused));
      REQUIRE(got.scalar_type() == torch::kFloat);
      REQUIRE(got.dim() == 0);
      const double rel = std::abs(got.item<double>() - want.item<double>()) / want.item<double>();
      INFO("loss " << got.item<double>() << " vs " << want.item<double>() << " (rel diff " << rel << ")");
      CHECK(rel <= kLossRtol);
      (got * 0.5).backward();
      (want * 0.5).backward();
      CHECK(max_abs_diff(h.grad(), h_full.grad()) <= kFp32Atol);
      CHECK(max_abs_diff(w.grad(), w_full.grad()) <= kFp32Atol);
      CHECK(h.grad()[0].abs().max().item<double>() == 0.0);  // an ignored row gets no gradient
    }
  }
  SECTION("bf16 autocast: logits in bf16, loss and dWeight in fp32") for (const bool fused : {false, true}) {
    auto h_full = hidden0.clone().requires_grad_(), w_full = weight0.clone().requires_grad_();
    auto h = hidden0.clone().requires_grad_(), w = weight0.clone().requires_grad_();
    torch::Tensor want, got;
    {
      memopt::detail::AutocastGuard guard({c10::kCPU, true, c10::kBFloat16});
      want = full_cross_entropy_sum(h_full, w_full, targets);
      got = memopt::nn::chunked_cross_entropy_sum(h, w, targets,
                                                  memopt::nn::ChunkedCrossEntropyOptions().chunk_size(8).fused(fused));
    }
    REQUIRE(got.scalar_type() == torch::kFloat);
    CHECK(std::abs(got.item<double>() - want.item<double>()) <= 1e-5 * std::abs(want.item<double>()));
    got.backward();
    want.backward();
    REQUIRE(w.grad().scalar_type() == torch::kFloat);
    // The full path rounds dWeight to bf16 once; the chunked one accumulates it in fp32.
    const double scale = w_full.grad().abs().max().item<double>();
    CHECK(max_abs_diff(w.grad(), w_full.grad()) <= 1e-2 * scale);
    CHECK(max_abs_diff(h.grad(), h_full.grad()) <= 1e-2 * h_full.grad().abs().max().item<double>());
  }
}

TEST_CASE("the chunked loss forms its gradients in forward: a frozen weight, no graph, one backward",
          "[cross_entropy]") {
  torch::manual_seed(6);
  const int64_t N = 40, C = 12, V = 29;
  const auto hidden0 = torch::randn({N, C});
  const auto weight0 = torch::randn({V, C}) * 0.5;
  const auto targets = torch::randint(V, {N});
  const auto options = memopt::nn::ChunkedCrossEntropyOptions().chunk_size(16).fused(true);
  SECTION("a frozen output projection (LoRA): dHidden alone, as the full logits give it") {
    auto h_full = hidden0.clone().requires_grad_(), h = hidden0.clone().requires_grad_();
    auto w = weight0.clone();
    (full_cross_entropy_sum(h_full, w, targets) / 7.0).backward();
    (memopt::nn::chunked_cross_entropy_sum(h, w, targets, options) / 7.0).backward();
    CHECK(max_abs_diff(h.grad(), h_full.grad()) <= kFp32Atol);
    CHECK_FALSE(w.grad().defined());
  }
  SECTION("without a graph: the same loss, nothing to differentiate") {
    auto h = hidden0.clone().requires_grad_();
    const auto with_graph = memopt::nn::chunked_cross_entropy_sum(h, weight0, targets, options);
    torch::NoGradGuard no_grad;
    const auto without = memopt::nn::chunked_cross_entropy_sum(h, weight0, targets, options);
    CHECK_FALSE(without.requires_grad());
    CHECK(without.item<double>() == with_graph.item<double>());
  }
  SECTION("a second backward through one loss is refused with a HINT") {
    auto h = hidden0.clone().requires_grad_(), w = weight0.clone().requires_grad_();
    const auto loss = memopt::nn::chunked_cross_entropy_sum(h, w, targets, options);
    loss.backward({}, /*retain_graph=*/true);
    memopt::test::require_error([&] { loss.backward(); }, "memopt::nn::chunked_cross_entropy_sum",
                                {"backward ran twice", "HINT"});
  }
}

TEST_CASE("a NaN logit makes the chunked loss NaN, fused or not, whatever its class", "[cross_entropy]") {
  torch::manual_seed(4);
  const auto h = torch::randn({6, 8});
  auto w = torch::randn({10, 8});
  w[7].fill_(std::nanf(""));  // class 7's logits are NaN in every row; no target is 7
  const auto targets = torch::tensor({1, 2, 3, 4, 5, 6}, torch::kLong);
  for (const bool fused : {false, true}) {
    INFO("fused " << fused);
    const auto loss = memopt::nn::chunked_cross_entropy_sum(
        h, w, targets, memopt::nn::ChunkedCrossEntropyOptions().chunk_size(4).fused(fused));
    CHECK(std::isnan(loss.item<double>()));  // not a finite loss that hides a broken weight
  }
}

TEST_CASE("chunked_cross_entropy_sum rejects bad targets with a HINT", "[cross_entropy]") {
  const auto h = torch::randn({4, 8}), w = torch::randn({10, 8});
  memopt::test::require_error(
      [&] { memopt::nn::chunked_cross_entropy_sum(h, w, torch::tensor({1, 2, 10, 3}, torch::kLong)); },
      "memopt::nn::chunked_cross_entropy_sum", {"target 10", "[0, 10)"});
  memopt::test::require_error([&] { memopt::nn::chunked_cross_entropy_sum(h, w, torch::tensor({1, 2, 3}, torch::kLong)); },
                              "memopt::nn::chunked_cross_entropy_sum", {"targets"});
  memopt::test::require_error(
      [&] { memopt::models::Llama(small_llama(true).loss_chunk_size(-1)); }, "memopt::models::LlamaConfig",
      {"loss_chunk_size", "-1"});
}

TEST_CASE("chunked_cross_entropy_sum defers its target check inside a DeferredChecks scope", "[cross_entropy]") {
  torch::manual_seed(6);
  const auto h = torch::randn({4, 8}), w = torch::randn({10, 8});
  const auto bad = torch::tensor({1, 2, 12, 3}, torch::kLong), ignored = torch::tensor({1, 2, -100, 3}, torch::kLong);
  memopt::detail::DeferredChecks checks;
  torch::Tensor got;
  {
    memopt::test::HostReads reads;
    memopt::detail::DeferredChecks::Scope scope(checks, true);
    got = memopt::nn::chunked_cross_entropy_sum(h, w, bad);  // no throw, no host read
    CHECK(reads.count() == 0);
  }
  CHECK(memopt::detail::DeferredChecks::current() == nullptr);
  // Meanwhile the bad target counts as ignored: the value is finite and safe to go on with.
  CHECK(got.item<double>() == memopt::nn::chunked_cross_entropy_sum(h, w, ignored).item<double>());
  REQUIRE_FALSE(checks.passed().item<bool>());
  memopt::test::require_error([&] { checks.throw_if_failed(); }, "memopt::nn::chunked_cross_entropy_sum",
                              {"target 12", "[0, 10)"});
  SECTION("good targets pass; a scope with defer off checks at once") {
    {
      memopt::detail::DeferredChecks::Scope scope(checks, true);  // clears the failed check
      memopt::nn::chunked_cross_entropy_sum(h, w, ignored);
    }
    CHECK_FALSE(checks.empty());
    CHECK(checks.passed().item<bool>());
    memopt::detail::DeferredChecks::Scope off(checks, false);
    memopt::test::require_error([&] { memopt::nn::chunked_cross_entropy_sum(h, w, bad); },
                                "memopt::nn::chunked_cross_entropy_sum", {"target 12"});
  }
}

TEST_CASE("Llama::loss_sum with loss_chunk_size equals the full logits' loss", "[cross_entropy][llama]") {
  torch::manual_seed(13);
  memopt::models::Llama full(small_llama(true));
  auto chunked = copy_of(full, small_llama(true).loss_chunk_size(24));  // 80 rows: ragged chunks
  const auto batch = small_batch(2, 40, 97);
  check_same_training(chunked, full, batch, memopt::recompute::None{});
  check_same_training(chunked, full, batch, memopt::recompute::EveryBlock{});
}
