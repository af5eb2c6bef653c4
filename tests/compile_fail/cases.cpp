// memopt's compile-fail cases: each CASE_<name> macro removes one thing from an otherwise
// correct program, which must then be rejected with a message naming what is missing
// (tests/compile_fail/CMakeLists.txt lists the cases and the text each must produce).
// CASE_control removes nothing and must compile: it proves the harness can compile at all.
#include <cstdint>
#include <memory>
#include <vector>

#include <torch/torch.h>

#include "memopt/batch.hpp"
#include "memopt/memory/policy_desc.hpp"
#include "memopt/trainer.hpp"

#if !defined(CASE_control) && !defined(CASE_recompute_without_run_block) &&   \
    !defined(CASE_precision_without_step) && !defined(CASE_accum_without_micro_steps) && \
    !defined(CASE_state_without_make_optimizer) && !defined(CASE_accum_fixed_zero) &&   \
    !defined(CASE_step_in_backward_with_accum) && !defined(CASE_recompute_without_describe)
#error "memopt compile_fail: define one CASE_<name> macro (see tests/compile_fail/CMakeLists.txt)"
#endif

// A user-defined policy for each of the Trainer's four parameters, each with every hook.
struct MyRecompute {
#if !defined(CASE_recompute_without_describe)
  static memopt::memory::RecomputeDesc describe() { return {.flag = "mine"}; }
#endif
#if !defined(CASE_recompute_without_run_block)
  torch::Tensor run_block(int64_t, torch::nn::Module&, const memopt::BlockFn& fn,
                          const std::vector<torch::Tensor>& inputs) const {
    return fn(inputs);
  }
#endif
};

struct MyPrecision {
  static memopt::memory::DtypeDesc describe() { return {.flag = "mine"}; }
  struct NoGuard {};
  NoGuard autocast(c10::DeviceType) const { return {}; }
  void backward(const torch::Tensor& loss) const { loss.backward(); }
#if !defined(CASE_precision_without_step)
  bool step(torch::optim::Optimizer& optimizer) const {
    optimizer.step();
    return true;
  }
#endif
};

struct MyAccum {
  static memopt::memory::SplitDesc describe() { return {.flag = "mine", .fixed_steps = 2}; }
#if !defined(CASE_accum_without_micro_steps)
  static constexpr int64_t micro_steps() { return 2; }
#endif
};

struct MyState {
  static memopt::memory::StateDesc describe() { return {.flag = "mine"}; }
#if !defined(CASE_state_without_make_optimizer)
  std::unique_ptr<torch::optim::Optimizer> make_optimizer(std::vector<torch::optim::OptimizerParamGroup> groups,
                                                          const torch::optim::AdamWOptions& options) {
    return std::make_unique<torch::optim::AdamW>(std::move(groups), options);
  }
#endif
  void before_step(torch::optim::Optimizer&) {}
  void after_step(torch::optim::Optimizer&) {}
};

#if defined(CASE_accum_fixed_zero)
using Accum = memopt::accum::Fixed<0>;
#else
using Accum = MyAccum;
#endif

#if defined(CASE_step_in_backward_with_accum)
using State = memopt::state::StepInBackward;  // with MyAccum's 2 micro-batches per step
#else
using State = MyState;
#endif

struct Loader {
  memopt::Batch next() { return {torch::zeros({2, 4}, torch::kLong), torch::zeros({2, 4}, torch::kLong)}; }
};

int main() {
  torch::nn::Embedding model(8, 4);
  using T = memopt::Trainer<MyRecompute, MyPrecision, Accum, State>;
  T trainer(*model, memopt::TrainerOptions());
  (void)memopt::memory::describe<T>();  // what the estimator and the planner know of the policies
  Loader loader;
  trainer.step(loader, [&](const memopt::Batch& b, const auto& ckpt) {
    torch::Tensor x = ckpt.run_block(0, *model, [&](const std::vector<torch::Tensor>& in) { return model(in[0]); },
                                     {b.inputs});
    return x.sum();
  });
  return 0;
}
