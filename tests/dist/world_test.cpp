// tests/dist/world_test.cpp — memopt/dist/world.hpp on two ranks (run by
// tests/dist/dist_test.sh): World::check_same, through the store, fails on the rank whose
// value differs from rank 0's, naming that rank and the first difference, with a HINT (here the
// model shapes a data-parallel Trainer checks at start; dist/data_parallel.hpp's check_model).
#include <catch2/catch.hpp>

#include <torch/torch.h>

#include <memopt/dist.hpp>
#include <memopt/memopt.hpp>

#include "dist/fixtures.hpp"
#include "support.hpp"

using namespace memopt::test::dist;  // dist/fixtures.hpp: launched(), base_options(), Fp32Trainer, ...

TEST_CASE("Different model shapes on the ranks are an error naming the rank", "[dist]") {
  if (!launched()) return;
  torch::manual_seed(1);
  memopt::models::Llama model(tiny_config(memopt::dist::world().rank() == 0 ? 32 : 64));
  memopt::test::require_error([&] { Fp32Trainer trainer(*model, base_options()); }, "memopt::dist",
                              {"rank 1's model shapes differ from rank 0's", "same model"});
}
