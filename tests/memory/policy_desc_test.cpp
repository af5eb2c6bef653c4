// tests/memory/policy_desc_test.cpp — memopt/memory/policy_desc.hpp: describe<Trainer<…>>()
// collects each policy type's description, takes accum from the call unless the Accum type
// fixes it, spells the combination as a name and as command-line flags, tells types from run
// settings (same_types, ==), reads a user's own policy's description; AdamW's state is 8 bytes
// per parameter.
#include <catch2/catch.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include <memopt/memopt.hpp>

namespace {

namespace rc = memopt::recompute;
namespace pr = memopt::precision;
namespace ac = memopt::accum;
namespace st = memopt::state;
using memopt::memory::describe;

// A user's own optimizer-state policy: Resident's optimizer, its own description.
struct HalfMoments : st::Resident {
  static memopt::memory::StateDesc describe() {
    return {.flag = "bf16-moments", .resident = [](const auto& n) { return 4 * memopt::memory::sum(n); }};
  }
};

}  // namespace

TEST_CASE("describe<Trainer> holds each policy type's description and the run's accum", "[memory][policy_desc]") {
  const auto d = describe<memopt::Trainer<rc::EveryBlock, pr::Bf16Autocast, ac::Runtime, st::Resident>>(4);
  CHECK(d.recompute.flag == "every");
  CHECK(d.recompute.whole_block(0, 3));
  CHECK(d.recompute.whole_block(2, 3));
  CHECK_FALSE(d.recompute.cheap_parts);
  CHECK(d.precision.flag == "bf16");
  CHECK(d.precision.half_matmuls);
  CHECK_FALSE(d.precision.half_weights);
  CHECK(d.split.flag == "micro-batches");
  CHECK(d.split.fixed_steps == 0);
  CHECK(d.state.flag == "resident");
  CHECK(d.accum == 4);
  CHECK(d.name() == "recompute=every precision=bf16 state=resident accum=4");
  CHECK(d.flags() == "--recompute every --precision bf16 --optimizer_state resident");

  // Every second block, pure bf16, 8-bit state; accum defaults to 1.
  const auto e = describe<memopt::Trainer<rc::EveryNth<2>, pr::Bf16Pure, ac::Runtime, st::Int8>>();
  CHECK(e.accum == 1);
  CHECK(e.recompute.whole_block(0, 4));
  CHECK_FALSE(e.recompute.whole_block(1, 4));
  CHECK(e.recompute.whole_block(2, 4));
  CHECK(e.precision.half_weights);
  CHECK(e.name() == "recompute=every-2 precision=bf16-pure state=int8 accum=1");
  CHECK(describe<memopt::Trainer<rc::Selective>>().recompute.cheap_parts);
}

TEST_CASE("an Accum type that fixes the micro-batches overrides the accum passed", "[memory][policy_desc]") {
  CHECK(describe<memopt::Trainer<rc::None, pr::Fp32, ac::Fixed<3>>>(7).accum == 3);
  CHECK(describe<memopt::Trainer<rc::None, pr::Fp32, ac::Fixed<3>>>().split.flag == "fixed-3");
  CHECK(describe<memopt::Trainer<rc::None, pr::Fp32, ac::None>>(5).accum == 1);
  CHECK(describe<memopt::Trainer<rc::None, pr::Fp32, ac::Runtime>>(5).accum == 5);
  // GradCache's split shows in the name and the flags.
  const auto grad_cache = describe<memopt::Trainer<rc::None, pr::Fp32, ac::GradCache>>(2);
  CHECK(grad_cache.split.grad_cache);
  CHECK(grad_cache.accum == 2);
  CHECK(grad_cache.name() == "recompute=none precision=fp32 state=resident accum=2 split=grad-cache");
  CHECK(grad_cache.flags() == "--recompute none --precision fp32 --optimizer_state resident (grad-cache)");
}

TEST_CASE("same_types compares the policy types, == compares accum too", "[memory][policy_desc]") {
  using T = memopt::Trainer<rc::EveryBlock, pr::Fp32, ac::Runtime>;
  const auto two = describe<T>(2), four = describe<T>(4);
  CHECK(two.same_types(four));
  CHECK_FALSE(two == four);
  CHECK(two == describe<T>(2));
  // One policy changed at a time: another type.
  CHECK_FALSE(two.same_types(describe<memopt::Trainer<rc::None, pr::Fp32, ac::Runtime>>(2)));
  CHECK_FALSE(two.same_types(describe<memopt::Trainer<rc::EveryBlock, pr::Bf16Autocast, ac::Runtime>>(2)));
  CHECK_FALSE(two.same_types(describe<memopt::Trainer<rc::EveryBlock, pr::Fp32, ac::Fixed<2>>>()));
  CHECK_FALSE(two.same_types(describe<memopt::Trainer<rc::EveryBlock, pr::Fp32, ac::Runtime, st::Disk>>(2)));
}

TEST_CASE("a user's policy describes itself, AdamW's state is 8 bytes per parameter", "[memory][policy_desc]") {
  const std::vector<int64_t> numels{10, 20, 300};
  CHECK(memopt::memory::sum(numels) == 330);
  CHECK(memopt::memory::sum({}) == 0);
  CHECK(memopt::memory::adamw_state_bytes(numels) == 8 * 330);  // two fp32 moments

  const auto d = describe<memopt::Trainer<rc::None, pr::Fp32, ac::Runtime, HalfMoments>>();
  CHECK(d.state.flag == "bf16-moments");
  CHECK(d.state.resident(numels) == 4 * 330);
  CHECK(d.state.step_state_bytes(numels) == 4 * 330);  // no at_step: the resident bytes
  CHECK(d.flags() == "--recompute none --precision fp32 --optimizer_state bf16-moments");
  // The defaults of a StateDesc: AdamW resident, 28 bytes of traffic per parameter.
  const memopt::memory::StateDesc plain;
  CHECK(plain.resident(numels) == 8 * 330);
  CHECK(plain.step_bytes_per_param == 28);
  CHECK_FALSE(plain.at_step);
}
