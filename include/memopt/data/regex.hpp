// memopt/data/regex.hpp — the regular expressions of tokenizer.json pre-tokenizers (GPT-2,
// Llama 3, Qwen: \p{L}, \p{N}, (?i:...), lookahead), run by PCRE2 with its JIT, when memopt's
// CMake found PCRE2 (MEMOPT_WITH_PCRE2). Hugging Face tokenizers runs them with Oniguruma, whose
// \s also matches U+0085 (NEL); Regex rewrites \s and \S so PCRE2 matches the same set.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <torch/torch.h>

#if defined(MEMOPT_WITH_PCRE2)
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#endif

namespace memopt::data {

/// True when this build runs regular expressions (PCRE2 was found).
constexpr bool regex_available() {
#if defined(MEMOPT_WITH_PCRE2)
  return true;
#else
  return false;
#endif
}

/// A compiled UTF-8 regular expression (Unicode properties on). Matching is thread-safe.
///   memopt::data::Regex re(R"( ?\p{L}+| ?\p{N}+)", "tokenizer.json: pre_tokenizer.pattern");
///   for (auto [begin, end] : re.find_all("Hi 42")) ...   // {0,2}, {2,5}
class Regex {
 public:
  /// Compiles `pattern`; `who` names where it came from in errors.
  Regex(const std::string& pattern, const std::string& who) : pattern_(pattern) {
#if defined(MEMOPT_WITH_PCRE2)
    const std::string rewritten = with_oniguruma_spaces(pattern);
    int code = 0;
    PCRE2_SIZE offset = 0;
    pcre2_code* compiled = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(rewritten.data()), rewritten.size(),
                                         PCRE2_UTF | PCRE2_UCP, &code, &offset, nullptr);
    if (compiled == nullptr) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(code, message, sizeof message);
      TORCH_CHECK(false, "memopt::data: ", who, ": the regular expression '", pattern, "' does not compile (",
                  reinterpret_cast<const char*>(message), " near character ", offset,
                  "). HINT: tokenizer.json patterns use Oniguruma syntax; PCRE2 reads the common subset");
    }
    code_.reset(compiled);
    jit_ = pcre2_jit_compile(compiled, PCRE2_JIT_COMPLETE) == 0;
#else
    TORCH_CHECK(false, "memopt::data: ", who, ": the regular expression '", pattern,
                "' needs PCRE2, which this build of memopt lacks. HINT: apt-get install libpcre2-dev "
                "(scripts/deps does) and re-run CMake");
#endif
  }

  /// The pattern as given.
  const std::string& pattern() const { return pattern_; }

  /// The non-empty matches in `text` (valid UTF-8), left to right: {begin, end} byte offsets.
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view text) const {
    std::vector<std::pair<size_t, size_t>> found;
#if defined(MEMOPT_WITH_PCRE2)
    std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> data(
        pcre2_match_data_create_from_pattern(code_.get(), nullptr), &pcre2_match_data_free);
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    size_t at = 0;
    while (at < text.size()) {
      const int rc = jit_ ? pcre2_jit_match(code_.get(), subject, text.size(), at, 0, data.get(), nullptr)
                          : pcre2_match(code_.get(), subject, text.size(), at, PCRE2_NO_UTF_CHECK, data.get(), nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      TORCH_CHECK(rc >= 0, "memopt::data: the regular expression '", pattern_, "' failed with PCRE2 error ", rc,
                  " at byte ", at, " of a text of ", text.size(), " bytes. HINT: report the text and the pattern");
      const PCRE2_SIZE* span = pcre2_get_ovector_pointer(data.get());
      if (span[1] > span[0]) {
        found.emplace_back(span[0], span[1]);
        at = span[1];
      } else {  // an empty match: step over one character
        at = span[0] + 1;
        while (at < text.size() && (static_cast<unsigned char>(text[at]) & 0xC0) == 0x80) ++at;
      }
    }
#else
    (void)text;
#endif
    return found;
  }

 private:
  /// `pattern` with \s as [\s\x{85}] and \S as [^\s\x{85}] (inside a class: \s\x{85}; a \S
  /// inside a class is left alone), so PCRE2's Unicode \s matches Oniguruma's.
  static std::string with_oniguruma_spaces(const std::string& pattern) {
    std::string out;
    bool in_class = false;
    for (size_t i = 0; i < pattern.size(); ++i) {
      const char c = pattern[i];
      if (c == '\\' && i + 1 < pattern.size()) {
        const char next = pattern[++i];
        if (next == 's') out += in_class ? "\\s\\x{85}" : "[\\s\\x{85}]";
        else if (next == 'S' && !in_class) out += "[^\\s\\x{85}]";
        else out += {c, next};
        continue;
      }
      if (c == '[' && !in_class) {
        in_class = true;
        out += c;
        if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
        if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];  // a leading ] is literal
        continue;
      }
      if (c == ']' && in_class) in_class = false;
      out += c;
    }
    return out;
  }

  std::string pattern_;
#if defined(MEMOPT_WITH_PCRE2)
  struct Free {
    void operator()(pcre2_code* code) const { pcre2_code_free(code); }
  };
  std::unique_ptr<pcre2_code, Free> code_;
  bool jit_ = false;
#endif
};

}  // namespace memopt::data
