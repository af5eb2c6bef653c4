// examples/common/cli.hpp — what the examples' command lines share: a long option's words
// join with '-' or '_' alike (--seq-len is --seq_len), and one setting answers to the
// spellings the seeds used (kSteps, kAccum: give them to add_option as the names).
#pragma once

namespace examples {

/// Rewrites each long option's name in argv ("--max-steps", "--max-steps=3") to its '_'
/// spelling, in place, before CLI11 parses it; values are left as they are.
///   examples::underscore_option_names(argc, argv);
///   CLI11_PARSE(app, argc, argv);
inline void underscore_option_names(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    char* arg = argv[i];
    if (arg[0] != '-' || arg[1] != '-') continue;
    for (char* c = arg + 2; *c != '\0' && *c != '='; ++c) {
      if (*c == '-') *c = '_';
    }
  }
}

/// One setting, every spelling (the first is the one --help shows first).
inline constexpr const char* kSteps = "--steps,--max_steps";
inline constexpr const char* kAccum = "--grad_accum,--accum,--gradient_accumulation_steps";

}  // namespace examples
