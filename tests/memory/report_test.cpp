// tests/memory/report_test.cpp — memopt/memory/report.hpp: the report a Trainer's fit() returns
// holds the per-phase peaks of the tracked tensors and RSS, and its table prints them.
#include <catch2/catch.hpp>

#include <algorithm>
#include <string>

#include <torch/torch.h>

#include <memopt/memory/report.hpp>
#include <memopt/memopt.hpp>

#include "memory/fixtures.hpp"
#include "support.hpp"

using namespace memopt::test::memory;  // NOLINT: the fixtures of the memory tests

TEST_CASE("the Trainer reports per-phase peaks and the report prints them", "[memory][trainer]") {
  torch::manual_seed(0);
  memopt::models::Llama model = tiny_llama();
  TinyLoader loader;
  memopt::Trainer<> trainer(*model, memopt::TrainerOptions().max_steps(2).log_interval(1));
  memopt::memory::Tracker::instance().reset_peaks();
  auto result = trainer.fit(loader, [&](const memopt::Batch& b, const auto& c) { return model->loss_sum(b, c); });
  const auto& s = result.memory.tensors;
  using memopt::memory::Phase;
  const int64_t fwd = s.phase_peak_bytes[static_cast<int>(Phase::kForward)];
  const int64_t bwd = s.phase_peak_bytes[static_cast<int>(Phase::kBackward)];
  const int64_t opt = s.phase_peak_bytes[static_cast<int>(Phase::kOptimizer)];
  CHECK(fwd > 0);
  CHECK(bwd > 0);
  CHECK(opt > 0);
  CHECK(s.peak_bytes == std::max({fwd, bwd, opt, s.phase_peak_bytes[0]}));
  CHECK(result.memory.peak_rss_bytes >= result.memory.rss_bytes);
  CHECK(result.memory.rss_bytes > 0);
  const std::string table = result.memory.table();
  CHECK_THAT(table, Catch::Contains("peak in forward") && Catch::Contains("peak in backward") &&
                        Catch::Contains("peak in optimizer") && Catch::Contains("RSS peak"));
}

TEST_CASE("CUDA: CudaMemory counts a tensor's bytes, the peak resets, a CUDA fit reports them", "[memory][cuda]") {
  MEMOPT_REQUIRE_CUDA();
  using memopt::memory::CudaMemory;
  const torch::Device cuda(torch::kCUDA, 0);
  torch::cuda::synchronize();
  const auto before = CudaMemory::now().at(0);
  constexpr int64_t kBytes = int64_t{64} << 20;  // a multiple of the allocator's 2 MiB large-block rounding
  {
    const auto t = torch::empty({kBytes / 4}, torch::TensorOptions().dtype(torch::kFloat).device(cuda));
    const auto during = CudaMemory::now().at(0);
    CHECK(during.allocated_bytes - before.allocated_bytes == kBytes);
    CHECK(during.reserved_bytes >= during.allocated_bytes);
    CHECK(during.peak_allocated_bytes >= during.allocated_bytes);
  }
  const auto after = CudaMemory::now().at(0);
  CHECK(after.allocated_bytes == before.allocated_bytes);
  CHECK(after.peak_allocated_bytes >= before.allocated_bytes + kBytes);
  memopt::memory::reset_cuda_peaks();
  CHECK(CudaMemory::now().at(0).peak_allocated_bytes == after.allocated_bytes);

  torch::manual_seed(0);
  memopt::models::Llama model = tiny_llama();
  model->to(cuda);
  TinyLoader loader;
  memopt::Trainer<> trainer(*model, memopt::TrainerOptions().max_steps(2).log_interval(1));
  auto result = trainer.fit(loader, [&](const memopt::Batch& b, const auto& c) { return model->loss_sum(b, c); });
  REQUIRE(result.memory.cuda.size() == static_cast<size_t>(torch::cuda::device_count()));
  CHECK(result.memory.cuda.at(0).peak_allocated_bytes > after.allocated_bytes);  // the model and its step
  CHECK_THAT(result.memory.table(), Catch::Contains("cuda:0 allocated"));
}
