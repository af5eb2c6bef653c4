// examples/common/distributed.hpp — what every example does to run data parallel under
// torchrun (scripts/launch): the flags of ZeRO sharding (--zero 1: optimizer state, 3:
// parameters and gradients too; --offload_params, on one rank too; --zero auto in the examples
// that plan: the planner's pick for --memory_budget) and the gradient buckets, and
// output from rank 0 only (the other ranks' stdout goes to /dev/null; errors
// still reach stderr, so a failing rank says why). A world of one trains alone; --zero 3 there
// keeps ZeRO-3's blocks and offload, its collectives being copies.
#pragma once

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <memopt/dist.hpp>  // data parallel: a Trainer in a job of several ranks trains on them all
#include <memopt/memory/estimator.hpp>
#include <memopt/planner.hpp>
#include <memopt/trainer.hpp>

namespace examples {

struct DistributedFlags {
  bool shard_optimizer_state = false;
  std::string zero = "0";  // 0, 1, 3, or auto (add_to(app, true): the program plans for a budget)
  std::string offload_params = "none";
  std::string offload_dir = (std::filesystem::temp_directory_path() / "memopt-offload").string();
  bool keep_gathered = false;
  bool gather_half = false;
  std::string param_gather = "broadcast";
  int64_t bucket_mib = 25;

  /// `plans`: the program plans for --memory_budget (memopt::plan), so --zero auto is allowed.
  void add_to(CLI::App& app, bool plans = false) {
    auto* group = app.add_option_group("data parallel", "with torchrun --nproc_per_node N (scripts/launch)");
    group->add_option("--zero", zero, std::string("ZeRO stage: 0 replicated, 1 optimizer state sharded (each rank "
                      "keeps ~1/N), 3 parameters, gradients and optimizer state sharded (blocks gathered as they run)") +
                      (plans ? "; auto: the fastest stage that fits --memory_budget on these ranks (the planner's)" : ""))
        ->check(plans ? CLI::IsMember({"0", "1", "3", "auto"}) : CLI::IsMember({"0", "1", "3"}))
        ->capture_default_str();
    group->add_flag("--shard_optimizer_state", shard_optimizer_state, "the same as --zero 1");
    group->add_option("--offload_params", offload_params, "--zero 3: none | host (--device cuda: the shards, their "
                      "state and the optimizer step on the host, in pinned memory) | disk (each rank's shards in a "
                      "file under --offload_dir, read ahead of use, out of memory between uses); one rank too")
        ->capture_default_str();
    group->add_option("--offload_dir", offload_dir, "where --offload_params disk keeps its files")->capture_default_str();
    group->add_flag("--keep_gathered", keep_gathered, "--zero 3: each block stays whole from its first use in a step to "
                    "the step's end (one all-gather a block and step, for the memory of the whole model's weights)");
    group->add_flag("--gather_half", gather_half, "--zero 3 --precision bf16: all-gather the blocks' matrices in bf16 "
                    "(what autocast casts them to anyway: the same results, half the bytes)");
    group->add_option("--param_gather", param_gather, "sharded: broadcast | allgather (how updated weights travel)")
        ->capture_default_str();
    group->add_option("--bucket_mib", bucket_mib, "gradient all-reduce bucket size")->capture_default_str();
  }

  bool automatic() const { return zero == "auto"; }
  /// The ZeRO stage: --zero's (1 with --shard_optimizer_state), or for auto the planner's (0 until adopt()).
  int stage() const {
    const int named = automatic() ? chosen_ : std::stoi(zero);
    return named == 0 && shard_optimizer_state ? 1 : named;
  }
  /// --zero auto: the stage the plan chose (PlanRow::zero); apply() again after.
  void adopt(int stage) { chosen_ = stage; }

  /// What the planner weighs over the ranks: every stage for --zero auto, else --zero's (alone:
  /// `options` as they are).
  memopt::PlanOptions plan_options(memopt::PlanOptions options, bool calibrate, const char* program) const {
    TORCH_CHECK(!automatic() || options.budget_bytes() > 0, program, ": --zero auto picks the stage that fits "
                "--memory_budget (got no budget). HINT: add --memory_budget 2GiB, or name the stage: --zero 0, 1 or 3");
    TORCH_CHECK(!automatic() || !calibrate, program, ": --calibrate measures a step on this rank alone, not a "
                "sharded one (got --zero auto). HINT: drop --calibrate, or name the stage: --zero 0, 1 or 3");
    auto& world = memopt::dist::world();
    if (!world.distributed()) return options;
    return options.ranks(world.size()).zero_stages(automatic() ? std::vector<int>{} : std::vector<int>{stage()});
  }
  /// The estimator's run on these ranks (one alone too) at this stage.
  memopt::memory::RunDesc run(memopt::memory::RunDesc run) const {
    run.ranks = memopt::dist::world().size();
    run.zero = stage();
    run.keep_gathered = keep_gathered;
    run.gather_half = gather_half;
    run.offload_params = offload_params == "disk";
    return run;
  }

  /// The data-parallel options on top of `options`. ZeRO-3 on several ranks: the step does not
  /// re-split over --memory_budget (the ranks gather together); the planned micro-batch stands.
  memopt::TrainerOptions apply(memopt::TrainerOptions options) const {
    auto& world = memopt::dist::world();
    const int zero_stage = stage();
    if (zero_stage == 3 && world.distributed() && options.memory_budget() > 0) {
      if (world.rank() == 0)
        fmt::print("--zero 3 on {} ranks: steps are not re-split over --memory_budget (the ranks gather blocks "
                   "together); the planned micro-batch stands\n", world.size());
      options.memory_budget(0);
    }
    TORCH_CHECK(!automatic() || (offload_params == "none" && !keep_gathered && !gather_half), "--zero auto picks "
                "the stage; --offload_params, --keep_gathered and --gather_half belong to ZeRO-3 (got --zero auto "
                "--offload_params ", offload_params, keep_gathered ? " --keep_gathered" : "", gather_half ?
                " --gather_half" : "", "). HINT: name the stage: --zero 3");
    TORCH_CHECK(param_gather == "broadcast" || param_gather == "allgather", "--param_gather must be broadcast or "
                "allgather (got '", param_gather, "'). HINT: broadcast is the default");
    TORCH_CHECK(offload_params == "none" || offload_params == "host" || offload_params == "disk", "--offload_params "
                "must be none, host or disk (got '", offload_params, "'). HINT: host keeps a GPU model's shards in "
                "pinned host memory; disk works on any device");
    TORCH_CHECK(offload_params == "none" || zero_stage == 3, "--offload_params ", offload_params, " offloads ZeRO-3's "
                "parameter shards (got --zero ", zero, "). HINT: add --zero 3");
    TORCH_CHECK(!gather_half || zero_stage == 3, "--gather_half gathers ZeRO-3's blocks in bf16 (got --zero ", zero,
                "). HINT: add --zero 3");
    TORCH_CHECK(!keep_gathered || zero_stage == 3, "--keep_gathered keeps ZeRO-3's blocks whole within a step (got --zero ",
                zero, "). HINT: add --zero 3");
    return options.shard_optimizer_state(zero_stage == 1)
        .shard_params(zero_stage == 3)
        .offload_params_dir(offload_params == "disk" ? offload_dir : "")
        .offload_params_host(offload_params == "host")
        .keep_gathered(keep_gathered)
        .gather_half(gather_half)
        .param_gather(param_gather == "broadcast" ? memopt::dist::ParamGather::kBroadcast
                                                  : memopt::dist::ParamGather::kAllgather)
        .bucket_mib(bucket_mib);
  }

 private:
  int chosen_ = 0;  // --zero auto: the planner's stage
};

/// Joins the job's process group (a world of one without torchrun) and silences stdout on
/// ranks other than 0. Returns the world.
inline memopt::dist::World& join_world(const char* program) {
  auto& world = memopt::dist::world();
  if (world.distributed()) {
    if (world.rank() == 0) {
      fmt::print("{}: data parallel over {} ranks ({}), {} thread(s) each\n", program, world.size(),
                 MEMOPT_HAS_CUDA && torch::cuda::is_available() ? "Gloo; NCCL for CUDA tensors" : "Gloo",
                 at::get_num_threads());
      std::fflush(stdout);
    } else {
      std::fflush(stdout);
      if (std::freopen("/dev/null", "w", stdout) == nullptr) std::perror("freopen /dev/null");
    }
  }
  return world;
}

}  // namespace examples
