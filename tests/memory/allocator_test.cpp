// tests/memory/allocator_test.cpp — memopt/memory/allocator.hpp: the allocator settings string
// (MEMOPT_ALLOC_CONF) parsed with units and presets, applied by mallopt, CUDA keys passed on, and
// bad input named with a HINT.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <string>

#include <memopt/memory/allocator.hpp>

#include "support.hpp"

TEST_CASE("allocator settings: parsed with units, applied by mallopt, bad input named", "[memory][allocator]") {
  using memopt::memory::AllocatorOptions;
  const auto o = AllocatorOptions::parse(" arena_max:2, trim_threshold:64MB,mmap_threshold:512kb ,top_pad:0,"
                                         "expandable_segments:True,max_split_size_mb:128");
  CHECK(o.arena_max() == 2);
  CHECK(o.trim_threshold() == (int64_t{64} << 20));
  CHECK(o.mmap_threshold() == (int64_t{512} << 10));
  CHECK(o.top_pad() == 0);
  CHECK(o.cuda() == "expandable_segments:True,max_split_size_mb:128");  // passed through to CUDA's allocator
  CHECK_NOTHROW(o.apply());
  // A CPU build cannot apply the CUDA keys: it says so in one line naming them, never silently.
  CHECK(o.cpu_warning().find("'expandable_segments:True,max_split_size_mb:128' do nothing") != std::string::npos);
  CHECK(o.cpu_warning().find("HINT") != std::string::npos);
  CHECK(AllocatorOptions::parse("arena_max:2").cpu_warning().empty());
  CHECK(AllocatorOptions::parse("").empty());
  CHECK_NOTHROW(AllocatorOptions().apply());  // nothing set: glibc's defaults stay
  // memopt's default for training: every block from the heap, 1 GB kept at its top; the other keys override it.
  const auto training = AllocatorOptions::parse("preset:training,trim_threshold:256MB,arena_max:2");
  CHECK(training.mmap_max() == 0);
  CHECK(training.trim_threshold() == (int64_t{256} << 20));
  CHECK(training.arena_max() == 2);
  CHECK(AllocatorOptions::parse("preset:glibc").empty());
  const char* env = std::getenv("MEMOPT_ALLOC_CONF");
  const std::string saved = env ? env : "";
  ::unsetenv("MEMOPT_ALLOC_CONF");
  CHECK(AllocatorOptions::from_env().mmap_max() == 0);  // unset: the training preset
  CHECK(AllocatorOptions::from_env().trim_threshold() == (int64_t{1} << 30));
  ::setenv("MEMOPT_ALLOC_CONF", "preset:glibc", 1);
  CHECK(AllocatorOptions::from_env().empty());
  if (env) ::setenv("MEMOPT_ALLOC_CONF", saved.c_str(), 1);
  else ::unsetenv("MEMOPT_ALLOC_CONF");

  using memopt::test::require_error;
  const std::string prefix = "memopt::memory::AllocatorOptions: MEMOPT_ALLOC_CONF";
  require_error([] { AllocatorOptions::parse("arena_max:2,max_arenas:4"); }, prefix,
                {"unknown key 'max_arenas'", "arena_max, trim_threshold"});
  require_error([] { AllocatorOptions::parse("trim_threshold:lots"); }, prefix, {"trim_threshold", "(got 'lots')"});
  require_error([] { AllocatorOptions::parse("arena_max:2MB"); }, prefix, {"arena_max", "integer", "(got '2MB')"});
  require_error([] { AllocatorOptions::parse("mmap_threshold:64MB"); }, prefix, {"at most 32MB", "(got 64MB)"});
  require_error([] { AllocatorOptions::parse("arena_max"); }, prefix, {"'arena_max' has no value"});
  require_error([] { AllocatorOptions::parse("arena_max:0"); }, prefix, {"arena_max must be >= 1 (got 0)"});
  require_error([] { AllocatorOptions::parse("preset:fast"); }, prefix, {"preset must be training or glibc (got 'fast')"});
  require_error([] { AllocatorOptions::parse("mmap_max:-1"); }, prefix, {"mmap_max", "(got '-1')"});
  // memopt::init(RuntimeOptions().alloc_conf(...)) names its option (the process's setting, never a Trainer's).
  require_error([] { AllocatorOptions::parse("arena:1", "RuntimeOptions::alloc_conf"); },
                "memopt::memory::AllocatorOptions: RuntimeOptions::alloc_conf", {"unknown key 'arena'"});
}
