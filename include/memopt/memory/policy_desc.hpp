// memopt/memory/policy_desc.hpp — a policy combination as data. Each policy struct describes
// itself through `static describe()` (hooks::Describes): its flag spelling and what it does
// to memory and time. The estimator, the planner, dispatch and the command-line flags read
// only these descriptions, so a new policy is one struct (examples/04_custom_policy).
//
//   struct MyState {                                       // … make_optimizer, before/after_step
//     static memopt::memory::StateDesc describe() {
//       return {.flag = "bf16-moments", .resident = [](const auto& n) { return 4 * memopt::memory::sum(n); }};
//     }
//   };
#pragma once

#include <cstdint>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>

#include "memopt/concepts.hpp"

namespace memopt::memory {

/// Elements in all of these tensors.
inline int64_t sum(const std::vector<int64_t>& numels) { return std::accumulate(numels.begin(), numels.end(), int64_t{0}); }

/// Bytes of state as a function of the parameter tensors' element counts.
using StateBytes = std::function<int64_t(const std::vector<int64_t>& numels)>;

/// A recompute policy: what runs again in backward.
struct RecomputeDesc {
  std::string flag = "none";  // its --recompute spelling
  /// Whether block `index` of `layers` is recomputed whole (it keeps only its input).
  std::function<bool(int64_t index, int64_t layers)> whole_block = [](int64_t, int64_t) { return false; };
  /// The parts a model runs through memopt::run_cheap (norms, the attention core, the SwiGLU
  /// product) are recomputed in every block (recompute::Selective).
  bool cheap_parts = false;
};

/// A precision policy: the dtypes of the weights and of the matmuls.
struct DtypeDesc {
  std::string flag = "fp32";   // its --precision spelling
  bool half_matmuls = false;   // matmuls run in 16 bits (autocast, or 16-bit weights)
  bool half_weights = false;   // weights, activations and gradients are 16-bit; fp32 masters in the optimizer
  bool needs_cuda = false;     // fp16 autocast
};

/// An accumulation policy: how a step's batch is split.
struct SplitDesc {
  std::string flag = "micro-batches";
  int64_t fixed_steps = 0;  // micro-batches per step fixed by the type (0: TrainerOptions::accum_steps)
  bool grad_cache = false;  // representation-loss chunks with cached gradients (accum::GradCache)
};

/// AdamW's state: two fp32 moments per parameter.
inline int64_t adamw_state_bytes(const std::vector<int64_t>& numels) { return 8 * sum(numels); }

/// An optimizer-state policy: where the optimizer state lives and what its step moves.
struct StateDesc {
  std::string flag = "resident";  // its --optimizer_state spelling
  /// Optimizer-state bytes on the parameters' device between steps.
  StateBytes resident = adamw_state_bytes;
  /// … during the optimizer step, when the state comes in for it (empty: `resident`).
  StateBytes at_step;
  double step_bytes_per_param = 28;  // memory traffic of the step (AdamW: 28)
  double disk_bytes_per_param = 0;   // read and written per step
  double host_bytes_per_param = 0;   // over the host link per step
  bool steps_in_backward = false;    // each parameter steps as its gradient is made: 1 micro-batch, no clipping
  bool needs_cuda = false;           // parameters on a CUDA device
  bool needs_cpu = false;            // parameters on the CPU
  bool fused_step = false;           // one pass a parameter (optim::FusedAdamW): no per-parameter temporaries
  int64_t step_state_bytes(const std::vector<int64_t>& numels) const {
    return at_step ? at_step(numels) : resident(numels);
  }
};

/// A Trainer instantiation's policies as data, and the run-time accumulation count.
struct PolicyDesc {
  RecomputeDesc recompute;
  DtypeDesc precision;
  SplitDesc split;
  StateDesc state;
  int64_t accum = 1;  // micro-batches per optimizer step

  /// "recompute=every precision=bf16 state=resident accum=2" (+ " split=grad-cache").
  std::string name() const {
    return fmt::format("recompute={} precision={} state={} accum={}{}", recompute.flag, precision.flag, state.flag,
                       accum, split.grad_cache ? " split=" + split.flag : "");
  }
  /// "--recompute every --precision bf16 --optimizer_state resident" (+ " (grad-cache)").
  std::string flags() const {
    return fmt::format("--recompute {} --precision {} --optimizer_state {}{}", recompute.flag, precision.flag,
                       state.flag, split.grad_cache ? " (" + split.flag + ")" : "");
  }
  /// The same policy types (accum is a run-time count, not part of the type).
  bool same_types(const PolicyDesc& o) const {
    return recompute.flag == o.recompute.flag && precision.flag == o.precision.flag && split.flag == o.split.flag &&
           state.flag == o.state.flag;
  }
  bool operator==(const PolicyDesc& o) const { return same_types(o) && accum == o.accum; }
};

/// The PolicyDesc of a Trainer instantiation (its policy types' describe(); accum as given,
/// or the Accum type's fixed count).
///   memopt::memory::describe<memopt::Trainer<memopt::recompute::EveryBlock>>(4)
template <class TrainerT>
PolicyDesc describe(int64_t accum = 1) {
  using C = typename TrainerT::recompute_type;
  using P = typename TrainerT::precision_type;
  using A = typename TrainerT::accum_type;
  using O = typename TrainerT::state_type;
  static_assert(hooks::Describes<C, RecomputeDesc>, "memopt::memory::describe: the recompute policy has no "
                "`static memopt::memory::RecomputeDesc describe()`: the estimator and the planner need one");
  static_assert(hooks::Describes<P, DtypeDesc>, "memopt::memory::describe: the precision policy has no "
                "`static memopt::memory::DtypeDesc describe()`: the estimator and the planner need one");
  static_assert(hooks::Describes<A, SplitDesc>, "memopt::memory::describe: the accumulation policy has no "
                "`static memopt::memory::SplitDesc describe()`: the estimator and the planner need one");
  static_assert(hooks::Describes<O, StateDesc>, "memopt::memory::describe: the optimizer-state policy has no "
                "`static memopt::memory::StateDesc describe()`: the estimator and the planner need one");
  PolicyDesc d{C::describe(), P::describe(), A::describe(), O::describe(), accum};
  if (d.split.fixed_steps > 0) d.accum = d.split.fixed_steps;
  return d;
}

}  // namespace memopt::memory
