// fuzz/jsonl_record_fuzz.cpp — libFuzzer target for memopt/data/source.hpp's JSONL reader:
// arbitrary bytes are one line of a JSONL file and go through parse_jsonl_record(line, "text",
// ...), as DocumentReader calls it for every record. A text it accepts must come back unchanged
// from a record written around it. A c10::Error is the expected rejection (not JSON, not an
// object, no "text", not a string); any other exception, a sanitizer report, a trap or a hang is
// a bug.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

// clang 14 in C++20 rejects LibTorch 1.13's <torch/torch.h> (a std::vector<c10::IValue> used
// while IValue is still incomplete) unless IValue's header comes first.
#include <ATen/core/ivalue.h>
#include <memopt/data/source.hpp>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view line(reinterpret_cast<const char*>(data), size);
  std::string text;
  try {
    text = memopt::data::parse_jsonl_record(line, "text", "fuzz.jsonl", 1);
  } catch (const c10::Error&) {
    return 0;  // rejected, with the file, the line and what was seen
  }
  std::string again;
  try {
    again = memopt::data::parse_jsonl_record(nlohmann::json{{"id", 1}, {"text", text}}.dump(), "text", "fuzz.jsonl", 2);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "jsonl_record_fuzz: a record around an accepted text is rejected: %s\n", e.what_without_backtrace());
    std::abort();
  }
  if (again != text) {
    std::fprintf(stderr, "jsonl_record_fuzz: the text changed on a round trip\n");
    std::abort();
  }
  return 0;
}
