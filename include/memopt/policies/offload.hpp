// memopt/policies/offload.hpp — offload policies: which optimizer holds the state and
// where that state lives between steps. offload::None keeps LibTorch's AdamW state in
// RAM (or device memory); later policies quantize it or move it to disk.
#pragma once

#include <memory>
#include <vector>

#include <torch/torch.h>

namespace memopt::offload {

/// State stays where the parameters are, in torch::optim::AdamW.
struct None {
  std::unique_ptr<torch::optim::Optimizer> make_optimizer(std::vector<torch::optim::OptimizerParamGroup> groups,
                                                          const torch::optim::AdamWOptions& options) const {
    return std::make_unique<torch::optim::AdamW>(std::move(groups), options);
  }
  void before_step(torch::optim::Optimizer&) const {}
  void after_step(torch::optim::Optimizer&) const {}
};

}  // namespace memopt::offload
