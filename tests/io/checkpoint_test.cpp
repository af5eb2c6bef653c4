// Tests for memopt/io/checkpoint.hpp and the Trainer's checkpoints, resume(), non-finite
// skips and SIGTERM stop: a run stopped by SIGTERM and resumed from "latest" ends bit for
// bit where an uninterrupted one does (fp32, 8-bit, disk-offloaded state, bf16 masters,
// bf16 autocast with checkpointed dropout); corrupt, truncated and half-written checkpoints
// are refused and the previous one used (malformed manifests: manifest_test.cpp); a NaN
// gradient skips the step leaving weights and optimizer state untouched, and too many in a
// row stop the run with a checkpoint of the last good state. A resume's refusal of other
// settings is tested in training_state_test.cpp, the signal handlers in tests/signals_test.cpp,
// memory_budget in tests/memory/budget_test.cpp.
#include <catch2/catch.hpp>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "io/fixtures.hpp"
#include "support.hpp"

#include <memopt/detail/optimizer_state.hpp>
#include <memopt/io/checkpoint.hpp>
#include <memopt/models/llama.hpp>
#include <memopt/trainer.hpp>

namespace fs = std::filesystem;

using namespace memopt::test::io;  // NOLINT: the fixtures of the checkpoint tests

namespace {

/// 6 steps in one go == 6 steps with a SIGTERM in step 4 (finished, checkpointed) and a
/// resume from "latest" in a fresh process-like setting (new model, trainer, loader).
template <class MakeTrainer>
void check_resume_is_exact(MakeTrainer make_trainer) {
  memopt::test::TempDir dir("memopt_checkpoint");
  torch::manual_seed(7);
  memopt::models::Llama straight(tiny_config());
  auto straight_trainer = make_trainer(straight, options());
  CountingLoader straight_loader;
  const auto done = fit(straight, straight_trainer, straight_loader);
  CHECK(done.steps == 6);
  CHECK(done.stop_signal == 0);

  torch::manual_seed(7);
  memopt::models::Llama first(tiny_config());
  auto first_trainer = make_trainer(first, options(dir.file("ckpt")).save_every(3));
  CountingLoader first_loader;
  const auto stopped = fit(first, first_trainer, first_loader, /*signal_at=*/4);  // one micro-batch a step
  CHECK(stopped.stop_signal == SIGTERM);
  CHECK(stopped.steps == 4);  // the step under way when the signal came was finished
  CHECK(first_trainer.steps_taken() == 4);
  CHECK(fs::is_directory(dir.file("ckpt/step-00000003")));
  REQUIRE(fs::is_directory(dir.file("ckpt/step-00000004")));
  CHECK(stopped.checkpoint == dir.file("ckpt/step-00000004"));
  CHECK(memopt::io::read_checkpoint_state(stopped.checkpoint)["reason"] == "SIGTERM");

  torch::manual_seed(99);
  memopt::models::Llama resumed(tiny_config());  // another init and random state: the resume overwrites both
  auto resumed_trainer = make_trainer(resumed, options(dir.file("ckpt")).save_every(3));
  CountingLoader resumed_loader;
  REQUIRE(resumed_trainer.resume("latest", resumed_loader));
  CHECK(resumed_trainer.steps_taken() == 4);
  CHECK(resumed_loader.next_index == 4);
  const auto rest = fit(resumed, resumed_trainer, resumed_loader);
  CHECK(rest.steps == 2);
  check_same_weights(straight, resumed);
}

void flip_byte(const std::string& path, std::streamoff offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset);
  char c = 0;
  f.get(c);
  f.seekp(offset);
  f.put(static_cast<char>(c ^ 0x5a));
}

/// AdamW's state, parameter by parameter (in the optimizer's parameter order): step, exp_avg, exp_avg_sq.
std::vector<torch::Tensor> adamw_state(torch::optim::Optimizer& optimizer) {
  std::vector<torch::optim::AdamWParamState*> ordered;
  for (auto& group : optimizer.param_groups())
    for (auto& p : group.params()) {
      auto it = optimizer.state().find(memopt::detail::optimizer_state_key(optimizer.state(), p));
      if (it != optimizer.state().end())
        ordered.push_back(static_cast<torch::optim::AdamWParamState*>(it->second.get()));
    }
  std::vector<torch::Tensor> out;
  for (auto* s : ordered) {
    out.push_back(torch::tensor(s->step()));
    out.push_back(s->exp_avg().clone());
    out.push_back(s->exp_avg_sq().clone());
  }
  return out;
}

bool equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!torch::equal(a[i], b[i])) return false;
  return true;
}

/// A checkpoint directory of steps 1..n (keep `keep`) of a tiny fp32 run.
void write_steps(const std::string& dir, int n, int64_t keep = 5) {
  torch::manual_seed(1);
  memopt::models::Llama model(tiny_config());
  memopt::Trainer<> trainer(*model, options(dir).keep_checkpoints(keep).max_steps(n).save_every(1));
  CountingLoader loader;
  fit(model, trainer, loader);
}

}  // namespace

TEST_CASE("SIGTERM, checkpoint, resume latest: bit for bit the uninterrupted run (fp32 AdamW)", "[checkpoint]") {
  check_resume_is_exact([](memopt::models::Llama& m, memopt::TrainerOptions o) { return memopt::Trainer<>(*m, o); });
}

TEST_CASE("SIGTERM, checkpoint, resume latest: bit for bit (8-bit AdamW)", "[checkpoint]") {
  using T = memopt::Trainer<memopt::recompute::None, memopt::precision::Fp32, memopt::accum::None,
                            memopt::state::Int8>;
  check_resume_is_exact([](memopt::models::Llama& m, memopt::TrainerOptions o) {  // every moment 8-bit
    return T(*m, o, {}, memopt::state::Int8(memopt::optim::AdamW8bitOptions().min_8bit_size(0)));
  });
}

TEST_CASE("SIGTERM, checkpoint, resume latest: bit for bit (optimizer state on disk)", "[checkpoint]") {
  using T = memopt::Trainer<memopt::recompute::None, memopt::precision::Fp32, memopt::accum::None,
                            memopt::state::Disk>;
  memopt::test::TempDir state_dir("memopt_disk_state");
  check_resume_is_exact([&](memopt::models::Llama& m, memopt::TrainerOptions o) {
    return T(*m, o, {}, memopt::state::Disk(memopt::optim::DiskAdamWOptions().directory(state_dir.path.string())));
  });
}

TEST_CASE("SIGTERM, checkpoint, resume latest: bit for bit (bf16 weights, fp32 masters)", "[checkpoint]") {
  using T = memopt::Trainer<memopt::recompute::None, memopt::precision::Bf16Pure>;
  check_resume_is_exact([](memopt::models::Llama& m, memopt::TrainerOptions o) { return T(*m, o); });
}

TEST_CASE("SIGTERM, checkpoint, resume latest: bit for bit (bf16 autocast, checkpointed dropout, accum 2)",
          "[checkpoint]") {
  using T = memopt::Trainer<memopt::recompute::EveryBlock, memopt::precision::Bf16Autocast, memopt::accum::Fixed<2>>;
  // Two micro-batches a step: the signal in the 7th forward comes in step 4.
  memopt::test::TempDir dir("memopt_checkpoint");
  auto run = [&](memopt::models::Llama& model, const std::string& ckpt, int64_t signal_at) {
    T trainer(*model, options(ckpt));
    CountingLoader loader;
    if (!ckpt.empty()) trainer.resume("latest", loader);
    int64_t calls = 0;
    return trainer.fit(loader, Loss{&model, &calls, signal_at});
  };
  torch::manual_seed(5);
  memopt::models::Llama straight(tiny_config());
  run(straight, "", 0);
  torch::manual_seed(5);
  memopt::models::Llama halves(tiny_config());
  const auto stopped = run(halves, dir.file("ckpt"), 7);
  CHECK(stopped.stop_signal == SIGTERM);
  CHECK(stopped.steps == 4);
  memopt::models::Llama resumed(tiny_config());
  CHECK(run(resumed, dir.file("ckpt"), 0).steps == 2);
  check_same_weights(straight, resumed);
}

TEST_CASE("latest skips corrupt, truncated and half-written checkpoints, and a named one is refused", "[checkpoint]") {
  memopt::test::TempDir dir("memopt_checkpoint");
  const std::string root = dir.file("ckpt");
  write_steps(root, 4);
  memopt::io::CheckpointManager manager(root, 5);
  REQUIRE(manager.list().size() == 4);
  CHECK(manager.resolve("latest") == manager.path_of(4));
  // A checkpoints folder, or a run's output folder holding one, names its newest checkpoint.
  CHECK(manager.resolve(root) == manager.path_of(4));
  const std::string run = dir.file("run");
  write_steps(run + "/checkpoints", 2);
  CHECK(manager.resolve(run) == memopt::io::CheckpointManager(run + "/checkpoints", 5).path_of(2));

  // A save killed half way leaves step-N.tmp: never listed, never resolved.
  fs::create_directories(root + "/step-00000009.tmp");
  std::ofstream(root + "/step-00000009.tmp/model.safetensors") << "partial";
  CHECK(manager.resolve("latest") == manager.path_of(4));

  flip_byte(manager.path_of(4) + "/model.safetensors", 200);
  std::vector<std::string> refused;
  CHECK(manager.resolve("latest", &refused) == manager.path_of(3));
  REQUIRE(refused.size() == 1);
  CHECK_THAT(refused[0], Catch::Contains("step-00000004") && Catch::Contains("model.safetensors") &&
                             Catch::Contains("fails its checksum"));
  memopt::test::require_error([&] { manager.resolve(manager.path_of(4)); }, "memopt::io: checkpoint",
                              {"model.safetensors", "fails its checksum", "step-00000003"});

  fs::resize_file(manager.path_of(3) + "/trainer.pt", 100);  // truncated
  refused.clear();
  CHECK(manager.resolve("latest", &refused) == manager.path_of(2));
  CHECK(refused.size() == 2);
  CHECK_THAT(refused[1], Catch::Contains("trainer.pt") && Catch::Contains("has 100 bytes, the manifest says"));

  fs::remove(manager.path_of(2) + "/manifest.json");  // killed before the manifest: never renamed, but say so
  fs::remove(manager.path_of(1) + "/state.json");
  memopt::test::require_error([&] { manager.resolve("latest"); }, "memopt::io: no checkpoint in",
                              {"passes its checks", "manifest.json is missing", "'state.json' is missing"});

  // A Trainer resuming "latest" from this folder is refused too, and starts nothing.
  torch::manual_seed(1);
  memopt::models::Llama model(tiny_config());
  memopt::Trainer<> trainer(*model, options(root));
  CountingLoader loader;
  CHECK_THROWS(trainer.resume("latest", loader));
  CHECK(trainer.steps_taken() == 0);
}

TEST_CASE("the newest keep_checkpoints are kept, and latest in an empty folder starts anew", "[checkpoint]") {
  memopt::test::TempDir dir("memopt_checkpoint");
  write_steps(dir.file("ckpt"), 5, /*keep=*/2);
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir.file("ckpt"))) names.push_back(entry.path().filename());
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"step-00000004", "step-00000005"});
  const auto manifest = memopt::io::verify_checkpoint(dir.file("ckpt/step-00000005"));
  CHECK(manifest.step == 5);
  CHECK(manifest.files.size() == 3);
  CHECK(manifest.files.at("model.safetensors") == memopt::io::digest_file(dir.file("ckpt/step-00000005/model.safetensors")));

  torch::manual_seed(1);
  memopt::models::Llama model(tiny_config());
  memopt::Trainer<> trainer(*model, options(dir.file("empty")));
  CountingLoader loader;
  CHECK_FALSE(trainer.resume("latest", loader));
  CHECK(trainer.steps_taken() == 0);
  CHECK(loader.next_index == 0);
}

TEST_CASE("a NaN gradient skips the step: weights and optimizer state untouched, counted", "[checkpoint][nonfinite]") {
  torch::manual_seed(11);
  memopt::models::Llama model(tiny_config().dropout(0.0));
  memopt::Trainer<> trainer(*model, options().max_steps(3));
  CountingLoader loader;
  auto loss = [&](const memopt::Batch& b, const auto& ckpt) { return model->loss_sum(b, ckpt); };
  trainer.step(loader, loss);
  const auto weights = model->parameters()[0].clone();
  const auto state = adamw_state(trainer.optimizer());
  REQUIRE(!state.empty());

  auto poisoned = model->parameters()[3];  // one gradient element becomes NaN
  auto hook = poisoned.register_hook([](torch::Tensor g) {
    g = g.clone();
    g.view(-1)[0] = std::numeric_limits<float>::quiet_NaN();
    return g;
  });
  const auto skipped = trainer.step(loader, loss);
  poisoned.remove_hook(hook);
  CHECK_FALSE(skipped.stepped);
  CHECK(std::isnan(skipped.grad_norm.item<double>()));
  CHECK(torch::equal(model->parameters()[0], weights));
  CHECK(equal(adamw_state(trainer.optimizer()), state));
  CHECK(trainer.steps_taken() == 2);  // the step is counted (its batch is consumed)

  const auto next = trainer.step(loader, loss);
  CHECK(next.stepped);
  CHECK_FALSE(torch::equal(model->parameters()[0], weights));
}

TEST_CASE("a non-finite loss backs off the loss scale and is counted by fit()", "[checkpoint][nonfinite]") {
  using T = memopt::Trainer<memopt::recompute::None, memopt::precision::Scaled<c10::kFloat>>;
  torch::manual_seed(12);
  memopt::models::Llama model(tiny_config().dropout(0.0));
  T trainer(*model, options().max_steps(4));
  CountingLoader loader;
  int64_t calls = 0;
  const double scale = trainer.precision().scaler().current_scale();
  const auto result = trainer.fit(loader, [&](const memopt::Batch& b, const auto& ckpt) {
    auto loss = model->loss_sum(b, ckpt);
    return ++calls == 2 ? loss * std::numeric_limits<float>::infinity() : loss;
  });
  CHECK(result.skipped_steps == 1);
  CHECK(trainer.precision().scaler().current_scale() == scale * 0.5);
  CHECK(trainer.precision().scaler().skipped_steps() == 1);
}

TEST_CASE("too many skipped steps in a row stop the run with a checkpoint of the last good state",
          "[checkpoint][nonfinite]") {
  memopt::test::TempDir dir("memopt_checkpoint");
  torch::manual_seed(13);
  memopt::models::Llama model(tiny_config().dropout(0.0));
  memopt::Trainer<> trainer(*model, options(dir.file("ckpt")).max_steps(10).max_consecutive_skips(3));
  CountingLoader loader;
  int64_t calls = 0;
  torch::Tensor good;  // the weights after step 2, the last good one
  memopt::test::require_error(
      [&] {
        trainer.fit(loader, [&](const memopt::Batch& b, const auto& ckpt) {
          if (++calls == 3) good = model->parameters()[0].detach().clone();
          auto loss = model->loss_sum(b, ckpt);
          return calls >= 3 ? loss * std::numeric_limits<float>::quiet_NaN() : loss;
        });
      },
      "memopt::Trainer: 3 steps in a row (3 to 5) had a non-finite loss or gradient norm",
      {"max_consecutive_skips 3", "the last good state is saved in", "step-00000005", "the weights after step 2"});
  const std::string saved = dir.file("ckpt/step-00000005");
  REQUIRE(fs::is_directory(saved));
  CHECK(memopt::io::read_checkpoint_state(saved)["reason"] == "nonfinite");

  memopt::models::Llama restored(tiny_config().dropout(0.0));
  memopt::Trainer<> restored_trainer(*restored, options(dir.file("ckpt")).max_steps(10).max_consecutive_skips(3));
  CountingLoader restored_loader;
  REQUIRE(restored_trainer.resume("latest", restored_loader));
  CHECK(torch::equal(restored->parameters()[0], good));
  CHECK(restored_loader.next_index == 5);  // the bad batches are behind it
}
