// memopt/memory/budget.hpp — StepBudget: a step's forward and backward kept within a
// tracked-bytes budget (TrainerOptions::memory_budget) by cutting micro-batches smaller.
// The tracker refuses an allocation over the budget; on that (or any out-of-memory error)
// the gradients are dropped, each micro-batch is cut into twice as many pieces, and the
// step runs again on the same micro-batches and random state: the same effective batch and
// target count, the dropout masks a run that started with this split would draw. The split
// is kept for later steps; below one sequence a piece the step stops with an error naming
// the need.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>

#include "memopt/detail/checkpoint_function.hpp"  // RngState
#include "memopt/loop_types.hpp"                  // SplittableBatch
#include "memopt/memory/report.hpp"   // mib
#include "memopt/memory/tracker.hpp"

namespace memopt::memory {

class StepBudget {
 public:
  /// `bytes`: tracked bytes forward and backward may use (0: no limit, nothing is cut).
  explicit StepBudget(int64_t bytes = 0) : bytes_(bytes) {}

  int64_t bytes() const { return bytes_; }
  /// Pieces each micro-batch is cut into (1: none).
  int64_t splits() const { return splits_; }
  /// A resumed run continues with the split its checkpoint recorded.
  void restore_splits(int64_t splits) { splits_ = bytes_ > 0 && splits > 0 ? splits : 1; }

  /// Sums `piece_fn(piece)` over the pieces of every micro-batch. Over the budget: `drop()`
  /// (the gradients so far), a split twice as fine, `notice(line)`, and the step again.
  /// `step` (1-based) names the step in messages.
  template <class B, class PieceFn, class Drop, class Notice>
  torch::Tensor run(const std::vector<B>& micro_batches, int64_t step, const c10::Device& device, PieceFn&& piece_fn,
                    Drop&& drop, Notice&& notice) {
    const auto rng = bytes_ > 0 ? memopt::detail::RngState::capture() : memopt::detail::RngState{};
    while (true) {
      try {
        LimitScope limit(bytes_);
        torch::Tensor sum = torch::zeros({}, torch::TensorOptions().device(device));
        for (const auto& batch : micro_batches)
          for (const auto& piece : pieces(batch)) sum += piece_fn(piece);
        return sum;
      } catch (const c10::OutOfMemoryError& e) {
        if (bytes_ == 0) throw;
        drop();
        notice(split_further(micro_batches.front(), step, e));
        rng.restore();
      }
    }
  }

 private:
  // The tracker's limit for a scope (0: none).
  struct LimitScope {
    explicit LimitScope(int64_t bytes) : active(bytes > 0) {
      if (active) Tracker::instance().set_limit(bytes);
    }
    ~LimitScope() {
      if (active) Tracker::instance().set_limit(0);
    }
    bool active;
  };

  template <class B>
  std::vector<B> pieces(const B& batch) const {
    if constexpr (SplittableBatch<B>) {
      return splits_ == 1 ? std::vector<B>{batch} : batch.split(splits_);
    } else {
      return {batch};
    }
  }

  // Doubles the split and returns the notice, or throws when a piece is one sequence already
  // (or the batch type cannot be cut).
  template <class B>
  std::string split_further(const B& batch, int64_t step, const c10::OutOfMemoryError& e) {
    const int64_t need = Tracker::instance().last_refused_need();
    if constexpr (SplittableBatch<B>) {
      const int64_t rows = batch.rows();
      TORCH_CHECK(rows / splits_ > 1, "memopt::Trainer: memory_budget ", fmt::format("{:.1f}", mib(bytes_)),
                  " MiB is too small: step ", step, " with micro-batches of ", (rows + splits_ - 1) / splits_,
                  " sequence(s) needs at least ", fmt::format("{:.1f}", mib(need)), " MiB (", e.what_without_backtrace(),
                  "). HINT: raise the budget, shorten the sequences, or pick lighter policies "
                  "(recompute::EveryBlock, precision::Bf16Autocast; memopt::plan() finds them)");
      splits_ *= 2;
      return fmt::format(
          "memopt: step {} went over the memory budget ({:.1f} MiB; it needed {:.1f} MiB): micro-batches of {} "
          "sequences are now run as {} pieces of about {} (accumulation x{}; the effective batch is unchanged)",
          step, mib(bytes_), mib(need), rows, splits_, (rows + splits_ - 1) / splits_, splits_);
    } else {
      TORCH_CHECK(false, "memopt::Trainer: step ", step, " went over memory_budget ", fmt::format("{:.1f}", mib(bytes_)),
                  " MiB (", e.what_without_backtrace(), ") and its batch type cannot be cut smaller (no split()). "
                  "HINT: raise the budget or use a smaller batch (GradCache: a smaller chunk)");
      return {};
    }
  }

  int64_t bytes_;
  int64_t splits_ = 1;
};

}  // namespace memopt::memory
