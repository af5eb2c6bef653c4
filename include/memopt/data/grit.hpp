// memopt/data/grit.hpp — data for GritLM-style training (Muennighoff et al. 2024: one model,
// a contrastive embedding loss and a generative loss): a batcher that cuts length-bucketed,
// padded batches. The tokenization with the instruction prefix measured once per instruction
// is grit_format.hpp's, the records, formats and JSONL readers grit_records.hpp's (both brought
// in here); the GritLM example builds its records from a corpus itself
// (examples/03_gritlm/corpus_pairs.hpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memopt/batch.hpp>
#include <memopt/data/random.hpp>
#include <memopt/data/grit_format.hpp>
#include <memopt/data/grit_records.hpp>
#include <memopt/data/tokenizer.hpp>

namespace memopt::data {

// ---- batches ---------------------------------------------------------------------------

/// Sequences to embed, right-padded, and the positions pooled.
namespace detail {

inline torch::Tensor to_device(const torch::Tensor& t, const torch::Device& device) {
  return t.defined() ? t.to(torch::TensorOptions().device(device), /*non_blocking=*/true) : t;
}

}  // namespace detail

struct EmbedBatch {
  torch::Tensor tokens;     // (n, T) int64, padding = GritFormat::pad_id() (<pad>, else </s>, else 0)
  torch::Tensor attention;  // (n, T) bool, true = a real token (not padding)
  torch::Tensor pool;       // (n, T) bool, true = pooled: a real token outside the instruction/format prefix

  /// All tensors on `device` (non-blocking copies; undefined ones stay undefined).
  EmbedBatch to(const torch::Device& device) const {
    return {detail::to_device(tokens, device), detail::to_device(attention, device), detail::to_device(pool, device)};
  }
};

namespace detail {
inline torch::Tensor pinned(const torch::Tensor& t) { return t.defined() ? t.pin_memory() : t; }
inline int64_t count_true(const torch::Tensor& t) { return t.defined() ? t.sum().item<int64_t>() : 0; }

}  // namespace detail

/// One GritLM batch: B queries, B·G passages, Bg generative sequences.
/// Any part may be empty (undefined tensors) for embedding-only or generative-only batches.
///   memopt::data::GritBatch b = batcher.batch(step);   // b.queries.tokens (B, Tq)
struct GritBatch {
  EmbedBatch queries;   // (B, Tq)
  EmbedBatch passages;  // (B·G, Tp): rows i·G .. i·G+G−1 belong to query i; row i·G is its positive
  Batch generative;     // inputs (Bg, Tg) = seq[:-1], targets (Bg, Tg) = seq[1:], kIgnoreIndex on the
                        // user part (everything before the answer) and on padding
  int64_t group_size = 1;
  torch::Tensor generative_attention;  // (Bg, Tg) bool, true = generative.inputs holds a real token
  int64_t real_tokens = -1;            // set by GritBatcher; -1: num_tokens() counts the masks

  /// All tensors on `device` (non-blocking copies; undefined parts stay undefined).
  GritBatch to(const torch::Device& device) const {
    GritBatch out = *this;
    out.queries = queries.to(device);
    out.passages = passages.to(device);
    out.generative.inputs = detail::to_device(generative.inputs, device);
    out.generative.targets = detail::to_device(generative.targets, device);
    out.generative_attention = detail::to_device(generative_attention, device);
    return out;
  }
  /// All tensors in pinned (page-locked) host memory. Call only in CUDA builds when
  /// torch::cuda::is_available() (Prefetcher's pin_memory option checks that).
  GritBatch pin_memory() const {
    GritBatch out = *this;
    for (EmbedBatch* e : {&out.queries, &out.passages}) {
      e->tokens = detail::pinned(e->tokens);
      e->attention = detail::pinned(e->attention);
      e->pool = detail::pinned(e->pool);
    }
    out.generative.inputs = detail::pinned(generative.inputs);
    out.generative.targets = detail::pinned(generative.targets);
    out.generative_attention = detail::pinned(generative_attention);
    return out;
  }
  /// Real (non-pad) tokens of all three parts, for tokens/s (no host sync when set by the batcher).
  int64_t num_tokens() const {
    if (real_tokens >= 0) return real_tokens;
    return detail::count_true(queries.attention) + detail::count_true(passages.attention) +
           (generative_attention.defined() ? detail::count_true(generative_attention)
                                           : (generative.inputs.defined() ? generative.inputs.numel() : 0));
  }
  /// 1: the GritLM loss is already a mean (contrastive over queries, generative over targets).
  torch::Tensor num_targets() const { return torch::ones({}, torch::kLong); }
};

/// Padding of a set of batches: positions (padding included) and real tokens.
struct PaddingStats {
  int64_t positions = 0;
  int64_t tokens = 0;
  /// Pad tokens / all positions (0 when empty).
  double fraction() const { return positions == 0 ? 0.0 : 1.0 - static_cast<double>(tokens) / positions; }
  PaddingStats& operator+=(const PaddingStats& o) {
    positions += o.positions;
    tokens += o.tokens;
    return *this;
  }
};

/// The padding of one batch (all three parts).   padding_of(b).fraction()
inline PaddingStats padding_of(const GritBatch& b) {
  PaddingStats s;
  for (const EmbedBatch* e : {&b.queries, &b.passages}) {
    if (e->tokens.defined()) s.positions += e->tokens.numel();
  }
  if (b.generative.inputs.defined()) s.positions += b.generative.inputs.numel();
  s.tokens = b.num_tokens();
  return s;
}

/// Right-padded (n, T) tensors of embedding sequences (T = the longest).
inline EmbedBatch collate_embed(const std::vector<EmbedSequence>& seqs, int64_t pad_id) {
  int64_t width = 0;
  for (const auto& s : seqs) width = std::max<int64_t>(width, static_cast<int64_t>(s.ids.size()));
  const auto n = static_cast<int64_t>(seqs.size());
  EmbedBatch out;
  out.tokens = torch::full({n, width}, pad_id, torch::kLong);  // (n, T)
  out.attention = torch::zeros({n, width}, torch::kBool);      // (n, T)
  out.pool = torch::zeros({n, width}, torch::kBool);           // (n, T)
  int64_t* tokens = out.tokens.data_ptr<int64_t>();
  bool* attention = out.attention.data_ptr<bool>();
  bool* pool = out.pool.data_ptr<bool>();
  for (int64_t i = 0; i < n; ++i) {
    const auto& s = seqs[static_cast<size_t>(i)];
    for (size_t t = 0; t < s.ids.size(); ++t) {
      const int64_t at = i * width + static_cast<int64_t>(t);
      tokens[at] = s.ids[t];
      attention[at] = true;
      pool[at] = static_cast<int64_t>(t) >= s.prefix_len;
    }
  }
  return out;
}

/// Next-token inputs/targets of generative sequences: inputs = ids[:-1], targets = ids[1:],
/// kIgnoreIndex where the target is in the user part or padding; right-padded to the longest.
/// Sets `attention` (Bg, Tg) to the real input positions.
inline Batch collate_gen(const std::vector<GenSequence>& seqs, int64_t pad_id, torch::Tensor* attention = nullptr) {
  int64_t width = 0;
  for (const auto& s : seqs) width = std::max<int64_t>(width, static_cast<int64_t>(s.ids.size()) - 1);
  const auto n = static_cast<int64_t>(seqs.size());
  Batch out{torch::full({n, width}, pad_id, torch::kLong),         // inputs (Bg, Tg)
            torch::full({n, width}, kIgnoreIndex, torch::kLong)};  // targets (Bg, Tg)
  torch::Tensor real = torch::zeros({n, width}, torch::kBool);    // (Bg, Tg)
  int64_t* inputs = out.inputs.data_ptr<int64_t>();
  int64_t* targets = out.targets.data_ptr<int64_t>();
  bool* mask = real.data_ptr<bool>();
  for (int64_t i = 0; i < n; ++i) {
    const auto& s = seqs[static_cast<size_t>(i)];
    for (int64_t t = 0; t + 1 < static_cast<int64_t>(s.ids.size()); ++t) {
      const int64_t at = i * width + t;
      inputs[at] = s.ids[static_cast<size_t>(t)];
      mask[at] = true;
      if (t + 1 >= s.prompt_len) targets[at] = s.ids[static_cast<size_t>(t + 1)];
    }
  }
  if (attention != nullptr) *attention = real;
  return out;
}

/// Batch shapes, lengths and order for GritBatcher.
///   auto opts = memopt::data::GritBatcherOptions(16).group_size(4).passage_max_len(128);
struct GritBatcherOptions {
  /// B: queries per batch; also the generative batch size unless gen_batch_size is set.
  explicit GritBatcherOptions(int64_t batch_size) : batch_size_(batch_size), gen_batch_size_(batch_size) {}
  TORCH_ARG(int64_t, batch_size);
  /// Bg: generative sequences per batch.
  TORCH_ARG(int64_t, gen_batch_size);
  /// G: passages per query (the positive and G − 1 negatives drawn from the record's).
  TORCH_ARG(int64_t, group_size) = 2;
  /// Token limits (sequences are cut on the right).
  TORCH_ARG(int64_t, query_max_len) = 64;
  TORCH_ARG(int64_t, passage_max_len) = 128;
  TORCH_ARG(int64_t, gen_max_len) = 256;
  /// Character pre-filter, before tokenizing (GritLM's max_seq_len * 10): texts longer
  /// than chars_per_token × their token limit are cut to that many bytes, and records whose
  /// instruction or generative prompt is that long are dropped.
  TORCH_ARG(int64_t, chars_per_token) = 10;
  /// Length bucketing: each pool of bucket_batches × B shuffled samples is sorted by length
  /// before it is cut into batches, then the batch order is shuffled. false: plain random batches.
  TORCH_ARG(bool, bucket) = true;
  TORCH_ARG(int64_t, bucket_batches) = 16;
  /// Seed of the order and of the negatives drawn.
  TORCH_ARG(uint64_t, seed) = 1234;
};

/// What GritBatcher kept and dropped.
struct GritBatcherStats {
  int64_t embed_records = 0;             // kept
  int64_t gen_records = 0;               // kept
  int64_t dropped_long_instruction = 0;  // query (passage) instruction >= query (passage) max len in tokens,
                                         // or over chars_per_token × that in characters
  int64_t dropped_no_negatives = 0;      // group_size > 1 and the record has no negative
  int64_t dropped_long_prompt = 0;       // generative user part leaves no answer token
  int64_t truncated_texts = 0;           // texts cut by the character pre-filter
};

/// Cuts GritLM batches from contrastive and generative records (queries embedded with the
/// record's instruction, passages with passage_instruction(r)): tokenizes them when a
/// batch is built (so Prefetcher workers do the tokenization), pads, masks. batch(index)
/// is a pure function of the seed and index (thread-safe, any order), so batches are the
/// same with any number of workers. An epoch covers each record set once (a partial last
/// batch is dropped); index i takes embedding batch i mod embed_batches_per_epoch() of
/// its epoch and generative batch i mod gen_batches_per_epoch() of its own epoch, each
/// set reshuffled per epoch (as GritLM, the smaller set repeats). Length bucketing sorts by
/// characters, a close proxy of tokens: query + G × the longest passage (the record's padded
/// size), prompt + answer.
///   memopt::data::GritBatcher batcher(format, data.train.embed, data.train.gen,
///                                     memopt::data::GritBatcherOptions(8).group_size(4));
///   memopt::data::GritBatch b = batcher.batch(0);
class GritBatcher {
 public:
  GritBatcher(std::shared_ptr<const GritFormat> format, std::vector<EmbedRecord> embed, std::vector<GenRecord> gen,
              GritBatcherOptions options)
      : format_(std::move(format)), options_(std::move(options)) {
    check_options();
    filter_embed(std::move(embed));
    filter_gen(std::move(gen));
    TORCH_CHECK(!embed_.empty() || !gen_.empty(), "memopt::data: GritBatcher: no records left (",
                stats_.dropped_long_instruction, " dropped for long instructions, ", stats_.dropped_no_negatives,
                " without negatives, ", stats_.dropped_long_prompt, " for long prompts). HINT: pass records, "
                "raise the max lengths, or lower group_size");
    if (!embed_.empty()) {
      TORCH_CHECK(static_cast<int64_t>(embed_.size()) >= options_.batch_size(), "memopt::data: GritBatcher: ",
                  embed_.size(), " contrastive records, fewer than batch_size ", options_.batch_size(),
                  ". HINT: use a smaller batch_size or more records");
      embed_per_epoch_ = static_cast<int64_t>(embed_.size()) / options_.batch_size();
    }
    if (!gen_.empty()) {
      TORCH_CHECK(static_cast<int64_t>(gen_.size()) >= options_.gen_batch_size(), "memopt::data: GritBatcher: ",
                  gen_.size(), " generative records, fewer than gen_batch_size ", options_.gen_batch_size(),
                  ". HINT: use a smaller gen_batch_size or more records");
      gen_per_epoch_ = static_cast<int64_t>(gen_.size()) / options_.gen_batch_size();
    }
  }

  /// Batch `index` (>= 0): a pure function of (seed, index); safe to call from several threads.
  GritBatch batch(int64_t index) const {
    TORCH_CHECK(index >= 0, "memopt::data: GritBatcher: batch index must be >= 0 (got ", index,
                "). HINT: count batches from 0");
    GritBatch out;
    out.group_size = options_.group_size();
    const int64_t pad = format_->pad_id();
    int64_t real = 0;
    if (embed_per_epoch_ > 0) {
      const int64_t epoch = index / embed_per_epoch_, b = index % embed_per_epoch_;
      const auto order = plan(Kind::kEmbed, epoch);
      std::vector<EmbedSequence> queries, passages;
      for (int64_t r = 0; r < options_.batch_size(); ++r) {
        const size_t k = static_cast<size_t>((*order)[static_cast<size_t>(b * options_.batch_size() + r)]);
        add_embed(k, epoch, queries, passages);
      }
      out.queries = collate_embed(queries, pad);
      out.passages = collate_embed(passages, pad);
      for (const auto* seqs : {&queries, &passages}) {
        for (const auto& s : *seqs) real += static_cast<int64_t>(s.ids.size());
      }
    }
    if (gen_per_epoch_ > 0) {
      const int64_t epoch = index / gen_per_epoch_, b = index % gen_per_epoch_;
      const auto order = plan(Kind::kGen, epoch);
      std::vector<GenSequence> seqs;
      for (int64_t r = 0; r < options_.gen_batch_size(); ++r) {
        const GenRecord& g = gen_[static_cast<size_t>((*order)[static_cast<size_t>(b * options_.gen_batch_size() + r)])];
        seqs.push_back(format_->encode_gen(g.prompt, cut(g.answer, options_.gen_max_len()), options_.gen_max_len()));
        real += static_cast<int64_t>(seqs.back().ids.size()) - 1;
      }
      out.generative = collate_gen(seqs, pad, &out.generative_attention);
    }
    out.real_tokens = real;
    return out;
  }

  /// The padding of batches [first, first + count) (builds them).
  ///   batcher.padding(0, 50).fraction()   // e.g. 0.31 plain, 0.06 bucketed
  PaddingStats padding(int64_t first, int64_t count) const {
    PaddingStats s;
    for (int64_t i = first; i < first + count; ++i) s += padding_of(batch(i));
    return s;
  }

  int64_t embed_batches_per_epoch() const { return embed_per_epoch_; }
  int64_t gen_batches_per_epoch() const { return gen_per_epoch_; }
  /// Batches until both record sets were seen once: the larger of the two.
  int64_t batches_per_epoch() const { return std::max(embed_per_epoch_, gen_per_epoch_); }
  const GritBatcherStats& stats() const { return stats_; }
  const GritBatcherOptions& options() const { return options_; }
  const GritFormat& format() const { return *format_; }
  const std::vector<EmbedRecord>& embed_records() const { return embed_; }
  const std::vector<GenRecord>& gen_records() const { return gen_; }

 private:
  enum class Kind : uint64_t { kEmbed = 1, kGen = 2 };

  void check_options() const {
    TORCH_CHECK(format_ != nullptr, "memopt::data: GritBatcher: the format is null. HINT: pass "
                "std::make_shared<memopt::data::GritFormat>(tokenizer)");
    const auto& o = options_;
    TORCH_CHECK(o.batch_size() >= 1 && o.gen_batch_size() >= 1 && o.group_size() >= 1,
                "memopt::data: GritBatcher: batch_size, gen_batch_size and group_size must be >= 1 (got ",
                o.batch_size(), ", ", o.gen_batch_size(), ", ", o.group_size(),
                "). HINT: e.g. GritBatcherOptions(8).group_size(2)");
    TORCH_CHECK(o.query_max_len() >= 2 && o.passage_max_len() >= 2 && o.gen_max_len() >= 2,
                "memopt::data: GritBatcher: query_max_len, passage_max_len and gen_max_len must be >= 2 (got ",
                o.query_max_len(), ", ", o.passage_max_len(), ", ", o.gen_max_len(),
                "). HINT: they are token limits; GritLM uses 256 / 2048 / 2048");
    TORCH_CHECK(o.chars_per_token() >= 1 && o.bucket_batches() >= 1, "memopt::data: GritBatcher: "
                "chars_per_token and bucket_batches must be >= 1 (got ", o.chars_per_token(), ", ",
                o.bucket_batches(), "). HINT: keep the defaults (10, 16)");
  }

  int64_t char_limit(int64_t max_len) const { return max_len * options_.chars_per_token(); }
  std::string_view cut(std::string_view text, int64_t max_len) const {
    return detail::utf8_prefix(text, static_cast<size_t>(char_limit(max_len)));
  }

  /// An instruction whose prefix leaves no token for the text (or is over the character limit).
  bool too_long(std::string_view instruction, int64_t max_len) const {
    const std::string_view clean = detail::clean_instruction(instruction);
    return static_cast<int64_t>(clean.size()) > char_limit(max_len) || format_->instruction_length(clean) >= max_len;
  }

  void filter_embed(std::vector<EmbedRecord> records) {
    for (auto& r : records) {
      if (too_long(r.instruction, options_.query_max_len()) ||
          too_long(passage_instruction(r), options_.passage_max_len())) {
        ++stats_.dropped_long_instruction;  // as GritLM's filter_too_long_instructions
        continue;
      }
      if (options_.group_size() > 1 && r.neg.empty()) {
        ++stats_.dropped_no_negatives;
        continue;
      }
      stats_.truncated_texts += static_cast<int64_t>(r.query.size()) > char_limit(options_.query_max_len());
      stats_.truncated_texts += static_cast<int64_t>(r.pos.size()) > char_limit(options_.passage_max_len());
      for (const auto& n : r.neg) {
        stats_.truncated_texts += static_cast<int64_t>(n.size()) > char_limit(options_.passage_max_len());
      }
      embed_.push_back(std::move(r));
    }
    stats_.embed_records = static_cast<int64_t>(embed_.size());
    // Bucketing key: the record's size once padded, query + G × its longest passage (characters,
    // cut as the pre-filter cuts them), so batches group records of similar padded cost.
    embed_key_.reserve(embed_.size());
    const int64_t query_cap = char_limit(options_.query_max_len()), passage_cap = char_limit(options_.passage_max_len());
    for (const auto& r : embed_) {
      int64_t longest = std::min<int64_t>(static_cast<int64_t>(r.pos.size()), passage_cap);
      for (const auto& n : r.neg) longest = std::max(longest, std::min<int64_t>(static_cast<int64_t>(n.size()), passage_cap));
      embed_key_.push_back(std::min<int64_t>(static_cast<int64_t>(r.query.size()), query_cap) +
                           options_.group_size() * longest);
    }
  }

  void filter_gen(std::vector<GenRecord> records) {
    for (auto& r : records) {
      // A prompt of c bytes is at most c + 2 tokens beside its symbols: tokenize only when it may not fit.
      bool too_long = static_cast<int64_t>(r.prompt.size()) > char_limit(options_.gen_max_len());
      if (!too_long && static_cast<int64_t>(r.prompt.size()) + 8 >= options_.gen_max_len()) {
        too_long = format_->encode_gen(r.prompt, "").prompt_len >= options_.gen_max_len();
      }
      if (too_long) {
        ++stats_.dropped_long_prompt;
        continue;
      }
      stats_.truncated_texts += static_cast<int64_t>(r.answer.size()) > char_limit(options_.gen_max_len());
      gen_.push_back(std::move(r));
    }
    stats_.gen_records = static_cast<int64_t>(gen_.size());
    gen_key_.reserve(gen_.size());
    for (const auto& r : gen_) {
      gen_key_.push_back(static_cast<int64_t>(r.prompt.size()) +
                         std::min<int64_t>(static_cast<int64_t>(r.answer.size()), char_limit(options_.gen_max_len())));
    }
  }

  /// Query k and its G passages (positive first, then G − 1 negatives drawn for this epoch).
  void add_embed(size_t k, int64_t epoch, std::vector<EmbedSequence>& queries,
                 std::vector<EmbedSequence>& passages) const {
    const EmbedRecord& r = embed_[k];
    queries.push_back(format_->encode_embed(r.instruction, cut(r.query, options_.query_max_len()),
                                            options_.query_max_len()));
    passages.push_back(format_->encode_embed(passage_instruction(r), cut(r.pos, options_.passage_max_len()),
                                             options_.passage_max_len()));
    const auto need = static_cast<size_t>(options_.group_size() - 1);
    if (need == 0) return;
    // As GritLM: G − 1 distinct negatives, repeating the list when it is shorter.
    std::vector<size_t> pick;
    const size_t copies = (need + r.neg.size() - 1) / r.neg.size();
    for (size_t c = 0; c < copies; ++c) {
      for (size_t j = 0; j < r.neg.size(); ++j) pick.push_back(j);
    }
    Rng rng(mix_seed({options_.seed(), 3, static_cast<uint64_t>(epoch), k}));
    for (size_t j = 0; j < need; ++j) std::swap(pick[j], pick[j + uniform_below(rng, pick.size() - j)]);
    for (size_t j = 0; j < need; ++j) {
      passages.push_back(format_->encode_embed(passage_instruction(r), cut(r.neg[pick[j]], options_.passage_max_len()),
                                               options_.passage_max_len()));
    }
  }

  /// The record order of one epoch: batch b is order[b·B, (b+1)·B).
  std::shared_ptr<const std::vector<int64_t>> plan(Kind kind, int64_t epoch) const {
    const uint64_t key = (static_cast<uint64_t>(epoch) << 2) | static_cast<uint64_t>(kind);
    {
      std::lock_guard<std::mutex> lock(plan_mutex_);
      if (auto it = plans_.find(key); it != plans_.end()) return it->second;
    }
    const bool is_embed = kind == Kind::kEmbed;
    const auto& keys = is_embed ? embed_key_ : gen_key_;
    const int64_t batch = is_embed ? options_.batch_size() : options_.gen_batch_size();
    const int64_t batches = is_embed ? embed_per_epoch_ : gen_per_epoch_;
    Rng rng(mix_seed({options_.seed(), static_cast<uint64_t>(kind), static_cast<uint64_t>(epoch)}));
    std::vector<int64_t> order(keys.size());
    std::iota(order.begin(), order.end(), int64_t{0});
    shuffle(rng, order);
    order.resize(static_cast<size_t>(batches * batch));  // drop the partial last batch
    if (options_.bucket()) {
      const int64_t pool = options_.bucket_batches() * batch;
      for (int64_t begin = 0; begin < static_cast<int64_t>(order.size()); begin += pool) {
        const auto first = order.begin() + begin;
        const auto last = order.begin() + std::min<int64_t>(begin + pool, static_cast<int64_t>(order.size()));
        std::stable_sort(first, last, [&](int64_t a, int64_t b) { return keys[a] < keys[b]; });
      }
      std::vector<int64_t> batch_order(static_cast<size_t>(batches));
      std::iota(batch_order.begin(), batch_order.end(), int64_t{0});
      shuffle(rng, batch_order);
      std::vector<int64_t> shuffled;
      shuffled.reserve(order.size());
      for (int64_t b : batch_order) {
        shuffled.insert(shuffled.end(), order.begin() + b * batch, order.begin() + (b + 1) * batch);
      }
      order = std::move(shuffled);
    }
    auto result = std::make_shared<const std::vector<int64_t>>(std::move(order));
    std::lock_guard<std::mutex> lock(plan_mutex_);
    if (plans_.size() >= 4) plans_.erase(plans_.begin());  // keep a few epochs (workers straddle one boundary)
    return plans_.emplace(key, std::move(result)).first->second;
  }

  std::shared_ptr<const GritFormat> format_;
  GritBatcherOptions options_;
  GritBatcherStats stats_;
  std::vector<EmbedRecord> embed_;
  std::vector<GenRecord> gen_;
  std::vector<int64_t> embed_key_, gen_key_;  // bucketing keys, in characters
  int64_t embed_per_epoch_ = 0, gen_per_epoch_ = 0;
  mutable std::mutex plan_mutex_;
  mutable std::map<uint64_t, std::shared_ptr<const std::vector<int64_t>>> plans_;
};

}  // namespace memopt::data
