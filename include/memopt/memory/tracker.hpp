// memopt/memory/tracker.hpp — exact accounting of CPU tensor memory. A wrapping
// c10::Allocator, installed before any tensor exists, counts every CPU tensor's bytes
// (oneDNN scratchpads included, OpenBLAS's own buffers not): live bytes, peak bytes,
// the peak of each training phase (forward, backward, optimizer) and allocation counts.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <string_view>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

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

  /// Marks the phase that later allocations belong to (one relaxed store).
  void set_phase(Phase p) {
    phase_.store(static_cast<int>(p), std::memory_order_relaxed);
    raise(phase_peak_[static_cast<int>(p)], live_bytes());
  }

 private:
  Tracker() = default;

  static void raise(std::atomic<int64_t>& peak, int64_t value) {
    int64_t seen = peak.load(std::memory_order_relaxed);
    while (value > seen && !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
    }
  }

  void on_alloc(int64_t n) {
    const int64_t live = live_.fetch_add(n, std::memory_order_relaxed) + n;
    allocations_.fetch_add(1, std::memory_order_relaxed);
    raise(peak_, live);
    raise(phase_peak_[phase_.load(std::memory_order_relaxed)], live);
  }
  void on_free(int64_t n) {
    live_.fetch_sub(n, std::memory_order_relaxed);
    frees_.fetch_add(1, std::memory_order_relaxed);
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
      auto* base = static_cast<char*>(c10::alloc_cpu(n + kHeader));
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
