// memopt/policies/precision.hpp — precision policies: the dtype the forward computes in,
// and the backward and optimizer step that go with it. The optimizer steps fp32 weights
// on fp32 gradients in every policy here: the model's own (Fp32, Bf16Autocast, Scaled) or
// fp32 masters of bf16 weights (Bf16Pure). Scaled<Dtype> (Fp16Scaled) adds dynamic loss
// scaling with torch.cuda.amp.GradScaler's semantics.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "memopt/bf16_gemm.hpp"
#include "memopt/fp32_gemm.hpp"
#include "memopt/detail/autocast.hpp"
#include "memopt/memory/policy_desc.hpp"

namespace memopt::detail {
/// Reads `key` of a Trainer's archive into `value`, or fails naming the key (the policies'
/// and the Trainer's load_state).
template <class T>
void read_state_entry(torch::serialize::InputArchive& archive, const std::string& key, T& value) {
  TORCH_CHECK(archive.try_read(key, value), "memopt::Trainer::load_state: the archive has no '", key,
              "' entry. HINT: load a state written by Trainer::save_state of a Trainer with the same policies.");
}
}  // namespace memopt::detail

namespace memopt::precision {

/// Everything in fp32.
struct Fp32 {
  static std::string name() { return "precision::Fp32"; }
  static memory::DtypeDesc describe() { return {.flag = "fp32"}; }
  /// On the CPU: fp32 GEMMs on brgemm where that beats LibTorch's (memopt/fp32_gemm.hpp).
  void prepare(c10::DeviceType device) const {
    if (device == c10::kCPU) fp32_gemm::enable();
  }
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
  static std::string name() { return "precision::Bf16Autocast"; }
  static memory::DtypeDesc describe() { return {.flag = "bf16", .half_matmuls = true}; }
  static constexpr c10::ScalarType kMatmulDtype = c10::kBFloat16;  // what autocast casts matmul weights to
  /// On the CPU: bf16 GEMMs at fp32 speed where the CPU has no bf16 units (memopt/bf16_gemm.hpp),
  /// fp32 ones (the widened bf16 ones among them) as Fp32's.
  void prepare(c10::DeviceType device) const {
    if (device != c10::kCPU) return;
    fp32_gemm::enable();
    bf16_gemm::enable();
  }
  memopt::detail::AutocastGuard autocast(c10::DeviceType device) const {
    return memopt::detail::AutocastGuard({device, true, c10::kBFloat16});
  }
  void backward(const torch::Tensor& loss) const { loss.backward(); }
  bool step(torch::optim::Optimizer& optimizer) const {
    optimizer.step();
    return true;
  }
};

/// Pure bf16: the model's weights, activations and gradients are bf16 (no casts in the
/// forward, half the activation bytes of autocast's fp32 norms and residual stream); the
/// optimizer owns fp32 master copies and steps on fp32 gradients, so updates smaller than
/// bf16's resolution (8 bits of mantissa: lr·update below ~0.4% of a weight) are not lost.
/// A master-weight scheme rather than a compensated bf16 update: it works with every
/// optimizer (AdamW, 8-bit AdamW, offloaded state) unchanged, and its update is the fp32 one.
/// Cost: 4 B/param of masters, plus fp32 gradients (4 B/param) at the optimizer step.
/// Build the model in fp32 as usual; the Trainer hands its parameters over (they become bf16).
struct Bf16Pure {
  static std::string name() { return "precision::Bf16Pure"; }
  static memory::DtypeDesc describe() { return {.flag = "bf16-pure", .half_matmuls = true, .half_weights = true}; }
  struct NoGuard {};
  void prepare(c10::DeviceType device) const { Bf16Autocast{}.prepare(device); }
  NoGuard autocast(c10::DeviceType) const { return {}; }  // the weights are bf16 already
  void backward(const torch::Tensor& loss) const { loss.backward(); }

  /// Keeps an fp32 master of every parameter (the optimizer's), turns the parameter bf16.
  std::vector<torch::optim::OptimizerParamGroup> master_groups(std::vector<torch::optim::OptimizerParamGroup> groups) {
    torch::NoGradGuard no_grad;
    std::vector<torch::optim::OptimizerParamGroup> out;
    for (auto& group : groups) {
      std::vector<torch::Tensor> masters;
      for (auto& p : group.params()) {
        TORCH_CHECK(p.is_floating_point(), "memopt::precision::Bf16Pure: parameters must be floating point (got ",
                    p.scalar_type(), "). HINT: keep integer buffers out of the optimizer.");
        auto master = p.detach().to(torch::kFloat, /*non_blocking=*/false, /*copy=*/true);  // fp32 copy
        cast_weights({p});
        pairs_.push_back({p, master});
        masters.push_back(master);
      }
      if (group.has_options()) {
        out.emplace_back(std::move(masters), group.options().clone());
      } else {
        out.emplace_back(std::move(masters));  // the optimizer's defaults
      }
    }
    return out;
  }

  /// Turns the parameters bf16: frozen ones (no master at all: LoRA's base) and those whose
  /// masters another rank keeps (sharded optimizer state).
  void cast_weights(const std::vector<torch::Tensor>& params) const {
    torch::NoGradGuard no_grad;
    for (auto p : params) p.set_data(p.detach().to(torch::kBFloat16));
  }

  /// bf16 gradients → fp32 master gradients, one parameter at a time (each bf16 one freed).
  void prepare_grads(torch::optim::Optimizer&) {
    torch::NoGradGuard no_grad;
    for (auto& [param, master] : pairs_) {
      if (!param.grad().defined()) continue;
      master.mutable_grad() = param.grad().to(torch::kFloat);
      param.mutable_grad() = torch::Tensor();
    }
  }

  /// Steps the masters, copies them back into the bf16 weights (round to nearest).
  bool step(torch::optim::Optimizer& optimizer) {
    optimizer.step();
    torch::NoGradGuard no_grad;
    for (auto& [param, master] : pairs_) {
      param.copy_(master);
      master.mutable_grad() = torch::Tensor();
    }
    return true;
  }

  /// The fp32 master of each parameter, in the optimizer's order: (bf16 weight, fp32 master).
  const std::vector<std::pair<torch::Tensor, torch::Tensor>>& masters() const { return pairs_; }

  /// The fp32 masters ("master_0", ...): a resumed run steps from them, not from the bf16 weights.
  void save_state(torch::serialize::OutputArchive& archive) const {
    for (size_t i = 0; i < pairs_.size(); ++i) archive.write("master_" + std::to_string(i), pairs_[i].second);
  }
  void load_state(torch::serialize::InputArchive& archive) {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < pairs_.size(); ++i) {
      torch::Tensor master;
      memopt::detail::read_state_entry(archive, "master_" + std::to_string(i), master);
      pairs_[i].second.copy_(master);
    }
  }

 private:
  std::vector<std::pair<torch::Tensor, torch::Tensor>> pairs_;
};

/// Dynamic loss scaling, GradScaler's defaults: start at 2^16, ×2 after
/// growth_interval clean steps in a row, ×0.5 and skip the step on an inf/nan gradient.
///   memopt::precision::LossScaleOptions().init_scale(1024).growth_interval(100)
struct LossScaleOptions {
  TORCH_ARG(double, init_scale) = 65536.0;
  TORCH_ARG(double, growth_factor) = 2.0;
  TORCH_ARG(double, backoff_factor) = 0.5;
  TORCH_ARG(int64_t, growth_interval) = 2000;

 public:
  void validate() const {
    TORCH_CHECK(init_scale_ > 0 && std::isfinite(init_scale_),
                "memopt::precision::LossScaleOptions: init_scale must be finite and > 0 (got ", init_scale_,
                "). HINT: 65536 (2^16) is GradScaler's default.");
    TORCH_CHECK(growth_factor_ > 1, "memopt::precision::LossScaleOptions: growth_factor must be > 1 (got ",
                growth_factor_, "). HINT: 2.0.");
    TORCH_CHECK(backoff_factor_ > 0 && backoff_factor_ < 1,
                "memopt::precision::LossScaleOptions: backoff_factor must lie in (0, 1) (got ", backoff_factor_,
                "). HINT: 0.5.");
    TORCH_CHECK(growth_interval_ >= 1, "memopt::precision::LossScaleOptions: growth_interval must be >= 1 (got ",
                growth_interval_, "). HINT: 2000 clean steps.");
  }
};

/// The loss scaler: scale the loss, unscale the gradients (checking them for inf/nan),
/// step unless one was found, update the scale. One host sync per step (the skip test),
/// as in GradScaler.
///   scaler.scale(loss).backward(); scaler.unscale(opt); clip(...); scaler.step(opt); scaler.update();
class LossScaler {
 public:
  explicit LossScaler(LossScaleOptions options = {}) : options_(validated(options)), scale_(options.init_scale()) {}

  torch::Tensor scale(const torch::Tensor& loss) const { return loss * scale_; }

  /// Divides every gradient of `optimizer` by the scale and records whether any is inf/nan.
  void unscale(torch::optim::Optimizer& optimizer) {
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> sums;
    for (auto& group : optimizer.param_groups())
      for (auto& p : group.params())
        if (p.grad().defined()) {
          p.grad().mul_(1.0 / scale_);
          sums.push_back(p.grad().sum(c10::nullopt, false, torch::kFloat));  // inf/nan propagate into the sum
        }
    found_inf_ = sums.empty() ? torch::zeros({}, torch::kBool) : torch::stack(sums).isfinite().all().logical_not();
    unscaled_ = true;
  }

  /// Steps unless unscale() found an inf/nan gradient; returns whether it stepped.
  bool step(torch::optim::Optimizer& optimizer) {
    if (!unscaled_) unscale(optimizer);
    last_found_inf_ = found_inf_.item<bool>();  // the host sync
    if (!last_found_inf_) optimizer.step();
    return !last_found_inf_;
  }

  /// The Trainer skipped the step (a non-finite loss or gradient norm): back off as update() does.
  void skip() {
    last_found_inf_ = true;
    update();
  }

  /// Backs off after a skipped step, grows after growth_interval clean ones.
  void update() {
    if (last_found_inf_) {
      scale_ *= options_.backoff_factor();
      clean_steps_ = 0;
      skipped_steps_ += 1;
    } else if (++clean_steps_ == options_.growth_interval()) {
      scale_ *= options_.growth_factor();
      clean_steps_ = 0;
    }
    unscaled_ = false;
  }

  double current_scale() const { return scale_; }
  int64_t skipped_steps() const { return skipped_steps_; }
  int64_t clean_steps() const { return clean_steps_; }
  const LossScaleOptions& options() const { return options_; }
  /// Restores the scale and the clean-step count (a resumed run).
  void load(double scale, int64_t clean_steps) {
    TORCH_CHECK(scale > 0 && std::isfinite(scale), "memopt::precision::LossScaler: scale must be finite and > 0 (got ",
                scale, "). HINT: pass the value current_scale() returned.");
    scale_ = scale;
    clean_steps_ = clean_steps;
  }

 private:
  static LossScaleOptions validated(LossScaleOptions o) {
    o.validate();
    return o;
  }

  LossScaleOptions options_;
  double scale_;
  int64_t clean_steps_ = 0;
  int64_t skipped_steps_ = 0;
  torch::Tensor found_inf_ = torch::zeros({}, torch::kBool);
  bool unscaled_ = false;
  bool last_found_inf_ = false;
};

/// Autocast to `Dtype` with dynamic loss scaling (fp32 master weights, gradients and
/// state). Fp16Scaled is the one to use: fp16's 5 exponent bits underflow small
/// gradients without scaling. Scaled<c10::kFloat> scales without autocast (tests).
/// LibTorch's CPU autocast supports bf16 only and the CPU has no fp16 matmul, so
/// Fp16Scaled needs a CUDA device: on the CPU, use Bf16Autocast (bf16 needs no scaling).
template <c10::ScalarType Dtype>
struct Scaled {
  static std::string name() {
    return Dtype == c10::kHalf ? "precision::Fp16Scaled" : std::string("precision::Scaled<") + c10::toString(Dtype) + ">";
  }
  static_assert(Dtype == c10::kHalf || Dtype == c10::kBFloat16 || Dtype == c10::kFloat,
                "memopt::precision::Scaled<Dtype>: Dtype must be kHalf, kBFloat16 or kFloat");
  static memory::DtypeDesc describe() {
    return {.flag = Dtype == c10::kHalf ? std::string("fp16") : Dtype == c10::kBFloat16 ? "bf16-scaled" : "fp32-scaled",
            .half_matmuls = Dtype != c10::kFloat,
            .needs_cuda = Dtype == c10::kHalf};
  }

  memopt::detail::AutocastGuard autocast(c10::DeviceType device) const {
    TORCH_CHECK(!(Dtype == c10::kHalf && device == c10::kCPU),
                "memopt::precision::Fp16Scaled: fp16 autocast needs a CUDA device (got a model on cpu): "
                "LibTorch's CPU autocast supports bf16 only and has no fp16 matmul. "
                "HINT: use memopt::precision::Bf16Autocast on the CPU (bf16 needs no loss scaling).");
    if constexpr (Dtype == c10::kFloat) {
      return memopt::detail::AutocastGuard(memopt::detail::AutocastState::current(device));  // unchanged
    } else {
      return memopt::detail::AutocastGuard({device, true, Dtype});
    }
  }
  void backward(const torch::Tensor& loss) const { scaler_.scale(loss).backward(); }
  /// Before clipping: the gradients become true gradients again.
  void prepare_grads(torch::optim::Optimizer& optimizer) { scaler_.unscale(optimizer); }
  bool step(torch::optim::Optimizer& optimizer) {
    const bool stepped = scaler_.step(optimizer);
    scaler_.update();
    return stepped;
  }

  /// The Trainer skipped the step on a non-finite loss or gradient norm: the scale backs off.
  void skip_step() { scaler_.skip(); }
  /// Decides from this rank's gradients whether to skip: no sharded optimizer state.
  static constexpr bool kSkipsOnLocalGrads = true;

  /// The loss scale and its clean-step count ("loss_scale", "loss_scale_clean_steps").
  void save_state(torch::serialize::OutputArchive& archive) const {
    archive.write("loss_scale", torch::tensor(scaler_.current_scale(), torch::kDouble));
    archive.write("loss_scale_clean_steps", torch::tensor(scaler_.clean_steps(), torch::kLong));
  }
  void load_state(torch::serialize::InputArchive& archive) {
    torch::Tensor scale, clean_steps;
    memopt::detail::read_state_entry(archive, "loss_scale", scale);
    memopt::detail::read_state_entry(archive, "loss_scale_clean_steps", clean_steps);
    scaler_.load(scale.item<double>(), clean_steps.item<int64_t>());
  }

  LossScaler& scaler() { return scaler_; }
  const LossScaler& scaler() const { return scaler_; }

 private:
  LossScaler scaler_;
};

/// fp16 autocast + dynamic loss scaling (CUDA).
using Fp16Scaled = Scaled<c10::kHalf>;

}  // namespace memopt::precision
