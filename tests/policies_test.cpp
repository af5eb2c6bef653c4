// Tests for the policies and the Trainer (include/memopt/policies/*.hpp, trainer.hpp):
// checkpointing gives the gradients of no checkpointing (dropout on), accumulation equals
// the big batch (ragged targets included), bf16 autocast keeps fp32 master state, loss
// scaling changes nothing but survives an inf, Bf16Pure's masters keep small updates,
// steps in backward give the normal step's weights and refuse misuse, and options are
// validated with a HINT.
#include <limits>
#include <map>
#include <sstream>
#include <type_traits>

#include <catch2/catch.hpp>

#include <memopt/memopt.hpp>

#include "support.hpp"

namespace {

using memopt::Batch;

memopt::models::LlamaConfig tiny_llama(double dropout) {
  return memopt::models::LlamaConfig()
      .vocab_size(64)
      .hidden_size(32)
      .num_hidden_layers(4)
      .num_attention_heads(4)
      .num_key_value_heads(2)
      .max_position_embeddings(32)
      .dropout(dropout);
}

Batch random_batch(int64_t B, int64_t T, int64_t vocab, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  auto tokens = torch::randint(vocab, {B, T + 1}, gen);
  return {tokens.slice(1, 0, T), tokens.slice(1, 1, T + 1)};
}

std::vector<torch::Tensor> grads_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> g;
  for (auto& p : m.parameters()) g.push_back(p.grad().defined() ? p.grad().clone() : torch::zeros_like(p));
  return g;
}

void zero_grads(torch::nn::Module& m) {
  for (auto& p : m.parameters()) p.mutable_grad() = torch::Tensor();
}

double max_abs_diff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  REQUIRE(a.size() == b.size());
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, (a[i] - b[i]).abs().max().item<double>());
  return d;
}

template <class Checkpoint>
std::vector<torch::Tensor> llama_grads(memopt::models::Llama& model, const Batch& batch, uint64_t dropout_seed) {
  zero_grads(*model);
  torch::manual_seed(dropout_seed);
  auto loss = model->loss_sum(batch, Checkpoint{}) / batch.num_targets();
  loss.backward();
  return grads_of(*model);
}

// A user's own model: blocks in a torch::nn::Sequential, run through run_sequential.
struct UserBlockImpl : torch::nn::Module {
  explicit UserBlockImpl(int64_t dim) {
    fc = register_module("fc", torch::nn::Linear(dim, dim));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
  }
  torch::Tensor forward(const torch::Tensor& x) {  // (B, T, C) -> (B, T, C)
    return norm(x + torch::dropout(torch::gelu(fc(x)), 0.1, is_training()));
  }
  torch::nn::Linear fc{nullptr};
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(UserBlock);

struct UserNetImpl : torch::nn::Module {
  explicit UserNetImpl(int64_t vocab, int64_t dim, int64_t depth) {
    embed = register_module("embed", torch::nn::Embedding(vocab, dim));
    blocks = register_module("blocks", torch::nn::Sequential());
    for (int64_t i = 0; i < depth; ++i) {
      blocks->push_back(UserBlock(dim));
    }
    head = register_module("head", torch::nn::Linear(dim, vocab));
  }
  template <memopt::CheckpointPolicy C>
  torch::Tensor loss_sum(const Batch& b, const C& ckpt) {
    auto x = memopt::run_sequential(ckpt, blocks, embed(b.inputs));  // (B, T, C)
    auto logits = head(x);                                           // (B, T, V)
    return torch::nn::functional::cross_entropy(
        logits.reshape({-1, logits.size(-1)}), b.targets.reshape({-1}),
        torch::nn::functional::CrossEntropyFuncOptions().ignore_index(memopt::kIgnoreIndex).reduction(torch::kSum));
  }
  torch::nn::Embedding embed{nullptr};
  torch::nn::Sequential blocks{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(UserNet);

template <class Checkpoint>
std::vector<torch::Tensor> user_grads(UserNet& net, const Batch& batch, uint64_t dropout_seed) {
  zero_grads(*net);
  torch::manual_seed(dropout_seed);
  (net->loss_sum(batch, Checkpoint{}) / batch.num_targets()).backward();
  return grads_of(*net);
}

// An offload policy that records the gradients the optimizer is about to use: lets a
// test see the accumulated, normalised gradients inside Trainer::step.
struct RecordGrads {
  std::shared_ptr<std::vector<torch::Tensor>> seen = std::make_shared<std::vector<torch::Tensor>>();
  std::unique_ptr<torch::optim::Optimizer> make_optimizer(std::vector<torch::optim::OptimizerParamGroup> groups,
                                                          const torch::optim::AdamWOptions& o) const {
    return memopt::offload::None{}.make_optimizer(std::move(groups), o);
  }
  void before_step(torch::optim::Optimizer& opt) const {
    seen->clear();
    for (auto& group : opt.param_groups())
      for (auto& p : group.params()) seen->push_back(p.grad().clone());
  }
  void after_step(torch::optim::Optimizer&) const {}
};
static_assert(memopt::OffloadPolicy<RecordGrads>);

// Replays a fixed list of batches.
struct ListLoader {
  std::vector<Batch> batches;
  size_t next_index = 0;
  Batch next() { return batches.at(next_index++ % batches.size()); }
};

// Gives batch rows ragged padding: row r of micro-batch m ignores its last (r + m) % T targets.
Batch with_padding(Batch b, int64_t salt) {
  auto targets = b.targets.clone();
  for (int64_t r = 0; r < targets.size(0); ++r) {
    const int64_t pad = (r * 3 + salt * 5) % targets.size(1);
    if (pad > 0) targets[r].slice(0, targets.size(1) - pad).fill_(memopt::kIgnoreIndex);
  }
  return {b.inputs, targets};
}

Batch concat(const std::vector<Batch>& parts) {
  std::vector<torch::Tensor> in, tg;
  for (const auto& p : parts) {
    in.push_back(p.inputs);
    tg.push_back(p.targets);
  }
  return {torch::cat(in), torch::cat(tg)};
}

template <class Accum>
std::vector<torch::Tensor> trainer_grads(const std::vector<Batch>& micro_batches, memopt::TrainerOptions opts) {
  torch::manual_seed(7);
  memopt::models::Llama model(tiny_llama(0.0));
  memopt::Trainer<memopt::checkpoint::None, memopt::precision::Fp32, Accum, RecordGrads> trainer(
      *model, opts.grad_clip(0).threads(1));
  ListLoader loader{micro_batches};
  auto stats = trainer.step(loader, [&](const Batch& b, const auto& ckpt) { return model->loss_sum(b, ckpt); });
  REQUIRE(stats.step == 1);
  return *trainer.offload().seen;
}

}  // namespace

TEST_CASE("checkpointing gives the gradients of no checkpointing, dropout on (LLaMA)", "[checkpoint]") {
  torch::manual_seed(0);
  memopt::models::Llama model(tiny_llama(0.1));
  model->train();
  const Batch batch = random_batch(3, 16, 64, 11);

  const auto plain = llama_grads<memopt::checkpoint::None>(model, batch, 123);
  const auto every = llama_grads<memopt::checkpoint::EveryBlock>(model, batch, 123);
  const auto nth = llama_grads<memopt::checkpoint::EveryNth<2>>(model, batch, 123);
  const auto selective = llama_grads<memopt::checkpoint::Selective>(model, batch, 123);
  CHECK(max_abs_diff(plain, every) <= 1e-6);
  CHECK(max_abs_diff(plain, nth) <= 1e-6);
  CHECK(max_abs_diff(plain, selective) <= 1e-6);

  // The comparison is sensitive: another dropout draw changes the gradients.
  const auto other_draw = llama_grads<memopt::checkpoint::None>(model, batch, 124);
  CHECK(max_abs_diff(plain, other_draw) > 1e-4);
}

TEST_CASE("checkpointing gives the gradients of no checkpointing, dropout on (user module)", "[checkpoint]") {
  torch::manual_seed(1);
  UserNet net(50, 24, 4);
  net->train();
  const Batch batch = random_batch(2, 12, 50, 5);
  const auto plain = user_grads<memopt::checkpoint::None>(net, batch, 99);
  const auto every = user_grads<memopt::checkpoint::EveryBlock>(net, batch, 99);
  const auto nth = user_grads<memopt::checkpoint::EveryNth<2>>(net, batch, 99);
  CHECK(max_abs_diff(plain, every) <= 1e-6);
  CHECK(max_abs_diff(plain, nth) <= 1e-6);
  CHECK(max_abs_diff(plain, user_grads<memopt::checkpoint::None>(net, batch, 100)) > 1e-4);
}

TEST_CASE("checkpointing leaves the RNG stream and autocast state as it found them", "[checkpoint]") {
  torch::manual_seed(3);
  UserNet net(20, 8, 2);
  const Batch batch = random_batch(2, 4, 20, 1);
  torch::manual_seed(5);
  (net->loss_sum(batch, memopt::checkpoint::EveryBlock{}) / batch.num_targets()).backward();
  const auto after_checkpointed = torch::rand({4});
  torch::manual_seed(5);
  (net->loss_sum(batch, memopt::checkpoint::None{}) / batch.num_targets()).backward();
  const auto after_plain = torch::rand({4});
  CHECK(torch::equal(after_checkpointed, after_plain));
  CHECK_FALSE(memopt::detail::AutocastState::current(c10::kCPU).enabled);
}

TEST_CASE("accum::Fixed<4> x micro-batch 2 gives the gradients of one batch of 8", "[accum]") {
  std::vector<Batch> micro;
  for (int m = 0; m < 4; ++m) micro.push_back(random_batch(2, 16, 64, 100 + m));
  const auto big = trainer_grads<memopt::accum::None>({concat(micro)}, memopt::TrainerOptions());
  const auto accumulated = trainer_grads<memopt::accum::Fixed<4>>(micro, memopt::TrainerOptions());
  const auto runtime = trainer_grads<memopt::accum::Runtime>(micro, memopt::TrainerOptions().accum_steps(4));
  CHECK(max_abs_diff(big, accumulated) <= 1e-6);
  CHECK(max_abs_diff(big, runtime) <= 1e-6);
  // Sensitive: half the batch gives other gradients.
  const auto half = trainer_grads<memopt::accum::Fixed<2>>(micro, memopt::TrainerOptions());
  CHECK(max_abs_diff(big, half) > 1e-4);
}

TEST_CASE("accumulation equals the big batch with ragged padding across micro-batches", "[accum]") {
  std::vector<Batch> micro;
  for (int m = 0; m < 4; ++m) micro.push_back(with_padding(random_batch(2, 16, 64, 200 + m), m));
  const auto big = trainer_grads<memopt::accum::None>({concat(micro)}, memopt::TrainerOptions());
  const auto accumulated = trainer_grads<memopt::accum::Fixed<4>>(micro, memopt::TrainerOptions());
  CHECK(max_abs_diff(big, accumulated) <= 1e-6);

  // The classic bug — averaging each micro-batch's mean — is measurably different here.
  torch::manual_seed(7);
  memopt::models::Llama model(tiny_llama(0.0));
  for (const auto& b : micro) (model->loss_sum(b, memopt::checkpoint::None{}) / b.num_targets() / 4).backward();
  std::vector<torch::Tensor> naive;
  for (auto& g : model->named_parameters()) naive.push_back(g.value().grad());
  // named_parameters() and the optimizer's groups order differ; compare norms instead.
  double big_norm = 0, naive_norm = 0;
  for (auto& g : big) big_norm += g.pow(2).sum().item<double>();
  for (auto& g : naive) naive_norm += g.pow(2).sum().item<double>();
  CHECK(std::abs(big_norm - naive_norm) > 1e-6 * big_norm);
}

TEST_CASE("Bf16Autocast: linear layers in bf16, fp32 master weights and grads, loss within 2%", "[precision]") {
  torch::manual_seed(0);
  memopt::models::Llama model(tiny_llama(0.0).num_hidden_layers(2));
  const Batch batch = random_batch(4, 16, 64, 3);
  torch::Tensor fp32_loss = model->loss_sum(batch, memopt::checkpoint::None{}) / batch.num_targets();

  torch::Tensor bf16_loss;
  {
    auto guard = memopt::precision::Bf16Autocast{}.autocast(c10::kCPU);
    auto hidden = model->model->forward(batch.inputs, memopt::checkpoint::None{});  // (B, T, C)
    CHECK(model->lm_head(hidden).scalar_type() == torch::kBFloat16);
    bf16_loss = model->loss_sum(batch, memopt::checkpoint::None{}) / batch.num_targets();
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

TEST_CASE("Trainer with bf16 autocast and checkpointing lowers the loss", "[trainer]") {
  torch::manual_seed(0);
  memopt::models::Llama model(tiny_llama(0.0));
  ListLoader loader{{random_batch(4, 16, 64, 1), random_batch(4, 16, 64, 2)}};
  memopt::Trainer<memopt::checkpoint::EveryBlock, memopt::precision::Bf16Autocast, memopt::accum::Fixed<2>> trainer(
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

TEST_CASE("the learning-rate schedule warms up linearly and decays to min_lr_ratio", "[optim]") {
  using memopt::optim::Decay;
  using memopt::optim::scheduled_lr;
  CHECK(scheduled_lr(0, 1.0, 10, 110, Decay::kCosine, 0.1) == Approx(0.1));
  CHECK(scheduled_lr(9, 1.0, 10, 110, Decay::kCosine, 0.1) == Approx(1.0));
  CHECK(scheduled_lr(60, 1.0, 10, 110, Decay::kCosine, 0.1) == Approx(0.55));
  CHECK(scheduled_lr(110, 1.0, 10, 110, Decay::kCosine, 0.1) == Approx(0.1));
  CHECK(scheduled_lr(60, 1.0, 10, 110, Decay::kLinear, 0.0) == Approx(0.5));
  CHECK(scheduled_lr(60, 1.0, 10, 110, Decay::kConstant, 0.0) == Approx(1.0));
}

TEST_CASE("AdamW groups: no weight decay on norms, biases and embeddings", "[optim]") {
  memopt::models::Llama model(tiny_llama(0.0));
  auto groups = memopt::optim::param_groups(model->named_parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
  REQUIRE(groups.size() == 2);
  auto& decay = static_cast<torch::optim::AdamWOptions&>(groups[0].options());
  auto& no_decay = static_cast<torch::optim::AdamWOptions&>(groups[1].options());
  CHECK(decay.weight_decay() == 0.1);
  CHECK(no_decay.weight_decay() == 0.0);
  auto named = model->named_parameters();
  auto holds = [](const torch::optim::OptimizerParamGroup& g, const torch::Tensor& t) {
    for (const auto& p : g.params())
      if (p.is_same(t)) return true;
    return false;
  };
  CHECK(holds(groups[1], named["model.embed_tokens.weight"]));
  CHECK(holds(groups[1], named["model.norm.weight"]));
  CHECK(holds(groups[1], named["model.layers.0.input_layernorm.weight"]));
  CHECK(holds(groups[0], named["model.layers.0.self_attn.q_proj.weight"]));
  CHECK(holds(groups[0], named["lm_head.weight"]));
  CHECK(groups[0].params().size() + groups[1].params().size() == named.size());
}

namespace {

std::vector<torch::Tensor> params_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (auto& p : m.parameters()) out.push_back(p.detach().clone());
  return out;
}

// Trains a fresh tiny LLaMA (same init every call) for `steps` steps; returns its weights.
template <class Checkpoint, class Precision, class Offload>
std::vector<torch::Tensor> weights_after(int steps, memopt::TrainerOptions opts, Offload offload = {}) {
  torch::manual_seed(11);
  memopt::models::Llama model(tiny_llama(0.0));
  ListLoader loader{{random_batch(2, 16, 64, 21), random_batch(2, 16, 64, 22)}};
  memopt::Trainer<Checkpoint, Precision, memopt::accum::None, Offload> trainer(
      *model, opts.threads(1).lr(1e-2).warmup_steps(2).max_steps(steps), {},
      std::move(offload));  // lr changes every step
  for (int s = 0; s < steps; ++s)
    REQUIRE(trainer.step(loader, [&](const Batch& b, const auto& ckpt) { return model->loss_sum(b, ckpt); }).stepped);
  return params_of(*model);
}

}  // namespace

TEST_CASE("Scaled: loss scaling leaves fp32 training unchanged", "[precision]") {
  using Scaled = memopt::precision::Scaled<c10::kFloat>;
  const auto plain = weights_after<memopt::checkpoint::None, memopt::precision::Fp32, memopt::offload::None>(
      3, memopt::TrainerOptions());
  const auto scaled =
      weights_after<memopt::checkpoint::None, Scaled, memopt::offload::None>(3, memopt::TrainerOptions());
  CHECK(max_abs_diff(plain, scaled) <= 1e-6);
  // Clipping sees the unscaled gradients: with a tight clip both still agree.
  const auto plain_clip = weights_after<memopt::checkpoint::None, memopt::precision::Fp32, memopt::offload::None>(
      3, memopt::TrainerOptions().grad_clip(0.05));
  const auto scaled_clip =
      weights_after<memopt::checkpoint::None, Scaled, memopt::offload::None>(3, memopt::TrainerOptions().grad_clip(0.05));
  CHECK(max_abs_diff(plain_clip, scaled_clip) <= 1e-6);
  CHECK(max_abs_diff(plain, plain_clip) > 1e-4);  // the clip did bite
}

TEST_CASE("Scaled: an inf gradient skips the step and backs the scale off", "[precision]") {
  torch::manual_seed(0);
  memopt::models::Llama model(tiny_llama(0.0));
  ListLoader loader{{random_batch(2, 16, 64, 1)}};
  memopt::Trainer<memopt::checkpoint::None, memopt::precision::Scaled<c10::kFloat>> trainer(
      *model, memopt::TrainerOptions().threads(1));
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

TEST_CASE("LossScaler grows the scale after growth_interval clean steps; bad options rejected", "[precision]") {
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

TEST_CASE("StepInBackward: the weights of the normal step, gradients freed during backward", "[offload]") {
  for (bool checkpointed : {false, true}) {
    INFO("checkpointed " << checkpointed);
    const auto normal = weights_after<memopt::checkpoint::None, memopt::precision::Fp32, memopt::offload::None>(
        3, memopt::TrainerOptions().grad_clip(0));
    const auto in_backward =
        checkpointed ? weights_after<memopt::checkpoint::EveryBlock, memopt::precision::Fp32,
                                     memopt::offload::StepInBackward>(3, memopt::TrainerOptions().grad_clip(0))
                     : weights_after<memopt::checkpoint::None, memopt::precision::Fp32,
                                     memopt::offload::StepInBackward>(3, memopt::TrainerOptions().grad_clip(0));
    CHECK(max_abs_diff(normal, in_backward) <= 1e-6);
  }
  // With 8-bit state per parameter: the weights of offload::Int8State's one AdamW8bit.
  const auto int8 = weights_after<memopt::checkpoint::None, memopt::precision::Fp32, memopt::offload::Int8State>(
      3, memopt::TrainerOptions().grad_clip(0));
  const auto int8_in_backward =
      weights_after<memopt::checkpoint::None, memopt::precision::Fp32, memopt::offload::StepInBackwardInt8>(
          3, memopt::TrainerOptions().grad_clip(0));
  CHECK(max_abs_diff(int8, int8_in_backward) <= 1e-6);

  // Plain LibTorch use: after backward every parameter is updated and holds no gradient.
  torch::manual_seed(0);
  memopt::models::Llama model(tiny_llama(0.0));
  const auto adamw = torch::optim::AdamWOptions(1e-2);
  std::vector<torch::Tensor> params = model->parameters();
  memopt::optim::StepInBackward opt(memopt::optim::single_group(params, adamw), adamw);
  const auto before = params_of(*model);
  const Batch batch = random_batch(2, 16, 64, 5);
  model->loss_sum(batch, memopt::checkpoint::None{}).backward();
  CHECK(opt.updated_this_step() == static_cast<int64_t>(params.size()));
  for (auto& p : params) CHECK_FALSE(p.grad().defined());
  const auto after = params_of(*model);
  for (size_t i = 0; i < params.size(); ++i) CHECK(max_abs_diff({before[i]}, {after[i]}) > 0);
  int64_t numel = 0;
  for (auto& p : params) numel += p.numel();
  CHECK(opt.state_bytes() == 8 * numel);  // exp_avg + exp_avg_sq, fp32
  opt.step();

  // A second backward in the same step would update twice: rejected.
  model->loss_sum(batch, memopt::checkpoint::None{}).backward();
  CHECK_THROWS_WITH(model->loss_sum(batch, memopt::checkpoint::None{}).backward(),
                    Catch::Contains("second gradient before step()") && Catch::Contains("HINT"));
}

TEST_CASE("StepInBackward with accumulation or clipping is rejected", "[offload]") {
  memopt::models::Llama model(tiny_llama(0.0));
  using InBackward = memopt::Trainer<memopt::checkpoint::None, memopt::precision::Fp32, memopt::accum::Runtime,
                                     memopt::offload::StepInBackward>;
  CHECK_THROWS_WITH(InBackward(*model, memopt::TrainerOptions().grad_clip(0).accum_steps(2)),
                    Catch::Contains("1 micro-batch per step (got accumulation over 2)") && Catch::Contains("HINT"));
  CHECK_THROWS_WITH(InBackward(*model, memopt::TrainerOptions().grad_clip(1.0)),
                    Catch::Contains("global gradient norm (got grad_clip 1)") && Catch::Contains("HINT"));
  CHECK_NOTHROW(InBackward(*model, memopt::TrainerOptions().grad_clip(0)));
  // accum::Fixed<N > 1> with StepInBackward does not compile: tests/compile_fail.
}

TEST_CASE("An accum_steps the Accum policy would ignore is an error", "[accum]") {
  memopt::models::Llama model(tiny_llama(0.0));
  using Fixed2 = memopt::Trainer<memopt::checkpoint::None, memopt::precision::Fp32, memopt::accum::Fixed<2>>;
  memopt::test::require_error([&] { Fixed2(*model, memopt::TrainerOptions().accum_steps(3)); }, "memopt::Trainer",
                              {"accum_steps is 3", "accum::Fixed<2>", "runs 2 micro-batch"});
  memopt::test::require_error([&] { memopt::Trainer<>(*model, memopt::TrainerOptions().accum_steps(4)); },
                              "memopt::Trainer", {"accum_steps is 4", "accum::None", "accum::Runtime"});
  CHECK(Fixed2(*model, memopt::TrainerOptions().accum_steps(2)).accum().micro_steps() == 2);  // the same count
  CHECK(Fixed2(*model, memopt::TrainerOptions()).accum().micro_steps() == 2);                 // left at 1
  using Runtime = memopt::Trainer<memopt::checkpoint::None, memopt::precision::Fp32, memopt::accum::Runtime>;
  CHECK(Runtime(*model, memopt::TrainerOptions().accum_steps(3)).accum().micro_steps() == 3);
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
    T trainer(*model, memopt::TrainerOptions().threads(1).lr(lr).warmup_steps(0).max_steps(20).grad_clip(1.0));
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
  using Fp32Trainer = memopt::Trainer<memopt::checkpoint::None, memopt::precision::Fp32>;
  using PureTrainer = memopt::Trainer<memopt::checkpoint::EveryBlock, memopt::precision::Bf16Pure>;
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

TEST_CASE("offload::Disk: LibTorch's AdamW update with the state in a file", "[offload]") {
  memopt::test::TempDir dir("memopt_disk");
  auto disk = [&](int64_t chunk) {
    return memopt::offload::Disk(memopt::optim::DiskAdamWOptions().directory(dir.path.string()).chunk_elements(chunk));
  };
  const auto normal = weights_after<memopt::checkpoint::None, memopt::precision::Fp32, memopt::offload::None>(
      3, memopt::TrainerOptions());
  // Chunks of 100 elements split most tensors mid-row; one chunk per tensor also works.
  for (int64_t chunk : {int64_t{100}, int64_t{1} << 20}) {
    INFO("chunk " << chunk);
    const auto on_disk = weights_after<memopt::checkpoint::None, memopt::precision::Fp32, memopt::offload::Disk>(
        3, memopt::TrainerOptions(), disk(chunk));
    CHECK(max_abs_diff(normal, on_disk) <= 1e-6);
  }
  CHECK(std::filesystem::is_empty(dir.path));  // the state file was unlinked at once

  // State size, residency, and save -> load -> the same next step.
  torch::manual_seed(0);
  memopt::models::Llama model(tiny_llama(0.0));
  auto adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  auto params = model->parameters();
  int64_t numel = 0, largest = 0;
  for (auto& p : params) {
    numel += p.numel();
    largest = std::max(largest, p.numel());
  }
  memopt::optim::DiskAdamW opt(memopt::optim::single_group(params, adamw), adamw, disk(256).options);
  CHECK(opt.state_bytes_on_disk() == 8 * numel);
  CHECK(opt.resident_state_bytes() == 3 * 2 * 256 * 4);
  const Batch batch = random_batch(2, 16, 64, 5);
  auto train_step = [&](torch::optim::Optimizer& o) {
    o.zero_grad();
    model->loss_sum(batch, memopt::checkpoint::None{}).backward();
    o.step();
  };
  train_step(opt);
  train_step(opt);
  std::stringstream saved;
  {
    torch::serialize::OutputArchive archive;
    opt.save(archive);
    archive.save_to(saved);
  }
  const auto weights = params_of(*model);
  train_step(opt);
  const auto continued = params_of(*model);
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) params[i].copy_(weights[i]);
  }
  memopt::optim::DiskAdamW fresh(memopt::optim::single_group(params, adamw), adamw, disk(1000).options);
  torch::serialize::InputArchive archive;
  archive.load_from(saved);
  fresh.load(archive);
  train_step(fresh);
  CHECK(max_abs_diff(continued, params_of(*model)) <= 1e-7);
  CHECK(max_abs_diff(continued, weights) > 1e-4);  // the step did something

  memopt::test::require_error(
      [&] {
        memopt::optim::DiskAdamW bad(memopt::optim::single_group(params, adamw), adamw,
                                     memopt::optim::DiskAdamWOptions().directory("/nonexistent/memopt"));
      },
      "memopt::optim::DiskAdamW: cannot create the state file", {"'/nonexistent/memopt'", "No such file"});
  memopt::test::require_error(
      [&] { memopt::offload::PinnedHost{}.make_optimizer(memopt::optim::single_group(params, adamw), adamw); },
      "memopt::offload::PinnedHost: parameters must live on a CUDA device", {"cpu"});
}

TEST_CASE("log_performance_info names LibTorch, threads, BLAS, CPU features and the policies", "[runtime]") {
  using T = memopt::Trainer<memopt::checkpoint::EveryNth<2>, memopt::precision::Bf16Autocast, memopt::accum::Fixed<4>,
                            memopt::offload::None>;
  CHECK(memopt::detail::policy_name<memopt::accum::Fixed<4>>() == "accum::Fixed<4>");
  CHECK(memopt::detail::policy_name<memopt::checkpoint::EveryBlock>() == "checkpoint::EveryBlock");
  std::map<std::string, std::string> info;
  for (const auto& [label, value] : memopt::performance_info()) info[label] = value;
  CHECK_THAT(info.at("libtorch"), Catch::StartsWith(TORCH_VERSION));
  CHECK_THAT(info.at("threads"), Catch::StartsWith(std::to_string(at::get_num_threads()) + " intra-op"));
  CHECK_THAT(info.at("cpu features"), Catch::Contains("avx512f"));
  CHECK(!info.at("blas").empty());
  std::FILE* file = std::tmpfile();
  REQUIRE(file != nullptr);
  memopt::log_performance_info<T>(file);
  std::rewind(file);
  std::string text;
  for (int c = std::fgetc(file); c != EOF; c = std::fgetc(file)) text += static_cast<char>(c);
  std::fclose(file);
  CHECK_THAT(text, Catch::Contains("trainer: Trainer<checkpoint::EveryNth<2>, precision::Bf16Autocast, "
                                   "accum::Fixed<4>, offload::None>"));
  CHECK_THAT(text, Catch::Contains("blas: "));
}
