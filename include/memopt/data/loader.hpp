// memopt/data/loader.hpp — language-model batches from a TokenShard: random windows for
// training (own seeded data::Rng, data/random.hpp, so a run is reproducible whatever torch's RNG or
// thread count, and resumable with skip()) and sequential, non-overlapping windows for
// evaluation. Each batch is a memopt::Batch: inputs (B, T) and targets (B, T) = inputs
// shifted left by one token.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <utility>

#include <nlohmann/json.hpp>

#include <torch/torch.h>

#include <memopt/batch.hpp>
#include <memopt/data/random.hpp>
#include <memopt/data/shard.hpp>
#include <memopt/data/source.hpp>

namespace memopt::data {

/// Shape and seed of the batches a loader draws.
///   auto opts = memopt::data::LoaderOptions(8, 256).seed(42);   // B = 8, T = 256
struct LoaderOptions {
  LoaderOptions(int64_t batch_size, int64_t seq_len) : batch_size_(batch_size), seq_len_(seq_len) {}
  /// B: windows per batch.
  TORCH_ARG(int64_t, batch_size);
  /// T: tokens per input row (each window reads T + 1 tokens).
  TORCH_ARG(int64_t, seq_len);
  /// Seed of RandomWindowLoader's data::Rng (std::mt19937_64).
  TORCH_ARG(uint64_t, seed) = 1234;
  /// SequentialLoader only: drop the last batch when it holds fewer than B windows.
  TORCH_ARG(bool, drop_last) = false;
};

namespace detail {

inline void check_loader(const char* who, const std::shared_ptr<const TokenShard>& shard,
                         const LoaderOptions& options) {
  TORCH_CHECK(shard != nullptr, "memopt::data: ", who,
              ": the shard is null. HINT: pass memopt::data::TokenShard::open(path)");
  TORCH_CHECK(options.batch_size() >= 1, "memopt::data: ", who, ": batch_size must be >= 1 (got ",
              options.batch_size(), ") for shard '", shard->path(),
              "'. HINT: pass LoaderOptions(batch_size, seq_len) with batch_size >= 1");
  TORCH_CHECK(options.seq_len() >= 1, "memopt::data: ", who, ": seq_len must be >= 1 (got ",
              options.seq_len(), ") for shard '", shard->path(),
              "'. HINT: pass LoaderOptions(batch_size, seq_len) with seq_len >= 1");
  TORCH_CHECK(shard->size() >= options.seq_len() + 1, "memopt::data: ", who, ": token shard '",
              shard->path(), "' holds ", shard->size(), " tokens, fewer than seq_len + 1 = ",
              options.seq_len() + 1, " (seq_len ", options.seq_len(),
              "). HINT: use a smaller seq_len or a larger shard");
}

}  // namespace detail

/// Training batches: B windows of T + 1 tokens at uniformly random starts.
/// Deterministic for a given seed; skip(n) fast-forwards exactly as n calls of next().
///   memopt::data::RandomWindowLoader loader(shard, memopt::data::LoaderOptions(8, 256));
///   memopt::Batch batch = loader.next();   // inputs, targets: (8, 256) int64
class RandomWindowLoader {
 public:
  RandomWindowLoader(std::shared_ptr<const TokenShard> shard, LoaderOptions options)
      : shard_(std::move(shard)), options_(std::move(options)) {
    detail::check_loader("RandomWindowLoader", shard_, options_);
    rng_.seed(options_.seed());
    num_starts_ = static_cast<uint64_t>(shard_->size() - options_.seq_len());
  }

  /// The next batch of B random windows.   auto batch = loader.next();
  Batch next() {
    const int64_t B = options_.batch_size(), T = options_.seq_len();
    torch::Tensor inputs = torch::empty({B, T}, torch::kLong);   // (B, T)
    torch::Tensor targets = torch::empty({B, T}, torch::kLong);  // (B, T)
    int64_t* in = inputs.data_ptr<int64_t>();
    int64_t* tg = targets.data_ptr<int64_t>();
    for (int64_t row = 0; row < B; ++row) {
      const auto start = static_cast<int64_t>(uniform_below(rng_, num_starts_));
      shard_->copy_to(start, T, in + row * T);
      shard_->copy_to(start + 1, T, tg + row * T);
    }
    ++batches_drawn_;
    return Batch{inputs, targets};
  }

  /// Advances as if next() had been called n times (for resuming a run).
  ///   loader.skip(state.step * accum_steps);
  void skip(int64_t n) {
    TORCH_CHECK(n >= 0, "memopt::data: RandomWindowLoader::skip(", n, ") on shard '",
                shard_->path(), "': n must be >= 0. HINT: pass the number of batches drawn");
    for (int64_t i = 0; i < n * options_.batch_size(); ++i) {
      uniform_below(rng_, num_starts_);
    }
    batches_drawn_ += n;
  }

  /// The position, for a training checkpoint (Trainer::save_checkpoint): the generator's
  /// exact state, the batches drawn, and what must match on load_state().
  nlohmann::json state() const {
    std::ostringstream rng;
    rng << rng_;
    return {{"kind", "RandomWindowLoader"}, {"shard", shard_->path()}, {"shard_tokens", shard_->size()},
            {"batch_size", options_.batch_size()}, {"seq_len", options_.seq_len()},
            {"seed", options_.seed()}, {"batches_drawn", batches_drawn_}, {"rng", rng.str()}};
  }

  /// Continues from state(): the next batch is the one the saving loader would have drawn.
  /// Refuses a state of another shard size, batch shape or seed, naming the field.
  void load_state(const nlohmann::json& state) {
    const auto now = this->state();
    for (const char* key : {"kind", "shard_tokens", "batch_size", "seq_len", "seed"}) {
      TORCH_CHECK(state.is_object() && state.contains(key) && state[key] == now[key],
                  "memopt::data: RandomWindowLoader::load_state on shard '", shard_->path(), "': \"", key, "\" is ",
                  state.is_object() && state.contains(key) ? state[key].dump() : std::string("missing"),
                  " in the checkpoint, ", now[key].dump(), " now. HINT: resume with the data and batch shape "
                  "of the run that saved it");
    }
    std::istringstream rng(state.value("rng", std::string()));
    Rng restored;
    rng >> restored;
    TORCH_CHECK(!rng.fail(), "memopt::data: RandomWindowLoader::load_state on shard '", shard_->path(),
                "': \"rng\" is not a generator state. HINT: the checkpoint's state.json is damaged");
    rng_ = restored;
    batches_drawn_ = state.value("batches_drawn", int64_t{0});
  }

  /// Batches drawn (or skipped) since construction.
  int64_t batches_drawn() const { return batches_drawn_; }
  const LoaderOptions& options() const { return options_; }
  const TokenShard& shard() const { return *shard_; }

 private:
  std::shared_ptr<const TokenShard> shard_;
  LoaderOptions options_;
  Rng rng_;
  uint64_t num_starts_ = 0;  // valid window starts: 0 .. size - T - 1
  int64_t batches_drawn_ = 0;
};

/// Evaluation batches: windows i = 0, 1, 2, ... with inputs [i*T, i*T + T) and targets one
/// token later, in order, B per batch. The last batch holds the remaining windows (fewer
/// than B) unless drop_last is set.
///   memopt::data::SequentialLoader val(shard, memopt::data::LoaderOptions(8, 256));
///   while (val.has_next()) total += model->loss(val.next()).sum;
class SequentialLoader {
 public:
  SequentialLoader(std::shared_ptr<const TokenShard> shard, LoaderOptions options)
      : shard_(std::move(shard)), options_(std::move(options)) {
    detail::check_loader("SequentialLoader", shard_, options_);
    num_windows_ = (shard_->size() - 1) / options_.seq_len();
    const int64_t B = options_.batch_size();
    num_batches_ = options_.drop_last() ? num_windows_ / B : (num_windows_ + B - 1) / B;
  }

  /// Whether next() has a batch left.
  bool has_next() const { return batches_drawn_ < num_batches_; }

  /// The next batch, (B, T) — (remaining windows, T) for a short last batch.
  Batch next() {
    TORCH_CHECK(has_next(), "memopt::data: SequentialLoader on shard '", shard_->path(),
                "' has no batch left (", num_batches_,
                " batches drawn). HINT: check has_next(), or call reset() to start over");
    const int64_t B = options_.batch_size(), T = options_.seq_len();
    const int64_t first = batches_drawn_ * B;
    const int64_t rows = std::min(B, num_windows_ - first);
    torch::Tensor inputs = torch::empty({rows, T}, torch::kLong);   // (rows, T)
    torch::Tensor targets = torch::empty({rows, T}, torch::kLong);  // (rows, T)
    int64_t* in = inputs.data_ptr<int64_t>();
    int64_t* tg = targets.data_ptr<int64_t>();
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t start = (first + row) * T;
      shard_->copy_to(start, T, in + row * T);
      shard_->copy_to(start + 1, T, tg + row * T);
    }
    ++batches_drawn_;
    return Batch{inputs, targets};
  }

  /// Starts over from the first window.
  void reset() { batches_drawn_ = 0; }
  /// Batches in one pass.
  int64_t num_batches() const { return num_batches_; }
  /// Windows of T tokens in one pass: (size - 1) / T.
  int64_t num_windows() const { return num_windows_; }
  const LoaderOptions& options() const { return options_; }
  const TokenShard& shard() const { return *shard_; }

 private:
  std::shared_ptr<const TokenShard> shard_;
  LoaderOptions options_;
  int64_t num_windows_ = 0;
  int64_t num_batches_ = 0;
  int64_t batches_drawn_ = 0;
};

}  // namespace memopt::data
