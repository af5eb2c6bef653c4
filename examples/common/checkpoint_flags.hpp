// examples/common/checkpoint_flags.hpp — the flags every example shares for never losing a
// run: --save_every, --resume latest|STEP_DIR|OUTPUT_DIR, --keep_checkpoints, --max_skips. Checkpoints go to
// OUTPUT_DIR/checkpoints/step-N (memopt/io/checkpoint.hpp); SIGTERM/SIGINT finish the step,
// save and exit 0 (memopt/signals.hpp).
#pragma once

#include <cstdio>
#include <optional>
#include <string>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <memopt/trainer.hpp>

namespace examples {

struct CheckpointFlags {
  int64_t save_every = 0;
  std::string resume;
  int64_t keep = 3;
  int64_t max_skips = 25;

  void add_to(CLI::App& app) {
    app.add_option("--save_every", save_every,
                   "write a checkpoint every N steps to OUTPUT_DIR/checkpoints (0: only at the end and on "
                   "SIGTERM/SIGINT)")
        ->capture_default_str();
    app.add_option("--resume", resume,
                   "continue from a checkpoint: latest (the newest that passes its checksums; none yet: start "
                   "anew), a step-N directory, or a run's output folder (its newest good checkpoint)");
    app.add_option("--keep_checkpoints", keep, "checkpoints kept (the newest)")->capture_default_str();
    app.add_option("--max_skips", max_skips,
                   "stop (after a checkpoint) when this many steps in a row had an inf/nan loss or gradient "
                   "norm (0: never)")
        ->capture_default_str();
  }

  /// Checkpointing options on top of `options`: OUTPUT_DIR/checkpoints, the flags' values.
  memopt::TrainerOptions apply(memopt::TrainerOptions options, const std::string& output_dir) const {
    return options.checkpoint_dir(output_dir + "/checkpoints")
        .save_every(save_every)
        .keep_checkpoints(keep)
        .max_consecutive_skips(max_skips);
  }

  /// The --precision spelling of the checkpoint --resume reads from OUTPUT_DIR's run (nothing
  /// without --resume, before the first checkpoint, or from one older than the record):
  /// `--precision auto` keeps it (common/precision.hpp).
  std::optional<std::string> saved_precision(const std::string& output_dir) const {
    return memopt::io::saved_precision(resume, apply(memopt::TrainerOptions(), output_dir).checkpoint_dir());
  }

  /// --resume: restores `trainer` and `loader` and says from where. Returns whether it resumed.
  template <class TrainerT, class Loader>
  bool resume_if_asked(TrainerT& trainer, Loader& loader, const std::string& program) const {
    if (resume.empty()) return false;
    const bool resumed = trainer.resume(resume, loader);
    if (resumed) {
      fmt::print("{}: resumed at step {} from {}\n", program, trainer.steps_taken(), trainer.last_checkpoint());
    } else {
      fmt::print("{}: no checkpoint in {} yet: starting at step 0\n", program, trainer.options().checkpoint_dir());
    }
    std::fflush(stdout);
    return resumed;
  }
};

/// After fit(): true when a signal stopped it (the caller exits 0 at once), with a line saying
/// where the checkpoint is.
inline bool stopped_by_signal(const memopt::FitResult& result, int64_t step, const std::string& program) {
  if (result.stop_signal == 0) return false;
  fmt::print("{}: {} after step {}: checkpoint {}; continue with --resume latest\n", program,
             memopt::signal_name(result.stop_signal), step, result.checkpoint.empty() ? "(none: no "
             "checkpoint directory)" : result.checkpoint);
  std::fflush(stdout);
  return true;
}

}  // namespace examples
