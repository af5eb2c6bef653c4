// Tests for memopt/planner.hpp: the planner choosing the fastest fitting combination for three
// budgets (and the largest micro-batch), with several ranks among DDP, ZeRO-1 and ZeRO-3,
// calibration, GritLM's plan, and the errors of bad flags and sizes. plan_finetune: tests/planner/finetune_test.cpp.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdlib>
#include <string_view>
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
  CHECK(free.chosen.policies.name() == "recompute=none precision=fp32 state=resident accum=1");
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
    if (r.policies.precision.flag == "fp16") CHECK_THAT(r.verdict, Catch::Contains("needs CUDA"));
  // Nothing fits: an error naming the budget and the smallest need.
  memopt::test::require_error([&] { plan_for(1 << 20); }, "memopt::plan", {"1 MiB", "smallest need", "HINT"});
}

TEST_CASE("with several ranks the planner weighs ZeRO-1 and ZeRO-3: DDP while it fits, sharding when it must",
          "[planner]") {
  using memopt::memory::mib;
  const auto desc = memopt::models::describe(memopt::models::LlamaConfig().vocab_size(4096).hidden_size(512)
                                                         .num_hidden_layers(8).num_attention_heads(8)
                                                         .max_position_embeddings(256));
  const auto candidates = memopt::candidates<memopt::StandardTrainers>();
  auto options = [](int64_t budget, int64_t ranks) {
    return memopt::PlanOptions().budget_bytes(budget).effective_batch(8).ranks(ranks).machine(
        memopt::MachineModel().bf16_speedup(0.5));
  };
  auto plan_for = [&](int64_t budget, int64_t ranks) { return memopt::plan(desc, 256, candidates, options(budget, ranks)); };
  const auto free = plan_for(0, 2);
  CHECK(free.chosen.zero != 3);  // no budget: ZeRO-3's extra collectives and recompute only cost time
  // (ZeRO-1 moves DDP's bytes and steps 1/N of the optimizer: as fast or faster, as measured)
  CHECK(free.rows.size() == 3 * plan_for(0, 1).rows.size());  // each candidate at ZeRO 0, 1 and 3
  // The smallest need of DDP and of ZeRO-1 over all candidates: a budget under both needs ZeRO-3.
  int64_t smallest_replicated = std::numeric_limits<int64_t>::max(), smallest_zero3 = smallest_replicated;
  for (const auto& r : memopt::detail::plan_rows(desc, 256, candidates, options(1, 2))) {  // none fits: each need
    if (r.peak == 0) continue;
    auto& smallest = r.zero == 3 ? smallest_zero3 : smallest_replicated;
    smallest = std::min(smallest, r.peak);
  }
  INFO("smallest need: replicated or ZeRO-1 " << mib(smallest_replicated) << " MiB, ZeRO-3 " << mib(smallest_zero3));
  REQUIRE(smallest_zero3 < smallest_replicated);
  const auto p = plan_for((smallest_zero3 + smallest_replicated) / 2, 2);
  INFO(p.explain());
  CHECK(p.chosen.zero == 3);
  CHECK_THAT(p.explain(), Catch::Contains("+ ZeRO-3"));
  CHECK(p.chosen.seconds > free.chosen.seconds);  // its collectives and recompute cost time
  // ZeRO-3's estimate is one rank's: it shrinks with the ranks.
  memopt::memory::RunDesc two{1, 256}, four{1, 256};
  two.ranks = 2, two.zero = 3, four.ranks = 4, four.zero = 3;
  const auto policies = p.chosen.policies;
  CHECK(memopt::memory::estimate(desc, four, policies).peak < memopt::memory::estimate(desc, two, policies).peak);
  memopt::test::require_error([&] { plan_for(0, 0); }, "memopt::plan", {"ranks", "(got 0)", "HINT"});
  // zero_stages: only the stages named are weighed (a run that names its stage: --zero 3)
  const auto named = memopt::plan(desc, 256, candidates, options(0, 2).zero_stages({3}));
  CHECK(named.rows.size() == plan_for(0, 1).rows.size());
  CHECK(std::all_of(named.rows.begin(), named.rows.end(), [](const auto& r) { return r.zero == 3; }));
  memopt::test::require_error([&] { memopt::plan(desc, 256, candidates, options(0, 2).zero_stages({2})); },
                              "memopt::plan", {"zero_stages holds 2", "HINT"});
}

TEST_CASE("a calibrated plan follows the measured peak: overruns move down, overestimates let more in",
          "[planner]") {
  using memopt::memory::mib;
  const auto desc = memopt::models::describe(memopt::models::LlamaConfig().vocab_size(4096).hidden_size(256)
                                                         .num_hidden_layers(4).num_attention_heads(8)
                                                         .max_position_embeddings(256));
  const auto candidates = memopt::candidates<memopt::RecomputePrecisionTrainers>();
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
  const auto candidates = memopt::candidates<memopt::GradCacheTrainers>();
  auto plan_for = [&](int64_t budget) {
    return memopt::plan_gritlm(desc, run, candidates,
                               memopt::PlanOptions().budget_bytes(budget).machine(memopt::MachineModel().bf16_speedup(0.5)));
  };
  const auto free = plan_for(0);
  CHECK(free.chosen.chunk == 0);  // one graph: no second forward pass
  CHECK(free.chosen.policies.name() == "recompute=none precision=fp32 state=resident accum=1");
  // Four whole-batch candidates (one graph each) and four GradCache ones at chunks 1 .. 32 (below 64 rows).
  CHECK(free.rows.size() == 4 + 4 * 6);
  for (const auto& r : free.rows) CHECK((r.chunk > 0) == r.policies.split.grad_cache);
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
  auto parse = [](const char* c, const char* p, const char* o, int64_t accum = 1) {
    return memopt::parse_policies<memopt::StandardTrainers>(c, p, o, accum);
  };
  const auto d = parse("every-2", "bf16-pure", "disk", 8);
  CHECK(d.recompute.whole_block(2, 4));
  CHECK(!d.recompute.whole_block(3, 4));
  CHECK(d.precision.half_weights);
  CHECK(d.name() == "recompute=every-2 precision=bf16-pure state=disk accum=8");
  // The choices a bad value is told are the list's own flags.
  memopt::test::require_error([&] { parse("every-x", "fp32", "resident"); }, "memopt",
                              {"--recompute", "every-x", "none, every, every-2, selective", "HINT"});
  memopt::test::require_error([&] { parse("none", "fp8", "resident"); }, "memopt",
                              {"--precision", "fp8", "fp32, bf16, bf16-pure, fp16", "HINT"});
  memopt::test::require_error([&] { parse("none", "fp32", "nvme"); }, "memopt", {"--optimizer_state", "nvme", "HINT"});
  memopt::test::require_error([&] { parse("none", "fp32", "resident", 0); }, "memopt", {"--accum", "0", "HINT"});
  // A type-fixed count wins over the flag's: accum::Fixed<4> runs 4 micro-batches.
  using Fixed4 = memopt::TypeList<memopt::Trainer<memopt::recompute::None, memopt::precision::Fp32,
                                                  memopt::accum::Fixed<4>>>;
  CHECK(memopt::parse_policies<Fixed4>("none", "fp32", "resident", 1).accum == 4);
  CHECK(memopt::parse_bytes("4GiB") == int64_t{4} << 30);
  CHECK(memopt::parse_bytes("512M") == int64_t{512} << 20);
  CHECK(memopt::parse_bytes("1.5G") == int64_t{3} << 29);
  CHECK(memopt::parse_bytes("2GB") == 2000000000);
  CHECK(memopt::parse_bytes("1048576") == 1048576);
  for (const char* bad : {"", "4XB", "-1G", "GiB", "0"})
    memopt::test::require_error([&] { memopt::parse_bytes(bad); }, "memopt", {"--memory_budget", "HINT"});
}

TEST_CASE("StepInBackward and PinnedHost are plannable: their descriptions change the estimate and the verdict",
          "[planner]") {
  using namespace memopt;
  using Plannable = TypeList<Trainer<recompute::None, precision::Fp32, accum::Runtime, state::Resident>,
                             Trainer<recompute::None, precision::Fp32, accum::Runtime, state::StepInBackward>,
                             Trainer<recompute::None, precision::Fp32, accum::Runtime, state::PinnedHost>>;
  const auto desc = models::describe(models::LlamaConfig().vocab_size(4096).hidden_size(256).num_hidden_layers(4)
                                         .num_attention_heads(8).max_position_embeddings(128));
  const auto all = candidates<Plannable>();
  const int64_t P = desc.num_parameters();
  // Stepped in backward, the gradients never all exist: no gradient set at the step or in
  // backward (a short sequence, where the parameters' bytes dominate the step).
  const auto none_short = memory::estimate(desc, {1, 16}, all[0]);
  const auto in_backward = memory::estimate(desc, {1, 16}, all[1]);
  CHECK(in_backward.gradients == 0);
  CHECK(in_backward.backward_peak < none_short.backward_peak);
  CHECK(in_backward.peak < none_short.peak - 3 * P);
  // Pinned host: no state on the device in forward and backward; all of it during the step.
  const auto none = memory::estimate(desc, {4, 128}, all[0]);
  const auto pinned = memory::estimate(desc, {4, 128}, all[2]);
  CHECK(pinned.optimizer_state == 0);
  CHECK(std::llabs(pinned.backward_peak - (none.backward_peak - 8 * P)) <= 1);
  CHECK(std::llabs(pinned.optimizer_peak - none.optimizer_peak) <= 1);

  auto plan_on = [&](bool cuda, double clip) {
    return plan(desc, 128, all, PlanOptions().effective_batch(4).grad_clip(clip).machine(MachineModel().cuda(cuda)));
  };
  auto row = [](const Plan& p, std::string_view flag) {
    for (const auto& r : p.rows)
      if (r.policies.state.flag == flag) return r;
    FAIL("no row for " << flag);
    return PlanRow{};
  };
  const auto cpu = plan_on(false, 1.0);
  CHECK_THAT(row(cpu, "pinned-host").verdict, Catch::Contains("needs CUDA"));
  CHECK_THAT(row(cpu, "step-in-backward").verdict, Catch::Contains("--grad_clip 0"));
  const auto unclipped = plan_on(false, 0.0);
  CHECK(row(unclipped, "step-in-backward").fits());
  CHECK(row(unclipped, "step-in-backward").micro_batch == 4);  // it allows no accumulation
  const auto gpu = plan_on(true, 0.0);
  CHECK(row(gpu, "pinned-host").fits());
  CHECK(row(gpu, "pinned-host").seconds > row(gpu, "resident").seconds);  // the host link costs time
  // Just below plain AdamW's peak at micro-batch 4 (its backward): AdamW must split the batch,
  // the state kept off the device lets pinned-host keep it whole.
  const auto p = plan(desc, 128, all, PlanOptions().effective_batch(4).grad_clip(0).budget_bytes(none.peak - 1)
                                          .machine(MachineModel().cuda(true)));
  INFO(p.explain());
  CHECK(row(p, "resident").micro_batch < 4);
  CHECK(row(p, "pinned-host").micro_batch == 4);
}
