// tests/dist/zero3_test.cpp — memopt/dist/zero3.hpp's Zero3 (TrainerOptions::shard_params) on
// the ranks tests/dist/dist_test.sh starts (2, or 3 for "[zero3-3]"): against one process on
// the global batch the weights after 6 steps agree to 1e-6 (fp32, with and without
// checkpointed blocks, accumulation and clipping); with dropout, and with bf16 weights and fp32
// masters, ZeRO-3 equals plain data parallel on the same ranks; between steps each of the
// model's parameters holds one element and each rank keeps 1/world of the elements as optimizer
// parameters and state; the collectives per block and micro-batch are counted; a checkpoint
// resumes bit for bit; state::Disk steps the shards as AdamW does, state::Int8 trains; the model
// is whole after fit(); keep_gathered gives the same weights with one all-gather per block and
// step; the estimator's per-rank peak for ZeRO-3,
// ZeRO-1 and plain data parallel is within 10% of the tracker's; a block run outside run_block
// is named. In a world of one ("[zero3-1]", a process alone): shards offloaded to a file, or
// (CUDA) a GPU model's shards in pinned host memory with the optimizer on the CPU, train as the
// Trainer without ZeRO-3, and a checkpoint resumes bit for bit; host offload of a CPU model is
// refused.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <map>
#include <utility>
#include <string>
#include <thread>
#include <vector>

#include <torch/torch.h>

#include <memopt/data/loader.hpp>
#include <memopt/dist.hpp>
#include <memopt/memopt.hpp>
#include <memopt/memory/estimator.hpp>
#include <memopt/memory/report.hpp>

#include "dist/fixtures.hpp"
#include "support.hpp"

using namespace memopt::test::dist;  // dist/fixtures.hpp: base_options(), train(), Fp32Trainer, ...

namespace {

using EveryBlockTrainer = memopt::Trainer<memopt::recompute::EveryBlock, memopt::precision::Fp32, memopt::accum::Runtime>;

memopt::TrainerOptions zero3_options() { return base_options().shard_params(true).param_persistence_threshold(0); }

// A tiny LLaMA seeded as train() seeds it, this rank's slice of its batches and its loss: what
// the cases that drive one Trainer themselves share.
struct TinyJob {
  explicit TinyJob(const memopt::models::LlamaConfig& config = tiny_config()) : model(seeded(config)) {}
  TinyJob(const TinyJob&) = delete;
  TinyJob& operator=(const TinyJob&) = delete;

  memopt::models::Llama model;
  RandomWindowLoader global{tokens(), LoaderOptions(4, 16).seed(7)};
  RankSlice<RandomWindowLoader> slice{global, memopt::dist::world().rank(), memopt::dist::world().size()};
  memopt::LossSum<memopt::models::Llama> loss{&model};

 private:
  static memopt::models::Llama seeded(const memopt::models::LlamaConfig& config) {
    torch::manual_seed(1);
    return memopt::models::Llama(config);
  }
};

// Whether every parameter of `model` is a placeholder of one fp32 element (ZeRO-3 between uses).
bool holds_placeholders(torch::nn::Module& model) {
  int64_t bytes = 0, tensors = 0;
  for (const auto& p : model.parameters()) bytes += static_cast<int64_t>(p.storage().nbytes()), ++tensors;
  return bytes == 4 * tensors;
}

// The collectives of one step of a TinyJob under `options`; the model holds placeholders after it.
int64_t step_collectives(memopt::TrainerOptions options) {
  auto& world = memopt::dist::world();
  TinyJob job;
  EveryBlockTrainer trainer(*job.model, options.param_specific_decay(false));
  const int64_t before = world.collectives();
  trainer.step(job.slice, job.loss);
  const int64_t count = world.collectives() - before;
  CHECK(holds_placeholders(*job.model));  // released when the step's gradients were synced
  return count;
}

bool zero3_ranks(int n) {
  if (memopt::dist::world().size() == n) return true;
  WARN("WORLD_SIZE is not " << n << ": run through tests/dist/dist_test.sh");
  return false;
}

// The ZeRO-3 run equals one process on the whole batch (the ranks' weights identical).
template <class T>
void zero3_matches_one_process(memopt::TrainerOptions options) {
  const Run sharded = train<T>(options, 6, true);
  const Run ref = train<T>(options, 6, false);
  const auto all = memopt::dist::world().all_gather(sharded.weights, "test: weights");
  for (const auto& w : all) CHECK(torch::equal(w, all.front()));
  const double diff = (sharded.weights - ref.weights).abs().max().item<double>();
  INFO("max |w_zero3 - w_one_process| = " << diff);
  CHECK(diff <= 1e-6);
  for (size_t s = 0; s < ref.losses.size(); ++s) CHECK(std::abs(sharded.losses[s] - ref.losses[s]) <= 1e-5 * ref.losses[s]);
  CHECK(sharded.losses.back() < sharded.losses.front());
}

void zero3_trains_as_one_process() {
  SECTION("fp32, blocks not recomputed by the policy, clipped") {
    zero3_matches_one_process<Fp32Trainer>(zero3_options().grad_clip(0.5));
  }
  SECTION("fp32, checkpointed blocks") { zero3_matches_one_process<EveryBlockTrainer>(zero3_options()); }
  SECTION("fp32, norms below the persistence threshold (ZeRO-1 for them)") {
    zero3_matches_one_process<EveryBlockTrainer>(zero3_options().param_persistence_threshold(100));
  }
}

}  // namespace

TEST_CASE("ZeRO-3 on 2 ranks trains as one process on the global batch", "[dist]") {
  if (!zero3_ranks(2)) return;
  zero3_trains_as_one_process();
}

TEST_CASE("ZeRO-3 on 3 ranks trains as one process on the global batch", "[zero3-3]") {
  if (!zero3_ranks(3)) return;
  zero3_trains_as_one_process();
}

TEST_CASE("ZeRO-3 changes nothing but memory: dropout, bf16 with fp32 masters", "[dist]") {
  if (!zero3_ranks(2)) return;
  SECTION("dropout 0.1, checkpointed blocks: equal to plain data parallel on the same ranks") {
    const auto config = tiny_config().dropout(0.1);
    const Run plain = train<EveryBlockTrainer>(base_options(), 6, true, config);
    const Run sharded = train<EveryBlockTrainer>(zero3_options(), 6, true, config);
    const double diff = (plain.weights - sharded.weights).abs().max().item<double>();
    INFO("max |w_zero3 - w_ddp| = " << diff);
    CHECK(diff <= 1e-6);
  }
  SECTION("Bf16Pure: equal to ZeRO-1 on the same ranks") {
    // One micro-batch and no clipping: the bf16 gradient of each element is the same rounding
    // of the same fp32 sum either way, and nothing else differs.
    using T = memopt::Trainer<memopt::recompute::None, memopt::precision::Bf16Pure, memopt::accum::Runtime>;
    const auto options = base_options().accum_steps(1).grad_clip(0);
    const Run zero1 = train<T>(memopt::TrainerOptions(options).shard_optimizer_state(true), 6, true);
    const Run zero3 = train<T>(memopt::TrainerOptions(options).shard_params(true).param_persistence_threshold(0), 6, true);
    const double diff = (zero1.weights - zero3.weights).abs().max().item<double>();
    INFO("max |w_zero3 - w_zero1| = " << diff);
    CHECK(diff <= 1e-6);
  }
}

TEST_CASE("ZeRO-3 steps its shards with any optimizer-state policy", "[dist]") {
  if (!zero3_ranks(2)) return;
  SECTION("state::Disk: the same weights as AdamW in memory") {
    using T = memopt::Trainer<memopt::recompute::EveryBlock, memopt::precision::Fp32, memopt::accum::Runtime,
                              memopt::state::Disk>;
    const Run memory = train<EveryBlockTrainer>(zero3_options(), 6, true);
    const Run disk = train<T>(zero3_options(), 6, true);
    const double diff = (memory.weights - disk.weights).abs().max().item<double>();
    INFO("max |w_disk - w_memory| = " << diff);
    CHECK(diff <= 1e-6);
  }
  SECTION("state::Int8: trains, the ranks agree (block-wise codes over flat shards: not DDP's blocks)") {
    using T = memopt::Trainer<memopt::recompute::EveryBlock, memopt::precision::Fp32, memopt::accum::Runtime,
                              memopt::state::Int8>;
    const Run int8 = train<T>(zero3_options(), 6, true);
    const auto all = memopt::dist::world().all_gather(int8.weights, "test: int8 weights");
    CHECK(torch::equal(all[0], all[1]));
    CHECK(int8.losses.back() < int8.losses.front());
  }
}

TEST_CASE("ZeRO-3 holds 1/world of the parameters and state per rank", "[dist]") {
  if (!zero3_ranks(2)) return;
  auto& world = memopt::dist::world();
  TinyJob job;
  auto& model = job.model;
  int64_t total = 0;
  for (const auto& p : model->parameters()) total += p.numel();
  EveryBlockTrainer trainer(*model, zero3_options().param_specific_decay(false));
  trainer.step(job.slice, job.loss);

  CHECK(holds_placeholders(*model));  // the model's parameters between steps
  int64_t shard_elements = 0, state_bytes = 0, flats = 0;
  for (const auto& group : trainer.optimizer().param_groups())
    for (const auto& p : group.params()) shard_elements += p.numel(), ++flats;
  for (const auto& [key, state] : trainer.optimizer().state())
    if (const auto* adamw = dynamic_cast<const torch::optim::AdamWParamState*>(state.get()))
      state_bytes += static_cast<int64_t>(adamw->exp_avg().nbytes() + adamw->exp_avg_sq().nbytes());
  INFO("rank " << world.rank() << ": " << shard_elements << " of " << total << " elements in " << flats << " shards");
  CHECK(flats == 3);  // 2 blocks + the root, one optimizer group
  CHECK(shard_elements * 2 >= total);
  CHECK(shard_elements * 2 - total < 2 * flats);  // padding: under one element per rank and flat
  CHECK(state_bytes == 8 * shard_elements);       // exp_avg + exp_avg_sq of the shards only
}

TEST_CASE("ZeRO-3 with its parameter shards offloaded to a file trains the same", "[dist]") {
  if (!zero3_ranks(2)) return;
  auto& world = memopt::dist::world();
  const char* dir = std::getenv("MEMOPT_TEST_DIR");
  REQUIRE(dir != nullptr);
  const std::string offload = std::string(dir) + "/offload";
  SECTION("fp32 and Bf16Pure: equal to the shards in memory") {
    const Run memory = train<EveryBlockTrainer>(zero3_options(), 6, true);
    const Run disk = train<EveryBlockTrainer>(zero3_options().offload_params_dir(offload), 6, true);
    CHECK(torch::equal(memory.weights, disk.weights));
    using T = memopt::Trainer<memopt::recompute::None, memopt::precision::Bf16Pure, memopt::accum::Runtime>;
    const Run pure_memory = train<T>(zero3_options(), 6, true);
    const Run pure_disk = train<T>(zero3_options().offload_params_dir(offload), 6, true);
    CHECK(torch::equal(pure_memory.weights, pure_disk.weights));
    CHECK_FALSE(std::filesystem::exists(offload + "/params-rank" + std::to_string(world.rank()) + ".bin"));  // removed
  }
  SECTION("the shards leave the tracked memory for the file") {
    auto& tracker = memopt::memory::Tracker::instance();
    const auto held = [&](const std::string& to) {  // live bytes after a step, and the file's size
      const int64_t before = tracker.live_bytes();
      TinyJob job;
      EveryBlockTrainer trainer(*job.model, zero3_options().param_specific_decay(false).offload_params_dir(to));
      trainer.step(job.slice, job.loss);
      // Gloo's worker threads drop their last work objects (which hold a collective's buffers) a
      // moment after it completes: after a barrier, read until two readings 100 ms apart agree.
      world.barrier();
      int64_t live = tracker.live_bytes();
      for (int i = 0; i < 30; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        const int64_t now = tracker.live_bytes();
        if (now == live) break;
        live = now;
      }
      const std::string file = to + "/params-rank" + std::to_string(world.rank()) + ".bin";
      const auto size = to.empty() ? 0 : static_cast<int64_t>(std::filesystem::file_size(file));
      return std::pair{live - before, size};
    };
    held("");  // what a first run creates once (caches) is not the shards'
    const auto [in_memory, none] = held("");
    const auto [offloaded, file_bytes] = held(offload);
    memopt::models::Llama shape(tiny_config());
    int64_t shard_elements = 0, blocks = 0, total = 0;  // 3 flats (2 blocks, root), each padded to the ranks
    for (const auto& p : shape->parameters()) total += p.numel();
    for (const auto& layer : *shape->model->layers) {
      int64_t n = 0;
      for (const auto& p : layer->parameters()) n += p.numel();
      shard_elements += (n + 1) / 2;
      blocks += n;
    }
    shard_elements += (total - blocks + 1) / 2;
    INFO("tracked after a step: " << in_memory << " B in memory, " << offloaded << " B offloaded; file " << file_bytes);
    CHECK(in_memory - offloaded == 4 * shard_elements);
    CHECK(file_bytes >= 4 * shard_elements);
    CHECK(file_bytes < 4 * shard_elements + 3 * memopt::dist::ShardFile::kPage);
  }
  memopt::test::require_error([] { memopt::TrainerOptions().offload_params_dir("x").validate(); },
                              "memopt::TrainerOptions", {"offload_params_dir 'x'", "shard_params", "HINT"});
}

TEST_CASE("ZeRO-3 collectives: two gathers and a reduce-scatter per block and micro-batch", "[dist]") {
  if (!zero3_ranks(2)) return;
  const int64_t per_step[] = {step_collectives(zero3_options().accum_steps(1)),
                              step_collectives(zero3_options().accum_steps(2))};
  const int64_t blocks = tiny_config().num_hidden_layers();
  CHECK(per_step[1] - per_step[0] == 3 * blocks);  // one more micro-batch: 2 gathers + 1 reduce-scatter each
  // the counts, the root's gather and reduce-scatter, the small tensors' bucket (the loss), the norm
  CHECK(per_step[0] == 3 * blocks + 5);
}

namespace {
// A ZeRO-3 run with a checkpoint at step 3, and one resumed from it: the same weights.
void resumes_bit_for_bit(const std::string& name, memopt::TrainerOptions options) {
  const char* dir = std::getenv("MEMOPT_TEST_DIR");
  REQUIRE(dir != nullptr);
  const std::string ckpt = std::string(dir) + "/" + name;
  options.checkpoint_dir(ckpt).save_every(3).max_steps(6);
  auto run = [&](bool resume) {
    TinyJob job(tiny_config().dropout(0.1));
    EveryBlockTrainer trainer(*job.model, options);
    if (resume) REQUIRE(trainer.resume(ckpt + "/step-00000003", job.slice));
    trainer.fit(job.slice, job.loss);
    torch::Tensor weights;
    trainer.with_full_weights([&] { weights = flat_weights(job.model); });
    return weights;
  };
  const torch::Tensor straight = run(false);
  const int ranks = memopt::dist::world().size();
  CHECK(std::filesystem::exists(ckpt + "/step-00000003/" + (ranks > 1 ? "trainer-rank1.pt" : "trainer.pt")));
  CHECK_FALSE(torch::isnan(straight).any().item<bool>());
  const torch::Tensor resumed = run(true);
  INFO("max |straight - resumed| = " << (straight - resumed).abs().max().item<double>());
  CHECK(torch::equal(straight, resumed));
}
}  // namespace

TEST_CASE("ZeRO-3 keep_gathered: the same weights, one all-gather per block and step", "[dist]") {
  if (!zero3_ranks(2)) return;
  const Run each_time = train<EveryBlockTrainer>(zero3_options(), 6, true);  // 2 micro-batches a step
  const Run kept = train<EveryBlockTrainer>(zero3_options().keep_gathered(true), 6, true);
  CHECK(torch::equal(each_time.weights, kept.weights));
  const int64_t blocks = tiny_config().num_hidden_layers();
  CHECK(step_collectives(zero3_options().accum_steps(2)) -  // 4 gathers a block -> 1
            step_collectives(zero3_options().keep_gathered(true).accum_steps(2)) ==
        3 * blocks);
  memopt::test::require_error([] { memopt::TrainerOptions().keep_gathered(true).validate(); },
                              "memopt::TrainerOptions", {"keep_gathered", "shard_params", "HINT"});
}

TEST_CASE("ZeRO-3 gather_half: bf16 autocast's weights bit for bit, matrices gathered in bf16", "[dist]") {
  if (!zero3_ranks(2)) return;
  using Bf16Trainer = memopt::Trainer<memopt::recompute::None, memopt::precision::Bf16Autocast, memopt::accum::Runtime>;
  const Run fp32_gathers = train<Bf16Trainer>(zero3_options(), 6, true);
  const Run half_gathers = train<Bf16Trainer>(zero3_options().gather_half(true), 6, true);
  // with_full_weights gathers fp32: bf16-rounded weights would differ here
  CHECK(torch::equal(fp32_gathers.weights, half_gathers.weights));
  CHECK(fp32_gathers.losses == half_gathers.losses);

  {
    TinyJob job;  // a block's matrices and vectors (norms) are flats of their own: 2 a block, 1 for the root
    Bf16Trainer trainer(*job.model, zero3_options().gather_half(true).param_specific_decay(false));
    CHECK(trainer.optimizer().param_groups().front().params().size() == 2 * 2 + 1);
  }
  memopt::test::require_error([] {
    TinyJob j;
    EveryBlockTrainer(*j.model, zero3_options().gather_half(true));
  }, "memopt::TrainerOptions", {"gather_half", "precision::Fp32", "HINT", "Bf16Autocast"});
  memopt::test::require_error([] { memopt::TrainerOptions().gather_half(true).validate(); },
                              "memopt::TrainerOptions", {"gather_half", "shard_params", "HINT"});
}

TEST_CASE("Loss scaling with sharded state: ZeRO-1 and ZeRO-3 train as one process, skip together", "[dist]") {
  if (!zero3_ranks(2)) return;
  using ScaledTrainer =
      memopt::Trainer<memopt::recompute::EveryBlock, memopt::precision::Scaled<c10::kFloat>, memopt::accum::Runtime>;
  SECTION("ZeRO-3") { zero3_matches_one_process<ScaledTrainer>(zero3_options()); }
  SECTION("ZeRO-1") { check_against_reference<ScaledTrainer>(base_options().shard_optimizer_state(true), 1e-6); }
  SECTION("an inf gradient in one rank's shard: both ranks skip, both scales back off, no weight moves") {
    auto& world = memopt::dist::world();
    TinyJob job;
    ScaledTrainer trainer(*job.model, zero3_options());
    REQUIRE(trainer.step(job.slice, job.loss).stepped);
    const double scale = trainer.precision().scaler().current_scale();
    torch::Tensor before;
    trainer.with_full_weights([&] { before = flat_weights(job.model); });
    // Rank 0's gradient of the head's first element becomes inf: after the reduce-scatter only
    // the rank that owns that element holds it.
    auto head = job.model->lm_head->weight;
    const bool poison = world.rank() == 0;
    unsigned hook = 0;
    if (poison) {
      hook = head.register_hook([](torch::Tensor g) {
        g = g.clone();
        g.view(-1)[0] = std::numeric_limits<float>::infinity();
        return g;
      });
    }
    const auto skipped = trainer.step(job.slice, job.loss);
    if (poison) head.remove_hook(hook);
    CHECK_FALSE(skipped.stepped);
    CHECK(trainer.precision().scaler().current_scale() == scale / 2);
    torch::Tensor after;
    trainer.with_full_weights([&] { after = flat_weights(job.model); });
    CHECK(torch::equal(before, after));
    const auto stepped = world.all_gather(torch::tensor({skipped.stepped ? 1 : 0}), "test: stepped");
    CHECK(stepped[0].item<int>() == stepped[1].item<int>());
    CHECK(trainer.step(job.slice, job.loss).stepped);  // the next step is clean again
  }
  memopt::test::require_error([] {
    TinyJob j;
    ScaledTrainer(*j.model, zero3_options().skip_nonfinite(false));
  }, "memopt::Trainer", {"Scaled", "skip_nonfinite(false)", "HINT"});
}

TEST_CASE("ZeRO-3 on several ranks refuses memory_budget's lone re-runs", "[dist]") {
  if (!zero3_ranks(2)) return;
  TinyJob job;
  memopt::test::require_error([&] { EveryBlockTrainer(*job.model, zero3_options().memory_budget(64 << 20)); },
                              "memopt::Trainer", {"memory_budget", "shard_params", "2 ranks", "HINT", "memory_budget(0)"});
}

TEST_CASE("A ZeRO-3 checkpoint resumes bit for bit", "[dist]") {
  if (!zero3_ranks(2)) return;
  resumes_bit_for_bit("zero3", zero3_options());
}

TEST_CASE("After fit() the ZeRO-3 model is whole on every rank; the next step shards it again", "[dist]") {
  if (!zero3_ranks(2)) return;
  auto& world = memopt::dist::world();
  TinyJob job;
  auto& model = job.model;
  EveryBlockTrainer trainer(*model, zero3_options().max_steps(2));
  const auto stored = [&] {  // bytes of the distinct storages (a unit's tensors share one buffer)
    std::map<const void*, int64_t> storages;
    for (const auto& p : model->parameters()) storages[p.storage().data()] = static_cast<int64_t>(p.storage().nbytes());
    int64_t bytes = 0;
    for (const auto& [ptr, n] : storages) bytes += n;
    return bytes;
  };
  int64_t total = 0;
  for (const auto& p : model->parameters()) total += p.numel();
  trainer.fit(job.slice, job.loss);
  CHECK(stored() >= 4 * total);  // whole, fp32 (a unit's buffer padded to a multiple of the ranks)
  CHECK(stored() < 4 * total + 64);
  const torch::Tensor after_fit = flat_weights(model);
  CHECK_FALSE(torch::isnan(after_fit).any().item<bool>());
  const auto all = world.all_gather(after_fit, "test: weights after fit");
  CHECK(torch::equal(all[0], all[1]));
  const double value = trainer.step(job.slice, job.loss).loss.item<double>();  // shards again from the whole weights
  CHECK(std::isfinite(value));
  CHECK(stored() < 4 * total / 100);
  torch::Tensor stepped;
  trainer.with_full_weights([&] { stepped = flat_weights(model); });
  CHECK_FALSE(torch::equal(stepped, after_fit));
  CHECK_FALSE(torch::isnan(stepped).any().item<bool>());
}

namespace {

// The tracker's peak over one step after a warm-up step, above what was alive before the model,
// on this rank, against memory::estimate for `ranks` ranks and ZeRO stage `zero`.
template <class T>
void zero3_estimate_matches(int zero, int64_t accum, bool keep = false, bool half = false,
                            const std::string& offload_dir = "") {
  auto& world = memopt::dist::world();
  auto& tracker = memopt::memory::Tracker::instance();
  REQUIRE(tracker.installed());
  const auto config = memopt::models::LlamaConfig().vocab_size(512).hidden_size(128).num_hidden_layers(4)
                          .num_attention_heads(4).max_position_embeddings(64);
  const int64_t micro = 4, seq = 64;  // per rank
  const int64_t before = tracker.live_bytes();
  torch::manual_seed(3);
  memopt::models::Llama model(config);
  RandomWindowLoader global(tokens(), LoaderOptions(micro * world.size(), seq).seed(7));
  RankSlice<RandomWindowLoader> slice(global, world.rank(), world.size());
  T trainer(*model, base_options().accum_steps(accum).shard_optimizer_state(zero == 1).shard_params(zero == 3)
                        .keep_gathered(keep).gather_half(half).offload_params_dir(offload_dir));
  trainer.step(slice, memopt::LossSum<memopt::models::Llama>{&model});
  world.barrier();
  tracker.reset_peaks();
  trainer.step(slice, memopt::LossSum<memopt::models::Llama>{&model});
  const int64_t measured = tracker.peak_bytes() - before;
  memopt::memory::RunDesc run{micro, seq};
  run.ranks = world.size();
  run.zero = zero;
  run.keep_gathered = keep;
  run.gather_half = half;
  run.offload_params = !offload_dir.empty();
  const auto predicted = memopt::memory::estimate(memopt::models::describe(config), run,
                                                  memopt::memory::describe<T>(accum));
  const double error = static_cast<double>(predicted.peak) / static_cast<double>(measured) - 1.0;
  INFO(T::name() << " zero " << zero << " accum " << accum << (keep ? " keep_gathered" : "")
                 << (half ? " gather_half" : "") << (offload_dir.empty() ? "" : " offloaded") << ", rank " << world.rank() << ": predicted "
                 << memopt::memory::mib(predicted.peak) << " MiB, measured " << memopt::memory::mib(measured)
                 << " MiB\n" << predicted.table());
  // The estimate is one number for every CPU kind, whose kernels' workspaces differ: it may err
  // high by 15% and low by 10% (measured: -3% to +7% on a 2-core AMX Xeon, where a CI machine of
  // another kind measured plain data parallel's step 2 MiB lower: +12.7%).
  CHECK(error >= -0.10);
  CHECK(error <= 0.15);
}

}  // namespace

TEST_CASE("The estimator predicts a ZeRO-3 rank's peak", "[dist]") {
  if (!zero3_ranks(2)) return;
  using Bf16Every = memopt::Trainer<memopt::recompute::EveryBlock, memopt::precision::Bf16Autocast, memopt::accum::Runtime>;
  using PureNone = memopt::Trainer<memopt::recompute::None, memopt::precision::Bf16Pure, memopt::accum::Runtime>;
  // (the tracker's peak also moves by ~0.5 MiB with the Gloo threads' timing)
  SECTION("fp32") { zero3_estimate_matches<Fp32Trainer>(3, 1); }
  SECTION("fp32, accumulation 2") { zero3_estimate_matches<Fp32Trainer>(3, 2); }
  SECTION("bf16 autocast, checkpointed blocks") { zero3_estimate_matches<Bf16Every>(3, 1); }
  SECTION("bf16 weights, fp32 masters") { zero3_estimate_matches<PureNone>(3, 1); }
  SECTION("keep_gathered, accumulation 2") { zero3_estimate_matches<Fp32Trainer>(3, 2, true); }
  SECTION("bf16 autocast, gather_half") { zero3_estimate_matches<Bf16Every>(3, 1, false, true); }
  SECTION("ZeRO-1 and plain data parallel") {
    zero3_estimate_matches<Fp32Trainer>(1, 1);
    zero3_estimate_matches<Fp32Trainer>(0, 1);
  }
}

TEST_CASE("ZeRO-3 names a block that ran outside run_block", "[dist]") {
  if (!zero3_ranks(2)) return;
  TinyJob job;
  auto& model = job.model;
  EveryBlockTrainer trainer(*model, zero3_options());
  // A loss that runs the layers directly (not through ckpt.run_block).
  auto direct = [&](const memopt::Batch& batch, const memopt::recompute::EveryBlock&) {
    auto x = model->model->embed_tokens(batch.inputs);
    auto [cos, sin] = memopt::nn::rope_tables(batch.inputs.size(1), tiny_config().rope(), x.device());
    for (size_t i = 0; i < model->model->layers->size(); ++i)
      x = model->model->layers->ptr<memopt::models::LlamaDecoderLayerImpl>(i)->forward(x, cos, sin);
    return model->lm_head(x).sum();
  };
  CHECK_THROWS_WITH(trainer.step(job.slice, direct), Catch::Contains("block 'model.layers.0'") &&
                                                     Catch::Contains("run_block"));
}

TEST_CASE("ZeRO-3 alone (a world of one) offloads its shards to a file, trains as without it, resumes",
          "[zero3-1]") {
  if (!zero3_ranks(1)) return;
  const char* dir = std::getenv("MEMOPT_TEST_DIR");
  REQUIRE(dir != nullptr);
  const Run plain = train<EveryBlockTrainer>(base_options(), 6, true);
  const Run disk = train<EveryBlockTrainer>(zero3_options().offload_params_dir(std::string(dir) + "/alone"), 6, true);
  const double diff = (plain.weights - disk.weights).abs().max().item<double>();
  INFO("max |w_plain - w_zero3_disk| = " << diff);
  CHECK(diff <= 1e-6);
  CHECK(disk.losses.back() < disk.losses.front());
  resumes_bit_for_bit("alone-ckpt", zero3_options().offload_params_dir(std::string(dir) + "/alone-offload"));
  // The estimate of a world of one: the shards whole with ZeRO-3's gathers; offloaded, out of memory.
  zero3_estimate_matches<EveryBlockTrainer>(3, 1);
  zero3_estimate_matches<EveryBlockTrainer>(3, 2, false, false, std::string(dir) + "/alone-estimate");

  TinyJob job;  // between steps the model holds placeholders; the optimizer steps the shards
  EveryBlockTrainer trainer(*job.model, zero3_options().param_specific_decay(false));
  trainer.step(job.slice, job.loss);
  CHECK(holds_placeholders(*job.model));
  CHECK(trainer.optimizer().param_groups().front().params().size() == 3);  // 2 blocks + the root

  memopt::test::require_error([&] { EveryBlockTrainer(*job.model, zero3_options().offload_params_host(true)); },
                              "memopt::dist::Zero3", {"offload_params_host", "cpu", "HINT", "offload_params_dir"});
  memopt::test::require_error([] { memopt::TrainerOptions().offload_params_host(true).validate(); },
                              "memopt::TrainerOptions", {"offload_params_host", "shard_params", "HINT"});
}

TEST_CASE("CUDA: ZeRO-3 alone keeps a GPU model's shards in pinned host memory and trains as without it",
          "[zero3-1][cuda]") {
  MEMOPT_REQUIRE_CUDA();
  if (!zero3_ranks(1)) return;
  const torch::Device gpu(torch::kCUDA, 0);
  // The offloaded run steps AdamW on the CPU, the plain one on the GPU: fp32 within 1e-5; under
  // bf16 autocast those last-bit differences pass through bf16 roundings, so the bound is a
  // tenth of what bf16 itself moves the weights from the fp32 run (the reference's own error).
  const auto compare = [&]<class T>(const char* what, const Run* fp32) {
    const Run plain = train<T>(base_options(), 6, true, tiny_config(), gpu);
    const Run host = train<T>(zero3_options().offload_params_host(true), 6, true, tiny_config(), gpu);
    const double diff = (plain.weights - host.weights).abs().max().item<double>();
    const double bound = fp32 == nullptr ? 1e-5 : 0.1 * (plain.weights - fp32->weights).abs().max().item<double>();
    INFO(what << ": max |w_gpu - w_host_offload| = " << diff << ", bound " << bound);
    CHECK(diff <= bound);
    for (size_t s = 0; s < plain.losses.size(); ++s)
      CHECK(std::abs(host.losses[s] - plain.losses[s]) <= (fp32 == nullptr ? 1e-5 : 1e-3) * plain.losses[s]);
    CHECK(host.losses.back() < host.losses.front());
    return plain;
  };
  const Run fp32 = compare.template operator()<EveryBlockTrainer>("fp32", nullptr);
  compare.template operator()<memopt::Trainer<memopt::recompute::None, memopt::precision::Bf16Autocast,
                                               memopt::accum::Runtime>>("bf16 autocast", &fp32);

  // Between steps the GPU holds none of the parameters, gradients or state: they are on the host.
  const auto allocated = [&](memopt::TrainerOptions options, bool expect_host) {
    TinyJob job;
    job.model->to(gpu);
    const int64_t before = memopt::memory::CudaMemory::now().at(0).allocated_bytes;
    EveryBlockTrainer trainer(*job.model, options.param_specific_decay(false));
    trainer.step(job.slice, job.loss);
    for (const auto& p : trainer.optimizer().param_groups().front().params()) {
      CHECK(p.is_cpu() == expect_host);
      CHECK(p.is_pinned() == expect_host);
    }
    return memopt::memory::CudaMemory::now().at(0).allocated_bytes - before;
  };
  int64_t elements = 0;
  for (const auto& p : memopt::models::Llama(tiny_config())->parameters()) elements += p.numel();
  const int64_t on_gpu = allocated(base_options(), false);
  const int64_t offloaded = allocated(zero3_options().offload_params_host(true), true);
  INFO("CUDA bytes allocated after a step: " << on_gpu << " resident, " << offloaded << " offloaded; "
       << elements << " parameters");
  CHECK(on_gpu - offloaded >= 8 * elements);  // AdamW's state at least; the gradients and weights too
}
