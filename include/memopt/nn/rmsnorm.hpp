// memopt/nn/rmsnorm.hpp — RMSNorm as in LLaMA: normalise in fp32 by the root mean
// square over the last dimension, cast back to the input's dtype, scale by a learned weight
// (so, as in HF's LlamaRMSNorm, an fp32 weight makes a bf16 input's result fp32). With
// fused(true) it runs nn/fused.hpp's one-pass kernel on the CPU (same values, ≤ 1e-6 in fp32).
#pragma once

#include <torch/torch.h>

#include "memopt/nn/fused.hpp"

namespace memopt::nn {

/// Options for RMSNorm.  RMSNorm(RMSNormOptions(512).eps(1e-6))
struct RMSNormOptions {
  explicit RMSNormOptions(int64_t dim) : dim_(dim) {}
  TORCH_ARG(int64_t, dim);
  TORCH_ARG(double, eps) = 1e-5;
  /// nn::fused_rms_norm (one pass each way, fp32/bf16 CPU tensors) instead of the composite.
  TORCH_ARG(bool, fused) = false;
};

/// y = weight · x / sqrt(mean(x²) + eps), computed in fp32.
class RMSNormImpl : public torch::nn::Cloneable<RMSNormImpl> {
 public:
  explicit RMSNormImpl(RMSNormOptions options) : options(options) { reset(); }
  void reset() override { weight = register_parameter("weight", torch::ones({options.dim()})); }

  torch::Tensor forward(const torch::Tensor& x) {  // (..., C) -> (..., C)
    return options.fused() ? fused_rms_norm(x, weight, options.eps()) : rms_norm_composite(x, weight, options.eps());
  }

  RMSNormOptions options;
  torch::Tensor weight;  // (C)
};
TORCH_MODULE(RMSNorm);

}  // namespace memopt::nn
