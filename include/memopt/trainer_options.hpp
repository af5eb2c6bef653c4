// memopt/trainer_options.hpp — TrainerOptions: a Trainer's settings in five groups, one per
// concern — the optimizer, the schedule, the loop, training-state checkpoints and data
// parallel — each group checked with a HINT. Settings of the whole process (threads,
// allocator) are memopt::init()'s (runtime.hpp), never a Trainer's.
//
//   auto opts = memopt::TrainerOptions().lr(3e-4).warmup_steps(50).max_steps(400);  // shortcuts
//   opts.state().checkpoint_dir("out/ckpt").save_every(100);                        // a group in place
//   memopt::TrainerOptions().optimizer(memopt::OptimizerOptions().lr(1e-3).weight_decay(0));
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "memopt/optim/schedule.hpp"  // optim::Decay
#include "memopt/step_sync.hpp"       // dist::ParamGather, SyncOptions

namespace memopt {

/// AdamW and the gradient clip.
struct OptimizerOptions {
  TORCH_ARG(double, lr) = 3e-4;
  TORCH_ARG(double, beta1) = 0.9;
  TORCH_ARG(double, beta2) = 0.95;
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0.1;
  /// true: no weight decay on norms, biases and embeddings (optim::param_groups);
  /// false: one group, every parameter decays (plain torch.optim.AdamW(model.parameters())).
  TORCH_ARG(bool, param_specific_decay) = true;
  /// Global gradient-norm clip; 0 turns clipping off.
  TORCH_ARG(double, grad_clip) = 1.0;

 public:
  void validate() const {
    TORCH_CHECK(lr_ > 0, "memopt::TrainerOptions: lr must be > 0 (got ", lr_, "). HINT: try 3e-4.");
    TORCH_CHECK(beta1_ >= 0 && beta1_ < 1 && beta2_ >= 0 && beta2_ < 1,
                "memopt::TrainerOptions: betas must lie in [0, 1) (got ", beta1_, ", ", beta2_,
                "). HINT: try 0.9, 0.95.");
    TORCH_CHECK(eps_ > 0, "memopt::TrainerOptions: eps must be > 0 (got ", eps_, "). HINT: try 1e-8.");
    TORCH_CHECK(weight_decay_ >= 0, "memopt::TrainerOptions: weight_decay must be >= 0 (got ", weight_decay_,
                "). HINT: 0 turns weight decay off; 0.1 is usual.");
    TORCH_CHECK(grad_clip_ >= 0, "memopt::TrainerOptions: grad_clip must be >= 0 (got ", grad_clip_,
                "). HINT: 0 turns clipping off.");
  }
};

/// The learning-rate schedule (warm-up, then decay to min_lr_ratio · lr) and the run's length.
struct ScheduleOptions {
  TORCH_ARG(int64_t, warmup_steps) = 0;
  TORCH_ARG(optim::Decay, decay) = optim::Decay::kCosine;
  TORCH_ARG(double, min_lr_ratio) = 0.1;
  TORCH_ARG(int64_t, max_steps) = 1000;

 public:
  void validate() const {
    TORCH_CHECK(warmup_steps_ >= 0, "memopt::TrainerOptions: warmup_steps must be >= 0 (got ", warmup_steps_,
                "). HINT: 0 starts at the full learning rate.");
    TORCH_CHECK(min_lr_ratio_ >= 0 && min_lr_ratio_ <= 1,
                "memopt::TrainerOptions: min_lr_ratio must lie in [0, 1] (got ", min_lr_ratio_,
                "). HINT: 0.1 decays to a tenth of lr.");
    TORCH_CHECK(max_steps_ >= 1, "memopt::TrainerOptions: max_steps must be >= 1 (got ", max_steps_,
                "). HINT: pass --steps 1 or more.");
  }
};

/// The loop: micro-batches per step, logging, non-finite steps, stop signals, the memory budget.
struct LoopOptions {
  /// Micro-batches per step for accum::Runtime.
  TORCH_ARG(int64_t, accum_steps) = 1;
  /// Steps between log lines (the only host syncs of the loop).
  TORCH_ARG(int64_t, log_interval) = 10;
  /// Skip a step whose loss or gradient norm is inf/nan, leaving weights and optimizer state
  /// untouched (one host sync a step). state::StepInBackward updates inside backward: unchecked.
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
  /// Checkpointed blocks save the RNG state in forward and replay it in the recompute, so
  /// dropout draws the same masks (PyTorch's preserve_rng_state). false skips the save: the
  /// gradients stay exact for a model without dropout or other random ops, and are wrong for
  /// one with them.
  TORCH_ARG(bool, preserve_rng_state) = true;

 public:
  void validate() const {
    TORCH_CHECK(accum_steps_ >= 1, "memopt::TrainerOptions: accum_steps must be >= 1 (got ", accum_steps_,
                "). HINT: pass --accum 1 or more.");
    TORCH_CHECK(log_interval_ >= 1, "memopt::TrainerOptions: log_interval must be >= 1 (got ", log_interval_,
                "). HINT: 10 logs every tenth step.");
    TORCH_CHECK(max_consecutive_skips_ >= 0, "memopt::TrainerOptions: max_consecutive_skips must be >= 0 (got ",
                max_consecutive_skips_, "). HINT: 0 never stops; 25 is the default.");
    TORCH_CHECK(memory_budget_ >= 0, "memopt::TrainerOptions: memory_budget must be >= 0 bytes (got ", memory_budget_,
                "). HINT: 0 sets no limit; memopt::parse_bytes(\"4GiB\") reads a size.");
  }
};

/// Training-state checkpoints (io/training_state.hpp).
struct StateOptions {
  /// Where fit() writes training-state checkpoints (DIR/step-N/, io/checkpoint.hpp); "": none.
  TORCH_ARG(std::string, checkpoint_dir) = "";
  /// Steps between checkpoints; 0: only at the end, on SIGTERM/SIGINT and on a non-finite stop.
  TORCH_ARG(int64_t, save_every) = 0;
  /// Checkpoints kept (the newest ones).
  TORCH_ARG(int64_t, keep_checkpoints) = 3;

 public:
  void validate() const {
    TORCH_CHECK(save_every_ >= 0, "memopt::TrainerOptions: save_every must be >= 0 (got ", save_every_,
                "). HINT: 0 saves only at the end and on a stop; 100 every hundredth step.");
    TORCH_CHECK(keep_checkpoints_ >= 1, "memopt::TrainerOptions: keep_checkpoints must be >= 1 (got ",
                keep_checkpoints_, "). HINT: 3 keeps the last three.");
  }
};

/// Data parallel over dist::world() (needs memopt/dist.hpp; no effect on one rank).
struct DistributedOptions {
  /// false: this Trainer trains on this process alone even when the job has several ranks
  /// (a probe, a reference run); true: on dist::world().
  TORCH_ARG(bool, data_parallel) = true;
  /// Gradient all-reduce bucket size.
  TORCH_ARG(int64_t, bucket_mib) = 25;
  /// ZeRO-1: each rank keeps the optimizer state of ~1/world of the parameters, receives only
  /// their gradient sums (reduce-scatter), steps them and shares them (dist/data_parallel.hpp).
  TORCH_ARG(bool, shard_optimizer_state) = false;
  /// How a sharded step shares the updated parameters (broadcast per owner, or one all-gather).
  TORCH_ARG(dist::ParamGather, param_gather) = dist::ParamGather::kBroadcast;
  /// ZeRO-3: parameters, gradients and optimizer state sharded; each block gathered around its
  /// forward and its backward (dist/zero3.hpp). Implies a sharded optimizer state.
  TORCH_ARG(bool, shard_params) = false;
  /// ZeRO-3: tensors with fewer elements stay whole on every rank, with ZeRO-1 state (as
  /// DeepSpeed's stage3_param_persistence_threshold, 1e5 there: it gathers tensor by tensor;
  /// memopt gathers a block's tensors in one collective, so 0, sharding all, costs no latency).
  TORCH_ARG(int64_t, param_persistence_threshold) = 0;
  /// ZeRO-3: each rank's parameter shards in a file in this folder (dist/shard_file.hpp: read
  /// ahead of each all-gather, out of memory between uses), as ZeRO-Infinity's offload_param to
  /// NVMe. Empty: in memory.
  TORCH_ARG(std::string, offload_params_dir) = "";
  /// ZeRO-3, a model on a GPU: each rank's parameter shards, their gradients and optimizer
  /// state in pinned host memory; the optimizer steps them on the CPU and each block's
  /// parameters are copied to the GPU ahead of use, as DeepSpeed's offload_param to cpu (with
  /// offload_optimizer) and FSDP's CPUOffload(offload_params=True).
  TORCH_ARG(bool, offload_params_host) = false;
  /// ZeRO-3: each block stays whole from its first all-gather in a step until the gradients are
  /// synced after the last micro-batch (FSDP2's reshard_after_forward=False with
  /// set_reshard_after_backward(False)): one all-gather per block and step instead of two per
  /// micro-batch, for the memory of the whole model's parameters during the step.
  TORCH_ARG(bool, keep_gathered) = false;
  /// ZeRO-3 under an autocast precision (Bf16Autocast): a block's matrices (tensors of 2 or more
  /// dimensions) are all-gathered in the dtype autocast casts matmul weights to — what they would
  /// be cast to anyway, so the same results where every matrix of a block feeds an autocast
  /// matmul (LLaMA, MoE and LLaDA blocks; not LoRA's fp32 adapters), for half the bytes; vectors
  /// (norms), the root and the shards stay fp32. Checkpoints and evaluation see fp32 weights.
  TORCH_ARG(bool, gather_half) = false;

 public:
  void validate() const {
    TORCH_CHECK(bucket_mib_ >= 1, "memopt::TrainerOptions: bucket_mib must be >= 1 (got ", bucket_mib_,
                "). HINT: 25 MiB buckets suit most models.");
    TORCH_CHECK(offload_params_dir_.empty() || shard_params_, "memopt::TrainerOptions: offload_params_dir '",
                offload_params_dir_, "' offloads parameter shards, but shard_params is off. HINT: set "
                "shard_params(true) (--zero 3), or leave offload_params_dir empty");
    TORCH_CHECK(!offload_params_host_ || shard_params_, "memopt::TrainerOptions: offload_params_host offloads "
                "parameter shards, but shard_params is off. HINT: set shard_params(true) (--zero 3) with it");
    TORCH_CHECK(!offload_params_host_ || offload_params_dir_.empty(), "memopt::TrainerOptions: offload_params_host "
                "and offload_params_dir '", offload_params_dir_, "' both given. HINT: the shards go to one place: "
                "pinned host memory (a model on a GPU) or a file (any device)");
    TORCH_CHECK(!gather_half_ || shard_params_, "memopt::TrainerOptions: gather_half all-gathers ZeRO-3's blocks "
                "in 16 bits, but shard_params is off. HINT: set shard_params(true) (--zero 3) with it");
    TORCH_CHECK(!keep_gathered_ || shard_params_, "memopt::TrainerOptions: keep_gathered keeps ZeRO-3's blocks "
                "whole within a step, but shard_params is off. HINT: set shard_params(true) (--zero 3) with it");
    TORCH_CHECK(param_persistence_threshold_ >= 0, "memopt::TrainerOptions: param_persistence_threshold must be "
                ">= 0 (got ", param_persistence_threshold_, "). HINT: 0 shards every tensor; 10000 keeps norms whole.");
  }
  /// As dist::DataParallel and dist::Zero3 take them.
  SyncOptions sync_options() const {
    return SyncOptions{bucket_mib_ << 20, shard_optimizer_state_ || shard_params_, param_gather_, shard_params_,
                       param_persistence_threshold_, offload_params_dir_, offload_params_host_,
                       keep_gathered_};
  }
};

// A shortcut to a group's setting: opts.lr(1e-3) sets optimizer().lr, opts.lr() reads it.
#define MEMOPT_GROUP_SHORTCUT(group, T, name)          \
  TrainerOptions& name(const T& value) {               \
    group##_.name(value);                              \
    return *this;                                      \
  }                                                    \
  const T& name() const noexcept { return group##_.name(); }

/// A Trainer's settings: five groups, each with a shortcut per setting.
///   auto opts = memopt::TrainerOptions().lr(3e-4).warmup_steps(50).max_steps(400);
struct TrainerOptions {
  TORCH_ARG(OptimizerOptions, optimizer) = {};
  TORCH_ARG(ScheduleOptions, schedule) = {};
  TORCH_ARG(LoopOptions, loop) = {};
  TORCH_ARG(StateOptions, state) = {};
  TORCH_ARG(DistributedOptions, distributed) = {};

 public:
  MEMOPT_GROUP_SHORTCUT(optimizer, double, lr)
  MEMOPT_GROUP_SHORTCUT(optimizer, double, beta1)
  MEMOPT_GROUP_SHORTCUT(optimizer, double, beta2)
  MEMOPT_GROUP_SHORTCUT(optimizer, double, eps)
  MEMOPT_GROUP_SHORTCUT(optimizer, double, weight_decay)
  MEMOPT_GROUP_SHORTCUT(optimizer, bool, param_specific_decay)
  MEMOPT_GROUP_SHORTCUT(optimizer, double, grad_clip)
  MEMOPT_GROUP_SHORTCUT(schedule, int64_t, warmup_steps)
  MEMOPT_GROUP_SHORTCUT(schedule, optim::Decay, decay)
  MEMOPT_GROUP_SHORTCUT(schedule, double, min_lr_ratio)
  MEMOPT_GROUP_SHORTCUT(schedule, int64_t, max_steps)
  MEMOPT_GROUP_SHORTCUT(loop, int64_t, accum_steps)
  MEMOPT_GROUP_SHORTCUT(loop, int64_t, log_interval)
  MEMOPT_GROUP_SHORTCUT(loop, bool, skip_nonfinite)
  MEMOPT_GROUP_SHORTCUT(loop, int64_t, max_consecutive_skips)
  MEMOPT_GROUP_SHORTCUT(loop, bool, handle_signals)
  MEMOPT_GROUP_SHORTCUT(loop, int64_t, memory_budget)
  MEMOPT_GROUP_SHORTCUT(loop, bool, preserve_rng_state)
  MEMOPT_GROUP_SHORTCUT(state, std::string, checkpoint_dir)
  MEMOPT_GROUP_SHORTCUT(state, int64_t, save_every)
  MEMOPT_GROUP_SHORTCUT(state, int64_t, keep_checkpoints)
  MEMOPT_GROUP_SHORTCUT(distributed, bool, data_parallel)
  MEMOPT_GROUP_SHORTCUT(distributed, int64_t, bucket_mib)
  MEMOPT_GROUP_SHORTCUT(distributed, bool, shard_optimizer_state)
  MEMOPT_GROUP_SHORTCUT(distributed, dist::ParamGather, param_gather)
  MEMOPT_GROUP_SHORTCUT(distributed, bool, shard_params)
  MEMOPT_GROUP_SHORTCUT(distributed, int64_t, param_persistence_threshold)
  MEMOPT_GROUP_SHORTCUT(distributed, std::string, offload_params_dir)
  MEMOPT_GROUP_SHORTCUT(distributed, bool, offload_params_host)
  MEMOPT_GROUP_SHORTCUT(distributed, bool, keep_gathered)
  MEMOPT_GROUP_SHORTCUT(distributed, bool, gather_half)

  /// Throws a message naming the option, the value and a HINT when one is out of range.
  void validate() const {
    optimizer_.validate();
    schedule_.validate();
    loop_.validate();
    state_.validate();
    distributed_.validate();
  }

  /// The data-parallel settings, as dist::DataParallel takes them.
  SyncOptions sync_options() const { return distributed_.sync_options(); }

  /// The options that shape the result, as a checkpoint records them: a resume must match
  /// them (io::setting_differences). Logging, checkpointing and stop settings may change.
  nlohmann::json resume_settings() const {
    const auto& o = optimizer_;
    const auto& s = schedule_;
    return {{"lr", o.lr()},
            {"beta1", o.beta1()},
            {"beta2", o.beta2()},
            {"eps", o.eps()},
            {"weight_decay", o.weight_decay()},
            {"param_specific_decay", o.param_specific_decay()},
            {"warmup_steps", s.warmup_steps()},
            {"decay", static_cast<int>(s.decay())},
            {"min_lr_ratio", s.min_lr_ratio()},
            {"grad_clip", o.grad_clip()},
            {"max_steps", s.max_steps()},
            {"accum_steps", loop_.accum_steps()},
            {"shard_optimizer_state", distributed_.shard_optimizer_state()},
            {"shard_params", distributed_.shard_params()},
            {"param_persistence_threshold", distributed_.param_persistence_threshold()}};
  }
};

#undef MEMOPT_GROUP_SHORTCUT

}  // namespace memopt
