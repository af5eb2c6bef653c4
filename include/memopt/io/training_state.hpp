// memopt/io/training_state.hpp — TrainingState: a Trainer's checkpoints of the run (what
// save_checkpoint() writes and resume() reads, io/checkpoint.hpp's format) and the run
// settings a resume must match. Data parallel: every rank takes part (the StepSync's
// barriers); rank 0 writes the checkpoint with every rank's loader position, CPU random state
// and measured kernel choices (memopt/kernel_choices.hpp), and with a sharded optimizer state
// each other rank writes its own shard.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "memopt/detail/checkpoint_function.hpp"  // RngState
#include "memopt/io/checkpoint.hpp"
#include "memopt/kernel_choices.hpp"
#include "memopt/loop_types.hpp"  // ResumableSource
#include "memopt/step_sync.hpp"

namespace memopt::io {

/// What a Trainer records of itself in each checkpoint: its instantiation, the options that
/// shape the result, and its counters (state.json's "consecutive_skips", "micro_splits").
struct TrainerRecord {
  std::string trainer;
  std::string precision;  // the precision policy's --precision spelling ("": it has no describe())
  nlohmann::json options;
  int64_t consecutive_skips = 0;
  int64_t micro_splits = 1;
};

/// Where Trainer::resume(spec) looks: the run's checkpoint directory, or without one the folder
/// holding `spec` (a step directory).
inline CheckpointManager resume_manager(const std::string& spec, const std::string& checkpoint_dir, int64_t keep) {
  return checkpoint_dir.empty()
             ? CheckpointManager(std::filesystem::path(spec).parent_path().string() + "/.", 1)
             : CheckpointManager(checkpoint_dir, keep);
}

/// The checkpoints of one Trainer's run.
class TrainingState {
 public:
  /// `dir`: where checkpoints go ("": none); the newest `keep` are kept.
  TrainingState(std::string dir, int64_t keep) : dir_(std::move(dir)), keep_(keep) {}

  bool enabled() const { return !dir_.empty(); }
  void set_run_config(nlohmann::json config) { run_config_ = std::move(config); }
  /// The checkpoint last written or resumed from ("" if none).
  const std::string& last_checkpoint() const { return last_checkpoint_; }
  /// The step of that checkpoint (-1: none yet).
  int64_t last_saved_step() const { return last_saved_step_; }

  /// Writes the state after `trainer.steps_taken()` steps (see Trainer::save_checkpoint).
  template <class TrainerT, class Loader>
  std::string save(torch::nn::Module& model, const TrainerT& trainer, StepSync& sync, const Loader& loader,
                   const TrainerRecord& record, const std::string& reason) {
    TORCH_CHECK(enabled(), "memopt::Trainer::save_checkpoint: no checkpoint directory is set. "
                "HINT: TrainerOptions().checkpoint_dir(\"runs/a/checkpoints\")");
    const int64_t step = trainer.steps_taken();
    nlohmann::json state = {{"reason", reason},
                            {"trainer", record.trainer},
                            {"options", record.options},
                            {"config", run_config_},
                            {"consecutive_skips", record.consecutive_skips},
                            {"micro_splits", record.micro_splits}};
    if (!record.precision.empty()) state["precision"] = record.precision;  // saved_precision() reads it
    if constexpr (ResumableSource<Loader>) state["loader"] = loader.state();
    state["kernels"] = kernel_choices::capture();  // a resume replays them (distributed: each rank's own)
    if (sync.distributed()) {  // every rank saves (a collective); rank 0 writes, other ranks their shards
      state["world_size"] = sync.size();
      state["ranks"] = sync.gather(rank_state(loader), fmt::format("checkpoint/{}", step));
      if (sync.rank() != 0) {
        if (sync.sharded()) {
          sync.barrier("checkpoint: directory made");
          write_trainer_file(manager().path_of(step) + ".tmp/" + shard_file(sync.rank()), trainer);
          sync.barrier("checkpoint: shards written");
        }
        last_checkpoint_ = manager().path_of(step);
      }
    }
    if (sync.rank() == 0) {
      last_checkpoint_ = manager().save(step, [&](const std::string& tmp) {
        std::vector<std::string> shards;  // the other ranks' optimizer state, listed in the manifest
        if (sync.sharded()) {
          sync.barrier("checkpoint: directory made");
          sync.barrier("checkpoint: shards written");
          for (int r = 1; r < sync.size(); ++r) shards.push_back(shard_file(r));
        }
        write_checkpoint(tmp, model, trainer, state, shards);
      });
    }
    sync.barrier("checkpoint: saved");
    last_saved_step_ = step;
    return last_checkpoint_;
  }

  /// Reads a checkpoint into `model` and `trainer` (see Trainer::resume): refuses one written by
  /// another Trainer, options (`mutable_options` may differ), run config or number of ranks,
  /// naming each difference. Returns its state.json, or nothing when "latest" finds none.
  template <class TrainerT, class Loader>
  std::optional<nlohmann::json> resume(const std::string& spec, torch::nn::Module& model, TrainerT& trainer,
                                       StepSync& sync, Loader& loader, const TrainerRecord& record,
                                       const std::set<std::string>& mutable_options) {
    const std::string who = "memopt::Trainer::resume('" + spec + "')";
    TORCH_CHECK(spec != "latest" || enabled(), who, ": 'latest' needs a checkpoint directory. "
                "HINT: set TrainerOptions().checkpoint_dir(...), or pass a step-N directory");
    const CheckpointManager checkpoints = resume_manager(spec, dir_, keep_);
    std::vector<std::string> refused;
    const std::string dir = checkpoints.resolve(spec, &refused);
    for (const auto& reason : refused) fmt::print(stderr, "memopt: refused a checkpoint, using an older one: {}\n", reason);
    if (dir.empty()) return std::nullopt;

    const nlohmann::json state = read_checkpoint_state(dir);
    TORCH_CHECK(state.value("trainer", "") == record.trainer, who, ": '", dir, "' was written by ",
                state.value("trainer", "?"), ", this is ", record.trainer,
                ". HINT: resume with the policies of the run that wrote it");
    // First: another number of ranks also changes what depends on it (the global batch).
    const int saved_world = state.value("world_size", 1);
    TORCH_CHECK(saved_world == sync.size(), who, ": '", dir, "' was written by ", saved_world, " rank(s), this run has ",
                sync.size(), ". HINT: resume with the number of ranks (--nproc_per_node) of the run that wrote it");
    auto differences = setting_differences(state.value("options", nlohmann::json()), record.options, mutable_options);
    const auto config = setting_differences(state.value("config", nlohmann::json()), run_config_, {}, "config");
    differences.insert(differences.end(), config.begin(), config.end());
    std::string listed;
    for (const auto& d : differences) listed += "\n  " + d;
    TORCH_CHECK(differences.empty(), who, ": '", dir, "' was written with other settings:", listed,
                "\nHINT: resume with the settings of the run that wrote it, or start a new run elsewhere");
    const nlohmann::json& mine = sync.distributed() ? state.at("ranks").at(static_cast<size_t>(sync.rank())) : state;
    if constexpr (ResumableSource<Loader>) {
      TORCH_CHECK(mine.contains("loader"), who, ": '", dir, "' holds no data-loader position. "
                  "HINT: it was written with a loader that has no state()");
      loader.load_state(mine["loader"]);
    }
    const bool own_shard = sync.sharded() && sync.rank() != 0;
    read_checkpoint(dir, model, trainer, /*verify=*/false, own_shard ? shard_file(sync.rank()) : "trainer.pt");
    if (sync.distributed()) restore_cpu_rng(mine.at("rng_cpu").get<std::string>());
    if (mine.contains("kernels")) {  // (older checkpoints have none: the run measures its own)
      const std::string note = kernel_choices::restore(mine["kernels"], who);
      if (!note.empty()) fmt::print(stderr, "memopt: {}\n", note);
    }
    last_saved_step_ = trainer.steps_taken();
    last_checkpoint_ = dir;
    return state;
  }

 private:
  CheckpointManager manager() const { return CheckpointManager(dir_, keep_); }

  static std::string shard_file(int rank) { return "trainer-rank" + std::to_string(rank) + ".pt"; }

  // This rank's loader position, CPU generator and kernel choices (rank 0 gathers every rank's).
  template <class Loader>
  static nlohmann::json rank_state(const Loader& loader) {
    const auto rng = memopt::detail::RngState::capture().cpu.contiguous();
    std::string hex;
    for (int64_t i = 0; i < rng.numel(); ++i) hex += fmt::format("{:02x}", rng.data_ptr<uint8_t>()[i]);
    nlohmann::json mine = {{"rng_cpu", hex}, {"kernels", kernel_choices::capture()}};
    if constexpr (ResumableSource<Loader>) mine["loader"] = loader.state();
    return mine;
  }

  static void restore_cpu_rng(const std::string& hex) {
    TORCH_CHECK(hex.size() % 2 == 0, "memopt::Trainer::resume: \"rng_cpu\" of this rank is not hex. HINT: the "
                "checkpoint's state.json is damaged");
    torch::Tensor state = torch::empty({static_cast<int64_t>(hex.size() / 2)}, torch::kByte);
    for (size_t i = 0; i < hex.size() / 2; ++i)
      state.data_ptr<uint8_t>()[i] = static_cast<uint8_t>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
    memopt::detail::RngState rng;
    rng.cpu = state;
    rng.restore();
  }

  std::string dir_;
  int64_t keep_;
  nlohmann::json run_config_ = nlohmann::json::object();
  int64_t last_saved_step_ = -1;
  std::string last_checkpoint_;
};

/// The --precision spelling ("fp32", "bf16", …) of the checkpoint a Trainer::resume(spec) with
/// `checkpoint_dir` (TrainerOptions::checkpoint_dir) would read, from its state.json; nothing
/// when there is none yet, it predates the record, or its state.json does not read (the resume
/// then says why, or skips it). For `--precision auto` with `--resume`: a resumed run keeps its
/// precision, which auto may measure otherwise on another CPU (and the resume refuses another
/// Trainer). A quick look, checksums unread: should the resume skip a damaged newest checkpoint
/// for an older one of another precision, it refuses that one, naming both Trainers.
///   if (auto p = memopt::io::saved_precision("latest", "runs/a/checkpoints")) precision = *p;
inline std::optional<std::string> saved_precision(const std::string& spec, const std::string& checkpoint_dir) {
  if (spec.empty() || (spec == "latest" && checkpoint_dir.empty())) return std::nullopt;
  try {
    const std::string dir = resume_manager(spec, checkpoint_dir, 1).resolve(spec, nullptr, /*verify=*/false);
    if (dir.empty() || !std::filesystem::exists(std::filesystem::path(dir) / "state.json")) return std::nullopt;
    const nlohmann::json state = read_checkpoint_state(dir);
    if (state.contains("precision") && state["precision"].is_string()) return state["precision"].get<std::string>();
  } catch (const c10::Error&) {  // a damaged state.json: the resume proper decides
  }
  return std::nullopt;
}

}  // namespace memopt::io
