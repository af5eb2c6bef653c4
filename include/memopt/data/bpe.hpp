// memopt/data/bpe.hpp — the BPE model of a tokenizer.json ("model": {"type": "BPE", ...}), as
// Hugging Face tokenizers runs it: each pre-tokenized word is split into characters (byte
// fallback <0xNN> pieces or <unk> for characters outside the vocab), then the pair of adjacent
// pieces with the lowest merge rank is merged, leftmost first, until no listed merge applies.
#pragma once

#include <array>
#include <cstdint>
#include <cstdio>
#include <queue>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "memopt/data/unicode.hpp"

namespace memopt::data {

/// tokenizer.json's BPE model: vocab, merges and their options.
///   memopt::data::BpeModel bpe(json["model"], "tokenizer.json");
///   std::vector<int32_t> ids;  bpe.tokenize("Ġhello", ids);
class BpeModel {
 public:
  BpeModel() = default;

  /// Reads `model` (the "model" object of `file`); fails naming the key and value.
  BpeModel(const nlohmann::json& model, const std::string& file) {
    auto fail = [&](const std::string& what, const char* hint) {
      TORCH_CHECK(false, "memopt::data: tokenizer '", file, "': model.", what, ". HINT: ", hint);
    };
    const char* retrain = "save the tokenizer again with a recent `tokenizers` (tokenizer.save(path))";
    if (!model.contains("vocab") || !model["vocab"].is_object()) fail("vocab is missing or not an object", retrain);
    for (const auto& [token, id] : model["vocab"].items()) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX) {
        fail("vocab['" + token + "'] is " + id.dump() + ", not an id in [0, 2^31)", retrain);
      }
      const auto value = id.get<int32_t>();
      vocab_.emplace(token, value);
      if (static_cast<size_t>(value) >= tokens_.size()) tokens_.resize(static_cast<size_t>(value) + 1);
      tokens_[static_cast<size_t>(value)] = token;
    }
    auto text_of = [&](const char* key) -> std::string {
      return model.contains(key) && model[key].is_string() ? model[key].get<std::string>() : std::string();
    };
    prefix_ = text_of("continuing_subword_prefix");
    suffix_ = text_of("end_of_word_suffix");
    byte_fallback_ = model.value("byte_fallback", false);
    fuse_unk_ = model.value("fuse_unk", false);
    ignore_merges_ = model.value("ignore_merges", false);
    if (model.contains("dropout") && model["dropout"].is_number() && model["dropout"].get<double>() > 0) {
      fail("dropout is " + model["dropout"].dump() + ": BPE dropout samples a different split on every call",
           "set \"dropout\": null in tokenizer.json for training data (dropout is a regularizer, not a format)");
    }
    if (const std::string unk = text_of("unk_token"); !unk.empty()) {
      const auto it = vocab_.find(unk);
      if (it == vocab_.end()) fail("unk_token '" + unk + "' is not in the vocab", retrain);
      unk_id_ = it->second;
    }
    if (!model.contains("merges") || !model["merges"].is_array()) fail("merges is missing or not an array", retrain);
    const auto& merges = model["merges"];
    merges_.reserve(merges.size());
    for (size_t rank = 0; rank < merges.size(); ++rank) {
      const auto& merge = merges[rank];
      std::string left, right;
      if (merge.is_string()) {  // the format before tokenizers 0.20: "left right"
        const std::string line = merge.get<std::string>();
        const size_t space = line.find(' ');
        if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos) {
          fail(c10::str("merges[", rank, "] is ", merge.dump(), ", not two tokens separated by one space"), retrain);
        }
        left = line.substr(0, space);
        right = line.substr(space + 1);
      } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string()) {
        left = merge[0].get<std::string>();
        right = merge[1].get<std::string>();
      } else {
        fail(c10::str("merges[", rank, "] is ", merge.dump(), ", not [left, right]"), retrain);
      }
      const std::string merged = left + right.substr(std::min(prefix_.size(), right.size()));
      for (const std::string* token : std::array<const std::string*, 3>{&left, &right, &merged}) {
        if (!vocab_.count(*token)) {
          fail(c10::str("merges[", rank, "] (", merge.dump(), ") refers to '", *token, "', which is not in the vocab"),
               "a merge must join two vocab tokens into a vocab token; the file was edited or truncated");
        }
      }
      merges_[key(vocab_.find(left)->second, vocab_.find(right)->second)] = {static_cast<int32_t>(rank),
                                                                             vocab_.find(merged)->second};
    }
  }

  /// Appends the ids of `word` (one pre-tokenized piece, valid UTF-8) to `ids`.
  void tokenize(std::string_view word, std::vector<int32_t>& ids) const {
    if (word.empty()) return;
    if (ignore_merges_) {
      if (const auto it = vocab_.find(word); it != vocab_.end()) {
        ids.push_back(it->second);
        return;
      }
    }
    // ---- characters (with prefix/suffix), byte fallback or <unk> for the unknown ones ----
    struct Symbol {
      int32_t id;
      int prev, next;
    };
    std::vector<Symbol> symbols;
    symbols.reserve(word.size());
    auto add = [&](int32_t id) {
      const int index = static_cast<int>(symbols.size());
      if (index > 0) symbols.back().next = index;
      symbols.push_back({id, index - 1, -1});
    };
    int32_t pending_unk = -1;  // an <unk> not added yet (fuse_unk joins a run of them)
    std::string piece;
    for (size_t at = 0; at < word.size();) {
      const size_t n = std::min(detail::utf8_char_len(word[at]), word.size() - at);
      piece.assign(at > 0 ? prefix_ : std::string());
      piece.append(word.substr(at, n));
      if (at + n == word.size()) piece += suffix_;
      at += n;
      if (const auto it = vocab_.find(piece); it != vocab_.end()) {
        if (pending_unk >= 0) add(pending_unk), pending_unk = -1;
        add(it->second);
        continue;
      }
      if (byte_fallback_ && add_bytes(piece, add)) continue;
      if (unk_id_ < 0) continue;  // no unk_token: the character is dropped, as in tokenizers
      if (pending_unk >= 0 && !fuse_unk_) add(pending_unk);
      pending_unk = unk_id_;
    }
    if (pending_unk >= 0) add(pending_unk);
    // ---- merge the lowest-ranked pair, leftmost first, until none applies ----
    struct Merge {
      int32_t rank;
      int pos;
      int32_t new_id;
      bool operator<(const Merge& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    std::priority_queue<Merge> queue;
    auto push = [&](int left) {
      if (left < 0 || symbols[left].next < 0) return;
      const auto it = merges_.find(key(symbols[left].id, symbols[symbols[left].next].id));
      if (it != merges_.end()) queue.push({it->second.first, left, it->second.second});
    };
    for (int i = 0; i + 1 < static_cast<int>(symbols.size()); ++i) push(i);
    while (!queue.empty()) {
      const Merge top = queue.top();
      queue.pop();
      Symbol& left = symbols[top.pos];
      if (left.id < 0 || left.next < 0) continue;  // merged into its left neighbour, or last
      const auto it = merges_.find(key(left.id, symbols[left.next].id));
      if (it == merges_.end() || it->second.second != top.new_id) continue;  // stale entry
      Symbol& right = symbols[left.next];
      left.id = top.new_id;
      right.id = -1;
      left.next = right.next;
      if (right.next >= 0) symbols[right.next].prev = top.pos;
      push(left.prev);
      push(top.pos);
    }
    for (int i = symbols.empty() ? -1 : 0; i >= 0; i = symbols[i].next) ids.push_back(symbols[i].id);
  }

  /// One past the largest id of the vocab.
  int64_t size() const { return static_cast<int64_t>(tokens_.size()); }
  /// The token of `id` ("" for an id the vocab skips).
  const std::string& token(int64_t id) const { return tokens_[static_cast<size_t>(id)]; }
  /// The id of `token`, -1 when it is not in the vocab.
  int32_t id(std::string_view token) const {
    const auto it = vocab_.find(token);
    return it == vocab_.end() ? -1 : it->second;
  }
  /// The id of unk_token, -1 without one.
  int32_t unk_id() const { return unk_id_; }

 private:
  static uint64_t key(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
  }

  /// Adds the <0xNN> pieces of `piece`'s bytes; false (adding nothing) when one is missing.
  template <typename Add>
  bool add_bytes(const std::string& piece, Add& add) const {
    int32_t found[16];
    if (piece.size() > sizeof found / sizeof found[0]) return false;
    for (size_t i = 0; i < piece.size(); ++i) {
      char name[8];
      std::snprintf(name, sizeof name, "<0x%02X>", static_cast<uint8_t>(piece[i]));
      const auto it = vocab_.find(std::string_view(name));
      if (it == vocab_.end()) return false;
      found[i] = it->second;
    }
    for (size_t i = 0; i < piece.size(); ++i) add(found[i]);
    return true;
  }

  std::unordered_map<std::string, int32_t, detail::StringHash, std::equal_to<>> vocab_;
  std::vector<std::string> tokens_;
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges_;  // (left, right) -> (rank, merged id)
  std::string prefix_, suffix_;
  bool byte_fallback_ = false, fuse_unk_ = false, ignore_merges_ = false;
  int32_t unk_id_ = -1;
};

}  // namespace memopt::data
