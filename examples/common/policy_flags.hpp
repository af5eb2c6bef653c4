// examples/common/policy_flags.hpp — the policy settings every example spells alike, with the
// seeds' and earlier spellings as aliases of the same setting (never a second setting):
//   --recompute every        = --gradient_checkpointing = --checkpoint every = --recompute every_block
//   --precision bf16         = --mixed_precision = --use_mixed_precision (TinyStories' spelling)
//   --optimizer_state VALUE  = --offload VALUE; `none` = `resident` (AdamW's state where the weights are)
//   --optimizer_state int8   = --use_8bit_optimizer (TinyStories' spelling)
// Each value is stored as it is parsed, so the later of two spellings wins, as with any flag
// given twice (the examples take the last of repeated options).
#pragma once

#include <initializer_list>
#include <string>

#include <CLI/CLI.hpp>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>
#include <memopt/dispatch.hpp>

namespace examples {

/// --recompute VALUE (memopt::recompute::*) and its aliases --checkpoint VALUE and
/// --gradient_checkpointing; `every` and `every_block` both store `every` (the value this
/// example's code uses for recomputing every block).
inline CLI::Option* add_recompute_option(CLI::App& app, std::string& value, const std::string& help,
                                         const std::string& every = "every") {
  auto to_every = [every](std::string v) { return v == "every" || v == "every_block" ? every : v; };
  auto* option = app.add_option("--recompute", value, help)->transform(to_every)->trigger_on_parse();
  app.add_option("--checkpoint", value, "= --recompute (its earlier name)")->transform(to_every)->trigger_on_parse();
  app.add_flag_callback("--gradient_checkpointing", [&value, every] { value = every; },
                        "= --recompute every (the seeds' spelling)")
      ->trigger_on_parse();
  return option;
}

/// --precision VALUE and its aliases --mixed_precision and --use_mixed_precision (= bf16: autocast, fp32
/// master weights).
inline CLI::Option* add_precision_option(CLI::App& app, std::string& value, const std::string& help) {
  auto* option = app.add_option("--precision", value, help)->trigger_on_parse();
  app.add_flag_callback("--mixed_precision", [&value] { value = "bf16"; }, "= --precision bf16 (the seeds' spelling)")
      ->trigger_on_parse();
  app.add_flag_callback("--use_mixed_precision", [&value] { value = "bf16"; }, "= --precision bf16 (TinyStories' "
                        "spelling)")
      ->trigger_on_parse();
  return option;
}

/// --optimizer_state VALUE (memopt::state::*) and its alias --offload VALUE; `none` stores
/// `resident`.
inline CLI::Option* add_state_option(CLI::App& app, std::string& value, const std::string& help) {
  auto to_resident = [](std::string v) { return v == "none" ? std::string("resident") : v; };
  auto* option = app.add_option("--optimizer_state", value, help)->transform(to_resident)->trigger_on_parse();
  app.add_option("--offload", value, "= --optimizer_state (its earlier name)")->transform(to_resident)
      ->trigger_on_parse();
  return option;
}

/// What --optimizer_state pinned-host adds to an example's compiled list: recompute none/every ×
/// fp32/bf16 autocast with AdamW's state in pinned host memory between steps
/// (memopt::state::PinnedHost; CUDA runs), under each of `Accums`.
template <class Accums = memopt::TypeList<memopt::accum::Runtime>>
using PinnedHostTrainers =
    memopt::TrainerProductT<memopt::TypeList<memopt::recompute::None, memopt::recompute::EveryBlock>,
                            memopt::TypeList<memopt::precision::Fp32, memopt::precision::Bf16Autocast>,
                            memopt::TypeList<memopt::state::PinnedHost>, Accums>;

/// --optimizer_state pinned-host keeps AdamW's state in pinned host memory between the steps of a
/// GPU run (memopt::state::PinnedHost); on the CPU the state is in host memory already, so it is
/// refused there, naming `who` and the device, with the choices that remain.
inline void check_state(const std::string& state, const char* who, const c10::Device& device,
                        const std::string& cpu_choices = "resident") {
  TORCH_CHECK(state != "pinned-host" || device.is_cuda(), who, ": --optimizer_state pinned-host keeps AdamW's state "
              "in pinned host memory for training on a GPU (got --device ", device.str(), "). HINT: use --device "
              "cuda; on the CPU the state is in host memory already: use ", cpu_choices);
}

/// --use_8bit_optimizer (TinyStories' spelling): = --optimizer_state int8, for the examples whose
/// --optimizer_state takes int8 (add it after add_state_option).
inline void add_8bit_optimizer_alias(CLI::App& app, std::string& value) {
  app.add_flag_callback("--use_8bit_optimizer", [&value] { value = "int8"; }, "= --optimizer_state int8 "
                        "(TinyStories' spelling: AdamW with 8-bit moments)")
      ->trigger_on_parse();
}

/// Whether the user gave the setting in any of its spellings.
inline bool given(const CLI::App& app, std::initializer_list<const char*> spellings) {
  for (const char* s : spellings)
    if (app.count(s) > 0) return true;
  return false;
}

}  // namespace examples
