// Tests for memopt/runtime.hpp: log_performance_info names LibTorch, threads, BLAS, CPU
// features and the policies.
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include <catch2/catch.hpp>

#include <memopt/memopt.hpp>

#include "support.hpp"

TEST_CASE("log_performance_info names LibTorch, threads, BLAS, CPU features and the policies", "[runtime]") {
  using T = memopt::Trainer<memopt::recompute::EveryNth<2>, memopt::precision::Bf16Autocast, memopt::accum::Fixed<4>,
                            memopt::state::Resident>;
  CHECK(memopt::detail::policy_name<memopt::accum::Fixed<4>>() == "accum::Fixed<4>");
  CHECK(memopt::detail::policy_name<memopt::recompute::EveryBlock>() == "recompute::EveryBlock");
  std::map<std::string, std::string> info;
  for (const auto& [label, value] : memopt::performance_info()) info[label] = value;
  CHECK_THAT(info.at("libtorch"), Catch::StartsWith(TORCH_VERSION));
  CHECK_THAT(info.at("threads"), Catch::StartsWith(std::to_string(at::get_num_threads()) + " intra-op"));
  CHECK_THAT(info.at("cpu features"), Catch::Contains("avx512f"));
  CHECK(!info.at("blas").empty());
  std::FILE* file = std::tmpfile();
  REQUIRE(file != nullptr);
  memopt::log_performance_info<T>(file);
  std::rewind(file);
  std::string text;
  for (int c = std::fgetc(file); c != EOF; c = std::fgetc(file)) text += static_cast<char>(c);
  std::fclose(file);
  CHECK_THAT(text, Catch::Contains("trainer: Trainer<recompute::EveryNth<2>, precision::Bf16Autocast, "
                                   "accum::Fixed<4>, state::Resident>"));
  CHECK_THAT(text, Catch::Contains("blas: "));
}
