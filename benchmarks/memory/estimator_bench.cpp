// benchmarks/memory/estimator_bench.cpp — memory/estimator.hpp's prediction next to the
// tracker's measured peak of one real step, for one configuration per process. The policies
// come from flags through memopt::dispatch over memopt::StandardTrainers (the planner's path).
// A warm-up step creates the optimizer state; the peaks are reset; the next step is measured.
// With --time_steps N, N more steps are timed against planner.hpp's cost model (step_seconds).
//
//   memopt_bench_estimator --layers 4 --dim 256 --seq 256 --micro 8 --recompute every --precision bf16
//   scripts/bench estimator          # the whole suite: one JSON line per configuration
//   scripts/bench planner            # the cost model: predicted vs measured s/step, --time_steps 3
#include <chrono>
#include <cstdint>
#include <string>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "bench_main.hpp"
#include "memopt/memopt.hpp"
#include "memopt/memory/estimator.hpp"
#include "memopt/models/distill.hpp"
#include "memopt/models/moe.hpp"
#include "memopt/planner.hpp"

namespace {

struct Config {
  std::string name;
  int64_t layers = 4, dim = 256, heads = 8, kv_heads = 0, ffn = 0, seq = 256, micro = 8, accum = 1, vocab = 4096;
  int64_t loss_chunk = 0, experts = 0, top_k = 2;
  bool checkpoint_experts = false, teacher_bf16 = false;
  int64_t kd_top_k = -1;  // >= 0: LLaMA -> LLaDA distillation (models/distill.hpp), a teacher of the same shape
  int64_t time_steps = 0;  // > 0: that many more steps, timed, next to planner.hpp's step_seconds
  double dropout = 0;
  std::string recompute = "none", precision = "fp32", state = "resident", attention = "math";
};

// Uniform random tokens: the step's memory does not depend on their values.
struct RandomTokens {
  int64_t batch, seq, vocab;
  memopt::Batch next() {
    auto rows = torch::randint(vocab, {batch, seq + 1}, torch::kLong);  // (B, T+1)
    return {rows.slice(1, 0, seq).contiguous(), rows.slice(1, 1).contiguous()};
  }
};

}  // namespace

int main(int argc, char** argv) {
  Config c;
  CLI::App app{"memopt_bench_estimator: predicted vs measured peak tensor memory of one training step"};
  app.add_option("--name", c.name, "the configuration's name in the JSON line");
  app.add_option("--layers", c.layers)->check(CLI::PositiveNumber);
  app.add_option("--dim", c.dim)->check(CLI::PositiveNumber);
  app.add_option("--heads", c.heads)->check(CLI::PositiveNumber);
  app.add_option("--kv_heads", c.kv_heads, "0: --heads")->check(CLI::NonNegativeNumber);
  app.add_option("--ffn", c.ffn, "0: LLaMA's rule")->check(CLI::NonNegativeNumber);
  app.add_option("--seq", c.seq)->check(CLI::PositiveNumber);
  app.add_option("--micro", c.micro)->check(CLI::PositiveNumber);
  app.add_option("--accum", c.accum)->check(CLI::PositiveNumber);
  app.add_option("--vocab", c.vocab)->check(CLI::PositiveNumber);
  app.add_option("--loss_chunk", c.loss_chunk, "rows per fused head+loss chunk (0: full logits)");
  app.add_option("--dropout", c.dropout);
  app.add_option("--recompute", c.recompute, "none | every | every-N | selective");
  app.add_option("--precision", c.precision, "fp32 | bf16 | bf16-pure | fp16");
  app.add_option("--optimizer_state", c.state, "resident | int8 | disk | step-in-backward");
  app.add_option("--attention", c.attention)->check(CLI::IsMember({"math", "blockwise"}));
  app.add_option("--experts", c.experts, "> 0: a MoE LM (models/moe.hpp, sorted dispatch), --ffn per expert");
  app.add_option("--top_k", c.top_k, "experts per token");
  app.add_flag("--checkpoint_experts", c.checkpoint_experts, "recompute each expert in backward");
  app.add_option("--kd_top_k", c.kd_top_k, ">= 0: distil a LLaDA student from a same-shape LLaMA teacher "
                 "(alpha 0.5; top-k teacher logits, 0: all)");
  app.add_flag("--teacher_bf16", c.teacher_bf16, "the teacher's weights and matmuls in bf16");
  app.add_option("--time_steps", c.time_steps, "> 0: time that many more steps after the measured one "
                 "(measured_s_per_step next to the planner's predicted_s_per_step)")
      ->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  memopt::init();

  return memopt::bench::print_line([&] {
    const auto policies = memopt::parse_policies<memopt::StandardTrainers>(c.recompute, c.precision, c.state, c.accum);
    auto config = memopt::bench::llama_config(c.vocab, c.dim, c.layers, c.heads, c.seq)
                      .num_key_value_heads(c.kv_heads)
                      .intermediate_size(c.ffn)
                      .dropout(c.dropout)
                      .loss_chunk_size(c.loss_chunk)
                      .attention_kind(c.attention == "math" ? memopt::nn::AttentionKind::kMath
                                                            : memopt::nn::AttentionKind::kBlockwise);
    torch::manual_seed(1234);
    const auto moe_config = memopt::models::MoeConfig().base(config).num_experts(c.experts).top_k(c.top_k)
                                .checkpoint_experts(c.checkpoint_experts);
    std::shared_ptr<torch::nn::Module> model;
    memopt::models::Llama llama{nullptr};
    memopt::models::MoeLM moe{nullptr};
    std::unique_ptr<memopt::models::Distiller> distill;
    const auto student_config = memopt::models::LlamaConfig(config).vocab_size(c.vocab + 1).causal(false);
    const auto distill_options = memopt::models::DistillOptions(c.vocab).top_k(std::max<int64_t>(c.kd_top_k, 0))
                                     .teacher_bf16(c.teacher_bf16);
    if (c.experts > 0) {
      moe = memopt::models::MoeLM(moe_config), model = moe.ptr();
    } else if (c.kd_top_k >= 0) {
      memopt::models::Llama teacher(config);
      if (c.teacher_bf16) teacher->to(torch::kBFloat16);
      llama = memopt::models::Llama(student_config), model = llama.ptr();
      distill = std::make_unique<memopt::models::Distiller>(teacher, llama, distill_options);
    } else {
      llama = memopt::models::Llama(config), model = llama.ptr();
    }
    model->train();
    const auto desc = c.experts > 0      ? memopt::models::describe(moe_config)
                      : c.kd_top_k >= 0 ? memopt::models::describe_distill(student_config, config,
                                                                                    distill_options, c.teacher_bf16)
                                         : memopt::models::describe(config);
    const auto predicted = memopt::memory::estimate(desc, {c.micro, c.seq}, policies);
    std::cerr << predicted.table();

    RandomTokens loader{c.micro, c.seq, c.vocab};
    auto loss_fn = [&](const memopt::Batch& b, const auto& ckpt) {
      return c.experts > 0 ? moe->loss_sum(b, ckpt) : distill ? distill->loss_sum(b, ckpt) : llama->loss_sum(b, ckpt);
    };
    const auto options = memopt::TrainerOptions().accum_steps(c.accum).max_steps(2 + c.time_steps);
    auto& tracker = memopt::memory::Tracker::instance();
    std::string trainer_name;
    memopt::memory::Snapshot s;
    double measured_s_per_step = 0;  // mean over the --time_steps timed steps
    memopt::dispatch<memopt::StandardTrainers>(policies, [&]<class T>(std::type_identity<T>) {
      T trainer(*model, options);
      trainer_name = T::name();
      trainer.step(loader, loss_fn);  // creates the optimizer state
      tracker.reset_peaks();
      tracker.start_timeline();
      trainer.step(loader, loss_fn);
      tracker.stop_timeline();
      s = tracker.snapshot();  // the measured step's peaks, before the timed steps
      if (c.time_steps == 0) return;
      const auto start = std::chrono::steady_clock::now();
      for (int64_t i = 0; i < c.time_steps; ++i) trainer.step(loader, loss_fn);  // accum micro-batches each
      measured_s_per_step = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() /
                            static_cast<double>(c.time_steps);
    });
    // Live bytes when the forward ends (the saved activations) and when the step begins.
    int64_t forward_end = 0, step_begin = -1;
    for (const auto& ev : tracker.timeline()) {
      if (step_begin < 0) step_begin = ev.live_bytes;
      if (ev.phase == memopt::memory::Phase::kForward) forward_end = ev.live_bytes;
    }
    auto phase = [&](memopt::memory::Phase p) { return memopt::memory::mib(s.phase_peak_bytes[static_cast<int>(p)]); };
    using memopt::memory::mib;
    const std::string name = c.name.empty() ? policies.name() : c.name;
    nlohmann::ordered_json line{
        {"suite", c.time_steps > 0 ? "planner" : "estimator"},  // timed: a line of scripts/bench planner
        {"name", name},
        {"predicted_mib", mib(predicted.peak)},
        {"measured_mib", mib(s.peak_bytes)},
        {"error", static_cast<double>(predicted.peak) / static_cast<double>(s.peak_bytes) - 1.0},
        {"predicted_phase", predicted.peak_phase},
        {"measured_forward_mib", phase(memopt::memory::Phase::kForward)},
        {"measured_backward_mib", phase(memopt::memory::Phase::kBackward)},
        {"measured_optimizer_mib", phase(memopt::memory::Phase::kOptimizer)},
        {"predicted_forward_mib", mib(predicted.forward_peak)},
        {"predicted_backward_mib", mib(predicted.backward_peak)},
        {"predicted_optimizer_mib", mib(predicted.optimizer_peak)},
        {"measured_step_begin_mib", mib(step_begin)},
        {"measured_forward_end_mib", mib(forward_end)},
        {"predicted_forward_end_mib", mib(predicted.parameters + predicted.master_weights + predicted.optimizer_state +
                                          predicted.activations)},
        {"trainer", trainer_name},
        {"policies", policies.name()},
        {"shape", fmt::format("l{}-d{}-h{}-kv{}-s{}-b{}-v{}{}", c.layers, c.dim, c.heads, config.kv_heads(), c.seq,
                              c.micro, c.vocab, c.experts > 0 ? fmt::format("-e{}k{}", c.experts, c.top_k) : "")}};
    if (c.time_steps > 0) {
      const auto machine = memopt::MachineModel::from_device(torch::kCPU);
      line["predicted_s_per_step"] = memopt::step_seconds(desc, c.seq, c.micro, policies, machine);
      line["measured_s_per_step"] = measured_s_per_step;
      line["time_steps"] = c.time_steps;
      line["threads"] = at::get_num_threads();
    }
    return line;
  });
}
