// memopt/data/grit_format.hpp — GritLM's prompt formats on a memopt Tokenizer (Muennighoff et
// al. 2024): the tokenized sequences to embed and to generate, with the instruction prefix
// tokenized once per distinct instruction. data/grit.hpp's batcher pads and masks them; the
// records and their format strings are in grit_records.hpp.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memopt/data/grit_records.hpp>
#include <memopt/data/tokenizer.hpp>

namespace memopt::data {

/// A tokenized text to embed: ids[0, prefix_len) are <s> and the instruction/format prefix,
/// ids[prefix_len, size) the text's own tokens (the ones pooled).
struct EmbedSequence {
  std::vector<int32_t> ids;
  int64_t prefix_len = 0;
};

/// A tokenized generative example: ids[0, prompt_len) are <s> and the user part (no loss),
/// ids[prompt_len, size) the answer and </s> (the targets).
struct GenSequence {
  std::vector<int32_t> ids;
  int64_t prompt_len = 0;
};

/// GritLM's formats on a memopt Tokenizer. Adds <|user|>, <|embed|>, <|assistant|> as user
/// symbols (new ids at the end of the vocab: size the model's embedding by
/// tokenizer().vocab_size() after constructing this). Thread-safe: the tokenizer is only
/// read, and the instruction cache is locked.
///
/// How ids are built (the "precompiled prompt parts"): embedding ids = [BOS] +
/// encode(embed_prefix(instruction)) + encode(text), where the prefix ids are computed once
/// per distinct instruction and cached; generative ids = [BOS] + encode(gen_prefix(prompt))
/// + encode(answer.strip()) + [EOS]. The pooled tokens are therefore exactly encode(text),
/// the text's tokens on its own. This equals encode() of the whole formatted string whenever
/// the normalizer turns "\n" into a space (SentencePiece's default nmt_nfkc, as data/brown's
/// model): the symbols never merge with their neighbours, the prefix's trailing newline is
/// dropped as trailing whitespace, and the text's dummy-prefix "▁" stands for it. With an
/// identity normalizer "\n" stays a character and the whole-string encoding would glue the
/// text's first word to it without "▁"; the split encoding is kept so pooled tokens never
/// depend on the instruction. A tokenizer without BOS (bos_id() < 0) or EOS gets none.
///   auto tok = std::make_shared<memopt::data::Tokenizer>("data/brown/tokenizer.model");
///   memopt::data::GritFormat format(tok);       // tok->vocab_size() is now 4099
///   auto q = format.encode_embed("Given a sentence", "The jury said.");
///   // q.ids = [<s>, ▁, <|user|>, ▁G, iv, en, ▁a, ▁sent, ence, ▁, <|embed|>, ▁The, ▁j, ury, ▁said, .]
///   // q.prefix_len == 11 == format.instruction_length("Given a sentence")
class GritFormat {
 public:
  explicit GritFormat(std::shared_ptr<Tokenizer> tokenizer) {
    TORCH_CHECK(tokenizer != nullptr, "memopt::data: GritFormat: the tokenizer is null. HINT: pass "
                "std::make_shared<memopt::data::Tokenizer>(path)");
    const auto ids = tokenizer->add_user_symbols(
        {std::string(kUserSymbol), std::string(kEmbedSymbol), std::string(kAssistantSymbol)});
    user_id_ = ids[0];
    embed_id_ = ids[1];
    assistant_id_ = ids[2];
    tokenizer_ = std::move(tokenizer);
  }

  const Tokenizer& tokenizer() const { return *tokenizer_; }
  /// The vocabulary size with GritLM's symbols (what the model's embedding needs).
  int64_t vocab_size() const { return tokenizer_->vocab_size(); }
  int32_t user_id() const { return user_id_; }
  int32_t embed_id() const { return embed_id_; }
  int32_t assistant_id() const { return assistant_id_; }
  /// The id padding gets: the tokenizer's <pad>, else </s>, else 0. Padding is always
  /// masked (attention false, target kIgnoreIndex), so the value only has to be a valid id.
  int64_t pad_id() const {
    if (tokenizer_->pad_id() >= 0) return tokenizer_->pad_id();
    return tokenizer_->eos_id() >= 0 ? tokenizer_->eos_id() : 0;
  }

  /// Tokens before the text of an embedding sequence with this instruction: <s> and
  /// encode(embed_prefix(instruction)), computed once per distinct instruction.
  ///   format.instruction_length("")   // <s> ▁ <|embed|> -> 3
  int64_t instruction_length(std::string_view instruction) const {
    return static_cast<int64_t>(prefix_ids(instruction)->size());
  }

  /// The ids of a text to embed, cut to max_len tokens (on the right, as Hugging Face's
  /// truncation); prefix_len tokens are not pooled. Fails when the prefix leaves no token
  /// of the text (GritBatcher drops such records beforehand).
  EmbedSequence encode_embed(std::string_view instruction, std::string_view text,
                             int64_t max_len = std::numeric_limits<int64_t>::max()) const {
    EmbedSequence out;
    out.ids = *prefix_ids(instruction);
    out.prefix_len = static_cast<int64_t>(out.ids.size());
    const std::vector<int32_t> body = tokenizer_->encode(text);
    out.ids.insert(out.ids.end(), body.begin(), body.end());
    if (static_cast<int64_t>(out.ids.size()) > max_len) out.ids.resize(static_cast<size_t>(max_len));
    TORCH_CHECK(static_cast<int64_t>(out.ids.size()) > out.prefix_len, "memopt::data: GritFormat: no token of "
                "the text is left to pool (instruction prefix ", out.prefix_len, " tokens, text ", body.size(),
                " tokens, max_len ", max_len, ", text '", detail::utf8_prefix(text, 80), "'). HINT: raise the "
                "max length above the instruction's length, and pass texts that hold more than whitespace");
    return out;
  }

  /// The ids of a generative example, cut to max_len tokens on the right (the answer
  /// loses its end, and </s>, first).
  GenSequence encode_gen(std::string_view prompt, std::string_view answer,
                         int64_t max_len = std::numeric_limits<int64_t>::max()) const {
    GenSequence out;
    if (tokenizer_->bos_id() >= 0) out.ids.push_back(static_cast<int32_t>(tokenizer_->bos_id()));
    const std::vector<int32_t> user = tokenizer_->encode(gen_prefix(prompt));
    out.ids.insert(out.ids.end(), user.begin(), user.end());
    out.prompt_len = static_cast<int64_t>(out.ids.size());
    const std::vector<int32_t> body = tokenizer_->encode(detail::strip(answer, " \t\n\r\f\v"));
    out.ids.insert(out.ids.end(), body.begin(), body.end());
    if (tokenizer_->eos_id() >= 0) out.ids.push_back(static_cast<int32_t>(tokenizer_->eos_id()));
    if (static_cast<int64_t>(out.ids.size()) > max_len) out.ids.resize(static_cast<size_t>(max_len));
    return out;
  }

  /// Number of distinct instructions cached so far.
  size_t cached_instructions() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return prefix_cache_.size();
  }

 private:
  std::shared_ptr<const std::vector<int32_t>> prefix_ids(std::string_view instruction) const {
    const std::string key(detail::clean_instruction(instruction));
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (auto it = prefix_cache_.find(key); it != prefix_cache_.end()) return it->second;
    }
    auto ids = std::make_shared<std::vector<int32_t>>();
    if (tokenizer_->bos_id() >= 0) ids->push_back(static_cast<int32_t>(tokenizer_->bos_id()));
    const std::vector<int32_t> prefix = tokenizer_->encode(embed_prefix(key));
    ids->insert(ids->end(), prefix.begin(), prefix.end());
    std::lock_guard<std::mutex> lock(mutex_);
    return prefix_cache_.emplace(key, std::move(ids)).first->second;  // a racing thread's copy wins: same ids
  }

  std::shared_ptr<const Tokenizer> tokenizer_;
  int32_t user_id_ = -1, embed_id_ = -1, assistant_id_ = -1;
  mutable std::mutex mutex_;
  mutable std::unordered_map<std::string, std::shared_ptr<const std::vector<int32_t>>> prefix_cache_;
};

}  // namespace memopt::data
