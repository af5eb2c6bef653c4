// memopt/memory/tracker.hpp — exact accounting of CPU tensor memory. A wrapping
// c10::Allocator, installed before any tensor exists, counts every CPU tensor's bytes
// (oneDNN scratchpads included, OpenBLAS's own buffers not): live bytes, peak bytes,
// the peak of each training phase (forward, backward, optimizer) and allocation counts; on
// request, a timeline of every allocation, free and phase change in a bounded ring buffer
// (memory/timeline.hpp writes it as a Chrome trace). With a limit set, an allocation that
// would take the live bytes over it fails with c10::OutOfMemoryError, as a full GPU does
// (the Trainer's memory_budget).
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string_view>
#include <vector>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include "memopt/detail/version.hpp"

namespace memopt::memory {

/// The phases of a training step the tracker keeps a separate peak for.
enum class Phase : int { kIdle = 0, kForward = 1, kBackward = 2, kOptimizer = 3 };
inline constexpr int kNumPhases = 4;

inline constexpr std::string_view phase_name(Phase p) {
  constexpr std::array<std::string_view, kNumPhases> names{"idle", "forward", "backward", "optimizer"};
  return names[static_cast<int>(p)];
}

/// Counters read at one moment.
struct Snapshot {
  int64_t live_bytes = 0;
  int64_t peak_bytes = 0;
  std::array<int64_t, kNumPhases> phase_peak_bytes{};
  int64_t allocations = 0;  // allocations since install
  int64_t frees = 0;
};

/// One moment of the timeline: steady-clock time, the live bytes just after it, the phase.
struct TimelineEvent {
  int64_t time_ns = 0;
  int64_t live_bytes = 0;
  Phase phase = Phase::kIdle;
};

namespace detail {
/// A fixed ring of the last `capacity` events; record() is lock-free (one fetch_add and three
/// relaxed stores), so any thread may allocate while it records.
class TimelineRing {
 public:
  explicit TimelineRing(size_t capacity) : slots_(capacity) {}

  void record(int64_t live, Phase phase) {
    Slot& s = slots_[next_.fetch_add(1, std::memory_order_relaxed) % slots_.size()];
    s.time_ns.store(std::chrono::steady_clock::now().time_since_epoch().count(), std::memory_order_relaxed);
    s.live.store(live, std::memory_order_relaxed);
    s.phase.store(static_cast<int>(phase), std::memory_order_relaxed);
  }
  /// The events still in the ring, in time order.
  std::vector<TimelineEvent> events() const {
    const uint64_t end = next_.load(std::memory_order_acquire);
    const uint64_t n = std::min<uint64_t>(end, slots_.size());
    std::vector<TimelineEvent> out;
    out.reserve(n);
    for (uint64_t i = end - n; i < end; ++i) {
      const Slot& s = slots_[i % slots_.size()];
      out.push_back({s.time_ns.load(std::memory_order_relaxed), s.live.load(std::memory_order_relaxed),
                     static_cast<Phase>(s.phase.load(std::memory_order_relaxed))});
    }
    // Threads may store a little out of order: order by time, keeping index order on ties.
    std::stable_sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.time_ns < b.time_ns; });
    return out;
  }
  uint64_t recorded() const { return next_.load(std::memory_order_relaxed); }
  size_t capacity() const { return slots_.size(); }

 private:
  struct Slot {
    std::atomic<int64_t> time_ns{0};
    std::atomic<int64_t> live{0};
    std::atomic<int> phase{0};
  };
  std::vector<Slot> slots_;
  std::atomic<uint64_t> next_{0};
};
}  // namespace detail

/// Process-wide tracker of CPU tensor bytes (a singleton that is never destroyed, so
/// it outlives every tensor).
///   memopt::memory::Tracker::install();          // first line of main()
///   auto before = memopt::memory::Tracker::instance().live_bytes();
class Tracker {
 public:
  static Tracker& instance() {
    static Tracker* t = new Tracker();  // leaked on purpose: tensors may die after main
    return *t;
  }

  /// Wraps LibTorch's CPU allocator. Idempotent. Call before any tensor exists: bytes
  /// allocated earlier are freed through their own deleter and never counted.
  static void install() {
    static const bool done = [] {
      static auto* alloc = new TrackingAllocator();
      c10::SetCPUAllocator(alloc, /*priority=*/100);
      instance().installed_.store(true);
      return true;
    }();
    (void)done;
  }

  bool installed() const { return installed_.load(std::memory_order_relaxed); }
  int64_t live_bytes() const { return live_.load(std::memory_order_relaxed); }
  int64_t peak_bytes() const { return peak_.load(std::memory_order_relaxed); }
  Phase phase() const { return static_cast<Phase>(phase_.load(std::memory_order_relaxed)); }

  Snapshot snapshot() const {
    Snapshot s;
    s.live_bytes = live_bytes();
    s.peak_bytes = peak_bytes();
    for (int i = 0; i < kNumPhases; ++i) s.phase_peak_bytes[i] = phase_peak_[i].load(std::memory_order_relaxed);
    s.allocations = allocations_.load(std::memory_order_relaxed);
    s.frees = frees_.load(std::memory_order_relaxed);
    return s;
  }

  /// Starts a new measurement window: every peak becomes the current live bytes.
  void reset_peaks() {
    const int64_t live = live_bytes();
    peak_.store(live);
    for (auto& p : phase_peak_) p.store(0);
    phase_peak_[phase_.load()].store(live);
  }

  /// Puts every peak back to what `before` (an earlier snapshot) saw, or to the live bytes where
  /// they are higher now: what was allocated and freed in between leaves no peak behind. For
  /// ExcludedFromPeaks; an allocation another thread made meanwhile is forgotten with the rest.
  void restore_peaks(const Snapshot& before) {
    const int64_t live = live_bytes();
    peak_.store(std::max(before.peak_bytes, live));
    for (int i = 0; i < kNumPhases; ++i) phase_peak_[i].store(before.phase_peak_bytes[i]);
    raise(phase_peak_[phase_.load()], live);
  }

  /// Makes every allocation that would take the live bytes over `bytes` fail with
  /// c10::OutOfMemoryError (0: no limit). The Trainer sets it around forward and backward.
  void set_limit(int64_t bytes) { limit_.store(bytes, std::memory_order_relaxed); }
  int64_t limit() const { return limit_.load(std::memory_order_relaxed); }
  /// Live bytes plus the request of the last allocation the limit refused (what it would have needed).
  int64_t last_refused_need() const { return refused_need_.load(std::memory_order_relaxed); }

  /// Marks the phase that later allocations belong to (one relaxed store).
  void set_phase(Phase p) {
    phase_.store(static_cast<int>(p), std::memory_order_relaxed);
    raise(phase_peak_[static_cast<int>(p)], live_bytes());
    if (auto* ring = recording_.load(std::memory_order_acquire)) ring->record(live_bytes(), p);
  }

  /// Starts a timeline: every later allocation, free and phase change is recorded (time,
  /// live bytes, phase) into a ring of the last `capacity` events (24 bytes each, outside the
  /// tracked memory). Starting again begins a new timeline. Off, the cost is one relaxed load
  /// per allocation.
  ///   tracker.start_timeline();  ...  tracker.stop_timeline();
  ///   memopt::memory::write_chrome_trace(tracker.timeline(), "memory.trace.json");
  void start_timeline(size_t capacity = size_t{1} << 18) {
    TORCH_CHECK(capacity >= 2, "memopt::memory: start_timeline: capacity must be >= 2 events (got ", capacity,
                "). HINT: the default keeps the last 262144 events in 6 MiB");
    std::lock_guard<std::mutex> lock(timeline_mutex_);
    rings_.push_back(std::make_unique<detail::TimelineRing>(capacity));  // an older ring may still be written
    recording_.store(rings_.back().get(), std::memory_order_release);
    rings_.back()->record(live_bytes(), phase());
  }
  /// Stops recording; timeline() still returns the events.
  void stop_timeline() { recording_.store(nullptr, std::memory_order_release); }
  bool timeline_recording() const { return recording_.load(std::memory_order_relaxed) != nullptr; }
  /// The last timeline's events in time order (the last `capacity` of them), and how many
  /// events it recorded in all (more than the size when the ring wrapped).
  std::vector<TimelineEvent> timeline(uint64_t* recorded = nullptr) const {
    std::lock_guard<std::mutex> lock(timeline_mutex_);
    if (recorded) *recorded = rings_.empty() ? 0 : rings_.back()->recorded();
    return rings_.empty() ? std::vector<TimelineEvent>{} : rings_.back()->events();
  }

 private:
  Tracker() = default;

  static void raise(std::atomic<int64_t>& peak, int64_t value) {
    int64_t seen = peak.load(std::memory_order_relaxed);
    while (value > seen && !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
    }
  }

  void check_limit(int64_t n) {
    const int64_t limit = limit_.load(std::memory_order_relaxed);
    if (limit <= 0) return;
    const int64_t need = live_.load(std::memory_order_relaxed) + n;
    if (need <= limit) return;
    refused_need_.store(need, std::memory_order_relaxed);
    TORCH_CHECK_WITH(OutOfMemoryError, false, "memopt::memory: an allocation of ", n, " bytes would take the tracked "
                     "tensor memory to ", need, " bytes, over the limit of ", limit, " bytes (the memory budget). HINT: "
                     "the Trainer lowers the micro-batch on this error when TrainerOptions::memory_budget is set");
  }

  void on_alloc(int64_t n) {
    const int64_t live = live_.fetch_add(n, std::memory_order_relaxed) + n;
    allocations_.fetch_add(1, std::memory_order_relaxed);
    raise(peak_, live);
    raise(phase_peak_[phase_.load(std::memory_order_relaxed)], live);
    if (auto* ring = recording_.load(std::memory_order_acquire)) ring->record(live, phase());
  }
  void on_free(int64_t n) {
    const int64_t live = live_.fetch_sub(n, std::memory_order_relaxed) - n;
    frees_.fetch_add(1, std::memory_order_relaxed);
    if (auto* ring = recording_.load(std::memory_order_acquire)) ring->record(live, phase());
  }

  // The replacement CPU allocator (it allocates with c10::alloc_cpu, as LibTorch's
  // default does): each block carries its size in a 64-byte header before the data,
  // and DataPtr's context equals its data pointer (some LibTorch paths rely on it).
  class TrackingAllocator final : public c10::Allocator {
   public:
    static constexpr size_t kHeader = 64;  // keeps LibTorch's 64-byte alignment

#if MEMOPT_TORCH_AT_LEAST(2, 3)
    c10::DataPtr allocate(size_t n) override { return allocate_tracked(n); }
    void copy_data(void* dest, const void* src, std::size_t count) const override {
      default_copy_data(dest, src, count);
    }
#else
    c10::DataPtr allocate(size_t n) const override { return allocate_tracked(n); }
#endif
    c10::DeleterFnPtr raw_deleter() const override { return &release; }

   private:
    c10::DataPtr allocate_tracked(size_t n) const {
      instance().check_limit(static_cast<int64_t>(n));
      char* base = nullptr;
      try {
        base = static_cast<char*>(c10::alloc_cpu(n + kHeader));
      } catch (const c10::Error& e) {  // the system's memory is full: the same error as over the limit
        TORCH_CHECK_WITH(OutOfMemoryError, false, "memopt::memory: allocating ", n, " bytes failed (",
                         e.what_without_backtrace(), "). HINT: set a memory budget or use less memory per step");
      }
      *reinterpret_cast<size_t*>(base) = n;
      instance().on_alloc(static_cast<int64_t>(n));
      void* data = base + kHeader;
      return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
    }
    static void release(void* data) {
      if (data == nullptr) return;
      char* base = static_cast<char*>(data) - kHeader;
      instance().on_free(static_cast<int64_t>(*reinterpret_cast<size_t*>(base)));
      c10::free_cpu(base);
    }
  };

  std::atomic<bool> installed_{false};
  std::atomic<int64_t> live_{0};
  std::atomic<int64_t> peak_{0};
  std::array<std::atomic<int64_t>, kNumPhases> phase_peak_{};
  std::atomic<int64_t> allocations_{0};
  std::atomic<int64_t> frees_{0};
  std::atomic<int> phase_{0};
  std::atomic<int64_t> limit_{0};
  std::atomic<int64_t> refused_need_{0};
  std::atomic<detail::TimelineRing*> recording_{nullptr};
  mutable std::mutex timeline_mutex_;
  std::vector<std::unique_ptr<detail::TimelineRing>> rings_;  // kept: a thread may still hold an older one
};

/// Keeps a scope's allocations out of every peak the tracker reports: the library's own
/// measurements (machine.hpp's GEMM speed probes, a few MiB at 512^3, run when a Trainer is
/// built) are not the run's memory. Every tensor made in the scope must be freed by its end.
///   { memopt::memory::ExcludedFromPeaks probe;  auto c = torch::mm(a, b); }
class ExcludedFromPeaks {
 public:
  ExcludedFromPeaks() : before_(Tracker::instance().snapshot()) {}
  ~ExcludedFromPeaks() { Tracker::instance().restore_peaks(before_); }
  ExcludedFromPeaks(const ExcludedFromPeaks&) = delete;
  ExcludedFromPeaks& operator=(const ExcludedFromPeaks&) = delete;

 private:
  Snapshot before_;
};

/// Sets the tracker's phase for a scope and restores the previous one.
///   { memopt::memory::PhaseScope fwd(memopt::memory::Phase::kForward); auto y = model(x); }
class PhaseScope {
 public:
  explicit PhaseScope(Phase p) : previous_(Tracker::instance().phase()) { Tracker::instance().set_phase(p); }
  ~PhaseScope() { Tracker::instance().set_phase(previous_); }
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  Phase previous_;
};

}  // namespace memopt::memory
