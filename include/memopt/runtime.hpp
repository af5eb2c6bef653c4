// memopt/runtime.hpp — what a memopt program does first: apply the allocator settings
// (MEMOPT_ALLOC_CONF), install the exact memory tracker (before any tensor exists) and set
// LibTorch's thread count (it defaults to 1 here).
// Note: 2-thread OpenMP regions stall badly when other processes load the cores (steps
// ran up to 6x slower while compiles ran beside them); benchmark on an idle machine.
#pragma once

#include <sched.h>

#include <algorithm>
#include <string>
#include <thread>

#include <torch/torch.h>

#include "memopt/memory/allocator.hpp"
#include "memopt/memory/tracker.hpp"

namespace memopt {

/// CPUs this process may run on (its affinity mask), at least 1.
inline int available_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

/// Options of memopt::init().
struct RuntimeOptions {
  /// Intra-op threads; 0 means all CPUs this process may run on.
  TORCH_ARG(int, threads) = 0;
  /// Install the tracking CPU allocator (exact tensor byte counts).
  TORCH_ARG(bool, track_memory) = true;
  /// Allocator settings, "key:value,..." (memory/allocator.hpp); "" reads $MEMOPT_ALLOC_CONF.
  TORCH_ARG(std::string, alloc_conf) = "";
};

/// The first line of main(): tracker installed, threads set.
///   int main() { memopt::init(); ... }
inline void init(const RuntimeOptions& options = {}) {
  TORCH_CHECK(options.threads() >= 0, "memopt::init: threads must be >= 0 (got ", options.threads(),
              "). HINT: 0 uses every available CPU.");
  const auto allocator = options.alloc_conf().empty()
                             ? memory::AllocatorOptions::from_env()
                             : memory::AllocatorOptions::parse(options.alloc_conf(), "RuntimeOptions::alloc_conf");
  allocator.apply();  // before any tensor: arena and threshold settings shape every allocation
  if (options.track_memory()) memory::Tracker::install();
  at::set_num_threads(options.threads() > 0 ? options.threads() : available_cpus());
}

}  // namespace memopt
