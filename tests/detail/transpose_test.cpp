// tests/detail/transpose_test.cpp — memopt/detail/transpose.hpp: transposed_copy equals
// LibTorch's contiguous transpose bit for bit (bf16 and fp32, ragged 64 × 64 tiles, a row
// stride wider than the row, a transposed view), and names a tensor it cannot take.
#include <catch2/catch.hpp>

#include <string>

#include <torch/torch.h>

#include <memopt/detail/transpose.hpp>

TEST_CASE("transposed_copy equals LibTorch's contiguous transpose, bit for bit", "[detail][transpose]") {
  torch::manual_seed(8);
  for (const auto dtype : {torch::kBFloat16, torch::kFloat, torch::kHalf}) {
    const auto wide = torch::randn({67, 200}).to(dtype);
    const std::vector<std::pair<std::string, torch::Tensor>> cases{
        {"67 x 200, ragged tiles both ways", wide},
        {"rows of a wider matrix (row stride 200)", wide.narrow(1, 3, 130)},
        {"a transposed view (column stride 200)", wide.t()},
        {"one row", wide.narrow(0, 5, 1)},
        {"128 x 64, whole tiles", torch::randn({128, 64}).to(dtype)}};
    for (const auto& [name, x] : cases) {
      DYNAMIC_SECTION(c10::toString(dtype) << ": " << name) {
        const auto got = memopt::detail::transposed_copy(x);
        CHECK(got.is_contiguous());
        CHECK(got.scalar_type() == dtype);
        CHECK(torch::equal(got, x.t()));
      }
    }
  }
}

TEST_CASE("transposed_copy names a tensor it cannot take", "[detail][transpose]") {
  CHECK_THROWS_WITH(memopt::detail::transposed_copy(torch::zeros({2, 3, 4})),
                    Catch::Contains("2-D tensor") && Catch::Contains("HINT"));
  CHECK_THROWS_WITH(memopt::detail::transposed_copy(torch::zeros({2, 3}, torch::kLong)),
                    Catch::Contains("16- or 32-bit") && Catch::Contains("Long"));
}
