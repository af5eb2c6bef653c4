// Tests for memopt/policies/offload.hpp: steps in backward give the normal step's
// weights with the gradients freed early; the disk state gives LibTorch AdamW's update.
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

TEST_CASE("StepInBackward: the weights of the normal step, gradients freed during backward", "[offload]") {
  for (bool checkpointed : {false, true}) {
    INFO("checkpointed " << checkpointed);
    const auto normal = weights_after<memopt::checkpoint::None, memopt::precision::Fp32, memopt::offload::None>(
        3, memopt::TrainerOptions().grad_clip(0));
    const auto in_backward =
        checkpointed ? weights_after<memopt::checkpoint::EveryBlock, memopt::precision::Fp32,
                                     memopt::offload::StepInBackward>(3, memopt::TrainerOptions().grad_clip(0))
                     : weights_after<memopt::checkpoint::None, memopt::precision::Fp32,
                                     memopt::offload::StepInBackward>(3, memopt::TrainerOptions().grad_clip(0));
    CHECK(max_abs_diff(normal, in_backward) <= 1e-6);
  }
  // With 8-bit state per parameter: the weights of offload::Int8State's one AdamW8bit.
  const auto int8 = weights_after<memopt::checkpoint::None, memopt::precision::Fp32, memopt::offload::Int8State>(
      3, memopt::TrainerOptions().grad_clip(0));
  const auto int8_in_backward =
      weights_after<memopt::checkpoint::None, memopt::precision::Fp32, memopt::offload::StepInBackwardInt8>(
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
  model->loss_sum(batch, memopt::checkpoint::None{}).backward();
  CHECK(opt.updated_this_step() == static_cast<int64_t>(params.size()));
  for (auto& p : params) CHECK_FALSE(p.grad().defined());
  const auto after = params_of(*model);
  for (size_t i = 0; i < params.size(); ++i) CHECK(max_abs_diff({before[i]}, {after[i]}) > 0);
  int64_t numel = 0;
  for (auto& p : params) numel += p.numel();
  CHECK(opt.state_bytes() == 8 * numel);  // exp_avg + exp_avg_sq, fp32
  opt.step();

  // A second backward in the same step would update twice: rejected.
  model->loss_sum(batch, memopt::checkpoint::None{}).backward();
  CHECK_THROWS_WITH(model->loss_sum(batch, memopt::checkpoint::None{}).backward(),
                    Catch::Contains("second gradient before step()") && Catch::Contains("HINT"));
}

TEST_CASE("offload::Disk: LibTorch's AdamW update with the state in a file", "[offload]") {
  memopt::test::TempDir dir("memopt_disk");
  auto disk = [&](int64_t chunk) {
    return memopt::offload::Disk(memopt::optim::DiskAdamWOptions().directory(dir.path.string()).chunk_elements(chunk));
  };
  const auto normal = weights_after<memopt::checkpoint::None, memopt::precision::Fp32, memopt::offload::None>(
      3, memopt::TrainerOptions());
  // Chunks of 100 elements split most tensors mid-row; one chunk per tensor also works.
  for (int64_t chunk : {int64_t{100}, int64_t{1} << 20}) {
    INFO("chunk " << chunk);
    const auto on_disk = weights_after<memopt::checkpoint::None, memopt::precision::Fp32, memopt::offload::Disk>(
        3, memopt::TrainerOptions(), disk(chunk));
    CHECK(max_abs_diff(normal, on_disk) <= 1e-6);
  }
  CHECK(std::filesystem::is_empty(dir.path));  // the state file was unlinked at once

  // State size, residency, and save -> load -> the same next step.
  torch::manual_seed(0);
  memopt::models::Llama model(tiny_llama(0.0));
  auto adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  auto params = model->parameters();
  int64_t numel = 0, largest = 0;
  for (auto& p : params) {
    numel += p.numel();
    largest = std::max(largest, p.numel());
  }
  memopt::optim::DiskAdamW opt(memopt::optim::single_group(params, adamw), adamw, disk(256).options);
  CHECK(opt.state_bytes_on_disk() == 8 * numel);
  CHECK(opt.resident_state_bytes() == 3 * 2 * 256 * 4);
  const Batch batch = random_batch(2, 16, 64, 5);
  auto train_step = [&](torch::optim::Optimizer& o) {
    o.zero_grad();
    model->loss_sum(batch, memopt::checkpoint::None{}).backward();
    o.step();
  };
  train_step(opt);
  train_step(opt);
  std::stringstream saved;
  {
    torch::serialize::OutputArchive archive;
    opt.save(archive);
    archive.save_to(saved);
  }
  const auto weights = params_of(*model);
  train_step(opt);
  const auto continued = params_of(*model);
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) params[i].copy_(weights[i]);
  }
  memopt::optim::DiskAdamW fresh(memopt::optim::single_group(params, adamw), adamw, disk(1000).options);
  torch::serialize::InputArchive archive;
  archive.load_from(saved);
  fresh.load(archive);
  train_step(fresh);
  CHECK(max_abs_diff(continued, params_of(*model)) <= 1e-7);
  CHECK(max_abs_diff(continued, weights) > 1e-4);  // the step did something

  memopt::test::require_error(
      [&] {
        memopt::optim::DiskAdamW bad(memopt::optim::single_group(params, adamw), adamw,
                                     memopt::optim::DiskAdamWOptions().directory("/nonexistent/memopt"));
      },
      "memopt::optim::DiskAdamW: cannot create the state file", {"'/nonexistent/memopt'", "No such file"});
  memopt::test::require_error(
      [&] { memopt::offload::PinnedHost{}.make_optimizer(memopt::optim::single_group(params, adamw), adamw); },
      "memopt::offload::PinnedHost: parameters must live on a CUDA device", {"cpu"});
}
