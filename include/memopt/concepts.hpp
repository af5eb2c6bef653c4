// memopt/concepts.hpp — the four policy concepts of Trainer<Recompute, Precision,
// Accum, State>. Each concept is built from one-hook concepts, so a policy that
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

// ---- Recompute: how a block of the model runs ----
/// `p.run_block(index, block, fn, inputs)` returns fn(inputs), recomputed in backward or not.
template <class P>
concept RunBlock = requires(const P& p, int64_t index, torch::nn::Module& block, const BlockFn& fn,
                            const std::vector<torch::Tensor>& inputs) {
  { p.run_block(index, block, fn, inputs) } -> std::same_as<torch::Tensor>;
};

/// Optional: `p.run_cheap(fn, inputs, params)` runs a compute-cheap, memory-heavy part of a
/// block (attention scores and softmax, norms, activation functions): kept or recomputed
/// (recompute::Selective). Without it the part just runs. Models call memopt::run_cheap().
template <class P>
concept RunCheap = requires(const P& p, const BlockFn& fn, const std::vector<torch::Tensor>& inputs) {
  { p.run_cheap(fn, inputs, inputs) } -> std::same_as<torch::Tensor>;
};

// ---- Precision: the dtype the forward runs in, and how loss and step are taken ----
/// `p.autocast(device_type)` returns an RAII guard held around the forward.
template <class P>
concept Autocast = requires(const P& p, c10::DeviceType device) { p.autocast(device); };
/// Optional: `P::kMatmulDtype`, the dtype its autocast casts matmul weights to (ZeRO-3's
/// TrainerOptions::gather_half all-gathers a block's matrices in it).
template <class P>
concept MatmulDtype = requires {
  { P::kMatmulDtype } -> std::convertible_to<c10::ScalarType>;
};
/// `p.backward(loss)` backpropagates a (possibly scaled) loss.
template <class P>
concept Backward = requires(P& p, const torch::Tensor& loss) { p.backward(loss); };
/// `p.step(optimizer)` steps; returns false when it skipped the step (inf/nan grads).
template <class P>
concept Step = requires(P& p, torch::optim::Optimizer& opt) {
  { p.step(opt) } -> std::convertible_to<bool>;
};

/// Optional: `p.prepare(device_type)` readies the process for this precision on that device,
/// once, when the Trainer is built — before any step, outside the tracked step and its memory
/// budget (on the CPU: Fp32 fp32_gemm::enable(); Bf16Autocast, Bf16Pure that and bf16_gemm::enable()).
template <class P>
concept PrepareDevice = requires(P& p, c10::DeviceType device) { p.prepare(device); };
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
/// Optional, with MasterGroups: `p.cast_weights(params)` gives parameters whose masters another
/// rank keeps (a sharded optimizer state) the form master_groups gives its own (Bf16Pure: bf16).
template <class P>
concept CastWeights = requires(P& p, const std::vector<torch::Tensor>& params) { p.cast_weights(params); };

/// Optional: `p.skip_step()` is called when the Trainer skips a step on a non-finite loss or
/// gradient norm (Scaled: the loss scale backs off). Without it nothing happens.
template <class P>
concept SkipStep = requires(P& p) { p.skip_step(); };
/// Optional: `P::kSkipsOnLocalGrads` true means step() decides from this rank's gradients
/// whether to skip (Scaled's inf/nan check), so a sharded optimizer state needs the Trainer's
/// check of the global gradient norm (TrainerOptions::skip_nonfinite) for the ranks to agree.
template <class P>
concept SkipsOnLocalGrads = requires { requires P::kSkipsOnLocalGrads; };

// ---- Accum: how many micro-batches make one optimizer step ----
/// `p.micro_steps()` is the number of micro-batches per optimizer step.
template <class P>
concept MicroSteps = requires(const P& p) {
  { p.micro_steps() } -> std::convertible_to<int64_t>;
};

/// Optional: `P::kRunsMicroBatch` true means the policy runs each micro-batch's forward and
/// backward itself, `p.forward_backward(batch, loss_fn, ckpt, precision, device, scale)`
/// (accum::GradCache: representations in chunks, with cached gradients).
template <class P>
concept RunsMicroBatch = requires { requires P::kRunsMicroBatch; };

// ---- State: where optimizer state lives ----
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
/// backward, as soon as its gradient is ready (state::StepInBackward).
template <class P>
concept StepsInBackward = requires { requires P::kStepsInBackward; };

// ---- Any policy: what it does to memory and time ----
/// `P::describe()` returns the policy's description (memory/policy_desc.hpp: RecomputeDesc,
/// DtypeDesc, SplitDesc or StateDesc): its flag spelling and its memory and time effects. The
/// Trainer runs without it; the estimator, the planner, dispatch and the flags need it.
template <class P, class Desc>
concept Describes = requires {
  { P::describe() } -> std::convertible_to<Desc>;
};

// ---- Any policy: state a resumed run needs ----
/// Optional: `p.save_state(archive)` writes the policy's state into the Trainer's archive
/// (trainer.pt) and `p.load_state(archive)` reads it back (Scaled: the loss scale; Bf16Pure:
/// the fp32 master weights). Without it the policy has no state to save.
template <class P>
concept SavesState = requires(const P& cp, P& p, torch::serialize::OutputArchive& out,
                              torch::serialize::InputArchive& in) {
  cp.save_state(out);
  p.load_state(in);
};

}  // namespace hooks

/// How blocks run: plain, or recomputed in backward (recompute::None, EveryBlock, EveryNth<N>).
template <class P>
concept RecomputePolicy = hooks::RunBlock<P>;

/// The forward's dtype and the backward/step it implies (precision::Fp32, Bf16Autocast,
/// Bf16Pure, Fp16Scaled).
template <class P>
concept PrecisionPolicy = hooks::Autocast<P> && hooks::Backward<P> && hooks::Step<P>;

/// Micro-batches per optimizer step (accum::None, Fixed<N>, Runtime).
template <class P>
concept AccumPolicy = hooks::MicroSteps<P>;

/// A loss built on representations (a contrastive loss over embeddings), split into its stages
/// so accum::GradCache can run the encoder in chunks. For a batch b:
///   f.roles(b)                        encoder inputs of b (GritLM: 2, queries and passages)
///   f.rows(b, role)                   rows of that input
///   f.encode(b, role, begin, end, c)  (end − begin, D) representations of rows [begin, end)
///   f.rep_loss(b, reps)               0-dim loss from every role's (rows, D) representations
///   f.gen_rows(b)                     rows of the part that needs no cache (GritLM: generative; may be 0)
///   f.gen_loss(b, begin, end, c)      that part's loss on rows [begin, end): its share of the
///                                     whole, so the shares of all chunks add up to the loss
/// and f(b, c) is the whole loss: rep_loss(all reps) + gen_loss(all rows).
template <class F, class B, class C>
concept RepresentationLoss = requires(F& f, const B& b, const C& ckpt, int64_t i,
                                      const std::vector<torch::Tensor>& reps) {
  { f.roles(b) } -> std::convertible_to<int64_t>;
  { f.rows(b, i) } -> std::convertible_to<int64_t>;
  { f.encode(b, i, i, i, ckpt) } -> std::convertible_to<torch::Tensor>;
  { f.rep_loss(b, reps) } -> std::convertible_to<torch::Tensor>;
  { f.gen_rows(b) } -> std::convertible_to<int64_t>;
  { f.gen_loss(b, i, i, ckpt) } -> std::convertible_to<torch::Tensor>;
};

/// Where optimizer state lives and when it steps (state::Resident, StepInBackward, ...).
template <class P>
concept StatePolicy = hooks::MakeOptimizer<P> && hooks::BeforeStep<P> && hooks::AfterStep<P>;

}  // namespace memopt
