// tests/batch_test.cpp — memopt/batch.hpp: a Batch counts the targets that carry loss (not
// kIgnoreIndex) and every token position, splits into row views whose sizes differ by at most
// one, moves to a device without copying when it is there already; Loss::mean divides by the
// count and never by zero.
#include <catch2/catch.hpp>

#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include <memopt/batch.hpp>

#include "support.hpp"

namespace {

// (rows, 4) inputs 0, 1, 2, … and targets inputs + 100, with kIgnoreIndex at every position
// whose index is a multiple of 3.
memopt::Batch numbered(int64_t rows) {
  auto inputs = torch::arange(rows * 4, torch::kLong).view({rows, 4});
  auto targets = inputs + 100;
  targets.view({-1}).index_put_({torch::arange(0, rows * 4, 3, torch::kLong)}, memopt::kIgnoreIndex);
  return {inputs, targets};
}

}  // namespace

TEST_CASE("Batch counts the targets that carry loss and every token position", "[batch]") {
  const auto b = numbered(5);  // 20 positions; indices 0, 3, …, 18 ignored: 7 of them
  const torch::Tensor n = b.num_targets();
  CHECK(n.dim() == 0);
  CHECK(n.item<int64_t>() == 20 - 7);
  CHECK(b.num_tokens() == 20);  // padding included
  CHECK(b.rows() == 5);

  // All ignored, none ignored; other negative ids are not kIgnoreIndex.
  const memopt::Batch none{torch::zeros({2, 3}, torch::kLong), torch::full({2, 3}, memopt::kIgnoreIndex)};
  CHECK(none.num_targets().item<int64_t>() == 0);
  CHECK(none.num_tokens() == 6);
  const memopt::Batch all{torch::zeros({2, 3}, torch::kLong), torch::full({2, 3}, int64_t{-1})};
  CHECK(all.num_targets().item<int64_t>() == 6);
  CHECK(memopt::kIgnoreIndex == -100);  // PyTorch's ignore_index
}

TEST_CASE("Batch::split gives consecutive rows as views, sizes differing by at most one", "[batch]") {
  const auto b = numbered(7);
  for (const int64_t n : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{7}}) {
    INFO("split(" << n << ")");
    const auto parts = b.split(n);
    REQUIRE(parts.size() == static_cast<size_t>(n));
    int64_t row = 0;
    for (int64_t i = 0; i < n; ++i) {
      const auto& part = parts[static_cast<size_t>(i)];
      // 7 rows in n parts: the first 7 % n parts have one row more (as torch.tensor_split).
      const int64_t expected_rows = 7 / n + (i < 7 % n ? 1 : 0);
      CHECK(part.rows() == expected_rows);
      CHECK(torch::equal(part.inputs, b.inputs.narrow(0, row, expected_rows)));
      CHECK(torch::equal(part.targets, b.targets.narrow(0, row, expected_rows)));
      // Views: the same storage, at the row's offset.
      CHECK(part.inputs.data_ptr<int64_t>() == b.inputs.data_ptr<int64_t>() + row * 4);
      CHECK(part.targets.data_ptr<int64_t>() == b.targets.data_ptr<int64_t>() + row * 4);
      row += expected_rows;
    }
    CHECK(row == 7);
  }
  // The parts' targets add up to the whole batch's.
  int64_t sum = 0;
  for (const auto& part : b.split(3)) sum += part.num_targets().item<int64_t>();
  CHECK(sum == b.num_targets().item<int64_t>());
  // A write through a part is seen by the batch (no copy), in its rows only.
  const auto whole = numbered(4);
  whole.split(2)[1].inputs.fill_(-7);
  CHECK((whole.inputs.narrow(0, 2, 2) == -7).all().item<bool>());
  CHECK(torch::equal(whole.inputs.narrow(0, 0, 2), torch::arange(8, torch::kLong).view({2, 4})));
}

TEST_CASE("Batch::to keeps the tensors when they are on the device already, copies otherwise", "[batch]") {
  const auto b = numbered(3);
  const auto same = b.to(torch::kCPU);
  CHECK(same.inputs.data_ptr() == b.inputs.data_ptr());
  CHECK(same.targets.data_ptr() == b.targets.data_ptr());
}

TEST_CASE("CUDA: Batch::to copies to the GPU, values and target count unchanged", "[batch][cuda]") {
  MEMOPT_REQUIRE_CUDA();
  const auto b = numbered(3);
  const auto moved = b.to(torch::Device(torch::kCUDA, 0));
  CHECK(moved.inputs.is_cuda());
  CHECK(moved.targets.is_cuda());
  CHECK(torch::equal(moved.inputs.cpu(), b.inputs));
  CHECK(torch::equal(moved.targets.cpu(), b.targets));
  CHECK(moved.num_targets().item<int64_t>() == b.num_targets().item<int64_t>());
}

TEST_CASE("Loss::mean is the sum over the count, in the sum's dtype, and 0 for no targets", "[batch]") {
  const memopt::Loss loss{torch::tensor(6.0F), torch::tensor(int64_t{4})};
  const torch::Tensor mean = loss.mean();
  CHECK(mean.scalar_type() == torch::kFloat);
  CHECK(mean.item<double>() == 1.5);
  // No targets: the sum (0) over max(count, 1), never NaN.
  const memopt::Loss empty{torch::tensor(0.0F), torch::tensor(int64_t{0})};
  CHECK(empty.mean().item<double>() == 0.0);
  // A double sum stays double: 1 / 3 to double precision.
  const memopt::Loss third{torch::tensor(1.0, torch::kDouble), torch::tensor(int64_t{3})};
  CHECK(third.mean().scalar_type() == torch::kDouble);
  CHECK(third.mean().item<double>() == 1.0 / 3.0);
  // With a Batch's own count.
  const auto b = numbered(5);
  const memopt::Loss from_batch{torch::tensor(26.0F), b.num_targets()};
  CHECK(from_batch.mean().item<double>() == 2.0);  // 26 / 13
}
