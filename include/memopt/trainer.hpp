// memopt/trainer.hpp — Trainer<Checkpoint, Precision, Accum, Offload>: the training loop
// with the chosen memory optimizations compiled in and the others costing nothing.
// The step reads top to bottom; policies are types, so there is no runtime branch on one.
#pragma once

#include <chrono>
#include <concepts>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include <torch/torch.h>

#include "memopt/batch.hpp"
#include "memopt/callbacks.hpp"
#include "memopt/concepts.hpp"
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

/// What fit() returns.
struct FitResult {
  int64_t steps = 0;
  double final_loss = 0;
  double tokens_per_s = 0;
  double seconds = 0;
  memory::Report memory;
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
      : options_(validated(options)), accum_(std::move(accum)), offload_(std::move(offload)) {
    memory::AllocatorOptions::parse(options_.alloc_conf(), "TrainerOptions::alloc_conf").apply();
    const int threads = options_.threads() > 0 ? options_.threads() : available_cpus();
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
    optimizer_ = offload_.make_optimizer(master_groups(std::move(groups)), adamw);
    for (auto& group : optimizer_->param_groups())
      for (auto& p : group.params()) step_params_.push_back(p);
    check_steps_in_backward();
  }

  /// Adds a callback (called in the order added).
  Trainer& add_callback(std::shared_ptr<Callback> cb) {
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

    // ---- forward + backward per micro-batch; gradients accumulate with += ----
    torch::Tensor loss_sum = torch::zeros({}, torch::TensorOptions().device(device_));
    for (const auto& batch : micro_batches) {
      loss_sum += forward_backward(batch, loss_fn, num_targets);  // 0-dim, this micro-batch's share
    }

    // ---- optimizer step ----
    tracker.set_phase(memory::Phase::kOptimizer);
    prepare_grads();                                       // Scaled: ÷ loss scale; Bf16Pure: → fp32 masters
    torch::Tensor grad_norm = optim::clip_grad_norm_(step_params_, options_.grad_clip());  // 0: steps in backward
    offload_.before_step(*optimizer_);
    const bool stepped = precision_.step(*optimizer_);    // false: inf/nan gradient, step skipped
    offload_.after_step(*optimizer_);
    zero_grad();
    tracker.set_phase(memory::Phase::kIdle);

    StepStats stats{++step_, lr, loss_sum, grad_norm, num_targets, tokens_in(micro_batches),
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), stepped};
    for (auto& cb : callbacks_) cb->on_step_end(stats);
    return stats;
  }

  /// Runs steps until options.max_steps(), logging every options.log_interval() steps.
  template <BatchSource Loader, LossFunction<Checkpoint, batch_of<Loader>> LossFn>
  FitResult fit(Loader& loader, LossFn&& loss_fn) {
    FitResult result;
    int64_t total_tokens = 0;
    int64_t tokens_since_log = 0, steps_since_log = 0;
    int64_t skipped_steps = 0;  // steps the precision policy skipped (inf/nan gradient), this fit()
    double seconds_since_log = 0;
    const auto fit_start = std::chrono::steady_clock::now();  // the ETA: mean wall time per step since here
    while (step_ < options_.max_steps()) {
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
    }
    result.tokens_per_s = static_cast<double>(total_tokens) / std::max(result.seconds, 1e-9);
    result.memory = memory::Report::now();
    for (auto& cb : callbacks_) cb->on_train_end(result.memory);
    return result;
  }

  int64_t steps_taken() const { return step_; }
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
    return n.clamp_min(1).to(torch::kFloat);
  }

  template <class B>
  static int64_t tokens_in(const std::vector<B>& batches) {
    int64_t n = 0;
    for (const auto& b : batches) n += b.num_tokens();
    return n;
  }

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

  std::vector<torch::optim::OptimizerParamGroup> master_groups(std::vector<torch::optim::OptimizerParamGroup> groups) {
    if constexpr (hooks::MasterGroups<Precision>) {
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
  int64_t step_ = 0;
};

}  // namespace memopt
