// memopt/trainer_options.hpp — TrainerOptions: the optimizer, schedule, loop, checkpoint,
// memory-budget and data-parallel settings of a Trainer, each checked with a HINT.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "memopt/optim/schedule.hpp"  // optim::Decay
#include "memopt/step_sync.hpp"       // dist::ParamGather, SyncOptions

namespace memopt {

/// Options of the optimizer, schedule and loop.
///   auto opts = memopt::TrainerOptions().lr(3e-4).warmup_steps(50).max_steps(400);
struct TrainerOptions {
  TORCH_ARG(double, lr) = 3e-4;
  TORCH_ARG(double, beta1) = 0.9;
  TORCH_ARG(double, beta2) = 0.95;
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0.1;
  /// true: no weight decay on norms, biases and embeddings (optim::param_groups);
  /// false: one group, every parameter decays (plain torch.optim.AdamW(model.parameters())).
  TORCH_ARG(bool, param_specific_decay) = true;
  TORCH_ARG(int64_t, warmup_steps) = 0;
  TORCH_ARG(optim::Decay, decay) = optim::Decay::kCosine;
  TORCH_ARG(double, min_lr_ratio) = 0.1;
  /// Global gradient-norm clip; 0 turns clipping off.
  TORCH_ARG(double, grad_clip) = 1.0;
  TORCH_ARG(int64_t, max_steps) = 1000;
  /// Steps between log lines (the only host syncs of the loop).
  TORCH_ARG(int64_t, log_interval) = 10;
  /// Intra-op threads; 0 means all CPUs this process may run on.
  TORCH_ARG(int, threads) = 0;
  /// Micro-batches per step for accum::Runtime.
  TORCH_ARG(int64_t, accum_steps) = 1;
  /// Allocator settings applied when the Trainer is built, "key:value,..." (see
  /// memory/allocator.hpp; memopt::init() applies $MEMOPT_ALLOC_CONF already); "" changes nothing.
  TORCH_ARG(std::string, alloc_conf) = "";
  /// Where fit() writes training-state checkpoints (DIR/step-N/, io/checkpoint.hpp); "": none.
  TORCH_ARG(std::string, checkpoint_dir) = "";
  /// Steps between checkpoints; 0: only at the end, on SIGTERM/SIGINT and on a non-finite stop.
  TORCH_ARG(int64_t, save_every) = 0;
  /// Checkpoints kept (the newest ones).
  TORCH_ARG(int64_t, keep_checkpoints) = 3;
  /// Skip a step whose loss or gradient norm is inf/nan, leaving weights and optimizer state
  /// untouched (one host sync a step). offload::StepInBackward updates inside backward: unchecked.
  TORCH_ARG(bool, skip_nonfinite) = true;
  /// Stop with an error (after a checkpoint) once this many steps in a row were skipped; 0: never.
  /// fp16 loss scaling skips a few steps in a row while its scale backs off from 2^16.
  TORCH_ARG(int64_t, max_consecutive_skips) = 25;
  /// During fit(), the first SIGTERM/SIGINT finishes the step, writes a checkpoint and returns
  /// (FitResult::stop_signal); a second SIGINT exits at once (signals.hpp).
  TORCH_ARG(bool, handle_signals) = true;
  /// Tracked tensor bytes forward and backward may use (0: no limit). An allocation that would
  /// go over it (or one that fails) makes the Trainer redo the step with each micro-batch cut
  /// in two halves (accumulation doubled: the effective batch and the loss are unchanged), and
  /// keep that split; below one sequence it stops with an error naming the need. Needs the
  /// tracker (memopt::init()) on the CPU and a batch type with split().
  TORCH_ARG(int64_t, memory_budget) = 0;
  /// false: this Trainer trains on this process alone even when the job has several ranks
  /// (a probe, a reference run); true: on dist::world() (needs memopt/dist.hpp, step_sync.hpp).
  TORCH_ARG(bool, data_parallel) = true;
  /// Data parallel (dist::world() of more than one rank): gradient all-reduce bucket size.
  TORCH_ARG(int64_t, bucket_mib) = 25;
  /// Data parallel: ZeRO-1 — each rank keeps the optimizer state of ~1/world of the
  /// parameters, receives only their gradient sums (reduce-scatter), steps them and shares
  /// them (dist/data_parallel.hpp). No effect on one rank.
  TORCH_ARG(bool, shard_optimizer_state) = false;
  /// How a sharded step shares the updated parameters (broadcast per owner, or one all-gather).
  TORCH_ARG(dist::ParamGather, param_gather) = dist::ParamGather::kBroadcast;


 public:
  /// Throws a message naming the option, the value and a HINT when one is out of range.
  void validate() const {
    TORCH_CHECK(lr_ > 0, "memopt::TrainerOptions: lr must be > 0 (got ", lr_, "). HINT: try 3e-4.");
    TORCH_CHECK(beta1_ >= 0 && beta1_ < 1 && beta2_ >= 0 && beta2_ < 1,
                "memopt::TrainerOptions: betas must lie in [0, 1) (got ", beta1_, ", ", beta2_,
                "). HINT: try 0.9, 0.95.");
    TORCH_CHECK(eps_ > 0, "memopt::TrainerOptions: eps must be > 0 (got ", eps_, "). HINT: try 1e-8.");
    TORCH_CHECK(weight_decay_ >= 0, "memopt::TrainerOptions: weight_decay must be >= 0 (got ", weight_decay_,
                "). HINT: 0 turns weight decay off; 0.1 is usual.");
    TORCH_CHECK(warmup_steps_ >= 0, "memopt::TrainerOptions: warmup_steps must be >= 0 (got ", warmup_steps_,
                "). HINT: 0 starts at the full learning rate.");
    TORCH_CHECK(min_lr_ratio_ >= 0 && min_lr_ratio_ <= 1,
                "memopt::TrainerOptions: min_lr_ratio must lie in [0, 1] (got ", min_lr_ratio_,
                "). HINT: 0.1 decays to a tenth of lr.");
    TORCH_CHECK(grad_clip_ >= 0, "memopt::TrainerOptions: grad_clip must be >= 0 (got ", grad_clip_,
                "). HINT: 0 turns clipping off.");
    TORCH_CHECK(max_steps_ >= 1, "memopt::TrainerOptions: max_steps must be >= 1 (got ", max_steps_,
                "). HINT: pass --steps 1 or more.");
    TORCH_CHECK(log_interval_ >= 1, "memopt::TrainerOptions: log_interval must be >= 1 (got ", log_interval_,
                "). HINT: 10 logs every tenth step.");
    TORCH_CHECK(threads_ >= 0, "memopt::TrainerOptions: threads must be >= 0 (got ", threads_,
                "). HINT: 0 uses every available CPU.");
    TORCH_CHECK(accum_steps_ >= 1, "memopt::TrainerOptions: accum_steps must be >= 1 (got ", accum_steps_,
                "). HINT: pass --accum 1 or more.");
    TORCH_CHECK(save_every_ >= 0, "memopt::TrainerOptions: save_every must be >= 0 (got ", save_every_,
                "). HINT: 0 saves only at the end and on a stop; 100 every hundredth step.");
    TORCH_CHECK(keep_checkpoints_ >= 1, "memopt::TrainerOptions: keep_checkpoints must be >= 1 (got ",
                keep_checkpoints_, "). HINT: 3 keeps the last three.");
    TORCH_CHECK(memory_budget_ >= 0, "memopt::TrainerOptions: memory_budget must be >= 0 bytes (got ", memory_budget_,
                "). HINT: 0 sets no limit; memopt::parse_bytes(\"4GiB\") reads a size.");
    TORCH_CHECK(max_consecutive_skips_ >= 0, "memopt::TrainerOptions: max_consecutive_skips must be >= 0 (got ",
                max_consecutive_skips_, "). HINT: 0 never stops; 25 is the default.");
    TORCH_CHECK(bucket_mib_ >= 1, "memopt::TrainerOptions: bucket_mib must be >= 1 (got ", bucket_mib_,
                "). HINT: 25 MiB buckets suit most models.");
  }

  /// The data-parallel settings, as dist::DataParallel takes them.
  SyncOptions sync_options() const {
    return SyncOptions{bucket_mib_ << 20, shard_optimizer_state_, param_gather_};
  }

  /// The options that shape the result, as a checkpoint records them: a resume must match
  /// them (io::setting_differences). Logging, threads, checkpointing and stop settings may change.
  nlohmann::json resume_settings() const {
    return {{"lr", lr_},
            {"beta1", beta1_},
            {"beta2", beta2_},
            {"eps", eps_},
            {"weight_decay", weight_decay_},
            {"param_specific_decay", param_specific_decay_},
            {"warmup_steps", warmup_steps_},
            {"decay", static_cast<int>(decay_)},
            {"min_lr_ratio", min_lr_ratio_},
            {"grad_clip", grad_clip_},
            {"max_steps", max_steps_},
            {"accum_steps", accum_steps_},
            {"shard_optimizer_state", shard_optimizer_state_}};
  }
};

}  // namespace memopt
