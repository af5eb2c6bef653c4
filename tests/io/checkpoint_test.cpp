// Tests for memopt/io/checkpoint.hpp, the Trainer's checkpoints, resume(), non-finite
// skips and SIGTERM stop: a run stopped by SIGTERM and resumed from "latest" ends bit for
// bit where an uninterrupted one does (fp32, 8-bit, disk-offloaded state, bf16 masters,
// bf16 autocast with checkpointed dropout); corrupt, truncated and half-written checkpoints
// are refused and the previous one used; malformed manifests are refused naming the field;
// a NaN gradient skips the step leaving weights and optimizer state untouched, and too many
// in a row stop the run with a checkpoint of the last good state.
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

#include "support.hpp"

#include <memopt/detail/optimizer_state.hpp>
#include <memopt/callbacks.hpp>
#include <memopt/data/loader.hpp>
#include <memopt/io/checkpoint.hpp>
#include <memopt/models/llama.hpp>
#include <memopt/trainer.hpp>

namespace fs = std::filesystem;

namespace {

constexpr int64_t kVocab = 50;

memopt::models::LlamaConfig tiny_config() {
  return memopt::models::LlamaConfig().vocab_size(kVocab).hidden_size(16).num_hidden_layers(2).num_attention_heads(
      2).max_position_embeddings(16).dropout(0.1);  // dropout: a resume must restore the random state
}

/// (4, 8) batches drawn from its own position; a ResumableSource.
struct CountingLoader {
  int64_t next_index = 0;
  memopt::Batch next() {
    torch::Tensor tokens = (torch::arange(36, torch::kLong) * (next_index + 3) + next_index).remainder(kVocab);
    tokens = tokens.view({4, 9});  // (B, T+1)
    ++next_index;
    return {tokens.narrow(1, 0, 8), tokens.narrow(1, 1, 8)};
  }
  nlohmann::json state() const { return {{"next_index", next_index}}; }
  void load_state(const nlohmann::json& s) { next_index = s.at("next_index").get<int64_t>(); }
};

memopt::TrainerOptions options(const std::string& dir = "") {
  return memopt::TrainerOptions().lr(1e-2).warmup_steps(2).max_steps(6).log_interval(100).checkpoint_dir(
      dir);
}

/// The model's loss; at step `signal_at` (1-based), raises `signal` in the forward.
struct Loss {
  memopt::models::Llama* model;
  int64_t* calls;
  int64_t signal_at = 0;
  int signal = SIGTERM;
  template <class C>
  torch::Tensor operator()(const memopt::Batch& b, const C& ckpt) const {
    if (++*calls == signal_at) std::raise(signal);
    return (*model)->loss_sum(b, ckpt);
  }
};

template <class TrainerT>
memopt::FitResult fit(memopt::models::Llama& model, TrainerT& trainer, CountingLoader& loader, int64_t signal_at = 0) {
  int64_t calls = 0;
  return trainer.fit(loader, Loss{&model, &calls, signal_at});
}

void check_same_weights(memopt::models::Llama& expected, memopt::models::Llama& got) {
  const auto a = expected->named_parameters();
  const auto b = got->named_parameters();
  REQUIRE(a.size() == b.size());
  for (const auto& item : a) {
    INFO(item.key());
    CHECK(torch::equal(item.value(), b[item.key()]));
  }
}

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
  using T = memopt::Trainer<memopt::checkpoint::None, memopt::precision::Fp32, memopt::accum::None,
                            memopt::offload::Int8State>;
  check_resume_is_exact([](memopt::models::Llama& m, memopt::TrainerOptions o) {  // every moment 8-bit
    return T(*m, o, {}, memopt::offload::Int8State(memopt::optim::AdamW8bitOptions().min_8bit_size(0)));
  });
}

TEST_CASE("SIGTERM, checkpoint, resume latest: bit for bit (optimizer state on disk)", "[checkpoint]") {
  using T = memopt::Trainer<memopt::checkpoint::None, memopt::precision::Fp32, memopt::accum::None,
                            memopt::offload::Disk>;
  memopt::test::TempDir state_dir("memopt_disk_state");
  check_resume_is_exact([&](memopt::models::Llama& m, memopt::TrainerOptions o) {
    return T(*m, o, {}, memopt::offload::Disk(memopt::optim::DiskAdamWOptions().directory(state_dir.path.string())));
  });
}

TEST_CASE("SIGTERM, checkpoint, resume latest: bit for bit (bf16 weights, fp32 masters)", "[checkpoint]") {
  using T = memopt::Trainer<memopt::checkpoint::None, memopt::precision::Bf16Pure>;
  check_resume_is_exact([](memopt::models::Llama& m, memopt::TrainerOptions o) { return T(*m, o); });
}

TEST_CASE("SIGTERM, checkpoint, resume latest: bit for bit (bf16 autocast, checkpointed dropout, accum 2)",
          "[checkpoint]") {
  using T = memopt::Trainer<memopt::checkpoint::EveryBlock, memopt::precision::Bf16Autocast, memopt::accum::Fixed<2>>;
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

TEST_CASE("fit() restores the signal handlers it replaced, and SIGINT stops like SIGTERM", "[checkpoint][signals]") {
  struct sigaction before {};
  sigaction(SIGINT, nullptr, &before);
  torch::manual_seed(3);
  memopt::models::Llama model(tiny_config());
  memopt::Trainer<> trainer(*model, options());  // no checkpoint directory: stops without one
  CountingLoader loader;
  int64_t calls = 0;
  const auto result = trainer.fit(loader, Loss{&model, &calls, 2, SIGINT});
  CHECK(result.stop_signal == SIGINT);
  CHECK(result.steps == 2);
  CHECK(result.checkpoint.empty());
  struct sigaction after {};
  sigaction(SIGINT, nullptr, &after);
  CHECK(after.sa_handler == before.sa_handler);
  CHECK(std::string(memopt::signal_name(SIGINT)) == "SIGINT");
}

TEST_CASE("latest skips corrupt, truncated and half-written checkpoints, and a named one is refused", "[checkpoint]") {
  memopt::test::TempDir dir("memopt_checkpoint");
  const std::string root = dir.file("ckpt");
  write_steps(root, 4);
  memopt::io::CheckpointManager manager(root, 5);
  REQUIRE(manager.list().size() == 4);
  CHECK(manager.resolve("latest") == manager.path_of(4));

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

TEST_CASE("resume refuses other policies, options or run settings, naming each difference", "[checkpoint]") {
  memopt::test::TempDir dir("memopt_checkpoint");
  const std::string root = dir.file("ckpt");
  torch::manual_seed(1);
  memopt::models::Llama model(tiny_config());
  {
    memopt::Trainer<> trainer(*model, options(root).max_steps(2));
    trainer.set_run_config({{"layers", 2}, {"data", "brown"}});
    CountingLoader loader;
    fit(model, trainer, loader);
  }
  CountingLoader loader;
  {
    memopt::Trainer<> other(*model, options(root).lr(5e-3).grad_clip(0.5));
    other.set_run_config({{"layers", 3}, {"data", "brown"}});
    memopt::test::require_error([&] { other.resume("latest", loader); }, "memopt::Trainer::resume('latest')",
                                {"other settings", "lr: 0.01 in the checkpoint, 0.005 now",
                                 "grad_clip: 1.0 in the checkpoint, 0.5 now", "config.layers: 2 in the checkpoint, 3 now"});
  }
  {
    memopt::Trainer<memopt::checkpoint::EveryBlock> other(*model, options(root));
    memopt::test::require_error([&] { other.resume("latest", loader); }, "memopt::Trainer::resume('latest')",
                                {"Trainer<checkpoint::None", "this is Trainer<checkpoint::EveryBlock"});
  }
  {  // max_steps may change: a run is extended
    memopt::Trainer<> longer(*model, options(root).max_steps(3));
    longer.set_run_config({{"layers", 2}, {"data", "brown"}});
    CHECK(longer.resume("latest", loader));
    CHECK(fit(model, longer, loader).steps == 1);
  }
  CHECK(memopt::io::setting_differences({{"a", {{"b", 1}}}}, {{"a", {{"b", 2}}}, {"c", 3}}) ==
        std::vector<std::string>{"a.b: 1 in the checkpoint, 2 now", "c: \"(absent)\" in the checkpoint, 3 now"});
}

TEST_CASE("manifest.json: each malformed field is refused, naming it and the value", "[checkpoint]") {
  const std::string good_file = R"({"bytes": 10, "xxh3": "0123456789abcdef"})";
  const std::string files = R"({"model.safetensors": )" + good_file + R"(, "trainer.pt": )" + good_file +
                            R"(, "state.json": )" + good_file + "}";
  auto manifest = [&](const std::string& format, const std::string& version, const std::string& step,
                      const std::string& f) {
    return R"({"format": )" + format + R"(, "version": )" + version + R"(, "step": )" + step + R"(, "files": )" + f + "}";
  };
  const auto m = memopt::io::Manifest::parse(manifest(R"("memopt-checkpoint")", "2", "7", files), "m.json");
  CHECK(m.step == 7);
  CHECK(m.files.at("trainer.pt").bytes == 10);
  CHECK(memopt::io::Manifest::parse(m.dump(), "again").files == m.files);

  struct Case {
    std::string text;
    std::vector<std::string> parts;
  };
  const std::string fmt = R"("memopt-checkpoint")";
  const std::vector<Case> cases = {
      {"{\"format\": ", {"is not valid JSON"}},
      {"[1, 2]", {"must be a JSON object", "[1,2]"}},
      {R"({"version": 2})", {"\"format\" is missing"}},
      {manifest(R"("zip")", "2", "7", files), {"\"format\" is \"zip\"", "memopt-checkpoint"}},
      {manifest(fmt, "3", "7", files), {"\"version\" is 3", "reads version 2"}},
      {manifest(fmt, "2", "-1", files), {"\"step\" must be an integer >= 0", "(got -1)"}},
      {manifest(fmt, "2", "\"7\"", files), {"\"step\" must be an integer >= 0", "(got \"7\")"}},
      {manifest(fmt, "2", "7", "[]"), {"\"files\" must be an object", "(got [])"}},
      {manifest(fmt, "2", "7", R"({"model.safetensors": 5})"), {"\"model.safetensors\" must be an object", "(got 5)"}},
      {manifest(fmt, "2", "7", R"({"model.safetensors": {"xxh3": "0123456789abcdef"}})"), {"\"bytes\" is missing"}},
      {manifest(fmt, "2", "7", R"({"model.safetensors": {"bytes": -4, "xxh3": "0123456789abcdef"}})"),
       {"\"bytes\" must be an integer >= 0", "(got -4)"}},
      {manifest(fmt, "2", "7", R"({"model.safetensors": {"bytes": 4, "xxh3": "XYZ"}})"),
       {"\"xxh3\" must be 16 lowercase hex digits", "(got \"XYZ\")"}},
      {manifest(fmt, "2", "7", R"({"../x": )" + good_file + "}"), {"\"../x\" is not a plain file name"}},
      {manifest(fmt, "2", "7", R"({"trainer.pt\u0000x": )" + good_file + "}"), {"is not a plain file name"}},
      {manifest(fmt, "2", "7", R"({"model.safetensors": )" + good_file + "}"), {"does not list \"trainer.pt\""}},
  };
  for (const auto& c : cases) {
    INFO(c.text);
    memopt::test::require_error([&] { memopt::io::Manifest::parse(c.text, "ckpt/manifest.json"); },
                                "memopt::io: checkpoint manifest 'ckpt/manifest.json'", c.parts);
  }
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
  using T = memopt::Trainer<memopt::checkpoint::None, memopt::precision::Scaled<c10::kFloat>>;
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

TEST_CASE("RandomWindowLoader's state() continues its exact sequence, and another shape is refused", "[checkpoint][data]") {
  memopt::test::TempDir dir("memopt_checkpoint");
  std::vector<int32_t> tokens(500);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(i % 97);
  const std::string path = dir.file("train.bin");
  memopt::data::write_shard(path, tokens, 100);
  const auto shard = memopt::data::TokenShard::open(path);
  memopt::data::RandomWindowLoader a(shard, memopt::data::LoaderOptions(3, 16).seed(5));
  a.next();
  a.next();
  const auto state = a.state();
  memopt::data::RandomWindowLoader b(shard, memopt::data::LoaderOptions(3, 16).seed(5));
  b.load_state(state);
  CHECK(b.batches_drawn() == 2);
  CHECK(torch::equal(a.next().inputs, b.next().inputs));
  memopt::data::RandomWindowLoader other(shard, memopt::data::LoaderOptions(4, 16).seed(5));
  memopt::test::require_error([&] { other.load_state(state); }, "memopt::data: RandomWindowLoader::load_state",
                              {"\"batch_size\" is 3 in the checkpoint, 4 now"});
}

namespace {

/// (B, 129) batches from a formula: B = 8 whole, or its two halves of 4 in turn.
struct WideLoader {
  int64_t rows = 8;
  int64_t index = 0;
  memopt::Batch next() {
    const int64_t whole = rows == 8 ? index : index / 2;
    torch::Tensor tokens = (torch::arange(8 * 129, torch::kLong) * (whole + 5) + whole).remainder(kVocab).view({8, 129});
    if (rows == 4) tokens = tokens.narrow(0, index % 2 * 4, 4);
    ++index;
    return {tokens.narrow(1, 0, 128), tokens.narrow(1, 1, 128)};  // (B, 128)
  }
};

/// The largest forward/backward tracked peak of each step.
struct StepPeaks : memopt::Callback {
  std::vector<int64_t> peaks;
  std::vector<std::string> notices;
  void on_step_begin(int64_t) override { memopt::memory::Tracker::instance().reset_peaks(); }
  void on_step_end(const memopt::StepStats&) override {
    const auto s = memopt::memory::Tracker::instance().snapshot();
    peaks.push_back(std::max(s.phase_peak_bytes[1], s.phase_peak_bytes[2]));  // forward, backward
  }
  void on_notice(const std::string& text) override { notices.push_back(text); }
};

memopt::models::LlamaConfig wide_config() {
  return memopt::models::LlamaConfig().vocab_size(kVocab).hidden_size(32).num_hidden_layers(2).num_attention_heads(
      2).max_position_embeddings(128).dropout(0.1);
}

template <class TrainerT>
std::shared_ptr<StepPeaks> run_wide(memopt::models::Llama& model, TrainerT& trainer, int64_t rows) {
  auto peaks = std::make_shared<StepPeaks>();
  trainer.add_callback(peaks);
  WideLoader loader{rows};
  trainer.fit(loader, [&](const memopt::Batch& b, const auto& ckpt) { return model->loss_sum(b, ckpt); });
  return peaks;
}

}  // namespace

TEST_CASE("over memory_budget the Trainer halves the micro-batch: same effective batch, same weights", "[budget]") {
  REQUIRE(memopt::memory::Tracker::instance().installed());
  const auto opts = options().max_steps(3);
  // The reference: micro-batches of 4 and accumulation 2 from the start.
  torch::manual_seed(21);
  memopt::models::Llama halves(wide_config());
  memopt::Trainer<memopt::checkpoint::None, memopt::precision::Fp32, memopt::accum::Fixed<2>> halves_trainer(*halves,
                                                                                                           opts);
  const auto halves_peaks = run_wide(halves, halves_trainer, 4)->peaks;
  // Whole micro-batches of 8, no budget: a higher peak.
  torch::manual_seed(21);
  memopt::models::Llama whole(wide_config());
  memopt::Trainer<> whole_trainer(*whole, opts);
  const auto whole_peaks = run_wide(whole, whole_trainer, 8)->peaks;
  const int64_t budget = (halves_peaks[0] + whole_peaks[0]) / 2;
  INFO("peaks: halves " << halves_peaks[0] << " .. " << halves_peaks[2] << ", whole " << whole_peaks[0]);
  REQUIRE(*std::max_element(halves_peaks.begin(), halves_peaks.end()) < budget);  // halves fit at every step
  REQUIRE(whole_peaks[0] > budget);                                                // whole ones do not

  // Whole micro-batches under the budget: step 1 goes over, is redone as halves, and stays so.
  torch::manual_seed(21);
  memopt::models::Llama budgeted(wide_config());
  memopt::Trainer<> budgeted_trainer(*budgeted, memopt::TrainerOptions(opts).memory_budget(budget));
  const auto seen = run_wide(budgeted, budgeted_trainer, 8);
  CHECK(budgeted_trainer.micro_splits() == 2);
  REQUIRE(seen->notices.size() == 1);
  CHECK_THAT(seen->notices[0], Catch::Contains("step 1 went over the memory budget") &&
                                   Catch::Contains("micro-batches of 8 sequences are now run as 2 pieces of about 4"));
  for (int64_t peak : seen->peaks) CHECK(peak <= budget);
  CHECK(memopt::memory::Tracker::instance().limit() == 0);  // only while forward and backward run
  check_same_weights(halves, budgeted);  // dropout included: the redone step draws the halves' masks
}

TEST_CASE("a memory_budget below one sequence's need stops with the need named", "[budget]") {
  torch::manual_seed(22);
  memopt::models::Llama model(wide_config());
  const int64_t budget = memopt::memory::Tracker::instance().live_bytes() + 64 * 1024;  // weights + 64 KiB
  memopt::Trainer<> trainer(*model, options().max_steps(1).memory_budget(budget));
  WideLoader loader{8};
  memopt::test::require_error(
      [&] { trainer.fit(loader, [&](const memopt::Batch& b, const auto& c) { return model->loss_sum(b, c); }); },
      "memopt::Trainer: memory_budget", {"MiB is too small", "micro-batches of 1 sequence(s) needs at least",
                                         "over the limit of " + std::to_string(budget) + " bytes"});
  CHECK(trainer.micro_splits() == 8);
  CHECK(memopt::memory::Tracker::instance().limit() == 0);
  memopt::test::require_error([] { memopt::TrainerOptions().memory_budget(-1).validate(); },
                              "memopt::TrainerOptions", {"memory_budget must be >= 0 bytes (got -1)"});
}
