// memopt/optim/step_in_backward.hpp — AdamW whose update runs inside backward: a hook on
// each parameter's gradient accumulator applies that parameter's step as soon as its
// gradient is final and frees the gradient, so at most a few gradients exist at once
// instead of all of them (4 B/param). torchtune's optimizer-in-backward, for LibTorch 1.13+
// (which has no post-accumulate-grad hook in its API: the hook goes on the AccumulateGrad node).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

namespace memopt::optim {

/// An optimizer whose step() does nothing: each parameter is updated by its own optimizer
/// (torch::optim::AdamW by default — LibTorch's exact update; optim::AdamW8bit for 8-bit
/// state) the moment backward has accumulated its gradient, which is then freed. Group options (the learning rate the schedule sets)
/// are read at that moment. It cannot combine with anything that needs every gradient at
/// once: gradient accumulation over micro-batches, global-norm clipping, loss scaling.
/// A second gradient for a parameter before step() (a second backward, or weights shared
/// across checkpointed blocks) is an error, not a silent double update.
///   memopt::optim::StepInBackward opt(memopt::optim::single_group(params, adamw), adamw);
///   loss.backward();   // parameters are updated here
///   opt.step();        // ends the step (checks every update ran once)
class StepInBackward : public torch::optim::Optimizer {
 public:
  /// Builds the optimizer of one parameter from its group's options.
  using Factory =
      std::function<std::unique_ptr<torch::optim::Optimizer>(const torch::Tensor&, const torch::optim::AdamWOptions&)>;

  /// torch::optim::AdamW for every parameter.
  static std::unique_ptr<torch::optim::Optimizer> adamw(const torch::Tensor& p, const torch::optim::AdamWOptions& o) {
    return std::make_unique<torch::optim::AdamW>(std::vector<torch::Tensor>{p}, o);
  }

  StepInBackward(std::vector<torch::optim::OptimizerParamGroup> groups, const torch::optim::AdamWOptions& defaults,
                 const Factory& make = adamw)
      : torch::optim::Optimizer(std::move(groups), std::make_unique<torch::optim::AdamWOptions>(defaults)),
        state_(std::make_shared<Shared>()) {
    state_->groups = &param_groups_;  // this object never moves (no copy, no move)
    for (size_t g = 0; g < param_groups().size(); ++g) {
      for (const auto& p : param_groups()[g].params()) {
        TORCH_CHECK(p.is_leaf() && p.requires_grad(),
                    "memopt::optim::StepInBackward: every parameter must be a leaf that requires grad (got one "
                    "of shape ",
                    p.sizes(), "). HINT: pass model.parameters() of trainable tensors only.");
        const auto& options = static_cast<const torch::optim::AdamWOptions&>(param_groups()[g].options());
        state_->params.push_back({g, p, make(p, options), -1});
      }
    }
    for (size_t i = 0; i < state_->params.size(); ++i) {
      auto accumulator = torch::autograd::impl::grad_accumulator(state_->params[i].param);
      const auto key = accumulator->add_post_hook(std::make_unique<Hook>(state_, i));
      hooks_.push_back({accumulator, key});  // holding the node keeps the hook alive across graphs
    }
  }

  ~StepInBackward() override {
    for (auto& [node, key] : hooks_) node->del_post_hook(key);
  }
  StepInBackward(const StepInBackward&) = delete;
  StepInBackward& operator=(const StepInBackward&) = delete;

  /// Ends the step: the updates already ran in backward.
  torch::Tensor step(LossClosure closure = nullptr) override {
    TORCH_CHECK(!closure, "memopt::optim::StepInBackward: step() takes no closure (updates run in backward). "
                          "HINT: call loss.backward() then step().");
    state_->step += 1;
    return {};
  }

  /// Parameters updated during the current step so far.
  int64_t updated_this_step() const {
    int64_t n = 0;
    for (const auto& e : state_->params) n += e.updated_at == state_->step ? 1 : 0;
    return n;
  }

  /// Optimizer state bytes: `bytes_of(optimizer)` summed over the per-parameter optimizers
  /// (default: AdamW's exp_avg and exp_avg_sq).
  int64_t state_bytes(const std::function<int64_t(const torch::optim::Optimizer&)>& bytes_of = adamw_bytes) const {
    int64_t bytes = 0;
    for (const auto& e : state_->params) bytes += bytes_of(*e.optimizer);
    return bytes;
  }
  static int64_t adamw_bytes(const torch::optim::Optimizer& optimizer) {
    int64_t bytes = 0;
    for (const auto& [key, st] : optimizer.state()) {
      const auto& s = static_cast<const torch::optim::AdamWParamState&>(*st);
      bytes += s.exp_avg().nbytes() + s.exp_avg_sq().nbytes();
    }
    return bytes;
  }

  void save(torch::serialize::OutputArchive& archive) const override {
    for (size_t i = 0; i < state_->params.size(); ++i) {
      torch::serialize::OutputArchive sub(archive.compilation_unit());
      state_->params[i].optimizer->save(sub);
      archive.write("param_" + std::to_string(i), sub);
    }
  }
  void load(torch::serialize::InputArchive& archive) override {
    for (size_t i = 0; i < state_->params.size(); ++i) {
      torch::serialize::InputArchive sub;
      TORCH_CHECK(archive.try_read("param_" + std::to_string(i), sub),
                  "memopt::optim::StepInBackward: the archive has no state for parameter ", i,
                  ". HINT: load a state saved by a StepInBackward over the same parameters.");
      state_->params[i].optimizer->load(sub);
    }
  }

 private:
  struct Entry {
    size_t group;
    torch::Tensor param;
    std::unique_ptr<torch::optim::Optimizer> optimizer;  // this parameter's own
    int64_t updated_at;  // the step index of its last update
  };
  // What the hooks share with the optimizer; hooks hold it weakly, so a hook that
  // outlives the optimizer (a graph built before its destruction) does nothing.
  struct Shared {
    std::vector<Entry> params;
    const std::vector<torch::optim::OptimizerParamGroup>* groups = nullptr;  // the optimizer's own
    int64_t step = 0;
    double lr_of(size_t group) const { return (*groups)[group].options().get_lr(); }
  };

  struct Hook : torch::autograd::FunctionPostHook {
    Hook(const std::shared_ptr<Shared>& state, size_t index) : state(state), index(index) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                              const torch::autograd::variable_list&) override {
      auto shared = state.lock();
      if (!shared) return outputs;
      auto& e = shared->params[index];
      if (!e.param.grad().defined()) return outputs;
      TORCH_CHECK(e.updated_at != shared->step, "memopt::optim::StepInBackward: parameter ", index, " (shape ",
                  e.param.sizes(),
                  ") received a second gradient before step(): a second backward (gradient accumulation) or a "
                  "weight shared across checkpointed blocks. HINT: steps in backward need exactly one "
                  "gradient per parameter per step; use state::Resident for accumulation.");
      e.updated_at = shared->step;
      e.optimizer->param_groups()[0].options().set_lr(shared->lr_of(e.group));
      e.optimizer->step();
      e.param.mutable_grad() = torch::Tensor();  // freed now, not at the end of the step
      return outputs;
    }
    std::weak_ptr<Shared> state;
    size_t index;
  };

  std::shared_ptr<Shared> state_;
  // The node holder: a shared_ptr before LibTorch 2.15, an intrusive_ptr since.
  using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const torch::Tensor&>()));
  std::vector<std::pair<NodePtr, uintptr_t>> hooks_;
};

}  // namespace memopt::optim
