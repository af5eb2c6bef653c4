// memopt/nn/rmsnorm.hpp — RMSNorm as in LLaMA: normalise in fp32 by the root mean
// square over the last dimension, cast back to the input's dtype, scale by a learned weight
// (so, as in HF's LlamaRMSNorm, an fp32 weight makes a bf16 input's result fp32). With
// fused(true) it runs nn/fused.hpp's one-pass kernel on the CPU (same values, ≤ 1e-6 in fp32),
// and with autocast_output(true) too, under autocast it returns autocast's dtype.
#pragma once

#include <optional>

#include <torch/torch.h>

#include "memopt/detail/autocast.hpp"
#include "memopt/nn/fused.hpp"

namespace memopt::nn {

/// Options for RMSNorm.  RMSNorm(RMSNormOptions(512).eps(1e-6))
struct RMSNormOptions {
  explicit RMSNormOptions(int64_t dim) : dim_(dim) {}
  TORCH_ARG(int64_t, dim);
  TORCH_ARG(double, eps) = 1e-5;
  /// nn::fused_rms_norm (one pass each way, fp32/bf16 CPU tensors) instead of the composite.
  TORCH_ARG(bool, fused) = false;
  /// With fused: under autocast (on x's device) the output in autocast's dtype, rounded once
  /// from the same fp32 values, for a norm whose consumers are Linear layers that would each
  /// cast it (LLaMA's q, k, v and gate, up): one bf16 tensor they share, where each kept a
  /// cast of its own; the consumers' gradients then add up in bf16 before the norm's backward.
  TORCH_ARG(bool, autocast_output) = false;
};

/// y = weight · x / sqrt(mean(x²) + eps), computed in fp32.
class RMSNormImpl : public torch::nn::Cloneable<RMSNormImpl> {
 public:
  explicit RMSNormImpl(RMSNormOptions options) : options(options) { reset(); }
  void reset() override { weight = register_parameter("weight", torch::ones({options.dim()})); }

  torch::Tensor forward(const torch::Tensor& x) {  // (..., C) -> (..., C)
    return options.fused() ? fused_rms_norm(x, weight, options.eps(), output_dtype(x))
                           : rms_norm_composite(x, weight, options.eps());
  }

  /// The dtype forward(x) rounds its output to: autocast's with autocast_output (and fused) while
  /// autocast is on for x's device; none (promote(x, weight)) otherwise.
  std::optional<c10::ScalarType> output_dtype(const torch::Tensor& x) const {
    if (!options.fused() || !options.autocast_output()) return std::nullopt;
    const auto autocast = memopt::detail::AutocastState::current(x.device().type());
    if (!autocast.enabled) return std::nullopt;
    return autocast.dtype;
  }

  RMSNormOptions options;
  torch::Tensor weight;  // (C)
};
TORCH_MODULE(RMSNorm);

}  // namespace memopt::nn
