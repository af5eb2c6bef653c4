// memopt/policies/precision.hpp — precision policies: the dtype the forward computes in,
// and the backward and optimizer step that go with it. Master weights, their gradients
// and the optimizer state stay fp32 in both policies here.
#pragma once

#include <torch/torch.h>

#include "memopt/detail/autocast.hpp"

namespace memopt::precision {

/// Everything in fp32.
struct Fp32 {
  static constexpr c10::ScalarType kComputeDtype = c10::kFloat;
  struct NoGuard {};
  NoGuard autocast(c10::DeviceType) const { return {}; }
  void backward(const torch::Tensor& loss) const { loss.backward(); }
  bool step(torch::optim::Optimizer& optimizer) const {
    optimizer.step();
    return true;
  }
};

/// Autocast to bf16 (matmuls and linear layers run in bf16 — AMX on CPUs that have it),
/// fp32 master weights and gradients. The guard restores the previous autocast state
/// and clears the cast cache, so the next step casts the updated weights again.
struct Bf16Autocast {
  static constexpr c10::ScalarType kComputeDtype = c10::kBFloat16;
  memopt::detail::AutocastGuard autocast(c10::DeviceType device) const {
    return memopt::detail::AutocastGuard({device, true, c10::kBFloat16});
  }
  void backward(const torch::Tensor& loss) const { loss.backward(); }
  bool step(torch::optim::Optimizer& optimizer) const {
    optimizer.step();
    return true;
  }
};

}  // namespace memopt::precision
