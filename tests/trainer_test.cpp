// Tests for memopt/trainer.hpp: a Trainer with bf16 autocast and checkpointing lowers the
// loss; bad options fail with the option, the value and a HINT.
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

namespace {

// 30 steps of bf16 autocast + checkpointing + accumulation of a tiny LLaMA on `device`: the
// loss falls by a fifth and the cache is released every 10 steps. Returns the fit's result.
memopt::FitResult fit_lowers_loss(torch::Device device, double dropout) {
  torch::manual_seed(0);
  memopt::models::Llama model(tiny_llama(dropout));
  model->to(device);
  ListLoader loader{{random_batch(4, 16, 64, 1), random_batch(4, 16, 64, 2)}};
  memopt::Trainer<memopt::recompute::EveryBlock, memopt::precision::Bf16Autocast, memopt::accum::Fixed<2>> trainer(
      *model, memopt::TrainerOptions().lr(3e-3).max_steps(30).log_interval(10).warmup_steps(2));
  auto release = std::make_shared<memopt::callbacks::ReleaseCache>(10);
  trainer.add_callback(release);
  auto loss_fn = [&](const Batch& b, const auto& ckpt) { return model->loss_sum(b, ckpt); };
  const double first = trainer.step(loader, loss_fn).loss.item<double>();
  const auto result = trainer.fit(loader, loss_fn);
  CHECK(result.steps == 29);
  CHECK(result.final_loss < first * 0.8);
  CHECK(release->releases() == 3);
  CHECK(trainer.steps_taken() == 30);
  for (const auto& p : model->parameters()) CHECK(p.device() == device);
  return result;
}

}  // namespace

TEST_CASE("Trainer with bf16 autocast and checkpointing lowers the loss", "[trainer]") {
  fit_lowers_loss(torch::kCPU, 0.0);
}

TEST_CASE("bad Trainer options fail with the option, the value and a HINT", "[trainer]") {
  memopt::models::Llama model(tiny_llama(0.0));
  using Plain = memopt::Trainer<>;
  auto message_of = [&](memopt::TrainerOptions o) -> std::string {
    try {
      Plain t(*model, o);
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
    return "";
  };
  CHECK_THAT(message_of(memopt::TrainerOptions().lr(0)), Catch::Contains("lr must be > 0 (got 0)") &&
                                                              Catch::Contains("HINT"));
  CHECK_THAT(message_of(memopt::TrainerOptions().max_steps(-3)), Catch::Contains("max_steps") &&
                                                                     Catch::Contains("-3"));
  CHECK_THAT(message_of(memopt::TrainerOptions().accum_steps(0)), Catch::Contains("accum_steps") &&
                                                                      Catch::Contains("HINT"));
  CHECK_THROWS_WITH(memopt::accum::Runtime(0), Catch::Contains("(got 0)") && Catch::Contains("HINT"));
  CHECK(message_of(memopt::TrainerOptions()).empty());
  CHECK_THROWS_WITH(memopt::init(memopt::RuntimeOptions().threads(-2)), Catch::Contains("(got -2)") &&
                                                                           Catch::Contains("HINT"));
}

namespace {

// Host reads during one step of a tiny LLaMA with the chunked loss over `micro` (one loader
// batch per micro-batch), under accumulation policy Accum; `fused`: LlamaConfig::fused_kernels.
template <class Accum>
int64_t host_reads_per_step(const std::vector<Batch>& micro, memopt::TrainerOptions options, bool fused = false) {
  torch::manual_seed(3);
  memopt::models::Llama model(tiny_llama(0.0).loss_chunk_size(8).fused_kernels(fused));
  memopt::Trainer<memopt::recompute::EveryBlock, memopt::precision::Fp32, Accum> trainer(*model, options);
  ListLoader loader{micro};
  auto loss_fn = [&](const Batch& b, const auto& ckpt) { return model->loss_sum(b, ckpt); };
  trainer.step(loader, loss_fn);  // warm-up: first-call work stays out of the count
  memopt::test::HostReads reads;
  const auto stats = trainer.step(loader, loss_fn);
  REQUIRE(stats.stepped);
  return reads.count();
}

}  // namespace

TEST_CASE("a Trainer step reads the host once, however many micro-batches check their targets", "[trainer]") {
  std::vector<Batch> micro;
  for (int m = 0; m < 4; ++m) micro.push_back(with_padding(random_batch(2, 16, 64, 60 + m), m));
  // The chunked loss checks its targets per micro-batch; the step reads those checks and the
  // loss and gradient norm's finiteness together, once.
  CHECK(host_reads_per_step<memopt::accum::None>({micro[0]}, memopt::TrainerOptions()) == 1);
  CHECK(host_reads_per_step<memopt::accum::Fixed<4>>(micro, memopt::TrainerOptions()) == 1);
  CHECK(host_reads_per_step<memopt::accum::Runtime>(micro, memopt::TrainerOptions().accum_steps(4)) == 1);
  CHECK(host_reads_per_step<memopt::accum::Fixed<4>>(micro, memopt::TrainerOptions().skip_nonfinite(false)) == 1);
  CHECK(host_reads_per_step<memopt::accum::Fixed<4>>(micro, memopt::TrainerOptions(), /*fused=*/true) == 1);
}

TEST_CASE("a target outside the vocabulary stops the Trainer step before the update, naming it", "[trainer]") {
  torch::manual_seed(3);
  memopt::models::Llama model(tiny_llama(0.0).loss_chunk_size(8));
  memopt::Trainer<memopt::recompute::None, memopt::precision::Fp32, memopt::accum::Fixed<4>> trainer(
      *model, memopt::TrainerOptions());
  std::vector<Batch> micro;
  for (int m = 0; m < 4; ++m) micro.push_back(random_batch(2, 16, 64, 70 + m));
  micro[2].targets = micro[2].targets.clone();  // its own storage: the inputs stay valid ids
  micro[2].targets[1][5] = 64;                  // vocab_size 64: one past the last id, in the third micro-batch
  ListLoader loader{micro};
  const auto before = params_of(*model);
  memopt::test::require_error(
      [&] { trainer.step(loader, [&](const Batch& b, const auto& ckpt) { return model->loss_sum(b, ckpt); }); },
      "memopt::nn::chunked_cross_entropy_sum", {"target 64", "[0, 64)"});
  CHECK(max_abs_diff(before, params_of(*model)) == 0.0);  // no update
  CHECK(trainer.steps_taken() == 0);
}

TEST_CASE("CUDA: the optimizer sees the CPU's gradients under every recompute policy and accumulation",
          "[trainer][cuda]") {
  MEMOPT_REQUIRE_CUDA();
  const torch::Device cuda(torch::kCUDA, 0);
  std::vector<Batch> micro;
  for (int m = 0; m < 4; ++m) micro.push_back(with_padding(random_batch(2, 16, 64, 300 + m), m));
  const auto cpu = trainer_grads<memopt::accum::None>({concat(micro)}, memopt::TrainerOptions());
  // fp32 on both devices; the GPU sums in other orders (and with atomics): ~1e-7 apart.
  constexpr double kTolerance = 1e-5;
  CHECK(max_abs_diff(cpu, trainer_grads<memopt::accum::None>({concat(micro)}, memopt::TrainerOptions(), cuda)) <=
        kTolerance);
  CHECK(max_abs_diff(cpu, trainer_grads<memopt::accum::Fixed<4>, memopt::recompute::EveryBlock>(
                              micro, memopt::TrainerOptions(), cuda)) <= kTolerance);
  CHECK(max_abs_diff(cpu, trainer_grads<memopt::accum::Runtime, memopt::recompute::Selective>(
                              micro, memopt::TrainerOptions().accum_steps(4), cuda)) <= kTolerance);
  // Sensitive: half the batch gives other gradients.
  CHECK(max_abs_diff(cpu, trainer_grads<memopt::accum::Fixed<2>>(micro, memopt::TrainerOptions(), cuda)) > 1e-4);
}

TEST_CASE("CUDA: a Trainer with bf16 autocast, checkpointing and accumulation lowers the loss on the GPU",
          "[trainer][cuda]") {
  MEMOPT_REQUIRE_CUDA();
  const auto result = fit_lowers_loss(torch::Device(torch::kCUDA, 0), 0.1);
  REQUIRE_FALSE(result.memory.cuda.empty());
  CHECK(result.memory.cuda.at(0).peak_allocated_bytes > 0);
}
