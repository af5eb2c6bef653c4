// tests/data/fixtures.hpp — what the shard, loader, tokenizer and corpus-reader tests share: a
// temporary folder, token lists, byte-level file patches, hand-written tokenizer models.
#pragma once

#include <catch2/catch.hpp>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include <unistd.h>

#include <torch/torch.h>

#include <memopt/data/brown.hpp>
#include <memopt/data/kjv.hpp>
#include <memopt/data/loader.hpp>
#include <memopt/data/shard.hpp>
#include <memopt/data/tokenizer.hpp>


#include "support.hpp"

namespace memopt::test::data {

struct TempDir : memopt::test::TempDir {
  TempDir() : memopt::test::TempDir("memopt_data_test") {}
};

inline std::vector<int32_t> iota_tokens(int32_t n) {
  std::vector<int32_t> tokens(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) tokens[static_cast<size_t>(i)] = i;
  return tokens;
}

inline std::vector<unsigned char> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline void write_bytes(const std::string& path, const std::vector<unsigned char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

/// Overwrites `n` little-endian bytes of `value` at `offset` of the file.
inline void patch_le(const std::string& path, size_t offset, uint64_t value, size_t n) {
  auto bytes = read_bytes(path);
  for (size_t b = 0; b < n; ++b) bytes[offset + b] = static_cast<unsigned char>(value >> (8 * b));
  write_bytes(path, bytes);
}

inline void require_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  memopt::test::require_error(fn, "memopt::data:", parts);
}

inline bool same(const torch::Tensor& a, const torch::Tensor& b) { return torch::equal(a, b); }

using memopt::test::pb_bytes;
using memopt::test::pb_float;
using memopt::test::pb_int;
using memopt::test::pb_varint;

using memopt::test::make_model;

const std::string kWs = "\xe2\x96\x81";  // "▁"

inline bool have_program(const std::string& name) {
  return std::system(("command -v " + name + " > /dev/null 2>&1").c_str()) == 0;
}

}  // namespace memopt::test::data
