// fuzz/shard_header_fuzz.cpp — libFuzzer target for memopt/data/shard.hpp: arbitrary bytes are a
// token shard file. Its first 64 bytes (zero-padded when the input is shorter) go through
// parse_shard_header() with the input's real size as the file size, as TokenShard and the stream
// reader call it. A header it accepts must describe the input exactly (2 or 4 bytes an id,
// 64 + count * width bytes, vocab_size in [1, 2^32]); the whole input is then opened as a
// TokenShard (every id checked against vocab_size) and read back with at() and copy_to(), and a
// shard with a zero reserved field must be what encode_shard() makes of its ids. A c10::Error is
// the expected rejection; any other exception, a sanitizer report, a trap or a hang is a bug.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

// clang 14 in C++20 rejects LibTorch 1.13's <torch/torch.h> (a std::vector<c10::IValue> used
// while IValue is still incomplete) unless IValue's header comes first.
#include <ATen/core/ivalue.h>
#include <memopt/data/shard.hpp>

namespace {

/// Stops the run with a message: libFuzzer records the input as a crash.
[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "shard_header_fuzz: %s\n", what.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memopt::data;
  unsigned char header[kShardHeaderBytes] = {};
  std::memcpy(header, data, std::min(size, static_cast<size_t>(kShardHeaderBytes)));
  ShardHeader h;
  try {
    h = parse_shard_header(header, static_cast<int64_t>(size), "fuzz.bin");
  } catch (const c10::Error&) {
    return 0;  // rejected, with a message naming the field: what bad bytes should get
  }
  if (h.bytes_per_token != 2 && h.bytes_per_token != 4) fail("accepted bytes_per_token " + std::to_string(h.bytes_per_token));
  if (h.tokens < 0 || static_cast<uint64_t>(kShardHeaderBytes + h.tokens * h.bytes_per_token) != size)
    fail("accepted a token count that does not match the size");
  if (h.vocab_size < 1 || h.vocab_size > (int64_t{1} << 32)) fail("accepted vocab_size " + std::to_string(h.vocab_size));

  std::shared_ptr<const TokenShard> shard;
  try {
    shard = std::make_shared<const TokenShard>("fuzz.bin", std::vector<unsigned char>(data, data + size));
  } catch (const c10::Error&) {
    return 0;  // an id >= vocab_size: refused with its position
  }
  if (shard->size() != h.tokens || shard->bytes_per_token() != h.bytes_per_token || shard->vocab_size() != h.vocab_size)
    fail("TokenShard and parse_shard_header disagree");
  std::vector<int64_t> ids(static_cast<size_t>(h.tokens));
  shard->copy_to(0, h.tokens, ids.data());
  std::vector<int32_t> narrow;
  for (int64_t i = 0; i < h.tokens; ++i) {
    if (ids[static_cast<size_t>(i)] != shard->at(i)) fail("copy_to() and at() disagree");
    if (ids[static_cast<size_t>(i)] < 0 || ids[static_cast<size_t>(i)] >= h.vocab_size) fail("an id >= vocab_size was accepted");
    narrow.push_back(static_cast<int32_t>(ids[static_cast<size_t>(i)]));
  }
  // encode_shard stores ids as int32: only vocabularies below 2^31 round-trip through it.
  const bool reserved_zero = std::all_of(data + 32, data + 64, [](uint8_t b) { return b == 0; });
  const bool same_width = (h.vocab_size <= 65536) == (h.bytes_per_token == 2);
  if (reserved_zero && same_width && h.vocab_size < (int64_t{1} << 31)) {
    const std::vector<unsigned char> again = encode_shard("fuzz.bin", narrow, h.vocab_size);
    if (again.size() != size || std::memcmp(again.data(), data, size) != 0) fail("encode_shard() of the ids differs from the input");
  }
  return 0;
}
