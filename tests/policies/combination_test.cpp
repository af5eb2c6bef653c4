// Tests for memopt/policies/combination.hpp: the combinations a Trainer refuses, with
// the setting named and a HINT.
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include <catch2/catch.hpp>

#include <memopt/memopt.hpp>

#include "policies/fixtures.hpp"
#include "support.hpp"

using namespace memopt::test::policies;  // NOLINT: the fixtures of the policy tests

TEST_CASE("StepInBackward with accumulation or clipping is rejected", "[state]") {
  memopt::models::Llama model(tiny_llama(0.0));
  using InBackward = memopt::Trainer<memopt::recompute::None, memopt::precision::Fp32, memopt::accum::Runtime,
                                     memopt::state::StepInBackward>;
  CHECK_THROWS_WITH(InBackward(*model, memopt::TrainerOptions().grad_clip(0).accum_steps(2)),
                    Catch::Contains("1 micro-batch per step (got accumulation over 2)") && Catch::Contains("HINT"));
  CHECK_THROWS_WITH(InBackward(*model, memopt::TrainerOptions().grad_clip(1.0)),
                    Catch::Contains("global gradient norm (got grad_clip 1)") && Catch::Contains("HINT"));
  CHECK_NOTHROW(InBackward(*model, memopt::TrainerOptions().grad_clip(0)));
  // accum::Fixed<N > 1> with StepInBackward does not compile: tests/compile_fail.
}

TEST_CASE("An accum_steps the Accum policy would ignore is an error", "[accum]") {
  memopt::models::Llama model(tiny_llama(0.0));
  using Fixed2 = memopt::Trainer<memopt::recompute::None, memopt::precision::Fp32, memopt::accum::Fixed<2>>;
  memopt::test::require_error([&] { Fixed2(*model, memopt::TrainerOptions().accum_steps(3)); }, "memopt::Trainer",
                              {"accum_steps is 3", "accum::Fixed<2>", "runs 2 micro-batch"});
  memopt::test::require_error([&] { memopt::Trainer<>(*model, memopt::TrainerOptions().accum_steps(4)); },
                              "memopt::Trainer", {"accum_steps is 4", "accum::None", "accum::Runtime"});
  CHECK(Fixed2(*model, memopt::TrainerOptions().accum_steps(2)).accum().micro_steps() == 2);  // the same count
  CHECK(Fixed2(*model, memopt::TrainerOptions()).accum().micro_steps() == 2);                 // left at 1
  using Runtime = memopt::Trainer<memopt::recompute::None, memopt::precision::Fp32, memopt::accum::Runtime>;
  CHECK(Runtime(*model, memopt::TrainerOptions().accum_steps(3)).accum().micro_steps() == 3);
}
