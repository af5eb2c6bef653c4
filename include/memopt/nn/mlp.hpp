// memopt/nn/mlp.hpp — the SwiGLU feed-forward of LLaMA: down(silu(gate(x)) · up(x)),
// no biases, HF parameter names (gate_proj, up_proj, down_proj).
#pragma once

#include <vector>

#include <torch/torch.h>

#include "memopt/nn/fused.hpp"
#include "memopt/nn/linear.hpp"

#include "memopt/policies/recompute.hpp"

namespace memopt::nn {

/// Options for SwiGLU.  SwiGLU(SwiGLUOptions(512, 1408))
struct SwiGLUOptions {
  SwiGLUOptions(int64_t hidden_size, int64_t intermediate_size)
      : hidden_size_(hidden_size), intermediate_size_(intermediate_size) {}
  TORCH_ARG(int64_t, hidden_size);
  TORCH_ARG(int64_t, intermediate_size);
  /// nn::fused_swiglu for silu(gate) · up (one pass each way; keeps gate and up only).
  TORCH_ARG(bool, fused) = false;
};

class SwiGLUImpl : public torch::nn::Cloneable<SwiGLUImpl> {
 public:
  explicit SwiGLUImpl(SwiGLUOptions options) : options(options) { reset(); }
  void reset() override {
    const int64_t C = options.hidden_size(), F = options.intermediate_size();
    gate_proj = register_module("gate_proj", nn::Linear(torch::nn::LinearOptions(C, F).bias(false)));
    up_proj = register_module("up_proj", nn::Linear(torch::nn::LinearOptions(C, F).bias(false)));
    down_proj = register_module("down_proj", nn::Linear(torch::nn::LinearOptions(F, C).bias(false)));
  }
  torch::Tensor forward(const torch::Tensor& x) {  // (B, T, C) -> (B, T, C)
    return forward(x, recompute::None{});
  }
  /// recompute::Selective recomputes silu(gate) · up in backward; the matmul outputs stay.
  template <RecomputePolicy Recompute>
  torch::Tensor forward(const torch::Tensor& x, const Recompute& ckpt) {  // (B, T, C) -> (B, T, C)
    const bool fused = options.fused();
    auto gated = run_cheap(
        ckpt,
        [fused](const std::vector<torch::Tensor>& in) {
          return fused ? fused_swiglu(in[0], in[1]) : torch::silu(in[0]) * in[1];
        },
        {gate_proj(x), up_proj(x)});  // (B, T, F)
    return down_proj(gated);                             // (B, T, C)
  }

  SwiGLUOptions options;
  nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(SwiGLU);

}  // namespace memopt::nn
