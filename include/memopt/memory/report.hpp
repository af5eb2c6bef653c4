// memopt/memory/report.hpp — the memory report printed at the end of training and
// returned as a struct: tracked tensor bytes (live, peak, per-phase peaks, allocation
// count) next to process RSS (current and peak), and on CUDA builds with a GPU, the CUDA
// caching allocator's own figures (allocated, reserved, peak) for each device.
#pragma once

#include <string>
#include <vector>

#include <fmt/format.h>
#include <torch/cuda.h>

#include "memopt/detail/version.hpp"
#include "memopt/memory/rss.hpp"
#include "memopt/memory/tracker.hpp"

#if MEMOPT_HAS_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace memopt::memory {

inline double mib(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

/// One CUDA device's caching-allocator figures (LibTorch's own counts: the tracker sees CPU
/// tensors only).
struct CudaMemory {
  int device = 0;
  int64_t allocated_bytes = 0;       // held by tensors now
  int64_t reserved_bytes = 0;        // held by the caching allocator (allocated + cached)
  int64_t peak_allocated_bytes = 0;  // since the process began or the last reset_cuda_peaks()

  /// Every visible device's figures; empty on a CPU-only build or machine.
  static std::vector<CudaMemory> now() {
    std::vector<CudaMemory> out;
#if MEMOPT_HAS_CUDA
    if (!torch::cuda::is_available()) return out;
    // The caching allocator starts at the process's first CUDA allocation (asking it for stats
    // before that fails with "Invalid device argument"): until then it holds nothing.
    const bool started = c10::cuda::CUDACachingAllocator::get()->initialized();
    for (int d = 0; d < static_cast<int>(torch::cuda::device_count()); ++d) {
      if (!started) {
        out.push_back({.device = d});
        continue;
      }
      const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(d));
      constexpr auto kAll = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
      out.push_back({d, stats.allocated_bytes[kAll].current, stats.reserved_bytes[kAll].current,
                     stats.allocated_bytes[kAll].peak});
    }
#endif
    return out;
  }
};

/// Resets the CUDA caching allocator's peak counts on every device (a no-op without CUDA).
inline void reset_cuda_peaks() {
#if MEMOPT_HAS_CUDA
  if (!torch::cuda::is_available()) return;
  for (int d = 0; d < static_cast<int>(torch::cuda::device_count()); ++d)
    c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(d));
#endif
}

/// Everything memopt measured about memory, at one moment.
///   auto r = memopt::memory::Report::now();  fmt::print("{}", r.table());
struct Report {
  bool tracked = false;  // false: the tracker was never installed, tensor figures are 0
  Snapshot tensors;
  int64_t rss_bytes = 0;
  int64_t peak_rss_bytes = 0;
  std::vector<CudaMemory> cuda;  // one entry per CUDA device; empty without CUDA

  static Report now() {
    const auto& t = Tracker::instance();
    return {t.installed(), t.snapshot(), current_rss_bytes(), memory::peak_rss_bytes(), CudaMemory::now()};
  }

  /// A small fixed-width table for the terminal.
  std::string table() const {
    std::string out = "memory report\n";
    if (tracked) {
      out += fmt::format("  tensors live      {:10.1f} MiB\n", mib(tensors.live_bytes));
      out += fmt::format("  tensors peak      {:10.1f} MiB\n", mib(tensors.peak_bytes));
      for (int p = 1; p < kNumPhases; ++p)
        out += fmt::format("    peak in {:<9} {:10.1f} MiB\n", phase_name(static_cast<Phase>(p)),
                           mib(tensors.phase_peak_bytes[p]));
      out += fmt::format("  allocations       {:10d}\n", tensors.allocations);
    } else {
      out += "  tensors           (tracker not installed: call memopt::memory::Tracker::install() first)\n";
    }
    out += fmt::format("  RSS now           {:10.1f} MiB\n", mib(rss_bytes));
    out += fmt::format("  RSS peak          {:10.1f} MiB\n", mib(peak_rss_bytes));
    for (const auto& c : cuda)
      out += fmt::format("  cuda:{} allocated  {:10.1f} MiB, reserved {:.1f} MiB, peak {:.1f} MiB\n", c.device,
                         mib(c.allocated_bytes), mib(c.reserved_bytes), mib(c.peak_allocated_bytes));
    return out;
  }
};

}  // namespace memopt::memory
