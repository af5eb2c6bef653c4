// tests/policies/fixtures.hpp — what the policy and Trainer tests share: a tiny LLaMA, random
// and padded batches, gradients of a model under a recompute policy, a user-defined module with
// dropout, an optimizer-state policy that records the gradients the optimizer sees, and short runs.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <catch2/catch.hpp>

#include <memopt/memopt.hpp>

#include "support.hpp"

namespace memopt::test::policies {

using memopt::Batch;

inline memopt::models::LlamaConfig tiny_llama(double dropout) {
  return memopt::models::LlamaConfig()
      .vocab_size(64)
      .hidden_size(32)
      .num_hidden_layers(4)
      .num_attention_heads(4)
      .num_key_value_heads(2)
      .max_position_embeddings(32)
      .dropout(dropout);
}

inline Batch random_batch(int64_t B, int64_t T, int64_t vocab, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  auto tokens = torch::randint(vocab, {B, T + 1}, gen);
  return {tokens.slice(1, 0, T), tokens.slice(1, 1, T + 1)};
}

inline std::vector<torch::Tensor> grads_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> g;
  for (auto& p : m.parameters()) g.push_back(p.grad().defined() ? p.grad().clone() : torch::zeros_like(p));
  return g;
}

inline void zero_grads(torch::nn::Module& m) {
  for (auto& p : m.parameters()) p.mutable_grad() = torch::Tensor();
}

inline double max_abs_diff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  REQUIRE(a.size() == b.size());
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, (a[i] - b[i]).abs().max().item<double>());
  return d;
}

template <class Recompute>
inline std::vector<torch::Tensor> llama_grads(memopt::models::Llama& model, const Batch& batch, uint64_t dropout_seed) {
  zero_grads(*model);
  torch::manual_seed(dropout_seed);
  auto loss = model->loss_sum(batch, Recompute{}) / batch.num_targets();
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
  template <memopt::RecomputePolicy C>
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

template <class Recompute>
inline std::vector<torch::Tensor> user_grads(UserNet& net, const Batch& batch, uint64_t dropout_seed) {
  zero_grads(*net);
  torch::manual_seed(dropout_seed);
  (net->loss_sum(batch, Recompute{}) / batch.num_targets()).backward();
  return grads_of(*net);
}

// An optimizer-state policy that records the gradients the optimizer is about to use: lets a
// test see the accumulated, normalised gradients inside Trainer::step.
struct RecordGrads {
  std::shared_ptr<std::vector<torch::Tensor>> seen = std::make_shared<std::vector<torch::Tensor>>();
  std::unique_ptr<torch::optim::Optimizer> make_optimizer(std::vector<torch::optim::OptimizerParamGroup> groups,
                                                          const torch::optim::AdamWOptions& o) const {
    return memopt::state::Resident{}.make_optimizer(std::move(groups), o);
  }
  void before_step(torch::optim::Optimizer& opt) const {
    seen->clear();
    for (auto& group : opt.param_groups())
      for (auto& p : group.params()) seen->push_back(p.grad().clone());
  }
  void after_step(torch::optim::Optimizer&) const {}
};
static_assert(memopt::StatePolicy<RecordGrads>);

// Replays a fixed list of batches.
struct ListLoader {
  std::vector<Batch> batches;
  size_t next_index = 0;
  Batch next() { return batches.at(next_index++ % batches.size()); }
};

// Gives batch rows ragged padding: row r of micro-batch m ignores its last (r + m) % T targets.
inline Batch with_padding(Batch b, int64_t salt) {
  auto targets = b.targets.clone();
  for (int64_t r = 0; r < targets.size(0); ++r) {
    const int64_t pad = (r * 3 + salt * 5) % targets.size(1);
    if (pad > 0) targets[r].slice(0, targets.size(1) - pad).fill_(memopt::kIgnoreIndex);
  }
  return {b.inputs, targets};
}

inline Batch concat(const std::vector<Batch>& parts) {
  std::vector<torch::Tensor> in, tg;
  for (const auto& p : parts) {
    in.push_back(p.inputs);
    tg.push_back(p.targets);
  }
  return {torch::cat(in), torch::cat(tg)};
}

// The gradients the optimizer sees at the first step of a fresh tiny LLaMA (same init every
// call) on `device`, returned on the CPU.
template <class Accum, class Recompute = memopt::recompute::None>
inline std::vector<torch::Tensor> trainer_grads(const std::vector<Batch>& micro_batches, memopt::TrainerOptions opts,
                                                torch::Device device = torch::kCPU) {
  torch::manual_seed(7);
  memopt::models::Llama model(tiny_llama(0.0));
  model->to(device);
  memopt::Trainer<Recompute, memopt::precision::Fp32, Accum, RecordGrads> trainer(*model, opts.grad_clip(0));
  ListLoader loader{micro_batches};
  auto stats = trainer.step(loader, [&](const Batch& b, const auto& ckpt) { return model->loss_sum(b, ckpt); });
  REQUIRE(stats.step == 1);
  std::vector<torch::Tensor> seen;
  for (const auto& g : *trainer.optimizer_state().seen) seen.push_back(g.cpu());
  return seen;
}


inline std::vector<torch::Tensor> params_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (auto& p : m.parameters()) out.push_back(p.detach().to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true));
  return out;
}

// Trains a fresh tiny LLaMA (same init every call) on `device` for `steps` steps; returns its
// weights, on the CPU.
template <class Recompute, class Precision, class State>
inline std::vector<torch::Tensor> weights_after(int steps, memopt::TrainerOptions opts, State offload = {},
                                                torch::Device device = torch::kCPU) {
  torch::manual_seed(11);
  memopt::models::Llama model(tiny_llama(0.0));
  model->to(device);
  ListLoader loader{{random_batch(2, 16, 64, 21), random_batch(2, 16, 64, 22)}};
  memopt::Trainer<Recompute, Precision, memopt::accum::None, State> trainer(
      *model, opts.lr(1e-2).warmup_steps(2).max_steps(steps), {},
      std::move(offload));  // lr changes every step
  for (int s = 0; s < steps; ++s)
    REQUIRE(trainer.step(loader, [&](const Batch& b, const auto& ckpt) { return model->loss_sum(b, ckpt); }).stepped);
  return params_of(*model);
}

// The losses of `steps` steps of Trainer T on a fresh tiny LLaMA (same init and batches every
// call) on `device`.
template <class T>
inline std::vector<double> losses_of(torch::Device device, double lr, int steps) {
  torch::manual_seed(11);
  memopt::models::Llama model(tiny_llama(0.0));
  model->to(device);
  ListLoader loader{{random_batch(4, 16, 64, 21), random_batch(4, 16, 64, 22)}};
  T trainer(*model, memopt::TrainerOptions().lr(lr).warmup_steps(0).max_steps(steps).grad_clip(1.0));
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s)
    losses.push_back(trainer.step(loader, [&](const Batch& b, const auto& ckpt) { return model->loss_sum(b, ckpt); })
                         .loss.template item<double>());
  return losses;
}

}  // namespace memopt::test::policies
