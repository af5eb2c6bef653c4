// memopt/runtime.hpp — what a memopt program does first: apply the allocator settings
// (MEMOPT_ALLOC_CONF), install the exact memory tracker (before any tensor exists) and set
// LibTorch's thread count (it defaults to 1 here); then say what it computes with
// (log_performance_info: LibTorch, threads, BLAS, CPU features, policies).
// Note: 2-thread OpenMP regions stall badly when other processes load the cores (steps
// ran up to 6x slower while compiles ran beside them); benchmark on an idle machine.
#pragma once

#include <cxxabi.h>
#include <sched.h>

#include <algorithm>
#include <concepts>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>
#include <torch/version.h>

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

/// Intra-op threads for "0: all": the CPUs this process may run on, shared evenly by the ranks
/// torchrun started on this machine (LOCAL_WORLD_SIZE), at least 1.
inline int default_threads() {
  int local_ranks = 1;
  if (const char* n = std::getenv("LOCAL_WORLD_SIZE"); n != nullptr) local_ranks = std::max(1, std::atoi(n));
  return std::max(1, available_cpus() / local_ranks);
}

/// Options of memopt::init().
struct RuntimeOptions {
  /// Intra-op threads; 0 means all CPUs this process may run on (shared by the ranks on this
  /// machine under torchrun: default_threads()).
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
  if (!allocator.cuda().empty() && (!MEMOPT_HAS_CUDA || !torch::cuda::is_available()))
    std::fputs(allocator.cpu_warning().c_str(), stderr);  // CUDA keys with no GPU to use them: say so
  if (options.track_memory()) memory::Tracker::install();
  at::set_num_threads(options.threads() > 0 ? options.threads() : default_threads());
}

namespace detail {

// "memopt::accum::Fixed<4l>" -> "accum::Fixed<4>"
template <class T>
std::string policy_name() {
  if constexpr (requires { { T::name() } -> std::convertible_to<std::string>; }) {
    return T::name();  // memopt's policies name themselves
  } else {
    int status = 0;
    std::unique_ptr<char, void (*)(void*)> demangled(abi::__cxa_demangle(typeid(T).name(), nullptr, nullptr, &status),
                                                     std::free);
    std::string name = status == 0 && demangled ? demangled.get() : typeid(T).name();
    name = std::regex_replace(name, std::regex("memopt::"), "");
    return std::regex_replace(name, std::regex("([0-9]+)(l|ul|ll|ull)\\b"), "$1");
  }
}

// The first CPU's model name and flags (" avx2 fma … ", space-delimited) from /proc/cpuinfo.
struct CpuDescription {
  std::string model, flags;
};
inline const CpuDescription& cpu_description() {
  static const CpuDescription cpu = [] {
    CpuDescription d;
    std::ifstream cpuinfo("/proc/cpuinfo");
    std::string line;
    while (std::getline(cpuinfo, line) && (d.model.empty() || d.flags.empty())) {
      const auto colon = line.find(':');
      if (colon == std::string::npos) continue;
      if (d.model.empty() && line.rfind("model name", 0) == 0) d.model = line.substr(colon + 2);
      if (d.flags.empty() && line.rfind("flags", 0) == 0) d.flags = " " + line.substr(colon + 2) + " ";
    }
    return d;
  }();
  return cpu;
}

// The shared libraries of this process whose file name contains one of `keys`.
inline std::vector<std::string> loaded_libraries(const std::vector<std::string>& keys) {
  std::ifstream maps("/proc/self/maps");
  std::set<std::string> found;
  std::string line;
  while (std::getline(maps, line)) {
    const auto slash = line.find('/');
    if (slash == std::string::npos) continue;
    const std::string path = line.substr(slash);
    const std::string file = path.substr(path.rfind('/') + 1);
    for (const auto& key : keys)
      if (file.find(key) != std::string::npos) found.insert(path);
  }
  return {found.begin(), found.end()};
}

}  // namespace detail

/// Whether the CPU reports `feature` in /proc/cpuinfo's flags ("amx_bf16", "avx512_bf16", …).
inline bool cpu_has(std::string_view feature) {
  return detail::cpu_description().flags.find(" " + std::string(feature) + " ") != std::string::npos;
}

/// The CPU kind, by the bf16 matmul instructions /proc/cpuinfo reports:
/// "amx" (amx_bf16), "avx512_bf16", "avx2", or "other".
inline std::string cpu_kind() {
  if (cpu_has("amx_bf16")) return "amx";
  if (cpu_has("avx512_bf16")) return "avx512_bf16";
  if (cpu_has("avx2")) return "avx2";
  return "other";
}

/// The CPU flags that decide bf16 speed, space-separated (what benchmarks record as cpu_flags).
inline std::string cpu_flags() {
  std::string out;
  for (const char* f : {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
    if (cpu_has(f)) out += (out.empty() ? "" : " ") + std::string(f);
  return out.empty() ? "none" : out;
}

/// What decides this process's speed, as (label, value) lines: LibTorch version, intra-op
/// threads, the BLAS library actually loaded, the CPU and its matmul-relevant features.
///   for (auto& [k, v] : memopt::performance_info()) ...
inline std::vector<std::pair<std::string, std::string>> performance_info() {
  std::vector<std::pair<std::string, std::string>> info;
  info.emplace_back("libtorch", fmt::format("{} ({})", TORCH_VERSION, torch::cuda::is_available()
                                                                          ? fmt::format("CUDA, {} device(s)",
                                                                                        torch::cuda::device_count())
                                                                          : std::string("CPU")));
  info.emplace_back("threads", fmt::format("{} intra-op of {} CPUs available", at::get_num_threads(), available_cpus()));
  const auto fast_blas = detail::loaded_libraries({"openblas", "mkl", "blis"});
  std::string blas_text;
  for (const auto& path : fast_blas) blas_text += (blas_text.empty() ? "" : ", ") + path;
  if (at::hasMKL()) blas_text = "MKL (linked into LibTorch)" + (blas_text.empty() ? "" : "; also " + blas_text);
  if (blas_text.empty())
    blas_text = "no OpenBLAS, MKL or BLIS loaded: fp32 matmuls run on the reference BLAS (~5 GFLOP/s). "
                "HINT: apt install libopenblas0-openmp";
  info.emplace_back("blas", blas_text);
  const auto cpu = detail::cpu_description();
  std::string features;
  for (const char* f : {"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16"})
    features += fmt::format("{}{}{}", features.empty() ? "" : " ", cpu_has(f) ? "+" : "-", f);
  info.emplace_back("cpu", fmt::format("{} (kind: {})", cpu.model.empty() ? "unknown" : cpu.model, cpu_kind()));
  info.emplace_back("cpu features", cpu.flags.empty() ? "unknown" : features);
  return info;
}

/// Prints performance_info() (and, for a Trainer type, its four policies) to `out`, once,
/// before training: a run's log then says what its tokens/s were measured with.
///   memopt::log_performance_info<decltype(trainer)>();
template <class TrainerT = void>
void log_performance_info(std::FILE* out = stdout) {
  for (const auto& [label, value] : performance_info()) fmt::print(out, "{:>13}: {}\n", label, value);
  if constexpr (!std::is_void_v<TrainerT>) {
    fmt::print(out, "{:>13}: {}\n", "trainer", TrainerT::name());
  }
  std::fflush(out);
}

}  // namespace memopt
