// memopt/data/text_spans.hpp — how tokenizer.json pre-tokenizers cut text, as Hugging Face
// tokenizers does: Unicode whitespace, GPT-2's byte-to-character table, {"String"}/{"Regex"}
// patterns, one-character matches, and the five SplitDelimiterBehaviors.
#pragma once

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "memopt/data/regex.hpp"
#include "memopt/data/unicode.hpp"

namespace memopt::data {

namespace detail {

/// Rust's char::is_whitespace (Unicode White_Space), which tokenizers' strip and lstrip use.
inline bool is_unicode_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

/// Bytes of the whitespace run at the start (or, with `at_end`, the end) of `s`.
inline size_t space_run(std::string_view s, bool at_end) {
  size_t n = 0;
  if (!at_end) {
    while (n < s.size()) {
      const size_t len = utf8_char_len(s[n]);
      if (!is_unicode_space(first_code_point(s.substr(n, len)))) break;
      n += len;
    }
    return n;
  }
  size_t end = s.size();
  while (end > 0) {
    size_t start = end - 1;
    while (start > 0 && (static_cast<uint8_t>(s[start]) & 0xC0) == 0x80) --start;
    if (!is_unicode_space(first_code_point(s.substr(start, end - start)))) break;
    end = start;
  }
  return s.size() - end;
}

/// GPT-2's byte-to-character table: byte b is the UTF-8 text of byte_char[b].
inline const std::array<std::string, 256>& byte_chars() {
  static const std::array<std::string, 256> table = [] {
    std::array<std::string, 256> t;
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      append_utf8(t[b], printable ? b : next++);
    }
    return t;
  }();
  return table;
}

/// The byte a GPT-2 byte character stands for, -1 for other characters.
inline int char_byte(uint32_t c) {
  static const std::vector<int> table = [] {
    std::vector<int> t(324, -1);
    const auto& chars = byte_chars();
    for (int b = 0; b < 256; ++b) t[first_code_point(chars[static_cast<size_t>(b)])] = b;
    return t;
  }();
  return c < table.size() ? table[c] : -1;
}

/// A piece of text on its way through the pre-tokenizers; `at_origin`: it starts the input.
struct TextPiece {
  std::string text;
  bool at_origin;
};

/// tokenizers' SplitDelimiterBehavior.
enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

/// A {"String": ...} or {"Regex": ...} pattern (or one character), found left to right.
struct Pattern {
  std::string literal;
  std::shared_ptr<const Regex> regex;

  /// Spans covering `text`: {begin, end, is_match}.
  std::vector<std::tuple<size_t, size_t, bool>> spans(std::string_view text) const {
    std::vector<std::pair<size_t, size_t>> found;
    if (regex) {
      found = regex->find_all(text);
    } else if (!literal.empty()) {
      for (size_t at = text.find(literal); at != std::string_view::npos; at = text.find(literal, at + literal.size())) {
        found.emplace_back(at, at + literal.size());
      }
    }
    std::vector<std::tuple<size_t, size_t, bool>> out;
    size_t prev = 0;
    for (const auto& [begin, end] : found) {
      if (prev < begin) out.emplace_back(prev, begin, false);
      out.emplace_back(begin, end, true);
      prev = end;
    }
    if (prev < text.size()) out.emplace_back(prev, text.size(), false);
    return out;
  }
};

/// NormalizedString::split: the pieces of `text` kept under `behavior` (empty ones dropped).
inline std::vector<std::pair<size_t, size_t>> split_spans(const std::vector<std::tuple<size_t, size_t, bool>>& spans,
                                                          SplitBehavior behavior) {
  std::vector<std::pair<size_t, size_t>> kept;
  bool previous = false;
  if (behavior == SplitBehavior::kMergedWithNext) {
    for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
      const auto [begin, end, match] = *it;
      if (match && !previous && !kept.empty()) kept.back().first = begin;
      else kept.emplace_back(begin, end);
      previous = match;
    }
    std::reverse(kept.begin(), kept.end());
    return kept;
  }
  for (const auto& [begin, end, match] : spans) {
    if (behavior == SplitBehavior::kRemoved && match) continue;
    const bool merge = (behavior == SplitBehavior::kContiguous && match == previous) ||
                       (behavior == SplitBehavior::kMergedWithPrevious && match && !previous);
    if (merge && !kept.empty()) kept.back().second = end;
    else kept.emplace_back(begin, end);
    previous = match;
  }
  return kept;
}

/// Each character for which `is_match` holds is a match of its own (tokenizers' Fn(char) pattern).
template <typename Predicate>
std::vector<std::tuple<size_t, size_t, bool>> char_spans(std::string_view text, Predicate is_match) {
  std::vector<std::tuple<size_t, size_t, bool>> out;
  size_t prev = 0;
  for (size_t at = 0; at < text.size();) {
    const size_t n = utf8_char_len(text[at]);
    if (is_match(text.substr(at, n))) {
      if (prev < at) out.emplace_back(prev, at, false);
      out.emplace_back(at, at + n, true);
      prev = at + n;
    }
    at += n;
  }
  if (prev < text.size()) out.emplace_back(prev, text.size(), false);
  return out;
}

/// Rust's char::is_numeric (Unicode Nd, Nl, No), which the Digits pre-tokenizer uses.
inline bool is_numeric(std::string_view c) {
#if defined(MEMOPT_WITH_UTF8PROC)
  const auto category = utf8proc_category(static_cast<utf8proc_int32_t>(first_code_point(c)));
  return category == UTF8PROC_CATEGORY_ND || category == UTF8PROC_CATEGORY_NL || category == UTF8PROC_CATEGORY_NO;
#else
  return c.size() == 1 && std::isdigit(static_cast<unsigned char>(c[0])) != 0;
#endif
}

}  // namespace detail

}  // namespace memopt::data
