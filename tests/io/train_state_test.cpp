// Tests for memopt/io/train_state.hpp and Trainer::save_state/load_state: N steps, save,
// a fresh model and trainer, load, N more steps gives bit for bit the weights of 2N steps
// in one go (fp32 AdamW, 8-bit AdamW, Bf16Pure's masters); each error names the file or
// tensor with a HINT; the directory is replaced atomically. Also callbacks::MemoryMonitor.
#include <catch2/catch.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "support.hpp"

#include <memopt/callbacks.hpp>
#include <memopt/io/train_state.hpp>
#include <memopt/models/llama.hpp>
#include <memopt/trainer.hpp>

namespace fs = std::filesystem;

namespace {

constexpr int64_t kVocab = 50;

memopt::models::LlamaConfig tiny_config() {
  return memopt::models::LlamaConfig().vocab_size(kVocab).hidden_size(16).num_hidden_layers(2).num_attention_heads(
      2).max_position_embeddings(16);
}

/// Random (4, 8) batches from the global generator: a resumed run sees the same ones only if
/// the random state was restored.
struct RandomLoader {
  memopt::Batch next() {
    torch::Tensor tokens = torch::randint(kVocab, {4, 9}, torch::kLong);  // (B, T+1)
    return {tokens.narrow(1, 0, 8), tokens.narrow(1, 1, 8)};
  }
};

memopt::TrainerOptions options() { return memopt::TrainerOptions().lr(1e-2).warmup_steps(2).max_steps(20).threads(1); }

template <class TrainerT>
void train(memopt::models::Llama& model, TrainerT& trainer, int steps) {
  RandomLoader loader;
  for (int s = 0; s < steps; ++s)
    trainer.step(loader, [&](const memopt::Batch& b, const auto& ckpt) { return model->loss_sum(b, ckpt); });
}

/// Weights after 2N steps in one go, and after N steps, save, fresh model + trainer, load, N steps.
template <class MakeTrainer>
void check_resume_is_exact(MakeTrainer make_trainer) {
  constexpr int kN = 3;
  memopt::test::TempDir dir("memopt_train_state");
  const std::string path = dir.file("ckpt");

  torch::manual_seed(7);
  memopt::models::Llama straight(tiny_config());
  auto straight_trainer = make_trainer(straight);
  train(straight, straight_trainer, 2 * kN);

  torch::manual_seed(7);
  memopt::models::Llama first(tiny_config());
  auto first_trainer = make_trainer(first);
  train(first, first_trainer, kN);
  memopt::io::save_train_state(path, *first, first_trainer, {{"loader", "random"}});

  memopt::models::Llama resumed(tiny_config());  // a different init: the load must overwrite it
  auto resumed_trainer = make_trainer(resumed);
  const nlohmann::json meta = memopt::io::load_train_state(path, *resumed, resumed_trainer);
  CHECK(meta["loader"] == "random");
  CHECK(meta["step"] == kN);
  CHECK(meta["format"] == "memopt-train-state");
  CHECK(resumed_trainer.steps_taken() == kN);
  train(resumed, resumed_trainer, kN);

  const auto expected = straight->named_parameters();
  const auto got = resumed->named_parameters();
  REQUIRE(expected.size() == got.size());
  for (const auto& item : expected) {
    INFO(item.key());
    CHECK(torch::equal(item.value(), got[item.key()]));
  }
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

void require_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  memopt::test::require_error(fn, "memopt::io: load_train_state", parts);
}

}  // namespace

TEST_CASE("a resumed run matches an uninterrupted one bit for bit (fp32 AdamW)", "[train_state]") {
  using T = memopt::Trainer<>;
  check_resume_is_exact([](memopt::models::Llama& m) { return T(*m, options()); });
}

TEST_CASE("a resumed run matches an uninterrupted one bit for bit (8-bit AdamW)", "[train_state]") {
  using T = memopt::Trainer<memopt::checkpoint::None, memopt::precision::Fp32, memopt::accum::None,
                            memopt::offload::Int8State>;
  check_resume_is_exact([](memopt::models::Llama& m) {  // min_8bit_size(0): every moment 8-bit
    return T(*m, options(), {}, memopt::offload::Int8State(memopt::optim::AdamW8bitOptions().min_8bit_size(0)));
  });
}

TEST_CASE("a resumed run matches an uninterrupted one bit for bit (bf16 weights, fp32 masters)", "[train_state]") {
  using T = memopt::Trainer<memopt::checkpoint::None, memopt::precision::Bf16Pure>;
  check_resume_is_exact([](memopt::models::Llama& m) { return T(*m, options()); });
}

TEST_CASE("the loss scale is saved and restored", "[train_state]") {
  using T = memopt::Trainer<memopt::checkpoint::None, memopt::precision::Scaled<c10::kFloat>>;
  memopt::test::TempDir dir("memopt_train_state");
  torch::manual_seed(3);
  memopt::models::Llama model(tiny_config());
  T trainer(*model, options());
  train(model, trainer, 2);
  trainer.precision().scaler().load(1024.0, 5);
  memopt::io::save_train_state(dir.file("ckpt"), *model, trainer, {});

  memopt::models::Llama fresh(tiny_config());
  T fresh_trainer(*fresh, options());
  memopt::io::load_train_state(dir.file("ckpt"), *fresh, fresh_trainer);
  CHECK(fresh_trainer.precision().scaler().current_scale() == 1024.0);
  CHECK(fresh_trainer.precision().scaler().clean_steps() == 5);
  CHECK(fresh_trainer.steps_taken() == 2);
}

TEST_CASE("save_train_state replaces the directory atomically", "[train_state]") {
  memopt::test::TempDir dir("memopt_train_state");
  const std::string path = dir.file("ckpt");
  torch::manual_seed(1);
  memopt::models::Llama model(tiny_config());
  memopt::Trainer<> trainer(*model, options());

  memopt::io::save_train_state(path, *model, trainer, {{"run", "first"}});
  train(model, trainer, 1);
  memopt::io::save_train_state(path, *model, trainer, {{"run", "second"}});  // overwrites
  fs::create_directories(path + ".tmp");                                      // a stale one from a crash
  memopt::io::save_train_state(path + "/", *model, trainer, {{"run", "third"}});

  std::vector<std::string> entries;
  for (const auto& entry : fs::directory_iterator(dir.path)) entries.push_back(entry.path().filename().string());
  CHECK(entries == std::vector<std::string>{"ckpt"});  // no ckpt.tmp, no ckpt.old
  for (const char* name : {"model.safetensors", "trainer.pt", "meta.json"})
    CHECK(fs::is_regular_file(path + "/" + name));
  const auto meta = nlohmann::json::parse(read_text(path + "/meta.json"));
  CHECK(meta["run"] == "third");
  CHECK(meta["step"] == 1);
  CHECK(meta["version"] == 1);
}

TEST_CASE("load_train_state names the missing directory, the wrong format and a mismatched tensor", "[train_state]") {
  memopt::test::TempDir dir("memopt_train_state");
  const std::string path = dir.file("ckpt");
  torch::manual_seed(2);
  memopt::models::Llama model(tiny_config());
  memopt::Trainer<> trainer(*model, options());

  require_error([&] { memopt::io::load_train_state(dir.file("nowhere"), *model, trainer); },
                {"nowhere", "is not a directory"});

  memopt::io::save_train_state(path, *model, trainer, {});
  {  // a different shape: hidden 32 instead of 16
    memopt::models::Llama wider(tiny_config().hidden_size(32));
    memopt::Trainer<> wider_trainer(*wider, options());
    require_error([&] { memopt::io::load_train_state(path, *wider, wider_trainer); },
                  {"model.safetensors", "model.embed_tokens.weight", "[50, 16]", "[50, 32]"});
  }
  {  // a layer fewer: the file holds tensors the model lacks
    memopt::models::Llama shallow(tiny_config().num_hidden_layers(1));
    memopt::Trainer<> shallow_trainer(*shallow, options());
    require_error([&] { memopt::io::load_train_state(path, *shallow, shallow_trainer); },
                  {"model.layers.1.", "which the model lacks"});
  }

  auto meta = nlohmann::json::parse(read_text(path + "/meta.json"));
  meta["format"] = "something-else";
  std::ofstream(path + "/meta.json", std::ios::trunc) << meta.dump();
  require_error([&] { memopt::io::load_train_state(path, *model, trainer); },
                {"meta.json", "\"format\" \"something-else\"", "memopt-train-state"});

  fs::remove(path + "/trainer.pt");
  require_error([&] { memopt::io::load_train_state(path, *model, trainer); }, {"trainer.pt", "is missing"});
}

TEST_CASE("MemoryMonitor prints one line per step and keeps the last report", "[callbacks]") {
  REQUIRE(memopt::memory::Tracker::instance().installed());  // tests/main.cpp: memopt::init()
  torch::manual_seed(4);
  memopt::models::Llama model(tiny_config());
  memopt::Trainer<> trainer(*model, options());
  std::FILE* out = std::tmpfile();
  REQUIRE(out != nullptr);
  auto monitor = std::make_shared<memopt::callbacks::MemoryMonitor>(out);
  trainer.add_callback(monitor);
  train(model, trainer, 2);

  std::rewind(out);
  std::vector<std::string> lines;
  char buffer[512];
  while (std::fgets(buffer, sizeof buffer, out) != nullptr) lines.emplace_back(buffer);
  std::fclose(out);
  REQUIRE(lines.size() == 2);
  CHECK_THAT(lines[0], Catch::StartsWith("memory step 1 | live "));
  CHECK_THAT(lines[1], Catch::StartsWith("memory step 2 | live "));
  CHECK_THAT(lines[1], Catch::Contains("| forward ") && Catch::Contains("| optimizer ") && Catch::Contains("RSS "));
  CHECK(monitor->last().tracked);
  CHECK(monitor->last().tensors.peak_bytes > 0);
  CHECK(monitor->last().tensors.peak_bytes >= monitor->last().tensors.live_bytes);
}
