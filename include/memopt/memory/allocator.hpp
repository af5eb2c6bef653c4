// memopt/memory/allocator.hpp — host allocator settings, the CPU counterpart of
// PYTORCH_CUDA_ALLOC_CONF: glibc malloc's arena count and its trim, mmap and top-pad
// thresholds, set by mallopt() before training. One string configures both allocators:
//   MEMOPT_ALLOC_CONF="arena_max:2,mmap_threshold:1MB,expandable_segments:True"
// glibc keys go to mallopt(); CUDA caching-allocator keys go to PYTORCH_CUDA_ALLOC_CONF.
// Unset (or empty), memopt::init() applies preset:training — freed blocks stay in the heap
// for the next step instead of being unmapped and faulted in again (no mmapped blocks, a 1 GB
// trim threshold): the CPU counterpart of CUDA's caching allocator. preset:glibc keeps glibc's
// defaults (dynamic thresholds: every block above ~32 MB is mapped and unmapped each time).
#pragma once

#include <malloc.h>

#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>

#include "memopt/detail/version.hpp"

// AddressSanitizer replaces glibc's malloc with its own: its mallopt() does nothing and
// returns 0, so under ASan (scripts/sanitize) the glibc settings are checked, not applied.
#if defined(__SANITIZE_ADDRESS__)
#define MEMOPT_GLIBC_MALLOC 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MEMOPT_GLIBC_MALLOC 0
#endif
#endif
#ifndef MEMOPT_GLIBC_MALLOC
#define MEMOPT_GLIBC_MALLOC 1
#endif

namespace memopt::memory {

/// The parsed settings; -1 leaves glibc's default (dynamic thresholds, 8 arenas per core).
///   auto a = memopt::memory::AllocatorOptions::parse("arena_max:1,trim_threshold:0");
///   a.apply();
struct AllocatorOptions {
  /// M_ARENA_MAX: malloc arenas (threads share them); fewer arenas, less fragmentation.
  TORCH_ARG(int64_t, arena_max) = -1;
  /// M_TRIM_THRESHOLD bytes: free memory at the heap top above this goes back to the OS.
  TORCH_ARG(int64_t, trim_threshold) = -1;
  /// M_MMAP_THRESHOLD bytes: blocks at least this big get their own mapping, unmapped on
  /// free (returned at once; costs page faults on reuse). glibc caps it at 32 MiB.
  TORCH_ARG(int64_t, mmap_threshold) = -1;
  /// M_TOP_PAD bytes: extra heap grown (and kept) on each sbrk.
  TORCH_ARG(int64_t, top_pad) = -1;
  /// M_MMAP_MAX: how many blocks may have their own mapping at once; 0 serves every block
  /// from the heap (freed ones are reused without page faults).
  TORCH_ARG(int64_t, mmap_max) = -1;
  /// Keys for the CUDA caching allocator ("expandable_segments:True,max_split_size_mb:128").
  TORCH_ARG(std::string, cuda) = "";

 public:
  /// The CUDA caching allocator's keys, passed through to PYTORCH_CUDA_ALLOC_CONF.
  static const std::vector<std::string>& cuda_keys() {
    static const std::vector<std::string> keys{"expandable_segments", "max_split_size_mb",
                                               "garbage_collection_threshold", "roundup_power2_divisions",
                                               "backend", "release_lock_on_cudamalloc", "pinned_use_cuda_host_register",
                                               "pinned_num_register_threads"};
    return keys;
  }

  /// memopt's default for training: every block from the heap (mmap_max 0) and freed memory
  /// kept up to 1 GB at its top (trim_threshold), so each step reuses the last one's pages.
  /// On this project's 2-core machine it made a d256 LLaMA step at micro-batch 8 1.7-2x
  /// faster than glibc's defaults for +3% peak RSS (docs/memory_levers.md, "Allocator settings").
  static AllocatorOptions training() { return AllocatorOptions().mmap_max(0).trim_threshold(int64_t{1} << 30); }

  /// Parses "key:value,key:value". Sizes take B, KB, MB, GB (powers of 1024) or no unit.
  /// preset:training or preset:glibc starts from that preset (else from glibc's defaults);
  /// the other keys override it.
  static AllocatorOptions parse(const std::string& conf, const std::string& source = "MEMOPT_ALLOC_CONF") {
    AllocatorOptions o;
    size_t start = 0;
    while (start < conf.size()) {
      size_t end = conf.find(',', start);
      if (end == std::string::npos) end = conf.size();
      const std::string item = trim(conf.substr(start, end - start));
      start = end + 1;
      if (item.empty()) continue;
      const size_t colon = item.find(':');
      TORCH_CHECK(colon != std::string::npos, "memopt::memory::AllocatorOptions: ", source, ": item '", item,
                  "' has no value. HINT: write key:value pairs separated by commas, e.g. arena_max:2,mmap_threshold:1MB.");
      const std::string key = trim(item.substr(0, colon)), value = trim(item.substr(colon + 1));
      if (key == "arena_max") {
        o.arena_max(size_value(source, key, value, /*units=*/false));
        TORCH_CHECK(o.arena_max() >= 1, "memopt::memory::AllocatorOptions: ", source,
                    ": arena_max must be >= 1 (got ", value, "). HINT: 1 or 2 arenas suit a training process.");
      } else if (key == "trim_threshold") {
        o.trim_threshold(size_value(source, key, value, true));
      } else if (key == "mmap_threshold") {
        o.mmap_threshold(size_value(source, key, value, true));
        TORCH_CHECK(o.mmap_threshold() <= (int64_t{32} << 20), "memopt::memory::AllocatorOptions: ", source,
                    ": mmap_threshold must be at most 32MB, glibc's limit (got ", value,
                    "). HINT: 1MB maps every tensor of a megabyte or more on its own.");
      } else if (key == "top_pad") {
        o.top_pad(size_value(source, key, value, true));
      } else if (key == "mmap_max") {
        o.mmap_max(size_value(source, key, value, /*units=*/false));
      } else if (key == "preset") {
        TORCH_CHECK(value == "training" || value == "glibc", "memopt::memory::AllocatorOptions: ", source,
                    ": preset must be training or glibc (got '", value, "'). HINT: training keeps freed blocks for "
                    "the next step; glibc keeps glibc's defaults.");
        const std::string cuda = o.cuda();
        o = value == "training" ? training() : AllocatorOptions();
        o.cuda(cuda);
      } else if (is_cuda_key(key)) {
        o.cuda(o.cuda().empty() ? item : o.cuda() + "," + item);
      } else {
        std::string known = "preset, arena_max, trim_threshold, mmap_threshold, mmap_max, top_pad";
        for (const auto& k : cuda_keys()) known += ", " + k;
        TORCH_CHECK(false, "memopt::memory::AllocatorOptions: ", source, ": unknown key '", key,
                    "'. HINT: the keys are ", known, ".");
      }
    }
    return o;
  }

  /// Parses $MEMOPT_ALLOC_CONF; unset or empty: training().
  static AllocatorOptions from_env() {
    const char* env = std::getenv("MEMOPT_ALLOC_CONF");
    return env != nullptr && *env != '\0' ? parse(env) : training();
  }

  bool empty() const {
    return arena_max_ < 0 && trim_threshold_ < 0 && mmap_threshold_ < 0 && top_pad_ < 0 && mmap_max_ < 0 &&
           cuda_.empty();
  }

  /// Applies the settings: mallopt() for glibc's, PYTORCH_CUDA_ALLOC_CONF for CUDA's
  /// (which takes effect if no CUDA memory was allocated yet: call memopt::init() first).
  /// Under AddressSanitizer, whose allocator replaces glibc's, the glibc keys are only checked.
  void apply() const {
    set(M_ARENA_MAX, arena_max_, "arena_max");
    set(M_TRIM_THRESHOLD, trim_threshold_, "trim_threshold");
    set(M_MMAP_THRESHOLD, mmap_threshold_, "mmap_threshold");
    set(M_TOP_PAD, top_pad_, "top_pad");
    set(M_MMAP_MAX, mmap_max_, "mmap_max");
#if MEMOPT_HAS_CUDA
    if (!cuda_.empty()) ::setenv("PYTORCH_CUDA_ALLOC_CONF", cuda_.c_str(), /*overwrite=*/1);
#endif
  }

  /// The line to print when the settings name CUDA allocator keys but no GPU will use them ("" when
  /// there are none): a CPU build, or a CUDA build on a machine without a GPU. The keys are checked
  /// and passed on, never silently dropped (memopt::init() prints it).
  std::string cpu_warning() const {
    if (cuda_.empty()) return "";
    return std::string("memopt: warning: the CUDA allocator settings '") + cuda_ + "' do nothing here (" +
           (MEMOPT_HAS_CUDA ? "no CUDA device visible" : "a CPU build of memopt") + "). HINT: on CPU only preset, "
           "arena_max, trim_threshold, mmap_threshold, mmap_max and top_pad act\n";
  }

 private:
  static bool is_cuda_key(const std::string& key) {
    for (const auto& k : cuda_keys())
      if (k == key) return true;
    return false;
  }

  static std::string trim(const std::string& s) {
    size_t a = 0, b = s.size();
    while (a < b && std::isspace(static_cast<unsigned char>(s[a]))) ++a;
    while (b > a && std::isspace(static_cast<unsigned char>(s[b - 1]))) --b;
    return s.substr(a, b - a);
  }

  static int64_t size_value(const std::string& source, const std::string& key, const std::string& value,
                            bool units) {
    size_t digits = 0;
    while (digits < value.size() && std::isdigit(static_cast<unsigned char>(value[digits]))) ++digits;
    std::string unit = value.substr(digits);
    for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    int64_t scale = 0;
    if (unit.empty() || unit == "B") scale = 1;
    if (units && (unit == "KB" || unit == "K")) scale = int64_t{1} << 10;
    if (units && (unit == "MB" || unit == "M")) scale = int64_t{1} << 20;
    if (units && (unit == "GB" || unit == "G")) scale = int64_t{1} << 30;
    TORCH_CHECK(digits > 0 && digits <= 12 && scale > 0, "memopt::memory::AllocatorOptions: ", source, ": ", key,
                " must be a non-negative ", units ? "size (a number with B, KB, MB or GB)" : "integer", " (got '",
                value, "'). HINT: e.g. ", key, units ? ":64MB" : ":2", ".");
    return std::stoll(value.substr(0, digits)) * scale;
  }

  static void set(int param, int64_t value, const char* key) {
    if (value < 0) return;
    TORCH_CHECK(value <= INT32_MAX && (!MEMOPT_GLIBC_MALLOC || ::mallopt(param, static_cast<int>(value)) == 1),
                "memopt::memory::AllocatorOptions: mallopt rejected ", key, " = ", value,
                ". HINT: thresholds below 2GB (mmap_threshold at most 32MB).");
  }
};

/// Gives the host heap's free pages back to the system (glibc's malloc_trim(0): also whole free
/// pages inside the heap, not only at its top). Under preset:training freed blocks stay in the
/// heap, so a large tensor freed for good (a dense weight once quantised) would stay resident.
inline void release_free_host_memory() {
#if MEMOPT_GLIBC_MALLOC
  ::malloc_trim(0);
#endif
}

}  // namespace memopt::memory
