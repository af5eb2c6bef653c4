// Tests for memopt/memory/tracker.hpp: exact byte counts of a known allocation, per-phase
// peaks, the measured effect of checkpointing. The report, the allocator settings and the
// timeline are tested in report_test.cpp, allocator_test.cpp and timeline_test.cpp; the callbacks
// that report memory (MemoryTrace, ProgressBar, JsonlMetrics) in tests/callbacks_test.cpp.
#include <catch2/catch.hpp>

#include <cstdint>

#include <torch/torch.h>

#include <memopt/memopt.hpp>

namespace {

// Peak tracked bytes of one forward+backward of an 8-block model under a recompute policy.
template <class Recompute>
int64_t peak_of_step(memopt::models::Llama& model, const memopt::Batch& batch) {
  auto& tracker = memopt::memory::Tracker::instance();
  for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
  tracker.reset_peaks();
  const int64_t before = tracker.live_bytes();
  (model->loss_sum(batch, Recompute{}) / batch.num_targets()).backward();
  return tracker.peak_bytes() - before;
}

}  // namespace

TEST_CASE("the tracker is installed by the test runner and counts a known allocation exactly", "[memory]") {
  auto& tracker = memopt::memory::Tracker::instance();
  REQUIRE(tracker.installed());
  const int64_t live = tracker.live_bytes();
  const int64_t allocs = tracker.snapshot().allocations;
  {
    auto t = torch::empty({1000, 250}, torch::kFloat);  // 1,000,000 bytes
    CHECK(tracker.live_bytes() - live == 1000000);
    CHECK(tracker.snapshot().allocations - allocs == 1);
    auto u = torch::empty({3, 7}, torch::kDouble);  // 168 bytes
    CHECK(tracker.live_bytes() - live == 1000168);
    CHECK(tracker.peak_bytes() >= live + 1000168);
  }
  CHECK(tracker.live_bytes() == live);
  CHECK(tracker.snapshot().frees - tracker.snapshot().allocations <= 0);
}

TEST_CASE("reset_peaks starts a new window and phases keep their own peaks", "[memory]") {
  using memopt::memory::Phase;
  auto& tracker = memopt::memory::Tracker::instance();
  tracker.reset_peaks();
  const int64_t base = tracker.live_bytes();
  CHECK(tracker.peak_bytes() == base);
  {
    memopt::memory::PhaseScope fwd(Phase::kForward);
    auto a = torch::empty({1 << 20}, torch::kByte);  // 1 MiB in forward
  }
  {
    memopt::memory::PhaseScope bwd(Phase::kBackward);
    auto b = torch::empty({3 << 20}, torch::kByte);  // 3 MiB in backward
  }
  const auto snap = tracker.snapshot();
  CHECK(snap.phase_peak_bytes[static_cast<int>(Phase::kForward)] == base + (1 << 20));
  CHECK(snap.phase_peak_bytes[static_cast<int>(Phase::kBackward)] == base + (3 << 20));
  CHECK(snap.peak_bytes == base + (3 << 20));
  CHECK(tracker.phase() == Phase::kIdle);
}
TEST_CASE("ExcludedFromPeaks leaves no peak behind, but keeps what outlives it live", "[memory]") {
  using memopt::memory::Phase;
  auto& tracker = memopt::memory::Tracker::instance();
  tracker.reset_peaks();
  const int64_t base = tracker.live_bytes();
  memopt::memory::PhaseScope fwd(Phase::kForward);
  auto kept = torch::empty({1 << 20}, torch::kByte);  // 1 MiB before: the peak to keep
  torch::Tensor outlives;
  {
    memopt::memory::ExcludedFromPeaks probe;
    auto scratch = torch::empty({5 << 20}, torch::kByte);  // 5 MiB, freed inside
    CHECK(tracker.peak_bytes() == base + (6 << 20));        // counted while it lives
    outlives = torch::empty({2 << 20}, torch::kByte);       // 2 MiB, alive at the end
  }
  const auto snap = tracker.snapshot();
  CHECK(snap.live_bytes == base + (3 << 20));
  CHECK(snap.peak_bytes == base + (3 << 20));  // not base + 8 MiB: the live bytes, over the 1 MiB before
  CHECK(snap.phase_peak_bytes[static_cast<int>(Phase::kForward)] == base + (3 << 20));
  CHECK(snap.phase_peak_bytes[static_cast<int>(Phase::kBackward)] == 0);
}
TEST_CASE("checkpointing lowers the measured peak of an 8-block model at least 2x", "[memory][checkpoint]") {
  torch::manual_seed(0);
  memopt::models::Llama model(memopt::models::LlamaConfig()
                                  .vocab_size(256)
                                  .hidden_size(128)
                                  .num_hidden_layers(8)
                                  .num_attention_heads(4)
                                  .max_position_embeddings(256));
  auto tokens = torch::randint(256, {4, 257});
  const memopt::Batch batch{tokens.slice(1, 0, 256), tokens.slice(1, 1, 257)};
  const int64_t plain = peak_of_step<memopt::recompute::None>(model, batch);
  const int64_t every = peak_of_step<memopt::recompute::EveryBlock>(model, batch);
  const int64_t nth = peak_of_step<memopt::recompute::EveryNth<2>>(model, batch);
  const int64_t selective = peak_of_step<memopt::recompute::Selective>(model, batch);
  INFO("peak above the model: none " << plain << " B, every block " << every << " B, every 2nd " << nth
                                     << " B, selective " << selective << " B");
  CHECK(plain >= 2 * every);
  CHECK(nth < plain);
  CHECK(nth > every);
  // Selective drops the (T, T) scores and probabilities and the norm/SwiGLU temporaries,
  // keeps the matmul outputs: between the two, and at least 1.5x below None at T = 256.
  CHECK(selective * 3 <= plain * 2);
  CHECK(selective > every);
}
