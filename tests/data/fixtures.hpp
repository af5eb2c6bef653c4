// tests/data/fixtures.hpp — what the shard, loader, tokenizer and corpus-reader tests share: a
// temporary folder, the error check, token lists, byte-level file patches, hand-written tokenizer
// models; in namespace grit, what the GritLM, JSONL-record, Prefetcher and tokenizer tests share
// (a hand-written BPE tokenizer, length-diverse records); in namespace stream, what the source
// and stream tests share (documents "w<k>" written as lines). Both reuse the outer TempDir and
// require_error.
#pragma once

#include <catch2/catch.hpp>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include <unistd.h>

#include <torch/torch.h>

#include <memopt/data/brown.hpp>
#include <memopt/data/grit.hpp>
#include <memopt/data/kjv.hpp>
#include <memopt/data/loader.hpp>
#include <memopt/data/shard.hpp>
#include <memopt/data/tokenizer.hpp>


#include "support.hpp"

namespace memopt::test::data {

using memopt::test::TempDir;

inline std::vector<int32_t> iota_tokens(int32_t n) {
  std::vector<int32_t> tokens(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) tokens[static_cast<size_t>(i)] = i;
  return tokens;
}

inline std::vector<unsigned char> read_bytes(const std::string& path) {
  const std::string text = memopt::test::read_text(path);
  return {text.begin(), text.end()};
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

/// memopt::test::require_error with the data components' prefix ("memopt::data:" unless given).
inline void require_error(const std::function<void()>& fn, const std::vector<std::string>& parts,
                          const std::string& prefix = "memopt::data:") {
  memopt::test::require_error(fn, prefix, parts);
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

// ---- the GritLM, JSONL-record and Prefetcher tests (make_tokenizer: the tokenizer test too) -
namespace grit {

using memopt::test::data::kWs;
using memopt::test::data::require_error;
using memopt::test::data::TempDir;

inline std::string le32(uint32_t v) {
  std::string out;
  for (int b = 0; b < 4; ++b) out += static_cast<char>(v >> (8 * b));
  return out;
}

/// A precompiled charsmap (darts-clone double array) with two rules, "\t" -> " " and
/// "\n" -> " ", as SentencePiece's default nmt_nfkc normalizer has.
inline std::string whitespace_charsmap() {
  std::vector<uint32_t> units(14, 0);
  units[0] = 1u << 10;                           // root: children at 1 ^ byte
  units[1 ^ 0x0A] = (7u << 10) | (1u << 8) | 0x0A;  // '\n', has a leaf at 11 ^ 7 = 12
  units[12] = 1u << 31;                          // leaf: replacement at offset 0
  units[1 ^ 0x09] = (5u << 10) | (1u << 8) | 0x09;  // '\t', leaf at 8 ^ 5 = 13
  units[13] = 1u << 31;
  std::string blob = le32(static_cast<uint32_t>(units.size() * 4));
  for (uint32_t u : units) blob += le32(u);
  blob += std::string(" \0", 2);
  return blob;
}

/// A character-level BPE model with a few merges; `newline_is_space`: "\n" and "\t"
/// normalize to " " (like nmt_nfkc), else the normalizer is the identity.
inline std::string make_model(bool newline_is_space) {
  std::vector<std::tuple<std::string, float, int>> pieces = {
      {"<unk>", 0.f, 2}, {"<s>", 0.f, 3}, {"</s>", 0.f, 3}, {kWs, 0.f, 1}};
  for (char c : std::string("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:;!?'\"-()/\n")) {
    pieces.emplace_back(std::string(1, c), 0.f, 1);
  }
  for (const auto& [merge, score] : std::vector<std::pair<std::string, float>>{
           {kWs + "t", -1.f}, {"he", -1.5f}, {kWs + "the", -2.f}, {"in", -2.5f}, {"er", -3.f}, {kWs + "a", -3.5f}}) {
    pieces.emplace_back(merge, score, 1);
  }
  std::string model;
  for (const auto& [text, score, type] : pieces) {
    model += pb_bytes(1, pb_bytes(1, text) + pb_float(2, score) + pb_int(3, static_cast<uint64_t>(type)));
  }
  model += pb_bytes(2, pb_int(3, 2));  // model_type BPE
  model += pb_bytes(3, newline_is_space ? pb_bytes(1, "nmt_nfkc") + pb_bytes(2, whitespace_charsmap())
                                        : pb_bytes(1, "identity"));
  return model;
}

/// A tokenizer from make_model, written to a file in a fresh temp folder.
inline std::shared_ptr<memopt::data::Tokenizer> make_tokenizer(bool newline_is_space = true) {
  static TempDir dir;  // lives for the whole test run
  static std::atomic<int> counter{0};
  const std::string path = dir.file("hand" + std::to_string(counter++) + ".model");
  std::ofstream(path, std::ios::binary) << make_model(newline_is_space);
  return std::make_shared<memopt::data::Tokenizer>(path);
}

/// Records whose query/positive/negative lengths grow with i (a length-diverse set).
inline std::vector<memopt::data::EmbedRecord> diverse_records(int n) {
  std::vector<memopt::data::EmbedRecord> out;
  for (int i = 0; i < n; ++i) {
    const int words = 1 + (i * 37) % n;  // lengths 1..n in a scrambled order
    // Appended, not "q" + to_string(i): GCC 12 warns of that form (-Wstringop-overflow, a false positive).
    const std::string id = std::to_string(i);
    std::string q = "q", p = "p", n = "n";
    q += id, p += id, n += id;
    for (int w = 0; w < words; ++w) {
      q += " ab";
      p += " cd ef";
      n += " gh ij";
    }
    out.push_back({q, p, {n}, "Find the passage"});
  }
  return out;
}

}  // namespace grit

// ---- the source and stream tests ----------------------------------------------------------
namespace stream {

using memopt::test::data::require_error;
using memopt::test::data::TempDir;
using memopt::test::write_text;

/// </s>: the id that ends each document of the tests' character-level tokenizer and shards.
inline constexpr int32_t kEos = 2;

// Writes documents first .. first + n - 1 as lines of `path`.
inline void write_docs(const std::string& path, int first, int n) {
  std::string text;
  // append, not "w" + std::to_string(k): GCC 12 -O3 warns falsely (-Wstringop-overflow) on that
  for (int k = first; k < first + n; ++k) text.append("w").append(std::to_string(k)).append("\n");
  write_text(path, text);
}

}  // namespace stream

}  // namespace memopt::test::data
