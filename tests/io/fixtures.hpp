// tests/io/fixtures.hpp — what the checkpoint, training-state, signal and memory-budget tests
// share: a tiny LLaMA with dropout, a resumable loader of formula batches, the options of a
// 6-step run, a loss that raises a signal at a given step, and a weights comparison.
#pragma once

#include <csignal>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <memopt/io/hf_config.hpp>
#include <memopt/models/llama.hpp>
#include <memopt/trainer.hpp>

#include "support.hpp"

namespace memopt::test::io {

/// memopt::test::require_error with the io components' prefix, "memopt::io:".
inline void require_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  memopt::test::require_error(fn, "memopt::io:", parts);
}

inline constexpr int64_t kVocab = 50;

inline memopt::models::LlamaConfig tiny_config() {
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

inline memopt::TrainerOptions options(const std::string& dir = "") {
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

inline void check_same_weights(memopt::models::Llama& expected, memopt::models::Llama& got) {
  const auto a = expected->named_parameters();
  const auto b = got->named_parameters();
  REQUIRE(a.size() == b.size());
  for (const auto& item : a) {
    INFO(item.key());
    CHECK(torch::equal(item.value(), b[item.key()]));
  }
}

/// The tiny HF-style LlamaConfig of the config.json and pretrained tests (GQA, rope_theta 5e5).
inline memopt::models::LlamaConfig hf_config() {
  return memopt::models::LlamaConfig()
      .vocab_size(64)
      .hidden_size(32)
      .num_hidden_layers(2)
      .num_attention_heads(4)
      .num_key_value_heads(2)
      .intermediate_size(48)
      .max_position_embeddings(16)
      .rope_theta(500000.0)
      .rms_norm_eps(1e-6);
}

/// dir/config.json with `edit` applied to hf_config()'s JSON.
inline void write_config(const TempDir& dir, const std::function<void(nlohmann::json&)>& edit) {
  auto json = memopt::io::to_json(hf_config());
  edit(json);
  memopt::test::write_text(dir.file("config.json"), json.dump(2));
}

}  // namespace memopt::test::io
