// memopt/fp32_gemm.hpp — fp32 matrix products on the CPU on oneDNN's brgemm micro-kernels,
// blocked and threaded by memopt (detail/blocked_gemm.hpp), where that beats LibTorch's GEMM.
// LibTorch sends an fp32 `mm` to MKL. On 2 cores of an AMD EPYC (Zen 4, AVX512-BF16) MKL ran
// the 8 × d512 trainer's products at 195–204 GFLOP/s, 84–88% of the cores' FMA peak (232), and
// the blocked kernel at 218–228; there a step is ~87% fp32 GEMMs. enable() measures both and
// where the blocked kernel is at least kMinGain faster it takes the CPU's fp32 mm, mm.out, addmm
// and addmm_ (memopt/detail/cpu_gemm.hpp's kernels, beside bf16_gemm's), for operands it takes:
// matrices of at least 2^22 multiply-adds, alpha 1, beta 0 or 1. Elsewhere, and for every other
// product, LibTorch's kernel runs. The results differ from MKL's in summation order only.
//
//   memopt::fp32_gemm::enable();   // once: installs, measures, says what it chose
//   MEMOPT_FP32_GEMM=native|blocked|auto (default auto) overrides the measurement.
//
// Every precision policy calls enable() when a Trainer is built for the CPU (their prepare()
// hook, policies/precision.hpp), and kernel_choices keeps the choice in a checkpoint. Its
// temporaries: a row-major copy of at most one operand (a weight's transpose in the forward,
// the input x in a weight's gradient), and a 32 KiB tile per thread.
#pragma once

#include <atomic>
#include <cstdlib>
#include <string>
#include <string_view>
#include <utility>

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <fmt/format.h>

#include "memopt/detail/cpu_gemm.hpp"
#include "memopt/machine.hpp"

namespace memopt::fp32_gemm {

/// How this process's CPU fp32 GEMMs run: LibTorch's kernel (MKL), or blocked on brgemm.
enum class Mode { Native, Blocked };

/// What enable() chose, and why (one line for a log): {Mode mode; std::string reason}.
using Choice = memopt::detail::cpu_gemm::Choice<Mode>;

/// How much faster the blocked kernel must measure for auto to take it: the two probes run in
/// one process a few ms apart, within ~2% of each other run to run on an idle machine.
inline constexpr double kMinGain = 1.05;

namespace detail {

namespace bg = memopt::detail::blocked_gemm;
using memopt::detail::cpu_gemm::blocked_count;

inline constexpr char kName[] = "fp32_gemm";
using Switch = memopt::detail::cpu_gemm::Switch<&memopt::detail::cpu_gemm::blocked_fp32, Mode, kName>;

/// The probe's shape: a trainer's (tokens, width) · (width, 2·width) product at d512.
inline constexpr int64_t kProbeM = 1024, kProbeK = 512, kProbeN = 1024;

/// GFLOP/s of LibTorch's fp32 kernel and of the blocked one on the probe shape (fastest of 5
/// each, machine.hpp's probe), called directly, whatever the mode. Needs blocked_gemm::runs_here().
inline std::pair<double, double> measure() {
  const double native = machine::detail::gemm_gflops(
      kProbeM, kProbeK, kProbeN, torch::kFloat32, 5,
      [](const at::Tensor& a, const at::Tensor& b) { return at::cpu::mm(a, b); });
  const double blocked = machine::detail::gemm_gflops(
      kProbeM, kProbeK, kProbeN, torch::kFloat32, 5, [](const at::Tensor& a, const at::Tensor& b) {
        auto out = at::empty({a.size(0), b.size(1)}, a.options());
        bg::run(out, a, b, /*accumulate=*/false);
        return out;
      });
  return {native, blocked};
}

/// The choice for a MEMOPT_FP32_GEMM value (null: unset = auto).
inline Choice decide(const char* env) {
  const std::string_view value = env == nullptr ? "auto" : env;
  if (value == "native") return {Mode::Native, "LibTorch's fp32 GEMM (MEMOPT_FP32_GEMM=native)"};
  TORCH_CHECK(value == "blocked" || value == "auto", "memopt::fp32_gemm: MEMOPT_FP32_GEMM must be native, blocked or "
              "auto (got '", value, "'). HINT: unset it to let memopt measure this CPU's fp32 GEMMs and choose.");
  TORCH_CHECK(value == "auto" || bg::runs_here(), "memopt::fp32_gemm: MEMOPT_FP32_GEMM=blocked, but this "
              "LibTorch's fp32 brgemm (at::native::cpublas) is missing or does not run on this ", memopt::cpu_kind(),
              " CPU. HINT: unset MEMOPT_FP32_GEMM to use LibTorch's fp32 GEMM.");
  if (value == "blocked") return {Mode::Blocked, "blocked on oneDNN's brgemm (MEMOPT_FP32_GEMM=blocked)"};
  if (!bg::runs_here())
    return {Mode::Native, "LibTorch's fp32 GEMM: no fp32 brgemm in this LibTorch, or not on this CPU"};
  const auto [native, blocked] = measure();
  const bool take = blocked >= kMinGain * native;
  return {take ? Mode::Blocked : Mode::Native,
          fmt::format("{}: measured fp32 GEMM {:.1f} GFLOP/s in LibTorch's kernel, {:.1f} blocked on brgemm "
                      "({}x{}x{}, {} threads, {} CPU)",
                      take ? "blocked on oneDNN's brgemm" : "LibTorch's fp32 GEMM", native, blocked, kProbeM, kProbeK,
                      kProbeN, at::get_num_threads(), memopt::cpu_kind())};
}

}  // namespace detail

/// Whether enable() has run in this process (a Trainer on the CPU runs it when built).
inline bool enabled() { return detail::Switch::enabled().load(); }

/// The mode CPU fp32 GEMMs run in now.
inline Mode mode() { return detail::Switch::mode(); }

/// A mode's name as MEMOPT_FP32_GEMM spells it: "native" or "blocked".
inline const char* mode_name(Mode mode) { return mode == Mode::Blocked ? "blocked" : "native"; }

/// Installs the kernels (once) and sets the mode for the whole process; enable() keeps it.
inline void set_mode(Mode mode) { detail::Switch::set(mode); }

/// Sets a mode for a scope, restores the previous one on exit (tests, benchmarks).
using ScopedMode = detail::Switch::Scoped;

/// Installs the kernels and sets the mode MEMOPT_FP32_GEMM asks for, or (auto) the faster one
/// measured here, unless the program chose one with set_mode() (then that one is kept). The
/// first call decides (~0.1 s); later calls return that choice.
inline const Choice& enable() {
  return detail::Switch::enable([] { return detail::decide(std::getenv("MEMOPT_FP32_GEMM")); });
}

}  // namespace memopt::fp32_gemm
