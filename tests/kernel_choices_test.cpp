// tests/kernel_choices_test.cpp — memopt/kernel_choices.hpp: capture() records the bf16 and fp32
// GEMM modes and attention_auto's kernel per shape, restore() runs them again unmeasured (through a JSON
// round trip), not when they were measured on another CPU kind, and a damaged record is an
// error naming the value.
#include <catch2/catch.hpp>

#include <string>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <memopt/kernel_choices.hpp>

#include "support.hpp"

namespace {

namespace bgemm = memopt::bf16_gemm;
namespace fgemm = memopt::fp32_gemm;
using memopt::nn::AttentionKind;
using memopt::nn::AttentionShape;

// A shape no other test chooses for: (1, 3, 24, 8), causal.
AttentionShape kernel_choices_shape() {
  const auto q = torch::randn({1, 3, 24, 8});
  return AttentionShape::of(q, q, q, /*causal=*/true, /*padded=*/false);
}

// capture()'s entry for `shape` (null when there is none).
nlohmann::json entry_for(const nlohmann::json& captured, const AttentionShape& shape) {
  for (const auto& e : captured.at("attention"))
    if (memopt::kernel_choices::detail::shape_of(e.at("shape"), "test").key() == shape.key()) return e;
  return nullptr;
}

}  // namespace

TEST_CASE("kernel choices: a restore runs the captured GEMM modes and attention kernels unmeasured",
          "[kernel_choices]") {
  bgemm::ScopedMode keep(bgemm::mode());
  fgemm::ScopedMode keep_fp32(fgemm::mode());
  bgemm::enable();
  fgemm::enable();
  const auto shape = kernel_choices_shape();
  const auto measured = memopt::nn::choose_attention(shape);  // measured: the timings are real
  CHECK(measured.sdpa.ms > 0);

  bgemm::set_mode(bgemm::Mode::Fp32Compute);
  fgemm::set_mode(fgemm::Mode::Blocked);
  memopt::nn::remember_attention(shape, AttentionKind::kBlockwise);
  const auto saved = nlohmann::json::parse(memopt::kernel_choices::capture().dump());  // as state.json holds it
  CHECK(saved.at("cpu") == memopt::cpu_kind());
  CHECK(saved.at("bf16_gemm") == "fp32");
  CHECK(saved.at("fp32_gemm") == "blocked");
  const auto entry = entry_for(saved, shape);
  REQUIRE(entry.is_object());
  CHECK(entry.at("kind") == "blockwise");

  // Another process would measure afresh: here, other choices in place of the saved ones.
  bgemm::set_mode(bgemm::Mode::Native);
  fgemm::set_mode(fgemm::Mode::Native);
  memopt::nn::remember_attention(shape, AttentionKind::kSdpa);
  const auto note = memopt::kernel_choices::restore(saved, "test");
  CHECK_THAT(note, Catch::Contains("bf16_gemm fp32, as the run that saved the checkpoint measured "
                                   "(this process chose native)"));
  CHECK_THAT(note, Catch::Contains("fp32_gemm blocked, as the run that saved the checkpoint measured "
                                   "(this process chose native)"));
  CHECK(memopt::kernel_choices::restore(saved, "test").empty());  // nothing left to override
  CHECK(bgemm::mode() == bgemm::Mode::Fp32Compute);
  CHECK(fgemm::mode() == fgemm::Mode::Blocked);
  const auto restored = memopt::nn::choose_attention(shape);
  CHECK(restored.kind == AttentionKind::kBlockwise);
  CHECK(restored.sdpa.ms == 0);  // not measured again
  CHECK(restored.blockwise.ms == 0);
}

TEST_CASE("kernel choices measured on another CPU kind are not restored, and the note says why",
          "[kernel_choices]") {
  bgemm::ScopedMode keep(bgemm::Mode::Native);
  const auto shape = kernel_choices_shape();
  memopt::nn::remember_attention(shape, AttentionKind::kSdpa);
  auto saved = memopt::kernel_choices::capture();
  saved["cpu"] = "not-" + memopt::cpu_kind();
  saved["bf16_gemm"] = "fp32";
  for (auto& e : saved["attention"]) e["kind"] = "blockwise";
  const std::string note = memopt::kernel_choices::restore(saved, "test");
  CHECK_THAT(note, Catch::Contains("measured on a not-" + memopt::cpu_kind() + " CPU"));
  CHECK(bgemm::mode() == bgemm::Mode::Native);
  CHECK(memopt::nn::choose_attention(shape).kind == AttentionKind::kSdpa);
}

TEST_CASE("a damaged kernel-choices record is an error naming the value, with a HINT", "[kernel_choices][errors]") {
  bgemm::ScopedMode keep(bgemm::mode());
  bgemm::enable();
  const auto restore = [](const nlohmann::json& j) { return memopt::kernel_choices::restore(j, "resume('x')"); };
  const auto cpu = memopt::cpu_kind();
  memopt::test::require_error([&] { restore(nlohmann::json::array()); }, "resume('x')", {"must be a JSON object"});
  memopt::test::require_error([&] { restore({{"cpu", cpu}, {"bf16_gemm", "bogus"}}); }, "resume('x')",
                              {"bf16_gemm 'bogus'", "native or fp32"});
  fgemm::ScopedMode keep_fp32(fgemm::mode());
  fgemm::enable();
  memopt::test::require_error([&] { restore({{"cpu", cpu}, {"fp32_gemm", 3}}); }, "resume('x')",
                              {"fp32_gemm '3'", "native or blocked"});
  auto good = memopt::kernel_choices::detail::shape_json(kernel_choices_shape());
  memopt::test::require_error(
      [&] { restore({{"cpu", cpu}, {"attention", {{{"shape", good}, {"kind", "math"}}}}}); }, "resume('x')",
      {"attention 'math'", "sdpa, flash or blockwise"});
  memopt::test::require_error([&] { restore({{"cpu", cpu}, {"attention", {{{"kind", "sdpa"}}}}}); }, "resume('x')",
                              {"must hold \"shape\" and \"kind\""});
  auto no_dim = good;
  no_dim.erase("head_dim");
  memopt::test::require_error([&] { restore({{"cpu", cpu}, {"attention", {{{"shape", no_dim}, {"kind", "sdpa"}}}}}); },
                              "resume('x')", {"malformed", "head_dim"});
  auto odd_dtype = good;
  odd_dtype["dtype"] = "Int";
  memopt::test::require_error(
      [&] { restore({{"cpu", cpu}, {"attention", {{{"shape", odd_dtype}, {"kind", "sdpa"}}}}}); }, "resume('x')",
      {"dtype 'Int'"});
}
