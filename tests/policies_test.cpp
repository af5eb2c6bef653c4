// Tests for the policies and the Trainer (include/memopt/policies/*.hpp, trainer.hpp):
// checkpointing gives the gradients of no checkpointing (dropout on), accumulation equals
// the big batch (ragged targets included), bf16 autocast keeps fp32 master state, and
// options are validated with a HINT.
#include <catch2/catch.hpp>

#include <memopt/memopt.hpp>

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
  CHECK(max_abs_diff(plain, every) <= 1e-6);
  CHECK(max_abs_diff(plain, nth) <= 1e-6);

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
