// Tests for memopt/planner.hpp: the planner choosing the fastest fitting combination for three
// budgets (and the largest micro-batch), calibration, GritLM's plan, and the errors of bad flags
// and sizes.
#include <catch2/catch.hpp>

#include <cmath>
#include <string>
#include <vector>

#include <memopt/memopt.hpp>
#include <memopt/memory/estimator.hpp>
#include <memopt/planner.hpp>

#include "support.hpp"

TEST_CASE("the planner picks the fastest combination that fits, for three budgets", "[planner]") {
  using memopt::memory::mib;
  const auto desc = memopt::models::describe(memopt::models::LlamaConfig().vocab_size(4096).hidden_size(256)
                                                         .num_hidden_layers(4).num_attention_heads(8)
                                                         .max_position_embeddings(256));
  const auto candidates = memopt::candidates<memopt::StandardTrainers>();
  const auto machine = memopt::MachineModel().bf16_speedup(0.5);  // this CPU: bf16 slower than fp32
  auto plan_for = [&](int64_t budget) {
    return memopt::plan(desc, 256, candidates,
                        memopt::PlanOptions().budget_bytes(budget).effective_batch(16).machine(machine));
  };
  // The unconstrained fastest: the cost model's minimum over every runnable combination.
  const auto free = plan_for(0);
  CHECK(free.chosen.policies.name() == "checkpoint=none precision=fp32 offload=none accum=1");
  const int64_t need = free.chosen.estimate.peak;

  for (const double fraction : {1.0, 0.5, 0.2}) {
    const auto budget = static_cast<int64_t>(fraction * static_cast<double>(need));
    const auto p = plan_for(budget);
    INFO("budget " << mib(budget) << " MiB\n" << p.explain());
    REQUIRE(p.chosen.fits());
    CHECK(p.chosen.estimate.peak <= budget);
    // No fitting row is faster, and no skipped row both fits and is faster.
    for (const auto& r : p.rows) {
      if (r.fits()) CHECK(r.seconds >= p.chosen.seconds);
      if (r.fits()) CHECK(r.estimate.peak <= budget);
    }
    // The chosen micro-batch is the largest that fits: the next larger divisor does not.
    for (int64_t bigger = p.chosen.micro_batch + 1; bigger <= 16; ++bigger) {
      if (16 % bigger != 0) continue;
      auto d = p.chosen.policies;
      d.accum = 16 / bigger;
      CHECK(memopt::memory::estimate(desc, {bigger, 256}, d).peak > budget);
      break;
    }
    CHECK(p.chosen.micro_batch * p.chosen.policies.accum == 16);  // the effective batch is kept
    CHECK_THAT(p.explain(), Catch::Contains("chose " + p.chosen.policies.name()));
    if (fraction < 1.0) CHECK(p.chosen.seconds > free.chosen.seconds);  // memory costs time
  }
  // fp16 is not runnable on this machine model: never chosen, said why.
  const auto p = plan_for(0);
  for (const auto& r : p.rows)
    if (r.policies.precision == memopt::memory::PrecisionKind::kFp16Scaled) CHECK_THAT(r.verdict, Catch::Contains("CUDA"));
  // Nothing fits: an error naming the budget and the smallest need.
  memopt::test::require_error([&] { plan_for(1 << 20); }, "memopt::plan", {"1 MiB", "smallest need", "HINT"});
}

TEST_CASE("a calibrated plan follows the measured peak: overruns move down, overestimates let more in",
          "[planner]") {
  using memopt::memory::mib;
  const auto desc = memopt::models::describe(memopt::models::LlamaConfig().vocab_size(4096).hidden_size(256)
                                                         .num_hidden_layers(4).num_attention_heads(8)
                                                         .max_position_embeddings(256));
  const auto candidates = memopt::candidates<memopt::CheckpointPrecisionTrainers>();
  const auto uncalibrated = memopt::plan(desc, 256, candidates, memopt::PlanOptions().effective_batch(16));
  const int64_t budget = uncalibrated.rows.back().estimate.peak;  // some, not all, combinations fit at micro 16
  const auto options = memopt::PlanOptions().budget_bytes(budget).effective_batch(16);
  auto plan_with = [&](const memopt::PlanOptions& o) { return memopt::plan(desc, 256, candidates, o); };
  const auto first = plan_with(options);
  // A machine whose real steps need `factor` × the estimate; each measured choice is recorded.
  auto run_with = [&](double factor) {
    std::vector<memopt::PlanRow> measured;
    memopt::MeasureStep measure = [&, factor](const memopt::PlanRow& r) {
      measured.push_back(r);
      return static_cast<int64_t>(factor * static_cast<double>(memopt::memory::estimate(desc, {r.micro_batch, 256},
                                                                                         r.policies).peak));
    };
    return std::pair{memopt::plan_calibrated(plan_with, options, measure), measured};
  };
  SECTION("the estimate is right: one measured step confirms the choice") {
    const auto [p, measured] = run_with(1.0);
    CHECK(measured.size() == 1);
    CHECK(p.chosen.same_choice(first.chosen));
    CHECK(p.calibration == Approx(1.0).epsilon(1e-6));
    CHECK_THAT(p.explain(), Catch::Contains("calibrated: 1 choice(s) measured"));
  }
  SECTION("steps need 30% more: the choice measured to fit is a smaller one") {
    const auto [p, measured] = run_with(1.3);
    INFO(p.explain());
    CHECK(measured.size() >= 2);
    CHECK(p.measured_peak <= budget);
    CHECK(p.measured_peak == static_cast<int64_t>(1.3 * static_cast<double>(p.chosen.estimate.peak)));
    CHECK(p.chosen.peak <= budget);
    CHECK(p.chosen.micro_batch * p.chosen.policies.accum == 16);
    CHECK(p.calibration == Approx(1.3).epsilon(1e-3));
  }
  SECTION("steps need 40% less: a larger micro-batch or faster combination fits") {
    const auto [p, measured] = run_with(0.6);
    INFO(p.explain());
    CHECK(p.measured_peak <= budget);
    CHECK(p.chosen.seconds <= first.chosen.seconds);
    CHECK(!p.chosen.same_choice(first.chosen));
  }
  SECTION("nothing measured fits: an error naming the budget and the last measurement") {
    memopt::MeasureStep too_big = [&](const memopt::PlanRow&) { return 2 * budget; };
    memopt::test::require_error([&] { memopt::plan_calibrated(plan_with, options, too_big); },
                                "memopt::plan_calibrated", {"no measured choice fits", "HINT"});
  }
}

TEST_CASE("GritLM's plan keeps the batch and picks the GradCache chunk and policies that fit", "[planner]") {
  const auto desc = memopt::models::describe(memopt::models::LlamaConfig().vocab_size(2048).hidden_size(256)
                                                         .num_hidden_layers(4).num_attention_heads(8)
                                                         .max_position_embeddings(128));
  memopt::memory::GritRunDesc run;
  run.queries = 32, run.query_len = 48, run.group_size = 2, run.passage_len = 96, run.gen_rows = 4, run.gen_len = 128;
  const auto candidates = memopt::candidates<memopt::CheckpointPrecisionTrainers>();
  auto plan_for = [&](int64_t budget) {
    return memopt::plan_gritlm(desc, run, candidates,
                               memopt::PlanOptions().budget_bytes(budget).machine(memopt::MachineModel().bf16_speedup(0.5)));
  };
  const auto free = plan_for(0);
  CHECK(free.chosen.chunk == 0);  // one graph: no second forward pass
  CHECK(free.chosen.policies.name() == "checkpoint=none precision=fp32 offload=none accum=1");
  CHECK(free.rows.size() == candidates.size() * 7);  // one graph + chunks 1 .. 32 below 64 embedding rows
  for (const double fraction : {0.6, 0.3, 0.15}) {
    const auto budget = static_cast<int64_t>(fraction * static_cast<double>(free.chosen.estimate.peak));
    const auto p = plan_for(budget);
    INFO("budget " << memopt::memory::mib(budget) << " MiB\n" << p.explain());
    CHECK(p.chosen.estimate.peak <= budget);
    CHECK(p.chosen.micro_batch == 32);  // the contrastive batch is never split
    CHECK(p.chosen.seconds > free.chosen.seconds);
    for (const auto& r : p.rows)
      if (r.fits()) CHECK(r.seconds >= p.chosen.seconds);
    auto r = run;
    r.chunk = p.chosen.chunk;
    CHECK(memopt::memory::estimate_gritlm(desc, r, p.chosen.policies).peak == p.chosen.estimate.peak);
  }
  CHECK_THAT(plan_for(static_cast<int64_t>(0.3 * static_cast<double>(free.chosen.estimate.peak))).explain(),
             Catch::Contains("chunk"));
  memopt::test::require_error([&] { plan_for(1 << 20); }, "memopt::plan", {"smallest need", "smallest chunk", "HINT"});
}

TEST_CASE("policy flags and sizes: good values parse, bad ones name the flag and the value", "[planner]") {
  using memopt::memory::PolicyDesc;
  const auto d = PolicyDesc::parse("every-3", "bf16-pure", "disk", 8);
  CHECK(d.checkpoint == memopt::memory::CheckpointKind::kEveryNth);
  CHECK(d.every == 3);
  CHECK(d.name() == "checkpoint=every-3 precision=bf16-pure offload=disk accum=8");
  CHECK(PolicyDesc::parse("every-1", "fp32", "none").checkpoint == memopt::memory::CheckpointKind::kEveryBlock);
  memopt::test::require_error([] { PolicyDesc::parse("every-x", "fp32", "none"); }, "memopt",
                              {"--checkpoint", "every-x", "HINT"});
  memopt::test::require_error([] { PolicyDesc::parse("none", "fp8", "none"); }, "memopt", {"--precision", "fp8", "HINT"});
  memopt::test::require_error([] { PolicyDesc::parse("none", "fp32", "nvme"); }, "memopt", {"--offload", "nvme", "HINT"});
  memopt::test::require_error([] { PolicyDesc::parse("none", "fp32", "none", 0); }, "memopt", {"--accum", "0", "HINT"});
  CHECK(memopt::parse_bytes("4GiB") == int64_t{4} << 30);
  CHECK(memopt::parse_bytes("512M") == int64_t{512} << 20);
  CHECK(memopt::parse_bytes("1.5G") == int64_t{3} << 29);
  CHECK(memopt::parse_bytes("2GB") == 2000000000);
  CHECK(memopt::parse_bytes("1048576") == 1048576);
  for (const char* bad : {"", "4XB", "-1G", "GiB", "0"})
    memopt::test::require_error([&] { memopt::parse_bytes(bad); }, "memopt", {"--memory_budget", "HINT"});
}
