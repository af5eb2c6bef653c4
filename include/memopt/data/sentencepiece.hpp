// memopt/data/sentencepiece.hpp — text <-> token ids with a SentencePiece BPE model
// (tokenizer.model, as written by spm_train or memopt_prepare_corpus), implemented here
// in plain C++: it reads the model file itself and reproduces SentencePiece's normalizer
// and BPE merges, so programs that link LibTorch need no libsentencepiece (Debian's
// bundles a protobuf that clashes with LibTorch's; see the note at the end of this file).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <queue>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "memopt/data/unicode.hpp"

namespace memopt::data {

namespace detail {

/// Reads protobuf wire format: enough for SentencePiece's ModelProto.
class ProtoReader {
 public:
  explicit ProtoReader(std::string_view bytes) : p_(bytes.data()), end_(bytes.data() + bytes.size()) {}

  bool done() const { return p_ >= end_; }
  bool ok() const { return ok_; }

  /// Reads the next key; false at the end or on malformed input.
  bool next(uint32_t& field, uint32_t& wire) {
    if (done() || !ok_) return false;
    const uint64_t key = varint();
    field = static_cast<uint32_t>(key >> 3);
    wire = static_cast<uint32_t>(key & 7);
    return ok_;
  }
  uint64_t varint() {
    uint64_t value = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (p_ >= end_) break;
      const auto byte = static_cast<uint8_t>(*p_++);
      value |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if ((byte & 0x80) == 0) return value;
    }
    ok_ = false;
    return 0;
  }
  std::string_view bytes() {
    const uint64_t n = varint();
    if (!ok_ || n > static_cast<uint64_t>(end_ - p_)) {
      ok_ = false;
      return {};
    }
    std::string_view out(p_, n);
    p_ += n;
    return out;
  }
  float fixed32_float() {
    if (end_ - p_ < 4) {
      ok_ = false;
      return 0.f;
    }
    uint32_t bits = 0;
    for (int b = 0; b < 4; ++b) bits |= static_cast<uint32_t>(static_cast<uint8_t>(p_[b])) << (8 * b);
    p_ += 4;
    float value;
    std::memcpy(&value, &bits, 4);
    return value;
  }
  void skip(uint32_t wire) {
    switch (wire) {
      case 0: varint(); break;
      case 1: advance(8); break;
      case 2: bytes(); break;
      case 5: advance(4); break;
      default: ok_ = false;  // groups (3, 4) are not used by SentencePiece
    }
  }

 private:
  void advance(int64_t n) {
    if (end_ - p_ < n) ok_ = false; else p_ += n;
  }
  const char* p_;
  const char* end_;
  bool ok_ = true;
};

/// SentencePiece's precompiled normalization map: a darts-clone double-array trie from
/// input byte strings to offsets of NUL-terminated replacements.
class CharsMap {
 public:
  CharsMap() = default;
  /// blob: <u32 trie bytes><trie units><replacement strings>; false when malformed.
  bool load(std::string_view blob) {
    if (blob.empty()) return true;
    if (blob.size() < 4) return false;
    uint32_t trie_bytes = 0;
    for (int b = 0; b < 4; ++b) trie_bytes |= static_cast<uint32_t>(static_cast<uint8_t>(blob[b])) << (8 * b);
    if (trie_bytes % 4 != 0 || trie_bytes == 0 || trie_bytes > blob.size() - 4) return false;
    units_.resize(trie_bytes / 4);
    for (size_t u = 0; u < units_.size(); ++u) {
      uint32_t v = 0;
      for (int b = 0; b < 4; ++b) v |= static_cast<uint32_t>(static_cast<uint8_t>(blob[4 + 4 * u + b])) << (8 * b);
      units_[u] = v;
    }
    replacements_ = std::string(blob.substr(4 + trie_bytes));
    return true;
  }
  bool empty() const { return units_.empty(); }

  /// Longest rule matching a prefix of `s`: {replacement, bytes consumed}, or consumed 0.
  std::pair<std::string_view, size_t> longest_prefix(std::string_view s) const {
    std::pair<std::string_view, size_t> best{{}, 0};
    if (units_.empty()) return best;
    size_t id = offset(units_[0]);
    for (size_t i = 0; i < s.size(); ++i) {
      const auto c = static_cast<uint8_t>(s[i]);
      id ^= c;
      if (id >= units_.size()) break;
      const uint32_t unit = units_[id];
      if (label(unit) != c) break;
      id ^= offset(unit);
      if (id >= units_.size()) break;
      if ((unit >> 8) & 1) {  // has a leaf: a rule ends here
        const uint32_t value = units_[id] & ((1u << 31) - 1);
        if (value < replacements_.size()) {
          best = {std::string_view(replacements_.c_str() + value), i + 1};
        }
      }
    }
    return best;
  }

 private:
  static size_t offset(uint32_t unit) { return (unit >> 10) << ((unit & (1u << 9)) >> 6); }
  static uint32_t label(uint32_t unit) { return unit & ((1u << 31) | 0xFF); }
  std::vector<uint32_t> units_;
  std::string replacements_;
};

}  // namespace detail

/// A SentencePiece BPE model (text <-> ids), loaded from a .model file. Programs usually hold
/// it through memopt::data::Tokenizer (tokenizer.hpp), which also reads tokenizer.json.
///   memopt::data::SentencePieceTokenizer tok("data/kjv/tokenizer.model");
///   std::vector<int32_t> ids = tok.encode("The jury said.");
class SentencePieceTokenizer {
 public:
  /// Piece kinds, numbered as in SentencePiece's ModelProto.
  enum class PieceType : int { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4,
                               kUnused = 5, kByte = 6 };

  /// Loads `model_path`; fails with a HINT when it is missing, not a SentencePiece model,
  /// or uses a feature this implementation leaves out (unigram, byte fallback).
  explicit SentencePieceTokenizer(const std::string& model_path) : path_(model_path) {
    std::ifstream in(model_path, std::ios::binary);
    TORCH_CHECK(in.good(), "memopt::data: tokenizer model '", model_path,
                "' does not exist or cannot be read. HINT: for data/kjv run "
                "scripts/fetch_corpus, then memopt_prepare_corpus (or scripts/demo)");
    const std::string bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    parse(bytes);
  }

  /// Token ids of `text`, as SentencePiece encodes it (no BOS/EOS added).
  ///   auto ids = tok.encode("Hello world.");
  std::vector<int32_t> encode(std::string_view text) const {
    const std::string normalized = normalize(text);
    // ---- split into characters (user-defined symbols stay whole and never merge) ----
    struct Symbol {
      int prev, next;
      std::string_view piece;
      bool frozen;
    };
    std::vector<Symbol> symbols;
    std::string_view rest = normalized;
    while (!rest.empty()) {
      size_t len = user_defined_prefix(rest);
      const bool frozen = len > 0;
      if (!frozen) len = std::min(detail::utf8_char_len(rest[0]), rest.size());
      const int index = static_cast<int>(symbols.size());
      symbols.push_back({index - 1, rest.size() == len ? -1 : index + 1, rest.substr(0, len), frozen});
      rest.remove_prefix(len);
    }
    // ---- merge the best-scoring adjacent pair until none is in the vocab ----
    struct Pair {
      float score;
      int left, right;
      size_t size;
    };
    auto worse = [](const Pair& a, const Pair& b) {
      return a.score < b.score || (a.score == b.score && a.left > b.left);
    };
    std::priority_queue<Pair, std::vector<Pair>, decltype(worse)> agenda(worse);
    std::map<std::string_view, std::pair<std::string_view, std::string_view>> unused_merges;
    auto try_pair = [&](int left, int right) {
      if (left < 0 || right < 0 || symbols[left].frozen || symbols[right].frozen) return;
      const std::string_view merged(symbols[left].piece.data(),
                                    symbols[left].piece.size() + symbols[right].piece.size());
      const auto it = mergeable_.find(merged);
      if (it == mergeable_.end()) return;
      agenda.push({pieces_[it->second].score, left, right, merged.size()});
      if (pieces_[it->second].type == PieceType::kUnused) {
        unused_merges[merged] = {symbols[left].piece, symbols[right].piece};
      }
    };
    for (size_t i = 1; i < symbols.size(); ++i) try_pair(static_cast<int>(i) - 1, static_cast<int>(i));
    while (!agenda.empty()) {
      const Pair top = agenda.top();
      agenda.pop();
      Symbol& left = symbols[top.left];
      Symbol& right = symbols[top.right];
      if (left.piece.empty() || right.piece.empty() ||
          left.piece.size() + right.piece.size() != top.size) {
        continue;  // stale: one side was merged since this pair was queued
      }
      left.piece = std::string_view(left.piece.data(), top.size);
      left.next = right.next;
      if (right.next >= 0) symbols[right.next].prev = top.left;
      right.piece = {};
      try_pair(left.prev, top.left);
      try_pair(top.left, left.next);
    }
    // ---- emit ids (unused pieces split back; runs of unknowns become one <unk>) ----
    std::vector<int32_t> ids;
    auto emit = [&](auto&& self, std::string_view piece) -> void {
      const int32_t id = piece_to_id(piece);
      if (pieces_[id].type == PieceType::kUnused) {
        const auto it = unused_merges.find(piece);
        if (it != unused_merges.end()) {
          self(self, it->second.first);
          self(self, it->second.second);
          return;
        }
      }
      if (id == unk_id_ && !ids.empty() && ids.back() == unk_id_) return;
      ids.push_back(id);
    };
    for (int i = symbols.empty() ? -1 : 0; i >= 0; i = symbols[i].next) emit(emit, symbols[i].piece);
    return ids;
  }

  /// Text of `ids` (control ids such as EOS decode to nothing, <unk> to " ⁇ ").
  ///   std::string s = tok.decode(tok.encode("Hello."));   // "Hello."
  std::string decode(const std::vector<int32_t>& ids) const {
    std::string text;
    for (size_t i = 0; i < ids.size(); ++i) {
      const int32_t id = ids[i];
      TORCH_CHECK(id >= 0 && id < vocab_size(), "memopt::data: tokenizer '", path_,
                  "' cannot decode token id ", id, " at position ", i, " (vocab_size ",
                  vocab_size(), "). HINT: decode ids produced with this tokenizer");
      const Piece& p = pieces_[id];
      if (p.type == PieceType::kControl) continue;
      if (p.type == PieceType::kUnknown) {
        text += unk_surface_;
        continue;
      }
      std::string_view piece = p.text;
      if (text.empty() && (add_dummy_prefix_ || remove_extra_whitespaces_) &&
          piece.substr(0, kSpaceSymbol.size()) == kSpaceSymbol) {
        piece.remove_prefix(kSpaceSymbol.size());  // the dummy prefix of the first word
      }
      for (size_t at = 0; at < piece.size();) {
        if (piece.substr(at, kSpaceSymbol.size()) == kSpaceSymbol) {
          text += ' ';
          at += kSpaceSymbol.size();
        } else {
          text += piece[at++];
        }
      }
    }
    return text;
  }

  /// Number of pieces; ids are in [0, vocab_size()).
  int64_t vocab_size() const { return static_cast<int64_t>(pieces_.size()); }
  /// Id of <s> (-1 if the model has none).
  int64_t bos_id() const { return bos_id_; }
  /// Id of </s>, appended after each document in memopt's shards (-1 if none).
  int64_t eos_id() const { return eos_id_; }
  /// Id of <pad> (-1 if the model has none).
  int64_t pad_id() const { return pad_id_; }
  /// Id of <unk>.
  int64_t unk_id() const { return unk_id_; }
  /// The piece of `id`, e.g. "▁the".   tok.piece(tok.eos_id()) == "</s>"
  const std::string& piece(int64_t id) const {
    TORCH_CHECK(id >= 0 && id < vocab_size(), "memopt::data: tokenizer '", path_,
                "' has no piece ", id, " (vocab_size ", vocab_size(),
                "). HINT: use an id in [0, vocab_size())");
    return pieces_[static_cast<size_t>(id)].text;
  }
  /// The id of a piece, unk_id() when it is not in the vocab.
  int32_t piece_to_id(std::string_view piece) const {
    if (auto it = reserved_.find(piece); it != reserved_.end()) return it->second;
    if (auto it = mergeable_.find(piece); it != mergeable_.end()) return it->second;
    return unk_id_;
  }
  /// The model file this tokenizer was loaded from.
  const std::string& path() const { return path_; }

  /// Appends user symbols (chat markers such as "<|user|>") as new pieces with ids
  /// vocab_size(), vocab_size() + 1, ..., as Hugging Face's add_tokens does (the model's
  /// embedding must then grow to the new vocab_size()). A symbol is matched whole in the
  /// text before segmentation, never merged with its neighbours, and decodes to its text;
  /// piece_to_id finds it. A symbol already in the vocab (of any kind) is left as it is and
  /// its id returned. Not thread-safe with concurrent encode(): add symbols first.
  ///   auto ids = tok.add_user_symbols({"<|user|>", "<|embed|>"});   // {4096, 4097}
  ///   tok.encode("<|embed|> Hi");   // {id of "▁" (the dummy prefix), 4097, ...}
  std::vector<int32_t> add_user_symbols(const std::vector<std::string>& symbols) {
    std::vector<int32_t> ids;
    ids.reserve(symbols.size());
    for (const std::string& symbol : symbols) {
      TORCH_CHECK(!symbol.empty(), "memopt::data: tokenizer '", path_,
                  "': cannot add an empty user symbol (symbol ", ids.size(),
                  " of the list). HINT: pass non-empty markers such as \"<|user|>\"");
      TORCH_CHECK(std::none_of(symbol.begin(), symbol.end(),
                               [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }),
                  "memopt::data: tokenizer '", path_, "': user symbol '", symbol,
                  "' holds whitespace, which the normalizer rewrites, so it could never match. "
                  "HINT: use a symbol without spaces, e.g. \"<|user|>\"");
      if (auto it = reserved_.find(symbol); it != reserved_.end()) {
        ids.push_back(it->second);
        continue;
      }
      if (auto it = mergeable_.find(symbol); it != mergeable_.end()) {
        ids.push_back(it->second);
        continue;
      }
      const auto id = static_cast<int32_t>(pieces_.size());
      pieces_.push_back({symbol, 0.f, PieceType::kUserDefined});
      mergeable_.emplace(symbol, id);  // user-defined pieces live there, as in parse()
      user_defined_.push_back(symbol);
      ids.push_back(id);
    }
    return ids;
  }

 private:
  static constexpr std::string_view kSpaceSymbol = "\xe2\x96\x81";  // U+2581 "▁"

  struct Piece {
    std::string text;
    float score = 0.f;
    PieceType type = PieceType::kNormal;
  };

  [[noreturn]] void fail(const std::string& what) const {
    TORCH_CHECK(false, "memopt::data: cannot load tokenizer model '", path_, "': ", what,
                ". HINT: pass a SentencePiece BPE model (spm_train --model_type=bpe); for "
                "data/kjv rebuild it with memopt_prepare_corpus --force");
  }

  void parse(std::string_view bytes) {
    // ModelProto: 1 pieces, 2 trainer_spec, 3 normalizer_spec, 5 denormalizer_spec.
    std::string_view charsmap;
    std::string bos_piece = "<s>", eos_piece = "</s>", pad_piece = "<pad>";
    uint64_t model_type = 1;  // UNIGRAM is the proto default
    detail::ProtoReader model(bytes);
    uint32_t field = 0, wire = 0;
    while (model.next(field, wire)) {
      if (field == 1 && wire == 2) {
        Piece piece;
        detail::ProtoReader sub(model.bytes());
        while (sub.next(field, wire)) {
          if (field == 1 && wire == 2) piece.text = std::string(sub.bytes());
          else if (field == 2 && wire == 5) piece.score = sub.fixed32_float();
          else if (field == 3 && wire == 0) piece.type = static_cast<PieceType>(sub.varint());
          else sub.skip(wire);
        }
        if (!sub.ok()) fail("malformed piece " + std::to_string(pieces_.size()));
        pieces_.push_back(std::move(piece));
      } else if (field == 2 && wire == 2) {  // TrainerSpec
        detail::ProtoReader sub(model.bytes());
        while (sub.next(field, wire)) {
          if (field == 3 && wire == 0) {
            model_type = sub.varint();
          } else if (field == 24 && wire == 0) {
            if (sub.varint() != 0) fail("treat_whitespace_as_suffix is not supported");
          } else if (field == 35 && wire == 0) {
            if (sub.varint() != 0) fail("byte_fallback is not supported");
          } else if (field == 44 && wire == 2) unk_surface_ = std::string(sub.bytes());
          else if (field == 46 && wire == 2) bos_piece = std::string(sub.bytes());
          else if (field == 47 && wire == 2) eos_piece = std::string(sub.bytes());
          else if (field == 48 && wire == 2) pad_piece = std::string(sub.bytes());
          else sub.skip(wire);
        }
        if (!sub.ok()) fail("malformed trainer_spec");
      } else if (field == 3 && wire == 2) {  // NormalizerSpec
        detail::ProtoReader sub(model.bytes());
        while (sub.next(field, wire)) {
          if (field == 2 && wire == 2) charsmap = sub.bytes();
          else if (field == 3 && wire == 0) add_dummy_prefix_ = sub.varint() != 0;
          else if (field == 4 && wire == 0) remove_extra_whitespaces_ = sub.varint() != 0;
          else if (field == 5 && wire == 0) escape_whitespaces_ = sub.varint() != 0;
          else sub.skip(wire);
        }
        if (!sub.ok()) fail("malformed normalizer_spec");
      } else if (field == 5 && wire == 2) {  // DenormalizerSpec: only an empty one is supported
        detail::ProtoReader sub(model.bytes());
        while (sub.next(field, wire)) {
          if (field == 2 && wire == 2) {
            if (!sub.bytes().empty()) fail("a denormalizer is not supported");
          } else {
            sub.skip(wire);
          }
        }
      } else {
        model.skip(wire);
      }
    }
    if (!model.ok() || pieces_.empty()) {
      fail(c10::str("not a SentencePiece model (", bytes.size(), " bytes, ", pieces_.size(),
                    " pieces read)"));
    }
    if (model_type != 2) fail(c10::str("model_type ", model_type, " is not BPE (2)"));
    if (!charsmap_.load(charsmap)) fail("malformed precompiled_charsmap");

    for (size_t i = 0; i < pieces_.size(); ++i) {
      const Piece& p = pieces_[i];
      const auto id = static_cast<int32_t>(i);
      const bool mergeable = p.type == PieceType::kNormal || p.type == PieceType::kUserDefined ||
                             p.type == PieceType::kUnused;
      if (p.type < PieceType::kNormal || p.type > PieceType::kByte) {
        fail(c10::str("piece ", i, " has unknown type ", static_cast<int>(p.type)));
      }
      if (p.text.empty()) fail(c10::str("piece ", i, " is empty"));
      const bool inserted = mergeable ? mergeable_.emplace(p.text, id).second
                                      : reserved_.emplace(p.text, id).second;
      if (!inserted) fail(c10::str("piece '", p.text, "' appears twice"));
      if (p.type == PieceType::kUserDefined) user_defined_.push_back(p.text);
      if (p.type == PieceType::kUnknown) unk_id_ = id;
    }
    if (unk_id_ < 0) fail("it has no <unk> piece");
    auto control_id = [&](const std::string& piece) -> int64_t {
      const auto it = reserved_.find(piece);
      return it != reserved_.end() && pieces_[it->second].type == PieceType::kControl ? it->second : -1;
    };
    bos_id_ = control_id(bos_piece);
    eos_id_ = control_id(eos_piece);
    pad_id_ = control_id(pad_piece);
  }

  /// Bytes of the longest user-defined symbol at the start of `s` (0 if none).
  size_t user_defined_prefix(std::string_view s) const {
    size_t best = 0;
    for (const std::string& u : user_defined_) {
      if (u.size() > best && s.substr(0, u.size()) == u) best = u.size();
    }
    return best;
  }

  /// One normalization step: {replacement, bytes consumed} (SentencePiece's NormalizePrefix).
  std::pair<std::string_view, size_t> normalize_prefix(std::string_view s) const {
    if (const size_t n = user_defined_prefix(s); n > 0) return {s.substr(0, n), n};
    if (auto rule = charsmap_.longest_prefix(s); rule.second > 0) return rule;
    if (const size_t n = detail::valid_utf8_prefix(s); n > 0) return {s.substr(0, n), n};
    return {"\xEF\xBF\xBD", 1};  // malformed UTF-8: U+FFFD for one byte
  }

  /// SentencePiece's Normalizer::Normalize (prefix ▁, spaces as ▁, extra spaces removed).
  std::string normalize(std::string_view input) const {
    std::string out;
    if (remove_extra_whitespaces_) {
      while (!input.empty()) {
        const auto [text, consumed] = normalize_prefix(input);
        if (text != " ") break;
        input.remove_prefix(consumed);
      }
    }
    if (input.empty()) return out;
    const std::string_view space = escape_whitespaces_ ? kSpaceSymbol : std::string_view(" ");
    if (add_dummy_prefix_) out += space;
    bool prev_space = remove_extra_whitespaces_;
    while (!input.empty()) {
      auto [text, consumed] = normalize_prefix(input);
      if (prev_space) {
        while (!text.empty() && text[0] == ' ') text.remove_prefix(1);
      }
      if (!text.empty()) {
        for (char c : text) {
          if (c == ' ') out += space; else out += c;
        }
        prev_space = text.back() == ' ';
      }
      input.remove_prefix(consumed);
      if (!remove_extra_whitespaces_) prev_space = false;
    }
    if (remove_extra_whitespaces_) {
      while (out.size() >= space.size() && out.compare(out.size() - space.size(), space.size(), space) == 0) {
        out.resize(out.size() - space.size());
      }
    }
    return out;
  }

  std::string path_;
  std::vector<Piece> pieces_;
  std::unordered_map<std::string, int32_t, detail::StringHash, std::equal_to<>> mergeable_;
  std::unordered_map<std::string, int32_t, detail::StringHash, std::equal_to<>> reserved_;
  std::vector<std::string> user_defined_;
  detail::CharsMap charsmap_;
  bool add_dummy_prefix_ = true, remove_extra_whitespaces_ = true, escape_whitespaces_ = true;
  std::string unk_surface_ = " \xE2\x81\x87 ";
  int32_t unk_id_ = -1;
  int64_t bos_id_ = -1, eos_id_ = -1, pad_id_ = -1;
};

// Why not wrap sentencepiece::SentencePieceProcessor: Debian's libsentencepiece (0.1.97)
// bundles protobuf-lite 3.14 and exports its symbols, while LibTorch loads libprotobuf
// 3.21. In one process one of them binds to the other's symbols: either the program
// crashes before main() (libprotobuf's static init) or SentencePiece fails its protobuf
// version check. So LibTorch programs must not load libsentencepiece; only
// memopt_prepare_corpus (linked against c10 alone) calls the SentencePiece trainer, and
// it checks that this tokenizer encodes the corpus exactly as SentencePiece does.

}  // namespace memopt::data
