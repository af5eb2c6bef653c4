// fuzz/manifest_fuzz.cpp — libFuzzer target for memopt/io/checkpoint.hpp's manifest reader:
// arbitrary text goes through memopt::io::Manifest::parse(). A c10::Error is the expected
// rejection; any other exception, a sanitizer report, a trap or a hang is a bug. A manifest
// it accepts must survive dump() and parse() again unchanged.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

// clang 14 in C++20 rejects LibTorch 1.13's <torch/torch.h> (a std::vector<c10::IValue> used
// while IValue is still incomplete) unless IValue's header comes first.
#include <ATen/core/ivalue.h>
#include <memopt/io/manifest.hpp>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using memopt::io::Manifest;
  const std::string path = "fuzz/manifest.json";
  Manifest manifest;
  try {
    manifest = Manifest::parse(std::string(reinterpret_cast<const char*>(data), size), path);
  } catch (const c10::Error&) {
    return 0;  // rejected, with a message naming the field: what bad text should get
  }
  Manifest again;
  try {
    again = Manifest::parse(manifest.dump(), path);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "manifest_fuzz: an accepted manifest's dump() is rejected: %s\n", e.what_without_backtrace());
    std::abort();
  }
  if (again.step != manifest.step || again.files != manifest.files) {
    std::fprintf(stderr, "manifest_fuzz: dump() then parse() changed the manifest\n");
    std::abort();
  }
  return 0;
}
