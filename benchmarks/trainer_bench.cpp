// benchmarks/trainer_bench.cpp — memopt's Trainer on a LLaMA, one configuration per
// process (so the peak RSS printed is that configuration's alone), timed over --steps
// optimizer steps after --warmup untimed ones. Prints one JSON line on stdout with the
// same keys as the PyTorch eager peer (benchmarks/peer/trainer_peer.py), which draws the
// same tokens from the same LCG. `--impl hand` trains the same model in a hand-written
// LibTorch loop instead (fp32, no checkpoint): the baseline of the Trainer's overhead.
// --finetune lora puts rank --lora_rank adapters on --lora_targets (memopt::lora::apply, the
// base frozen); --finetune qlora builds the model under memopt::nn::QuantizeOnInit first (each
// Linear weight NF4 as soon as it exists: a 7B shape never exists in fp32) — the peers are
// PEFT and PEFT + bitsandbytes (trainer_peer.py --finetune). A Trainer run's line carries
// estimated_peak_mib: memory::estimate's peak for its model and policies, next to the tracker's.
//
//   memopt_bench_trainer --layers 4 --dim 256 --seq 256 --precision bf16 --recompute every
//   scripts/bench trainer            # the whole suite, peer and ratios included
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "bench_main.hpp"
#include "profile.hpp"
#include "memopt/memopt.hpp"
#include "memopt/memory/estimator.hpp"

namespace {

/// What one process benchmarks (the command line).
struct BenchConfig {
  int64_t layers = 4;
  int64_t dim = 256;
  int64_t heads = 8;
  int64_t seq = 256;
  int64_t micro = 8;  // B of one micro-batch
  int64_t accum = 2;  // micro-batches per optimizer step
  int64_t vocab = 4096;
  int64_t steps = 5;
  int64_t warmup = 1;
  uint64_t seed = 1234;
  int threads = 0;  // 0: every CPU this process may run on
  std::string precision = "fp32";
  std::string recompute = "none";
  std::string impl = "memopt";
  std::string attention = "auto";  // the model's AttentionKind (nn/attention_kernels.hpp)
  bool fused_kernels = true;       // LlamaConfig::fused_kernels (nn/fused.hpp)
  int64_t loss_chunk = 0;          // LlamaConfig::loss_chunk_size: rows per chunk of the fused head + loss (0: logits)
  int64_t mlp_tiles = 1;           // LlamaConfig::mlp_row_tiles: the SwiGLU's rows in tiles, each recomputed
  int64_t ffn = 0;  // SwiGLU width; 0: LlamaConfig's 8/3 rule
  std::string finetune = "full";
  bool profile = false;  // one more step after the timed ones, under LibTorch's profiler
  int64_t lora_rank = 16;
  std::vector<std::string> lora_targets = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};

  int64_t tokens_per_step() const { return micro * accum * seq; }
  std::string name() const {
    return "l" + std::to_string(layers) + "-d" + std::to_string(dim) + "-s" + std::to_string(seq) + "-" + precision +
           (recompute == "every" ? "-ckpt" : "") + (finetune == "full" ? "" : "-" + finetune);
  }
};

/// Random tokens from a 64-bit LCG (Knuth's MMIX constants), drawn row by row: B rows of
/// T + 1 tokens per micro-batch, inputs = row[:T], targets = row[1:]. The peer implements
/// the same generator, so both train on identical data.
class LcgTokenLoader {
 public:
  LcgTokenLoader(int64_t batch, int64_t seq, int64_t vocab, uint64_t seed)
      : batch_(batch), seq_(seq), vocab_(static_cast<uint64_t>(vocab)), state_(seed) {}

  memopt::Batch next() {
    auto rows = torch::empty({batch_, seq_ + 1}, torch::kLong);  // (B, T+1)
    int64_t* p = rows.data_ptr<int64_t>();
    for (int64_t i = 0; i < rows.numel(); ++i) {
      state_ = state_ * 6364136223846793005ULL + 1442695040888963407ULL;  // mod 2^64
      p[i] = static_cast<int64_t>((state_ >> 33) % vocab_);
    }
    return {rows.slice(1, 0, seq_).contiguous(), rows.slice(1, 1).contiguous()};  // (B, T) each
  }

 private:
  int64_t batch_, seq_;
  uint64_t vocab_;
  uint64_t state_;
};

/// What a run measured.
struct BenchResult {
  std::vector<double> step_seconds;  // timed steps only
  double loss_first = 0;             // the very first (warm-up) step's loss
  double loss_last = 0;
  int64_t estimated_peak = 0;        // memory::estimate's peak for the Trainer's policies (0: --impl hand)
  std::optional<memopt::bench::StepProfile> profile;  // --profile: the step after the timed ones
};

/// Runs warmup + steps calls of `step` (which returns the step's loss), timing the last `steps`.
template <class StepFn>
BenchResult time_steps(const BenchConfig& cfg, StepFn&& step) {
  BenchResult r;
  for (int64_t s = 0; s < cfg.warmup + cfg.steps; ++s) {
    const auto start = std::chrono::steady_clock::now();
    const double loss = step();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (s == 0) r.loss_first = loss;
    r.loss_last = loss;
    if (s >= cfg.warmup) r.step_seconds.push_back(seconds);
    std::cerr << "  " << cfg.name() << " [" << cfg.impl << "] step " << s << (s < cfg.warmup ? " (warm-up)" : "")
              << ": loss " << loss << ", " << seconds * 1e3 << " ms\n";
  }
  if (cfg.profile) r.profile = memopt::bench::profile_step(step);  // untimed; its loss is not reported
  return r;
}

/// The tracker's peak of each phase of the step, {"forward": MiB, "backward": MiB, "optimizer": MiB}.
nlohmann::ordered_json phase_peaks() {
  using memopt::memory::Phase;
  const auto snapshot = memopt::memory::Tracker::instance().snapshot();
  auto out = nlohmann::ordered_json::object();
  for (Phase p : {Phase::kForward, Phase::kBackward, Phase::kOptimizer})
    out[std::string(memopt::memory::phase_name(p))] =
        memopt::memory::mib(snapshot.phase_peak_bytes[static_cast<int>(p)]);
  return out;
}

/// memopt's Trainer with the policy types picked in main().
template <memopt::RecomputePolicy Recompute, memopt::PrecisionPolicy Precision>
BenchResult run_trainer(const BenchConfig& cfg, memopt::models::Llama& model, const memopt::memory::ModelDesc& desc) {
  using Trainer = memopt::Trainer<Recompute, Precision, memopt::accum::Runtime>;
  auto options = memopt::TrainerOptions()
                     .accum_steps(cfg.accum)
                     .decay(memopt::optim::Decay::kConstant)  // lr 3e-4 throughout, as the peer
                     .max_steps(cfg.warmup + cfg.steps + (cfg.profile ? 1 : 0));
  Trainer trainer(*model, options);
  LcgTokenLoader loader(cfg.micro, cfg.seq, cfg.vocab, cfg.seed);
  auto loss_fn = [&model](const memopt::Batch& b, const auto& ckpt) { return model->loss_sum(b, ckpt); };
  BenchResult r = time_steps(cfg, [&] { return trainer.step(loader, loss_fn).loss.template item<double>(); });
  const auto estimate =
      memopt::memory::estimate(desc, {cfg.micro, cfg.seq}, memopt::memory::describe<Trainer>(cfg.accum));
  r.estimated_peak = estimate.peak;
  std::cerr << estimate.table();
  return r;
}

/// The same training written by hand against LibTorch: no memopt Trainer, policies or
/// tracker phases; the optimizer, parameter groups, clipping and loss normalisation are
/// the Trainer's, so the step-time ratio is the Trainer's overhead.
BenchResult run_hand(const BenchConfig& cfg, memopt::models::Llama& model) {
  memopt::fp32_gemm::enable();  // the Trainer's GEMM kernels (its Fp32 policy's prepare hook), so the ratio is the rest
  std::vector<torch::Tensor> decay, no_decay;  // weight decay on matrices, none on norms and embeddings
  for (const auto& item : model->named_parameters()) {
    const bool decays = item.value().dim() >= 2 && item.key().find("embed") == std::string::npos;
    (decays ? decay : no_decay).push_back(item.value());
  }
  auto adamw = torch::optim::AdamWOptions(3e-4).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.1);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(adamw));
  groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(
                                    torch::optim::AdamWOptions(adamw).weight_decay(0.0)));
  memopt::optim::FusedAdamW optimizer(std::move(groups), adamw);  // state::Resident's optimizer
  const std::vector<torch::Tensor> params = model->parameters();
  LcgTokenLoader loader(cfg.micro, cfg.seq, cfg.vocab, cfg.seed);

  return time_steps(cfg, [&] {
    std::vector<memopt::Batch> micro_batches;  // accum × (B, T)
    torch::Tensor num_targets = torch::zeros({}, torch::kLong);
    for (int64_t m = 0; m < cfg.accum; ++m) {
      micro_batches.push_back(loader.next());
      num_targets += micro_batches.back().num_targets();
    }
    num_targets = num_targets.to(torch::kFloat);
    torch::Tensor loss_sum = torch::zeros({});
    for (const auto& batch : micro_batches) {
      torch::Tensor loss = model->loss_sum(batch, memopt::recompute::None{}) / num_targets;
      loss.backward();
      loss_sum += loss.detach();
    }
    torch::nn::utils::clip_grad_norm_(params, 1.0);
    optimizer.step();
    for (auto& p : params) p.mutable_grad() = torch::Tensor();  // set to none, as the Trainer and the peer
    return loss_sum.item<double>();
  });
}

}  // namespace

int main(int argc, char** argv) {
  BenchConfig cfg;
  CLI::App app{"memopt_bench_trainer: memopt's Trainer on a LLaMA, one configuration per run, one JSON line"};
  memopt::bench::add_shape_options(app, cfg);
  app.add_option("--micro", cfg.micro, "rows per micro-batch (B)")->check(CLI::PositiveNumber);
  app.add_option("--accum", cfg.accum, "micro-batches per optimizer step")->check(CLI::PositiveNumber);
  app.add_option("--vocab", cfg.vocab, "vocabulary size")->check(CLI::PositiveNumber);
  app.add_option("--steps", cfg.steps, "timed optimizer steps")->check(CLI::PositiveNumber);
  app.add_option("--warmup", cfg.warmup, "untimed optimizer steps first")->check(CLI::NonNegativeNumber);
  app.add_option("--seed", cfg.seed, "seed of the token LCG");
  app.add_option("--threads", cfg.threads, "intra-op threads (0: all available CPUs)")->check(CLI::NonNegativeNumber);
  memopt::bench::add_policy_options(app, cfg);
  app.add_option("--impl", cfg.impl, "memopt: the Trainer; hand: a hand-written LibTorch loop (fp32, no checkpoint)")
      ->check(CLI::IsMember({"memopt", "hand"}));
  app.add_option("--ffn", cfg.ffn, "SwiGLU width (0: 8/3 x dim rounded up to 64)")->check(CLI::NonNegativeNumber);
  app.add_option("--finetune", cfg.finetune, "full | lora | qlora (adapters over an NF4 base)")
      ->check(CLI::IsMember({"full", "lora", "qlora"}));
  app.add_option("--lora_rank", cfg.lora_rank, "LoRA rank (alpha 2 x rank, no dropout)")->check(CLI::PositiveNumber);
  app.add_option("--lora_targets", cfg.lora_targets, "Linear layers to adapt, comma-separated, or all-linear")
      ->delimiter(',');
  app.add_option("--attention", cfg.attention, "math | blockwise | sdpa | flash | auto (the fastest of sdpa, flash "
                 "and blockwise on each shape, measured)")->capture_default_str();
  app.add_option("--fused_kernels", cfg.fused_kernels, "LlamaConfig::fused_kernels: the norms (with the residual "
                 "add), RoPE, SwiGLU, the dropouts and the loss's softmax as memopt's kernels (false: ATen "
                 "composites)")->capture_default_str();
  app.add_option("--loss_chunk", cfg.loss_chunk, "rows per chunk of the fused output projection + loss (0: the "
                 "whole (B*T, V) logits, as the peer)")->check(CLI::NonNegativeNumber);
  app.add_option("--mlp_tiles", cfg.mlp_tiles, "the SwiGLU's rows (B*T) in this many tiles, each recomputed in "
                 "backward (1: whole)")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_flag("--profile", cfg.profile, "profile one more step: the line's \"profile\" lists the top ops by self time");
  CLI11_PARSE(app, argc, argv);
  // Tracker and threads before any tensor or parallel work, for every --impl (the peer
  // sets its threads first too).
  memopt::init(memopt::RuntimeOptions().threads(cfg.threads));

  return memopt::bench::print_line([&] {
    TORCH_CHECK(cfg.impl != "hand" || cfg.finetune == "full", "memopt_bench_trainer: --impl hand trains every "
                "weight (got --finetune ", cfg.finetune, "). HINT: drop --finetune.");
    TORCH_CHECK(cfg.impl != "hand" || (cfg.precision == "fp32" && cfg.recompute == "none"),
                "memopt_bench_trainer: --impl hand runs fp32 without checkpointing only (got --precision ",
                cfg.precision, " --recompute ", cfg.recompute, "). HINT: drop --precision/--recompute.");
    torch::manual_seed(static_cast<int64_t>(cfg.seed));
    auto config = memopt::bench::llama_config(cfg.vocab, cfg.dim, cfg.layers, cfg.heads, cfg.seq);
    if (cfg.ffn > 0) config.intermediate_size(cfg.ffn);
    config.attention_kind(memopt::nn::parse_attention_kind(cfg.attention, "memopt_bench_trainer: --attention"));
    config.fused_kernels(cfg.fused_kernels).loss_chunk_size(cfg.loss_chunk).mlp_row_tiles(cfg.mlp_tiles);
    memopt::models::Llama model{nullptr};
    {
      std::optional<memopt::nn::QuantizeOnInit> nf4;  // qlora: each Linear weight NF4 once it exists
      if (cfg.finetune == "qlora") nf4.emplace();
      model = memopt::models::Llama(config);
    }
    const auto setup_rss = memopt::memory::peak_rss_bytes();  // the model built: the step's memory comes after
    const auto lora = memopt::nn::LoraOptions().rank(cfg.lora_rank).alpha(2.0 * cfg.lora_rank).dropout(0)
                          .targets(cfg.lora_targets);
    if (cfg.finetune != "full") memopt::lora::apply(*model, lora);
    const auto full = memopt::models::describe(config);  // what the estimator predicts for this run
    const auto desc = cfg.finetune == "full" ? full : full.with_lora(lora, cfg.finetune == "qlora");
    const auto counts = memopt::lora::count_parameters(*model);
    model->train();

    // The peak scripts/bench divides by for the line's mfu: the model's widest GEMM, (B·T, C)·(C, ffn),
    // in the precision it computes in, outside the tracked peak; the faster of before the run and after it,
    // each the fastest of kPeakReps products. On the shared host one round's bf16 peak read 2233 GFLOP/s
    // (of 3, after the run) and the next 2898, and after a profiled step one read 1208 (of 10).
    constexpr int kPeakReps = 10;
    const auto gemm_peak = [&] {
      return memopt::machine::gemm_gflops(cfg.micro * cfg.seq, cfg.dim, config.ffn_size(),
                                          cfg.precision == "fp32" ? torch::kFloat32 : torch::kBFloat16, kPeakReps);
    };
    const double peak_before = gemm_peak();

    // The policies are types: the only runtime branch is this one, outside every step.
    auto trainer_run = [&]<class C, class P>() { return run_trainer<C, P>(cfg, model, desc); };
    const BenchResult r = cfg.impl == "hand" ? run_hand(cfg, model)
                                             : memopt::bench::with_policies(cfg.precision, cfg.recompute, trainer_run);

    double total = 0;
    for (double s : r.step_seconds) total += s;
    const double step_s = total / static_cast<double>(r.step_seconds.size());
    const double min_s = *std::min_element(r.step_seconds.begin(), r.step_seconds.end());
    auto line = nlohmann::ordered_json{
        {"name", cfg.name()},
        {"impl", cfg.impl},
        {"tokens_per_s", static_cast<double>(cfg.tokens_per_step()) / step_s},
        {"step_ms", step_s * 1e3},
        {"step_ms_min", min_s * 1e3},
        {"peak_tracked_mib", memopt::memory::mib(memopt::memory::Tracker::instance().peak_bytes())},
        {"phase_peak_mib", phase_peaks()},
        {"peak_rss_mib", memopt::memory::mib(memopt::memory::peak_rss_bytes())},
        {"loss_first", r.loss_first},
        {"loss_last", r.loss_last},
        {"params_m", static_cast<double>(counts.total) / 1e6},
        {"trainable_m", static_cast<double>(counts.trainable) / 1e6},
        {"setup_peak_rss_mib", memopt::memory::mib(setup_rss)},
        {"layers", cfg.layers},
        {"dim", cfg.dim},
        {"heads", cfg.heads},
        {"seq", cfg.seq},
        {"micro", cfg.micro},
        {"accum", cfg.accum},
        {"vocab", cfg.vocab},
        {"steps", cfg.steps},
        {"warmup", cfg.warmup},
        {"precision", cfg.precision},
        {"recompute", cfg.recompute},
        {"threads", at::get_num_threads()},
        {"finetune", cfg.finetune},
        {"lora_rank", cfg.finetune == "full" ? 0 : cfg.lora_rank},
        {"ffn", config.ffn_size()},
        {"attention", cfg.attention},
        {"fused_kernels", cfg.fused_kernels},
        {"loss_chunk", cfg.loss_chunk},
        {"mlp_tiles", cfg.mlp_tiles},
    };
    for (const auto& [shape, choice] : memopt::nn::attention_choices()) {  // what auto measured, per shape
      nlohmann::ordered_json c{{"shape", shape.str()},
                               {"kind", memopt::nn::attention_kind_name(choice.kind)},
                               {"sdpa_ms", choice.sdpa.ms},
                               {"blockwise_ms", choice.blockwise.ms}};
      if (choice.flash) c["flash_ms"] = choice.flash->ms;
      line["attention_choices"].push_back(c);
    }
    line["gemm_gflops"] = std::max(peak_before, gemm_peak());
    if (r.profile) {  // where the step's time went: the 15 ops and 12 GEMM shapes of most self time
      line["profile_wall_ms"] = r.profile->wall_ms;
      line["profile"] = r.profile->top(15);
      line["profile_gemms"] = r.profile->top_gemms(12);
    }
    if (r.estimated_peak > 0) line["estimated_peak_mib"] = memopt::memory::mib(r.estimated_peak);
    if (cfg.precision == "bf16")  // the kernel its CPU GEMMs ran (MEMOPT_BF16_GEMM, or measured)
      line["bf16_gemm"] = memopt::bf16_gemm::mode_name(memopt::bf16_gemm::mode());
    if (memopt::fp32_gemm::enabled())  // its CPU fp32 GEMMs' (MEMOPT_FP32_GEMM, or measured)
      line["fp32_gemm"] = memopt::fp32_gemm::mode_name(memopt::fp32_gemm::mode());
    return line;
  });
}
