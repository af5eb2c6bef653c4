// benchmarks/stack_bench.cpp — the "stack" table: one LLaMA (8 layers × d512, seq 1024,
// vocab 4096) trained on the King James corpus with one more memory lever per row, one row per
// process (so the peak RSS printed is that row's alone). Every row sees the same init, the
// same batches and the same effective batch (2 × 1024 tokens per step, no accumulation:
// optimizer-in-backward cannot accumulate), and prints one JSON line: name (the lever
// added), peak_tracked_mib, peak_rss_mib, tokens_per_s, loss_last.
//
//   memopt_bench_stack --row bf16 --data data/kjv/train.bin
//   scripts/bench stack            # every row, in order
#include <chrono>
#include <cstdint>
#include <iostream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "bench_main.hpp"
#include "memopt/data/loader.hpp"
#include "memopt/data/shard.hpp"
#include "memopt/memopt.hpp"

namespace {

struct StackConfig {
  std::string row = "fp32";
  std::string data = "data/kjv/train.bin";
  std::string offload_dir;  // state::Disk's folder ("": $MEMOPT_OFFLOAD_DIR or the temp folder)
  int64_t layers = 8, dim = 512, heads = 8, seq = 1024, batch = 2, vocab = 4096;
  int64_t steps = 3, warmup = 1;
  int64_t loss_chunk = 1024;  // rows per chunk of the fused head + loss
  uint64_t seed = 1234;
  int threads = 0;
};

// The rows, in order: each adds one lever to the previous (alternatives say what they replace).
const std::vector<std::string> kRows = {
    "fp32",              // baseline: fp32, no checkpointing, math attention, full logits, AdamW
    "bf16",              // + bf16 autocast
    "selective",         // + selective recomputation (attention core, SwiGLU product)
    "every_block",       // checkpoint every block instead of selective
    "mem_attention",     // + blockwise attention
    "chunked_ce",        // + head and loss fused in chunks (no (B·T, V) logits)
    "int8_state",        // + 8-bit AdamW state
    "step_in_backward",  // optimizer in backward instead of 8-bit state (no gradients kept; no clipping)
    "disk",              // AdamW state on disk instead of 8-bit (the resident set holds 3 chunks)
    "full",              // optimizer in backward with 8-bit state: every lever at once
    "full_fp32",         // the same in fp32 (this CPU has no bf16 matmul hardware)
    "ce_v32k_full",      // V = 32000, every_block + mem_attention, full logits
    "ce_v32k_chunked",   // V = 32000, the same with the fused chunked loss
};

struct RowResult {
  std::vector<double> step_seconds;  // timed steps
  double loss_last = 0;
  int64_t state_bytes = -1;          // optimizer state resident in RAM (-1: not reported)
};

template <class Opt>
int64_t adamw_state_bytes(Opt& optimizer) {
  int64_t bytes = 0;
  for (const auto& [key, state] : optimizer.state()) {
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*state);
    bytes += s.exp_avg().nbytes() + s.exp_avg_sq().nbytes();
  }
  return bytes;
}

template <memopt::RecomputePolicy Recompute, memopt::PrecisionPolicy Precision, memopt::StatePolicy State>
RowResult train(const StackConfig& cfg, memopt::models::Llama& model, double grad_clip, State opt_state = {}) {
  auto shard = memopt::data::TokenShard::open(cfg.data);
  memopt::data::RandomWindowLoader loader(shard, memopt::data::LoaderOptions(cfg.batch, cfg.seq).seed(cfg.seed));
  auto options = memopt::TrainerOptions()
                     .lr(1e-3)
                     .warmup_steps(0)
                     .decay(memopt::optim::Decay::kConstant)
                     .grad_clip(grad_clip)
                     .max_steps(cfg.warmup + cfg.steps);
  memopt::Trainer<Recompute, Precision, memopt::accum::None, State> trainer(*model, options, {},
                                                                               std::move(opt_state));
  auto loss_fn = [&model](const memopt::Batch& b, const auto& ckpt) { return model->loss_sum(b, ckpt); };
  RowResult r;
  for (int64_t s = 0; s < cfg.warmup + cfg.steps; ++s) {
    const auto start = std::chrono::steady_clock::now();
    r.loss_last = trainer.step(loader, loss_fn).loss.template item<double>();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (s >= cfg.warmup) r.step_seconds.push_back(seconds);
    std::cerr << "  stack " << cfg.row << " step " << s << (s < cfg.warmup ? " (warm-up)" : "") << ": loss "
              << r.loss_last << ", " << seconds << " s\n";
  }
  auto& opt = trainer.optimizer();
  if (auto* adamw = dynamic_cast<torch::optim::AdamW*>(&opt)) r.state_bytes = adamw_state_bytes(*adamw);
  if (auto* q = dynamic_cast<memopt::optim::AdamW8bit*>(&opt)) r.state_bytes = q->state_bytes();
  if (auto* d = dynamic_cast<memopt::optim::DiskAdamW*>(&opt)) r.state_bytes = d->resident_state_bytes();
  if (auto* b = dynamic_cast<memopt::optim::StepInBackward*>(&opt))
    r.state_bytes = b->state_bytes([](const torch::optim::Optimizer& o) {
      auto* q = dynamic_cast<const memopt::optim::AdamW8bit*>(&o);
      return q ? q->state_bytes() : memopt::optim::StepInBackward::adamw_bytes(o);
    });
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  StackConfig cfg;
  CLI::App app{"memopt_bench_stack: one row of the memory-lever stack table, one JSON line"};
  std::string rows_help = "the row:";
  for (const auto& r : kRows) rows_help += " " + r;
  app.add_option("--row", cfg.row, rows_help)->check(CLI::IsMember(kRows));
  app.add_option("--data", cfg.data, "token shard to train on")->check(CLI::ExistingFile);
  app.add_option("--offload_dir", cfg.offload_dir, "folder of the disk row's optimizer state");
  memopt::bench::add_shape_options(app, cfg);
  app.add_option("--batch", cfg.batch, "rows per step (B)")->check(CLI::PositiveNumber);
  app.add_option("--steps", cfg.steps, "timed steps")->check(CLI::PositiveNumber);
  app.add_option("--warmup", cfg.warmup, "untimed steps first")->check(CLI::NonNegativeNumber);
  app.add_option("--loss_chunk", cfg.loss_chunk, "rows per chunk of the fused loss")->check(CLI::PositiveNumber);
  app.add_option("--threads", cfg.threads, "intra-op threads (0: all available CPUs)")->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  memopt::init(memopt::RuntimeOptions().threads(cfg.threads));

  return memopt::bench::print_line([&] {
    namespace rc = memopt::recompute;
    namespace prec = memopt::precision;
    namespace st = memopt::state;
    const std::string& row = cfg.row;
    const bool v32k = row.rfind("ce_v32k", 0) == 0;
    const int64_t vocab = v32k ? 32000 : cfg.vocab;
    const bool blockwise = row == "mem_attention" || row == "chunked_ce" || row == "int8_state" ||
                           row == "step_in_backward" || row == "disk" || row == "full" || row == "full_fp32" || v32k;
    const bool chunked = row == "chunked_ce" || row == "int8_state" || row == "step_in_backward" || row == "disk" ||
                         row == "full" || row == "full_fp32" || row == "ce_v32k_chunked";
    torch::manual_seed(static_cast<int64_t>(cfg.seed));
    memopt::models::Llama model(
        memopt::bench::llama_config(vocab, cfg.dim, cfg.layers, cfg.heads, cfg.seq)
            .attention_kind(blockwise ? memopt::nn::AttentionKind::kBlockwise : memopt::nn::AttentionKind::kMath)
            .loss_chunk_size(chunked ? cfg.loss_chunk : 0));
    model->train();

    // The policies are types: one branch here, outside every step.
    RowResult r;
    if (row == "fp32") r = train<rc::None, prec::Fp32, st::Resident>(cfg, model, 1.0);
    else if (row == "bf16") r = train<rc::None, prec::Bf16Autocast, st::Resident>(cfg, model, 1.0);
    else if (row == "selective") r = train<rc::Selective, prec::Bf16Autocast, st::Resident>(cfg, model, 1.0);
    else if (row == "every_block" || row == "mem_attention" || row == "chunked_ce" || v32k)
      r = train<rc::EveryBlock, prec::Bf16Autocast, st::Resident>(cfg, model, 1.0);
    else if (row == "int8_state") r = train<rc::EveryBlock, prec::Bf16Autocast, st::Int8>(cfg, model, 1.0);
    else if (row == "step_in_backward")
      r = train<rc::EveryBlock, prec::Bf16Autocast, st::StepInBackward>(cfg, model, 0.0);
    else if (row == "disk")
      r = train<rc::EveryBlock, prec::Bf16Autocast, st::Disk>(
          cfg, model, 1.0, st::Disk(memopt::optim::DiskAdamWOptions().directory(cfg.offload_dir)));
    else if (row == "full") r = train<rc::EveryBlock, prec::Bf16Autocast, st::StepInBackwardInt8>(cfg, model, 0.0);
    else r = train<rc::EveryBlock, prec::Fp32, st::StepInBackwardInt8>(cfg, model, 0.0);  // full_fp32

    double total = 0;
    for (double s : r.step_seconds) total += s;
    const double step_s = total / static_cast<double>(r.step_seconds.size());
    return nlohmann::ordered_json{
        {"suite", "stack"},
        {"name", row},
        {"peak_tracked_mib", memopt::memory::mib(memopt::memory::Tracker::instance().peak_bytes())},
        {"peak_rss_mib", memopt::memory::mib(memopt::memory::peak_rss_bytes())},
        {"tokens_per_s", static_cast<double>(cfg.batch * cfg.seq) / step_s},
        {"loss_last", r.loss_last},
        {"state_mib", r.state_bytes >= 0 ? memopt::memory::mib(r.state_bytes) : -1.0},
        {"params_m", memopt::bench::params_m(*model)},
        {"vocab", vocab},
        {"steps", cfg.steps},
    };
  });
}
