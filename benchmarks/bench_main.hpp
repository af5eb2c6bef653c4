// benchmarks/bench_main.hpp — how every memopt benchmark ends main(): run the measurement,
// add the machine's load average to its JSON line (other work skews timings, so every line
// carries it), print the line on stdout; an error becomes a message and exit code 1.
//   return memopt::bench::print_line([&] { return nlohmann::ordered_json{{"name", "x"}}; });
#pragma once

#include <stdlib.h>  // getloadavg

#include <iostream>

#include <nlohmann/json.hpp>

#include "memopt/error.hpp"

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

}  // namespace memopt::bench
