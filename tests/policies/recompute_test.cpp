// Tests for memopt/policies/recompute.hpp: checkpointing gives the gradients of no
// checkpointing with dropout on (LLaMA and a user module) and leaves the RNG stream and the
// autocast state as it found them.
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include <catch2/catch.hpp>

#include <memopt/memopt.hpp>

#include "policies/fixtures.hpp"
#include "support.hpp"

using namespace memopt::test::policies;  // NOLINT: the fixtures of the policy tests

TEST_CASE("checkpointing gives the gradients of no checkpointing, dropout on (LLaMA)", "[checkpoint]") {
  torch::manual_seed(0);
  memopt::models::Llama model(tiny_llama(0.1));
  model->train();
  const Batch batch = random_batch(3, 16, 64, 11);

  const auto plain = llama_grads<memopt::recompute::None>(model, batch, 123);
  const auto every = llama_grads<memopt::recompute::EveryBlock>(model, batch, 123);
  const auto nth = llama_grads<memopt::recompute::EveryNth<2>>(model, batch, 123);
  const auto selective = llama_grads<memopt::recompute::Selective>(model, batch, 123);
  CHECK(max_abs_diff(plain, every) <= 1e-6);
  CHECK(max_abs_diff(plain, nth) <= 1e-6);
  CHECK(max_abs_diff(plain, selective) <= 1e-6);

  // The comparison is sensitive: another dropout draw changes the gradients.
  const auto other_draw = llama_grads<memopt::recompute::None>(model, batch, 124);
  CHECK(max_abs_diff(plain, other_draw) > 1e-4);
}

TEST_CASE("a checkpointed LLaMA block's recompute skips the down projection's GEMM", "[checkpoint]") {
  // Its output only feeds the block's output, which the recompute never reads (the gradients are
  // checked equal above, dropout on): the recompute runs the block's 7 projections less that one.
  torch::manual_seed(0);
  const auto config = tiny_llama(0.1);
  memopt::models::Llama model(config);
  model->train();
  const Batch batch = random_batch(2, 16, 64, 11);
  auto mm_calls = [&](auto ckpt) {
    memopt::test::OpCalls mm("aten::mm");
    (void)llama_grads<decltype(ckpt)>(model, batch, 123);
    return mm.count();
  };
  const int64_t plain = mm_calls(memopt::recompute::None{}), every = mm_calls(memopt::recompute::EveryBlock{});
  INFO("aten::mm calls: None " << plain << ", EveryBlock " << every);
  CHECK(every - plain == 6 * config.num_hidden_layers());
}

TEST_CASE("checkpointing gives the gradients of no checkpointing, dropout on (user module)", "[checkpoint]") {
  torch::manual_seed(1);
  UserNet net(50, 24, 4);
  net->train();
  const Batch batch = random_batch(2, 12, 50, 5);
  const auto plain = user_grads<memopt::recompute::None>(net, batch, 99);
  const auto every = user_grads<memopt::recompute::EveryBlock>(net, batch, 99);
  const auto nth = user_grads<memopt::recompute::EveryNth<2>>(net, batch, 99);
  CHECK(max_abs_diff(plain, every) <= 1e-6);
  CHECK(max_abs_diff(plain, nth) <= 1e-6);
  CHECK(max_abs_diff(plain, user_grads<memopt::recompute::None>(net, batch, 100)) > 1e-4);
}

TEST_CASE("preserve_rng_state off: exact without dropout, other masks with it", "[checkpoint]") {
  torch::manual_seed(0);
  const Batch batch = random_batch(3, 16, 64, 11);
  memopt::models::Llama plain_model(tiny_llama(0.0));
  plain_model->train();
  const auto reference = llama_grads<memopt::recompute::None>(plain_model, batch, 123);
  {
    memopt::detail::PreserveRng off(false);  // as TrainerOptions().preserve_rng_state(false) sets it a step
    CHECK(max_abs_diff(reference, llama_grads<memopt::recompute::EveryBlock>(plain_model, batch, 123)) <= 1e-6);
  }
  // With dropout the recompute draws other masks than the forward did: the gradients are wrong,
  // which is what the RNG save (on by default, and again after the scope) prevents.
  memopt::models::Llama dropout_model(tiny_llama(0.1));
  dropout_model->train();
  const auto dropout_reference = llama_grads<memopt::recompute::None>(dropout_model, batch, 123);
  {
    memopt::detail::PreserveRng off(false);
    CHECK(max_abs_diff(dropout_reference, llama_grads<memopt::recompute::EveryBlock>(dropout_model, batch, 123)) > 1e-4);
  }
  CHECK(memopt::detail::preserve_rng_state());
  CHECK(max_abs_diff(dropout_reference, llama_grads<memopt::recompute::EveryBlock>(dropout_model, batch, 123)) <= 1e-6);
  CHECK(memopt::TrainerOptions().preserve_rng_state());
}

TEST_CASE("checkpointing leaves the RNG stream and autocast state as it found them", "[checkpoint]") {
  torch::manual_seed(3);
  UserNet net(20, 8, 2);
  const Batch batch = random_batch(2, 4, 20, 1);
  torch::manual_seed(5);
  (net->loss_sum(batch, memopt::recompute::EveryBlock{}) / batch.num_targets()).backward();
  const auto after_checkpointed = torch::rand({4});
  torch::manual_seed(5);
  (net->loss_sum(batch, memopt::recompute::None{}) / batch.num_targets()).backward();
  const auto after_plain = torch::rand({4});
  CHECK(torch::equal(after_checkpointed, after_plain));
  CHECK_FALSE(memopt::detail::AutocastState::current(c10::kCPU).enabled);
}

TEST_CASE("CUDA: checkpointing gives the gradients of no checkpointing, dropout on", "[checkpoint][cuda]") {
  MEMOPT_REQUIRE_CUDA();
  const torch::Device cuda(torch::kCUDA, 0);
  // Tolerance: the CUDA kernels' own run-to-run spread (atomics in the embedding and attention
  // backward), far below what another dropout draw moves (checked last).
  constexpr double kTolerance = 2e-5;
  torch::manual_seed(0);
  memopt::models::Llama model(tiny_llama(0.1));
  model->to(cuda);
  model->train();
  const Batch batch = random_batch(3, 16, 64, 11).to(cuda);
  const auto plain = llama_grads<memopt::recompute::None>(model, batch, 123);
  CHECK(max_abs_diff(plain, llama_grads<memopt::recompute::EveryBlock>(model, batch, 123)) <= kTolerance);
  CHECK(max_abs_diff(plain, llama_grads<memopt::recompute::EveryNth<2>>(model, batch, 123)) <= kTolerance);
  CHECK(max_abs_diff(plain, llama_grads<memopt::recompute::Selective>(model, batch, 123)) <= kTolerance);
  CHECK(max_abs_diff(plain, llama_grads<memopt::recompute::None>(model, batch, 124)) > 1e-4);

  torch::manual_seed(1);
  UserNet net(50, 24, 4);
  net->to(cuda);
  net->train();
  const Batch user_batch = random_batch(2, 12, 50, 5).to(cuda);
  const auto user_plain = user_grads<memopt::recompute::None>(net, user_batch, 99);
  CHECK(max_abs_diff(user_plain, user_grads<memopt::recompute::EveryBlock>(net, user_batch, 99)) <= kTolerance);
  CHECK(max_abs_diff(user_plain, user_grads<memopt::recompute::None>(net, user_batch, 100)) > 1e-4);

  // The CUDA generator continues as if nothing had been recomputed.
  torch::manual_seed(5);
  (net->loss_sum(user_batch, memopt::recompute::EveryBlock{}) / user_batch.num_targets()).backward();
  const auto after_checkpointed = torch::rand({4}, torch::TensorOptions().device(cuda)).cpu();
  torch::manual_seed(5);
  (net->loss_sum(user_batch, memopt::recompute::None{}) / user_batch.num_targets()).backward();
  CHECK(torch::equal(after_checkpointed, torch::rand({4}, torch::TensorOptions().device(cuda)).cpu()));
}
