// memopt/optim/param_groups.hpp — AdamW parameter groups the way LLM trainers set them:
// weight decay on matrices, none on norms, biases and embeddings.
#pragma once

#include <string>
#include <unordered_set>
#include <vector>

#include <torch/torch.h>

namespace memopt::optim {

/// True for parameters that take weight decay: 2-D or larger, and not an embedding.
inline bool takes_weight_decay(const std::string& name, const torch::Tensor& param) {
  return param.dim() >= 2 && name.find("embed") == std::string::npos;
}

/// Two groups (decay, no decay) of a module's trainable parameters. A tensor listed under two
/// names (LibTorch's named_parameters() lists a parameter registered in two modules twice)
/// goes in once, by its first name, as PyTorch's named_parameters() dedups; models::Llama's
/// tied head registers no second name anyway.
///   auto groups = memopt::optim::param_groups(model->named_parameters(), opts);
inline std::vector<torch::optim::OptimizerParamGroup> param_groups(
    const torch::OrderedDict<std::string, torch::Tensor>& named, const torch::optim::AdamWOptions& options) {
  std::vector<torch::Tensor> decay, no_decay;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : named) {
    if (!item.value().requires_grad() || !seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    (takes_weight_decay(item.key(), item.value()) ? decay : no_decay).push_back(item.value());
  }
  auto decay_options = std::make_unique<torch::optim::AdamWOptions>(options);
  auto no_decay_options = std::make_unique<torch::optim::AdamWOptions>(options);
  no_decay_options->weight_decay(0.0);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (!decay.empty()) groups.emplace_back(decay, std::move(decay_options));
  if (!no_decay.empty()) groups.emplace_back(no_decay, std::move(no_decay_options));
  return groups;
}

/// One group holding every parameter, with `options` (weight decay on all of them).
inline std::vector<torch::optim::OptimizerParamGroup> single_group(const std::vector<torch::Tensor>& params,
                                                                   const torch::optim::AdamWOptions& options) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(params, std::make_unique<torch::optim::AdamWOptions>(options));
  return groups;
}

}  // namespace memopt::optim
