// tests/detail/parallel_test.cpp — memopt/detail/parallel.hpp: parallel_chunks covers the range
// once in contiguous chunks, runs them on two threads when LibTorch has two, and rethrows.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include <ATen/Parallel.h>

#include <memopt/detail/parallel.hpp>

namespace {

// at::set_num_threads for a scope.
struct Threads {
  int before = at::get_num_threads();
  explicit Threads(int n) { at::set_num_threads(n); }
  ~Threads() { at::set_num_threads(before); }
};

}  // namespace

TEST_CASE("parallel_chunks covers the range once, in at most get_num_threads chunks", "[parallel]") {
  Threads two(2);
  for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{1000}}) {
    std::vector<std::atomic<int>> seen(static_cast<size_t>(n));
    std::mutex mutex;
    std::set<int64_t> chunks;
    memopt::detail::parallel_chunks(n, 3, [&](int64_t begin, int64_t end, int64_t chunk) {
      for (int64_t i = begin; i < end; ++i) ++seen[static_cast<size_t>(i)];
      std::lock_guard<std::mutex> lock(mutex);
      CHECK(chunks.insert(chunk).second);
    });
    for (const auto& s : seen) CHECK(s.load() == 1);
    CHECK(static_cast<int64_t>(chunks.size()) <= memopt::detail::parallel_chunk_count(n, 3));
  }
  CHECK(memopt::detail::parallel_chunk_count(1000, 3) == 2);
  CHECK(memopt::detail::parallel_chunk_count(5, 3) == 1);  // below two grains: one chunk
}

TEST_CASE("parallel_chunks runs its chunks on two threads at once", "[parallel]") {
  Threads two(2);
  std::atomic<int> started{0};
  std::mutex mutex;
  std::set<std::thread::id> threads;
  memopt::detail::parallel_chunks(2, 1, [&](int64_t, int64_t, int64_t) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      threads.insert(std::this_thread::get_id());
    }
    ++started;
    // Wait for the other chunk to start: it can only on another thread.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (started.load() < 2 && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  });
  CHECK(threads.size() == 2);
}

TEST_CASE("parallel_chunks rethrows a chunk's exception after every chunk is done", "[parallel]") {
  Threads two(2);
  std::atomic<int> done{0};
  CHECK_THROWS_WITH(memopt::detail::parallel_chunks(100, 1,
                                                    [&](int64_t begin, int64_t, int64_t) {
                                                      ++done;
                                                      if (begin == 0) throw std::runtime_error("chunk 0 failed");
                                                    }),
                    "chunk 0 failed");
  CHECK(done.load() == 2);
}
