// memopt/trainer.hpp — Trainer<Recompute, Precision, Accum, State>: the training loop
// with the chosen memory optimizations compiled in and the others costing nothing.
// The step reads top to bottom; policies are types, so there is no runtime branch on one.
// It never loses more than the work since its last checkpoint: checkpoints every N steps,
// on SIGTERM/SIGINT and when it stops on non-finite values, and resume() restores one
// exactly (io/training_state.hpp). A step with an inf/nan loss or gradient norm is skipped.
// Its other concerns are components it holds: the memory-budget retry (memory/budget.hpp),
// the other ranks of a job (step_sync.hpp; data parallel is opt-in, memopt/dist.hpp).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <torch/torch.h>

#include "memopt/batch.hpp"
#include "memopt/callbacks.hpp"
#include "memopt/concepts.hpp"
#include "memopt/detail/deferred_checks.hpp"
#include "memopt/io/training_state.hpp"
#include "memopt/loop_types.hpp"
#include "memopt/memory/budget.hpp"
#include "memopt/memory/report.hpp"
#include "memopt/memory/tracker.hpp"
#include "memopt/optim/param_groups.hpp"
#include "memopt/optim/schedule.hpp"
#include "memopt/policies/accum.hpp"
#include "memopt/policies/recompute.hpp"
#include "memopt/policies/combination.hpp"
#include "memopt/policies/state.hpp"
#include "memopt/policies/precision.hpp"
#include "memopt/runtime.hpp"
#include "memopt/signals.hpp"
#include "memopt/step_sync.hpp"
#include "memopt/trainer_options.hpp"

namespace memopt {

/// The training loop. Policies are chosen at compile time; everything else at run time.
///
///   memopt::init();                                          // first line of main()
///   auto model = memopt::models::Llama(cfg);
///   memopt::Trainer<memopt::recompute::EveryBlock, memopt::precision::Bf16Autocast,
///                   memopt::accum::Fixed<4>> trainer(*model, memopt::TrainerOptions().lr(1e-3));
///   trainer.fit(loader, [&](const memopt::Batch& b, const auto& ckpt) { return model->loss_sum(b, ckpt); });
template <RecomputePolicy Recompute = recompute::None, PrecisionPolicy Precision = precision::Fp32,
          AccumPolicy Accum = accum::None, StatePolicy State = state::Resident>
class Trainer {
 public:
  using recompute_type = Recompute;
  using precision_type = Precision;
  using accum_type = Accum;
  using state_type = State;

  /// The instantiation, e.g. "Trainer<recompute::EveryBlock, precision::Bf16Autocast,
  /// accum::Runtime, state::Resident>" (what the planner's dispatch reports it ran).
  static std::string name() {
    return "Trainer<" + detail::policy_name<Recompute>() + ", " + detail::policy_name<Precision>() + ", " +
           detail::policy_name<Accum>() + ", " + detail::policy_name<State>() + ">";
  }

  /// Takes the model's trainable parameters; builds the optimizer through the State policy.
  Trainer(torch::nn::Module& model, TrainerOptions options) : Trainer(model, options, make_accum_policy(options)) {}
  Trainer(torch::nn::Module& model, TrainerOptions options, Accum accum)
      : Trainer(model, options, std::move(accum), State{}) {}
  /// With configured policy values: Trainer(model, options, accum::Runtime(4), state::Disk(disk_options)).
  Trainer(torch::nn::Module& model, TrainerOptions options, Accum accum, State opt_state)
      : options_(validated(options)), accum_(std::move(accum)), opt_state_(std::move(opt_state)), model_(&model),
        budget_(options_.memory_budget()), state_(options_.checkpoint_dir(), options_.keep_checkpoints()),
        sync_(make_step_sync(options_.data_parallel(), sync_options(options_))) {
    for (const auto& p : model.parameters())
      if (p.requires_grad()) params_.push_back(p);
    TORCH_CHECK(!params_.empty(), "memopt::Trainer: the model has no trainable parameters. "
                                  "HINT: register parameters with register_parameter/register_module.");
    device_ = params_.front().device();
    if constexpr (hooks::PrepareDevice<Precision>) precision_.prepare(device_.type());
    auto adamw = torch::optim::AdamWOptions(options_.lr())
                     .betas({options_.beta1(), options_.beta2()})
                     .eps(options_.eps())
                     .weight_decay(options_.weight_decay());
    auto groups = options_.param_specific_decay() ? optim::param_groups(model.named_parameters(), adamw)
                                                  : optim::single_group(params_, adamw);
    check_combination<Recompute, Precision, Accum, State>(options_, accum_, *sync_);  // or a clear error
    std::vector<torch::Tensor> others = sync_->setup(model, params_, groups);  // sharded: other ranks' parameters
    for (const auto& flat : sync_->flat_params()) params_.push_back(flat);     // ZeRO-3: what stands for the blocks
    for (const auto& p : model.parameters())  // frozen (LoRA's base): no master anywhere, cast like the others
      if (!p.requires_grad() && p.is_floating_point()) others.push_back(p);
    optimizer_ = opt_state_.make_optimizer(master_groups(std::move(groups), others), adamw);
    for (auto& group : optimizer_->param_groups())
      for (auto& p : group.params()) step_params_.push_back(p);
    TORCH_CHECK(options_.memory_budget() == 0 || device_.is_cuda() || memory::Tracker::instance().installed(),
                "memopt::Trainer: memory_budget ", options_.memory_budget(), " needs the memory tracker, which is "
                "not installed. HINT: call memopt::init() first in main()");
  }

  /// Adds a callback (called in the order added). Data parallel: on every rank, but a reporter
  /// (Callback::main_rank_only()) on rank 0 only.
  Trainer& add_callback(std::shared_ptr<Callback> cb) {
    if (cb->main_rank_only() && sync_->rank() != 0) return *this;
    callbacks_.push_back(std::move(cb));
    return *this;
  }

  /// One optimizer step over accum_.micro_steps() micro-batches from `loader`.
  template <BatchSource Loader, LossFunction<Recompute, batch_of<Loader>> LossFn>
  StepStats step(Loader& loader, LossFn&& loss_fn) {
    const auto start = std::chrono::steady_clock::now();
    for (auto& cb : callbacks_) cb->on_step_begin(step_ + 1);
    auto& tracker = memory::Tracker::instance();
    detail::PreserveRng rng(options_.preserve_rng_state());  // checkpointed blocks replay dropout's draws

    const double lr = set_learning_rate(step_);  // before backward: state::StepInBackward steps there

    // ---- the effective batch: its micro-batches and their target count, summed over the ranks ----
    auto micro_batches = next_batches(loader, accum_.micro_steps(), device_);  // micro_steps × (B, T)
    torch::Tensor num_targets = count_targets(micro_batches, device_);         // 0-dim, no host sync
    int64_t tokens = count_tokens(micro_batches);
    sync_->sum_counts(num_targets, tokens);  // data parallel: the global batch's
    num_targets = num_targets.clamp_min(1);

    // ---- forward + backward per micro-batch (cut smaller if over memory_budget); grads accumulate ----
    detail::DeferredChecks::Scope checks(checks_, !hooks::StepsInBackward<State>);  // read by finite()
    sync_->gather_params();                                // ZeRO-3: the root unit (embedding, head) whole
    torch::Tensor loss_sum = accumulate(micro_batches, loss_fn, num_targets);  // 0-dim, the step's mean loss
    agreed_stop_ = sync_->sync_gradients(loss_sum, pending_signal());  // once, after the last micro-batch

    // ---- optimizer step ----
    tracker.set_phase(memory::Phase::kOptimizer);
    prepare_grads();                                       // Scaled: ÷ loss scale; Bf16Pure: → fp32 masters
    torch::Tensor grad_norm = sync_->clip_grad_norm_(step_params_, options_.grad_clip());
    bool stepped = false;
    if (finite(loss_sum, grad_norm)) {                     // the one host sync; inf/nan: weights and state untouched
      opt_state_.before_step(*optimizer_);
      stepped = precision_.step(*optimizer_);              // false: the loss scaler found inf/nan
      opt_state_.after_step(*optimizer_);
      if (stepped) sync_->share_params();                  // sharded: each rank's updated parameters to all
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

  /// Runs steps until options.max_steps(), logging every options.log_interval() steps. The model
  /// is whole on every rank when it returns (ZeRO-3 gathers it; StepSync::unshard).
  template <BatchSource Loader, LossFunction<Recompute, batch_of<Loader>> LossFn>
  FitResult fit(Loader& loader, LossFn&& loss_fn) {
    StopSignals stop(options_.handle_signals());  // SIGTERM/SIGINT: finish the step, checkpoint, return
    stop_ = &stop;
    struct Forget {  // stop_ points into this frame only
      StopSignals*& p;
      ~Forget() { p = nullptr; }
    } forget{stop_};
    FitResult result;
    FitMeter meter(options_.max_steps());  // totals, and the window since the last log line
    while (step_ < options_.max_steps()) {
      if constexpr (FiniteSource<Loader>) {  // every rank stops before a step one of them cannot fill
        if ((result.data_exhausted = sync_->any(!loader.has_next(accum_.micro_steps()), "out-of-data agreement")))
          break;
      }
      StepStats s = step(loader, loss_fn);
      meter.add(s);
      if (s.step % options_.log_interval() == 0 || s.step == options_.max_steps()) {
        const LogLine line = meter.log_line(s);
        result.final_loss = line.loss;
        for (auto& cb : callbacks_) cb->on_log(line);
      }
      stop_if_diverged(s, loader);  // throws after max_consecutive_skips skipped steps in a row (checkpointed)
      if (state_.enabled() && options_.save_every() > 0 && s.step % options_.save_every() == 0)
        save_checkpoint(loader, "interval");
      // Data parallel: the ranks stop together, at the step whose gradient sync carried a signal.
      if ((result.stop_signal = sync_->distributed() ? agreed_stop_ : stop.requested()) != 0) {
        if (state_.enabled()) save_checkpoint(loader, signal_name(result.stop_signal));
        break;
      }
    }
    if (state_.enabled() && state_.last_saved_step() != step_) save_checkpoint(loader, "end");
    meter.finish(result);
    result.micro_splits = budget_.splits();
    result.checkpoint = state_.last_checkpoint();
    result.memory = memory::Report::now();
    sync_->unshard();  // ZeRO-3: the model whole again on every rank, for evaluation and export
    for (auto& cb : callbacks_) cb->on_train_end(result.memory);
    return result;
  }

  /// Settings of the run a resume must match besides the options (model shape, data, flags):
  /// stored in each checkpoint, compared by resume().
  ///   trainer.set_run_config({{"layers", 4}, {"dim", 256}, {"data", "data/kjv"}});
  Trainer& set_run_config(nlohmann::json config) {
    state_.set_run_config(std::move(config));
    return *this;
  }

  /// Writes a checkpoint of the state after step steps_taken() into options().checkpoint_dir():
  /// weights, Trainer state, random states, `loader`'s position (when it is a ResumableSource),
  /// the options and run config. `reason` is recorded ("interval", "SIGTERM", "end", ...).
  template <class Loader>
  std::string save_checkpoint(const Loader& loader, const std::string& reason) {
    std::string dir;
    sync_->with_full_weights([&] { dir = state_.save(*model_, *this, *sync_, loader, record(), reason); }, false);
    for (auto& cb : callbacks_) cb->on_checkpoint(step_, dir, reason);
    return dir;
  }

  /// Continues from a checkpoint: "latest" (the newest in options().checkpoint_dir() that passes
  /// its checksums; refused ones are reported on stderr) or a step-N directory. Refuses one
  /// written by other policies, options or run config, naming each difference (max_steps may
  /// change). Restores weights, optimizer and precision state, step, random states, `loader`'s
  /// position and, on the same CPU kind, the kernels the saving run measured (kernel_choices.hpp).
  /// Returns false, changing nothing, when "latest" finds no checkpoint.
  ///   if (!trainer.resume("latest", loader)) fmt::print("starting a new run\n");
  template <class Loader>
  bool resume(const std::string& spec, Loader& loader) {
    std::optional<nlohmann::json> state;
    sync_->with_full_weights([&] { state = state_.resume(spec, *model_, *this, *sync_, loader, record(), {"max_steps"}); },
                             /*write_back=*/true);
    if (!state) return false;
    consecutive_skips_ = state->value("consecutive_skips", int64_t{0});
    budget_.restore_splits(state->value("micro_splits", int64_t{1}));
    return true;
  }

  /// Runs `f` with the model's parameters whole: with TrainerOptions::shard_params (ZeRO-3) the
  /// blocks are gathered for it (every rank must call it), else it just runs `f`. For evaluating
  /// or exporting the model outside step().
  ///   trainer.with_full_weights([&] { val_loss = evaluate(model, val_loader); });
  void with_full_weights(const std::function<void()>& f) { sync_->with_full_weights(f, /*write_back=*/false); }

  int64_t steps_taken() const { return step_; }
  /// Pieces each micro-batch is cut into to stay within memory_budget (1: none).
  int64_t micro_splits() const { return budget_.splits(); }
  /// The checkpoint last written or resumed from ("" if none).
  const std::string& last_checkpoint() const { return state_.last_checkpoint(); }
  const TrainerOptions& options() const { return options_; }
  torch::optim::Optimizer& optimizer() { return *optimizer_; }
  Precision& precision() { return precision_; }
  const Accum& accum() const { return accum_; }
  const Recompute& recompute() const { return recompute_; }
  const State& optimizer_state() const { return opt_state_; }

  /// What a resumed run needs besides the weights: optimizer state, step, and each policy's own
  /// (hooks::SavesState: Scaled's loss scale, Bf16Pure's fp32 masters).
  void save_state(torch::serialize::OutputArchive& archive) const {
    torch::serialize::OutputArchive optimizer(archive.compilation_unit());
    optimizer_->save(optimizer);
    archive.write("optimizer", optimizer);                      // whichever optimizer State built
    archive.write("step", torch::tensor(step_, torch::kLong));  // drives the learning-rate schedule
    for_each_policy([&](const auto& policy) {
      if constexpr (hooks::SavesState<std::remove_cvref_t<decltype(policy)>>) policy.save_state(archive);
    });
  }

  /// Restores save_state()'s archive into a Trainer built with the same model, options and policies.
  void load_state(torch::serialize::InputArchive& archive) {
    torch::serialize::InputArchive optimizer;
    detail::read_state_entry(archive, "optimizer", optimizer);
    optimizer_->load(optimizer);
    torch::Tensor step;
    detail::read_state_entry(archive, "step", step);
    step_ = step.item<int64_t>();
    for_each_policy([&](auto& policy) {
      if constexpr (hooks::SavesState<std::remove_cvref_t<decltype(policy)>>) policy.load_state(archive);
    });
  }

 private:
  static TrainerOptions validated(TrainerOptions o) {
    o.validate();
    return o;
  }
  // What the StepSync is built with: the options', and with gather_half the precision's matmul dtype.
  static SyncOptions sync_options(const TrainerOptions& o) {
    SyncOptions sync = o.sync_options();
    if constexpr (hooks::MatmulDtype<Precision>) {
      if (o.gather_half()) sync.matrix_gather_dtype = Precision::kMatmulDtype;
    }
    return sync;
  }
  static Accum make_accum_policy(const TrainerOptions& o) {
    if constexpr (std::is_constructible_v<Accum, int64_t>) {
      return Accum(o.accum_steps());
    } else {
      return Accum{};
    }
  }

  template <class F>
  void for_each_policy(F&& f) {
    f(recompute_), f(precision_), f(accum_), f(opt_state_);
  }
  template <class F>
  void for_each_policy(F&& f) const {
    f(recompute_), f(precision_), f(accum_), f(opt_state_);
  }

  io::TrainerRecord record() const {
    std::string precision;
    if constexpr (hooks::Describes<Precision, memory::DtypeDesc>) precision = Precision::describe().flag;
    return {name(), precision, options_.resume_settings(), consecutive_skips_, budget_.splits()};
  }

  // Every micro-batch's forward and backward, within memory_budget (memory/budget.hpp).
  template <class B, class LossFn>
  torch::Tensor accumulate(const std::vector<B>& micro_batches, LossFn& loss_fn, const torch::Tensor& num_targets) {
    return budget_.run(
        micro_batches, step_ + 1, device_, [&](const B& piece) { return forward_backward(piece, loss_fn, num_targets); },
        [&] { zero_grad(); }, [&](const std::string& note) { for (auto& cb : callbacks_) cb->on_notice(note); });
  }

  // One micro-batch's forward and backward; returns its share of the step's loss, detached.
  // accum::GradCache runs both itself (chunks, cached representation gradients).
  template <class B, class LossFn>
  torch::Tensor forward_backward(const B& batch, LossFn& loss_fn, const torch::Tensor& num_targets) {
    if constexpr (hooks::RunsMicroBatch<Accum>) {
      return accum_.forward_backward(batch, loss_fn, recompute_, precision_, device_.type(), 1.0 / num_targets);
    } else {
      auto& tracker = memory::Tracker::instance();
      tracker.set_phase(memory::Phase::kForward);
      torch::Tensor loss = forward_loss(batch, loss_fn) / num_targets;  // 0-dim
      tracker.set_phase(memory::Phase::kBackward);
      precision_.backward(loss);
      return loss.detach();
    }
  }

  template <class B, class LossFn>
  torch::Tensor forward_loss(const B& batch, LossFn& loss_fn) {
    auto autocast = precision_.autocast(device_.type());  // no-op for Fp32
    return loss_fn(batch, recompute_).to(torch::kFloat);
  }

  std::vector<torch::optim::OptimizerParamGroup> master_groups(std::vector<torch::optim::OptimizerParamGroup> groups,
                                                               const std::vector<torch::Tensor>& others) {
    if constexpr (hooks::MasterGroups<Precision>) {
      static_assert(hooks::CastWeights<Precision>, "a precision policy with master_groups needs cast_weights "
                                                   "(frozen parameters, a sharded optimizer state's other parameters)");
      precision_.cast_weights(others);
      return precision_.master_groups(std::move(groups));
    } else {
      return groups;
    }
  }

  void prepare_grads() {
    if constexpr (hooks::PrepareGrads<Precision>) precision_.prepare_grads(*optimizer_);
  }

  // Whether the step may update: loss and gradient norm finite, read with the input checks
  // the step's building blocks deferred (bad targets throw here, before any update) in one
  // host sync. Not checked when updates happen inside backward (state::StepInBackward: the
  // checks ran at once there); finiteness not when skip_nonfinite is off.
  bool finite(const torch::Tensor& loss_sum, const torch::Tensor& grad_norm) const {
    if constexpr (hooks::StepsInBackward<State>) {
      return true;
    } else {
      const bool skip_nonfinite = options_.skip_nonfinite();
      if (!skip_nonfinite && checks_.empty()) return true;
      torch::Tensor ok = checks_.passed();  // 0-dim bool
      if (skip_nonfinite) ok = ok & loss_sum.isfinite() & grad_norm.isfinite();
      if (ok.item<bool>()) return true;
      checks_.throw_if_failed();
      return false;
    }
  }

  void skip_step() {
    if constexpr (hooks::SkipStep<Precision>) precision_.skip_step();
  }

  // Counts skipped steps in a row; at max_consecutive_skips, checkpoints (the weights are
  // those of the last good step: skipped steps change nothing) and throws.
  template <class Loader>
  void stop_if_diverged(const StepStats& s, const Loader& loader) {
    consecutive_skips_ = s.stepped ? 0 : consecutive_skips_ + 1;
    const int64_t limit = options_.max_consecutive_skips();
    if (limit == 0 || consecutive_skips_ < limit) return;
    const std::string saved = state_.enabled() ? "the last good state is saved in '" +
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

  // The SIGTERM/SIGINT fit() received (0: none), for the ranks to agree on a stop.
  int pending_signal() const { return stop_ != nullptr ? stop_->requested() : 0; }

  TrainerOptions options_;
  detail::DeferredChecks checks_;  // the current step's deferred input checks
  [[no_unique_address]] Recompute recompute_;
  [[no_unique_address]] Precision precision_;
  [[no_unique_address]] Accum accum_;
  [[no_unique_address]] State opt_state_;
  torch::nn::Module* model_;                // what checkpoints save and resume() restores
  memory::StepBudget budget_;               // memory_budget: micro-batches cut smaller
  io::TrainingState state_;                 // checkpoints of the run
  std::unique_ptr<StepSync> sync_;          // the other ranks (LocalSync: none)
  std::vector<torch::Tensor> params_;       // the model's trainable parameters
  std::vector<torch::Tensor> step_params_;  // what the optimizer updates (Bf16Pure: fp32 masters)
  c10::Device device_ = torch::kCPU;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::vector<std::shared_ptr<Callback>> callbacks_;
  int64_t step_ = 0;
  int64_t consecutive_skips_ = 0;
  StopSignals* stop_ = nullptr;  // fit()'s
  int agreed_stop_ = 0;          // the signal every rank stops on (0: none)
};

}  // namespace memopt
