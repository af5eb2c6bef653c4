// tests/dist/fixtures.hpp — what the 2-rank tests of memopt/dist share (they run as two
// processes on loopback, started by tests/dist/dist_test.sh): a tiny LLaMA and a learnable
// token stream, the Trainer options they train with, a run of N steps on this rank's half of
// every micro-batch (or on the whole batch in one process, TrainerOptions::data_parallel(false)),
// and the check that the data-parallel run matches that single-process reference.
#pragma once

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include <torch/torch.h>

#include <memopt/data/loader.hpp>
#include <memopt/dist.hpp>
#include <memopt/memopt.hpp>

namespace memopt::test::dist {

using memopt::data::LoaderOptions;
using memopt::data::RandomWindowLoader;
using memopt::dist::RankSlice;

inline memopt::models::LlamaConfig tiny_config(int64_t dim = 32) {
  return memopt::models::LlamaConfig().vocab_size(64).hidden_size(dim).num_hidden_layers(2).num_attention_heads(4)
      .max_position_embeddings(32);
}

inline std::shared_ptr<const memopt::data::TokenShard> tokens() {
  // A learnable stream: each id follows from the last, one in eight is noise.
  std::vector<int32_t> ids(6000);
  uint64_t x = 12345;
  int32_t last = 0;
  for (auto& id : ids) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    id = last = (x >> 61) == 0 ? static_cast<int32_t>((x >> 33) % 64) : (last * 5 + 3) % 64;
  }
  return memopt::data::TokenShard::from_tokens("dist_test", ids, 64);
}

inline torch::Tensor flat_weights(memopt::models::Llama& model) {
  std::vector<torch::Tensor> parts;
  for (const auto& p : model->parameters()) parts.push_back(p.detach().to(torch::kCPU, torch::kFloat).reshape({-1}));
  return torch::cat(parts);
}

inline memopt::TrainerOptions base_options() {
  // eps 1e-6: Adam's first step divides by |g| + eps, which turns last-bit differences in
  // near-zero gradients (2-row vs 4-row matmuls) into lr-sized ones at eps 1e-8.
  return memopt::TrainerOptions().lr(3e-3).eps(1e-6).warmup_steps(1).max_steps(6).accum_steps(2).handle_signals(false)
      .log_interval(1000);
}

struct Run {
  torch::Tensor weights;
  std::vector<double> losses;
  int64_t state_bytes = 0;  // bytes of the AdamW state (exp_avg, exp_avg_sq) this rank holds
};

// `steps` steps of the Trainer T on micro-batches of 4 rows (2 per rank when data parallel), the
// model on `device`.
template <class T>
inline Run train(memopt::TrainerOptions options, int64_t steps, bool data_parallel,
                 const memopt::models::LlamaConfig& config = tiny_config(), torch::Device device = torch::kCPU) {
  auto& world = memopt::dist::world();
  torch::manual_seed(1);
  memopt::models::Llama model(config);
  model->to(device);
  RandomWindowLoader global(tokens(), LoaderOptions(4, 16).seed(7));
  RankSlice<RandomWindowLoader> slice(global, world.rank(), world.size());
  T trainer(*model, options.data_parallel(data_parallel));
  Run run;
  for (int64_t s = 0; s < steps; ++s) {
    const auto stats = data_parallel ? trainer.step(slice, memopt::LossSum<memopt::models::Llama>{&model})
                                     : trainer.step(global, memopt::LossSum<memopt::models::Llama>{&model});
    run.losses.push_back(stats.loss.template item<double>());
  }
  for (const auto& [key, state] : trainer.optimizer().state()) {
    if (const auto* adamw = dynamic_cast<const torch::optim::AdamWParamState*>(state.get()))
      run.state_bytes += static_cast<int64_t>(adamw->exp_avg().nbytes() + adamw->exp_avg_sq().nbytes());
  }
  trainer.with_full_weights([&] { run.weights = flat_weights(model); });  // ZeRO-3: gathered
  return run;
}

template <class T>
inline void check_against_reference(memopt::TrainerOptions options, double tolerance, double loss_tolerance = 1e-5) {
  auto& world = memopt::dist::world();
  const Run dp = train<T>(options, 6, true);
  const Run ref = train<T>(options, 6, false);
  // identical on both ranks
  const auto all = world.all_gather(dp.weights, "test: weights");
  CHECK(torch::equal(all[0], all[1]));
  // equal to one process with the same global batch
  const double diff = (dp.weights - ref.weights).abs().max().item<double>();
  INFO("max |w_dp - w_ref| = " << diff);
  CHECK(diff <= tolerance);
  REQUIRE(dp.losses.size() == ref.losses.size());
  for (size_t s = 0; s < dp.losses.size(); ++s) {
    INFO("step " << s + 1 << ": " << dp.losses[s] << " vs " << ref.losses[s]);
    CHECK(std::abs(dp.losses[s] - ref.losses[s]) <= loss_tolerance * std::abs(ref.losses[s]));
  }
  CHECK(dp.losses.back() < dp.losses.front());
}

inline bool launched() {
  if (memopt::dist::world().size() == 2) return true;
  WARN("WORLD_SIZE is not 2: run through tests/dist/dist_test.sh");
  return false;
}

using Fp32Trainer = memopt::Trainer<memopt::recompute::None, memopt::precision::Fp32, memopt::accum::Runtime>;

}  // namespace memopt::test::dist
