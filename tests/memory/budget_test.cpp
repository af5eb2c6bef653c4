// tests/memory/budget_test.cpp — memopt/memory/budget.hpp: over memory_budget the Trainer halves
// the micro-batch (the same effective batch, the same weights, dropout included), and a budget
// below one sequence's need stops with the need named.
#include <catch2/catch.hpp>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <memopt/callbacks.hpp>
#include <memopt/memory/budget.hpp>
#include <memopt/memory/tracker.hpp>
#include <memopt/models/llama.hpp>
#include <memopt/trainer.hpp>

#include "io/fixtures.hpp"
#include "support.hpp"

using namespace memopt::test::io;  // NOLINT: the fixtures of the checkpoint tests

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
  memopt::Trainer<memopt::recompute::None, memopt::precision::Fp32, memopt::accum::Fixed<2>> halves_trainer(*halves,
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
