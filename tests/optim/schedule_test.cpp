// Tests for memopt/optim/schedule.hpp: the learning rate warms up linearly and decays to
// min_lr_ratio (cosine, linear, constant).
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include <catch2/catch.hpp>

#include <memopt/memopt.hpp>

#include "support.hpp"

TEST_CASE("the learning-rate schedule warms up linearly and decays to min_lr_ratio", "[optim]") {
  using memopt::optim::Decay;
  using memopt::optim::scheduled_lr;
  CHECK(scheduled_lr(0, 1.0, 10, 110, Decay::kCosine, 0.1) == Approx(0.1));
  CHECK(scheduled_lr(9, 1.0, 10, 110, Decay::kCosine, 0.1) == Approx(1.0));
  CHECK(scheduled_lr(60, 1.0, 10, 110, Decay::kCosine, 0.1) == Approx(0.55));
  CHECK(scheduled_lr(110, 1.0, 10, 110, Decay::kCosine, 0.1) == Approx(0.1));
  CHECK(scheduled_lr(60, 1.0, 10, 110, Decay::kLinear, 0.0) == Approx(0.5));
  CHECK(scheduled_lr(60, 1.0, 10, 110, Decay::kConstant, 0.0) == Approx(1.0));
}
