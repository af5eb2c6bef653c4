// memopt/dist/env.hpp — what torchrun (or a launcher imitating it) tells a worker about
// itself: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT and the elastic agent's
// variables. Reading them starts nothing: code that only needs to know its rank (a metrics
// writer on rank 0) includes this, not dist/world.hpp and its c10d headers.
#pragma once

#include <chrono>
#include <cstdlib>
#include <string>

#include <c10/util/Exception.h>

namespace memopt::dist {

/// What torchrun (or a launcher imitating it) says about this process.
struct Env {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  int restart_count = 0;
  bool agent_store = false;  // TORCHELASTIC_USE_AGENT_STORE=True: torchrun's agent serves the store
  std::chrono::milliseconds timeout{120000};

  /// Reads the variables; a malformed one is an error naming it and its value.
  static Env from_environment() {
    Env env;
    auto number = [](const char* name, int fallback, int low) {
      const char* text = std::getenv(name);
      if (text == nullptr || *text == '\0') return fallback;
      char* end = nullptr;
      const long value = std::strtol(text, &end, 10);
      TORCH_CHECK(end != text && *end == '\0' && value >= low && value <= (1L << 30), "memopt::dist: environment variable ",
                  name, "='", text, "' is not an integer >= ", low, ". HINT: launch with torchrun (scripts/launch), "
                  "which sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT");
      return static_cast<int>(value);
    };
    env.world_size = number("WORLD_SIZE", 1, 1);
    env.rank = number("RANK", 0, 0);
    env.local_rank = number("LOCAL_RANK", env.rank, 0);
    env.master_port = number("MASTER_PORT", 29500, 1);
    env.restart_count = number("TORCHELASTIC_RESTART_COUNT", 0, 0);
    env.timeout = std::chrono::milliseconds(1000L * number("MEMOPT_DIST_TIMEOUT", 120, 1));
    if (const char* addr = std::getenv("MASTER_ADDR"); addr != nullptr && *addr != '\0') env.master_addr = addr;
    const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
    env.agent_store = agent != nullptr && (std::string(agent) == "True" || std::string(agent) == "true" ||
                                           std::string(agent) == "1");
    TORCH_CHECK(env.rank < env.world_size, "memopt::dist: RANK=", env.rank, " is not below WORLD_SIZE=", env.world_size,
                ". HINT: ranks are 0 .. WORLD_SIZE - 1");
    return env;
  }
};

}  // namespace memopt::dist
