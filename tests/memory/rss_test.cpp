// tests/memory/rss_test.cpp — memopt/memory/rss.hpp: the resident set grows by about the size
// of a block of memory once its pages are touched and shrinks when it is unmapped; the peak
// keeps the high point until reset_peak_rss() brings it down to the current size.
//
// Tolerances are loose on purpose: RSS counts whole pages of the process (other threads,
// allocator caches, Catch2's own allocations, transparent huge pages rounding up to 2 MiB),
// so the test touches 128 MiB of fresh pages and asks for the change within 16 MiB of it; the
// kernel's high-water mark may also lag the current size by a few hundred KiB.
#include <catch2/catch.hpp>

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>

#include <memopt/memory/rss.hpp>

using memopt::memory::current_rss_bytes;
using memopt::memory::peak_rss_bytes;

namespace {

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kBlock = 128 * kMiB;
constexpr int64_t kSlack = 16 * kMiB;

}  // namespace

TEST_CASE("RSS grows by a touched block, shrinks when it is unmapped, and the peak keeps it", "[memory][rss]") {
  const int64_t before = current_rss_bytes();
  REQUIRE(before > 0);
  CHECK(before % sysconf(_SC_PAGESIZE) == 0);
  CHECK(peak_rss_bytes() >= before - kSlack);

  // Fresh anonymous pages (not the allocator's recycled ones): resident only once written.
  void* block = mmap(nullptr, kBlock, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(block != MAP_FAILED);
  CHECK(current_rss_bytes() - before < kSlack);  // mapped, not touched
  volatile char* bytes = static_cast<char*>(block);
  for (int64_t i = 0; i < kBlock; i += 4096) bytes[i] = 1;  // every page (4 KiB or larger)
  const int64_t touched = current_rss_bytes();
  const int64_t peak_touched = peak_rss_bytes();
  INFO("RSS before " << before / kMiB << " MiB, with the block " << touched / kMiB << " MiB, peak "
                     << peak_touched / kMiB << " MiB");
  CHECK(touched - before > kBlock - kSlack);
  CHECK(touched - before < kBlock + kSlack);
  CHECK(peak_touched >= touched - kSlack);

  REQUIRE(munmap(block, kBlock) == 0);
  const int64_t after = current_rss_bytes();
  INFO("RSS after munmap " << after / kMiB << " MiB");
  CHECK(touched - after > kBlock - kSlack);
  CHECK(peak_rss_bytes() >= touched - kSlack);  // the peak remembers the block

  // A reset brings the peak down to about the current size (where the kernel allows it).
  if (memopt::memory::reset_peak_rss()) {
    const int64_t peak_reset = peak_rss_bytes();
    INFO("peak after reset " << peak_reset / kMiB << " MiB");
    CHECK(peak_reset < touched - kBlock / 2);
    CHECK(peak_reset >= current_rss_bytes() - kSlack);
  } else {
    WARN("/proc/self/clear_refs refused the reset; its check is skipped");
  }
}
