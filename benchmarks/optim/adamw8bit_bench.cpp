// benchmarks/optim/adamw8bit_bench.cpp — fp32 AdamW (state::Resident) against 8-bit AdamW
// (state::Int8) training the same LLaMA on the King James corpus shards: the same init,
// the same batches, --steps optimizer steps. One impl per process (so peak RSS is its own);
// prints one JSON line: the mean loss of the last 10 steps, the held-out loss, the
// optimizer state's bytes, peak tracked/RSS memory, tokens/s and the optimizer step's time.
//
//   memopt_bench_adamw8bit --impl adamw8bit --steps 150 --data data/kjv
//   scripts/bench adamw8bit          # both impls and their ratio line

#include <chrono>
#include <cstdint>
#include <iostream>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "bench_main.hpp"
#include "memopt/data/loader.hpp"
#include "memopt/data/shard.hpp"
#include "memopt/memopt.hpp"
#include "memopt/optim/adamw8bit.hpp"

namespace {

struct BenchConfig {
  std::string data = "data/kjv";
  std::string impl = "adamw8bit";
  int64_t steps = 150;
  int64_t layers = 4;
  int64_t dim = 256;
  int64_t heads = 8;
  int64_t vocab = 4096;
  int64_t seq = 128;
  int64_t micro = 8;
  double lr = 2e-3;
  int64_t warmup = 10;
  int64_t eval_batches = 8;
  uint64_t seed = 1234;
  int threads = 0;
};

/// An offload policy around `Inner` that times the optimizer step (between its hooks).
template <memopt::StatePolicy Inner>
struct Timed {
  Inner inner;
  std::shared_ptr<std::vector<double>> step_seconds = std::make_shared<std::vector<double>>();
  std::shared_ptr<std::chrono::steady_clock::time_point> started =
      std::make_shared<std::chrono::steady_clock::time_point>();

  std::unique_ptr<torch::optim::Optimizer> make_optimizer(std::vector<torch::optim::OptimizerParamGroup> groups,
                                                          const torch::optim::AdamWOptions& options) const {
    return inner.make_optimizer(std::move(groups), options);
  }
  void before_step(torch::optim::Optimizer& opt) const {
    inner.before_step(opt);
    *started = std::chrono::steady_clock::now();
  }
  void after_step(torch::optim::Optimizer& opt) const {
    step_seconds->push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - *started).count());
    inner.after_step(opt);
  }
};

/// Bytes of an optimizer's state: AdamW8bit counts its own; torch::optim::AdamW's are its
/// moment tensors plus the int64 step, counted the same way.
int64_t state_bytes(const torch::optim::Optimizer& opt) {
  if (const auto* q = dynamic_cast<const memopt::optim::AdamW8bit*>(&opt)) return q->state_bytes();
  int64_t n = 0;
  for (const auto& item : opt.state()) {
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*item.second);
    n += static_cast<int64_t>(s.exp_avg().nbytes() + s.exp_avg_sq().nbytes() + sizeof(int64_t));
  }
  return n;
}

/// Mean next-token loss over the first `batches` sequential held-out batches.
double heldout_loss(memopt::models::Llama& model, const std::shared_ptr<const memopt::data::TokenShard>& shard,
                    const BenchConfig& cfg) {
  torch::NoGradGuard no_grad;
  model->eval();
  memopt::data::SequentialLoader loader(shard, memopt::data::LoaderOptions(cfg.micro, cfg.seq));
  double sum = 0, count = 0;
  for (int64_t i = 0; i < cfg.eval_batches && loader.has_next(); ++i) {
    const memopt::Batch batch = loader.next();  // (B, T)
    sum += model->loss_sum(batch, memopt::recompute::None{}).item<double>();
    count += batch.num_targets().item<double>();
  }
  model->train();
  return count > 0 ? sum / count : 0.0;
}

template <memopt::StatePolicy State>
nlohmann::ordered_json run(const BenchConfig& cfg) {
  const auto train = memopt::data::TokenShard::open(cfg.data + "/train.bin");
  const auto val = memopt::data::TokenShard::open(cfg.data + "/val.bin");
  train->check_vocab(cfg.vocab);
  val->check_vocab(cfg.vocab);
  torch::manual_seed(static_cast<int64_t>(cfg.seed));
  memopt::models::Llama model(memopt::bench::llama_config(cfg.vocab, cfg.dim, cfg.layers, cfg.heads, cfg.seq));
  model->train();

  const auto options = memopt::TrainerOptions()
                           .lr(cfg.lr)
                           .warmup_steps(cfg.warmup)
                           .max_steps(cfg.steps);
  memopt::Trainer<memopt::recompute::None, memopt::precision::Fp32, memopt::accum::None, Timed<State>> trainer(
      *model, options);
  memopt::data::RandomWindowLoader loader(train, memopt::data::LoaderOptions(cfg.micro, cfg.seq).seed(cfg.seed));
  auto loss_fn = [&model](const memopt::Batch& b, const auto& ckpt) { return model->loss_sum(b, ckpt); };

  std::vector<double> losses;
  double seconds = 0;  // steps after the first (warm-up)
  int64_t tokens = 0;
  for (int64_t s = 0; s < cfg.steps; ++s) {
    const memopt::StepStats stats = trainer.step(loader, loss_fn);
    losses.push_back(stats.loss.item<double>());
    if (s > 0) {
      seconds += stats.seconds;
      tokens += stats.tokens;
    }
    if ((s + 1) % 10 == 0 || s == 0)
      std::cerr << "  " << cfg.impl << " step " << s + 1 << ": loss " << losses.back() << ", " << stats.seconds * 1e3
                << " ms\n";
  }
  const int64_t last = std::min<int64_t>(10, static_cast<int64_t>(losses.size()));
  const double loss_last = std::accumulate(losses.end() - last, losses.end(), 0.0) / static_cast<double>(last);
  const auto& opt_seconds = *trainer.optimizer_state().step_seconds;
  const double opt_ms = opt_seconds.size() > 1
                            ? 1e3 * std::accumulate(opt_seconds.begin() + 1, opt_seconds.end(), 0.0) /
                                  static_cast<double>(opt_seconds.size() - 1)
                            : 0.0;
  return nlohmann::ordered_json{
      {"suite", "adamw8bit"},
      {"name", "adamw8bit"},
      {"impl", cfg.impl},
      {"steps", cfg.steps},
      {"loss_last", loss_last},
      {"loss_first", losses.front()},
      {"val_loss", heldout_loss(model, val, cfg)},
      {"state_mib", memopt::memory::mib(state_bytes(trainer.optimizer()))},
      {"peak_tracked_mib", memopt::memory::mib(memopt::memory::Tracker::instance().peak_bytes())},
      {"peak_rss_mib", memopt::memory::mib(memopt::memory::peak_rss_bytes())},
      {"tokens_per_s", static_cast<double>(tokens) / std::max(seconds, 1e-9)},
      {"optimizer_ms", opt_ms},
      {"params_m", memopt::bench::params_m(*model)},
      {"layers", cfg.layers},
      {"dim", cfg.dim},
      {"seq", cfg.seq},
      {"micro", cfg.micro},
      {"lr", cfg.lr},
      {"threads", at::get_num_threads()},
  };
}

}  // namespace

int main(int argc, char** argv) {
  BenchConfig cfg;
  CLI::App app{"memopt_bench_adamw8bit: fp32 AdamW or 8-bit AdamW training a LLaMA on the King James corpus, one JSON line"};
  app.add_option("--impl", cfg.impl, "adamw: state::Resident; adamw8bit: state::Int8")
      ->check(CLI::IsMember({"adamw", "adamw8bit"}));
  app.add_option("--data", cfg.data, "folder with train.bin and val.bin")->capture_default_str();
  app.add_option("--steps", cfg.steps, "optimizer steps")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--layers", cfg.layers, "decoder blocks")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--dim", cfg.dim, "hidden size")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--heads", cfg.heads, "attention heads")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--vocab", cfg.vocab, "vocabulary size")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--seq", cfg.seq, "tokens per row (T)")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--micro", cfg.micro, "rows per batch (B)")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--lr", cfg.lr, "peak learning rate (cosine decay)")->capture_default_str();
  app.add_option("--warmup", cfg.warmup, "warmup steps")->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--eval_batches", cfg.eval_batches, "held-out batches for val_loss")->capture_default_str();
  app.add_option("--seed", cfg.seed, "seed of init and data order")->capture_default_str();
  app.add_option("--threads", cfg.threads, "intra-op threads (0: all available CPUs)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  memopt::init(memopt::RuntimeOptions().threads(cfg.threads));  // tracker + threads, before any tensor
  return memopt::bench::print_line(
      [&] { return cfg.impl == "adamw" ? run<memopt::state::Resident>(cfg) : run<memopt::state::Int8>(cfg); });
}
