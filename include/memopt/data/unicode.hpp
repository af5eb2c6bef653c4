// memopt/data/unicode.hpp — the UTF-8 and Unicode pieces the tokenizers share: character
// lengths, checking or repairing malformed UTF-8 (InvalidUtf8), and Unicode normalization
// forms and lowercasing through utf8proc (when memopt's CMake found it: MEMOPT_WITH_UTF8PROC).
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <string_view>

#include <torch/torch.h>

#if defined(MEMOPT_WITH_UTF8PROC)
#include <utf8proc.h>
#endif

namespace memopt::data {

/// What a tokenizer does with bytes of its input that are not UTF-8 (a Latin-1 file, a cut
/// multi-byte character):
///   kReplace  each maximal malformed subpart becomes U+FFFD "�", as Python's
///             bytes.decode("utf-8", errors="replace") and Rust's String::from_utf8_lossy do
///             (the default: what a Python pipeline that reads the same file would see);
///   kReject   encode() fails, naming the byte offset and the bytes.
/// SentencePiece .model tokenizers replace each malformed byte, as SentencePiece itself does.
enum class InvalidUtf8 { kReplace, kReject };

namespace detail {

/// Bytes of the UTF-8 character starting with `lead` (SentencePiece's OneCharLen).
inline size_t utf8_char_len(char lead) {
  return static_cast<size_t>("\1\1\1\1\1\1\1\1\1\1\1\1\2\2\3\4"[static_cast<uint8_t>(lead) >> 4]);
}

/// Length of the valid UTF-8 character at the start of `s`, 0 when it is malformed
/// (SentencePiece's IsValidDecodeUTF8: overlong forms and surrogates are malformed).
inline size_t valid_utf8_prefix(std::string_view s) {
  auto trail = [&](size_t i) { return (static_cast<uint8_t>(s[i]) & 0xC0) == 0x80; };
  auto valid = [](uint32_t c) { return c < 0xD800 || (c >= 0xE000 && c <= 0x10FFFF); };
  const auto b0 = static_cast<uint8_t>(s[0]);
  if (b0 < 0x80) return 1;
  if (s.size() >= 2 && (b0 & 0xE0) == 0xC0 && trail(1)) {
    const uint32_t c = ((b0 & 0x1Fu) << 6) | (static_cast<uint8_t>(s[1]) & 0x3Fu);
    if (c >= 0x80 && valid(c)) return 2;
  } else if (s.size() >= 3 && (b0 & 0xF0) == 0xE0 && trail(1) && trail(2)) {
    const uint32_t c = ((b0 & 0x0Fu) << 12) | ((static_cast<uint8_t>(s[1]) & 0x3Fu) << 6) |
                       (static_cast<uint8_t>(s[2]) & 0x3Fu);
    if (c >= 0x800 && valid(c)) return 3;
  } else if (s.size() >= 4 && (b0 & 0xF8) == 0xF0 && trail(1) && trail(2) && trail(3)) {
    const uint32_t c = ((b0 & 0x07u) << 18) | ((static_cast<uint8_t>(s[1]) & 0x3Fu) << 12) |
                       ((static_cast<uint8_t>(s[2]) & 0x3Fu) << 6) |
                       (static_cast<uint8_t>(s[3]) & 0x3Fu);
    if (c >= 0x10000 && valid(c)) return 4;
  }
  return 0;
}

/// Bytes of the maximal subpart of a malformed sequence at the start of `s` (Unicode's
/// "substitution of maximal subparts", U+FFFD per subpart): the lead byte and the
/// continuation bytes that could still have led to a well-formed character. At least 1.
inline size_t malformed_subpart(std::string_view s) {
  const auto b0 = static_cast<uint8_t>(s[0]);
  size_t need = 0;
  uint8_t lo = 0x80, hi = 0xBF;  // the allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) need = 1;
  else if (b0 >= 0xE0 && b0 <= 0xEF) need = 2, lo = b0 == 0xE0 ? 0xA0 : 0x80, hi = b0 == 0xED ? 0x9F : 0xBF;
  else if (b0 >= 0xF0 && b0 <= 0xF4) need = 3, lo = b0 == 0xF0 ? 0x90 : 0x80, hi = b0 == 0xF4 ? 0x8F : 0xBF;
  size_t n = 1;
  for (; n <= need && n < s.size(); ++n) {
    const auto b = static_cast<uint8_t>(s[n]);
    if (n == 1 ? (b < lo || b > hi) : (b & 0xC0) != 0x80) break;
  }
  return n;
}

/// Appends code point `c` as UTF-8.
inline void append_utf8(std::string& out, uint32_t c) {
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

/// The code point of the (valid) UTF-8 character at the start of `s`.
inline uint32_t first_code_point(std::string_view s) {
  const auto b = [&](size_t i) { return static_cast<uint32_t>(static_cast<uint8_t>(s[i])); };
  switch (utf8_char_len(s[0])) {
    case 1: return b(0);
    case 2: return ((b(0) & 0x1F) << 6) | (b(1) & 0x3F);
    case 3: return ((b(0) & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F);
    default: return ((b(0) & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F);
  }
}

/// Hash for unordered maps keyed by std::string and looked up by std::string_view.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

}  // namespace detail

/// `text` as valid UTF-8 under `policy`: unchanged when it already is (the usual case costs one
/// scan), else with each malformed subpart replaced by U+FFFD, or an error naming `who`, the
/// byte offset and the bytes (kReject).
///   std::string ok = memopt::data::valid_utf8("caf\xe9", InvalidUtf8::kReplace, "notes.txt");  // "caf�"
inline std::string valid_utf8(std::string_view text, InvalidUtf8 policy, std::string_view who) {
  std::string out;
  size_t copied = 0;  // text[0, copied) is in `out` (only once a repair started)
  for (size_t at = 0; at < text.size();) {
    if (static_cast<uint8_t>(text[at]) < 0x80) {
      ++at;
      continue;
    }
    if (const size_t n = detail::valid_utf8_prefix(text.substr(at)); n > 0) {
      at += n;
      continue;
    }
    const size_t bad = detail::malformed_subpart(text.substr(at));
    if (policy == InvalidUtf8::kReject) {
      std::string hex;
      for (size_t i = at; i < at + bad; ++i) {
        char byte[8];
        std::snprintf(byte, sizeof byte, "%s0x%02X", hex.empty() ? "" : " ", static_cast<uint8_t>(text[i]));
        hex += byte;
      }
      TORCH_CHECK(false, "memopt::data: ", who, ": the text is not valid UTF-8 at byte ", at, " (", hex,
                  "). HINT: convert the file to UTF-8 (iconv -f latin1 -t utf-8), or let the tokenizer "
                  "replace malformed bytes with U+FFFD (InvalidUtf8::kReplace, --invalid_utf8 replace)");
    }
    out.append(text.substr(copied, at - copied));
    out += "\xEF\xBF\xBD";
    at += bad;
    copied = at;
  }
  if (copied == 0) return std::string(text);
  out.append(text.substr(copied));
  return out;
}

/// A Unicode normalization form, as tokenizer.json's normalizers name them.
enum class NormalForm { kNFC, kNFD, kNFKC, kNFKD };

/// True when this build can normalize and lowercase (utf8proc was found).
constexpr bool unicode_available() {
#if defined(MEMOPT_WITH_UTF8PROC)
  return true;
#else
  return false;
#endif
}

#if defined(MEMOPT_WITH_UTF8PROC)
namespace detail {
inline std::string utf8proc_run(std::string_view text, utf8proc_option_t options) {
  utf8proc_uint8_t* mapped = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                                          static_cast<utf8proc_ssize_t>(text.size()), &mapped, options);
  TORCH_CHECK(n >= 0, "memopt::data: utf8proc could not normalize a text of ", text.size(), " bytes: ",
              utf8proc_errmsg(n), ". HINT: the tokenizer passes valid UTF-8 only; report this text");
  std::string out(reinterpret_cast<const char*>(mapped), static_cast<size_t>(n));
  std::free(mapped);
  return out;
}
}  // namespace detail

/// `text` (valid UTF-8) in normalization form `form`.
inline std::string unicode_normalize(std::string_view text, NormalForm form) {
  bool ascii = true;
  for (char c : text) ascii = ascii && static_cast<uint8_t>(c) < 0x80;
  if (ascii) return std::string(text);  // every form leaves ASCII as it is
  auto options = static_cast<utf8proc_option_t>(UTF8PROC_STABLE);
  if (form == NormalForm::kNFC || form == NormalForm::kNFKC) options = static_cast<utf8proc_option_t>(options | UTF8PROC_COMPOSE);
  if (form == NormalForm::kNFD || form == NormalForm::kNFKD) options = static_cast<utf8proc_option_t>(options | UTF8PROC_DECOMPOSE);
  if (form == NormalForm::kNFKC || form == NormalForm::kNFKD) options = static_cast<utf8proc_option_t>(options | UTF8PROC_COMPAT);
  return detail::utf8proc_run(text, options);
}

/// `text` (valid UTF-8) lowercased code point by code point (Unicode's simple case mapping).
inline std::string unicode_lowercase(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t at = 0; at < text.size();) {
    const size_t n = detail::utf8_char_len(text[at]);
    detail::append_utf8(out, static_cast<uint32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(
                                 detail::first_code_point(text.substr(at, n))))));
    at += n;
  }
  return out;
}
#endif

}  // namespace memopt::data
