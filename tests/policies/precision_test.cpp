// Tests for memopt/policies/precision.hpp: bf16 autocast keeps fp32 master state, loss
// scaling changes nothing but survives an inf, Bf16Pure's masters keep small updates, and the
// policies save their own state.
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

TEST_CASE("Bf16Autocast: linear layers in bf16, fp32 master weights and grads, loss within 2%", "[precision]") {
  torch::manual_seed(0);
  memopt::models::Llama model(tiny_llama(0.0).num_hidden_layers(2));
  const Batch batch = random_batch(4, 16, 64, 3);
  torch::Tensor fp32_loss = model->loss_sum(batch, memopt::recompute::None{}) / batch.num_targets();

  torch::Tensor bf16_loss;
  {
    auto guard = memopt::precision::Bf16Autocast{}.autocast(c10::kCPU);
    auto hidden = model->model->forward(batch.inputs, memopt::recompute::None{});  // (B, T, C)
    CHECK(model->lm_head(hidden).scalar_type() == torch::kBFloat16);
    bf16_loss = model->loss_sum(batch, memopt::recompute::None{}) / batch.num_targets();
  }
  CHECK_FALSE(memopt::detail::AutocastState::current(c10::kCPU).enabled);  // guard restored
  bf16_loss.backward();
  for (auto& p : model->parameters()) {
    CHECK(p.scalar_type() == torch::kFloat);
    REQUIRE(p.grad().defined());
    CHECK(p.grad().scalar_type() == torch::kFloat);
  }
  const double rel = std::abs(bf16_loss.item<double>() - fp32_loss.item<double>()) / fp32_loss.item<double>();
  CHECK(rel < 0.02);
  CHECK(rel > 0.0);  // it really ran in lower precision
}

TEST_CASE("A bf16 Trainer built for the CPU has chosen its GEMM kernels before the first step", "[precision]") {
  memopt::models::Llama model(tiny_llama(0.0).num_hidden_layers(1));
  memopt::Trainer<memopt::recompute::None, memopt::precision::Bf16Autocast> trainer(*model, memopt::TrainerOptions());
  CHECK(memopt::bf16_gemm::enabled());  // the prepare hook ran: measured, or MEMOPT_BF16_GEMM
  CHECK(memopt::fp32_gemm::enabled());  // and the fp32 one (the widened bf16 products run on it)
  static_assert(memopt::hooks::PrepareDevice<memopt::precision::Bf16Pure>);
  static_assert(memopt::hooks::PrepareDevice<memopt::precision::Fp32>);  // fp32_gemm::enable()
}

TEST_CASE("Scaled: loss scaling leaves fp32 training unchanged", "[precision]") {
  using Scaled = memopt::precision::Scaled<c10::kFloat>;
  const auto plain = weights_after<memopt::recompute::None, memopt::precision::Fp32, memopt::state::Resident>(
      3, memopt::TrainerOptions());
  const auto scaled =
      weights_after<memopt::recompute::None, Scaled, memopt::state::Resident>(3, memopt::TrainerOptions());
  CHECK(max_abs_diff(plain, scaled) <= 1e-6);
  // Clipping sees the unscaled gradients: with a tight clip both still agree.
  const auto plain_clip = weights_after<memopt::recompute::None, memopt::precision::Fp32, memopt::state::Resident>(
      3, memopt::TrainerOptions().grad_clip(0.05));
  const auto scaled_clip =
      weights_after<memopt::recompute::None, Scaled, memopt::state::Resident>(3, memopt::TrainerOptions().grad_clip(0.05));
  CHECK(max_abs_diff(plain_clip, scaled_clip) <= 1e-6);
  CHECK(max_abs_diff(plain, plain_clip) > 1e-4);  // the clip did bite
}

TEST_CASE("Scaled: an inf gradient skips the step and backs the scale off", "[precision]") {
  torch::manual_seed(0);
  memopt::models::Llama model(tiny_llama(0.0));
  ListLoader loader{{random_batch(2, 16, 64, 1)}};
  memopt::Trainer<memopt::recompute::None, memopt::precision::Scaled<c10::kFloat>> trainer(
      *model, memopt::TrainerOptions());
  int calls = 0;
  auto loss_fn = [&](const Batch& b, const auto& ckpt) {
    auto loss = model->loss_sum(b, ckpt);
    return ++calls == 2 ? loss * std::numeric_limits<float>::infinity() : loss;  // step 2 overflows
  };
  CHECK(trainer.precision().scaler().current_scale() == 65536.0);
  CHECK(trainer.step(loader, loss_fn).stepped);
  const auto before = params_of(*model);
  const auto stats = trainer.step(loader, loss_fn);
  CHECK_FALSE(stats.stepped);
  CHECK(max_abs_diff(before, params_of(*model)) == 0.0);  // no update, not even weight decay
  CHECK(trainer.precision().scaler().current_scale() == 32768.0);
  CHECK(trainer.precision().scaler().skipped_steps() == 1);
  CHECK(trainer.step(loader, loss_fn).stepped);  // recovers
  CHECK(max_abs_diff(before, params_of(*model)) > 0.0);
}

TEST_CASE("LossScaler grows the scale after growth_interval clean steps, bad options rejected", "[precision]") {
  auto w = torch::ones({3}, torch::requires_grad());
  torch::optim::SGD sgd({w}, torch::optim::SGDOptions(0.1));
  memopt::precision::LossScaler scaler(memopt::precision::LossScaleOptions().init_scale(8).growth_interval(2));
  for (int s = 0; s < 2; ++s) {
    sgd.zero_grad();
    scaler.scale((w * w).sum()).backward();
    scaler.unscale(sgd);
    CHECK(torch::allclose(w.grad(), 2 * w.detach()));  // true gradients after unscale
    CHECK(scaler.step(sgd));
    scaler.update();
  }
  CHECK(scaler.current_scale() == 16.0);
  sgd.zero_grad();
  scaler.scale(w.sum() * std::numeric_limits<float>::quiet_NaN()).backward();
  CHECK_FALSE(scaler.step(sgd));  // step() unscales when unscale() was not called
  scaler.update();
  CHECK(scaler.current_scale() == 8.0);
  CHECK(scaler.clean_steps() == 0);

  CHECK_THROWS_WITH(memopt::precision::LossScaler(memopt::precision::LossScaleOptions().backoff_factor(1.5)),
                    Catch::Contains("backoff_factor") && Catch::Contains("(got 1.5)") && Catch::Contains("HINT"));
  CHECK_THROWS_WITH(memopt::precision::Fp16Scaled{}.autocast(c10::kCPU),
                    Catch::Contains("needs a CUDA device") && Catch::Contains("HINT"));
}

TEST_CASE("Policies save their own state through hooks::SavesState", "[precision]") {
  static_assert(memopt::hooks::SavesState<memopt::precision::Fp16Scaled>);
  static_assert(memopt::hooks::SavesState<memopt::precision::Bf16Pure>);
  static_assert(!memopt::hooks::SavesState<memopt::precision::Fp32>);
  static_assert(memopt::hooks::SkipStep<memopt::precision::Fp16Scaled>);
  static_assert(memopt::hooks::SkipsOnLocalGrads<memopt::precision::Fp16Scaled>);
  static_assert(!memopt::hooks::SkipsOnLocalGrads<memopt::precision::Bf16Pure>);
  memopt::precision::Scaled<c10::kFloat> scaled;
  scaled.scaler().load(1024.0, 7);
  torch::serialize::OutputArchive out;
  scaled.save_state(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  std::istringstream in_bytes(bytes.str());
  torch::serialize::InputArchive in;
  in.load_from(in_bytes);
  memopt::precision::Scaled<c10::kFloat> restored;
  restored.load_state(in);
  CHECK(restored.scaler().current_scale() == 1024.0);
  CHECK(restored.scaler().clean_steps() == 7);
  torch::serialize::InputArchive empty_archive;
  memopt::test::require_error([&] { restored.load_state(empty_archive); }, "memopt::Trainer::load_state",
                              {"'loss_scale'"});
  CHECK_NOTHROW(memopt::precision::Bf16Pure().load_state(empty_archive));  // no masters yet: nothing to read
}

TEST_CASE("Bf16Pure: bf16 weights and activations, fp32 masters, losses track fp32", "[precision]") {
  auto losses_of = [](auto trainer_tag, double lr, std::vector<torch::Tensor>* masters_out) {
    using T = typename decltype(trainer_tag)::type;
    torch::manual_seed(11);
    memopt::models::Llama model(tiny_llama(0.0));
    ListLoader loader{{random_batch(4, 16, 64, 21), random_batch(4, 16, 64, 22)}};
    T trainer(*model, memopt::TrainerOptions().lr(lr).warmup_steps(0).max_steps(20).grad_clip(1.0));
    std::vector<double> losses;
    for (int s = 0; s < 20; ++s)
      losses.push_back(
          trainer.step(loader, [&](const Batch& b, const auto& ckpt) { return model->loss_sum(b, ckpt); })
              .loss.template item<double>());
    if constexpr (std::is_same_v<typename T::precision_type, memopt::precision::Bf16Pure>) {
      for (auto& p : model->parameters()) CHECK(p.scalar_type() == torch::kBFloat16);
      CHECK(model->forward(random_batch(1, 8, 64, 3).inputs).scalar_type() == torch::kBFloat16);
      for (auto& group : trainer.optimizer().param_groups())
        for (auto& p : group.params()) CHECK(p.scalar_type() == torch::kFloat);  // the optimizer owns masters
      for (const auto& [param, master] : trainer.precision().masters()) {
        CHECK(torch::equal(param, master.to(torch::kBFloat16)));  // weights = rounded masters
        if (masters_out) masters_out->push_back(master.clone());
      }
    }
    return losses;
  };
  using Fp32Trainer = memopt::Trainer<memopt::recompute::None, memopt::precision::Fp32>;
  using PureTrainer = memopt::Trainer<memopt::recompute::EveryBlock, memopt::precision::Bf16Pure>;
  const auto fp32 = losses_of(std::type_identity<Fp32Trainer>{}, 3e-3, nullptr);
  const auto pure = losses_of(std::type_identity<PureTrainer>{}, 3e-3, nullptr);
  for (size_t s = 0; s < fp32.size(); ++s) CHECK(std::abs(pure[s] - fp32[s]) / fp32[s] < 0.03);
  CHECK(pure.back() < pure.front() * 0.9);  // it trains
  CHECK(pure.front() != fp32.front());      // and really computes in bf16

  // Updates far below bf16's resolution (lr 1e-6 on weights ~0.02, bf16 spacing ~1e-4)
  // accumulate in the masters: they move while a bf16-only update would round to nothing.
  std::vector<torch::Tensor> masters;
  losses_of(std::type_identity<PureTrainer>{}, 1e-6, &masters);
  torch::manual_seed(11);
  memopt::models::Llama initial(tiny_llama(0.0));
  std::vector<torch::Tensor> initial_in_optimizer_order;
  for (auto& group : memopt::optim::param_groups(initial->named_parameters(), torch::optim::AdamWOptions(1)))
    for (auto& p : group.params()) initial_in_optimizer_order.push_back(p.detach());
  REQUIRE(masters.size() == initial_in_optimizer_order.size());
  double max_move = 0;
  for (size_t i = 0; i < masters.size(); ++i)
    max_move = std::max(max_move, (masters[i] - initial_in_optimizer_order[i]).abs().max().item<double>());
  CHECK(max_move > 5e-6);  // ~20 steps x 1e-6
  CHECK(max_move < 1e-4);  // below the bf16 spacing of the weights
}

TEST_CASE("Bf16Pure with LoRA: the frozen base turns bf16 too, masters only for the adapters", "[precision][lora]") {
  torch::manual_seed(12);
  memopt::models::Llama model(tiny_llama(0.0));
  memopt::lora::apply(*model, memopt::nn::LoraOptions().rank(4).targets({"all-linear"}));
  int64_t trainable = 0, frozen = 0;
  for (const auto& p : model->parameters()) (p.requires_grad() ? trainable : frozen) += 1;
  REQUIRE(frozen > 0);
  ListLoader loader{{random_batch(4, 16, 64, 23)}};
  memopt::Trainer<memopt::recompute::Selective, memopt::precision::Bf16Pure> trainer(
      *model, memopt::TrainerOptions().lr(1e-2).warmup_steps(0).max_steps(2));
  // Every weight computes in bf16 (no fp32 base beside bf16 activations); the optimizer owns
  // fp32 masters of the adapters alone.
  for (const auto& p : model->parameters()) CHECK(p.scalar_type() == torch::kBFloat16);
  CHECK(static_cast<int64_t>(trainer.precision().masters().size()) == trainable);
  const auto before = model->named_parameters()["model.layers.0.self_attn.q_proj.weight"].clone();
  const auto loss = trainer.step(loader, [&](const Batch& b, const auto& ckpt) { return model->loss_sum(b, ckpt); });
  CHECK(std::isfinite(loss.loss.item<double>()));
  CHECK(model->forward(random_batch(1, 8, 64, 3).inputs).scalar_type() == torch::kBFloat16);
  CHECK(torch::equal(model->named_parameters()["model.layers.0.self_attn.q_proj.weight"], before));  // frozen stays
  for (const auto& [param, master] : trainer.precision().masters()) CHECK(torch::equal(param, master.to(torch::kBFloat16)));
}

TEST_CASE("CUDA: bf16 autocast, fp16 with loss scaling and pure bf16 track fp32's losses", "[precision][cuda]") {
  MEMOPT_REQUIRE_CUDA();
  const torch::Device cuda(torch::kCUDA, 0);
  using memopt::recompute::EveryBlock;
  using memopt::recompute::None;
  constexpr int kSteps = 20;
  const auto fp32 = losses_of<memopt::Trainer<None, memopt::precision::Fp32>>(cuda, 3e-3, kSteps);
  // fp32 on the GPU is fp32 on the CPU (no TF32: LibTorch leaves it off for matmuls).
  const auto cpu = losses_of<memopt::Trainer<None, memopt::precision::Fp32>>(torch::kCPU, 3e-3, kSteps);
  for (int s = 0; s < kSteps; ++s) CHECK(std::abs(cpu[s] - fp32[s]) / cpu[s] < 1e-3);

  const auto check_tracks = [&](const std::vector<double>& half, double tolerance, const char* what) {
    INFO(what);
    for (int s = 0; s < kSteps; ++s) CHECK(std::abs(half[s] - fp32[s]) / fp32[s] < tolerance);
    CHECK(half.back() < half.front() * 0.9);  // it trains
    CHECK(half.front() != fp32.front());      // and really computes in half precision
  };
  check_tracks(losses_of<memopt::Trainer<EveryBlock, memopt::precision::Bf16Autocast>>(cuda, 3e-3, kSteps), 0.03,
               "bf16 autocast");
  check_tracks(losses_of<memopt::Trainer<EveryBlock, memopt::precision::Fp16Scaled>>(cuda, 3e-3, kSteps), 0.03,
               "fp16 autocast + loss scaling");
  check_tracks(losses_of<memopt::Trainer<None, memopt::precision::Bf16Pure>>(cuda, 3e-3, kSteps), 0.03, "pure bf16");
}

TEST_CASE("CUDA: fp16 loss scaling skips a step with an inf gradient and backs the scale off", "[precision][cuda]") {
  MEMOPT_REQUIRE_CUDA();
  const torch::Device cuda(torch::kCUDA, 0);
  torch::manual_seed(3);
  memopt::models::Llama model(tiny_llama(0.0));
  model->to(cuda);
  ListLoader loader{{random_batch(2, 16, 64, 1)}};
  memopt::Trainer<memopt::recompute::None, memopt::precision::Fp16Scaled> trainer(
      *model, memopt::TrainerOptions().lr(1e-3).warmup_steps(0).max_steps(3));
  const auto before = params_of(*model);
  const double scale = trainer.precision().scaler().current_scale();
  // A loss of +inf: every gradient overflows.
  auto stats = trainer.step(loader, [&](const Batch& b, const auto& ckpt) {
    return model->loss_sum(b, ckpt) * std::numeric_limits<float>::infinity();
  });
  CHECK_FALSE(stats.stepped);
  CHECK(trainer.precision().scaler().current_scale() == scale / 2);
  CHECK(trainer.precision().scaler().skipped_steps() == 1);
  CHECK(max_abs_diff(before, params_of(*model)) == 0.0);
  stats = trainer.step(loader, [&](const Batch& b, const auto& ckpt) { return model->loss_sum(b, ckpt); });
  CHECK(stats.stepped);
  CHECK(max_abs_diff(before, params_of(*model)) > 0.0);
}
