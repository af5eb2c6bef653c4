// memopt/data/hf_pipeline.hpp — the normalizers, pre-tokenizers and decoders of a tokenizer.json
// (the parts around its model), as Hugging Face tokenizers runs them. HfTokenizer
// (hf_tokenizer.hpp) drives them; the names follow tokenizers' own types.
#pragma once

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "memopt/data/regex.hpp"
#include "memopt/data/text_spans.hpp"
#include "memopt/data/unicode.hpp"

namespace memopt::data {

namespace detail {

/// The tokenizer.json components around the model: normalizers, pre-tokenizers, decoders
/// (a Sequence is flattened into its steps).
class HfPipeline {
 public:
  HfPipeline() = default;

  /// Reads json["normalizer"], ["pre_tokenizer"] and ["decoder"] of `file`.
  HfPipeline(const nlohmann::json& json, const std::string& file) : file_(file) {
    if (json.contains("normalizer")) read_normalizer(json["normalizer"], "normalizer");
    if (json.contains("pre_tokenizer")) read_pre_tokenizer(json["pre_tokenizer"], "pre_tokenizer");
    if (json.contains("decoder")) read_decoder(json["decoder"], "decoder");
  }

  /// `text` through the normalizers.
  std::string normalize(std::string_view text) const {
    std::string s(text);
    for (const Normalizer& n : normalizers_) {
      switch (n.kind) {
        case Normalizer::kForm: s = unicode_form(s, n.form); break;
        case Normalizer::kLowercase: s = lowercase(s); break;
        case Normalizer::kStrip: {
          const size_t left = n.left ? space_run(s, false) : 0;
          const size_t right = n.right && left < s.size() ? space_run(std::string_view(s).substr(left), true) : 0;
          s = s.substr(left, s.size() - left - right);
          break;
        }
        case Normalizer::kReplace: s = replace(s, n.pattern, n.content); break;
        case Normalizer::kPrepend:
          if (!s.empty()) s.insert(0, n.content);
          break;
      }
    }
    return s;
  }

  /// `pieces` through the pre-tokenizers; empty pieces are dropped.
  std::vector<TextPiece> pre_tokenize(std::vector<TextPiece> pieces) const {
    for (const PreTokenizer& p : pre_tokenizers_) {
      std::vector<TextPiece> next;
      next.reserve(pieces.size());
      for (TextPiece& piece : pieces) {
        std::string text = std::move(piece.text);
        std::vector<std::tuple<size_t, size_t, bool>> spans;
        SplitBehavior behavior = p.behavior;
        switch (p.kind) {
          case PreTokenizer::kByteLevel:
            if (p.add_prefix_space && (text.empty() || text[0] != ' ')) text.insert(0, " ");
            spans = p.use_regex ? p.pattern.spans(text) : std::vector<std::tuple<size_t, size_t, bool>>{{0, text.size(), false}};
            break;
          case PreTokenizer::kMetaspace: {
            text = replace(text, Pattern{" ", nullptr}, p.replacement);
            const bool starts = text.compare(0, p.replacement.size(), p.replacement) == 0;
            if (!starts && (p.prepend == kAlways || (p.prepend == kFirst && piece.at_origin))) text.insert(0, p.replacement);
            spans = p.split ? char_spans(text, [&](std::string_view c) { return c == p.replacement; })
                            : std::vector<std::tuple<size_t, size_t, bool>>{{0, text.size(), false}};
            break;
          }
          case PreTokenizer::kSplit: spans = p.pattern.spans(text); break;
          case PreTokenizer::kDigits: spans = char_spans(text, is_numeric); break;
          case PreTokenizer::kWhitespaceSplit:
            spans = char_spans(text, [](std::string_view c) { return is_unicode_space(first_code_point(c)); });
            break;
        }
        if (p.invert) {
          for (auto& span : spans) std::get<2>(span) = !std::get<2>(span);
        }
        for (const auto& [begin, end] : split_spans(spans, behavior)) {
          if (begin == end) continue;
          std::string part = text.substr(begin, end - begin);
          if (p.kind == PreTokenizer::kByteLevel) {
            std::string mapped;
            mapped.reserve(part.size() * 2);
            for (char c : part) mapped += byte_chars()[static_cast<uint8_t>(c)];
            part = std::move(mapped);
          }
          next.push_back({std::move(part), piece.at_origin && begin == 0});
        }
      }
      pieces = std::move(next);
    }
    return pieces;
  }

  /// `tokens` through the decoders, joined (with spaces when the file has no decoder).
  std::string decode(std::vector<std::string> tokens) const {
    if (decoders_.empty()) {
      std::string out;
      for (size_t i = 0; i < tokens.size(); ++i) out += (i ? " " : "") + tokens[i];
      return out;
    }
    for (const Decoder& d : decoders_) tokens = decode_step(d, std::move(tokens));
    std::string out;
    for (const auto& token : tokens) out += token;
    return out;
  }

 private:
  enum Prepend { kAlways, kFirst, kNever };
  struct Normalizer {
    enum Kind { kForm, kLowercase, kStrip, kReplace, kPrepend } kind = kForm;
    NormalForm form = NormalForm::kNFC;
    Pattern pattern;
    std::string content;
    bool left = false, right = false;
  };
  struct PreTokenizer {
    enum Kind { kByteLevel, kMetaspace, kSplit, kDigits, kWhitespaceSplit } kind = kSplit;
    Pattern pattern;
    SplitBehavior behavior = SplitBehavior::kIsolated;
    bool invert = false, add_prefix_space = false, use_regex = true, split = true;
    std::string replacement;
    Prepend prepend = kAlways;
  };
  struct Decoder {
    enum Kind { kByteLevel, kMetaspace, kReplace, kByteFallback, kFuse, kStrip } kind = kFuse;
    Pattern pattern;
    std::string content;  // Replace's content, Strip's character, Metaspace's replacement
    Prepend prepend = kAlways;
    size_t start = 0, stop = 0;
  };

  [[noreturn]] void unsupported(const std::string& where, const nlohmann::json& node, const char* known) const {
    TORCH_CHECK(false, "memopt::data: tokenizer '", file_, "': ", where, ".type is \"",
                node.value("type", std::string("?")), "\", which memopt does not implement (it implements ", known, "). HINT: use a tokenizer.json "
                "without it, or a SentencePiece .model file");
  }
  [[noreturn]] void bad(const std::string& where, const nlohmann::json& node, const char* expected) const {
    TORCH_CHECK(false, "memopt::data: tokenizer '", file_, "': ", where, " is ", node.dump(), ", expected ", expected,
                ". HINT: save the tokenizer again with a recent `tokenizers`");
  }
  void need_unicode(const std::string& where) const {
    TORCH_CHECK(unicode_available(), "memopt::data: tokenizer '", file_, "': ", where, " needs Unicode tables (utf8proc), "
                "which this build of memopt lacks. HINT: apt-get install libutf8proc-dev (scripts/deps does) and "
                "re-run CMake");
  }

  Pattern read_pattern(const nlohmann::json& node, const std::string& where) const {
    if (node.is_object() && node.contains("String") && node["String"].is_string()) {
      return {node["String"].get<std::string>(), nullptr};
    }
    if (node.is_object() && node.contains("Regex") && node["Regex"].is_string()) {
      return {"", std::make_shared<const Regex>(node["Regex"].get<std::string>(), "tokenizer '" + file_ + "': " + where)};
    }
    bad(where, node, "{\"String\": ...} or {\"Regex\": ...}");
  }

  static std::string single_char(const nlohmann::json& node) {
    return node.is_string() ? node.get<std::string>() : std::string();
  }

  Prepend read_prepend(const nlohmann::json& node, const std::string& where) const {
    if (node.contains("prepend_scheme") && node["prepend_scheme"].is_string()) {
      const std::string scheme = node["prepend_scheme"].get<std::string>();
      if (scheme == "always") return kAlways;
      if (scheme == "first") return kFirst;
      if (scheme == "never") return kNever;
      bad(where + ".prepend_scheme", node["prepend_scheme"], "\"always\", \"first\" or \"never\"");
    }
    return node.value("add_prefix_space", true) ? kAlways : kNever;  // before tokenizers 0.14
  }

  void read_normalizer(const nlohmann::json& node, const std::string& where) {
    if (node.is_null()) return;
    if (!node.is_object() || !node.contains("type")) bad(where, node, "an object with a \"type\"");
    const std::string type = node["type"].get<std::string>();
    Normalizer n{};
    if (type == "Sequence") {
      const auto& list = node.value("normalizers", nlohmann::json::array());
      for (size_t i = 0; i < list.size(); ++i) read_normalizer(list[i], c10::str(where, ".normalizers[", i, "]"));
      return;
    } else if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
      need_unicode(where);
      n.form = type == "NFC" ? NormalForm::kNFC : type == "NFD" ? NormalForm::kNFD
               : type == "NFKC" ? NormalForm::kNFKC : NormalForm::kNFKD;
    } else if (type == "Lowercase") {
      need_unicode(where);
      n.kind = Normalizer::kLowercase;
    } else if (type == "Strip") {
      n.kind = Normalizer::kStrip;
      n.left = node.value("strip_left", true);
      n.right = node.value("strip_right", true);
    } else if (type == "Replace") {
      n.kind = Normalizer::kReplace;
      n.pattern = read_pattern(node.value("pattern", nlohmann::json()), where + ".pattern");
      n.content = node.value("content", std::string());
    } else if (type == "Prepend") {
      n.kind = Normalizer::kPrepend;
      n.content = node.value("prepend", std::string());
    } else {
      unsupported(where, node, "NFC, NFD, NFKC, NFKD, Lowercase, Strip, Replace, Prepend, Sequence");
    }
    normalizers_.push_back(std::move(n));
  }

  void read_pre_tokenizer(const nlohmann::json& node, const std::string& where) {
    if (node.is_null()) return;
    if (!node.is_object() || !node.contains("type")) bad(where, node, "an object with a \"type\"");
    const std::string type = node["type"].get<std::string>();
    PreTokenizer p{};
    if (type == "Sequence") {
      const auto& list = node.value("pretokenizers", nlohmann::json::array());
      for (size_t i = 0; i < list.size(); ++i) read_pre_tokenizer(list[i], c10::str(where, ".pretokenizers[", i, "]"));
      return;
    } else if (type == "ByteLevel") {
      p.kind = PreTokenizer::kByteLevel;
      p.add_prefix_space = node.value("add_prefix_space", true);
      p.use_regex = node.value("use_regex", true);
      if (p.use_regex) {  // GPT-2's pattern, fixed in tokenizers
        static const auto gpt2 = std::make_shared<const Regex>(
            R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)", "ByteLevel pre-tokenizer");
        p.pattern.regex = gpt2;
      }
    } else if (type == "Split") {
      p.pattern = read_pattern(node.value("pattern", nlohmann::json()), where + ".pattern");
      p.invert = node.value("invert", false);
      const std::string behavior = node.value("behavior", std::string("Isolated"));
      if (behavior == "Removed") p.behavior = SplitBehavior::kRemoved;
      else if (behavior == "Isolated") p.behavior = SplitBehavior::kIsolated;
      else if (behavior == "MergedWithPrevious") p.behavior = SplitBehavior::kMergedWithPrevious;
      else if (behavior == "MergedWithNext") p.behavior = SplitBehavior::kMergedWithNext;
      else if (behavior == "Contiguous") p.behavior = SplitBehavior::kContiguous;
      else bad(where + ".behavior", node["behavior"], "Removed, Isolated, MergedWithPrevious, MergedWithNext or Contiguous");
    } else if (type == "Metaspace") {
      p.kind = PreTokenizer::kMetaspace;
      p.replacement = single_char(node.value("replacement", nlohmann::json("\xE2\x96\x81")));
      p.prepend = read_prepend(node, where);
      p.split = node.value("split", true);
      p.behavior = SplitBehavior::kMergedWithNext;
    } else if (type == "Digits") {
      need_unicode(where);
      p.kind = PreTokenizer::kDigits;
      p.behavior = node.value("individual_digits", false) ? SplitBehavior::kIsolated : SplitBehavior::kContiguous;
    } else if (type == "Whitespace") {  // keeps the matches of \w+|[^\w\s]+
      p.pattern.regex = std::make_shared<const Regex>(R"(\w+|[^\w\s]+)", "Whitespace pre-tokenizer");
      p.invert = true;
      p.behavior = SplitBehavior::kRemoved;
    } else if (type == "WhitespaceSplit") {
      p.kind = PreTokenizer::kWhitespaceSplit;
      p.behavior = SplitBehavior::kRemoved;
    } else {
      unsupported(where, node, "ByteLevel, Split, Metaspace, Digits, Whitespace, WhitespaceSplit, Sequence");
    }
    pre_tokenizers_.push_back(std::move(p));
  }

  void read_decoder(const nlohmann::json& node, const std::string& where) {
    if (node.is_null()) return;
    if (!node.is_object() || !node.contains("type")) bad(where, node, "an object with a \"type\"");
    const std::string type = node["type"].get<std::string>();
    Decoder d{};
    if (type == "Sequence") {
      const auto& list = node.value("decoders", nlohmann::json::array());
      for (size_t i = 0; i < list.size(); ++i) read_decoder(list[i], c10::str(where, ".decoders[", i, "]"));
      return;
    } else if (type == "ByteLevel") {
      d.kind = Decoder::kByteLevel;
    } else if (type == "Metaspace") {
      d.kind = Decoder::kMetaspace;
      d.content = single_char(node.value("replacement", nlohmann::json("\xE2\x96\x81")));
      d.prepend = read_prepend(node, where);
    } else if (type == "Replace") {
      d.kind = Decoder::kReplace;
      d.pattern = read_pattern(node.value("pattern", nlohmann::json()), where + ".pattern");
      d.content = node.value("content", std::string());
    } else if (type == "ByteFallback") {
      d.kind = Decoder::kByteFallback;
    } else if (type == "Fuse") {
      d.kind = Decoder::kFuse;
    } else if (type == "Strip") {
      d.kind = Decoder::kStrip;
      d.content = single_char(node.value("content", nlohmann::json(" ")));
      d.start = node.value("start", size_t{0});
      d.stop = node.value("stop", size_t{0});
    } else {
      unsupported(where, node, "ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip, Sequence");
    }
    decoders_.push_back(std::move(d));
  }

  static std::string replace(std::string_view text, const Pattern& pattern, const std::string& content) {
    std::string out;
    for (const auto& [begin, end, match] : pattern.spans(text)) {
      if (match) out += content;
      else out.append(text.substr(begin, end - begin));
    }
    return out;
  }

  static std::string unicode_form(const std::string& s, NormalForm form) {
#if defined(MEMOPT_WITH_UTF8PROC)
    return unicode_normalize(s, form);
#else
    (void)form;
    return s;  // unreachable: need_unicode() refused the file
#endif
  }
  static std::string lowercase(const std::string& s) {
#if defined(MEMOPT_WITH_UTF8PROC)
    return unicode_lowercase(s);
#else
    return s;  // unreachable: need_unicode() refused the file
#endif
  }

  static std::vector<std::string> decode_step(const Decoder& d, std::vector<std::string> tokens) {
    std::vector<std::string> out;
    switch (d.kind) {
      case Decoder::kByteLevel: {
        std::string bytes;
        for (const std::string& token : tokens) {
          std::string mapped;
          bool all = true;
          for (size_t at = 0; at < token.size() && all;) {
            const size_t n = utf8_char_len(token[at]);
            const int b = char_byte(first_code_point(std::string_view(token).substr(at, n)));
            all = b >= 0;
            if (all) mapped += static_cast<char>(b);
            at += n;
          }
          bytes += all ? mapped : token;
        }
        out.push_back(valid_utf8(bytes, InvalidUtf8::kReplace, "ByteLevel decoder"));
        return out;
      }
      case Decoder::kMetaspace:
        for (size_t i = 0; i < tokens.size(); ++i) {
          std::string text;
          for (const auto& [begin, end, match] : char_spans(tokens[i], [&](std::string_view c) { return c == d.content; })) {
            if (!match) text.append(tokens[i], begin, end - begin);
            else if (i != 0 || d.prepend == kNever) text += ' ';
          }
          out.push_back(std::move(text));
        }
        return out;
      case Decoder::kReplace:
        for (const auto& token : tokens) out.push_back(replace(token, d.pattern, d.content));
        return out;
      case Decoder::kByteFallback: {
        std::string pending;
        size_t count = 0;
        auto flush = [&] {
          if (count == 0) return;
          if (valid_utf8(pending, InvalidUtf8::kReplace, "ByteFallback decoder") == pending) out.push_back(pending);
          else for (size_t i = 0; i < count; ++i) out.emplace_back("\xEF\xBF\xBD");
          pending.clear();
          count = 0;
        };
        for (auto& token : tokens) {
          const auto hex = [](char c) { return std::isxdigit(static_cast<unsigned char>(c)) != 0; };
          if (token.size() == 6 && token.compare(0, 3, "<0x") == 0 && token[5] == '>' && hex(token[3]) && hex(token[4])) {
            pending += static_cast<char>(std::stoi(token.substr(3, 2), nullptr, 16));
            ++count;
            continue;
          }
          flush();
          out.push_back(std::move(token));
        }
        flush();
        return out;
      }
      case Decoder::kFuse: {
        std::string all;
        for (const auto& token : tokens) all += token;
        out.push_back(std::move(all));
        return out;
      }
      case Decoder::kStrip:
        for (const auto& token : tokens) {
          std::vector<std::string_view> chars;
          for (size_t at = 0; at < token.size(); at += utf8_char_len(token[at])) {
            chars.push_back(std::string_view(token).substr(at, utf8_char_len(token[at])));
          }
          size_t first = 0, last = chars.size();
          while (first < std::min(d.start, chars.size()) && chars[first] == d.content) ++first;
          for (size_t i = 0; i < d.stop && last > first && chars[last - 1] == d.content; ++i) --last;
          std::string text;
          for (size_t i = first; i < last; ++i) text.append(chars[i]);
          out.push_back(std::move(text));
        }
        return out;
    }
    return out;
  }

  std::string file_;
  std::vector<Normalizer> normalizers_;
  std::vector<PreTokenizer> pre_tokenizers_;
  std::vector<Decoder> decoders_;
};

/// The BOS token a tokenizer.json's post-processor puts first (TemplateProcessing, or
/// Roberta/Bert's cls, also inside a Sequence), through `id_of`; -1 when there is none.
inline int64_t template_bos(const nlohmann::json& json, const std::function<int32_t(const std::string&)>& id_of) {
  std::function<int64_t(const nlohmann::json&)> visit = [&](const nlohmann::json& p) -> int64_t {
    if (!p.is_object()) return -1;
    const std::string type = p.value("type", std::string());
    if (type == "Sequence") {
      for (const auto& inner : p.value("processors", nlohmann::json::array())) {
        if (const int64_t id = visit(inner); id >= 0) return id;
      }
    } else if (type == "TemplateProcessing" && p.contains("single") && p["single"].is_array() && !p["single"].empty()) {
      const auto& first = p["single"][0];
      if (first.contains("SpecialToken") && first["SpecialToken"].contains("id")) {
        return id_of(first["SpecialToken"]["id"].get<std::string>());
      }
    } else if ((type == "RobertaProcessing" || type == "BertProcessing") && p.contains("cls") && p["cls"].is_array()) {
      return id_of(p["cls"][0].get<std::string>());
    }
    return -1;
  };
  return json.contains("post_processor") ? visit(json["post_processor"]) : -1;
}

}  // namespace detail

}  // namespace memopt::data
