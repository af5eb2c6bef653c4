// memopt/optim/clip.hpp — gradient norm clipping without a host sync: the norm and the
// clip coefficient stay tensors, so a CUDA step never waits on the host.
#pragma once

#include <vector>

#include <torch/torch.h>

namespace memopt::optim {

/// The L2 norm of each defined gradient of `params`, as a (k,) fp32 tensor (k may be 0) on the
/// first one's device (ZeRO-3's host-offloaded shards and a GPU's replicated tensors mix).
inline torch::Tensor grad_norms(const std::vector<torch::Tensor>& params) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> norms;
  for (const auto& p : params) {
    if (!p.grad().defined()) continue;
    torch::Tensor norm = at::linalg_vector_norm(p.grad(), 2, c10::nullopt, false, torch::kFloat);
    norms.push_back(norms.empty() ? norm : norm.to(norms.front().device()));
  }
  return norms.empty() ? torch::zeros({0}) : torch::stack(norms);
}

/// Scales the gradients of `params` by min(1, max_norm / (norm + 1e-6)), `norm` being their
/// global norm (a 0-dim tensor); max_norm <= 0 leaves them as they are.
inline void clip_grads_to_(const std::vector<torch::Tensor>& params, const torch::Tensor& norm, double max_norm) {
  if (max_norm <= 0) return;
  torch::NoGradGuard no_grad;
  const torch::Tensor coef = (max_norm / (norm + 1e-6)).clamp_max(1.0);
  for (const auto& p : params)
    if (p.grad().defined()) p.grad().mul_(coef.to(p.grad().device(), p.grad().scalar_type()));
}

/// Clips the global L2 norm of the gradients to `max_norm` (<= 0: measure only).
/// Returns the norm before clipping as a 0-dim fp32 tensor.
///   auto norm = memopt::optim::clip_grad_norm_(params, 1.0);
inline torch::Tensor clip_grad_norm_(const std::vector<torch::Tensor>& params, double max_norm) {
  torch::Tensor norm = grad_norms(params).norm();  // as torch.nn.utils.clip_grad_norm_
  clip_grads_to_(params, norm, max_norm);
  return norm;
}

}  // namespace memopt::optim
