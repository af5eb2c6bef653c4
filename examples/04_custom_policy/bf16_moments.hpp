// examples/04_custom_policy/bf16_moments.hpp — a policy memopt does not ship, in one struct:
// AdamW whose two moments wait between steps in bf16 (4 B/param instead of 8), widened to fp32
// for the step and rounded back stochastically, so the moments are unbiased in expectation
// (torchao's bf16 stochastic-rounding AdamW keeps its state the same way). Its random
// generator is its state: a resumed run continues the same rounding stream, bit for bit.
//
// Nothing outside this struct names it: the Trainer builds it (hooks::MakeOptimizer,
// BeforeStep, AfterStep), the estimator, the planner, dispatch and the --optimizer_state flag read its
// describe(), and a training checkpoint saves its generator (hooks::SavesState).
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <memopt/memory/policy_desc.hpp>
#include <memopt/policies/state.hpp>  // for_each_adamw_moment

namespace custom {

struct Bf16Moments {
  static std::string name() { return "custom::Bf16Moments"; }

  /// Resident between steps: 2 × 2 B/param. During the step: AdamW's fp32 moments (8 B/param).
  /// Traffic: AdamW's 28 B/param, widening 12, stochastic rounding ~24 (noise, add, mask, cast).
  static memopt::memory::StateDesc describe() {
    return {.flag = "bf16-moments",
            .resident = [](const std::vector<int64_t>& numels) { return 4 * memopt::memory::sum(numels); },
            .at_step = memopt::memory::adamw_state_bytes,
            .step_bytes_per_param = 28 + 12 + 24};
  }

  explicit Bf16Moments(uint64_t seed = 0x5eed) : generator_(at::make_generator<at::CPUGeneratorImpl>(seed)) {}

  std::unique_ptr<torch::optim::Optimizer> make_optimizer(std::vector<torch::optim::OptimizerParamGroup> groups,
                                                          const torch::optim::AdamWOptions& options) const {
    return std::make_unique<torch::optim::AdamW>(std::move(groups), options);
  }
  /// bf16 → fp32 for the step (no state before the first one).
  void before_step(torch::optim::Optimizer& optimizer) const {
    memopt::state::for_each_adamw_moment(optimizer, [](const torch::Tensor& m, const torch::Tensor&) { return m.to(torch::kFloat); });
  }
  /// fp32 → bf16, stochastically rounded, in the parameters' order (the noise stream is the same
  /// in every run with the same seed and steps).
  void after_step(torch::optim::Optimizer& optimizer) const {
    memopt::state::for_each_adamw_moment(optimizer, [this](const torch::Tensor& m, const torch::Tensor&) { return round_to_bf16(m); });
  }

  void save_state(torch::serialize::OutputArchive& archive) const {
    archive.write("bf16_moments_generator", generator_.get_state());
  }
  void load_state(torch::serialize::InputArchive& archive) {
    torch::Tensor state;
    TORCH_CHECK(archive.try_read("bf16_moments_generator", state), "custom::Bf16Moments::load_state: the archive has "
                "no 'bf16_moments_generator' entry. HINT: resume a checkpoint written with --optimizer_state bf16-moments.");
    generator_.set_state(state);
  }

 private:
  /// Adds uniform noise below bf16's last mantissa bit to the fp32 bit pattern, then truncates:
  /// x rounds up with probability (x − down) / (up − down). Exact: the low 16 bits are zero.
  torch::Tensor round_to_bf16(const torch::Tensor& x) const {
    auto noise = torch::randint(0, 1 << 16, x.sizes(), generator_, torch::TensorOptions(torch::kInt32));
    auto bits = x.contiguous().view(torch::kInt32) + noise.to(x.device());
    return bits.bitwise_and_(static_cast<int32_t>(0xFFFF0000u)).view(torch::kFloat).to(torch::kBFloat16);
  }

  mutable at::Generator generator_;
};

}  // namespace custom
