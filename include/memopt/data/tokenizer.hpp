// memopt/data/tokenizer.hpp — text <-> token ids, for a SentencePiece .model
// (SentencePieceTokenizer, sentencepiece.hpp) or a Hugging Face tokenizer.json (HfTokenizer,
// hf_tokenizer.hpp), behind one type: the data loaders, the pretokenizer and the examples
// take a Tokenizer, and load_tokenizer() makes one from a file or a checkpoint folder.
#pragma once

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <torch/torch.h>

#include "memopt/data/hf_tokenizer.hpp"
#include "memopt/data/sentencepiece.hpp"
#include "memopt/data/unicode.hpp"

namespace memopt::data {

/// How a Tokenizer treats its input.   TokenizerOptions().invalid_utf8(InvalidUtf8::kReject)
struct TokenizerOptions {
  /// Bytes that are not UTF-8: replaced by U+FFFD (default) or rejected with an error.
  TORCH_ARG(InvalidUtf8, invalid_utf8) = InvalidUtf8::kReplace;
};

/// The file a Tokenizer made from `path` reads: `path` itself, or for a folder its
/// tokenizer.json (preferred) or tokenizer.model; an error when the folder holds neither.
///   memopt::data::tokenizer_file("checkpoints/llama")   // "checkpoints/llama/tokenizer.json"
inline std::string tokenizer_file(const std::string& path) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(path)) return path;
  for (const char* name : {"tokenizer.json", "tokenizer.model"}) {
    if (fs::exists(fs::path(path) / name)) return (fs::path(path) / name).string();
  }
  TORCH_CHECK(false, "memopt::data: the folder '", path, "' holds neither tokenizer.json nor tokenizer.model. "
              "HINT: pass the tokenizer file itself, or a checkpoint folder saved with its tokenizer");
}

/// A tokenizer of either kind. `path` is a .model file, a tokenizer.json, or a folder holding
/// tokenizer.json (preferred) or tokenizer.model, such as a Hugging Face checkpoint.
///   memopt::data::Tokenizer tok("data/kjv/tokenizer.model");
///   memopt::data::Tokenizer llama("checkpoints/llama-3.2-1b");        // its tokenizer.json
///   std::vector<int32_t> ids = tok.encode("The jury said.");
class Tokenizer {
 public:
  explicit Tokenizer(const std::string& path, TokenizerOptions options = {})
      : impl_(open(path)), options_(options) {}

  /// Token ids of `text` (no BOS/EOS added). Malformed UTF-8 is handled per the options.
  std::vector<int32_t> encode(std::string_view text) const {
    const std::string valid = valid_utf8(text, options_.invalid_utf8(), "tokenizer '" + path() + "': encode");
    return std::visit([&](const auto& t) { return t.encode(valid); }, impl_);
  }
  /// Text of `ids` (special/control tokens decode to nothing).
  std::string decode(const std::vector<int32_t>& ids) const {
    return std::visit([&](const auto& t) { return t.decode(ids); }, impl_);
  }
  /// Text of a 1-D integer tensor of ids (any integer dtype, any device).
  ///   std::string s = tok.decode(batch.inputs[0]);
  std::string decode(const torch::Tensor& ids) const {
    TORCH_CHECK(ids.dim() <= 1 && !ids.is_floating_point() && !ids.is_complex() && ids.scalar_type() != torch::kBool,
                "memopt::data: tokenizer '", path(), "' decodes a 1-D integer tensor of ids (got ", ids.dim(), "-D ",
                ids.scalar_type(), "). HINT: decode one row, e.g. ids[0]");
    torch::Tensor flat = ids.reshape({-1}).to(torch::kCPU, torch::kLong).contiguous();  // (n,)
    const int64_t* p = flat.data_ptr<int64_t>();
    std::vector<int32_t> narrow(static_cast<size_t>(flat.numel()));
    for (size_t i = 0; i < narrow.size(); ++i) {
      TORCH_CHECK(p[i] >= 0 && p[i] < vocab_size(), "memopt::data: tokenizer '", path(), "' cannot decode token id ",
                  p[i], " at position ", i, " (vocab_size ", vocab_size(), "). HINT: decode ids produced with this tokenizer");
      narrow[i] = static_cast<int32_t>(p[i]);
    }
    return decode(narrow);
  }

  /// Number of ids: they are in [0, vocab_size()).
  int64_t vocab_size() const { return std::visit([](const auto& t) -> int64_t { return t.vocab_size(); }, impl_); }
  /// Id of BOS (<s>, <|begin_of_text|>, ...), -1 if the tokenizer has none.
  int64_t bos_id() const { return std::visit([](const auto& t) -> int64_t { return t.bos_id(); }, impl_); }
  /// Id of EOS, appended after each document in memopt's shards (-1 if none).
  int64_t eos_id() const { return std::visit([](const auto& t) -> int64_t { return t.eos_id(); }, impl_); }
  /// Id of the padding token (-1 if none).
  int64_t pad_id() const { return std::visit([](const auto& t) -> int64_t { return t.pad_id(); }, impl_); }
  /// Id of <unk> (-1 for byte-level BPE, which has none).
  int64_t unk_id() const { return std::visit([](const auto& t) -> int64_t { return t.unk_id(); }, impl_); }
  /// The piece (token text) of `id`, e.g. "▁the" or "Ġthe".
  const std::string& piece(int64_t id) const {
    return std::visit([&](const auto& t) -> const std::string& { return t.piece(id); }, impl_);
  }
  /// The id of a piece, unk_id() when it is not in the vocab.
  int32_t piece_to_id(std::string_view piece) const {
    return std::visit([&](const auto& t) { return t.piece_to_id(piece); }, impl_);
  }
  /// The file this tokenizer was loaded from.
  const std::string& path() const {
    return std::visit([](const auto& t) -> const std::string& { return t.path(); }, impl_);
  }
  /// "sentencepiece" or "tokenizer.json".
  const char* kind() const { return std::holds_alternative<SentencePieceTokenizer>(impl_) ? "sentencepiece" : "tokenizer.json"; }
  const TokenizerOptions& options() const { return options_; }

  /// Appends user symbols (chat markers such as "<|user|>") with ids vocab_size(),
  /// vocab_size() + 1, ..., as Hugging Face's add_tokens does; a symbol is matched whole, never
  /// merged, and decodes to its text. A symbol already in the vocab keeps its id. Not
  /// thread-safe with concurrent encode(): add symbols first.
  ///   auto ids = tok.add_user_symbols({"<|user|>", "<|embed|>"});   // {4096, 4097}
  std::vector<int32_t> add_user_symbols(const std::vector<std::string>& symbols) {
    return std::visit([&](auto& t) { return t.add_user_symbols(symbols); }, impl_);
  }

  /// Copies the tokenizer's file into `dir` (an existing folder) where Hugging Face's
  /// save_pretrained puts it next to the weights: tokenizer.model, or tokenizer.json plus the
  /// tokenizer_config.json beside it, if any (the other kind's file is removed, so the folder
  /// loads as this tokenizer). The file as loaded: add_user_symbols' symbols are not in it.
  /// Nothing happens when the tokenizer was loaded from `dir`.
  ///   tok.save("out/model");   // out/model now loads with memopt::data::load_tokenizer("out/model")
  void save(const std::string& dir) const {
    namespace fs = std::filesystem;
    const fs::path from(path()), root(dir);
    std::error_code ec;
    if (fs::equivalent(from.parent_path(), root, ec)) return;
    const bool json = hf() != nullptr;
    const fs::path config = from.parent_path() / "tokenizer_config.json";
    fs::remove(root / (json ? "tokenizer.model" : "tokenizer.json"), ec);
    fs::remove(root / "tokenizer_config.json", ec);
    bool copied = fs::copy_file(from, root / (json ? "tokenizer.json" : "tokenizer.model"),
                                fs::copy_options::overwrite_existing, ec);
    if (copied && json && fs::exists(config)) copied = fs::copy_file(config, root / "tokenizer_config.json", ec);
    TORCH_CHECK(copied, "memopt::data: cannot copy the tokenizer '", path(), "' into '", dir, "' (", ec.message(),
                "). HINT: pass an existing, writable folder");
  }

  /// The SentencePiece model, nullptr for a tokenizer.json.
  const SentencePieceTokenizer* sentencepiece() const { return std::get_if<SentencePieceTokenizer>(&impl_); }
  /// The tokenizer.json, nullptr for a SentencePiece model.
  const HfTokenizer* hf() const { return std::get_if<HfTokenizer>(&impl_); }

 private:
  using Impl = std::variant<SentencePieceTokenizer, HfTokenizer>;


  static Impl open(const std::string& path) {
    const std::string file = tokenizer_file(path);
    if (std::filesystem::path(file).extension() == ".json") return HfTokenizer(file);
    std::ifstream in(file, std::ios::binary);
    char first = 0;
    while (in.get(first) && std::isspace(static_cast<unsigned char>(first))) {
    }
    if (in && first == '{') return HfTokenizer(file);  // a tokenizer.json under another name
    return SentencePieceTokenizer(file);
  }

  Impl impl_;
  TokenizerOptions options_;
};

/// The tokenizer at `path` (see Tokenizer), shared as the data loaders take it.
///   auto tok = memopt::data::load_tokenizer("checkpoints/llama-3.2-1b");
///   memopt::data::StreamLoader loader({"corpus/*.jsonl"}, tok, options);
inline std::shared_ptr<Tokenizer> load_tokenizer(const std::string& path, TokenizerOptions options = {}) {
  return std::make_shared<Tokenizer>(path, options);
}

}  // namespace memopt::data
