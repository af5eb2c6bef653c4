// tests/machine_test.cpp — memopt/machine.hpp: the GEMM probe and the precision it chooses.
#include <catch2/catch.hpp>

#include <cmath>

#include <memopt/machine.hpp>

TEST_CASE("cpu_kind names the best bf16 instructions /proc/cpuinfo reports", "[machine]") {
  const std::string kind = memopt::cpu_kind();
  if (memopt::cpu_has("amx_bf16")) CHECK(kind == "amx");
  else if (memopt::cpu_has("avx512_bf16")) CHECK(kind == "avx512_bf16");
  else if (memopt::cpu_has("avx2")) CHECK(kind == "avx2");
  else CHECK(kind == "other");
  CHECK(memopt::cpu_flags().find(kind == "amx" ? "amx_bf16" : kind == "other" ? "" : kind) != std::string::npos);
}

TEST_CASE("matmul_speed measures both dtypes once per process", "[machine]") {
  const auto& first = memopt::machine::matmul_speed();
  CHECK(first.size == 512);
  CHECK(first.threads == at::get_num_threads());
  CHECK(first.fp32_gflops > 0.1);  // even the reference BLAS does ~5 GFLOP/s
  CHECK(first.bf16_gflops > 0.01);
  CHECK(first.bf16_over_fp32() == Approx(first.bf16_gflops / first.fp32_gflops));
  CHECK(&memopt::machine::matmul_speed() == &first);  // the same figures, not a second probe
}

TEST_CASE("a GEMM speed probe leaves the tracked peak where it was", "[machine][memory]") {
  auto& tracker = memopt::memory::Tracker::instance();
  REQUIRE(tracker.installed());
  tracker.reset_peaks();
  const int64_t peak = tracker.peak_bytes();
  const int64_t allocations = tracker.snapshot().allocations;
  CHECK(memopt::machine::gemm_gflops(256, 128, 512, torch::kFloat32, 1) > 0);
  CHECK(tracker.snapshot().allocations - allocations >= 3);  // it did allocate: operands and products
  CHECK(tracker.peak_bytes() == peak);                       // 1.1 MiB at least, none of it a peak
}

TEST_CASE("gemm_gflops times the shape it is given", "[machine]") {
  // Operands of the shapes asked for; one untimed warm-up, then `reps` timed products.
  int calls = 0;
  const auto count = [&calls](const torch::Tensor& a, const torch::Tensor& b) {
    ++calls;
    CHECK(a.sizes() == torch::IntArrayRef{64, 32});
    CHECK(b.sizes() == torch::IntArrayRef{32, 16});
    return torch::mm(a, b);
  };
  CHECK(memopt::machine::detail::gemm_gflops(64, 32, 16, torch::kFloat32, 4, count) > 0);
  CHECK(calls == 5);  // one warm-up, then the 4 timed
  const double r = memopt::machine::gemm_gflops(64, 32, 16, torch::kFloat32, 1);
  CHECK(std::isfinite(r));
}

TEST_CASE("choose_precision follows the measured ratio and says why", "[machine]") {
  const double ratio = memopt::machine::matmul_speed().bf16_over_fp32();
  const auto bf16 = memopt::machine::choose_precision(torch::kCPU, ratio * 0.5);  // bf16 clears the bar
  const auto fp32 = memopt::machine::choose_precision(torch::kCPU, ratio * 2.0);  // it does not
  CHECK(bf16.precision == "bf16");
  CHECK(fp32.precision == "fp32");
  CHECK_THAT(fp32.reason, Catch::Contains("GFLOP/s") && Catch::Contains(memopt::cpu_kind()));
  CHECK(memopt::machine::choose_precision(torch::Device(torch::kCUDA, 0)).precision == "bf16");
  CHECK(memopt::machine::resolve_precision("fp32").precision == "fp32");
  CHECK(memopt::machine::resolve_precision("auto").precision ==
        memopt::machine::choose_precision(torch::kCPU).precision);
}
