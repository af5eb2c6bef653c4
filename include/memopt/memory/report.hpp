// memopt/memory/report.hpp — the memory report printed at the end of training and
// returned as a struct: tracked tensor bytes (live, peak, per-phase peaks, allocation
// count) next to process RSS (current and peak).
#pragma once

#include <string>

#include <fmt/format.h>

#include "memopt/memory/rss.hpp"
#include "memopt/memory/tracker.hpp"

namespace memopt::memory {

inline double mib(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

/// Everything memopt measured about memory, at one moment.
///   auto r = memopt::memory::Report::now();  fmt::print("{}", r.table());
struct Report {
  bool tracked = false;  // false: the tracker was never installed, tensor figures are 0
  Snapshot tensors;
  int64_t rss_bytes = 0;
  int64_t peak_rss_bytes = 0;

  static Report now() {
    const auto& t = Tracker::instance();
    return {t.installed(), t.snapshot(), current_rss_bytes(), memory::peak_rss_bytes()};
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
    return out;
  }
};

}  // namespace memopt::memory
