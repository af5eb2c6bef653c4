// memopt/optim/fused_adamw.hpp — torch::optim::AdamW whose step runs ATen's fused AdamW kernel
// (at::_fused_adamw_, what torch.optim.AdamW(fused=True) calls; CPU and CUDA since PyTorch 2.4):
// one pass over each parameter, its gradient and both moments, where LibTorch's C++ AdamW makes
// about ten (p·(1 − lr·wd), two moment updates, sqrt, a divide, an add, addcdiv) and allocates a
// temporary of the parameter's size for the denominator. Same state (AdamWParamState: step,
// exp_avg, exp_avg_sq), so saving, loading and every policy that reads the moments see an
// AdamW; the same update (the kernel interpolates the first moment, lerp, where AdamW multiplies
// and adds: roundings differ in the last bit). 30 M fp32 parameters, 2 cores: 22 ms a step
// against 77 for torch.optim.AdamW's loop (docs/benchmarks.md).
// Falls back to AdamW::step (per call) for a closure, amsgrad, sparse gradients, or a LibTorch
// before 2.4.
//   memopt::optim::FusedAdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-4).weight_decay(0.1));
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "memopt/detail/optimizer_state.hpp"
#include "memopt/detail/version.hpp"

namespace memopt::optim {

/// Whether FusedAdamW's step is the fused kernel in this LibTorch (else AdamW's).
inline constexpr bool kFusedAdamW = MEMOPT_TORCH_AT_LEAST(2, 4);

class FusedAdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;

  torch::Tensor step(LossClosure closure = nullptr) override {
#if MEMOPT_TORCH_AT_LEAST(2, 4)
    if (closure != nullptr || !fusable()) return torch::optim::AdamW::step(std::move(closure));
    torch::NoGradGuard no_grad;
    for (auto& group : param_groups()) {
      const auto& options = static_cast<const torch::optim::AdamWOptions&>(group.options());
      // One kernel call per device and dtype (a CUDA call takes one of each), as torch.optim does.
      std::map<std::pair<std::string, c10::ScalarType>, Lists> by_kind;
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        auto& s = state_of(p);
        s.step(s.step() + 1);
        auto& l = by_kind[{p.device().str(), p.scalar_type()}];
        l.params.push_back(p);
        l.grads.push_back(p.grad());
        l.exp_avgs.push_back(s.exp_avg());
        l.exp_avg_sqs.push_back(s.exp_avg_sq());
        l.steps.push_back(torch::full({}, static_cast<double>(s.step()), p.options().dtype(torch::kFloat)));
      }
      const auto [beta1, beta2] = options.betas();
      for (auto& [kind, l] : by_kind)
        at::_fused_adamw_(l.params, l.grads, l.exp_avgs, l.exp_avg_sqs, /*max_exp_avg_sqs=*/{}, l.steps, options.lr(),
                          beta1, beta2, options.weight_decay(), options.eps(), /*amsgrad=*/false, /*maximize=*/false);
    }
    return {};
#else
    return torch::optim::AdamW::step(std::move(closure));
#endif
  }

 private:
  struct Lists {
    std::vector<torch::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
  };

  // Whether every parameter with a gradient can take the fused kernel: dense gradients, no
  // amsgrad, a floating dtype, on the CPU or a CUDA device.
  bool fusable() const {
    for (const auto& group : param_groups()) {
      if (static_cast<const torch::optim::AdamWOptions&>(group.options()).amsgrad()) return false;
      for (const auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        if (p.grad().is_sparse() || !p.is_floating_point() || !(p.is_cpu() || p.is_cuda())) return false;
      }
    }
    return true;
  }

  // p's AdamW state, created as AdamW::step creates it (step 0, zero moments) on first use.
  torch::optim::AdamWParamState& state_of(const torch::Tensor& p) {
    const auto key = memopt::detail::optimizer_state_key(state(), p);
    auto it = state().find(key);
    if (it == state().end()) {
      auto s = std::make_unique<torch::optim::AdamWParamState>();
      s->step(0);
      s->exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
      s->exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
      it = state().emplace(key, std::move(s)).first;
    }
    return static_cast<torch::optim::AdamWParamState&>(*it->second);
  }
};

}  // namespace memopt::optim
