// tests/optim/step_in_backward_test.cpp — memopt/optim/step_in_backward.hpp: StepInBackward
// (state::StepInBackward and StepInBackwardInt8 in a Trainer, or alone) gives the normal step's
// weights, updates each parameter and frees its gradient during backward, and refuses a second
// gradient before step().
#include <catch2/catch.hpp>

#include <vector>

#include <memopt/memopt.hpp>
#include <memopt/optim/step_in_backward.hpp>

#include "policies/fixtures.hpp"

using namespace memopt::test::policies;  // NOLINT: the fixtures of the policy tests

TEST_CASE("StepInBackward: the weights of the normal step, gradients freed during backward", "[state]") {
  for (bool checkpointed : {false, true}) {
    INFO("checkpointed " << checkpointed);
    const auto normal = weights_after<memopt::recompute::None, memopt::precision::Fp32, memopt::state::Resident>(
        3, memopt::TrainerOptions().grad_clip(0));
    const auto in_backward =
        checkpointed ? weights_after<memopt::recompute::EveryBlock, memopt::precision::Fp32,
                                     memopt::state::StepInBackward>(3, memopt::TrainerOptions().grad_clip(0))
                     : weights_after<memopt::recompute::None, memopt::precision::Fp32,
                                     memopt::state::StepInBackward>(3, memopt::TrainerOptions().grad_clip(0));
    CHECK(max_abs_diff(normal, in_backward) <= 1e-6);
  }
  // With 8-bit state per parameter: the weights of state::Int8's one AdamW8bit.
  const auto int8 = weights_after<memopt::recompute::None, memopt::precision::Fp32, memopt::state::Int8>(
      3, memopt::TrainerOptions().grad_clip(0));
  const auto int8_in_backward =
      weights_after<memopt::recompute::None, memopt::precision::Fp32, memopt::state::StepInBackwardInt8>(
          3, memopt::TrainerOptions().grad_clip(0));
  CHECK(max_abs_diff(int8, int8_in_backward) <= 1e-6);

  // Plain LibTorch use: after backward every parameter is updated and holds no gradient.
  torch::manual_seed(0);
  memopt::models::Llama model(tiny_llama(0.0));
  const auto adamw = torch::optim::AdamWOptions(1e-2);
  std::vector<torch::Tensor> params = model->parameters();
  memopt::optim::StepInBackward opt(memopt::optim::single_group(params, adamw), adamw);
  const auto before = params_of(*model);
  const Batch batch = random_batch(2, 16, 64, 5);
  model->loss_sum(batch, memopt::recompute::None{}).backward();
  CHECK(opt.updated_this_step() == static_cast<int64_t>(params.size()));
  for (auto& p : params) CHECK_FALSE(p.grad().defined());
  const auto after = params_of(*model);
  for (size_t i = 0; i < params.size(); ++i) CHECK(max_abs_diff({before[i]}, {after[i]}) > 0);
  int64_t numel = 0;
  for (auto& p : params) numel += p.numel();
  CHECK(opt.state_bytes() == 8 * numel);  // exp_avg + exp_avg_sq, fp32
  opt.step();

  // A second backward in the same step would update twice: rejected.
  model->loss_sum(batch, memopt::recompute::None{}).backward();
  CHECK_THROWS_WITH(model->loss_sum(batch, memopt::recompute::None{}).backward(),
                    Catch::Contains("second gradient before step()") && Catch::Contains("HINT"));
}
