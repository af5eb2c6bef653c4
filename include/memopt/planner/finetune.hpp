// memopt/planner/finetune.hpp — full fine-tuning, LoRA or QLoRA, whichever fits: plan_finetune()
// weighs the ways in the caller's order of preference, each through plan() or plan_gritlm()
// (memopt/planner.hpp), and picks the first whose plan has a candidate that fits the budget.
//   auto f = memopt::plan_finetune({{"full", desc}, {"lora", desc.with_lora(lora, false)},
//                                   {"qlora", desc.with_lora(lora, true)}}, 256, candidates, options);
//   memopt::dispatch<Trainers>(f.plan.chosen.policies, ...);   // f.chosen: "full", "lora" or "qlora"
#pragma once

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>

#include "memopt/memory/estimator.hpp"
#include "memopt/memory/model_desc.hpp"
#include "memopt/planner.hpp"

namespace memopt {

/// One way to fine-tune, as plan_finetune() weighs it: its name ("full", "lora", "qlora") and
/// the model as that way trains it (memory::ModelDesc::with_lora for the adapters).
struct FinetuneWay {
  std::string name;
  memory::ModelDesc model;
};

/// plan_finetune()'s answer: the way chosen, its plan, and each way's verdict in the order given.
struct FinetunePlan {
  std::string chosen;  // FinetuneWay::name
  Plan plan;           // the chosen way's plan
  std::vector<std::pair<std::string, std::string>> verdicts;  // (way, "fits: ..." / "over budget: ...")

  std::string explain() const {
    std::string out = fmt::format("finetune: the first way that fits the budget of {}, in the order allowed\n",
                                  plan.budget_bytes > 0 ? fmt::format("{:.1f} MiB", memory::mib(plan.budget_bytes))
                                                        : "none");
    for (const auto& [way, verdict] : verdicts)
      out += fmt::format("  {} {:<6} {}\n", way == chosen ? "*" : " ", way, verdict);
    out += fmt::format("chose {} fine-tuning\n", chosen);
    return out;
  }
};

/// Weighs ways to fine-tune one model (full, LoRA, QLoRA: each trains less than the one before
/// and needs less memory) in the caller's order of preference: the first way whose plan has a
/// candidate that fits wins, with that plan's fastest candidate. `rows_for(model)` gives a
/// way's plan rows (the overload below: plan()'s). Every way is weighed, so the explanation
/// says what each would need. Throws, naming each way's smallest need, when none fits.
template <class RowsFor>
FinetunePlan plan_finetune(const std::vector<FinetuneWay>& ways, RowsFor&& rows_for, const PlanOptions& options) {
  TORCH_CHECK(!ways.empty(), "memopt::plan_finetune: no ways to fine-tune. HINT: pass at least {\"full\", desc}.");
  FinetunePlan result;
  std::string needs;
  for (const auto& way : ways) {
    std::vector<PlanRow> rows = rows_for(way.model);
    const bool any_fits = std::any_of(rows.begin(), rows.end(), [](const PlanRow& r) { return r.fits(); });
    if (!any_fits) {
      const PlanRow* least = nullptr;
      for (const auto& r : rows)
        if (r.peak > 0 && (least == nullptr || r.peak < least->peak)) least = &r;
      const std::string need = least ? fmt::format("{:.2f} MiB ({})", memory::mib(least->peak), least->policies.name())
                                     : std::string("nothing runnable");
      result.verdicts.emplace_back(way.name, "over budget: needs " + need + " at the least");
      needs += fmt::format("{}{} {}", needs.empty() ? "" : "; ", way.name, need);
      continue;
    }
    Plan p = detail::choose_fastest(std::move(rows), options, "micro-batch 1");
    result.verdicts.emplace_back(way.name, fmt::format("fits: {} ({}), peak {:.1f} MiB, {:.3f} s/step",
                                                       p.chosen.policies.name(), p.chosen.shape(),
                                                       memory::mib(p.chosen.peak), p.chosen.seconds));
    if (result.chosen.empty()) {
      result.chosen = way.name;
      result.plan = std::move(p);
    }
  }
  TORCH_CHECK(!result.chosen.empty(), "memopt::plan_finetune: no way to fine-tune fits the memory budget of ",
              memory::mib(options.budget_bytes()), " MiB: ", needs, ". HINT: raise --memory_budget, shorten the "
              "sequences, or allow QLoRA (its NF4 base needs about 0.13x the fp32 weights).");
  return result;
}

/// plan_finetune() for a language model's step: each way's rows as plan() weighs them.
///   auto f = memopt::plan_finetune({{"full", desc}, {"lora", desc.with_lora(lora, false)},
///                                   {"qlora", desc.with_lora(lora, true)}}, 256, candidates, options);
///   auto p = f.plan;  // f.chosen: "full", "lora" or "qlora"
inline FinetunePlan plan_finetune(const std::vector<FinetuneWay>& ways, int64_t seq_len,
                                  const std::vector<memory::PolicyDesc>& candidates, const PlanOptions& options) {
  return plan_finetune(
      ways, [&](const memory::ModelDesc& m) { return detail::plan_rows(m, seq_len, candidates, options); }, options);
}

/// plan_finetune() for a GritLM step: each way's rows as plan_gritlm() weighs them (its chunks).
inline FinetunePlan plan_finetune(const std::vector<FinetuneWay>& ways, const memory::GritRunDesc& run,
                                  const std::vector<memory::PolicyDesc>& candidates, const PlanOptions& options,
                                  const std::vector<int64_t>& chunks = kGradCacheChunks) {
  return plan_finetune(
      ways, [&](const memory::ModelDesc& m) { return detail::plan_gritlm_rows(m, run, candidates, options, chunks); },
      options);
}

}  // namespace memopt
