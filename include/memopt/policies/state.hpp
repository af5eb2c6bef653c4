// memopt/policies/state.hpp — optimizer-state policies: which optimizer holds AdamW's state,
// in what form, and where it lives between steps. state::Resident keeps LibTorch's AdamW state
// where the parameters are (stepped by ATen's fused AdamW kernel); state::Int8 keeps it there in 8 bits (optim::AdamW8bit); Disk and
// PinnedHost offload it; StepInBackward updates each parameter inside backward.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "memopt/detail/optimizer_state.hpp"
#include "memopt/memory/policy_desc.hpp"
#include "memopt/optim/adamw8bit.hpp"
#include "memopt/optim/disk_adamw.hpp"
#include "memopt/optim/fused_adamw.hpp"
#include "memopt/optim/step_in_backward.hpp"

namespace memopt::state {

namespace detail {
/// optim::AdamW8bit's state: 2 B/param plus a scale per block of each moment; parameters under
/// min_8bit_size keep fp32 moments.
inline int64_t int8_state_bytes(const std::vector<int64_t>& numels) {
  int64_t bytes = 0;
  for (int64_t n : numels)
    bytes += n < optim::AdamW8bitOptions().min_8bit_size() ? 8 * n : 2 * n + 8 * optim::num_quant_blocks(n);
  return bytes;
}
}  // namespace detail

/// Replaces both AdamW moments of every parameter that has state (none before the first step)
/// with `fn(moment, param)`: for policies that move or recast AdamW's state around the step
/// (PinnedHost; examples/04_custom_policy's bf16 moments).
///   memopt::state::for_each_adamw_moment(opt, [](const auto& m, const auto&) { return m.to(torch::kFloat); });
template <class Fn>
void for_each_adamw_moment(torch::optim::Optimizer& optimizer, Fn&& fn) {
  for (auto& group : optimizer.param_groups())
    for (auto& p : group.params()) {
      auto it = optimizer.state().find(memopt::detail::optimizer_state_key(optimizer.state(), p));
      if (it == optimizer.state().end()) continue;
      auto& s = static_cast<torch::optim::AdamWParamState&>(*it->second);
      s.exp_avg(fn(s.exp_avg(), p));
      s.exp_avg_sq(fn(s.exp_avg_sq(), p));
    }
}

/// State stays where the parameters are, in torch::optim::AdamW's form; the step is ATen's fused
/// AdamW kernel (optim::FusedAdamW: one pass a parameter, no temporaries).
struct Resident {
  static std::string name() { return "state::Resident"; }
  static memory::StateDesc describe() { return {.flag = "resident", .fused_step = optim::kFusedAdamW}; }
  std::unique_ptr<torch::optim::Optimizer> make_optimizer(std::vector<torch::optim::OptimizerParamGroup> groups,
                                                          const torch::optim::AdamWOptions& options) const {
    return std::make_unique<optim::FusedAdamW>(std::move(groups), options);
  }
  void before_step(torch::optim::Optimizer&) const {}
  void after_step(torch::optim::Optimizer&) const {}
};

/// Each parameter is updated inside backward, as soon as its gradient is ready, and its
/// gradient freed (optim::StepInBackward): the gradients never all exist at once. `Inner`
/// is the per-parameter optimizer: torch::optim::AdamW (StepInBackward) or optim::AdamW8bit
/// (StepInBackwardInt8: no gradients and 8-bit state). The Trainer rejects it with
/// accumulation, global-norm clipping or loss scaling.
///   memopt::Trainer<memopt::recompute::EveryBlock, memopt::precision::Bf16Autocast,
///                   memopt::accum::None, memopt::state::StepInBackward> t(*model, opts.grad_clip(0));
template <class Inner>
struct StepInBackwardWith {
  static std::string name() {
    return std::is_same_v<Inner, torch::optim::AdamW> ? "state::StepInBackward" : "state::StepInBackwardInt8";
  }
  static constexpr bool kStepsInBackward = true;
  static memory::StateDesc describe() {
    constexpr bool int8 = !std::is_same_v<Inner, torch::optim::AdamW>;
    return {.flag = int8 ? "step-in-backward-int8" : "step-in-backward",
            .resident = int8 ? memory::StateBytes(detail::int8_state_bytes) : memory::adamw_state_bytes,
            .step_bytes_per_param = int8 ? 40.0 : 28.0,
            .steps_in_backward = true};
  }
  std::unique_ptr<torch::optim::Optimizer> make_optimizer(std::vector<torch::optim::OptimizerParamGroup> groups,
                                                          const torch::optim::AdamWOptions& options) const {
    return std::make_unique<optim::StepInBackward>(
        std::move(groups), options, [](const torch::Tensor& p, const torch::optim::AdamWOptions& o) {
          return std::unique_ptr<torch::optim::Optimizer>(std::make_unique<Inner>(std::vector<torch::Tensor>{p}, o));
        });
  }
  void before_step(torch::optim::Optimizer&) const {}
  void after_step(torch::optim::Optimizer&) const {}
};
using StepInBackward = StepInBackwardWith<torch::optim::AdamW>;
using StepInBackwardInt8 = StepInBackwardWith<optim::AdamW8bit>;

/// Both AdamW moments 8-bit block-quantised where the parameters are, in
/// optim::AdamW8bit: ~2 B/param of state instead of 8 (parameters under 4096 elements keep fp32).
///   memopt::Trainer<memopt::recompute::None, memopt::precision::Fp32, memopt::accum::None,
///                   memopt::state::Int8> trainer(*model, options);
struct Int8 {
  static std::string name() { return "state::Int8"; }
  /// 8-bit moments; the (de)quantisation makes the step's traffic 40 B/param.
  static memory::StateDesc describe() {
    return {.flag = "int8", .resident = detail::int8_state_bytes, .step_bytes_per_param = 40};
  }
  Int8() = default;
  /// E.g. the token embedding's state in fp32, as bitsandbytes does:
  ///   memopt::state::Int8(memopt::optim::AdamW8bitOptions().fp32_params({model->model->embed_tokens->weight}))
  explicit Int8(optim::AdamW8bitOptions state_options) : options(std::move(state_options)) {}
  std::unique_ptr<torch::optim::Optimizer> make_optimizer(std::vector<torch::optim::OptimizerParamGroup> groups,
                                                          const torch::optim::AdamWOptions& adamw) const {
    return std::make_unique<optim::AdamW8bit>(std::move(groups), adamw, options);
  }
  void before_step(torch::optim::Optimizer&) const {}
  void after_step(torch::optim::Optimizer&) const {}
  optim::AdamW8bitOptions options;
};

/// AdamW state in a file, streamed through three chunk buffers at each step
/// (optim::DiskAdamW): the resident set holds 3 chunks of state instead of 8 B/param.
/// CPU training; pass the folder (fast local disk) or let it use $MEMOPT_OFFLOAD_DIR / the temp folder.
///   using T = memopt::Trainer<memopt::recompute::EveryBlock, memopt::precision::Fp32,
///                             memopt::accum::None, memopt::state::Disk>;
///   T trainer(*model, options, {}, memopt::state::Disk(memopt::optim::DiskAdamWOptions().directory("/nvme")));
struct Disk {
  static std::string name() { return "state::Disk"; }
  /// Resident: three (2, chunk) fp32 buffers; each step reads and writes the state.
  static memory::StateDesc describe() {
    return {.flag = "disk",
            .resident = [](const std::vector<int64_t>& numels) {
              int64_t largest = 1;
              for (int64_t n : numels) largest = std::max(largest, n);
              return 3 * 2 * 4 * std::min(optim::DiskAdamWOptions().chunk_elements(), largest);
            },
            .disk_bytes_per_param = 16,
            .needs_cpu = true};
  }
  Disk() = default;
  explicit Disk(optim::DiskAdamWOptions options) : options(std::move(options)) {}
  std::unique_ptr<torch::optim::Optimizer> make_optimizer(std::vector<torch::optim::OptimizerParamGroup> groups,
                                                          const torch::optim::AdamWOptions& adamw) const {
    return std::make_unique<optim::DiskAdamW>(std::move(groups), adamw, options);
  }
  void before_step(torch::optim::Optimizer&) const {}
  void after_step(torch::optim::Optimizer&) const {}
  optim::DiskAdamWOptions options;
};

/// CUDA training: AdamW's state waits in pinned host memory between steps and visits the
/// device only for the step (copies overlap on the current stream), so between steps —
/// forward and backward, where activations peak — the device holds no optimizer state.
/// Needs parameters on a CUDA device: on CPU parameters it stops with a clear error.
struct PinnedHost {
  static std::string name() { return "state::PinnedHost"; }
  /// No state on the device between steps; AdamW's whole state during the step, 16 B/param
  /// each way over the host link.
  static memory::StateDesc describe() {
    return {.flag = "pinned-host",
            .resident = [](const std::vector<int64_t>&) { return int64_t{0}; },
            .at_step = memory::adamw_state_bytes,
            .host_bytes_per_param = 32,
            .needs_cuda = true,
            .fused_step = optim::kFusedAdamW};
  }
  std::unique_ptr<torch::optim::Optimizer> make_optimizer(std::vector<torch::optim::OptimizerParamGroup> groups,
                                                          const torch::optim::AdamWOptions& options) const {
    for (const auto& group : groups)
      for (const auto& p : group.params())
        TORCH_CHECK(p.is_cuda(), "memopt::state::PinnedHost: parameters must live on a CUDA device (got one on ",
                    p.device(), "). HINT: move the model to CUDA first; on the CPU use state::Disk or state::Int8.");
    return std::make_unique<optim::FusedAdamW>(std::move(groups), options);
  }
  /// Host → device: the state the step needs.
  void before_step(torch::optim::Optimizer& optimizer) const {
    for_each_adamw_moment(optimizer, [](const torch::Tensor& m, const torch::Tensor& param) {
      return m.to(param.device(), /*non_blocking=*/true);
    });
  }
  /// Device → pinned host: frees the device copy. The step returns once the copies have landed,
  /// so what reads the state on the host next (a checkpoint, the metrics) sees this step's values.
  void after_step(torch::optim::Optimizer& optimizer) const {
    std::optional<c10::DeviceIndex> device;
    for_each_adamw_moment(optimizer, [&device](const torch::Tensor& m, const torch::Tensor& param) {
      device = param.device().index();
      auto host = torch::empty(m.sizes(), m.options().device(torch::kCPU).pinned_memory(true));
      return host.copy_(m, /*non_blocking=*/true);
    });
    if (device) torch::cuda::synchronize(*device);
  }

};

}  // namespace memopt::state
