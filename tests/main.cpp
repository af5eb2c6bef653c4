// Test runner: memopt::init() installs the tracking allocator before any tensor exists
// (so the memory tests see exact counts) and sets LibTorch's threads, then runs Catch2.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <memopt/runtime.hpp>

int main(int argc, char** argv) {
  memopt::init();  // tracker before any tensor exists; threads before any parallel work
  return Catch::Session().run(argc, argv);
}
