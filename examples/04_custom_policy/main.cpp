// 04_custom_policy: a user-defined policy (custom::Bf16Moments, bf16_moments.hpp: AdamW state
// in bf16 between steps) gets everything memopt's own policies get:
//   --optimizer_state bf16-moments   the flag, parsed against the compiled list's describe()
//   --policies auto --memory_budget 95MiB   the planner weighs it by its description (AdamW's
//                              100.8 MiB step does not fit; bf16-moments' 89.0 MiB does)
//   --estimate_only            the estimator's table for it
//   training                   the Trainer runs it; the step's measured peak against the estimate
//   --check_resume             a checkpoint at half-way and a resumed run that ends bit-identical
//                              to the uninterrupted one (its generator is saved state)
// The model is a small LLaMA on a synthetic token stream, so the example needs no data.
//   build/examples/04_custom_policy/custom_policy --optimizer_state bf16-moments --check_resume
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <type_traits>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <torch/torch.h>

#include <memopt/data/loader.hpp>
#include <memopt/data/shard.hpp>
#include <memopt/dispatch.hpp>
#include <memopt/memopt.hpp>
#include <memopt/memory/estimator.hpp>
#include <memopt/planner.hpp>

#include "04_custom_policy/bf16_moments.hpp"
#include "common/cli.hpp"
#include "common/policy_flags.hpp"

namespace {

// The compiled combinations: plain AdamW state, and the custom one.
using Trainers = memopt::TrainerProductT<memopt::TypeList<memopt::recompute::None>,
                                         memopt::TypeList<memopt::precision::Fp32>,
                                         memopt::TypeList<memopt::state::Resident, custom::Bf16Moments>>;

struct Args {
  std::string optimizer_state = "bf16-moments", policies = "fixed", memory_budget, output_dir = "out/custom_policy";
  int64_t steps = 8, micro_batch = 1, seq_len = 256, dim = 256, layers = 4, vocab = 4096;
  bool estimate_only = false, check_resume = false;
};

// A token stream with structure to learn: each token follows from the previous two, 1 in 8 random.
std::shared_ptr<const memopt::data::TokenShard> synthetic_tokens(int64_t vocab, int64_t count) {
  std::vector<int32_t> tokens{1, 2};
  uint64_t state = 42;
  while (static_cast<int64_t>(tokens.size()) < count) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    const auto n = tokens.size();
    const int64_t next = (state >> 61) == 0 ? static_cast<int64_t>(state >> 33) % vocab
                                           : (tokens[n - 1] * 31 + tokens[n - 2] * 7 + 3) % vocab;
    tokens.push_back(static_cast<int32_t>(next));
  }
  return memopt::data::TokenShard::from_tokens("synthetic", tokens, vocab);
}

memopt::models::LlamaConfig config_of(const Args& a) {
  return memopt::models::LlamaConfig().vocab_size(a.vocab).hidden_size(a.dim).num_hidden_layers(a.layers)
      .num_attention_heads(4).max_position_embeddings(a.seq_len);
}

// A run of `T` from a fresh model (seeded): `steps` steps, or half of them, a checkpoint, and a
// resumed second half. Returns the final weights; `peak` is the tracker's peak of step 2.
template <class T>
std::vector<torch::Tensor> train(const Args& a, int64_t micro, const std::string& dir, bool interrupt, int64_t* peak) {
  auto options = memopt::TrainerOptions().lr(3e-3).max_steps(a.steps).checkpoint_dir(dir);
  auto shard = synthetic_tokens(a.vocab, 1 << 16);
  auto make_loader = [&] { return memopt::data::RandomWindowLoader(shard, memopt::data::LoaderOptions(micro, a.seq_len)); };
  torch::manual_seed(1);
  memopt::models::Llama model(config_of(a));
  auto loss = [&model](const memopt::Batch& b, const auto& ckpt) { return model->loss_sum(b, ckpt); };
  auto loader = make_loader();
  {
    T trainer(*model, options);
    for (int64_t s = 0; s < (interrupt ? a.steps / 2 : a.steps); ++s) {
      if (s == 1 && peak != nullptr) {
        *peak = memopt::measure_peak([&] { trainer.step(loader, loss); });
        continue;
      }
      const auto stats = trainer.step(loader, loss);
      if (!interrupt && peak != nullptr) fmt::print("step {:>3}  loss {:.4f}\n", s + 1, stats.loss.template item<double>());
    }
    if (interrupt) trainer.save_checkpoint(loader, "interval");
  }
  if (interrupt) {  // a new process would do this: another model, loader and policy value, then resume
    torch::manual_seed(99);
    model = memopt::models::Llama(config_of(a));
    loader = make_loader();
    T trainer(*model, options);
    TORCH_CHECK(trainer.resume("latest", loader), "custom_policy: no checkpoint in ", dir);
    while (trainer.steps_taken() < a.steps) trainer.step(loader, loss);
  }
  std::vector<torch::Tensor> weights;
  for (const auto& p : model->parameters()) weights.push_back(p.detach().clone());
  return weights;
}

int run(Args a) {
  const auto desc = memopt::models::describe(config_of(a));
  auto policies = memopt::parse_policies<Trainers>("none", "fp32", a.optimizer_state);
  int64_t micro = a.micro_batch;
  TORCH_CHECK(a.policies == "fixed" || a.policies == "auto", "custom_policy: --policies must be fixed or auto (got '",
              a.policies, "'). HINT: auto picks the fastest compiled combination that fits --memory_budget.");
  if (a.policies == "auto" || !a.memory_budget.empty()) {
    const auto chosen = memopt::choose_policies(
        desc, a.seq_len, policies, a.policies == "auto", memopt::candidates<Trainers>(),
        memopt::PlanOptions()
            .budget_bytes(a.memory_budget.empty() ? 0 : memopt::parse_bytes(a.memory_budget))
            .effective_batch(a.micro_batch));
    policies = chosen.policies;
    micro = chosen.micro_batch;
  }
  const auto estimate = memopt::memory::estimate(desc, {micro, a.seq_len}, policies);
  fmt::print("{} (micro-batch {})\n{}estimate: peak {} bytes\n", policies.name(), micro, estimate.table(),
             estimate.peak);
  if (a.estimate_only) return 0;

  return memopt::dispatch<Trainers>(policies, [&]<class T>(std::type_identity<T>) {
    fmt::print("training with {}\n", T::name());
    int64_t peak = 0;
    std::filesystem::remove_all(a.output_dir);
    const auto straight = train<T>(a, micro, a.output_dir + "/straight", false, &peak);
    const double error = static_cast<double>(estimate.peak) / static_cast<double>(peak) - 1;
    fmt::print("measured: peak {} bytes (estimate {} bytes, error {:+.1f}%)\n", peak, estimate.peak, 100 * error);
    if (!a.check_resume) return 0;
    const auto resumed = train<T>(a, micro, a.output_dir + "/resumed", true, nullptr);
    for (size_t i = 0; i < straight.size(); ++i)
      TORCH_CHECK(torch::equal(straight[i], resumed[i]), "custom_policy: parameter ", i, " differs after resuming "
                  "at step ", a.steps / 2, ". HINT: the policy's save_state/load_state must carry all of its state.");
    fmt::print("resume: bit-identical to the uninterrupted run after {} steps (checkpoint at {})\n", a.steps,
               a.steps / 2);
    return 0;
  });
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"A user-defined optimizer-state policy (bf16 AdamW moments) through memopt's Trainer, estimator and planner"};
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  examples::add_state_option(app, a.optimizer_state, "resident or bf16-moments (custom::Bf16Moments)")
      ->capture_default_str();
  app.add_option("--policies", a.policies, "fixed: the flags; auto: the planner picks")->capture_default_str();
  app.add_option("--memory_budget", a.memory_budget, "tensor-memory budget for the plan (e.g. 60MiB)");
  app.add_option(examples::kSteps, a.steps, "optimizer steps")->capture_default_str();
  app.add_option("--micro_batch", a.micro_batch, "sequences per step")->capture_default_str();
  app.add_option("--seq_len", a.seq_len, "tokens per sequence")->capture_default_str();
  app.add_option("--dim", a.dim, "hidden size")->capture_default_str();
  app.add_option("--layers", a.layers, "decoder blocks")->capture_default_str();
  app.add_option("--vocab", a.vocab, "vocabulary size")->capture_default_str();
  app.add_option("--output_dir", a.output_dir, "checkpoints go here")->capture_default_str();
  app.add_flag("--estimate_only", a.estimate_only, "print the plan and the estimate, then stop");
  app.add_flag("--check_resume", a.check_resume, "also train half, checkpoint, resume, and compare the weights");
  examples::underscore_option_names(argc, argv);
  CLI11_PARSE(app, argc, argv);
  return memopt::guarded_main([&] {
    memopt::init();
    return run(a);
  });
}
