// memopt/data/hf_tokenizer.hpp — a Hugging Face tokenizer.json with a BPE model: byte-level BPE
// (GPT-2, Llama 3, Qwen, Mistral-Nemo) and SentencePiece-style BPE with byte fallback (Llama 2,
// Mistral 7B, TinyLlama). Reproduces tokenizers' pipeline: added tokens are cut out first, the
// rest normalized, pre-tokenized and BPE-merged; decoding runs the decoder chain. What a file
// uses and this implementation lacks fails at load, naming the component and its type.
//   Normalizers:     NFC NFD NFKC NFKD Lowercase Strip Replace Prepend Sequence
//   Pre-tokenizers:  ByteLevel Split Metaspace Digits Whitespace WhitespaceSplit Sequence
//   Decoders:        ByteLevel Metaspace Replace ByteFallback Fuse Strip Sequence
// encode() never adds BOS/EOS (tokenizers' add_special_tokens=False); decode() skips special
// tokens (tokenizers' default skip_special_tokens=True).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "memopt/data/bpe.hpp"
#include "memopt/data/hf_pipeline.hpp"
#include "memopt/data/unicode.hpp"

namespace memopt::data {

/// A tokenizer.json with a BPE model (see the top of this file for what it covers).
///   memopt::data::HfTokenizer tok("checkpoints/llama/tokenizer.json");
///   std::vector<int32_t> ids = tok.encode("Hello world");   // == tokenizers' encode(..., add_special_tokens=False).ids
class HfTokenizer {
 public:
  /// Loads `path`; fails naming the key and value of anything unsupported or inconsistent.
  explicit HfTokenizer(const std::string& path) : path_(path) {
    std::ifstream in(path, std::ios::binary);
    TORCH_CHECK(in.good(), "memopt::data: tokenizer '", path, "' does not exist or cannot be read. HINT: pass a "
                "tokenizer.json (tokenizers' Tokenizer.save) or the checkpoint folder that holds it");
    nlohmann::json json;
    try {
      json = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      TORCH_CHECK(false, "memopt::data: tokenizer '", path, "' is not valid JSON (", e.what(),
                  "). HINT: the file is truncated or not a tokenizer.json");
    }
    TORCH_CHECK(json.is_object() && json.contains("model") && json["model"].is_object(), "memopt::data: tokenizer '",
                path, "' has no \"model\" object. HINT: pass a tokenizer.json written by Hugging Face tokenizers");
    const std::string type = json["model"].value("type", std::string("BPE"));
    TORCH_CHECK(type == "BPE", "memopt::data: tokenizer '", path, "': model.type is \"", type,
                "\", which memopt does not read (it reads \"BPE\": byte-level BPE and SentencePiece-style BPE). "
                "HINT: use a BPE tokenizer, or a SentencePiece .model file");
    model_ = BpeModel(json["model"], path);
    pipeline_ = detail::HfPipeline(json, path);
    if (json.contains("added_tokens") && json["added_tokens"].is_array()) {
      for (const auto& token : json["added_tokens"]) {
        TORCH_CHECK(token.is_object() && token.contains("id") && token["id"].is_number_integer() &&
                        token.contains("content") && token["content"].is_string(),
                    "memopt::data: tokenizer '", path, "': added_tokens holds ", token.dump(),
                    ", without an integer id and a string content. HINT: save the tokenizer again");
        added_.push_back({token["content"].get<std::string>(), token["id"].get<int32_t>(), token.value("special", false),
                          token.value("normalized", !token.value("special", false)), token.value("lstrip", false),
                          token.value("rstrip", false), token.value("single_word", false)});
      }
    }
    index_added_tokens();
    read_special_ids(json);
  }

  /// Token ids of `text` (valid UTF-8: Tokenizer checks it), with no BOS/EOS added.
  std::vector<int32_t> encode(std::string_view text) const {
    std::vector<int32_t> ids;
    for (const auto& segment : split_added(text, raw_)) {
      if (segment.id >= 0) {
        ids.push_back(segment.id);
        continue;
      }
      const std::string normalized = pipeline_.normalize(text.substr(segment.begin, segment.end - segment.begin));
      for (const auto& part : split_added(normalized, normalized_)) {
        if (part.id >= 0) {
          ids.push_back(part.id);
          continue;
        }
        std::vector<detail::TextPiece> pieces{
            {normalized.substr(part.begin, part.end - part.begin), segment.begin == 0 && part.begin == 0}};
        for (const auto& piece : pipeline_.pre_tokenize(std::move(pieces))) model_.tokenize(piece.text, ids);
      }
    }
    return ids;
  }

  /// Text of `ids` through the decoder chain; special tokens are skipped.
  std::string decode(const std::vector<int32_t>& ids) const {
    std::vector<std::string> tokens;
    tokens.reserve(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      const int32_t id = ids[i];
      TORCH_CHECK(id >= 0 && id < vocab_size(), "memopt::data: tokenizer '", path_, "' cannot decode token id ", id,
                  " at position ", i, " (vocab_size ", vocab_size(), "). HINT: decode ids produced with this tokenizer");
      if (const AddedToken* added = added_by_id(id)) {
        if (!added->special) tokens.push_back(added->content);
      } else if (id < model_.size() && !model_.token(id).empty()) {
        tokens.push_back(model_.token(id));
      }
    }
    return pipeline_.decode(std::move(tokens));
  }

  /// One past the largest id (model vocab and added tokens).
  int64_t vocab_size() const {
    int64_t size = model_.size();
    for (const auto& token : added_) size = std::max<int64_t>(size, token.id + 1);
    return size;
  }
  int64_t bos_id() const { return bos_id_; }
  int64_t eos_id() const { return eos_id_; }
  int64_t pad_id() const { return pad_id_; }
  /// The model's unk_token id (-1: byte-level BPE has none).
  int64_t unk_id() const { return model_.unk_id(); }
  /// The token text of `id` ("" for an id neither the vocab nor the added tokens use).
  const std::string& piece(int64_t id) const {
    TORCH_CHECK(id >= 0 && id < vocab_size(), "memopt::data: tokenizer '", path_, "' has no piece ", id,
                " (vocab_size ", vocab_size(), "). HINT: use an id in [0, vocab_size())");
    if (const AddedToken* added = added_by_id(static_cast<int32_t>(id))) return added->content;
    static const std::string none;
    return id < model_.size() ? model_.token(id) : none;
  }
  /// The id of a token (added tokens first), unk_id() when absent.
  int32_t piece_to_id(std::string_view token) const {
    for (const auto& added : added_) {
      if (added.content == token) return added.id;
    }
    const int32_t id = model_.id(token);
    return id >= 0 ? id : model_.unk_id();
  }
  const std::string& path() const { return path_; }

  /// Adds `symbols` as added tokens (non-special, matched whole in the raw text), with ids
  /// vocab_size(), vocab_size() + 1, ...; a symbol already known keeps its id.
  std::vector<int32_t> add_user_symbols(const std::vector<std::string>& symbols) {
    std::vector<int32_t> ids;
    for (const std::string& symbol : symbols) {
      TORCH_CHECK(!symbol.empty(), "memopt::data: tokenizer '", path_, "': cannot add an empty user symbol (symbol ",
                  ids.size(), " of the list). HINT: pass non-empty markers such as \"<|user|>\"");
      const int32_t known = piece_to_id(symbol);
      if (known >= 0 && piece(known) == symbol) {
        ids.push_back(known);
        continue;
      }
      added_.push_back({symbol, static_cast<int32_t>(vocab_size()), false, false, false, false, false});
      ids.push_back(added_.back().id);
    }
    index_added_tokens();
    return ids;
  }

 private:
  struct AddedToken {
    std::string content;
    int32_t id;
    bool special, normalized, lstrip, rstrip, single_word;
  };
  /// Added tokens by their first byte, longest first: the leftmost-longest match wins.
  struct Matcher {
    std::array<std::vector<std::pair<std::string, size_t>>, 256> by_byte;  // (text to match, index in added_)
    bool empty = true;
  };
  struct Segment {
    size_t begin, end;
    int32_t id;  // the added token, or -1 for text between them
  };

  const AddedToken* added_by_id(int32_t id) const {
    for (const auto& token : added_) {
      if (token.id == id) return &token;
    }
    return nullptr;
  }

  void index_added_tokens() {
    raw_ = Matcher();
    normalized_ = Matcher();
    for (size_t i = 0; i < added_.size(); ++i) {
      Matcher& matcher = added_[i].normalized ? normalized_ : raw_;
      const std::string text = added_[i].normalized ? pipeline_.normalize(added_[i].content) : added_[i].content;
      if (text.empty()) continue;
      matcher.by_byte[static_cast<uint8_t>(text[0])].emplace_back(text, i);
      matcher.empty = false;
    }
    for (Matcher* matcher : {&raw_, &normalized_}) {
      for (auto& list : matcher->by_byte) {
        std::stable_sort(list.begin(), list.end(), [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
      }
    }
  }

  /// AddedVocabulary::find_matches: added tokens in `text` (with lstrip/rstrip/single_word) and the text between.
  std::vector<Segment> split_added(std::string_view text, const Matcher& matcher) const {
    std::vector<Segment> out;
    if (matcher.empty) {
      if (!text.empty()) out.push_back({0, text.size(), -1});
      return out;
    }
    auto is_word = [](std::string_view s) {
      const uint32_t c = detail::first_code_point(s);
      return c == '_' || (c < 0x80 ? std::isalnum(static_cast<int>(c)) != 0 : !detail::is_unicode_space(c));
    };
    size_t done = 0;
    for (size_t at = 0; at < text.size();) {
      const auto& candidates = matcher.by_byte[static_cast<uint8_t>(text[at])];
      const std::pair<std::string, size_t>* hit = nullptr;
      for (const auto& candidate : candidates) {
        if (text.compare(at, candidate.first.size(), candidate.first) == 0) {
          hit = &candidate;
          break;
        }
      }
      if (hit == nullptr) {
        ++at;
        continue;
      }
      const AddedToken& token = added_[hit->second];
      size_t start = at, stop = at + hit->first.size();
      at = stop;
      if (token.single_word) {
        size_t before = start;
        while (before > 0 && (static_cast<uint8_t>(text[before - 1]) & 0xC0) == 0x80) --before;
        const bool word_before = start > 0 && is_word(text.substr(before > 0 ? before - 1 : 0));
        const bool word_after = stop < text.size() && is_word(text.substr(stop));
        if (word_before || word_after) continue;
      }
      if (token.lstrip) start = std::max(done, start - detail::space_run(text.substr(0, start), true));
      if (token.rstrip) stop += detail::space_run(text.substr(stop), false), at = stop;
      if (done < start) out.push_back({done, start, -1});
      out.push_back({start, stop, token.id});
      done = stop;
    }
    if (done < text.size()) out.push_back({done, text.size(), -1});
    return out;
  }

  /// BOS/EOS/PAD from tokenizer_config.json beside the file, else the post-processor's template
  /// (BOS) and the usual names.
  void read_special_ids(const nlohmann::json& json) {
    nlohmann::json config;
    const auto config_path = std::filesystem::path(path_).parent_path() / "tokenizer_config.json";
    if (std::ifstream in(config_path); in.good()) {
      config = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    }
    auto from_config = [&](const char* key) -> int64_t {
      if (!config.is_object() || !config.contains(key)) return -1;
      const auto& value = config[key];
      const std::string content = value.is_string() ? value.get<std::string>()
                                  : value.is_object() ? value.value("content", std::string()) : std::string();
      const int32_t id = content.empty() ? -1 : piece_to_id(content);
      return id >= 0 && piece(id) == content ? id : -1;
    };
    auto first_known = [&](std::initializer_list<const char*> names) -> int64_t {
      for (const char* name : names) {
        const int32_t id = piece_to_id(name);
        if (id >= 0 && piece(id) == name) return id;
      }
      return -1;
    };
    bos_id_ = from_config("bos_token");
    if (bos_id_ < 0) bos_id_ = detail::template_bos(json, [&](const std::string& t) { return piece_to_id(t); });
    if (bos_id_ < 0) bos_id_ = first_known({"<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>"});
    eos_id_ = from_config("eos_token");
    if (eos_id_ < 0) eos_id_ = first_known({"</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "<|im_end|>"});
    pad_id_ = from_config("pad_token");
    if (pad_id_ < 0) pad_id_ = first_known({"<pad>", "<|pad|>", "<|finetune_right_pad_id|>"});
  }

  std::string path_;
  BpeModel model_;
  detail::HfPipeline pipeline_;
  std::vector<AddedToken> added_;
  Matcher raw_, normalized_;
  int64_t bos_id_ = -1, eos_id_ = -1, pad_id_ = -1;
};

}  // namespace memopt::data
