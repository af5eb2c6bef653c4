// examples/common/lora_flags.hpp — the fine-tuning flags llama_lm and gritlm share: --lora RANK
// puts LoRA adapters on the model (memopt::lora::apply: the base frozen, the Trainer steps the
// adapters alone), --lora_targets names the layers (PEFT's q_proj,v_proj by default, or
// all-linear), --lora_alpha / --lora_dropout / --rslora set the rest as PEFT's LoraConfig does,
// and --qlora holds the frozen Linear weights in NF4 first (memopt::lora::quantize: QLoRA).
// --finetune full|lora|qlora says the same in one flag; --finetune auto lets the planner take
// the first of full fine-tuning, LoRA and QLoRA that fits --memory_budget (memopt::plan_finetune).
// The adapter is saved in PEFT's format (adapter_model.safetensors + adapter_config.json).
#pragma once

#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <memopt/io/peft.hpp>
#include <memopt/lora.hpp>
#include <memopt/memory/model_desc.hpp>
#include <memopt/planner/finetune.hpp>

namespace examples {

struct LoraFlags {
  int64_t rank = 0;     // 0: full fine-tuning
  double alpha = 0;     // 0: 2 x rank
  double dropout = 0.05;
  std::vector<std::string> targets = {"q_proj", "v_proj"};
  bool rslora = false;
  bool qlora = false;
  std::string finetune;  // "": as --lora / --qlora say; full | lora | qlora | auto

  void add_to(CLI::App& app) {
    auto* group = app.add_option_group("LoRA / QLoRA", "fine-tune low-rank adapters on a frozen base");
    group->add_option("--lora", rank, "LoRA rank: adapters on --lora_targets, every other weight frozen "
                      "(0: full fine-tuning)")->capture_default_str();
    group->add_option("--lora_alpha", alpha, "LoRA alpha: the update is scaled by alpha / rank (0: 2 x rank)")
        ->capture_default_str();
    group->add_option("--lora_dropout", dropout, "dropout on the adapters' input in training")->capture_default_str();
    group->add_option("--lora_targets", targets, "layers to adapt by name (q_proj k_proj v_proj o_proj gate_proj "
                      "up_proj down_proj) or all-linear; comma-separated or repeated")
        ->delimiter(',')->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)->capture_default_str();
    group->add_flag("--rslora", rslora, "rank-stabilised LoRA: scale alpha / sqrt(rank)");
    group->add_flag("--qlora", qlora, "with --lora: hold the frozen Linear weights in NF4 (4-bit, blocksize 64, "
                    "double quantisation), dequantised a layer at a time");
    group->add_option("--finetune", finetune, "full | lora | qlora (--lora RANK, 16 if not given; qlora: --qlora) "
                      "| auto: with --memory_budget, the first of full, LoRA and QLoRA that fits")
        ->check(CLI::IsMember({"full", "lora", "qlora", "auto"}));
  }

  bool enabled() const { return rank > 0; }
  bool automatic() const { return finetune == "auto"; }

  memopt::nn::LoraOptions options() const {
    return memopt::nn::LoraOptions()
        .rank(rank)
        .alpha(alpha > 0 ? alpha : 2.0 * static_cast<double>(rank))
        .dropout(dropout)
        .targets(targets)
        .use_rslora(rslora);
  }

  /// Refuses --qlora without --lora, a --finetune the other flags contradict and a bad rank,
  /// alpha or dropout, before any data is read. --finetune lora, qlora or auto without --lora
  /// take rank 16; --finetune qlora sets --qlora; --finetune auto needs a memory budget.
  void resolve(const std::string& program, bool budget_given) {
    TORCH_CHECK(rank >= 0, program, ": --lora must be >= 0 (got ", rank, "). HINT: 0 trains every weight; 8 or 16 "
                "is a usual LoRA rank");
    TORCH_CHECK(finetune != "full" || (!enabled() && !qlora), program, ": --finetune full trains every weight, but "
                "--lora is ", rank, qlora ? " with --qlora" : "", ". HINT: drop --lora/--qlora, or use --finetune lora");
    TORCH_CHECK(finetune != "lora" || !qlora, program, ": --finetune lora keeps the base dense, but --qlora asks for "
                "NF4. HINT: use --finetune qlora");
    TORCH_CHECK(finetune != "auto" || !qlora, program, ": --finetune auto chooses between full, LoRA and QLoRA "
                "itself, but --qlora fixes QLoRA. HINT: drop --qlora (or --finetune auto)");
    TORCH_CHECK(finetune != "auto" || budget_given, program, ": --finetune auto picks full, LoRA or QLoRA for a "
                "budget (got no --memory_budget). HINT: add --memory_budget 2GiB, or name the way: --finetune lora");
    if ((finetune == "lora" || finetune == "qlora" || automatic()) && !enabled()) rank = 16;
    if (finetune == "qlora") qlora = true;
    TORCH_CHECK(!qlora || enabled(), program, ": --qlora quantises the frozen base of a LoRA fine-tune, but --lora "
                "is 0. HINT: add --lora 16 (QLoRA trains adapters over NF4 weights)");
    TORCH_CHECK(alpha >= 0, program, ": --lora_alpha must be >= 0 (got ", alpha, "). HINT: 0 means 2 x rank");
    if (enabled()) options().check((program + ": --lora").c_str());
  }

  /// The run-config entry a resume must match: {} without LoRA.
  nlohmann::json record() const {
    if (!enabled()) return nlohmann::json::object();
    const auto o = options();
    return {{"rank", o.rank()}, {"alpha", o.alpha()}, {"dropout", o.dropout()}, {"targets", o.targets()},
            {"rslora", o.use_rslora()}, {"qlora", qlora}};
  }

  /// --finetune auto: the ways memopt::plan_finetune weighs, in order of preference (each
  /// trains less than the one before): full, LoRA and QLoRA at --lora's rank.
  std::vector<memopt::FinetuneWay> ways(const memopt::memory::ModelDesc& full) const {
    return {{"full", full}, {"lora", full.with_lora(options(), false)}, {"qlora", full.with_lora(options(), true)}};
  }

  /// Takes the way memopt::plan_finetune chose: "full" drops the adapters, "qlora" adds NF4.
  void adopt(const std::string& way) {
    finetune = way;
    if (way == "full") rank = 0;
    qlora = way == "qlora";
  }

  /// The estimator's description of the model as these flags fine-tune it.
  memopt::memory::ModelDesc describe(const memopt::memory::ModelDesc& full) const {
    return enabled() ? full.with_lora(options(), qlora) : full;
  }

  /// --qlora: the Linear weights to NF4; --lora: the adapters. Says what trains unless `program`
  /// is empty. Does nothing without --lora.
  void apply(torch::nn::Module& model, const std::string& program = "") const {
    if (!enabled()) return;
    const auto before = memopt::lora::count_parameters(model);
    const int64_t saved = qlora ? memopt::lora::quantize(model) : 0;
    const auto paths = memopt::lora::apply(model, options());
    if (program.empty()) return;
    if (qlora) fmt::print("{}: --qlora: Linear weights in NF4, {:.1f} MiB smaller\n", program, saved / 1048576.0);
    const auto after = memopt::lora::count_parameters(model);
    fmt::print("{}: LoRA rank {} alpha {:g} on {} layers ({}): {:.3f} M trainable of {:.2f} M parameters ({:.2f}%)\n",
               program, rank, options().alpha(), paths.size(), fmt::join(targets, ","), after.trainable / 1e6,
               before.total / 1e6, 100.0 * static_cast<double>(after.trainable) / static_cast<double>(after.total));
    std::fflush(stdout);
  }

  /// Saves the adapter in PEFT's format to `dir` (PeftModel.from_pretrained(base, dir) loads it).
  void save(const torch::nn::Module& model, const std::string& dir, const std::string& base_model,
            const std::string& program) const {
    if (!enabled()) return;
    memopt::io::save_adapter(dir, model, options(), base_model);
    fmt::print("{}: adapter saved to {} (PEFT's format)\n", program, dir);
  }
};

}  // namespace examples
