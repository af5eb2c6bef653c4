// examples/02_moe — trains a Mixture-of-Experts LM (models/moe.hpp: top-k routing,
// capacity factor, load-balancing and z-loss, sort-based dispatch) on the King James corpus.
// Flags pick the policies: --recompute every (recompute::EveryBlock; the seed's
// --gradient_checkpointing), --precision auto|fp32|bf16|fp16 (auto: bf16 autocast where this
// device measured it faster; bf16 = precision::Bf16Autocast, the seed's --mixed_precision;
// fp16 = precision::Fp16Scaled, CUDA only), --grad_accum N (accum::Runtime, default 2 as the
// seed's script), --optimizer_state pinned-host (state::PinnedHost: AdamW's state in pinned host
// memory between steps; CUDA only); the seed project's "original" is --dispatch dense --precision fp32
// --grad_accum 1 without recompute. --preset memory_optimized (= --train_memory_optimized, the
// seed's script) turns on recompute every, --precision auto and --grad_accum 2 unless given.
// --attention math|blockwise|sdpa|flash|auto picks the attention, --release_cache_every N gives freed
// memory back every N steps (common/memory_flags.hpp), --memory_trace N traces the first N
// steps into OUT/memory.trace.json. It logs loss, aux loss, z-loss, dropped assignments and
// per-expert load, evaluates held-out perplexity, writes OUT/metrics.jsonl (a summary line
// last) and checkpoints to OUT/checkpoints (--save_every; --resume latest, a step-N folder or
// a run's output folder; SIGTERM/SIGINT save and exit 0);
// --plot draws OUT/metrics.png (loss and memory over steps; scripts/plot does the same).
//   build/examples/02_moe/moe_lm --config moe-nano --gradient_checkpointing --mixed_precision
//   build/examples/02_moe/moe_lm --train_memory_optimized --config moe-nano --batch_size 8
//   build/examples/02_moe/moe_lm --dense     # the dense LLaMA with the same active parameters
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <memopt/data/loader.hpp>
#include <memopt/data/shard.hpp>
#include <memopt/data/tokenizer.hpp>
#include <memopt/memopt.hpp>
#include <memopt/memory/estimator.hpp>
#include <memopt/planner.hpp>
#include <memopt/models/moe.hpp>
#include <memopt/plot.hpp>

#include "common/checkpoint_flags.hpp"
#include "common/device.hpp"
#include "common/eval.hpp"
#include "common/precision.hpp"
#include "common/cli.hpp"
#include "common/policy_flags.hpp"
#include "common/distributed.hpp"
#include "common/memory_flags.hpp"

namespace {

namespace fs = std::filesystem;
using memopt::models::Llama;
using memopt::models::MoeConfig;
using memopt::models::MoeLM;

/// What moe_lm compiles: recompute none/every × fp32, bf16 autocast, fp16 with loss scaling
/// (CUDA only) with AdamW's state resident — memopt::RecomputePrecisionTrainers plus fp16 — and
/// the same without fp16 with the state in pinned host memory (--optimizer_state pinned-host,
/// CUDA only). The flags, --policies auto's plan and --calibrate's probes all go through this list.
using MoeTrainers = typename memopt::detail::Concat<
    memopt::TypeList<>,
    memopt::TrainerProductT<memopt::TypeList<memopt::recompute::None, memopt::recompute::EveryBlock>,
                            memopt::TypeList<memopt::precision::Fp32, memopt::precision::Bf16Autocast,
                                             memopt::precision::Fp16Scaled>,
                            memopt::TypeList<memopt::state::Resident>>,
    examples::PinnedHostTrainers<>>::type;

struct Args {
  std::string data = "data/kjv";
  std::string output_dir = "runs/moe";
  std::string config = "moe-nano";
  int64_t steps = 60;
  int64_t batch_size = 8;
  int64_t grad_accum = 2;  // the seed's scripts/train_memory_optimized.sh default
  int64_t seq_len = 256;
  std::string preset = "none";      // none | memory_optimized (--train_memory_optimized)
  std::string preset_line;          // what the preset turned on ("" when none)
  std::string recompute = "none";  // none | every (--gradient_checkpointing = every)
  std::string precision = "auto";   // auto | fp32 | bf16 | fp16 (--mixed_precision = bf16)
  std::string precision_used = "fp32";  // --precision resolved on the device: fp32 | bf16 | fp16
  std::string optimizer_state = "resident";  // resident | pinned-host (CUDA)
  std::string device = "cpu";  // cpu | cuda[:N]
  std::string dispatch = "sorted";
  int64_t num_experts = 0;  // 0: the preset's
  int64_t top_k = 0;        // 0: the preset's
  double capacity_factor = 1.25;
  double router_jitter = 0.0;
  double aux_loss_coef = 0.01;
  double z_loss_coef = 0.001;
  bool checkpoint_experts = false;
  bool estimate_only = false;
  bool calibrate = false;          // measure the plan's choice by a real step
  std::string policies = "fixed";  // auto: the planner picks among MoeTrainers' combinations
  std::string memory_budget;
  bool dense = false;
  bool monitor_memory = false;
  bool plot = false;
  int64_t memory_trace = 0;  // steps traced into OUT/memory.trace.json (0: off)
  examples::MemoryFlags memory;  // --attention, --release_cache_every
  examples::CheckpointFlags checkpoints;
  examples::DistributedFlags distributed;
  double lr = 1e-3;
  int64_t warmup = 6;
  int64_t eval_batches = 16;
  int64_t log_interval = 5;
  int threads = 0;
  uint64_t seed = 1234;
};

// The run's settings that a resumed run must share (each checkpoint records them).
nlohmann::json run_settings(const Args& a) {
  return {{"config", a.config},         {"dense", a.dense},           {"num_experts", a.num_experts},
          {"top_k", a.top_k},           {"capacity_factor", a.capacity_factor},
          {"batch_size", a.batch_size}, {"grad_accum", a.grad_accum}, {"seq_len", a.seq_len},
          {"seed", a.seed},             {"dispatch", a.dispatch},     {"mixed_precision", a.precision_used != "fp32"}};
}

// --preset memory_optimized (= --train_memory_optimized, the seed's "applies all memory
// optimizations" script): recompute every block, machine-aware precision (auto) and gradient
// accumulation 2, so --batch_size × 2 sequences make an optimizer step, as the script's
// --batch_size 8 --grad_accum 2. A setting given explicitly, in any spelling, is kept. Sets
// a.preset_line to say what the preset turned on.
void apply_preset(Args& a, const CLI::App& app) {
  if (a.preset != "memory_optimized") return;
  std::vector<std::string> on, kept;
  if (examples::given(app, {"--recompute", "--checkpoint", "--gradient_checkpointing"})) {
    kept.push_back("--recompute " + a.recompute);
  } else {
    a.recompute = "every";
    on.push_back("recompute every block");
  }
  if (examples::given(app, {"--precision", "--mixed_precision", "--use_mixed_precision"})) {
    kept.push_back("--precision " + a.precision);
  } else {
    a.precision = "auto";
    on.push_back("precision auto (bf16 where measured faster)");
  }
  if (examples::given(app, {"--grad_accum", "--accum", "--gradient_accumulation_steps"})) {
    kept.push_back(fmt::format("--grad_accum {}", a.grad_accum));
  } else {
    a.grad_accum = 2;
    on.push_back("gradient accumulation 2");
  }
  a.preset_line = fmt::format("preset memory_optimized: {}{}; effective batch {} x {} = {} sequences per step\n",
                              on.empty() ? "nothing (every setting given)" : fmt::format("{}", fmt::join(on, ", ")),
                              kept.empty() ? "" : fmt::format(" (given: {})", fmt::join(kept, ", ")), a.batch_size,
                              a.grad_accum, a.batch_size * a.grad_accum);
}

MoeConfig model_config(const Args& a, int64_t vocab) {
  MoeConfig cfg = MoeConfig::preset(a.config, vocab);
  TORCH_CHECK(a.dispatch == "sorted" || a.dispatch == "dense", "moe_lm: --dispatch must be sorted or dense (got '",
              a.dispatch, "'). HINT: sorted is the memory-efficient one; dense is the one-hot reference.");
  cfg.num_experts(a.num_experts != 0 ? a.num_experts : cfg.num_experts())  // negative: validate() says why
      .top_k(a.top_k != 0 ? a.top_k : cfg.top_k())
      .capacity_factor(a.capacity_factor)
      .router_jitter(a.router_jitter)
      .aux_loss_coef(a.aux_loss_coef)
      .z_loss_coef(a.z_loss_coef)
      .dispatch(a.dispatch == "sorted" ? memopt::models::MoeDispatch::kSorted : memopt::models::MoeDispatch::kDense)
      .checkpoint_experts(a.checkpoint_experts);
  cfg.base().max_position_embeddings(std::max<int64_t>(a.seq_len, cfg.base().max_position_embeddings()));
  cfg.base(a.memory.apply(cfg.base(), "moe_lm"));  // --attention
  cfg.validate();
  return cfg;
}

template <class Model>
MoeLM* as_moe(Model& model) {
  if constexpr (std::is_same_v<Model, MoeLM>) {
    return &model;
  } else {
    return nullptr;
  }
}

// The router statistics of a log line: added to its metrics.jsonl object and printed.
memopt::callbacks::JsonlMetrics::Extra router_stats(MoeLM* moe) {
  if (moe == nullptr) return {};
  return [moe](const memopt::LogLine& l, nlohmann::json& j) {
    const auto s = (*moe)->take_stats();
    const auto& c = (*moe)->config;
    j["ce"] = l.loss - c.aux_loss_coef() * s.lb_loss - c.z_loss_coef() * s.z_loss;  // per-target CE
    j["aux_loss"] = s.lb_loss;
    j["z_loss"] = s.z_loss;
    j["dropped"] = s.dropped;
    j["expert_load"] = s.load;
    // On a terminal ProgressBar's line (stderr) has no newline yet: start below it.
    const bool below_bar = isatty(fileno(stdout)) != 0 && isatty(fileno(stderr)) != 0;
    fmt::print("{}  moe step {:>4} | ce {:.4f} | aux {:.4f} | z {:.3f} | dropped {:.2f}% | load {:.3f}\n",
               below_bar ? "\n" : "", l.step, j["ce"].get<double>(), s.lb_loss, s.z_loss, 100 * s.dropped,
               fmt::join(s.load, " "));
    std::fflush(stdout);
  };
}

// Mean next-token cross-entropy (no aux terms) over the first held-out batches.
template <class Model>
double heldout_loss(Model& model, const std::shared_ptr<const memopt::data::TokenShard>& shard, const Args& a) {
  return examples::heldout_loss(*model, shard, memopt::data::LoaderOptions(a.batch_size, a.seq_len), a.eval_batches,
                                model->parameters().front().device(), [&](const memopt::Batch& batch) {
                                  if constexpr (std::is_same_v<Model, MoeLM>) return model->ce_sum(batch);
                                  else return model->loss_sum(batch, memopt::recompute::None{});
                                });
}

struct Data {
  std::shared_ptr<const memopt::data::TokenShard> train, val;
  int64_t vocab = 0;
};

template <class Recompute, class Precision, class State, class Model>
int train(const Args& a, const Data& d, Model& model, const std::string& description) {
  using TrainerT = memopt::Trainer<Recompute, Precision, memopt::accum::Runtime, State>;
  model->to(examples::parse_device(a.device, "moe_lm"));  // the Trainer follows the parameters: batches go there
  const auto options = memopt::TrainerOptions()
                           .lr(a.lr)
                           .warmup_steps(a.warmup)
                           .max_steps(a.steps)
                           .accum_steps(a.grad_accum)
                           .log_interval(a.log_interval);
  const int64_t budget = a.memory_budget.empty() ? 0 : memopt::parse_bytes(a.memory_budget);
  TrainerT trainer(*model, a.memory.options(a.distributed.apply(a.checkpoints.apply(options, a.output_dir)
                                                                    .memory_budget(budget))));
  trainer.set_run_config(run_settings(a));
  a.memory.attach(trainer, "moe_lm");  // --release_cache_every
  auto& world = memopt::dist::world();  // data parallel: each rank trains on its rows of every batch
  memopt::data::RandomWindowLoader global(d.train,
                                          memopt::data::LoaderOptions(a.batch_size * world.size(), a.seq_len).seed(a.seed));
  memopt::dist::RankSlice loader(global, world.rank(), world.size());
  auto log = std::make_shared<memopt::callbacks::JsonlMetrics>(a.output_dir + "/metrics.jsonl", /*append=*/true,
                                                                 router_stats(as_moe(model)));
  a.checkpoints.resume_if_asked(trainer, loader, "moe_lm");
  if (a.monitor_memory) trainer.add_callback(std::make_shared<memopt::callbacks::MemoryMonitor>());
  if (a.memory_trace > 0)
    trainer.add_callback(std::make_shared<memopt::callbacks::MemoryTrace>(a.output_dir + "/memory.trace.json",
                                                                          a.memory_trace));
  trainer.add_callback(std::make_shared<memopt::callbacks::ProgressBar>());
  trainer.add_callback(log);

  int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();
  int64_t active = params;  // parameters a token passes through: top_k of the E experts per layer
  if (auto* moe = as_moe(model)) {
    const auto& c = (*moe)->config;
    active -= (c.num_experts() - c.top_k()) * c.base().num_hidden_layers() * 3 * c.base().hidden_size() *
              c.base().ffn_size();
  }
  fmt::print("moe_lm: {} — {:.2f} M parameters ({:.2f} M active per token), vocab {}, {} train / {} held-out tokens\n",
             description, params / 1e6, active / 1e6, d.vocab, d.train->size(), d.val->size());
  fmt::print("policies: {}, {}, {}, accum::Runtime({}) — effective batch {} x {} tokens, attention {}, {} threads\n",
             Recompute::name(), Precision::name(), State::name(), a.grad_accum, a.batch_size * a.grad_accum, a.seq_len,
             a.memory.attention, at::get_num_threads());
  std::fflush(stdout);

  const auto result = trainer.fit(loader, memopt::LossSum<Model>{&model});
  if (examples::stopped_by_signal(result, trainer.steps_taken(), "moe_lm")) return 0;
  const double loss = heldout_loss(model, d.val, a);
  fmt::print("held-out loss after {} steps {:.4f} (perplexity {:.1f}); {:.0f} tokens/s over {:.1f} s\n",
             trainer.steps_taken(), loss, std::exp(loss), result.tokens_per_s, result.seconds);
  fmt::print("{}", result.memory.table());
  const int64_t peak = std::max(log->run_peak(), result.memory.tensors.peak_bytes);
  log->write({{"event", "summary"},
              {"model", a.dense ? "dense" : a.config},
              {"params", params},
              {"active_params", active},
              {"steps", result.steps},
              {"tokens_per_s", result.tokens_per_s},
              {"seconds", result.seconds},
              {"final_loss", result.final_loss},
              {"eval_loss", loss},
              {"perplexity", std::exp(loss)},
              {"peak_tracked_mib", memopt::memory::mib(peak)},
              {"peak_rss_mib", memopt::memory::mib(result.memory.peak_rss_bytes)}});
  if (a.plot && memopt::dist::world().rank() == 0) {
    memopt::plot_metrics(a.output_dir + "/metrics.jsonl", a.output_dir + "/metrics.png");
    fmt::print("plot: {}/metrics.png (loss and memory over steps)\n", a.output_dir);
  }
  return 0;
}

// The policies the flags name (--recompute, --precision resolved, --grad_accum).
memopt::memory::PolicyDesc policies_of(const Args& a) {
  return memopt::parse_policies<MoeTrainers>(a.recompute, a.precision_used, a.optimizer_state, a.grad_accum);
}

// --calibrate's real steps: a throwaway `Model` of the run's shape (memopt::probe_steps).
template <class Model, class Config>
memopt::MeasureStep probe_steps(const Args& a, const Data& d, const Config& cfg) {
  return memopt::probe_steps<MoeTrainers>(
      memopt::TrainerOptions(), [cfg] { return Model(cfg); },
      [train = d.train, seq_len = a.seq_len](int64_t micro) {
        return memopt::data::RandomWindowLoader(train, memopt::data::LoaderOptions(micro, seq_len));
      },
      [](Model& probe) { return memopt::LossSum<Model>{&probe}; });
}

// One of the ten compiled combinations (MoeTrainers; --policies auto plans over the same
// list, fp16 and pinned-host only on CUDA), reached through memopt::dispatch.
template <class Model>
int train_with_flags(const Args& a, const Data& d, Model& model, const std::string& description) {
  return memopt::dispatch<MoeTrainers>(policies_of(a), [&]<class T>(std::type_identity<T>) {
    return train<typename T::recompute_type, typename T::precision_type, typename T::state_type>(a, d, model,
                                                                                                  description);
  });
}

int run(Args a) {  // a copy: --policies auto rewrites the policy flags
  // ---- options first: a bad flag fails before any data is read ----
  TORCH_CHECK(a.batch_size >= 1, "moe_lm: --batch_size must be >= 1 (got ", a.batch_size, "). HINT: try 8.");
  TORCH_CHECK(a.grad_accum >= 1, "moe_lm: --grad_accum must be >= 1 (got ", a.grad_accum, "). HINT: 1 turns it off.");
  TORCH_CHECK(a.seq_len >= 2, "moe_lm: --seq_len must be >= 2 (got ", a.seq_len, "). HINT: try 256.");
  a.memory.check("moe_lm");  // --attention, --release_cache_every
  a.checkpoints.apply(memopt::TrainerOptions(), a.output_dir).validate();  // --save_every, --keep_checkpoints, --max_skips
  TORCH_CHECK(!a.calibrate || !a.memory_budget.empty(), "moe_lm: --calibrate measures the plan for a budget (got no "
              "--memory_budget). HINT: add --memory_budget 512MiB (with --policies auto or your flags).");
  (void)model_config(a, /*vocab=*/2);  // checks the preset, the MoE flags and --attention
  const torch::Device device = examples::parse_device(a.device, "moe_lm");
  examples::check_precision(a.precision, "moe_lm", &device);  // fp16 too, on CUDA
  examples::check_state(a.optimizer_state, "moe_lm", device);  // pinned-host: CUDA only
  if (a.plot) memopt::check_gnuplot();  // before training, not after it

  // ---- data ----
  Data d;
  d.train = memopt::data::TokenShard::open(a.data + "/train.bin");
  d.val = memopt::data::TokenShard::open(a.data + "/val.bin");
  d.vocab = memopt::data::Tokenizer(a.data + "/tokenizer.model").vocab_size();
  d.train->check_vocab(d.vocab);
  d.val->check_vocab(d.vocab);
  fs::create_directories(a.output_dir);
  examples::join_world("moe_lm");  // torchrun: data parallel, rank 0 prints and writes the log
  if (memopt::dist::world().rank() == 0) fmt::print("{}", a.preset_line);  // what --preset turned on
  a.precision_used =
      examples::resolve_precision(a.precision, device, "moe_lm", a.checkpoints.saved_precision(a.output_dir));
  if (memopt::dist::world().rank() == 0)
    std::ofstream(a.output_dir + "/metrics.jsonl", a.checkpoints.resume.empty() ? std::ios::trunc : std::ios::app);

  // ---- model ----
  torch::manual_seed(static_cast<int64_t>(a.seed));
  const MoeConfig cfg = model_config(a, d.vocab);
  const bool planning = a.policies == "auto" || !a.memory_budget.empty() || a.distributed.automatic();
  if (a.estimate_only || planning) {  // memory/estimator.hpp, planner.hpp
    TORCH_CHECK(a.dispatch == "sorted", "moe_lm: the memory estimate models the sorted dispatch (got --dispatch ",
                a.dispatch, "). HINT: drop --dispatch dense, or measure it with a short run.");
    auto policies = policies_of(a);
    const auto desc = a.dense ? memopt::models::describe(cfg.dense_equivalent())
                              : memopt::models::describe(cfg);
    int64_t micro = a.batch_size;
    if (planning) {  // fixed + budget: the micro-batch finder only
      const auto chosen = memopt::choose_policies(
          desc, a.seq_len, policies, a.policies == "auto", memopt::candidates<MoeTrainers>(),
          a.distributed.plan_options(memopt::PlanOptions()  // on several ranks: the ZeRO stage(s) too
                                         .budget_bytes(a.memory_budget.empty() ? 0 : memopt::parse_bytes(a.memory_budget))
                                         .effective_batch(a.batch_size * a.grad_accum)
                                         .machine(memopt::MachineModel::from_device(device)),
                                     a.calibrate, "moe_lm"),
          a.calibrate ? (a.dense ? probe_steps<Llama>(a, d, cfg.dense_equivalent()) : probe_steps<MoeLM>(a, d, cfg))
                      : memopt::MeasureStep());
      policies = chosen.policies;
      micro = chosen.micro_batch;
      a.recompute = policies.recompute.flag;
      a.precision_used = policies.precision.flag;
      a.optimizer_state = policies.state.flag;
      a.batch_size = micro;
      a.grad_accum = policies.accum;
      a.distributed.adopt(chosen.zero);  // --zero auto: the chosen stage (train_with_flags applies it)
      torch::manual_seed(static_cast<int64_t>(a.seed));   // the run starts as it would have without the probes
      memopt::memory::Tracker::instance().reset_peaks();  // and its measured peak is its own
    }
    fmt::print("{} ({}, micro-batch {})\n{}", a.dense ? "dense equivalent" : a.config, policies.name(), micro,
               memopt::memory::estimate(desc, a.distributed.run({micro, a.seq_len}), policies).table());
    if (a.estimate_only) return 0;
  }
  if (a.dense) {
    Llama model(cfg.dense_equivalent());
    return train_with_flags(a, d, model,
                            fmt::format("dense LLaMA equal in active parameters to {} (SwiGLU {})", a.config,
                                        cfg.dense_equivalent().ffn_size()));
  }
  MoeLM model(cfg);
  return train_with_flags(a, d, model,
                          fmt::format("{}: {} layers, d{}, {} experts x SwiGLU {}, top-{}, capacity factor {}, "
                                      "{} dispatch",
                                      a.config, cfg.base().num_hidden_layers(), cfg.base().hidden_size(),
                                      cfg.num_experts(), cfg.base().ffn_size(), cfg.top_k(), cfg.capacity_factor(),
                                      a.dispatch));
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"Train a Mixture-of-Experts LM on the King James corpus with memopt's Trainer"};
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);  // a later flag overrides
  app.add_option("--data", a.data, "folder with train.bin, val.bin, tokenizer.model")->capture_default_str();
  app.add_option("--output_dir", a.output_dir, "metrics.jsonl and checkpoints/ go here")->capture_default_str();
  app.add_option("--config", a.config, "preset: " + MoeConfig::preset_names())->capture_default_str();
  app.add_option(examples::kSteps, a.steps, "optimizer steps (in all, a resumed run included)")->capture_default_str();
  app.add_option("--batch_size", a.batch_size, "sequences per micro-batch")->capture_default_str();
  app.add_option(examples::kAccum, a.grad_accum, "micro-batches per optimizer step (the seed's script: 2)")
      ->capture_default_str();
  app.add_option("--seq_len", a.seq_len, "tokens per sequence")->capture_default_str();
  examples::add_recompute_option(app, a.recompute, "none | every (recompute every block in backward)")
      ->check(CLI::IsMember({"none", "every"}))->capture_default_str();
  examples::add_precision_option(app, a.precision, "auto (bf16 autocast where this device's bf16 matmul measured "
                                 "faster than fp32) | fp32 | bf16 | fp16 (autocast with loss scaling; CUDA only)")
      ->capture_default_str();
  examples::add_state_option(app, a.optimizer_state, "resident | pinned-host (AdamW's state in pinned host memory "
                             "between steps; CUDA only, with --precision fp32 or bf16)")
      ->check(CLI::IsMember({"resident", "pinned-host"}))->capture_default_str();
  app.add_option("--preset", a.preset, "none | memory_optimized: recompute every, --precision auto, --grad_accum 2 "
                 "(all memory optimizations; explicit flags override it)")
      ->check(CLI::IsMember({"none", "memory_optimized"}))
      ->capture_default_str();
  app.add_flag_callback("--train_memory_optimized", [&a] { a.preset = "memory_optimized"; },
                        "= --preset memory_optimized (the seed's scripts/train_memory_optimized.sh)")
      ->trigger_on_parse();
  app.add_option("--device", a.device, "cpu | cuda[:N]: where the model trains")->capture_default_str();
  app.add_option("--dispatch", a.dispatch, "sorted (memory linear in tokens) or dense (one-hot, the original)")
      ->capture_default_str();
  app.add_option("--num_experts", a.num_experts, "experts per layer (0: the preset's)")->capture_default_str();
  app.add_option("--top_k", a.top_k, "experts per token (0: the preset's)")->capture_default_str();
  app.add_option("--capacity_factor", a.capacity_factor, "expert capacity factor (<= 0: dropless)")
      ->capture_default_str();
  app.add_option("--router_jitter", a.router_jitter, "multiplicative router jitter (0: off)")->capture_default_str();
  app.add_option("--aux_loss_coef", a.aux_loss_coef, "load-balancing loss coefficient")->capture_default_str();
  app.add_option("--z_loss_coef", a.z_loss_coef, "router z-loss coefficient")->capture_default_str();
  app.add_flag("--checkpoint_experts", a.checkpoint_experts, "recompute each expert's SwiGLU in backward");
  app.add_flag("--estimate_only", a.estimate_only, "print the estimated peak tensor memory of a step and stop");
  app.add_option("--policies", a.policies, "fixed: the flags; auto: the planner picks checkpointing, precision, "
                 "micro-batch and accumulation for --memory_budget")->check(CLI::IsMember({"fixed", "auto"}));
  app.add_option("--memory_budget", a.memory_budget, "peak tensor memory allowed, e.g. 512MiB (fixed policies: "
                 "the largest micro-batch that fits, accumulation keeping the effective batch)");
  app.add_flag("--calibrate", a.calibrate, "with --memory_budget: measure the plan's choice by a real step and "
               "re-plan with measured / estimated peak until a choice measured to fit stays the choice");
  app.add_flag("--dense", a.dense, "train the dense LLaMA with the same active parameters instead");
  app.add_flag("--monitor_memory", a.monitor_memory, "print a memory line every step (tracked by phase, RSS)");
  app.add_flag("--plot", a.plot, "draw OUTPUT_DIR/metrics.png after training (loss, memory over steps; gnuplot)");
  app.add_option("--memory_trace", a.memory_trace, "trace the first N steps' memory into OUTPUT_DIR/memory.trace.json "
                 "(Chrome trace; open in ui.perfetto.dev), 0: off")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  a.memory.add_to(app, /*release_default=*/0);
  a.checkpoints.add_to(app);
  a.distributed.add_to(app, /*plans=*/true);
  app.add_option("--lr", a.lr, "peak learning rate")->capture_default_str();
  app.add_option("--warmup", a.warmup, "warmup steps")->capture_default_str();
  app.add_option("--eval_batches", a.eval_batches, "held-out batches to evaluate (0: none)")->capture_default_str();
  app.add_option("--log_interval", a.log_interval, "steps between log lines")->capture_default_str();
  app.add_option("--threads", a.threads, "CPU threads (0: all available)")->capture_default_str();
  app.add_option("--seed", a.seed, "seed of init and data order")->capture_default_str();
  examples::underscore_option_names(argc, argv);  // --seq-len is --seq_len
  CLI11_PARSE(app, argc, argv);
  return memopt::guarded_main([&] {
    apply_preset(a, app);  // --preset: the settings not given explicitly
    memopt::init(memopt::RuntimeOptions().threads(a.threads));  // tracker + threads, before any tensor
    memopt::log_performance_info();
    return run(a);
  });
}
