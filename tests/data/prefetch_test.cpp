// tests/data/prefetch_test.cpp — memopt/data/prefetch.hpp's Prefetcher: the same sequence for
// any number of workers, a producer's exception from the next() of its item, at most depth
// items ahead, start and skip to resume, and a destructor that stops waiting workers.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

#include <torch/torch.h>

#include <memopt/data/grit.hpp>
#include <memopt/data/prefetch.hpp>

#include "data/fixtures.hpp"

using namespace memopt::test::data::grit;  // NOLINT: the fixtures of the GritLM tests

using memopt::data::GenRecord;
using memopt::data::GritBatch;
using memopt::data::GritBatcher;
using memopt::data::GritBatcherOptions;
using memopt::data::GritFormat;
using memopt::data::Prefetcher;
using memopt::data::PrefetchOptions;

TEST_CASE("Prefetcher returns the same sequence with 0, 1 and 3 workers", "[grit][prefetch]") {
  auto format = std::make_shared<GritFormat>(make_tokenizer());
  std::vector<GenRecord> gen = {{"a", "b c"}, {"d e f", "g"}, {"h", "i j k l"}, {"m", "n"}};
  GritBatcher batcher(format, diverse_records(24), gen, GritBatcherOptions(4).gen_batch_size(2));
  std::vector<std::vector<torch::Tensor>> runs;
  for (int64_t workers : {0, 1, 3}) {
    Prefetcher<GritBatch> prefetch([&](int64_t i) { return batcher.batch(i); },
                                   PrefetchOptions().workers(workers).depth(2).pin_memory(true));
    std::vector<torch::Tensor> seq;
    for (int i = 0; i < 9; ++i) {
      const GritBatch b = prefetch.next();
      // Pinning needs CUDA (a no-op without it); with a GPU every tensor of the batch is pinned.
      CHECK(b.queries.tokens.is_pinned() == torch::cuda::is_available());
      CHECK(b.generative.targets.is_pinned() == torch::cuda::is_available());
      seq.push_back(b.passages.tokens);
      seq.push_back(b.generative.targets);
    }
    CHECK(prefetch.index() == 9);
    runs.push_back(seq);
  }
  for (size_t r = 1; r < runs.size(); ++r) {
    for (size_t k = 0; k < runs[0].size(); ++k) CHECK(torch::equal(runs[0][k], runs[r][k]));
  }
  // Plain values, out-of-order completion (later items are faster): still in order.
  for (int64_t workers : {0, 1, 3}) {
    Prefetcher<int64_t> prefetch([](int64_t i) {
      std::this_thread::sleep_for(std::chrono::milliseconds((7 - i % 7)));
      return i * i;
    }, PrefetchOptions().workers(workers).depth(4));
    for (int64_t i = 0; i < 20; ++i) CHECK(prefetch.next() == i * i);
  }
}

TEST_CASE("Prefetcher rethrows a producer's exception from the next() of its item, with the index",
          "[grit][prefetch]") {
  for (int64_t workers : {0, 2}) {
    INFO("workers " << workers);
    Prefetcher<int64_t> prefetch([](int64_t i) -> int64_t {
      if (i == 2) throw std::runtime_error("boom at two");
      if (i == 4) TORCH_CHECK(false, "torch error at four");
      return i;
    }, PrefetchOptions().workers(workers).depth(3));
    CHECK(prefetch.next() == 0);
    CHECK(prefetch.next() == 1);
    require_error([&] { prefetch.next(); }, {"producing item 2 failed", "boom at two"}, "memopt::data::Prefetcher");
    CHECK(prefetch.next() == 3);  // the sequence goes on
    require_error([&] { prefetch.next(); }, {"producing item 4 failed", "torch error at four"}, "memopt::data::Prefetcher");
    CHECK(prefetch.next() == 5);
  }
}

TEST_CASE("Prefetcher keeps at most depth items ahead, start and skip resume", "[grit][prefetch]") {
  std::atomic<int64_t> produced{0};
  auto wait_for = [&](int64_t n) {
    for (int i = 0; i < 2000 && produced.load() < n; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  };
  {
    Prefetcher<int64_t> prefetch([&](int64_t i) {
      ++produced;
      return i;
    }, PrefetchOptions().workers(3).depth(3));
    wait_for(3);
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    CHECK(produced.load() == 3);  // full, and no more
    for (int64_t i = 0; i < 5; ++i) CHECK(prefetch.next() == i);
    wait_for(8);
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    CHECK(produced.load() == 5 + 3);
  }
  Prefetcher<int64_t> resumed([](int64_t i) { return i; }, PrefetchOptions().workers(2).depth(2).start(5));
  CHECK(resumed.next() == 5);
  resumed.skip(3);
  CHECK(resumed.index() == 9);
  CHECK(resumed.next() == 9);
  CHECK(resumed.next() == 10);
  Prefetcher<int64_t> inline_one([](int64_t i) { return i; }, PrefetchOptions().workers(0).start(2));
  inline_one.skip(2);
  CHECK(inline_one.next() == 4);
  require_error([&] { resumed.skip(-1); }, {"cannot skip -1"}, "memopt::data::Prefetcher");
  require_error([&] { Prefetcher<int64_t>([](int64_t i) { return i; }, PrefetchOptions().depth(0)); },
                {"depth must be >= 1 (got 0)"}, "memopt::data::Prefetcher");
}

TEST_CASE("Prefetcher's destructor stops workers waiting on a full queue", "[grit][prefetch]") {
  std::atomic<int64_t> produced{0};
  const auto start = std::chrono::steady_clock::now();
  {
    Prefetcher<std::vector<int64_t>> prefetch([&](int64_t i) {
      ++produced;
      return std::vector<int64_t>(100, i);
    }, PrefetchOptions().workers(3).depth(2));
    for (int i = 0; i < 2000 && produced.load() < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    CHECK(produced.load() == 2);
  }  // never consumed: the workers wait on the full queue and must wake to stop
  {
    // A producer still running when the prefetcher goes: the call finishes, then the join.
    Prefetcher<int64_t> slow([](int64_t i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      return i;
    }, PrefetchOptions().workers(2).depth(4));
  }
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
}

TEST_CASE("CUDA: pinned prefetched batches copy to the GPU without blocking, unchanged", "[grit][prefetch][cuda]") {
  MEMOPT_REQUIRE_CUDA();
  const torch::Device cuda(torch::kCUDA, 0);
  auto format = std::make_shared<GritFormat>(make_tokenizer());
  std::vector<GenRecord> gen = {{"a", "b c"}, {"d e f", "g"}};
  GritBatcher batcher(format, diverse_records(12), gen, GritBatcherOptions(4).gen_batch_size(2));
  Prefetcher<GritBatch> prefetch([&](int64_t i) { return batcher.batch(i); },
                                 PrefetchOptions().workers(2).depth(2).pin_memory(true));
  for (int i = 0; i < 3; ++i) {
    const GritBatch b = prefetch.next();
    REQUIRE(b.passages.tokens.is_pinned());
    const auto on_gpu = b.passages.tokens.to(cuda, /*non_blocking=*/true);
    CHECK(torch::equal(on_gpu.cpu(), batcher.batch(i).passages.tokens));
  }
}
