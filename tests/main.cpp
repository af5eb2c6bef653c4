// Test runner: installs memopt's tracking allocator before any tensor exists (so the
// memory tests see exact counts), pins LibTorch to the available CPUs, then runs Catch2.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <memopt/memory/tracker.hpp>

int main(int argc, char** argv) {
  memopt::memory::Tracker::install();
  return Catch::Session().run(argc, argv);
}
