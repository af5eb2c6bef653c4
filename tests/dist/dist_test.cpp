// Tests for memopt/dist: run as two processes on loopback by tests/dist/dist_test.sh
// (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set; MEMOPT_TEST_DIR shared by both). Each rank
// trains the same tiny LLaMA on its half of every micro-batch and checks, against a
// single-process reference run on the whole batch (TrainerOptions::data_parallel(false)):
// the weights after N steps are identical on both ranks and equal (<= 1e-6) to the
// reference, the loss curve is the reference's, with and without a sharded optimizer state
// (broadcast and all-gather, AdamW, 8-bit AdamW, bf16 weights with fp32 masters), bf16
// autocast too; GradientSync's all-reduce and reduce-scatter sum what they should where they
// should; no collective runs on a non-final micro-step; a sharded rank holds half the
// optimizer state (give or take one tensor); a checkpoint written by both ranks resumes bit
// for bit; different model shapes are refused; callbacks run on every rank (reporters on rank 0);
// ranks whose finite data runs out at different steps stop together, with one checkpoint.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <memopt/data/loader.hpp>
#include <memopt/dist.hpp>
#include <memopt/memopt.hpp>

#include "support.hpp"

namespace {

using memopt::data::LoaderOptions;
using memopt::data::RandomWindowLoader;
using memopt::dist::RankSlice;

memopt::models::LlamaConfig tiny_config(int64_t dim = 32) {
  return memopt::models::LlamaConfig().vocab_size(64).hidden_size(dim).num_hidden_layers(2).num_attention_heads(4)
      .max_position_embeddings(32);
}

std::shared_ptr<const memopt::data::TokenShard> tokens() {
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

torch::Tensor flat_weights(memopt::models::Llama& model) {
  std::vector<torch::Tensor> parts;
  for (const auto& p : model->parameters()) parts.push_back(p.detach().to(torch::kFloat).reshape({-1}));
  return torch::cat(parts);
}

memopt::TrainerOptions base_options() {
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

// `steps` steps of the Trainer T on micro-batches of 4 rows (2 per rank when data parallel).
template <class T>
Run train(memopt::TrainerOptions options, int64_t steps, bool data_parallel) {
  auto& world = memopt::dist::world();
  torch::manual_seed(1);
  memopt::models::Llama model(tiny_config());
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
  run.weights = flat_weights(model);
  return run;
}

template <class T>
void check_against_reference(memopt::TrainerOptions options, double tolerance, double loss_tolerance = 1e-5) {
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

bool launched() {
  if (memopt::dist::world().size() == 2) return true;
  WARN("WORLD_SIZE is not 2: run through tests/dist/dist_test.sh");
  return false;
}

}  // namespace

using Fp32Trainer = memopt::Trainer<memopt::recompute::None, memopt::precision::Fp32, memopt::accum::Runtime>;

TEST_CASE("2 ranks train as one process on the global batch: weights and loss curve", "[dist]") {
  if (!launched()) return;
  SECTION("fp32 AdamW") { check_against_reference<Fp32Trainer>(base_options(), 1e-6); }
  SECTION("bf16 autocast, checkpointed blocks") {
    // bf16 matmuls over 2 rows and over 4 round differently (5e-5 relative in the loss), and
    // Adam's normalised steps carry that into the weights at lr scale: a looser bound.
    using T = memopt::Trainer<memopt::recompute::EveryBlock, memopt::precision::Bf16Autocast, memopt::accum::Runtime>;
    check_against_reference<T>(base_options(), 2e-2, 1e-4);
  }
}

TEST_CASE("A sharded optimizer state (ZeRO-1) trains the same and holds half the state", "[dist]") {
  if (!launched()) return;
  SECTION("AdamW, parameters shared by broadcast") {
    check_against_reference<Fp32Trainer>(base_options().shard_optimizer_state(true), 1e-6);
  }
  SECTION("AdamW, parameters shared by all-gather") {
    check_against_reference<Fp32Trainer>(
        base_options().shard_optimizer_state(true).param_gather(memopt::dist::ParamGather::kAllgather), 1e-6);
  }
  SECTION("8-bit AdamW: sharded equals unsharded on the same ranks") {
    // (Against one process the 8-bit state's rounding turns last-bit gradient differences into
    // a quantization step: the sharding itself must change nothing.) No clipping here: the
    // sharded global norm sums its parts in another order, and a last-bit change of the clip
    // factor flips 8-bit codes (1.3e-4 in the weights with LibTorch 2.15's MKL); the global-norm
    // clip is checked against one process in fp32 above.
    using T = memopt::Trainer<memopt::recompute::None, memopt::precision::Fp32, memopt::accum::Runtime,
                              memopt::state::Int8>;
    const Run whole = train<T>(base_options().grad_clip(0), 6, true);
    const Run sharded = train<T>(base_options().grad_clip(0).shard_optimizer_state(true), 6, true);
    const double diff = (whole.weights - sharded.weights).abs().max().item<double>();
    INFO("max |w_sharded - w_whole| = " << diff);
    CHECK(diff <= 1e-6);
    for (size_t s = 0; s < whole.losses.size(); ++s) CHECK(std::abs(whole.losses[s] - sharded.losses[s]) <= 1e-6);
  }
  SECTION("bf16 weights with fp32 masters: sharded equals unsharded on the same ranks") {
    // The clip norm is the global one: each rank's owned fp32 master gradients, summed over
    // the ranks (measured on the model's bf16 gradients it would miss the owned ones).
    using T = memopt::Trainer<memopt::recompute::None, memopt::precision::Bf16Pure, memopt::accum::Runtime>;
    const Run whole = train<T>(base_options(), 6, true);
    const Run sharded = train<T>(base_options().shard_optimizer_state(true), 6, true);
    const double diff = (whole.weights - sharded.weights).abs().max().item<double>();
    INFO("max |w_sharded - w_whole| = " << diff);
    CHECK(diff <= 1e-6);
    for (size_t s = 0; s < whole.losses.size(); ++s) CHECK(std::abs(whole.losses[s] - sharded.losses[s]) <= 1e-6);
  }
  SECTION("state bytes per rank") {
    const Run whole = train<Fp32Trainer>(base_options(), 1, true);
    const Run sharded = train<Fp32Trainer>(base_options().shard_optimizer_state(true), 1, true);
    torch::manual_seed(1);
    memopt::models::Llama model(tiny_config());
    std::vector<torch::Tensor> params;
    for (const auto& p : model->parameters()) params.push_back(p);
    const auto owner = memopt::dist::owners(params, 2);
    int64_t owned = 0, total = 0;
    for (size_t i = 0; i < params.size(); ++i) {
      total += params[i].numel();
      if (owner[i] == memopt::dist::world().rank()) owned += params[i].numel();
    }
    INFO("rank " << memopt::dist::world().rank() << ": unsharded " << whole.state_bytes << " B, sharded " << sharded.state_bytes << " B, owned " << owned << " of "
                      << total);
    CHECK(whole.state_bytes == 8 * total);  // exp_avg + exp_avg_sq, fp32
    CHECK(sharded.state_bytes == 8 * owned);
    int64_t largest = 0;
    for (const auto& p : params) largest = std::max(largest, p.numel());
    CHECK(std::abs(2 * owned - total) <= largest);  // largest first: the shares differ by at most one tensor
    CHECK(std::abs(static_cast<double>(owned) / static_cast<double>(total) - 0.5) < 0.02);
  }
}

TEST_CASE("GradientSync sums onto every rank, or onto each tensor's owner", "[dist]") {
  if (!launched()) return;
  auto& world = memopt::dist::world();
  const int rank = world.rank();
  const std::vector<int64_t> sizes{5, 3, 8, 1, 4, 2};
  const auto make = [&] {  // rank r's gradient of tensor i: (r + 1) * (i + 1) + arange; tensor 3 has none on rank 1
    std::vector<torch::Tensor> params;
    for (size_t i = 0; i < sizes.size(); ++i) {
      params.push_back(torch::zeros({sizes[i]}, torch::requires_grad()));
      if (i == 3 && rank == 1) continue;
      params.back().mutable_grad() = torch::arange(sizes[i], torch::kFloat) + static_cast<double>((rank + 1) * (i + 1));
    }
    return params;
  };
  const auto expected = [&](size_t i) {  // the sum over both ranks
    torch::Tensor sum = 2 * torch::arange(sizes[i], torch::kFloat) + 3.0 * static_cast<double>(i + 1);
    return i == 3 ? sum - 2.0 * static_cast<double>(i + 1) : sum;  // rank 1's counts as zero
  };
  const auto owner = memopt::dist::owners(make(), 2);
  CHECK(owner == std::vector<int>{1, 0, 0, 0, 1, 1});  // 8 → 0, 5 → 1, 4 → 1, 3 → 0, 2 → 1, 1 → 0: 12 vs 11
  for (const int64_t bucket_bytes : {int64_t{1} << 20, int64_t{16}}) {  // one bucket; buckets one rank owns wholly
    for (const bool scatter : {false, true}) {
      INFO("bucket_bytes " << bucket_bytes << ", reduce-scatter " << scatter);
      auto params = make();
      memopt::dist::GradientSync sync(world, params, bucket_bytes, scatter ? owner : std::vector<int>{});
      torch::Tensor loss = torch::scalar_tensor(rank + 1.0), signal = torch::scalar_tensor(rank == 1 ? 1.0 : 0.0);
      const int64_t before = world.collectives();
      sync.sync({loss, signal});
      CHECK(world.collectives() - before == sync.buckets());
      CHECK((bucket_bytes == 16 ? sync.buckets() > 3 : sync.buckets() == 1));
      CHECK(loss.item<double>() == 3.0);
      CHECK(signal.item<double>() == 1.0);
      for (size_t i = 0; i < sizes.size(); ++i) {
        INFO("tensor " << i);
        if (scatter && owner[i] != rank) {
          CHECK(!params[i].grad().defined());  // freed: its owner holds the sum
        } else {
          REQUIRE(params[i].grad().defined());
          CHECK(torch::equal(params[i].grad(), expected(i)));
        }
      }
    }
  }
}

TEST_CASE("No collective runs on a non-final micro-step", "[dist]") {
  if (!launched()) return;
  auto& world = memopt::dist::world();
  for (const bool sharded : {false, true}) {
    INFO("sharded " << sharded);
    torch::manual_seed(1);
    memopt::models::Llama model(tiny_config());
    RandomWindowLoader global(tokens(), LoaderOptions(4, 16).seed(7));
    RankSlice<RandomWindowLoader> slice(global, world.rank(), world.size());
    memopt::Trainer<memopt::recompute::None, memopt::precision::Fp32, memopt::accum::Fixed<4>> trainer(
        *model, base_options().accum_steps(4).shard_optimizer_state(sharded).bucket_mib(1));
    std::vector<int64_t> seen;  // collectives() at each micro-step's forward
    auto loss = [&](const memopt::Batch& batch, const memopt::recompute::None& ckpt) {
      seen.push_back(world.collectives());
      return model->loss_sum(batch, ckpt);
    };
    for (int step = 0; step < 2; ++step) {
      seen.clear();
      const int64_t before = world.collectives();
      trainer.step(slice, loss);
      REQUIRE(seen.size() == 4);
      for (int64_t c : seen) CHECK(c == before + 1);  // only the target count, before the first forward
      const int64_t expected = sharded ? 1 + 1 + 1 + world.size()  // count, one bucket, norm, share
                                       : 1 + 1;                     // count, one bucket
      CHECK(world.collectives() - before == expected);
    }
  }
}

TEST_CASE("A checkpoint written by both ranks resumes bit for bit", "[dist]") {
  if (!launched()) return;
  const char* dir = std::getenv("MEMOPT_TEST_DIR");
  REQUIRE(dir != nullptr);
  for (const bool sharded : {false, true}) {
    const std::string ckpt = std::string(dir) + (sharded ? "/sharded" : "/plain");
    auto options = base_options().shard_optimizer_state(sharded).checkpoint_dir(ckpt).save_every(3).max_steps(6);
    auto run = [&](bool resume) {
      torch::manual_seed(1);
      memopt::models::Llama model(tiny_config());
      RandomWindowLoader global(tokens(), LoaderOptions(4, 16).seed(7));
      RankSlice<RandomWindowLoader> slice(global, memopt::dist::world().rank(), memopt::dist::world().size());
      Fp32Trainer trainer(*model, options);
      if (resume) REQUIRE(trainer.resume(ckpt + "/step-00000003", slice));
      trainer.fit(slice, memopt::LossSum<memopt::models::Llama>{&model});
      return flat_weights(model);
    };
    const torch::Tensor straight = run(false);
    CHECK(std::filesystem::exists(ckpt + "/step-00000003/manifest.json"));
    CHECK(std::filesystem::exists(ckpt + "/step-00000003/trainer-rank1.pt") == sharded);
    const torch::Tensor resumed = run(true);
    CHECK(torch::equal(straight, resumed));
  }
}

TEST_CASE("Different model shapes on the ranks are an error naming the rank", "[dist]") {
  if (!launched()) return;
  torch::manual_seed(1);
  memopt::models::Llama model(tiny_config(memopt::dist::world().rank() == 0 ? 32 : 64));
  memopt::test::require_error([&] { Fp32Trainer trainer(*model, base_options()); }, "memopt::dist",
                              {"rank 1's model shapes differ from rank 0's", "same model"});
}

TEST_CASE("Callbacks run on every rank, reporters on rank 0 only", "[dist]") {
  if (!launched()) return;
  auto& world = memopt::dist::world();
  struct Count : memopt::Callback {
    int64_t ends = 0;
    void on_step_end(const memopt::StepStats& /*stats*/) override { ++ends; }
  };
  struct Reporter : Count {
    bool main_rank_only() const override { return true; }
  };
  torch::manual_seed(1);
  memopt::models::Llama model(tiny_config());
  RandomWindowLoader global(tokens(), LoaderOptions(4, 16).seed(7));
  RankSlice<RandomWindowLoader> slice(global, world.rank(), world.size());
  Fp32Trainer trainer(*model, base_options().max_steps(3));
  auto count = std::make_shared<Count>();
  auto reporter = std::make_shared<Reporter>();
  auto release = std::make_shared<memopt::callbacks::ReleaseCache>(1);
  trainer.add_callback(count).add_callback(reporter).add_callback(release);
  trainer.fit(slice, memopt::LossSum<memopt::models::Llama>{&model});
  INFO("rank " << world.rank());
  CHECK(count->ends == 3);
  CHECK(release->releases() == 3);  // frees memory on rank 1 too
  CHECK(reporter->ends == (world.rank() == 0 ? 3 : 0));
}

namespace {
// `left` micro-batches, then none: a FiniteSource, like a stream of documents dealt by rank.
struct FiniteLoader {
  RandomWindowLoader inner;
  int64_t left;
  memopt::Batch next() {
    --left;
    return inner.next();
  }
  bool has_next(int64_t n) const { return left >= n; }
};
}  // namespace

TEST_CASE("Ranks whose data runs out at different steps stop together, with one final checkpoint", "[dist]") {
  if (!launched()) return;
  auto& world = memopt::dist::world();
  const char* dir = std::getenv("MEMOPT_TEST_DIR");
  REQUIRE(dir != nullptr);
  const std::string ckpt = std::string(dir) + "/uneven";
  torch::manual_seed(1);
  memopt::models::Llama model(tiny_config());
  // Rank 0 could fill 6 steps of 2 micro-batches, rank 1 only 2 (5 micro-batches).
  FiniteLoader loader{RandomWindowLoader(tokens(), LoaderOptions(2, 16).seed(7 + world.rank())),
                      world.rank() == 0 ? 12 : 5};
  Fp32Trainer trainer(*model, base_options().max_steps(100).checkpoint_dir(ckpt));
  const memopt::FitResult result = trainer.fit(loader, memopt::LossSum<memopt::models::Llama>{&model});
  INFO("rank " << world.rank());
  CHECK(result.steps == 2);
  CHECK(result.data_exhausted);
  CHECK(trainer.steps_taken() == 2);
  world.barrier("test: both ranks done");
  std::vector<std::string> saved;
  for (const auto& entry : std::filesystem::directory_iterator(ckpt))
    if (entry.path().filename().string().rfind("step-", 0) == 0) saved.push_back(entry.path().filename().string());
  CHECK(saved == std::vector<std::string>{"step-00000002"});
  const auto all = world.all_gather(flat_weights(model), "test: weights");
  CHECK(torch::equal(all[0], all[1]));  // the same weights: every step was taken by both ranks
}
