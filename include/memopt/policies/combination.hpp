// memopt/policies/combination.hpp — the policy combinations a Trainer refuses, and why: at
// compile time where the policy types say so (static_assert), else with an error naming the
// setting and a HINT when the Trainer is built.
#pragma once

#include <cstdint>
#include <type_traits>

#include <torch/torch.h>

#include "memopt/concepts.hpp"
#include "memopt/runtime.hpp"  // detail::policy_name
#include "memopt/step_sync.hpp"
#include "memopt/trainer_options.hpp"

namespace memopt {

/// Checks that Trainer<Recompute, Precision, Accum, State> can train with these options, this
/// Accum value and these ranks.
template <class Recompute, class Precision, class Accum, class State>
void check_combination(const TrainerOptions& options, const Accum& accum, const StepSync& sync) {
  TORCH_CHECK(options.accum_steps() == 1 || options.accum_steps() == accum.micro_steps(),
              "memopt::Trainer: TrainerOptions::accum_steps is ", options.accum_steps(), " but ",
              detail::policy_name<Accum>(), " runs ", accum.micro_steps(), " micro-batch(es) a step. HINT: use "
              "accum::Runtime for a run-time count, give the policy its count, or leave accum_steps at 1");
  if constexpr (hooks::SkipsOnLocalGrads<Precision>) {
    // Sharded, its inf/nan check sees only this rank's shard; the ranks agree through the Trainer's
    // check of the global gradient norm, which runs first and skips on every rank together.
    TORCH_CHECK(!(sync.distributed() && (options.shard_optimizer_state() || options.shard_params())) ||
                    options.skip_nonfinite(),
                "memopt::Trainer: ", detail::policy_name<Precision>(), " with a sharded optimizer state decides its "
                "skips from this rank's shard alone, and skip_nonfinite(false) turns off the global gradient-norm "
                "check that makes the ranks agree. HINT: leave skip_nonfinite(true), or shard_optimizer_state(false) "
                "and shard_params(false)");
  }
  // memory_budget retries a step on the rank that ran over; ZeRO-3's ranks gather and
  // reduce-scatter inside forward and backward together, so a lone retry would pair one rank's
  // collectives with another's different ones.
  TORCH_CHECK(!(sync.distributed() && options.shard_params() && options.memory_budget() > 0),
              "memopt::Trainer: memory_budget (", options.memory_budget(), " bytes) re-runs a step with smaller "
              "micro-batches on the rank that ran over it, but with shard_params (ZeRO-3) on ", sync.size(),
              " ranks the blocks are gathered inside the step by all ranks together. HINT: choose the micro-batch "
              "ahead (memopt::plan with PlanOptions::ranks; the examples' --memory_budget does), and set "
              "memory_budget(0)");
  if constexpr (!hooks::MatmulDtype<Precision>) {
    TORCH_CHECK(!options.gather_half(), "memopt::TrainerOptions: gather_half all-gathers ZeRO-3's matrices in the "
                "dtype autocast casts them to, but ", detail::policy_name<Precision>(), " runs no autocast. HINT: use "
                "precision::Bf16Autocast (--precision bf16), or gather_half(false)");
  }
  if constexpr (hooks::StepsInBackward<State>) {
    // One gradient per parameter per step, taken whole: nothing that needs every gradient at once.
    static_assert(!hooks::PrepareGrads<Precision>,
                  "memopt::Trainer: state::StepInBackward cannot combine with a precision policy that prepares "
                  "the gradients before the step (Scaled's inf/nan check, Bf16Pure's master weights): use "
                  "precision::Fp32 or Bf16Autocast");
    if constexpr (requires { typename std::integral_constant<int64_t, Accum::micro_steps()>; })
      static_assert(Accum::micro_steps() == 1,
                    "memopt::Trainer: state::StepInBackward cannot combine with gradient accumulation "
                    "(each micro-batch's gradient would update the weights): use accum::None");
    TORCH_CHECK(accum.micro_steps() == 1,
                "memopt::Trainer: state::StepInBackward needs 1 micro-batch per step (got accumulation over ",
                accum.micro_steps(), "). HINT: use state::Resident for gradient accumulation.");
    TORCH_CHECK(options.grad_clip() == 0,
                "memopt::Trainer: state::StepInBackward cannot clip by the global gradient norm (got grad_clip ",
                options.grad_clip(), "): each update runs before the other gradients exist. "
                "HINT: set TrainerOptions().grad_clip(0).");
    TORCH_CHECK(!sync.distributed(), "memopt::Trainer: state::StepInBackward updates each weight inside "
                "backward, before the gradients are summed over the ranks (world size ", sync.size(),
                "). HINT: use state::Resident, Int8 or Disk for data-parallel training");
  }
}

}  // namespace memopt
