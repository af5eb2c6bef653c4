// memopt/loop_types.hpp — what the training loop meets: the batches it moves, the sources
// it draws them from, the loss functions it calls, and what fit() returns.
#pragma once

#include <concepts>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "memopt/batch.hpp"
#include "memopt/memory/report.hpp"

namespace memopt {

/// What the Trainer moves: memopt::Batch, data::GritBatch, or any type that says where it
/// goes, how many targets its loss is a sum over (0-dim tensor: no host sync) and how many
/// tokens it holds (for tokens/s).
template <class B>
concept TrainingBatch = requires(const B& b, const c10::Device& device) {
  { b.to(device) } -> std::convertible_to<B>;
  { b.num_targets() } -> std::convertible_to<torch::Tensor>;
  { b.num_tokens() } -> std::convertible_to<int64_t>;
};

/// A source of micro-batches: `loader.next()` returns a TrainingBatch.
template <class L>
concept BatchSource = requires(L& loader) {
  { loader.next() } -> TrainingBatch;
};

/// The batch type of a BatchSource.
template <class L>
using batch_of = std::remove_cvref_t<decltype(std::declval<L&>().next())>;

/// The next `n` micro-batches of `loader`, on `device`.
template <BatchSource Loader>
std::vector<batch_of<Loader>> next_batches(Loader& loader, int64_t n, const c10::Device& device) {
  std::vector<batch_of<Loader>> batches;
  batches.reserve(static_cast<size_t>(n));
  for (int64_t m = 0; m < n; ++m) batches.push_back(loader.next().to(device));
  return batches;
}

/// The targets of all `batches`, a 0-dim float tensor on `device` (no host sync).
template <TrainingBatch B>
torch::Tensor count_targets(const std::vector<B>& batches, const c10::Device& device) {
  torch::Tensor n = batches.front().num_targets().to(device);
  for (size_t m = 1; m < batches.size(); ++m) n = n + batches[m].num_targets().to(device);
  return n.to(torch::kFloat);
}

/// The token positions of all `batches` (what tokens/s counts).
template <TrainingBatch B>
int64_t count_tokens(const std::vector<B>& batches) {
  int64_t n = 0;
  for (const auto& b : batches) n += b.num_tokens();
  return n;
}

/// A batch the Trainer can cut into smaller ones when a step goes over its memory budget.
template <class B>
concept SplittableBatch = requires(const B& b, int64_t n) {
  { b.split(n) } -> std::convertible_to<std::vector<B>>;
  { b.rows() } -> std::convertible_to<int64_t>;
};

/// What a loss function computes: `loss_fn(batch, recompute_policy)` returns the SUM of
/// the per-target losses of the batch (the Trainer divides by the effective batch's
/// num_targets()).
template <class F, class Recompute, class B = Batch>
concept LossFunction = requires(F& fn, const B& batch, const Recompute& ckpt) {
  { fn(batch, ckpt) } -> std::convertible_to<torch::Tensor>;
};

/// The usual loss function: `model`'s loss_sum(batch, recompute_policy), for models that
/// have one (models::Llama, models::MoeLM). A named type, so a run and the planner's probes
/// (planner.hpp's probe_steps) share each Trainer's compiled step.
///   trainer.fit(loader, memopt::LossSum<memopt::models::Llama>{&model});
template <class ModelHolder>
struct LossSum {
  ModelHolder* model;
  template <class Recompute>
  torch::Tensor operator()(const Batch& batch, const Recompute& ckpt) const {  // batch (B, T)
    return (*model)->loss_sum(batch, ckpt);
  }
};

/// A loader whose position a checkpoint can hold: state() as JSON, load_state() restores it
/// so a resumed run draws exactly the batches it would have drawn.
template <class L>
concept ResumableSource = requires(L& loader, const L& cloader, const nlohmann::json& state) {
  { cloader.state() } -> std::convertible_to<nlohmann::json>;
  loader.load_state(state);
};

/// A loader that can run out (data::StreamLoader with finite epochs): has_next(n) says
/// whether n more batches come; fit() ends before a step it could not fill.
template <class L>
concept FiniteSource = requires(L& loader, int64_t n) {
  { loader.has_next(n) } -> std::convertible_to<bool>;
};

/// What fit() returns.
struct FitResult {
  int64_t steps = 0;
  double final_loss = 0;
  double tokens_per_s = 0;
  double seconds = 0;
  memory::Report memory;
  int64_t skipped_steps = 0;  // steps skipped on an inf/nan loss or gradient norm
  int stop_signal = 0;        // SIGTERM/SIGINT that stopped fit() early (after a checkpoint), else 0
  std::string checkpoint;     // the last checkpoint written, "" if none
  int64_t micro_splits = 1;   // pieces each micro-batch is cut into to stay within memory_budget
  bool data_exhausted = false;  // a FiniteSource ran out before max_steps
};

}  // namespace memopt
