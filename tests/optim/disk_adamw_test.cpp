// tests/optim/disk_adamw_test.cpp — memopt/optim/disk_adamw.hpp: DiskAdamW (state::Disk in a
// Trainer, or alone) gives LibTorch AdamW's update with the state in an unlinked file streamed in
// chunks, holds three chunks resident, saves and loads its state, and names a folder it cannot
// use (as state::PinnedHost names CPU parameters).
#include <catch2/catch.hpp>

#include <algorithm>
#include <filesystem>
#include <sstream>
#include <vector>

#include <memopt/memopt.hpp>
#include <memopt/optim/disk_adamw.hpp>

#include "policies/fixtures.hpp"
#include "support.hpp"

using namespace memopt::test::policies;  // NOLINT: the fixtures of the policy tests

TEST_CASE("state::Disk: LibTorch's AdamW update with the state in a file", "[state]") {
  memopt::test::TempDir dir("memopt_disk");
  auto disk = [&](int64_t chunk) {
    return memopt::state::Disk(memopt::optim::DiskAdamWOptions().directory(dir.path.string()).chunk_elements(chunk));
  };
  const auto normal = weights_after<memopt::recompute::None, memopt::precision::Fp32, memopt::state::Resident>(
      3, memopt::TrainerOptions());
  // Chunks of 100 elements split most tensors mid-row; one chunk per tensor also works.
  for (int64_t chunk : {int64_t{100}, int64_t{1} << 20}) {
    INFO("chunk " << chunk);
    const auto on_disk = weights_after<memopt::recompute::None, memopt::precision::Fp32, memopt::state::Disk>(
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
    model->loss_sum(batch, memopt::recompute::None{}).backward();
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
      [&] { memopt::state::PinnedHost{}.make_optimizer(memopt::optim::single_group(params, adamw), adamw); },
      "memopt::state::PinnedHost: parameters must live on a CUDA device", {"cpu"});
}
