// Tests for memopt/planner/finetune.hpp: plan_finetune choosing full fine-tuning, LoRA or QLoRA
// for the budget, in the order of preference, for a language model and a GritLM step, and its
// error naming each way's least need when none fits.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <memopt/lora.hpp>
#include <memopt/memory/estimator.hpp>
#include <memopt/models/llama.hpp>
#include <memopt/planner/finetune.hpp>

#include "support.hpp"

TEST_CASE("plan_finetune keeps full fine-tuning where it fits, then LoRA, then QLoRA, and names each need",
          "[planner][lora]") {
  using memopt::memory::mib;
  // Weights and AdamW's state dominate (short sequences): each way needs less than the one before.
  const auto desc = memopt::models::describe(memopt::models::LlamaConfig().vocab_size(8192).hidden_size(512)
                                                         .num_hidden_layers(4).num_attention_heads(8)
                                                         .max_position_embeddings(64));
  const auto lora = memopt::nn::LoraOptions().rank(16).targets({"all-linear"});
  const std::vector<memopt::FinetuneWay> ways = {
      {"full", desc}, {"lora", desc.with_lora(lora, false)}, {"qlora", desc.with_lora(lora, true)}};
  const auto candidates = memopt::candidates<memopt::StandardTrainers>();
  const auto options = memopt::PlanOptions().effective_batch(4).machine(memopt::MachineModel().bf16_speedup(2.0));
  // A way's least need: its smallest peak over the candidates at micro-batch 1.
  auto least = [&](const memopt::memory::ModelDesc& m) {
    int64_t out = std::numeric_limits<int64_t>::max();
    for (const auto& r : memopt::detail::plan_rows(m, 64, candidates, memopt::PlanOptions(options).budget_bytes(1)))
      if (r.peak > 0) out = std::min(out, r.peak);
    return out;
  };
  const int64_t full = least(ways[0].model), with_lora = least(ways[1].model), with_qlora = least(ways[2].model);
  INFO("least needs: full " << mib(full) << ", LoRA " << mib(with_lora) << ", QLoRA " << mib(with_qlora) << " MiB");
  REQUIRE(full > with_lora);
  REQUIRE(with_lora > with_qlora);

  auto choose = [&](int64_t budget) {
    return memopt::plan_finetune(ways, 64, candidates, memopt::PlanOptions(options).budget_bytes(budget));
  };
  const auto roomy = choose(0);
  CHECK(roomy.chosen == "full");
  CHECK(roomy.verdicts.size() == 3);  // every way weighed, in the order given
  for (const auto& [way, verdict] : roomy.verdicts) CHECK_THAT(verdict, Catch::StartsWith("fits"));
  CHECK(choose(full).chosen == "full");
  for (const auto& [budget, want] : {std::pair{full - 1, "lora"}, std::pair{with_lora, "lora"},
                                     std::pair{with_lora - 1, "qlora"}, std::pair{with_qlora, "qlora"}}) {
    const auto f = choose(budget);
    INFO(f.explain());
    CHECK(f.chosen == want);
    CHECK(f.plan.chosen.peak <= budget);
    CHECK(f.plan.chosen.policies.accum * f.plan.chosen.micro_batch == 4);
    CHECK_THAT(f.explain(), Catch::Contains(std::string("* ") + want) &&
                                Catch::Contains(std::string("chose ") + want + " fine-tuning"));
    CHECK_THAT(f.verdicts.front().second, Catch::StartsWith("over budget: needs"));  // full never fits here
  }
  // GritLM's overload weighs the same ways through plan_gritlm()'s rows.
  memopt::memory::GritRunDesc run;
  run.queries = 2;
  run.query_len = 16;
  run.group_size = 2;
  run.passage_len = 32;
  CHECK(memopt::plan_finetune(ways, run, candidates, options).chosen == "full");
  // Nothing fits: each way's least need, and a HINT.
  memopt::test::require_error([&] { choose(with_qlora - 1); }, "memopt::plan_finetune: no way to fine-tune fits",
                              {"full " + fmt::format("{:.2f} MiB", mib(full)), "lora ", "qlora ", "allow QLoRA"});
}
