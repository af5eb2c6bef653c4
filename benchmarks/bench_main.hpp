// benchmarks/bench_main.hpp — how every memopt benchmark ends main(): run the measurement,
// add the machine's load average to its JSON line (other work skews timings, so every line
// carries it), print the line on stdout; an error becomes a message and exit code 1.
//   return memopt::bench::print_line([&] { return nlohmann::ordered_json{{"name", "x"}}; });
#pragma once

#include <stdlib.h>  // getloadavg

#include <iostream>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "memopt/error.hpp"
#include "memopt/models/llama.hpp"

namespace memopt::bench {

/// Runs `measure` (returns the JSON line), adds load_avg_1m, prints it; 1 on error.
template <class Measure>
int print_line(Measure&& measure) {
  return memopt::guarded_main([&] {
    nlohmann::ordered_json line = measure();
    double load[1] = {-1};
    getloadavg(load, 1);
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

/// Millions of parameters of a module (the JSON lines' params_m).
inline double params_m(torch::nn::Module& module) {
  int64_t n = 0;
  for (const auto& p : module.parameters()) n += p.numel();
  return static_cast<double>(n) / 1e6;
}

}  // namespace memopt::bench
