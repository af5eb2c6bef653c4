// memopt/nn/rmsnorm.hpp — RMSNorm as in LLaMA: normalise in fp32 by the root mean
// square over the last dimension, cast back to the input's dtype, scale by a learned weight
// (so, as in HF's LlamaRMSNorm, an fp32 weight makes a bf16 input's result fp32).
#pragma once

#include <torch/torch.h>

namespace memopt::nn {

/// Options for RMSNorm.  RMSNorm(RMSNormOptions(512).eps(1e-6))
struct RMSNormOptions {
  explicit RMSNormOptions(int64_t dim) : dim_(dim) {}
  TORCH_ARG(int64_t, dim);
  TORCH_ARG(double, eps) = 1e-5;
};

/// y = weight · x / sqrt(mean(x²) + eps), computed in fp32.
class RMSNormImpl : public torch::nn::Cloneable<RMSNormImpl> {
 public:
  explicit RMSNormImpl(RMSNormOptions options) : options(options) { reset(); }
  void reset() override { weight = register_parameter("weight", torch::ones({options.dim()})); }

  torch::Tensor forward(const torch::Tensor& x) {  // (..., C) -> (..., C)
    auto h = x.to(torch::kFloat);
    h = h * torch::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + options.eps());
    return weight * h.to(x.scalar_type());
  }

  RMSNormOptions options;
  torch::Tensor weight;  // (C)
};
TORCH_MODULE(RMSNorm);

}  // namespace memopt::nn
