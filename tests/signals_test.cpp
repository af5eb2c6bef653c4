// tests/signals_test.cpp — memopt/signals.hpp: fit() restores the signal handlers it replaced,
// SIGINT stops a run as SIGTERM does (after the step under way), and signal_name names them.
#include <catch2/catch.hpp>

#include <csignal>
#include <string>

#include <torch/torch.h>

#include <memopt/models/llama.hpp>
#include <memopt/signals.hpp>
#include <memopt/trainer.hpp>

#include "io/fixtures.hpp"

using namespace memopt::test::io;  // NOLINT: the fixtures of the checkpoint tests

TEST_CASE("fit() restores the signal handlers it replaced, and SIGINT stops like SIGTERM", "[checkpoint][signals]") {
  struct sigaction before {};
  sigaction(SIGINT, nullptr, &before);
  torch::manual_seed(3);
  memopt::models::Llama model(tiny_config());
  memopt::Trainer<> trainer(*model, options());  // no checkpoint directory: stops without one
  CountingLoader loader;
  int64_t calls = 0;
  const auto result = trainer.fit(loader, Loss{&model, &calls, 2, SIGINT});
  CHECK(result.stop_signal == SIGINT);
  CHECK(result.steps == 2);
  CHECK(result.checkpoint.empty());
  struct sigaction after {};
  sigaction(SIGINT, nullptr, &after);
  CHECK(after.sa_handler == before.sa_handler);
  CHECK(std::string(memopt::signal_name(SIGINT)) == "SIGINT");
}
