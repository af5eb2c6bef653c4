// memopt/step_sync.hpp — StepSync: how a Trainer's step meets the other ranks of a job.
// The Trainer is given one and calls it at fixed points of every step; this process alone
// (LocalSync) each call does nothing. Data parallel training is opt-in: memopt/dist.hpp
// provides dist::DataParallel (gradients summed over dist::world(), ZeRO-1 sharding) and
// makes it what a Trainer with TrainerOptions::data_parallel(true) gets in a job of several
// ranks. Without that header a Trainer started as one of several ranks stops with a HINT.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "memopt/dist/env.hpp"
#include "memopt/optim/clip.hpp"

namespace memopt {

namespace dist {
/// How updated parameters reach the other ranks after a sharded optimizer step.
enum class ParamGather {
  kBroadcast,  // each owner broadcasts its parameters (world broadcasts of 1/world of the bytes)
  kAllgather,  // one all-gather of every rank's parameters, padded to the largest share
};
}  // namespace dist

/// The settings of a data-parallel step (TrainerOptions' distributed group).
struct SyncOptions {
  int64_t bucket_bytes = 25 << 20;  // gradient all-reduce bucket size
  bool shard_optimizer_state = false;  // ZeRO-1 (dist/data_parallel.hpp)
  dist::ParamGather param_gather = dist::ParamGather::kBroadcast;
  bool shard_params = false;                    // ZeRO-3 (dist/zero3.hpp)
  int64_t param_persistence_threshold = 0;  // ZeRO-3: smaller tensors stay whole on every rank
  std::string offload_params_dir;           // ZeRO-3: the parameter shards in a file there (empty: memory)
  bool offload_params_host = false;         // ZeRO-3, a model on a GPU: the shards in pinned host memory
  bool keep_gathered = false;               // ZeRO-3: blocks stay whole from their first use to the step's end
  std::optional<c10::ScalarType> matrix_gather_dtype;  // ZeRO-3 gather_half: blocks' matrices gathered in it
};

/// The Trainer's link to the other ranks. Every hook has the one-process meaning here, so
/// LocalSync is this class as it is; dist::DataParallel overrides them.
class StepSync {
 public:
  virtual ~StepSync() = default;
  virtual int rank() const { return 0; }
  virtual int size() const { return 1; }
  bool distributed() const { return size() > 1; }
  /// Whether each rank keeps the optimizer state of its own parameters only (ZeRO-1).
  virtual bool sharded() const { return false; }

  /// Before the optimizer is built: the same model on every rank, rank 0's weights. Sharded,
  /// `groups` keeps this rank's parameters only; returns the parameters other ranks step.
  virtual std::vector<torch::Tensor> setup(torch::nn::Module& /*model*/, const std::vector<torch::Tensor>& /*params*/,
                                           std::vector<torch::optim::OptimizerParamGroup>& /*groups*/) {
    return {};
  }
  /// Whether `local` holds on any rank (fit(): a rank that cannot fill the next step stops all).
  virtual bool any(bool local, const char* /*what*/) { return local; }
  /// Before the step's first forward: what the step uses whole from start to end (ZeRO-3: the
  /// root unit, embedding and head, released again by sync_gradients).
  virtual void gather_params() {}
  /// The global batch's target and token counts (one small all-reduce before forward).
  virtual void sum_counts(torch::Tensor& /*num_targets*/, int64_t& /*tokens*/) {}
  /// After the last micro-batch: gradients and the loss summed over the ranks, with a pending
  /// stop signal; returns the signal the ranks agree to stop on (0: none).
  virtual int sync_gradients(torch::Tensor& /*loss_sum*/, int local_signal) { return local_signal; }
  /// Clips the global gradient norm of the parameters this rank steps; returns it (0-dim).
  virtual torch::Tensor clip_grad_norm_(const std::vector<torch::Tensor>& params, double max_norm) {
    return optim::clip_grad_norm_(params, max_norm);
  }
  /// After a step that updated the weights: each rank's updated parameters to all (sharded).
  virtual void share_params() {}
  /// Parameters sharded (ZeRO-3): what the optimizer steps in place of the model's, one flat
  /// tensor per unit and group (none otherwise).
  virtual std::vector<torch::Tensor> flat_params() const { return {}; }
  /// Runs `f` with every parameter of the model whole (ZeRO-3 gathers them; a collective), for
  /// checkpoints and evaluation; with `write_back`, each rank then takes its shard of the
  /// parameters as `f` left them (a resume).
  virtual void with_full_weights(const std::function<void()>& f, bool /*write_back*/) { f(); }
  /// At the end of fit(): the model's parameters whole on every rank (ZeRO-3 gathers them; a
  /// collective), for what the program does with the model next; the next step shards them again.
  virtual void unshard() {}

  // ---- training-state checkpoints (io/training_state.hpp) ----
  virtual void barrier(const char* /*what*/) {}
  /// Every rank's `mine`, in rank order, on rank 0 (null elsewhere). `key` is unique per call.
  virtual nlohmann::json gather(const nlohmann::json& mine, const std::string& /*key*/) {
    return nlohmann::json::array({mine});
  }
};

/// This process alone.
class LocalSync final : public StepSync {};

namespace detail {
/// What builds a data-parallel StepSync: set by memopt/dist.hpp, empty without it.
using DataParallelFactory = std::function<std::unique_ptr<StepSync>(const SyncOptions&)>;
inline DataParallelFactory& data_parallel_factory() {
  static DataParallelFactory factory;
  return factory;
}
}  // namespace detail

/// The StepSync of a Trainer: this process alone unless `data_parallel` and the job has several
/// ranks, then dist::DataParallel over dist::world() (needs memopt/dist.hpp).
inline std::unique_ptr<StepSync> make_step_sync(bool data_parallel, const SyncOptions& options) {
  if (!data_parallel) return std::make_unique<LocalSync>();
  if (const auto& factory = detail::data_parallel_factory()) return factory(options);
  const dist::Env env = dist::Env::from_environment();
  TORCH_CHECK(env.world_size <= 1, "memopt::Trainer: this process is rank ", env.rank, " of ", env.world_size,
              " (WORLD_SIZE) but data parallel training is not compiled in. HINT: #include <memopt/dist.hpp> in "
              "the program and link memopt::dist, or set TrainerOptions().data_parallel(false) to train alone");
  return std::make_unique<LocalSync>();
}

}  // namespace memopt
