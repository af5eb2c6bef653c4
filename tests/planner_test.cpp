// Tests for memopt/planner.hpp and memopt/memory/estimator.hpp: the estimator's peak within
// ±10% of the tracker's on thirteen configurations spanning the policies (two MoE, one
// LLaMA → LLaDA distillation), the runtime →
// compile-time dispatch reaching the instantiation the flags name, the planner choosing the
// fastest fitting combination for three budgets (and the largest micro-batch), and the
// errors of bad flags and sizes.
#include <catch2/catch.hpp>

#include <cmath>
#include <string>
#include <vector>

#include <memopt/memopt.hpp>
#include <memopt/memory/estimator.hpp>
#include <memopt/planner.hpp>

#include "support.hpp"

namespace {

// The instantiations the estimator test runs (a small list keeps this file's compile short).
using EstimatorTrainers = memopt::TypeList<
    memopt::Trainer<memopt::checkpoint::None, memopt::precision::Fp32, memopt::accum::Runtime>,
    memopt::Trainer<memopt::checkpoint::EveryBlock, memopt::precision::Fp32, memopt::accum::Runtime>,
    memopt::Trainer<memopt::checkpoint::EveryNth<2>, memopt::precision::Fp32, memopt::accum::Runtime>,
    memopt::Trainer<memopt::checkpoint::Selective, memopt::precision::Fp32, memopt::accum::Runtime>,
    memopt::Trainer<memopt::checkpoint::None, memopt::precision::Bf16Autocast, memopt::accum::Runtime>,
    memopt::Trainer<memopt::checkpoint::EveryBlock, memopt::precision::Bf16Autocast, memopt::accum::Runtime,
                    memopt::offload::Int8State>,
    memopt::Trainer<memopt::checkpoint::None, memopt::precision::Bf16Pure, memopt::accum::Runtime>,
    memopt::Trainer<memopt::checkpoint::Selective, memopt::precision::Bf16Autocast, memopt::accum::Runtime,
                    memopt::offload::Disk>>;

struct EstimatorCase {
  int64_t experts;  // > 0: a MoE LM (sorted dispatch, top-2); -K: a LLaMA -> LLaDA distillation with top-K KD
  const char* checkpoint;
  const char* precision;
  const char* offload;
  int64_t accum, layers, kv_heads, seq;
  bool blockwise;
  int64_t loss_chunk;
  double dropout;
  const char* trainer;  // the instantiation dispatch must reach
};

struct Measured {
  int64_t peak = 0;
  std::string trainer;
};

// The tracker's peak over one step after a warm-up step (which creates the optimizer state),
// above what was alive before `make_model` built the model. make_model() returns the module
// to train and its loss function.
template <class MakeModel>
Measured measure(MakeModel&& make_model, const memopt::memory::PolicyDesc& policies, int64_t micro, int64_t seq,
                 int64_t vocab) {
  auto& tracker = memopt::memory::Tracker::instance();
  const int64_t before = tracker.live_bytes();  // whatever earlier tests left alive
  torch::manual_seed(7);
  auto [model, loss_fn] = make_model();
  struct Tokens {
    int64_t b, t, v;
    memopt::Batch next() {
      auto rows = torch::randint(v, {b, t + 1}, torch::kLong);  // (B, T+1)
      return {rows.slice(1, 0, t).contiguous(), rows.slice(1, 1).contiguous()};
    }
  } loader{micro, seq, vocab};
  Measured out;
  memopt::dispatch<EstimatorTrainers>(policies, [&]<class T>(std::type_identity<T>) {
    T trainer(*model, memopt::TrainerOptions().accum_steps(policies.accum).max_steps(2));
    out.trainer = T::name();
    trainer.step(loader, loss_fn);
    tracker.reset_peaks();
    trainer.step(loader, loss_fn);
    out.peak = tracker.peak_bytes() - before;
  });
  return out;
}

}  // namespace

TEST_CASE("the estimator predicts the tracker's peak within 10% on thirteen configurations (LLaMA, MoE, distillation)", "[estimator]") {
  REQUIRE(memopt::memory::Tracker::instance().installed());
  const std::vector<EstimatorCase> cases = {
      {0, "none", "fp32", "none", 1, 2, 0, 64, false, 0, 0.0,
       "Trainer<checkpoint::None, precision::Fp32, accum::Runtime, offload::None>"},
      {0, "every", "fp32", "none", 1, 3, 0, 64, false, 0, 0.0,
       "Trainer<checkpoint::EveryBlock, precision::Fp32, accum::Runtime, offload::None>"},
      {0, "every-2", "fp32", "none", 1, 4, 2, 64, false, 0, 0.0,
       "Trainer<checkpoint::EveryNth<2>, precision::Fp32, accum::Runtime, offload::None>"},
      {0, "selective", "fp32", "none", 1, 2, 0, 128, false, 0, 0.0,
       "Trainer<checkpoint::Selective, precision::Fp32, accum::Runtime, offload::None>"},
      {0, "none", "bf16", "none", 1, 2, 0, 64, false, 0, 0.0,
       "Trainer<checkpoint::None, precision::Bf16Autocast, accum::Runtime, offload::None>"},
      {0, "every", "bf16", "int8", 1, 2, 0, 64, false, 0, 0.0,
       "Trainer<checkpoint::EveryBlock, precision::Bf16Autocast, accum::Runtime, offload::Int8State>"},
      {0, "none", "bf16-pure", "none", 2, 2, 0, 64, false, 0, 0.0,
       "Trainer<checkpoint::None, precision::Bf16Pure, accum::Runtime, offload::None>"},
      {0, "selective", "bf16", "disk", 1, 2, 0, 64, false, 0, 0.0,
       "Trainer<checkpoint::Selective, precision::Bf16Autocast, accum::Runtime, offload::Disk>"},
      {0, "none", "fp32", "none", 1, 2, 0, 128, true, 64, 0.0,
       "Trainer<checkpoint::None, precision::Fp32, accum::Runtime, offload::None>"},
      {0, "none", "fp32", "none", 1, 2, 0, 64, false, 0, 0.1,
       "Trainer<checkpoint::None, precision::Fp32, accum::Runtime, offload::None>"},
      {4, "none", "bf16", "none", 1, 2, 0, 64, false, 0, 0.0,
       "Trainer<checkpoint::None, precision::Bf16Autocast, accum::Runtime, offload::None>"},
      {4, "every", "fp32", "none", 1, 2, 0, 64, false, 0, 0.0,
       "Trainer<checkpoint::EveryBlock, precision::Fp32, accum::Runtime, offload::None>"},
      {-16, "every", "bf16", "int8", 1, 2, 0, 64, false, 0, 0.0,
       "Trainer<checkpoint::EveryBlock, precision::Bf16Autocast, accum::Runtime, offload::Int8State>"},
  };
  const int64_t micro = 4;
  for (const auto& c : cases) {
    const auto policies = memopt::memory::PolicyDesc::parse(c.checkpoint, c.precision, c.offload, c.accum);
    auto config = memopt::models::LlamaConfig()
                      .vocab_size(512)
                      .hidden_size(128)
                      .num_hidden_layers(c.layers)
                      .num_attention_heads(4)
                      .num_key_value_heads(c.kv_heads)
                      .max_position_embeddings(c.seq)
                      .attention_kind(c.blockwise ? memopt::nn::AttentionKind::kBlockwise
                                                  : memopt::nn::AttentionKind::kMath)
                      .loss_chunk_size(c.loss_chunk)
                      .dropout(c.dropout);
    const auto moe = memopt::models::MoeConfig().base(config).num_experts(c.experts > 0 ? c.experts : 4).top_k(2);
    const auto student = memopt::models::LlamaConfig(config).vocab_size(513).causal(false);
    const auto kd = memopt::models::DistillOptions(512).top_k(c.experts < 0 ? -c.experts : 0);
    const auto desc = c.experts > 0   ? memopt::memory::ModelDesc::moe(moe)
                      : c.experts < 0 ? memopt::memory::ModelDesc::llada_distill(student, config, kd, false)
                                      : memopt::memory::ModelDesc::llama(config);
    const auto predicted = memopt::memory::estimate(desc, {micro, c.seq}, policies);
    auto lm = [](auto model) {
      return std::pair{model.ptr(), [model](const memopt::Batch& b, const auto& ckpt) mutable { return model->loss_sum(b, ckpt); }};
    };
    const Measured measured =
        c.experts > 0   ? measure([&] { return lm(memopt::models::MoeLM(moe)); }, policies, micro, c.seq, 512)
        : c.experts < 0 ? measure([&] {
                            memopt::models::Llama s(student);
                            auto d = std::make_shared<memopt::models::Distiller>(memopt::models::Llama(config), s, kd);
                            return std::pair{s.ptr(), [d](const memopt::Batch& b, const auto& ckpt) {
                                               return d->loss_sum(b, ckpt);
                                             }};
                          }, policies, micro, c.seq, 512)
                        : measure([&] { return lm(memopt::models::Llama(config)); }, policies, micro, c.seq, 512);
    const double error = static_cast<double>(predicted.peak) / static_cast<double>(measured.peak) - 1.0;
    INFO(policies.name() << (c.experts > 0 ? " MoE" : c.experts < 0 ? " distillation" : "") << (c.blockwise ? " blockwise" : "") << (c.dropout > 0 ? " dropout" : "") << ": predicted "
                         << memopt::memory::mib(predicted.peak) << " MiB, measured "
                         << memopt::memory::mib(measured.peak) << " MiB\n" << predicted.table());
    CHECK(std::abs(error) <= 0.10);
    CHECK(measured.trainer == c.trainer);  // the flags reached the intended instantiation
  }
}

TEST_CASE("the estimate's parts add up and follow the policies", "[estimator]") {
  using memopt::memory::PolicyDesc;
  const auto config = memopt::models::LlamaConfig().vocab_size(1000).hidden_size(64).num_hidden_layers(3)
                          .num_attention_heads(4).max_position_embeddings(64);
  const auto desc = memopt::memory::ModelDesc::llama(config);
  memopt::models::Llama model(config);
  int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();
  CHECK(desc.num_parameters() == params);  // the description counts the real model's parameters

  const auto fp32 = estimate(desc, {4, 64}, PolicyDesc::parse("none", "fp32", "none"));
  CHECK(fp32.parameters == 4 * params);
  CHECK(fp32.optimizer_state == 8 * params);
  CHECK(estimate(desc, {4, 64}, PolicyDesc::parse("none", "fp32", "int8")).optimizer_state < fp32.optimizer_state / 2);
  const auto pure = estimate(desc, {4, 64}, PolicyDesc::parse("none", "bf16-pure", "none"));
  CHECK(pure.parameters == 2 * params);
  CHECK(pure.master_weights == 4 * params);
  const auto every = estimate(desc, {4, 64}, PolicyDesc::parse("every", "fp32", "none"));
  const auto every2 = estimate(desc, {4, 64}, PolicyDesc::parse("every-2", "fp32", "none"));
  CHECK(every.activations < every2.activations);
  CHECK(every2.activations < fp32.activations);
  CHECK(fp32.peak == std::max({fp32.forward_peak, fp32.backward_peak, fp32.optimizer_peak}));
  CHECK_THAT(fp32.table(), Catch::Contains("optimizer state") && Catch::Contains("peak"));
  CHECK(estimate(desc, {8, 64}, PolicyDesc::parse("none", "fp32", "none")).peak > fp32.peak);
}

TEST_CASE("dispatch reaches the instantiation the flags name", "[planner]") {
  using memopt::memory::PolicyDesc;
  auto name_of = [](const PolicyDesc& d) {
    return memopt::dispatch<memopt::StandardTrainers>(d, []<class T>(std::type_identity<T>) { return T::name(); });
  };
  CHECK(memopt::StandardTrainers::size == 48);
  CHECK(name_of(PolicyDesc::parse("none", "fp32", "none")) ==
        "Trainer<checkpoint::None, precision::Fp32, accum::Runtime, offload::None>");
  CHECK(name_of(PolicyDesc::parse("every-2", "bf16-pure", "int8", 4)) ==
        "Trainer<checkpoint::EveryNth<2>, precision::Bf16Pure, accum::Runtime, offload::Int8State>");
  CHECK(name_of(PolicyDesc::parse("selective", "fp16", "disk")) ==
        "Trainer<checkpoint::Selective, precision::Fp16Scaled, accum::Runtime, offload::Disk>");
  CHECK(name_of(PolicyDesc::parse("every", "bf16", "none")) ==
        "Trainer<checkpoint::EveryBlock, precision::Bf16Autocast, accum::Runtime, offload::None>");
  // Every instantiation is reachable, and describes itself as the flags that reach it.
  const auto all = memopt::candidates<memopt::StandardTrainers>();
  const auto names = memopt::trainer_names<memopt::StandardTrainers>();
  for (size_t i = 0; i < all.size(); ++i) CHECK(name_of(all[i]) == names[i]);
  // A combination the list does not hold: an error that lists what it holds.
  memopt::test::require_error(
      [] {
        memopt::dispatch<EstimatorTrainers>(PolicyDesc::parse("every-2", "bf16", "disk"),
                                            []<class T>(std::type_identity<T>) { return 0; });
      },
      "memopt::dispatch", {"--checkpoint every-2 --precision bf16 --offload disk", "HINT", "--checkpoint selective"});
}

TEST_CASE("the planner picks the fastest combination that fits, for three budgets", "[planner]") {
  using memopt::memory::mib;
  const auto desc = memopt::memory::ModelDesc::llama(memopt::models::LlamaConfig().vocab_size(4096).hidden_size(256)
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
  const auto desc = memopt::memory::ModelDesc::llama(memopt::models::LlamaConfig().vocab_size(4096).hidden_size(256)
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
  const auto desc = memopt::memory::ModelDesc::llama(memopt::models::LlamaConfig().vocab_size(2048).hidden_size(256)
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

TEST_CASE("shape_for_params sizes a LLaMA to about the target, with LLaMA-like proportions", "[estimator]") {
  using memopt::memory::ModelDesc;
  const auto base = memopt::models::LlamaConfig().vocab_size(4096).max_position_embeddings(64);
  for (const int64_t target : {int64_t{2'000'000}, int64_t{5'300'000}, int64_t{30'000'000}, int64_t{125'000'000},
                               int64_t{1'000'000'000}}) {
    const auto c = memopt::memory::shape_for_params(target, base);
    const auto params = static_cast<double>(ModelDesc::llama(c).num_parameters());
    INFO(target << " -> " << c.num_hidden_layers() << " layers, d" << c.hidden_size() << ", " << params);
    CHECK(std::abs(std::log(params / static_cast<double>(target))) < 0.1);  // within ~10%
    CHECK(c.hidden_size() % 64 == 0);
    CHECK(c.hidden_size() / c.num_hidden_layers() >= 32);
    CHECK(c.hidden_size() / c.num_hidden_layers() <= 128);
    CHECK(c.vocab_size() == 4096);
    CHECK_NOTHROW(c.validate());
  }
  // The counting matches the built model.
  const auto c = memopt::memory::shape_for_params(3'000'000, base);
  memopt::models::Llama model(c);
  int64_t built = 0;
  for (const auto& p : model->parameters()) built += p.numel();
  CHECK(built == ModelDesc::llama(c).num_parameters());
  // The reference shape (4 layers, d256) is what 5.3 M parameters give.
  const auto ref = memopt::memory::shape_for_params(5'310'720, base);
  CHECK(ref.hidden_size() == 256);
  CHECK(ref.num_hidden_layers() == 4);
  memopt::test::require_error([&] { memopt::memory::shape_for_params(0, base); }, "shape_for_params",
                              {"target_params must be >= 1 (got 0)"});
}
