// memopt/batch.hpp — the unit of data the Trainer moves: token inputs and their
// targets, and the loss a model returns for them (a sum plus the count it is a sum
// over, so gradient accumulation can normalise by the whole effective batch).
#pragma once

#include <vector>

#include <torch/torch.h>

namespace memopt {

/// Target id that contributes no loss (padding, prompt tokens), as in PyTorch.
inline constexpr int64_t kIgnoreIndex = -100;

/// One (micro-)batch of language-model data.
///   memopt::Batch b{inputs, targets};   // both (B, T) int64
struct Batch {
  torch::Tensor inputs;   // (B, T) int64 token ids
  torch::Tensor targets;  // (B, T) int64, kIgnoreIndex where no loss is taken

  /// Number of targets that carry loss, as a 0-dim int64 tensor (no host sync).
  torch::Tensor num_targets() const { return targets.ne(kIgnoreIndex).sum(); }
  /// Token positions of the batch, padding included (what tokens/s counts).
  int64_t num_tokens() const { return inputs.numel(); }
  /// Both tensors on `device` (no copy when they are there already).
  Batch to(const c10::Device& device) const { return {inputs.to(device), targets.to(device)}; }
  /// `n` batches of consecutive rows (sizes differ by at most one; views, no copy); what the
  /// Trainer runs when a micro-batch does not fit its memory budget.
  std::vector<Batch> split(int64_t n) const {
    auto in = torch::tensor_split(inputs, n, 0);
    auto tg = torch::tensor_split(targets, n, 0);
    std::vector<Batch> out;
    for (size_t i = 0; i < in.size(); ++i) out.push_back({in[i], tg[i]});
    return out;
  }
  /// Rows (sequences) in the batch.
  int64_t rows() const { return inputs.size(0); }
};

/// What a loss function hands the Trainer: the *sum* of per-target losses and the
/// number of targets summed over. The Trainer divides by the count of the whole
/// effective batch, so N accumulated micro-batches equal one big batch even when
/// they hold different numbers of targets.
///   return memopt::Loss{ce_sum, batch.num_targets()};
struct Loss {
  torch::Tensor sum;    // 0-dim, float
  torch::Tensor count;  // 0-dim, number of targets in `sum`

  /// The mean loss of this batch alone (syncs on the value only when read).
  torch::Tensor mean() const { return sum / count.to(sum.scalar_type()).clamp_min(1); }
};

}  // namespace memopt
