// memopt/concepts.hpp — the four policy concepts of Trainer<Checkpoint, Precision,
// Accum, Offload>. Each concept is built from one-hook concepts, so a policy that
// lacks a hook fails to compile with a message naming that hook.
#pragma once

#include <concepts>
#include <cstdint>
#include <memory>
#include <vector>

#include <torch/torch.h>

#include "memopt/detail/checkpoint_function.hpp"  // BlockFn

namespace memopt {
namespace hooks {

// ---- Checkpoint: how a block of the model runs ----
/// `p.run_block(index, block, fn, inputs)` returns fn(inputs), checkpointed or not.
template <class P>
concept RunBlock = requires(const P& p, int64_t index, torch::nn::Module& block, const BlockFn& fn,
                            const std::vector<torch::Tensor>& inputs) {
  { p.run_block(index, block, fn, inputs) } -> std::same_as<torch::Tensor>;
};

/// Optional: `p.run_cheap(fn, inputs, params)` runs a compute-cheap, memory-heavy part of a
/// block (attention scores and softmax, norms, activation functions): kept or recomputed
/// (checkpoint::Selective). Without it the part just runs. Models call memopt::run_cheap().
template <class P>
concept RunCheap = requires(const P& p, const BlockFn& fn, const std::vector<torch::Tensor>& inputs) {
  { p.run_cheap(fn, inputs, inputs) } -> std::same_as<torch::Tensor>;
};

// ---- Precision: the dtype the forward runs in, and how loss and step are taken ----
/// `p.autocast(device_type)` returns an RAII guard held around the forward.
template <class P>
concept Autocast = requires(const P& p, c10::DeviceType device) { p.autocast(device); };
/// `p.backward(loss)` backpropagates a (possibly scaled) loss.
template <class P>
concept Backward = requires(P& p, const torch::Tensor& loss) { p.backward(loss); };
/// `p.step(optimizer)` steps; returns false when it skipped the step (inf/nan grads).
template <class P>
concept Step = requires(P& p, torch::optim::Optimizer& opt) {
  { p.step(opt) } -> std::convertible_to<bool>;
};

/// Optional: `p.prepare_grads(optimizer)` turns the backward's gradients into the true
/// gradients of the optimizer's parameters, before clipping (Scaled: ÷ the loss scale;
/// Bf16Pure: bf16 gradients → fp32 master gradients). Without it they are used as they are.
template <class P>
concept PrepareGrads = requires(P& p, torch::optim::Optimizer& opt) { p.prepare_grads(opt); };
/// Optional: `p.master_groups(groups)` gives the optimizer other tensors to own than the
/// model's parameters (Bf16Pure: fp32 masters of bf16 weights).
template <class P>
concept MasterGroups = requires(P& p, std::vector<torch::optim::OptimizerParamGroup> groups) {
  { p.master_groups(std::move(groups)) } -> std::same_as<std::vector<torch::optim::OptimizerParamGroup>>;
};

// ---- Accum: how many micro-batches make one optimizer step ----
/// `p.micro_steps()` is the number of micro-batches per optimizer step.
template <class P>
concept MicroSteps = requires(const P& p) {
  { p.micro_steps() } -> std::convertible_to<int64_t>;
};

// ---- Offload: where optimizer state lives ----
/// `p.make_optimizer(groups, options)` builds the optimizer that owns the state.
template <class P>
concept MakeOptimizer = requires(P& p, std::vector<torch::optim::OptimizerParamGroup> groups,
                                 const torch::optim::AdamWOptions& options) {
  { p.make_optimizer(std::move(groups), options) } -> std::convertible_to<std::unique_ptr<torch::optim::Optimizer>>;
};
/// `p.before_step(optimizer)`: bring the state in (no-op when it never left).
template <class P>
concept BeforeStep = requires(P& p, torch::optim::Optimizer& opt) { p.before_step(opt); };
/// `p.after_step(optimizer)`: send the state out again.
template <class P>
concept AfterStep = requires(P& p, torch::optim::Optimizer& opt) { p.after_step(opt); };

/// Optional: `P::kStepsInBackward` true means the optimizer updates each parameter during
/// backward, as soon as its gradient is ready (offload::StepInBackward).
template <class P>
concept StepsInBackward = requires { requires P::kStepsInBackward; };

}  // namespace hooks

/// How blocks run: plain, or recomputed in backward (checkpoint::None, EveryBlock, EveryNth<N>).
template <class P>
concept CheckpointPolicy = hooks::RunBlock<P>;

/// The forward's dtype and the backward/step it implies (precision::Fp32, Bf16Autocast,
/// Bf16Pure, Fp16Scaled).
template <class P>
concept PrecisionPolicy = hooks::Autocast<P> && hooks::Backward<P> && hooks::Step<P>;

/// Micro-batches per optimizer step (accum::None, Fixed<N>, Runtime).
template <class P>
concept AccumPolicy = hooks::MicroSteps<P>;

/// Where optimizer state lives and when it steps (offload::None, StepInBackward, ...).
template <class P>
concept OffloadPolicy = hooks::MakeOptimizer<P> && hooks::BeforeStep<P> && hooks::AfterStep<P>;

}  // namespace memopt
