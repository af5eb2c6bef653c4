// memopt/policies/recompute.hpp — recompute policies (activation checkpointing). A model runs each
// block through `ckpt.run_block(i, block, fn, inputs)`; the policy decides whether the
// block's activations are kept (None) or recomputed in backward (EveryBlock, EveryNth<N>);
// parts of a block run through memopt::run_cheap() are recomputed by Selective.
// Works for any torch::nn::Module: see run_sequential() and models/llama.hpp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "memopt/concepts.hpp"
#include "memopt/detail/checkpoint_function.hpp"
#include "memopt/memory/policy_desc.hpp"

namespace memopt::recompute {

/// Keeps every activation (fastest, most memory).
struct None {
  static std::string name() { return "recompute::None"; }
  static memory::RecomputeDesc describe() { return {.flag = "none"}; }
  torch::Tensor run_block(int64_t, torch::nn::Module& block, const BlockFn& fn,
                          const std::vector<torch::Tensor>& inputs) const {
    return memopt::detail::run_block(block, fn, inputs, /*recompute=*/false);
  }
};

/// Recomputes every block in backward: keeps only each block's input.
///   x = memopt::recompute::EveryBlock{}.run_block(i, *layer, fn, {x});
struct EveryBlock {
  static std::string name() { return "recompute::EveryBlock"; }
  static memory::RecomputeDesc describe() {
    return {.flag = "every", .whole_block = [](int64_t, int64_t) { return true; }};
  }
  torch::Tensor run_block(int64_t, torch::nn::Module& block, const BlockFn& fn,
                          const std::vector<torch::Tensor>& inputs) const {
    return memopt::detail::run_block(block, fn, inputs, /*recompute=*/true);
  }
};

/// Recomputes blocks 0, N, 2N, …: 1/N of the blocks, trading memory for less recompute.
template <int N>
struct EveryNth {
  static std::string name() { return "recompute::EveryNth<" + std::to_string(N) + ">"; }
  static_assert(N >= 1, "memopt::recompute::EveryNth<N>: N must be >= 1");
  static memory::RecomputeDesc describe() {
    return {.flag = N == 1 ? std::string("every") : "every-" + std::to_string(N),
            .whole_block = [](int64_t index, int64_t) { return index % N == 0; }};
  }
  torch::Tensor run_block(int64_t index, torch::nn::Module& block, const BlockFn& fn,
                          const std::vector<torch::Tensor>& inputs) const {
    return memopt::detail::run_block(block, fn, inputs, /*recompute=*/index % N == 0);
  }
};

/// Megatron's selective recomputation: blocks run whole, but their compute-cheap,
/// memory-heavy parts (the attention core's scores and softmax, RMSNorm, the SwiGLU
/// product — whatever the model runs through memopt::run_cheap) are recomputed in
/// backward, while the matmul outputs stay. Memory between None and EveryBlock, time
/// close to None.
struct Selective {
  static std::string name() { return "recompute::Selective"; }
  static memory::RecomputeDesc describe() { return {.flag = "selective", .cheap_parts = true}; }
  torch::Tensor run_block(int64_t, torch::nn::Module& block, const BlockFn& fn,
                          const std::vector<torch::Tensor>& inputs) const {
    return memopt::detail::run_block(block, fn, inputs, /*recompute=*/false);
  }
  torch::Tensor run_cheap(const BlockFn& fn, const std::vector<torch::Tensor>& inputs,
                          const std::vector<torch::Tensor>& params) const {
    return memopt::detail::checkpointed(fn, inputs, params);
  }
};

}  // namespace memopt::recompute

namespace memopt {

/// Runs a cheap, memory-heavy part of a block (`params`: the trainable tensors it uses)
/// under a recompute policy: recomputed in backward by recompute::Selective, plain
/// otherwise (inside an EveryBlock block it is recomputed with the block anyway).
///   y = memopt::run_cheap(ckpt, [](const auto& in) { return torch::silu(in[0]) * in[1]; }, {gate, up});
template <RecomputePolicy Recompute>
torch::Tensor run_cheap(const Recompute& ckpt, const BlockFn& fn, const std::vector<torch::Tensor>& inputs,
                        const std::vector<torch::Tensor>& params = {}) {
  if constexpr (hooks::RunCheap<Recompute>) {
    return ckpt.run_cheap(fn, inputs, params);
  } else {
    return fn(inputs);
  }
}

/// Runs a torch::nn::Sequential of single-input blocks under a recompute policy: the
/// shortest way to give a user-defined model recomputation.
///   x = memopt::run_sequential(ckpt, blocks_, x);   // blocks_: torch::nn::Sequential
template <RecomputePolicy Recompute>
torch::Tensor run_sequential(const Recompute& ckpt, const torch::nn::Sequential& blocks, torch::Tensor x) {
  int64_t index = 0;
  for (const auto& any : *blocks) {
    auto module = any;  // shallow copy: shares the module, outlives this call
    x = ckpt.run_block(index++, *any.ptr(),
                       [module](const std::vector<torch::Tensor>& in) mutable { return module.forward(in[0]); }, {x});
  }
  return x;
}

}  // namespace memopt
