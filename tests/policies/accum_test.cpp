// Tests for memopt/policies/accum.hpp: accumulated micro-batches give one big batch's
// gradients, ragged padding included (GradCache: tests/models/gritlm_test.cpp).
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

TEST_CASE("accum::Fixed<4> x micro-batch 2 gives the gradients of one batch of 8", "[accum]") {
  std::vector<Batch> micro;
  for (int m = 0; m < 4; ++m) micro.push_back(random_batch(2, 16, 64, 100 + m));
  const auto big = trainer_grads<memopt::accum::None>({concat(micro)}, memopt::TrainerOptions());
  const auto accumulated = trainer_grads<memopt::accum::Fixed<4>>(micro, memopt::TrainerOptions());
  const auto runtime = trainer_grads<memopt::accum::Runtime>(micro, memopt::TrainerOptions().accum_steps(4));
  CHECK(max_abs_diff(big, accumulated) <= 1e-6);
  CHECK(max_abs_diff(big, runtime) <= 1e-6);
  // Sensitive: half the batch gives other gradients.
  const auto half = trainer_grads<memopt::accum::Fixed<2>>(micro, memopt::TrainerOptions());
  CHECK(max_abs_diff(big, half) > 1e-4);
}

TEST_CASE("accumulation equals the big batch with ragged padding across micro-batches", "[accum]") {
  std::vector<Batch> micro;
  for (int m = 0; m < 4; ++m) micro.push_back(with_padding(random_batch(2, 16, 64, 200 + m), m));
  const auto big = trainer_grads<memopt::accum::None>({concat(micro)}, memopt::TrainerOptions());
  const auto accumulated = trainer_grads<memopt::accum::Fixed<4>>(micro, memopt::TrainerOptions());
  CHECK(max_abs_diff(big, accumulated) <= 1e-6);

  // The classic bug — averaging each micro-batch's mean — is measurably different here.
  torch::manual_seed(7);
  memopt::models::Llama model(tiny_llama(0.0));
  for (const auto& b : micro) (model->loss_sum(b, memopt::recompute::None{}) / b.num_targets() / 4).backward();
  std::vector<torch::Tensor> naive;
  for (auto& g : model->named_parameters()) naive.push_back(g.value().grad());
  // named_parameters() and the optimizer's groups order differ; compare norms instead.
  double big_norm = 0, naive_norm = 0;
  for (auto& g : big) big_norm += g.pow(2).sum().item<double>();
  for (auto& g : naive) naive_norm += g.pow(2).sum().item<double>();
  CHECK(std::abs(big_norm - naive_norm) > 1e-6 * big_norm);
}
