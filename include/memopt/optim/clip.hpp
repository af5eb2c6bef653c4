// memopt/optim/clip.hpp — gradient norm clipping without a host sync: the norm and the
// clip coefficient stay tensors, so a CUDA step never waits on the host.
#pragma once

#include <vector>

#include <torch/torch.h>

namespace memopt::optim {

/// Clips the global L2 norm of the gradients of `measured` to `max_norm` (<= 0: measure
/// only), scaling the gradients of `scaled`. Returns the norm before clipping as a 0-dim fp32
/// tensor. A sharded optimizer measures every parameter and scales the ones it steps.
///   auto norm = memopt::optim::clip_grad_norm_(owned, all_params, 1.0);
inline torch::Tensor clip_grad_norm_(const std::vector<torch::Tensor>& scaled, const std::vector<torch::Tensor>& measured,
                                     double max_norm) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> norms;
  for (const auto& p : measured)
    if (p.grad().defined()) norms.push_back(at::linalg_vector_norm(p.grad(), 2, c10::nullopt, false, torch::kFloat));
  if (norms.empty()) return torch::zeros({});
  torch::Tensor norm = torch::stack(norms).norm();
  if (max_norm > 0) {
    const torch::Tensor coef = (max_norm / (norm + 1e-6)).clamp_max(1.0);
    for (const auto& p : scaled)
      if (p.grad().defined()) p.grad().mul_(coef.to(p.grad().scalar_type()));
  }
  return norm;
}

/// Clips the global L2 norm of the gradients to `max_norm` (<= 0: measure only).
/// Returns the norm before clipping as a 0-dim fp32 tensor.
///   auto norm = memopt::optim::clip_grad_norm_(params, 1.0);
inline torch::Tensor clip_grad_norm_(const std::vector<torch::Tensor>& params, double max_norm) {
  return clip_grad_norm_(params, params, max_norm);
}

}  // namespace memopt::optim
