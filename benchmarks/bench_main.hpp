// benchmarks/bench_main.hpp — how every memopt benchmark ends main(): run the measurement,
// add the machine's load average to its JSON line (other work skews timings, so every line
// carries it), print the line on stdout; an error becomes a message and exit code 1.
//   return memopt::bench::print_line([&] { return nlohmann::ordered_json{{"name", "x"}}; });
#pragma once

#include <stdlib.h>  // getloadavg

#include <iostream>
#include <string>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "memopt/error.hpp"
#include "memopt/runtime.hpp"
#include "memopt/models/llama.hpp"
#include "memopt/policies/recompute.hpp"
#include "memopt/policies/precision.hpp"

namespace memopt::bench {

/// Runs `measure` (returns the JSON line), adds the platform (torch_version, cpu_flags) and
/// load_avg_1m, prints it; 1 on error.
template <class Measure>
int print_line(Measure&& measure) {
  return memopt::guarded_main([&] {
    nlohmann::ordered_json line = measure();
    double load[1] = {-1};
    getloadavg(load, 1);
    line["torch_version"] = TORCH_VERSION;
    line["cpu_flags"] = memopt::cpu_flags();
    line["load_avg_1m"] = load[0];
    std::cout << line.dump() << std::endl;
    return 0;
  });
}

/// The benchmarks' LLaMA shape: vocab, hidden size, blocks, heads, positions.
inline memopt::models::LlamaConfig llama_config(int64_t vocab, int64_t dim, int64_t layers, int64_t heads,
                                                int64_t seq) {
  return memopt::models::LlamaConfig()
      .vocab_size(vocab)
      .hidden_size(dim)
      .num_hidden_layers(layers)
      .num_attention_heads(heads)
      .max_position_embeddings(seq);
}

/// The LLaMA shape flags of the benchmarks, into cfg.layers, cfg.dim, cfg.heads, cfg.seq.
template <class Config>
void add_shape_options(CLI::App& app, Config& cfg) {
  app.add_option("--layers", cfg.layers, "decoder blocks")->check(CLI::PositiveNumber);
  app.add_option("--dim", cfg.dim, "hidden size")->check(CLI::PositiveNumber);
  app.add_option("--heads", cfg.heads, "attention heads")->check(CLI::PositiveNumber);
  app.add_option("--seq", cfg.seq, "tokens per row (T)")->check(CLI::PositiveNumber);
}

/// --precision and --recompute, into cfg.precision and cfg.recompute: what with_policies reads.
template <class Config>
void add_policy_options(CLI::App& app, Config& cfg) {
  app.add_option("--precision", cfg.precision, "compute precision")->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--recompute", cfg.recompute, "recompute every block in backward (activation checkpointing)")->check(CLI::IsMember({"none", "every"}));
}

/// Calls `run.template operator()<Recompute, Precision>()` with the policy types the
/// --precision (fp32 | bf16: autocast) and --recompute (none | every) strings name: the one
/// runtime branch on a policy, outside every step.
///   auto run = [&]<class C, class P>() { return measure<C, P>(cfg); };
///   auto r = memopt::bench::with_policies(cfg.precision, cfg.recompute, run);
template <class Run>
auto with_policies(const std::string& precision, const std::string& recompute, Run&& run) {
  namespace rc = memopt::recompute;
  namespace prec = memopt::precision;
  const bool bf16 = precision == "bf16", every = recompute == "every";
  if (!bf16 && !every) return run.template operator()<rc::None, prec::Fp32>();
  if (!bf16 && every) return run.template operator()<rc::EveryBlock, prec::Fp32>();
  if (bf16 && !every) return run.template operator()<rc::None, prec::Bf16Autocast>();
  return run.template operator()<rc::EveryBlock, prec::Bf16Autocast>();
}

/// Millions of parameters of a module (the JSON lines' params_m).
inline double params_m(torch::nn::Module& module) {
  int64_t n = 0;
  for (const auto& p : module.parameters()) n += p.numel();
  return static_cast<double>(n) / 1e6;
}

}  // namespace memopt::bench
