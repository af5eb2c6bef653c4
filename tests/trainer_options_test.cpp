// Tests for memopt/trainer_options.hpp: the five groups and their shortcuts are one setting
// each, every group validates its own settings with a HINT, and what a checkpoint records of
// them (resume_settings) keeps its keys.
#include <catch2/catch.hpp>

#include <string>

#include <memopt/trainer_options.hpp>

#include "support.hpp"

TEST_CASE("TrainerOptions: a group's setting and its shortcut are one setting", "[options]") {
  auto o = memopt::TrainerOptions().lr(1e-3).max_steps(7).accum_steps(3).checkpoint_dir("ck").bucket_mib(4);
  CHECK(o.optimizer().lr() == 1e-3);
  CHECK(o.schedule().max_steps() == 7);
  CHECK(o.loop().accum_steps() == 3);
  CHECK(o.state().checkpoint_dir() == "ck");
  CHECK(o.distributed().bucket_mib() == 4);
  o.optimizer().weight_decay(0).grad_clip(0.5);  // a group set in place
  o.state().save_every(100);
  CHECK(o.weight_decay() == 0);
  CHECK(o.grad_clip() == 0.5);
  CHECK(o.save_every() == 100);
  const auto whole = memopt::TrainerOptions().schedule(memopt::ScheduleOptions().warmup_steps(5).max_steps(9));
  CHECK(whole.warmup_steps() == 5);
  CHECK(whole.max_steps() == 9);
  CHECK(whole.lr() == memopt::OptimizerOptions().lr());  // other groups keep their defaults
  CHECK(o.sync_options().bucket_bytes == int64_t{4} << 20);
}

TEST_CASE("TrainerOptions: each group validates its settings, naming the option, the value and a HINT",
          "[options]") {
  using memopt::TrainerOptions;
  const std::string prefix = "memopt::TrainerOptions";
  memopt::test::require_error([] { TrainerOptions().lr(-1).validate(); }, prefix, {"lr must be > 0", "-1", "HINT"});
  memopt::test::require_error([] { TrainerOptions().min_lr_ratio(2).validate(); }, prefix,
                              {"min_lr_ratio", "(got 2)", "HINT"});
  memopt::test::require_error([] { TrainerOptions().log_interval(0).validate(); }, prefix,
                              {"log_interval", "(got 0)", "HINT"});
  memopt::test::require_error([] { TrainerOptions().keep_checkpoints(0).validate(); }, prefix,
                              {"keep_checkpoints", "(got 0)", "HINT"});
  memopt::test::require_error([] { TrainerOptions().bucket_mib(0).validate(); }, prefix,
                              {"bucket_mib", "(got 0)", "HINT"});
  memopt::test::require_error([] { TrainerOptions().param_persistence_threshold(-1).validate(); }, prefix,
                              {"param_persistence_threshold", "(got -1)", "HINT"});
}

TEST_CASE("TrainerOptions: what a checkpoint records keeps its keys and values", "[options]") {
  const auto j = memopt::TrainerOptions().lr(2e-3).warmup_steps(4).accum_steps(2).resume_settings();
  CHECK(j.at("lr") == 2e-3);
  CHECK(j.at("warmup_steps") == 4);
  CHECK(j.at("accum_steps") == 2);
  for (const char* key : {"beta1", "beta2", "eps", "weight_decay", "param_specific_decay", "decay", "min_lr_ratio",
                          "grad_clip", "max_steps", "shard_optimizer_state", "shard_params",
                          "param_persistence_threshold"})
    CHECK(j.contains(key));
  CHECK(j.size() == 15);
  CHECK_FALSE(j.contains("checkpoint_dir"));  // where checkpoints go may change on resume
}
