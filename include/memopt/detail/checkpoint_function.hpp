// memopt/detail/checkpoint_function.hpp — not API. Activation checkpointing as a custom
// autograd Function (LibTorch C++ has none): forward runs the block without saving its
// activations; backward replays it with the RNG and autocast state of the forward, so
// dropout draws the same masks, and returns the block's input and parameter gradients.
#pragma once

#include <atomic>
#include <functional>
#include <vector>

#include <torch/torch.h>

#include "memopt/detail/autocast.hpp"
#include "memopt/detail/version.hpp"

#if MEMOPT_HAS_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/CUDAContext.h>
#endif

namespace memopt {

/// A block's computation: its tensor inputs in, one tensor out. Checkpointing calls it
/// twice (forward, then the recompute in backward), so capture by value.
using BlockFn = std::function<torch::Tensor(const std::vector<torch::Tensor>&)>;

namespace detail {

// Sets a thread-local flag (a function returning a reference to it) for a scope.
template <bool& (*Flag)()>
class ScopedFlag {
 public:
  explicit ScopedFlag(bool on) : previous_(Flag()) { Flag() = on; }
  ~ScopedFlag() { Flag() = previous_; }
  ScopedFlag(const ScopedFlag&) = delete;
  ScopedFlag& operator=(const ScopedFlag&) = delete;

 private:
  bool previous_;
};

// Whether checkpointed blocks save the RNG state in forward and replay it in backward
// (PyTorch's preserve_rng_state): on by default. Read in forward, on the thread that runs it;
// backward replays what forward saved. The Trainer sets it for each step from
// TrainerOptions::preserve_rng_state (PreserveRng); a model without dropout or other random
// ops loses nothing with it off and saves the RNG copies of every checkpointed block.
inline bool& preserve_rng_state() {
  thread_local bool on = true;
  return on;
}

// Sets preserve_rng_state() for a scope.
using PreserveRng = ScopedFlag<preserve_rng_state>;

// Whether this thread is running a checkpointed block's recompute (replay()). There the
// block's output is the root of the block's backward and its value is never read, so a model
// may build the graph of what only feeds that output without computing it
// (nn::Linear::forward_to_output skips such a GEMM, as PyTorch's non-reentrant checkpoint stops
// its recompute early). False inside a checkpointed forward, where every value is read.
inline bool& replaying() {
  thread_local bool on = false;
  return on;
}

// Sets replaying() for a scope.
using Replaying = ScopedFlag<replaying>;

// Carries a BlockFn through AutogradContext::saved_data (an IValue capsule).
struct BlockFnHolder : torch::CustomClassHolder {
  explicit BlockFnHolder(BlockFn f) : fn(std::move(f)) {}
  BlockFn fn;
};

// Random-number state of the devices a block may draw from (CPU always, the current
// CUDA device in CUDA builds).
struct RngState {
  torch::Tensor cpu;
#if MEMOPT_HAS_CUDA
  torch::Tensor cuda;
#endif

  static RngState capture() {
    RngState s;
    auto gen = at::detail::getDefaultCPUGenerator();
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      s.cpu = gen.get_state();
    }
#if MEMOPT_HAS_CUDA
    if (at::cuda::is_available()) {
      auto cg = at::cuda::detail::getDefaultCUDAGenerator();
      std::lock_guard<std::mutex> lock(cg.mutex());
      s.cuda = cg.get_state();
    }
#endif
    return s;
  }

  void restore() const {
    auto gen = at::detail::getDefaultCPUGenerator();
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(cpu);
    }
#if MEMOPT_HAS_CUDA
    if (cuda.defined()) {
      auto cg = at::cuda::detail::getDefaultCUDAGenerator();
      std::lock_guard<std::mutex> lock(cg.mutex());
      cg.set_state(cuda);
    }
#endif
  }
};

// Saves in `ctx` what a recompute replays: the RNG state (when preserve_rng_state()) and the
// autocast state of the forward.
inline void save_replay_state(torch::autograd::AutogradContext* ctx) {
  if (preserve_rng_state()) {  // dropout in the recompute draws the forward's masks
    const RngState rng = RngState::capture();
    ctx->saved_data["rng_cpu"] = rng.cpu;
#if MEMOPT_HAS_CUDA
    if (rng.cuda.defined()) ctx->saved_data["rng_cuda"] = rng.cuda;
#endif
  }
#if MEMOPT_HAS_CUDA
  const auto cuda_autocast = AutocastState::current(c10::kCUDA);
  ctx->saved_data["autocast_cuda"] = cuda_autocast.enabled;
  ctx->saved_data["autocast_cuda_dtype"] = static_cast<int64_t>(cuda_autocast.dtype);
#endif
  const auto cpu_autocast = AutocastState::current(c10::kCPU);
  ctx->saved_data["autocast_cpu"] = cpu_autocast.enabled;
  ctx->saved_data["autocast_cpu_dtype"] = static_cast<int64_t>(cpu_autocast.dtype);
}

// Runs fn(inputs) again under grad mode with the RNG and autocast state save_replay_state()
// kept (the RNG as it was afterwards, so the rest of backward sees its own draws).
inline torch::Tensor replay(torch::autograd::AutogradContext* ctx, const BlockFn& fn,
                            const std::vector<torch::Tensor>& inputs) {
  const bool replay_rng = ctx->saved_data.count("rng_cpu") > 0;
  RngState forward_rng, outer_rng;
  if (replay_rng) {
    forward_rng.cpu = ctx->saved_data["rng_cpu"].toTensor();
#if MEMOPT_HAS_CUDA
    if (ctx->saved_data.count("rng_cuda")) forward_rng.cuda = ctx->saved_data["rng_cuda"].toTensor();
#endif
    outer_rng = RngState::capture();
  }
  torch::Tensor output;
  {
    if (replay_rng) forward_rng.restore();
    AutocastGuard cpu_autocast({c10::kCPU, ctx->saved_data["autocast_cpu"].toBool(),
                                static_cast<c10::ScalarType>(ctx->saved_data["autocast_cpu_dtype"].toInt())});
#if MEMOPT_HAS_CUDA
    AutocastGuard cuda_autocast({c10::kCUDA, ctx->saved_data["autocast_cuda"].toBool(),
                                 static_cast<c10::ScalarType>(ctx->saved_data["autocast_cuda_dtype"].toInt())});
#endif
    torch::AutoGradMode enable_grad(true);
    Replaying replaying(true);  // the output is backward's root: its value is not read
    output = fn(inputs);
  }
  if (replay_rng) outer_rng.restore();  // the rest of backward sees the RNG as it was
  return output;
}

// Inputs to apply(): the block's tensor inputs followed by its parameters. Parameters
// are inputs so their gradients flow through the normal AccumulateGrad path (and the
// node exists even when no data input requires grad).
struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const BlockFn& fn, int64_t num_inputs,
                               at::TensorList inputs_and_params) {
    std::vector<torch::Tensor> inputs(inputs_and_params.begin(), inputs_and_params.begin() + num_inputs);
    ctx->saved_data["fn"] = c10::IValue::make_capsule(c10::make_intrusive<BlockFnHolder>(fn));
    ctx->saved_data["num_inputs"] = num_inputs;
    save_replay_state(ctx);
    ctx->save_for_backward(inputs_and_params.vec());  // references only: no activations
    Replaying values_read(false);                     // a nested checkpoint's output is read
    return fn(inputs);                                 // runs under no-grad: nothing saved
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const int64_t num_inputs = ctx->saved_data["num_inputs"].toInt();
    const auto holder = ctx->saved_data["fn"].toCapsule();
    const BlockFn& fn = static_cast<BlockFnHolder*>(holder.get())->fn;

    // Detached copies of the inputs are the recompute's leaves; parameters are used as
    // they are (the block's own modules reference them).
    std::vector<torch::Tensor> inputs;
    std::vector<torch::Tensor> wrt;
    std::vector<int64_t> wrt_index;
    for (int64_t i = 0; i < static_cast<int64_t>(saved.size()); ++i) {
      torch::Tensor t = saved[i];
      if (i < num_inputs) {
        torch::Tensor leaf = t.detach();
        leaf.requires_grad_(t.requires_grad());
        inputs.push_back(leaf);
        t = leaf;
      }
      if (t.requires_grad()) {
        wrt.push_back(t);
        wrt_index.push_back(i);
      }
    }

    torch::autograd::variable_list grads(saved.size());
    if (wrt.empty() || !grad_outputs[0].defined()) return with_non_tensor_slots(std::move(grads));

    const torch::Tensor output = replay(ctx, fn, inputs);
    auto block_grads = torch::autograd::grad({output}, wrt, {grad_outputs[0]}, /*retain_graph=*/false,
                                             /*create_graph=*/false, /*allow_unused=*/true);
    for (size_t k = 0; k < wrt.size(); ++k) grads[wrt_index[k]] = block_grads[k];
    return with_non_tensor_slots(std::move(grads));
  }

 private:
  // backward returns one slot per forward argument: fn and num_inputs get none, and
  // the TensorList's elements are flattened after them.
  static torch::autograd::variable_list with_non_tensor_slots(torch::autograd::variable_list grads) {
    grads.insert(grads.begin(), 2, torch::Tensor());
    return grads;
  }
};

/// Runs `fn(inputs)` under activation checkpointing for a block with `params`.
inline torch::Tensor checkpointed(const BlockFn& fn, const std::vector<torch::Tensor>& inputs,
                                  const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> all = inputs;
  all.insert(all.end(), params.begin(), params.end());
  return CheckpointFunction::apply(fn, static_cast<int64_t>(inputs.size()), at::TensorList(all));
}

// The parameters of `block` that require grad (what checkpointed() passes on).
inline std::vector<torch::Tensor> trainable(torch::nn::Module& block) {
  std::vector<torch::Tensor> params;
  for (auto& p : block.parameters())
    if (p.requires_grad()) params.push_back(p);
  return params;
}

// Where a block runs when a component owns its parameters: dist::Zero3 gathers a block's
// sharded parameters around its forward and its recompute. One per process at a time.
class BlockRunner {
 public:
  virtual ~BlockRunner() = default;
  // fn(inputs) for a block this runner owns; an undefined tensor for any other block.
  virtual torch::Tensor run(torch::nn::Module& block, const BlockFn& fn, const std::vector<torch::Tensor>& inputs) = 0;
};

inline std::atomic<BlockRunner*>& block_runner() {
  static std::atomic<BlockRunner*> runner{nullptr};
  return runner;
}

/// How the recompute policies run a block: through the block runner when one owns it, else
/// fn(inputs), under activation checkpointing when `recompute`.
inline torch::Tensor run_block(torch::nn::Module& block, const BlockFn& fn, const std::vector<torch::Tensor>& inputs,
                               bool recompute) {
  if (BlockRunner* runner = block_runner().load()) {
    if (torch::Tensor y = runner->run(block, fn, inputs); y.defined()) return y;
  }
  return recompute ? checkpointed(fn, inputs, trainable(block)) : fn(inputs);
}

}  // namespace detail
}  // namespace memopt
