// tests/io/training_state_test.cpp — memopt/io/training_state.hpp: a resume refuses a checkpoint
// of other policies, options or run settings, naming each difference; a longer max_steps extends
// the run; saved_precision reads the precision a resume would resume in.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <memopt/io/checkpoint.hpp>
#include <memopt/io/training_state.hpp>
#include <memopt/models/llama.hpp>
#include <memopt/trainer.hpp>

#include "io/fixtures.hpp"
#include "support.hpp"

using namespace memopt::test::io;  // NOLINT: the fixtures of the checkpoint tests

TEST_CASE("resume refuses other policies, options or run settings, naming each difference", "[checkpoint]") {
  memopt::test::TempDir dir("memopt_checkpoint");
  const std::string root = dir.file("ckpt");
  torch::manual_seed(1);
  memopt::models::Llama model(tiny_config());
  {
    memopt::Trainer<> trainer(*model, options(root).max_steps(2));
    trainer.set_run_config({{"layers", 2}, {"data", "brown"}});
    CountingLoader loader;
    fit(model, trainer, loader);
  }
  CountingLoader loader;
  {
    memopt::Trainer<> other(*model, options(root).lr(5e-3).grad_clip(0.5));
    other.set_run_config({{"layers", 3}, {"data", "brown"}});
    memopt::test::require_error([&] { other.resume("latest", loader); }, "memopt::Trainer::resume('latest')",
                                {"other settings", "lr: 0.01 in the checkpoint, 0.005 now",
                                 "grad_clip: 1.0 in the checkpoint, 0.5 now", "config.layers: 2 in the checkpoint, 3 now"});
  }
  {
    memopt::Trainer<memopt::recompute::EveryBlock> other(*model, options(root));
    memopt::test::require_error([&] { other.resume("latest", loader); }, "memopt::Trainer::resume('latest')",
                                {"Trainer<recompute::None", "this is Trainer<recompute::EveryBlock"});
  }
  {  // max_steps may change: a run is extended
    memopt::Trainer<> longer(*model, options(root).max_steps(3));
    longer.set_run_config({{"layers", 2}, {"data", "brown"}});
    CHECK(longer.resume("latest", loader));
    CHECK(fit(model, longer, loader).steps == 1);
  }
  CHECK(memopt::io::setting_differences({{"a", {{"b", 1}}}}, {{"a", {{"b", 2}}}, {"c", 3}}) ==
        std::vector<std::string>{"a.b: 1 in the checkpoint, 2 now", "c: \"(absent)\" in the checkpoint, 3 now"});
}

TEST_CASE("a resume runs the kernels the saving run measured: its GEMM modes, from state.json", "[checkpoint]") {
  namespace bgemm = memopt::bf16_gemm;
  namespace fgemm = memopt::fp32_gemm;
  bgemm::ScopedMode keep(bgemm::mode());
  fgemm::ScopedMode keep_fp32(fgemm::mode());
  memopt::test::TempDir dir("memopt_checkpoint");
  const std::string root = dir.file("ckpt");
  using T = memopt::Trainer<memopt::recompute::None, memopt::precision::Bf16Autocast>;
  torch::manual_seed(1);
  memopt::models::Llama model(tiny_config());
  {
    T trainer(*model, options(root).max_steps(2));  // bf16 on the CPU: bf16_gemm::enable() has run
    REQUIRE(bgemm::enabled());
    REQUIRE(fgemm::enabled());
    bgemm::set_mode(bgemm::Mode::Fp32Compute);      // as if its probe had measured widening faster
    fgemm::set_mode(fgemm::Mode::Blocked);          // and the blocked fp32 kernel faster
    CountingLoader loader;
    fit(model, trainer, loader);
  }
  const auto state = memopt::io::read_checkpoint_state(root + "/step-00000002");
  CHECK(state.at("kernels").at("bf16_gemm") == "fp32");
  CHECK(state.at("kernels").at("fp32_gemm") == "blocked");
  CHECK(state.at("kernels").at("cpu") == memopt::cpu_kind());
  bgemm::set_mode(bgemm::Mode::Native);             // the resumed process measured the other way
  fgemm::set_mode(fgemm::Mode::Native);
  T resumed(*model, options(root).max_steps(2));
  CountingLoader loader;
  REQUIRE(resumed.resume("latest", loader));
  CHECK(bgemm::mode() == bgemm::Mode::Fp32Compute);
  CHECK(fgemm::mode() == fgemm::Mode::Blocked);
}

TEST_CASE("saved_precision names the precision of the checkpoint a resume would read", "[checkpoint]") {
  memopt::test::TempDir dir("memopt_checkpoint");
  const std::string fp32_root = dir.file("fp32/checkpoints"), bf16_root = dir.file("bf16/checkpoints");
  CHECK_FALSE(memopt::io::saved_precision("latest", fp32_root).has_value());  // nothing saved yet
  torch::manual_seed(1);
  memopt::models::Llama model(tiny_config());
  {
    memopt::Trainer<> trainer(*model, options(fp32_root).max_steps(2));
    CountingLoader loader;
    fit(model, trainer, loader);
  }
  {
    memopt::Trainer<memopt::recompute::None, memopt::precision::Bf16Autocast> trainer(*model,
                                                                                    options(bf16_root).max_steps(1));
    CountingLoader loader;
    fit(model, trainer, loader);
  }
  CHECK(memopt::io::read_checkpoint_state(fp32_root + "/step-00000002").at("precision") == "fp32");
  CHECK(memopt::io::saved_precision("latest", fp32_root) == "fp32");
  CHECK(memopt::io::saved_precision("latest", bf16_root) == "bf16");
  // A step directory, a run's output folder or its checkpoints folder, as resume resolves them.
  CHECK(memopt::io::saved_precision(bf16_root + "/step-00000001", "") == "bf16");
  CHECK(memopt::io::saved_precision(dir.file("bf16"), fp32_root) == "bf16");
  CHECK(memopt::io::saved_precision(bf16_root, fp32_root) == "bf16");
  CHECK_FALSE(memopt::io::saved_precision("", fp32_root).has_value());               // no --resume
  CHECK_FALSE(memopt::io::saved_precision(dir.file("nowhere"), fp32_root).has_value());  // resume says why
  const std::string damaged = dir.file("damaged/step-00000001");
  std::filesystem::create_directories(damaged);
  std::ofstream(damaged + "/state.json") << "{\"precision\": ";
  CHECK_FALSE(memopt::io::saved_precision(damaged, "").has_value());  // resume refuses it, or skips it
}
