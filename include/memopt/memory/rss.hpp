// memopt/memory/rss.hpp — resident set size of the process: current, peak, and a reset
// of the peak (Linux /proc/self/clear_refs) so one process can measure several phases.
// RSS counts touched pages (allocator caches, OpenBLAS buffers, code); the tracker counts
// tensor bytes. Reports show both.
#pragma once

#include <sys/resource.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <string>

namespace memopt::memory {

/// Current resident set size in bytes (0 where /proc is unavailable).
inline int64_t current_rss_bytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t pages_total = 0, pages_resident = 0;
  if (!(statm >> pages_total >> pages_resident)) return 0;
  return pages_resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

/// Peak resident set size in bytes since process start or the last reset_peak_rss().
inline int64_t peak_rss_bytes() {
  std::ifstream status("/proc/self/status");
  std::string key;
  while (status >> key) {
    if (key == "VmHWM:") {
      int64_t kib = 0;
      status >> kib;
      return kib * 1024;
    }
    status.ignore(1 << 16, '\n');
  }
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;
}

/// Resets the peak RSS to the current RSS. Returns false where the kernel refuses.
inline bool reset_peak_rss() {
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";
  clear.flush();
  return static_cast<bool>(clear);
}

}  // namespace memopt::memory
