// memopt/trainer.hpp — Trainer<Checkpoint, Precision, Accum, Offload>: the training loop
// with the chosen memory optimizations compiled in and the others costing nothing.
// The step reads top to bottom; policies are types, so there is no runtime branch on one.
// It never loses more than the work since its last checkpoint: checkpoints every N steps,
// on SIGTERM/SIGINT and when it stops on non-finite values, and resume() restores one
// exactly (io/checkpoint.hpp). A step with an inf/nan loss or gradient norm is skipped.
#pragma once

#include <chrono>
#include <csignal>
#include <concepts>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include <torch/torch.h>

#include "memopt/batch.hpp"
#include "memopt/callbacks.hpp"
#include "memopt/concepts.hpp"
#include "memopt/dist/data_parallel.hpp"
#include "memopt/io/checkpoint.hpp"
#include "memopt/memory/allocator.hpp"
#include "memopt/memory/report.hpp"
#include "memopt/memory/tracker.hpp"
#include "memopt/optim/clip.hpp"
#include "memopt/optim/param_groups.hpp"
#include "memopt/optim/schedule.hpp"
#include "memopt/policies/accum.hpp"
#include "memopt/policies/checkpoint.hpp"
#include "memopt/policies/offload.hpp"
#include "memopt/policies/precision.hpp"
#include "memopt/runtime.hpp"
#include "memopt/signals.hpp"

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
  /// (a probe, a reference run); true: on dist::world().
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

/// A batch the Trainer can cut into smaller ones when a step goes over its memory budget.
template <class B>
concept SplittableBatch = requires(const B& b, int64_t n) {
  { b.split(n) } -> std::convertible_to<std::vector<B>>;
  { b.rows() } -> std::convertible_to<int64_t>;
};

/// What a loss function computes: `loss_fn(batch, checkpoint_policy)` returns the SUM of
/// the per-target losses of the batch (the Trainer divides by the effective batch's
/// num_targets()).
template <class F, class Checkpoint, class B = Batch>
concept LossFunction = requires(F& fn, const B& batch, const Checkpoint& ckpt) {
  { fn(batch, ckpt) } -> std::convertible_to<torch::Tensor>;
};

/// The usual loss function: `model`'s loss_sum(batch, checkpoint_policy), for models that
/// have one (models::Llama, models::MoeLM). A named type, so a run and the planner's probes
/// (planner.hpp's probe_steps) share each Trainer's compiled step.
///   trainer.fit(loader, memopt::LossSum<memopt::models::Llama>{&model});
template <class ModelHolder>
struct LossSum {
  ModelHolder* model;
  template <class Checkpoint>
  torch::Tensor operator()(const Batch& batch, const Checkpoint& ckpt) const {  // batch (B, T)
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

/// The training loop. Policies are chosen at compile time; everything else at run time.
///
///   memopt::init();                                          // first line of main()
///   auto model = memopt::models::Llama(cfg);
///   memopt::Trainer<memopt::checkpoint::EveryBlock, memopt::precision::Bf16Autocast,
///                   memopt::accum::Fixed<4>> trainer(*model, memopt::TrainerOptions().lr(1e-3));
///   trainer.fit(loader, [&](const memopt::Batch& b, const auto& ckpt) { return model->loss_sum(b, ckpt); });
template <CheckpointPolicy Checkpoint = checkpoint::None, PrecisionPolicy Precision = precision::Fp32,
          AccumPolicy Accum = accum::None, OffloadPolicy Offload = offload::None>
class Trainer {
 public:
  using checkpoint_type = Checkpoint;
  using precision_type = Precision;
  using accum_type = Accum;
  using offload_type = Offload;

  /// The instantiation, e.g. "Trainer<checkpoint::EveryBlock, precision::Bf16Autocast,
  /// accum::Runtime, offload::None>" (what the planner's dispatch reports it ran).
  static std::string name() {
    return "Trainer<" + detail::policy_name<Checkpoint>() + ", " + detail::policy_name<Precision>() + ", " +
           detail::policy_name<Accum>() + ", " + detail::policy_name<Offload>() + ">";
  }

  /// Takes the model's trainable parameters; builds the optimizer through the Offload policy.
  Trainer(torch::nn::Module& model, TrainerOptions options) : Trainer(model, options, make_accum_policy(options)) {}
  Trainer(torch::nn::Module& model, TrainerOptions options, Accum accum)
      : Trainer(model, options, std::move(accum), Offload{}) {}
  /// With configured policy values: Trainer(model, options, accum::Runtime(4), offload::Disk(disk_options)).
  Trainer(torch::nn::Module& model, TrainerOptions options, Accum accum, Offload offload)
      : options_(validated(options)), accum_(std::move(accum)), offload_(std::move(offload)), model_(&model) {
    memory::AllocatorOptions::parse(options_.alloc_conf(), "TrainerOptions::alloc_conf").apply();
    const int threads = options_.threads() > 0 ? options_.threads() : default_threads();
    at::set_num_threads(threads);  // usually already done by memopt::init()
    for (const auto& p : model.parameters())
      if (p.requires_grad()) params_.push_back(p);
    TORCH_CHECK(!params_.empty(), "memopt::Trainer: the model has no trainable parameters. "
                                  "HINT: register parameters with register_parameter/register_module.");
    device_ = params_.front().device();
    auto adamw = torch::optim::AdamWOptions(options_.lr())
                     .betas({options_.beta1(), options_.beta2()})
                     .eps(options_.eps())
                     .weight_decay(options_.weight_decay());
    auto groups = options_.param_specific_decay() ? optim::param_groups(model.named_parameters(), adamw)
                                                  : optim::single_group(params_, adamw);
    world_ = options_.data_parallel() ? &dist::world() : &dist::local_world();
    std::vector<torch::Tensor> others;  // sharded: the parameters whose optimizer state other ranks keep
    if (world_->distributed()) others = setup_data_parallel(model, groups);  // sharded: keeps this rank's groups
    optimizer_ = offload_.make_optimizer(master_groups(std::move(groups), others), adamw);
    for (auto& group : optimizer_->param_groups())
      for (auto& p : group.params()) step_params_.push_back(p);
    check_steps_in_backward();
    TORCH_CHECK(options_.memory_budget() == 0 || device_.is_cuda() || memory::Tracker::instance().installed(),
                "memopt::Trainer: memory_budget ", options_.memory_budget(), " needs the memory tracker, which is "
                "not installed. HINT: call memopt::init() first in main()");
  }

  /// Adds a callback (called in the order added). Data parallel: on every rank, but a reporter
  /// (Callback::main_rank_only()) on rank 0 only.
  Trainer& add_callback(std::shared_ptr<Callback> cb) {
    if (cb->main_rank_only() && world_->rank() != 0) return *this;
    callbacks_.push_back(std::move(cb));
    return *this;
  }

  /// One optimizer step over accum_.micro_steps() micro-batches from `loader`.
  template <BatchSource Loader, LossFunction<Checkpoint, batch_of<Loader>> LossFn>
  StepStats step(Loader& loader, LossFn&& loss_fn) {
    const auto start = std::chrono::steady_clock::now();
    for (auto& cb : callbacks_) cb->on_step_begin(step_ + 1);
    auto& tracker = memory::Tracker::instance();

    const double lr = set_learning_rate(step_);  // before backward: offload::StepInBackward steps there

    // ---- the effective batch: its micro-batches and their target count ----
    auto micro_batches = next_micro_batches(loader);           // accum_.micro_steps() × (B, T)
    torch::Tensor num_targets = count_targets(micro_batches);  // 0-dim, no host sync
    int64_t tokens = tokens_in(micro_batches);
    if (world_->distributed()) sum_over_ranks(num_targets, tokens);  // the global batch's counts
    num_targets = num_targets.clamp_min(1);

    // ---- forward + backward per micro-batch (cut smaller if over memory_budget); grads accumulate ----
    torch::Tensor loss_sum = accumulate(micro_batches, loss_fn, num_targets);  // 0-dim, the step's mean loss
    if (world_->distributed()) sync_gradients(loss_sum);  // once, after the last micro-batch (no_sync before)

    // ---- optimizer step ----
    tracker.set_phase(memory::Phase::kOptimizer);
    prepare_grads();                                       // Scaled: ÷ loss scale; Bf16Pure: → fp32 masters
    torch::Tensor grad_norm = param_share_ ? dist::clip_grad_norm_(*world_, step_params_, options_.grad_clip())
                                           : optim::clip_grad_norm_(step_params_, options_.grad_clip());
    bool stepped = false;
    if (finite(loss_sum, grad_norm)) {                     // one host sync; inf/nan: weights and state untouched
      offload_.before_step(*optimizer_);
      stepped = precision_.step(*optimizer_);              // false: the loss scaler found inf/nan
      offload_.after_step(*optimizer_);
      if (param_share_ && stepped) param_share_->share();  // sharded: each rank's updated parameters to all
    } else {
      skip_step();                                         // Scaled: the loss scale backs off
    }
    zero_grad();
    tracker.set_phase(memory::Phase::kIdle);

    StepStats stats{++step_, lr, loss_sum, grad_norm, num_targets, tokens,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), stepped};
    for (auto& cb : callbacks_) cb->on_step_end(stats);
    return stats;
  }

  /// Runs steps until options.max_steps(), logging every options.log_interval() steps.
  template <BatchSource Loader, LossFunction<Checkpoint, batch_of<Loader>> LossFn>
  FitResult fit(Loader& loader, LossFn&& loss_fn) {
    StopSignals stop(options_.handle_signals());  // SIGTERM/SIGINT: finish the step, checkpoint, return
    stop_ = &stop;
    struct Forget {  // stop_ points into this frame only
      StopSignals*& p;
      ~Forget() { p = nullptr; }
    } forget{stop_};
    FitResult result;
    int64_t total_tokens = 0;
    int64_t tokens_since_log = 0, steps_since_log = 0;
    int64_t skipped_steps = 0;  // steps the precision policy skipped (inf/nan gradient), this fit()
    double seconds_since_log = 0;
    const auto fit_start = std::chrono::steady_clock::now();  // the ETA: mean wall time per step since here
    while (step_ < options_.max_steps()) {
      if constexpr (FiniteSource<Loader>) {
        if ((result.data_exhausted = out_of_data(loader))) break;
      }
      StepStats s = step(loader, loss_fn);
      tokens_since_log += s.tokens;
      seconds_since_log += s.seconds;
      steps_since_log += 1;
      skipped_steps += s.stepped ? 0 : 1;
      result.seconds += s.seconds;
      result.steps += 1;
      total_tokens += s.tokens;
      if (s.step % options_.log_interval() == 0 || s.step == options_.max_steps()) {
        LogLine line{s.step, options_.max_steps(), s.loss.item<double>(), s.lr, s.grad_norm.item<double>(),
                     static_cast<double>(tokens_since_log) / std::max(seconds_since_log, 1e-9),
                     memory::Report::now()};
        const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - fit_start).count();
        line.skipped_steps = skipped_steps;
        line.step_seconds = seconds_since_log / static_cast<double>(steps_since_log);
        const auto steps_left = static_cast<double>(options_.max_steps() - s.step);
        line.eta_seconds = wall / static_cast<double>(result.steps) * steps_left;
        result.final_loss = line.loss;
        for (auto& cb : callbacks_) cb->on_log(line);
        tokens_since_log = 0;
        steps_since_log = 0;
        seconds_since_log = 0;
      }
      stop_if_diverged(s, loader);  // throws after max_consecutive_skips skipped steps in a row (checkpointed)
      if (checkpointing() && options_.save_every() > 0 && s.step % options_.save_every() == 0)
        save_checkpoint(loader, "interval");
      // Data parallel: the ranks stop together, at the step whose gradient sync carried a signal.
      if ((result.stop_signal = world_->distributed() ? agreed_stop_ : stop.requested()) != 0) {
        if (checkpointing()) save_checkpoint(loader, signal_name(result.stop_signal));
        break;
      }
    }
    if (checkpointing() && last_saved_step_ != step_) save_checkpoint(loader, "end");
    result.skipped_steps = skipped_steps;
    result.micro_splits = micro_splits_;
    result.checkpoint = last_checkpoint_;
    result.tokens_per_s = static_cast<double>(total_tokens) / std::max(result.seconds, 1e-9);
    result.memory = memory::Report::now();
    for (auto& cb : callbacks_) cb->on_train_end(result.memory);
    return result;
  }

  /// Settings of the run a resume must match besides the options (model shape, data, flags):
  /// stored in each checkpoint, compared by resume().
  ///   trainer.set_run_config({{"layers", 4}, {"dim", 256}, {"data", "data/kjv"}});
  Trainer& set_run_config(nlohmann::json config) {
    run_config_ = std::move(config);
    return *this;
  }

  /// Writes a checkpoint of the state after step steps_taken() into options().checkpoint_dir():
  /// weights, Trainer state, random states, `loader`'s position (when it is a ResumableSource),
  /// the options and run config. `reason` is recorded ("interval", "SIGTERM", "end", ...).
  template <class Loader>
  std::string save_checkpoint(const Loader& loader, const std::string& reason) {
    TORCH_CHECK(checkpointing(), "memopt::Trainer::save_checkpoint: no checkpoint directory is set. "
                "HINT: TrainerOptions().checkpoint_dir(\"runs/a/checkpoints\")");
    nlohmann::json state = {{"reason", reason},
                            {"trainer", name()},
                            {"options", options_.resume_settings()},
                            {"config", run_config_},
                            {"consecutive_skips", consecutive_skips_},
                            {"micro_splits", micro_splits_}};
    if constexpr (ResumableSource<Loader>) state["loader"] = loader.state();
    if (world_->distributed()) {  // every rank saves (a collective); rank 0 writes, other ranks their shards
      state["world_size"] = world_->size();
      state["ranks"] = rank_states(loader);
      if (world_->rank() != 0) {
        const std::string tmp = manager().path_of(step_) + ".tmp";
        if (param_share_) {
          world_->barrier("checkpoint: directory made");
          io::write_trainer_file(tmp + "/" + shard_file(world_->rank()), *this);
          world_->barrier("checkpoint: shards written");
        }
        last_checkpoint_ = manager().path_of(step_);
      }
    }
    if (world_->rank() == 0) {
      last_checkpoint_ = manager().save(step_, [&](const std::string& tmp) {
        std::vector<std::string> shards;  // the other ranks' optimizer state, listed in the manifest
        if (param_share_) {
          world_->barrier("checkpoint: directory made");
          world_->barrier("checkpoint: shards written");
          for (int r = 1; r < world_->size(); ++r) shards.push_back(shard_file(r));
        }
        io::write_checkpoint(tmp, *model_, *this, state, shards);
      });
    }
    world_->barrier("checkpoint: saved");
    last_saved_step_ = step_;
    for (auto& cb : callbacks_) cb->on_checkpoint(step_, last_checkpoint_, reason);
    return last_checkpoint_;
  }

  /// Continues from a checkpoint: "latest" (the newest in options().checkpoint_dir() that passes
  /// its checksums; refused ones are reported on stderr) or a step-N directory. Refuses one
  /// written by other policies, options or run config, naming each difference (max_steps may
  /// change). Restores weights, optimizer and precision state, step, random states and
  /// `loader`'s position. Returns false, changing nothing, when "latest" finds no checkpoint.
  ///   if (!trainer.resume("latest", loader)) fmt::print("starting a new run\n");
  template <class Loader>
  bool resume(const std::string& spec, Loader& loader) {
    const std::string who = "memopt::Trainer::resume('" + spec + "')";
    TORCH_CHECK(spec != "latest" || checkpointing(), who, ": 'latest' needs a checkpoint directory. "
                "HINT: set TrainerOptions().checkpoint_dir(...), or pass a step-N directory");
    const io::CheckpointManager checkpoints =
        checkpointing() ? manager() : io::CheckpointManager(std::filesystem::path(spec).parent_path().string() + "/.", 1);
    std::vector<std::string> refused;
    const std::string dir = checkpoints.resolve(spec, &refused);
    for (const auto& reason : refused) fmt::print(stderr, "memopt: refused a checkpoint, using an older one: {}\n", reason);
    if (dir.empty()) return false;

    const nlohmann::json state = io::read_checkpoint_state(dir);
    TORCH_CHECK(state.value("trainer", "") == name(), who, ": '", dir, "' was written by ", state.value("trainer", "?"),
                ", this is ", name(), ". HINT: resume with the policies of the run that wrote it");
    auto differences = io::setting_differences(state.value("options", nlohmann::json()), options_.resume_settings(),
                                               {"max_steps"});
    const auto config = io::setting_differences(state.value("config", nlohmann::json()), run_config_, {}, "config");
    differences.insert(differences.end(), config.begin(), config.end());
    std::string listed;
    for (const auto& d : differences) listed += "\n  " + d;
    TORCH_CHECK(differences.empty(), who, ": '", dir, "' was written with other settings:", listed,
                "\nHINT: resume with the settings of the run that wrote it, or start a new run elsewhere");
    const int saved_world = state.value("world_size", 1);
    TORCH_CHECK(saved_world == world_->size(), who, ": '", dir, "' was written by ", saved_world, " rank(s), this run has ",
                world_->size(), ". HINT: resume with the number of ranks (--nproc_per_node) of the run that wrote it");
    const nlohmann::json* mine = world_->distributed() ? &state.at("ranks").at(static_cast<size_t>(world_->rank())) : &state;
    if constexpr (ResumableSource<Loader>) {
      TORCH_CHECK(mine->contains("loader"), who, ": '", dir, "' holds no data-loader position. "
                  "HINT: it was written with a loader that has no state()");
      loader.load_state((*mine)["loader"]);
    }
    const bool own_shard = param_share_ && world_->rank() != 0;
    io::read_checkpoint(dir, *model_, *this, /*verify=*/false, own_shard ? shard_file(world_->rank()) : "trainer.pt");
    if (world_->distributed()) restore_cpu_rng(mine->at("rng_cpu").get<std::string>());
    consecutive_skips_ = state.value("consecutive_skips", int64_t{0});
    micro_splits_ = options_.memory_budget() > 0 ? state.value("micro_splits", int64_t{1}) : 1;
    last_saved_step_ = step_;
    last_checkpoint_ = dir;
    return true;
  }

  int64_t steps_taken() const { return step_; }
  /// Pieces each micro-batch is cut into to stay within memory_budget (1: none).
  int64_t micro_splits() const { return micro_splits_; }
  /// The checkpoint last written or resumed from ("" if none).
  const std::string& last_checkpoint() const { return last_checkpoint_; }
  const TrainerOptions& options() const { return options_; }
  torch::optim::Optimizer& optimizer() { return *optimizer_; }
  Precision& precision() { return precision_; }
  const Accum& accum() const { return accum_; }
  const Checkpoint& checkpoint() const { return checkpoint_; }
  const Offload& offload() const { return offload_; }

  /// What a resumed run needs besides the weights (optimizer state, step, loss scale, fp32 masters).
  void save_state(torch::serialize::OutputArchive& archive) const {
    torch::serialize::OutputArchive optimizer(archive.compilation_unit());
    optimizer_->save(optimizer);
    archive.write("optimizer", optimizer);                            // whichever optimizer Offload built
    archive.write("step", torch::tensor(step_, torch::kLong));        // drives the learning-rate schedule
    if constexpr (requires { precision_.scaler(); }) {                // Scaled<>: dynamic loss scale
      archive.write("loss_scale", torch::tensor(precision_.scaler().current_scale(), torch::kDouble));
      archive.write("loss_scale_clean_steps", torch::tensor(precision_.scaler().clean_steps(), torch::kLong));
    }
    if constexpr (requires { precision_.masters(); }) {               // Bf16Pure: the fp32 weights stepped
      for (size_t i = 0; i < precision_.masters().size(); ++i)
        archive.write("master_" + std::to_string(i), precision_.masters()[i].second);
    }
  }

  /// Restores save_state()'s archive into a Trainer built with the same model, options and policies.
  void load_state(torch::serialize::InputArchive& archive) {
    auto read = [&](const std::string& key, auto& value) {
      TORCH_CHECK(archive.try_read(key, value), "memopt::Trainer::load_state: the archive has no '", key,
                  "' entry. HINT: load a state written by Trainer::save_state of a Trainer with the same policies.");
    };
    torch::serialize::InputArchive optimizer;
    read("optimizer", optimizer);
    optimizer_->load(optimizer);
    torch::Tensor step;
    read("step", step);
    step_ = step.item<int64_t>();
    if constexpr (requires { precision_.scaler(); }) {
      torch::Tensor scale, clean_steps;
      read("loss_scale", scale);
      read("loss_scale_clean_steps", clean_steps);
      precision_.scaler().load(scale.item<double>(), clean_steps.item<int64_t>());
    }
    if constexpr (requires { precision_.masters(); }) {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < precision_.masters().size(); ++i) {
        torch::Tensor master;
        read("master_" + std::to_string(i), master);
        precision_.masters()[i].second.copy_(master);
      }
    }
  }

 private:
  static TrainerOptions validated(TrainerOptions o) {
    o.validate();
    return o;
  }
  static Accum make_accum_policy(const TrainerOptions& o) {
    if constexpr (std::is_constructible_v<Accum, int64_t>) {
      return Accum(o.accum_steps());
    } else {
      return Accum{};
    }
  }

  template <class Loader>
  std::vector<batch_of<Loader>> next_micro_batches(Loader& loader) {
    std::vector<batch_of<Loader>> batches;
    batches.reserve(static_cast<size_t>(accum_.micro_steps()));
    for (int64_t m = 0; m < accum_.micro_steps(); ++m) batches.push_back(loader.next().to(device_));
    return batches;
  }

  template <class B>
  torch::Tensor count_targets(const std::vector<B>& batches) const {
    torch::Tensor n = batches.front().num_targets().to(device_);
    for (size_t m = 1; m < batches.size(); ++m) n = n + batches[m].num_targets().to(device_);
    return n.to(torch::kFloat);  // step() clamps it to >= 1 (after summing over the ranks)
  }

  template <class B>
  static int64_t tokens_in(const std::vector<B>& batches) {
    int64_t n = 0;
    for (const auto& b : batches) n += b.num_tokens();
    return n;
  }

  // Every micro-batch's forward and backward, each cut into micro_splits_ pieces. With a
  // memory_budget, the tracker refuses allocations over it during forward and backward; on
  // that (or any out-of-memory error) the gradients are dropped, the split doubles, and the
  // step runs again on the same micro-batches and random state: same effective batch, same
  // target count, the dropout masks a run that started with this split would draw.
  template <class B, class LossFn>
  torch::Tensor accumulate(const std::vector<B>& micro_batches, LossFn& loss_fn, const torch::Tensor& num_targets) {
    const auto rng = options_.memory_budget() > 0 ? detail::RngState::capture() : detail::RngState{};
    while (true) {
      try {
        LimitScope limit(options_.memory_budget());
        torch::Tensor loss_sum = torch::zeros({}, torch::TensorOptions().device(device_));
        for (const auto& batch : micro_batches)
          for (const auto& piece : pieces(batch)) loss_sum += forward_backward(piece, loss_fn, num_targets);
        return loss_sum;
      } catch (const c10::OutOfMemoryError& e) {
        if (options_.memory_budget() == 0) throw;
        zero_grad();
        split_further(micro_batches.front(), e);
        rng.restore();
      }
    }
  }

  template <class B>
  std::vector<B> pieces(const B& batch) const {
    if constexpr (SplittableBatch<B>) {
      return micro_splits_ == 1 ? std::vector<B>{batch} : batch.split(micro_splits_);
    } else {
      return {batch};
    }
  }

  // Doubles micro_splits_, or throws when a piece is one sequence already (or cannot be cut).
  template <class B>
  void split_further(const B& batch, const c10::OutOfMemoryError& e) {
    using memory::mib;
    const int64_t budget = options_.memory_budget();
    const int64_t need = memory::Tracker::instance().last_refused_need();
    if constexpr (SplittableBatch<B>) {
      const int64_t rows = batch.rows();
      TORCH_CHECK(rows / micro_splits_ > 1, "memopt::Trainer: memory_budget ", fmt::format("{:.1f}", mib(budget)),
                  " MiB is too small: step ", step_ + 1, " with micro-batches of ", (rows + micro_splits_ - 1) / micro_splits_,
                  " sequence(s) needs at least ", fmt::format("{:.1f}", mib(need)), " MiB (", e.what_without_backtrace(),
                  "). HINT: raise the budget, shorten the sequences, or pick lighter policies "
                  "(checkpoint::EveryBlock, precision::Bf16Autocast; memopt::plan() finds them)");
      micro_splits_ *= 2;
      const std::string note = fmt::format(
          "memopt: step {} went over the memory budget ({:.1f} MiB; it needed {:.1f} MiB): micro-batches of {} "
          "sequences are now run as {} pieces of about {} (accumulation x{}; the effective batch is unchanged)",
          step_ + 1, mib(budget), mib(need), rows, micro_splits_, (rows + micro_splits_ - 1) / micro_splits_,
          micro_splits_);
      for (auto& cb : callbacks_) cb->on_notice(note);
    } else {
      TORCH_CHECK(false, "memopt::Trainer: step ", step_ + 1, " went over memory_budget ",
                  fmt::format("{:.1f}", mib(budget)), " MiB (", e.what_without_backtrace(), ") and its batch type cannot be "
                  "cut smaller (no split()). HINT: raise the budget or use a smaller batch (GradCache: a smaller chunk)");
    }
  }

  // The tracker's limit for a scope (0: none).
  struct LimitScope {
    explicit LimitScope(int64_t bytes) : active(bytes > 0) {
      if (active) memory::Tracker::instance().set_limit(bytes);
    }
    ~LimitScope() {
      if (active) memory::Tracker::instance().set_limit(0);
    }
    bool active;
  };

  // One micro-batch's forward and backward; returns its share of the step's loss, detached.
  // accum::GradCache runs both itself (chunks, cached representation gradients).
  template <class B, class LossFn>
  torch::Tensor forward_backward(const B& batch, LossFn& loss_fn, const torch::Tensor& num_targets) {
    if constexpr (hooks::RunsMicroBatch<Accum>) {
      return accum_.forward_backward(batch, loss_fn, checkpoint_, precision_, device_.type(), 1.0 / num_targets);
    } else {
      auto& tracker = memory::Tracker::instance();
      tracker.set_phase(memory::Phase::kForward);
      torch::Tensor loss = forward_loss(batch, loss_fn) / num_targets;  // 0-dim
      tracker.set_phase(memory::Phase::kBackward);
      precision_.backward(loss);
      return loss.detach();
    }
  }

  std::vector<torch::optim::OptimizerParamGroup> master_groups(std::vector<torch::optim::OptimizerParamGroup> groups,
                                                               const std::vector<torch::Tensor>& others) {
    if constexpr (hooks::MasterGroups<Precision>) {
      static_assert(hooks::CastWeights<Precision>, "a precision policy with master_groups needs cast_weights "
                                                   "(a sharded optimizer state's other parameters)");
      precision_.cast_weights(others);
      return precision_.master_groups(std::move(groups));
    } else {
      return groups;
    }
  }

  void prepare_grads() {
    if constexpr (hooks::PrepareGrads<Precision>) precision_.prepare_grads(*optimizer_);
  }

  // Steps in backward need one gradient per parameter per step, taken whole: reject what
  // would need every gradient at once, at compile time where the policy types say so.
  void check_steps_in_backward() const {
    if constexpr (hooks::StepsInBackward<Offload>) {
      static_assert(!hooks::PrepareGrads<Precision>,
                    "memopt::Trainer: offload::StepInBackward cannot combine with a precision policy that prepares "
                    "the gradients before the step (Scaled's inf/nan check, Bf16Pure's master weights): use "
                    "precision::Fp32 or Bf16Autocast");
      if constexpr (requires { typename std::integral_constant<int64_t, Accum::micro_steps()>; })
        static_assert(Accum::micro_steps() == 1,
                      "memopt::Trainer: offload::StepInBackward cannot combine with gradient accumulation "
                      "(each micro-batch's gradient would update the weights): use accum::None");
      TORCH_CHECK(accum_.micro_steps() == 1,
                  "memopt::Trainer: offload::StepInBackward needs 1 micro-batch per step (got accumulation over ",
                  accum_.micro_steps(), "). HINT: use offload::None for gradient accumulation.");
      TORCH_CHECK(options_.grad_clip() == 0,
                  "memopt::Trainer: offload::StepInBackward cannot clip by the global gradient norm (got grad_clip ",
                  options_.grad_clip(), "): each update runs before the other gradients exist. "
                  "HINT: set TrainerOptions().grad_clip(0).");
    }
  }

  template <class B, class LossFn>
  torch::Tensor forward_loss(const B& batch, LossFn& loss_fn) {
    auto autocast = precision_.autocast(device_.type());  // no-op for Fp32
    return loss_fn(batch, checkpoint_).to(torch::kFloat);
  }

  bool checkpointing() const { return !options_.checkpoint_dir().empty(); }
  io::CheckpointManager manager() const {
    return io::CheckpointManager(options_.checkpoint_dir(), options_.keep_checkpoints());
  }

  // Whether the step may update: loss and gradient norm finite (one host sync). Not checked
  // when updates happen inside backward (offload::StepInBackward) or skip_nonfinite is off.
  bool finite(const torch::Tensor& loss_sum, const torch::Tensor& grad_norm) const {
    if constexpr (hooks::StepsInBackward<Offload>) {
      return true;
    } else {
      if (!options_.skip_nonfinite()) return true;
      return (loss_sum.isfinite() & grad_norm.isfinite()).item<bool>();
    }
  }

  void skip_step() {
    if constexpr (requires { precision_.skip_step(); }) precision_.skip_step();
  }

  // Counts skipped steps in a row; at max_consecutive_skips, checkpoints (the weights are
  // those of the last good step: skipped steps change nothing) and throws.
  template <class Loader>
  void stop_if_diverged(const StepStats& s, const Loader& loader) {
    consecutive_skips_ = s.stepped ? 0 : consecutive_skips_ + 1;
    const int64_t limit = options_.max_consecutive_skips();
    if (limit == 0 || consecutive_skips_ < limit) return;
    const std::string saved = checkpointing() ? "the last good state is saved in '" +
                                                    save_checkpoint(loader, "nonfinite") + "'"
                                              : std::string("no checkpoint_dir is set, so nothing was saved");
    TORCH_CHECK(false, "memopt::Trainer: ", consecutive_skips_, " steps in a row (", s.step - consecutive_skips_ + 1,
                " to ", s.step, ") had a non-finite loss or gradient norm (max_consecutive_skips ", limit,
                "), so the run stops; ", saved, " (the weights after step ", s.step - consecutive_skips_,
                "). HINT: lower the learning rate or warm up longer, check the data of these steps, "
                "or raise TrainerOptions::max_consecutive_skips");
  }

  double set_learning_rate(int64_t step) {
    const double lr = optim::scheduled_lr(step, options_.lr(), options_.warmup_steps(), options_.max_steps(),
                                          options_.decay(), options_.min_lr_ratio());
    for (auto& group : optimizer_->param_groups()) group.options().set_lr(lr);
    return lr;
  }

  void zero_grad() {
    for (auto& p : params_) p.mutable_grad() = torch::Tensor();  // frees the gradient memory
    for (auto& p : step_params_) p.mutable_grad() = torch::Tensor();
  }

  // ---- data parallel (dist::world() of more than one rank) ----
  // Returns the parameters other ranks keep the optimizer state of (none unless sharded).
  std::vector<torch::Tensor> setup_data_parallel(torch::nn::Module& model,
                                                 std::vector<torch::optim::OptimizerParamGroup>& groups) {
    TORCH_CHECK(!hooks::StepsInBackward<Offload>, "memopt::Trainer: offload::StepInBackward updates each weight "
                "inside backward, before the gradients are summed over the ranks (world size ", world_->size(),
                "). HINT: use offload::None, Int8 or Disk for data-parallel training");
    if constexpr (requires { precision_.scaler(); }) {
      TORCH_CHECK(!options_.shard_optimizer_state(), "memopt::Trainer: a sharded optimizer state cannot combine with "
                  "fp16 loss scaling (its inf/nan check sees only this rank's shard). HINT: use bf16, or "
                  "shard_optimizer_state(false)");
    }
    dist::check_model(*world_, model);      // the same names and shapes everywhere, or an error naming the rank
    dist::broadcast_module(*world_, model);  // rank 0's initial weights on every rank
    const int64_t bucket_bytes = options_.bucket_mib() << 20;
    if (!options_.shard_optimizer_state()) {
      grad_sync_ = std::make_unique<dist::GradientSync>(*world_, params_, bucket_bytes);  // all-reduce
      return {};
    }
    const std::vector<int> owner = dist::owners(params_, world_->size());
    grad_sync_ = std::make_unique<dist::GradientSync>(*world_, params_, bucket_bytes, owner);  // reduce-scatter
    std::set<const void*> mine;
    std::vector<torch::Tensor> others;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (owner[i] == world_->rank()) {
        mine.insert(params_[i].unsafeGetTensorImpl());
      } else {
        others.push_back(params_[i]);
      }
    }
    std::vector<torch::optim::OptimizerParamGroup> kept;
    for (auto& group : groups) {
      std::vector<torch::Tensor> owned;
      for (const auto& p : group.params())
        if (mine.count(p.unsafeGetTensorImpl())) owned.push_back(p);
      if (!owned.empty()) kept.emplace_back(owned, group.options().clone());
    }
    TORCH_CHECK(!kept.empty(), "memopt::Trainer: rank ", world_->rank(), " owns no parameter (", params_.size(),
                " tensors over ", world_->size(), " ranks). HINT: use fewer ranks or shard_optimizer_state(false)");
    groups = std::move(kept);
    param_share_ = std::make_unique<dist::ParamShare>(*world_, params_, owner, options_.param_gather());
    return others;
  }

  // Whether this rank, or any other, cannot fill the next step. Data parallel: one 4-byte
  // all-reduce, so that the ranks stop at the same step (with finite streamed data dealt by
  // rank, one rank runs dry first; alone, it would start the end-of-run checkpoint while the
  // others wait for it in the next step's collectives).
  template <FiniteSource Loader>
  bool out_of_data(Loader& loader) {
    const bool dry = !loader.has_next(accum_.micro_steps());
    if (!world_->distributed()) return dry;
    torch::Tensor any = torch::scalar_tensor(dry ? 1.0F : 0.0F, torch::kFloat);
    world_->all_reduce_sum({any}, "out-of-data agreement");
    return any.item<float>() > 0;
  }

  // The global batch's target and token counts (one small all-reduce before forward).
  void sum_over_ranks(torch::Tensor& num_targets, int64_t& tokens) {
    torch::Tensor counts = torch::stack({num_targets.to(torch::kCPU, torch::kDouble),
                                         torch::scalar_tensor(static_cast<double>(tokens), torch::kDouble)});
    world_->all_reduce_sum({counts}, "target count all-reduce");
    num_targets = counts[0].to(device_, torch::kFloat);
    tokens = static_cast<int64_t>(counts[1].item<double>());
  }

  // Gradients, the loss and a pending stop signal, summed over the ranks.
  void sync_gradients(torch::Tensor& loss_sum) {
    const int local = stop_ != nullptr ? stop_->requested() : 0;
    torch::Tensor signal = torch::scalar_tensor(static_cast<float>(local), loss_sum.options());
    grad_sync_->sync({loss_sum, signal});
    agreed_stop_ = signal.item<float>() > 0 ? (local != 0 ? local : SIGTERM) : 0;
  }

  static std::string shard_file(int rank) { return "trainer-rank" + std::to_string(rank) + ".pt"; }

  // Every rank's loader position and CPU generator, gathered on rank 0 (through the store).
  template <class Loader>
  nlohmann::json rank_states(const Loader& loader) {
    const auto rng = memopt::detail::RngState::capture().cpu.contiguous();
    std::string hex;
    for (int64_t i = 0; i < rng.numel(); ++i) hex += fmt::format("{:02x}", rng.data_ptr<uint8_t>()[i]);
    nlohmann::json mine = {{"rng_cpu", hex}};
    if constexpr (ResumableSource<Loader>) mine["loader"] = loader.state();
    const std::string key = fmt::format("checkpoint/{}/{}", step_, world_->rank());
    if (world_->rank() != 0) {
      world_->store_set(key, mine.dump());
      return nullptr;
    }
    nlohmann::json all = nlohmann::json::array({mine});
    for (int r = 1; r < world_->size(); ++r)
      all.push_back(nlohmann::json::parse(world_->store_get(fmt::format("checkpoint/{}/{}", step_, r))));
    return all;
  }

  static void restore_cpu_rng(const std::string& hex) {
    TORCH_CHECK(hex.size() % 2 == 0, "memopt::Trainer::resume: \"rng_cpu\" of this rank is not hex. HINT: the "
                "checkpoint's state.json is damaged");
    torch::Tensor state = torch::empty({static_cast<int64_t>(hex.size() / 2)}, torch::kByte);
    for (size_t i = 0; i < hex.size() / 2; ++i)
      state.data_ptr<uint8_t>()[i] = static_cast<uint8_t>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
    memopt::detail::RngState rng;
    rng.cpu = state;
    rng.restore();
  }

  TrainerOptions options_;
  [[no_unique_address]] Checkpoint checkpoint_;
  [[no_unique_address]] Precision precision_;
  [[no_unique_address]] Accum accum_;
  [[no_unique_address]] Offload offload_;
  std::vector<torch::Tensor> params_;       // the model's trainable parameters
  std::vector<torch::Tensor> step_params_;  // what the optimizer updates (Bf16Pure: fp32 masters)
  c10::Device device_ = torch::kCPU;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::vector<std::shared_ptr<Callback>> callbacks_;
  torch::nn::Module* model_;   // what checkpoints save and resume() restores
  nlohmann::json run_config_ = nlohmann::json::object();
  int64_t step_ = 0;
  int64_t consecutive_skips_ = 0;
  int64_t last_saved_step_ = -1;
  int64_t micro_splits_ = 1;  // pieces per micro-batch (memory_budget)
  std::string last_checkpoint_;
  dist::World* world_ = nullptr;                      // dist::world(): one rank unless launched by torchrun
  std::unique_ptr<dist::GradientSync> grad_sync_;     // data parallel: the gradient all-reduce / reduce-scatter
  std::unique_ptr<dist::ParamShare> param_share_;     // sharded optimizer state: parameters after the step
  StopSignals* stop_ = nullptr;                       // fit()'s, for the ranks to agree on a stop
  int agreed_stop_ = 0;
};

}  // namespace memopt
