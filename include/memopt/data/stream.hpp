// memopt/data/stream.hpp — language-model batches streamed from text, JSONL or token
// shards (memopt/data/source.hpp) in constant memory, whatever the corpus size:
//
//   DocumentReader --blocks of documents--> workers tokenize (SentencePiece, in parallel,
//   in order) --> packing (fixed windows, EOS between documents) or per-document rows
//   (padded, masked) --> shuffle buffer (seeded) --> batches (B, T)
//
// What is held: the prefetch queue (`prefetch` blocks of at most `block_documents`
// documents), the packing tail, the shuffle buffer (`shuffle_buffer` rows of T + 1 ids) and
// the look-ahead batches. The result does not depend on the number of workers.
//
// state()/load_state() capture all of it (the reader's position, the packing tail, the
// buffer's rows and generator), so a run resumed from a training checkpoint sees exactly
// the batches the uninterrupted run would have seen (a ResumableSource for the Trainer).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <memopt/batch.hpp>
#include <memopt/data/prefetch.hpp>
#include <memopt/data/random.hpp>
#include <memopt/data/source.hpp>
#include <memopt/data/tokenizer.hpp>

namespace memopt::data {

/// How documents become rows of T + 1 ids.
enum class Packing {
  kPack,  // documents concatenated with EOS after each, cut into windows of T + 1 every `stride` ids
  kPad,   // each document (+ EOS) on rows of its own, T + 1 ids every T ids; short rows padded,
          // padding masked out of the loss (targets kIgnoreIndex)
};

/// Everything a StreamLoader does, besides its sources and tokenizer.
///   auto opts = memopt::data::StreamOptions(8, 256).shuffle_buffer(1000).seed(42).epochs(0);
struct StreamOptions {
  StreamOptions(int64_t batch_size, int64_t seq_len) : batch_size_(batch_size), seq_len_(seq_len) {}
  /// B: rows per batch.
  TORCH_ARG(int64_t, batch_size);
  /// T: tokens per input row (each row holds T + 1 ids: inputs and targets shifted by one).
  TORCH_ARG(int64_t, seq_len);
  /// kPack: ids between the starts of consecutive windows; 0: seq_len (no id is an input twice).
  TORCH_ARG(int64_t, stride) = 0;
  TORCH_ARG(Packing, packing) = Packing::kPack;
  /// Rows held and drawn from at random; 1: the order they are made in.
  TORCH_ARG(int64_t, shuffle_buffer) = 1000;
  /// Seed of the shuffle buffer and of the file order (SourceOptions::seed is set from it).
  TORCH_ARG(uint64_t, seed) = 1234;
  /// Tokenizer threads; 0: documents are read and tokenized inside next().
  TORCH_ARG(int64_t, workers) = 1;
  /// Blocks read ahead (and being tokenized).
  TORCH_ARG(int64_t, prefetch) = 4;
  /// Documents per block (a block also ends after 1 MiB of text).
  TORCH_ARG(int64_t, block_documents) = 256;
  /// Pin each batch (CUDA builds with a GPU).
  TORCH_ARG(bool, pin_memory) = false;
  /// Reading: text field, split, epochs, max_examples, rank / world_size, ...
  TORCH_ARG(SourceOptions, source) = SourceOptions();
  /// > 0: every id must be below it (a shard written for a larger vocabulary is an error).
  TORCH_ARG(int64_t, vocab_size) = 0;
};

/// What the data costs in memory, two ways.
/// memopt's (bytes): a whole tokenized dataset held as int64 input and target tensors, versus
/// a stream holding its shuffle buffer (int32 rows of T + 1), prefetched batches and their
/// int64 tensors.
/// The seed's own (streaming_data_loader.py's estimate_memory_usage, its keys and counting):
/// input + target at 4 bytes a token, every sequence (full_load_mb) against one batch
/// (streaming_mb), in MiB, and the saving as a percentage string ("99.97%").
struct DataMemoryEstimate {
  int64_t full_load_bytes = 0;
  int64_t streaming_bytes = 0;
  double full_load_mb = 0;
  double streaming_mb = 0;
  std::string memory_savings;
  double ratio() const { return static_cast<double>(full_load_bytes) / static_cast<double>(std::max<int64_t>(streaming_bytes, 1)); }
};

///   auto e = memopt::data::estimate_memory_usage(100'000, 128, 32);
///   // e.full_load_mb 97.66, e.streaming_mb 0.03, e.memory_savings "99.97%" (the seed's figures);
///   // e.full_load_bytes 204.8 MB, e.streaming_bytes 1.3 MB (memopt's, shuffle buffer 1000)
inline DataMemoryEstimate estimate_memory_usage(int64_t num_sequences, int64_t seq_len, int64_t batch_size,
                                                int64_t shuffle_buffer = 1000, int64_t prefetch_batches = 4) {
  TORCH_CHECK(num_sequences >= 0 && seq_len >= 1 && batch_size >= 1 && shuffle_buffer >= 1 && prefetch_batches >= 0,
              "memopt::data::estimate_memory_usage: need num_sequences >= 0, seq_len >= 1, batch_size >= 1, "
              "shuffle_buffer >= 1, prefetch_batches >= 0 (got ", num_sequences, ", ", seq_len, ", ", batch_size, ", ",
              shuffle_buffer, ", ", prefetch_batches, "). HINT: pass the dataset's sequence count and the batch shape");
  DataMemoryEstimate e;
  const int64_t row_tensors = 2 * seq_len * 8;  // inputs + targets, int64
  e.full_load_bytes = num_sequences * row_tensors;
  e.streaming_bytes = shuffle_buffer * (seq_len + 1) * 4 + (prefetch_batches + 1) * batch_size * row_tensors;
  const double row_seed = 2.0 * static_cast<double>(seq_len) * 4 / (1024.0 * 1024.0);  // input + target, int32, MiB
  e.full_load_mb = static_cast<double>(num_sequences) * row_seed;
  e.streaming_mb = static_cast<double>(batch_size) * row_seed;
  const double saved = e.full_load_mb > 0 ? 100.0 * (1.0 - e.streaming_mb / e.full_load_mb) : 0.0;
  e.memory_savings = fmt::format("{:.2f}%", saved);
  return e;
}

/// Every document of `files` tokenized into one id vector, EOS after each text document (a
/// pretokenized shard chunk is taken as it is): the "load it whole" way, for corpora that fit
/// in memory and as the baseline a stream is measured against. One pass (epochs and rank
/// sharding of `options` apply).
///   auto ids = memopt::data::load_tokens(memopt::data::resolve_sources({"corpus"}), tok, {});
inline std::vector<int32_t> load_tokens(std::vector<SourceFile> files, const Tokenizer* tokenizer,
                                        SourceOptions options) {
  DocumentReader reader(std::move(files), options.epochs(options.epochs() == 0 ? 1 : options.epochs()));
  std::vector<int32_t> ids;
  RawDocument doc;
  while (reader.next(doc)) {
    if (doc.pretokenized) {
      ids.insert(ids.end(), doc.tokens.begin(), doc.tokens.end());
      continue;
    }
    TORCH_CHECK(tokenizer != nullptr, "memopt::data::load_tokens: '", reader.files().front().path, "' holds text and "
                "no tokenizer was given. HINT: pass the Tokenizer");
    const auto part = tokenizer->encode(doc.text);
    ids.insert(ids.end(), part.begin(), part.end());
    ids.push_back(static_cast<int32_t>(tokenizer->eos_id()));
  }
  return ids;
}

/// A stream of language-model batches (see the top of this file). Deterministic for a seed;
/// epochs(0) streams without end. Implements has_next(n) so the Trainer stops cleanly when
/// a finite stream runs out.
///   auto tok = std::make_shared<const memopt::data::Tokenizer>("data/kjv/tokenizer.model");
///   memopt::data::StreamLoader loader({"corpus/*.jsonl"}, tok, memopt::data::StreamOptions(8, 256));
///   memopt::Batch batch = loader.next();   // inputs, targets: (8, 256) int64
class StreamLoader {
 public:
  StreamLoader(const std::vector<std::string>& sources, std::shared_ptr<const Tokenizer> tokenizer,
               StreamOptions options)
      : StreamLoader(resolve_sources(sources), std::move(tokenizer), std::move(options)) {}

  StreamLoader(std::vector<SourceFile> files, std::shared_ptr<const Tokenizer> tokenizer, StreamOptions options)
      : tokenizer_(std::move(tokenizer)), options_(std::move(options)) {
    const int64_t B = options_.batch_size(), T = options_.seq_len();
    TORCH_CHECK(B >= 1, "memopt::data::StreamLoader: batch_size must be >= 1 (got ", B, "). HINT: StreamOptions(batch_size, seq_len)");
    TORCH_CHECK(T >= 1, "memopt::data::StreamLoader: seq_len must be >= 1 (got ", T, "). HINT: StreamOptions(batch_size, seq_len)");
    TORCH_CHECK(options_.stride() >= 0, "memopt::data::StreamLoader: stride must be >= 0 (got ", options_.stride(),
                "). HINT: 0 means seq_len: windows that share no input");
    TORCH_CHECK(options_.shuffle_buffer() >= 1, "memopt::data::StreamLoader: shuffle_buffer must be >= 1 (got ",
                options_.shuffle_buffer(), "). HINT: 1 keeps the order the rows are made in");
    TORCH_CHECK(options_.workers() >= 0 && options_.prefetch() >= 1 && options_.block_documents() >= 1,
                "memopt::data::StreamLoader: need workers >= 0, prefetch >= 1, block_documents >= 1 (got ",
                options_.workers(), ", ", options_.prefetch(), ", ", options_.block_documents(), "). HINT: workers 0-2, prefetch 4 "
                "and block_documents 256 suit most corpora");
    stride_ = options_.stride() > 0 ? options_.stride() : T;
    options_.source().seed(options_.seed());
    const bool needs_tokenizer = std::any_of(files.begin(), files.end(), [](const SourceFile& f) { return f.kind != SourceKind::kShard; });
    TORCH_CHECK(tokenizer_ != nullptr || !needs_tokenizer, "memopt::data::StreamLoader: '",
                std::find_if(files.begin(), files.end(), [](const SourceFile& f) { return f.kind != SourceKind::kShard; })->path,
                "' is text and no tokenizer was given. HINT: pass the Tokenizer, or pre-tokenize with memopt-pretokenize");
    if (tokenizer_) {
      eos_ = static_cast<int32_t>(tokenizer_->eos_id());
      pad_ = static_cast<int32_t>(tokenizer_->pad_id() >= 0 ? tokenizer_->pad_id() : tokenizer_->eos_id());
      TORCH_CHECK(eos_ >= 0 || !needs_tokenizer, "memopt::data::StreamLoader: tokenizer '", tokenizer_->path(),
                  "' has no EOS piece: documents could not be separated. HINT: train it with eos_id >= 0");
      if (options_.vocab_size() == 0) options_.vocab_size(tokenizer_->vocab_size());
    }
    rng_.seed(options_.seed());
    shared_ = std::make_shared<Shared>(std::move(files), options_.source());
    position_ = shared_->reader.position();
    start_workers();
  }

  ~StreamLoader() { stop_workers(); }
  StreamLoader(const StreamLoader&) = delete;
  StreamLoader& operator=(const StreamLoader&) = delete;

  /// Whether at least `n` more batches come (reads ahead to know; never false with epochs(0)).
  bool has_next(int64_t n = 1) {
    while (static_cast<int64_t>(ready_.size()) < n) {
      std::vector<std::vector<int32_t>> rows;
      rows.reserve(static_cast<size_t>(options_.batch_size()));
      while (static_cast<int64_t>(rows.size()) < options_.batch_size()) {
        auto row = next_row();
        if (!row) return false;  // the stream ended: a last partial batch is dropped
        rows.push_back(std::move(*row));
      }
      ready_.push_back(std::move(rows));
    }
    return true;
  }

  /// The next batch: inputs and targets (B, T) int64.
  Batch next() {
    TORCH_CHECK(has_next(1), "memopt::data::StreamLoader: the stream ended after ", batches_, " batches (",
                options_.source().epochs(), " epoch(s) of ", shared_->reader.files().size(), " file(s)). HINT: ",
                "raise epochs (0 streams without end) or train for fewer steps");
    auto rows = std::move(ready_.front());
    ready_.pop_front();
    ++batches_;
    Batch batch = collate(rows);
    if (options_.pin_memory() && torch::cuda::is_available()) return {batch.inputs.pin_memory(), batch.targets.pin_memory()};
    return batch;
  }

  /// The position, for a training checkpoint: the reader's position after the blocks taken,
  /// the packing tail, the rows made and not yet handed out, the shuffle generator.
  nlohmann::json state() const {
    std::ostringstream rng;
    rng << rng_;
    nlohmann::json lookahead = nlohmann::json::array();
    for (const auto& rows : ready_) lookahead.push_back(rows);
    return {{"kind", "StreamLoader"},
            {"files", static_cast<int64_t>(shared_->reader.files().size())},
            {"first_file", shared_->reader.files().front().path},
            {"batch_size", options_.batch_size()},
            {"seq_len", options_.seq_len()},
            {"stride", stride_},
            {"packing", options_.packing() == Packing::kPack ? "pack" : "pad"},
            {"shuffle_buffer", options_.shuffle_buffer()},
            {"seed", options_.seed()},
            {"rank", options_.source().rank()},
            {"world_size", options_.source().world_size()},
            {"position", position_.to_json()},
            {"source_done", source_done_},
            {"pending", std::vector<int32_t>(pending_.begin() + static_cast<std::ptrdiff_t>(cursor_), pending_.end())},
            {"staged", staged_},
            {"buffer", buffer_},
            {"lookahead", lookahead},
            {"rng", rng.str()},
            {"batches", batches_}};
  }

  /// Continues from state(): the next batch is the one the saving loader would have given.
  /// Refuses a state of other sources, shape, seed or rank, naming the field.
  void load_state(const nlohmann::json& state) {
    const auto now = this->state();
    for (const char* key : {"kind", "files", "first_file", "batch_size", "seq_len", "stride", "packing",
                            "shuffle_buffer", "seed", "rank", "world_size"}) {
      TORCH_CHECK(state.is_object() && state.contains(key) && state[key] == now[key],
                  "memopt::data::StreamLoader::load_state: \"", key, "\" is ",
                  state.is_object() && state.contains(key) ? state[key].dump() : std::string("missing"),
                  " in the checkpoint, ", now[key].dump(), " now. HINT: resume with the data sources, batch shape, "
                  "seed and ranks of the run that saved it");
    }
    std::istringstream rng(state.value("rng", std::string()));
    Rng restored;
    rng >> restored;
    TORCH_CHECK(!rng.fail(), "memopt::data::StreamLoader::load_state: \"rng\" is not a generator state. HINT: the "
                "checkpoint's state.json is damaged");
    const auto rows = [&](const char* key) {
      try {
        return state.at(key).get<std::vector<std::vector<int32_t>>>();
      } catch (const nlohmann::json::exception&) {
        TORCH_CHECK(false, "memopt::data::StreamLoader::load_state: \"", key, "\" is not a list of id rows. HINT: "
                    "the checkpoint's state.json is damaged");
      }
    };
    auto staged = rows("staged");
    auto buffer = rows("buffer");
    auto lookahead_rows = state.contains("lookahead") && state["lookahead"].is_array() ? state["lookahead"]
                                                                                        : nlohmann::json::array();
    std::deque<std::vector<std::vector<int32_t>>> lookahead;
    for (const auto& batch : lookahead_rows) lookahead.push_back(batch.get<std::vector<std::vector<int32_t>>>());
    const SourcePosition position = SourcePosition::from_json(state.at("position"));
    auto pending = state.contains("pending") && state["pending"].is_array() ? state["pending"].get<std::vector<int32_t>>()
                                                                            : std::vector<int32_t>();

    stop_workers();
    shared_->reader.seek(position);
    position_ = position;
    source_done_ = state.value("source_done", false);
    pending_ = std::move(pending);
    cursor_ = 0;
    staged_.assign(staged.begin(), staged.end());
    buffer_ = std::move(buffer);
    ready_ = std::move(lookahead);
    rng_ = restored;
    batches_ = state.value("batches", int64_t{0});
    start_workers();
  }

  /// Batches handed out.
  int64_t batches_drawn() const { return batches_; }
  /// The reader's position after the documents taken so far (epoch, file, offset).
  const SourcePosition& position() const { return position_; }
  const StreamOptions& options() const { return options_; }
  const std::vector<SourceFile>& files() const { return shared_->reader.files(); }

 private:
  // Documents read together and tokenized by one worker; `end` is the reader's position after them.
  struct Block {
    std::vector<std::vector<int32_t>> documents;  // ids, EOS appended to text documents
    SourcePosition end;
    bool last = false;  // the reader is finished: no document after these
  };

  // What the workers share: the reader, taken in block order (turn).
  struct Shared {
    Shared(std::vector<SourceFile> files, SourceOptions options) : reader(std::move(files), std::move(options)) {}
    DocumentReader reader;
    std::mutex mutex;
    std::condition_variable turn_cv;
    int64_t turn = 0;
  };

  void start_workers() {
    shared_->turn = 0;
    auto shared = shared_;
    auto tokenizer = tokenizer_;
    const int64_t block_documents = options_.block_documents(), vocab = options_.vocab_size();
    const int32_t eos = eos_;
    auto produce = [shared, tokenizer, block_documents, vocab, eos](int64_t index) {
      std::vector<RawDocument> raw;
      Block block;
      {
        std::unique_lock<std::mutex> lock(shared->mutex);
        shared->turn_cv.wait(lock, [&] { return shared->turn == index; });
        struct NextTurn {  // the next block may read, also when this one throws
          Shared& s;
          ~NextTurn() {
            ++s.turn;
            s.turn_cv.notify_all();
          }
        } next_turn{*shared};
        int64_t bytes = 0;
        RawDocument doc;
        while (static_cast<int64_t>(raw.size()) < block_documents && bytes < (int64_t{1} << 20) && shared->reader.next(doc)) {
          bytes += static_cast<int64_t>(doc.text.size() + doc.tokens.size() * 4);
          raw.push_back(std::move(doc));
        }
        block.end = shared->reader.position();
        block.last = shared->reader.finished();
      }
      block.documents.reserve(raw.size());
      for (auto& d : raw) {
        if (d.pretokenized) {
          for (const int32_t id : d.tokens) {
            TORCH_CHECK(vocab == 0 || id < vocab, "memopt::data::StreamLoader: a token shard holds id ", id,
                        ", >= the vocabulary size ", vocab, ". HINT: pre-tokenize with the model's tokenizer");
          }
          block.documents.push_back(std::move(d.tokens));
        } else {
          std::vector<int32_t> ids = tokenizer->encode(d.text);
          ids.push_back(eos);
          block.documents.push_back(std::move(ids));
        }
      }
      return block;
    };
    prefetch_ = std::make_unique<Prefetcher<Block>>(
        std::move(produce), PrefetchOptions().workers(options_.workers()).depth(options_.prefetch()));
  }

  void stop_workers() { prefetch_.reset(); }

  // Takes the next block's documents into the packing tail (kPack) or as rows (kPad).
  bool pull_block() {
    if (source_done_) return false;
    Block block = prefetch_->next();
    position_ = block.end;
    source_done_ = block.last;
    const int64_t row = options_.seq_len() + 1;
    for (auto& doc : block.documents) {
      if (options_.packing() == Packing::kPack) {
        pending_.insert(pending_.end(), doc.begin(), doc.end());
        continue;
      }
      // Rows of T + 1 ids every T ids (each id is a target once), at least 2 ids each.
      for (size_t start = 0; start + 1 < doc.size(); start += static_cast<size_t>(row - 1)) {
        const size_t end = std::min(doc.size(), start + static_cast<size_t>(row));
        staged_.emplace_back(doc.begin() + static_cast<std::ptrdiff_t>(start), doc.begin() + static_cast<std::ptrdiff_t>(end));
      }
    }
    return true;
  }

  // The next row in making order, before the shuffle buffer.
  std::optional<std::vector<int32_t>> make_row() {
    const auto row = static_cast<size_t>(options_.seq_len() + 1);
    if (options_.packing() == Packing::kPack) {
      while (pending_.size() - cursor_ < row) {
        if (!pull_block()) return std::nullopt;  // the tail shorter than a row is dropped
      }
      std::vector<int32_t> out(pending_.begin() + static_cast<std::ptrdiff_t>(cursor_),
                               pending_.begin() + static_cast<std::ptrdiff_t>(cursor_ + row));
      cursor_ += static_cast<size_t>(stride_);
      if (cursor_ >= pending_.size()) {
        pending_.clear();
        cursor_ = 0;
      } else if (cursor_ >= (size_t{1} << 16)) {
        pending_.erase(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(cursor_));
        cursor_ = 0;
      }
      return out;
    }
    while (staged_.empty()) {
      if (!pull_block()) return std::nullopt;
    }
    std::vector<int32_t> out = std::move(staged_.front());
    staged_.pop_front();
    return out;
  }

  // The next row out of the shuffle buffer: a random one of the buffer, replaced by the next made.
  std::optional<std::vector<int32_t>> next_row() {
    while (static_cast<int64_t>(buffer_.size()) < options_.shuffle_buffer()) {
      auto row = make_row();
      if (!row) break;
      buffer_.push_back(std::move(*row));
    }
    if (buffer_.empty()) return std::nullopt;
    const auto j = static_cast<size_t>(uniform_below(rng_, buffer_.size()));
    std::vector<int32_t> out = std::move(buffer_[j]);
    if (auto row = make_row()) {
      buffer_[j] = std::move(*row);
    } else {
      buffer_[j] = std::move(buffer_.back());
      buffer_.pop_back();
    }
    return out;
  }

  Batch collate(const std::vector<std::vector<int32_t>>& rows) const {
    const int64_t B = static_cast<int64_t>(rows.size()), T = options_.seq_len();
    torch::Tensor inputs = torch::full({B, T}, pad_, torch::kLong);           // (B, T)
    torch::Tensor targets = torch::full({B, T}, kIgnoreIndex, torch::kLong);  // (B, T)
    int64_t* in = inputs.data_ptr<int64_t>();
    int64_t* tg = targets.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      const auto& row = rows[static_cast<size_t>(b)];
      const int64_t n = static_cast<int64_t>(row.size()) - 1;  // kPack: T; kPad: 1 .. T
      for (int64_t t = 0; t < n; ++t) {
        in[b * T + t] = row[static_cast<size_t>(t)];
        tg[b * T + t] = row[static_cast<size_t>(t + 1)];
      }
    }
    return {inputs, targets};
  }

  std::shared_ptr<const Tokenizer> tokenizer_;
  StreamOptions options_;
  int64_t stride_ = 0;
  int32_t eos_ = -1, pad_ = 0;
  std::shared_ptr<Shared> shared_;
  std::unique_ptr<Prefetcher<Block>> prefetch_;
  SourcePosition position_;  // the reader's position after the blocks taken
  bool source_done_ = false;
  std::vector<int32_t> pending_;  // kPack: ids not yet fully cut into rows, from cursor_
  size_t cursor_ = 0;
  std::deque<std::vector<int32_t>> staged_;  // kPad: rows made, not yet in the buffer
  std::vector<std::vector<int32_t>> buffer_;  // the shuffle buffer
  std::deque<std::vector<std::vector<int32_t>>> ready_;  // batches made by has_next(), not yet handed out
  Rng rng_;
  int64_t batches_ = 0;
};

}  // namespace memopt::data
