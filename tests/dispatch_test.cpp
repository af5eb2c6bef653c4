// Tests for memopt/dispatch.hpp: the runtime → compile-time dispatch reaching the instantiation
// the flags name, every instantiation describing itself as the flags that reach it, and a
// combination the list does not hold refused with what it holds.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include <memopt/dispatch.hpp>
#include <memopt/memopt.hpp>

#include "support.hpp"

namespace {
// Two instantiations: dispatch to a combination outside the list is an error listing them.
using TwoTrainers = memopt::TypeList<
    memopt::Trainer<memopt::recompute::None, memopt::precision::Fp32, memopt::accum::Runtime>,
    memopt::Trainer<memopt::recompute::Selective, memopt::precision::Bf16Autocast, memopt::accum::Runtime,
                    memopt::state::Disk>>;
}  // namespace

TEST_CASE("dispatch reaches the instantiation the flags name", "[planner]") {
  using memopt::memory::PolicyDesc;
  auto parse = [](const char* c, const char* p, const char* o, int64_t accum = 1) {
    return memopt::parse_policies<memopt::StandardTrainers>(c, p, o, accum);
  };
  auto name_of = [](const PolicyDesc& d) {
    return memopt::dispatch<memopt::StandardTrainers>(d, []<class T>(std::type_identity<T>) { return T::name(); });
  };
  CHECK(memopt::StandardTrainers::size == 48);
  CHECK(name_of(parse("none", "fp32", "resident")) ==
        "Trainer<recompute::None, precision::Fp32, accum::Runtime, state::Resident>");
  CHECK(name_of(parse("every-2", "bf16-pure", "int8", 4)) ==
        "Trainer<recompute::EveryNth<2>, precision::Bf16Pure, accum::Runtime, state::Int8>");
  CHECK(name_of(parse("selective", "fp16", "disk")) ==
        "Trainer<recompute::Selective, precision::Fp16Scaled, accum::Runtime, state::Disk>");
  CHECK(name_of(parse("every", "bf16", "resident")) ==
        "Trainer<recompute::EveryBlock, precision::Bf16Autocast, accum::Runtime, state::Resident>");
  // Every instantiation is reachable, and describes itself as the flags that reach it.
  const auto all = memopt::candidates<memopt::StandardTrainers>();
  const auto names = memopt::trainer_names<memopt::StandardTrainers>();
  for (size_t i = 0; i < all.size(); ++i) CHECK(name_of(all[i]) == names[i]);
  // A combination the list does not hold: an error that lists what it holds.
  memopt::test::require_error(
      [&] {
        memopt::dispatch<TwoTrainers>(parse("every-2", "bf16", "disk"),
                                      []<class T>(std::type_identity<T>) { return 0; });
      },
      "memopt::dispatch", {"--recompute every-2 --precision bf16 --optimizer_state disk", "HINT", "--recompute selective"});
  // Two instantiations under the same flags (EveryNth<1> describes itself as "every"): ambiguous, refused.
  using Twins = memopt::TypeList<
      memopt::Trainer<memopt::recompute::EveryBlock, memopt::precision::Fp32, memopt::accum::Runtime>,
      memopt::Trainer<memopt::recompute::EveryNth<1>, memopt::precision::Fp32, memopt::accum::Runtime>>;
  memopt::test::require_error(
      [] {
        memopt::dispatch<Twins>(memopt::parse_policies<Twins>("every", "fp32", "resident"),
                                []<class T>(std::type_identity<T>) { return 0; });
      },
      "memopt::dispatch: 2 compiled Trainers", {"recompute::EveryBlock", "recompute::EveryNth<1>", "HINT"});
}
