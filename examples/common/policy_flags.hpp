// examples/common/policy_flags.hpp — the policy settings every example spells alike, with the
// seeds' spellings as aliases of the same setting (never a second setting):
//   --checkpoint every      = --gradient_checkpointing = --checkpoint every_block
//   --precision bf16        = --mixed_precision
// Each value is stored as it is parsed, so the later of two spellings wins, as with any flag
// given twice (the examples take the last of repeated options).
#pragma once

#include <string>

#include <CLI/CLI.hpp>

namespace examples {

/// --checkpoint VALUE and its alias --gradient_checkpointing; `every` and `every_block` both
/// store `every` (the value this example's code uses for recomputing every block).
inline CLI::Option* add_checkpoint_option(CLI::App& app, std::string& value, const std::string& help,
                                          const std::string& every = "every") {
  auto* option = app.add_option("--checkpoint", value, help)
                     ->transform([every](std::string v) { return v == "every" || v == "every_block" ? every : v; })
                     ->trigger_on_parse();
  app.add_flag_callback("--gradient_checkpointing", [&value, every] { value = every; },
                        "= --checkpoint every (the seeds' spelling)")
      ->trigger_on_parse();
  return option;
}

/// --precision VALUE and its alias --mixed_precision (= bf16: autocast, fp32 master weights).
inline CLI::Option* add_precision_option(CLI::App& app, std::string& value, const std::string& help) {
  auto* option = app.add_option("--precision", value, help)->trigger_on_parse();
  app.add_flag_callback("--mixed_precision", [&value] { value = "bf16"; }, "= --precision bf16 (the seeds' spelling)")
      ->trigger_on_parse();
  return option;
}

/// Whether the user gave the setting in either spelling.
inline bool given(const CLI::App& app, const char* option, const char* alias) {
  return app.count(option) > 0 || app.count(alias) > 0;
}

}  // namespace examples
