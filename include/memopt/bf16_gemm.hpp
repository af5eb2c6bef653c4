// memopt/bf16_gemm.hpp — bf16 matrix products on the CPU at fp32 GEMM speed where this CPU has
// no bf16 units. LibTorch computes a bf16 `mm` on an AVX2-only CPU with a scalar fallback:
// 1.2 GFLOP/s against fp32's 87 on a 2-core EPYC (LibTorch 2.15), so one bf16-autocast step of
// a 3 M-parameter model took 116 s, 96% of it in aten::mm. enable() measures that, and where
// the native kernel loses it switches memopt's CPU kernels of aten::mm, addmm, addmm_, bmm,
// baddbmm, baddbmm_ and the out= forms of mm, addmm and bmm (detail/cpu_gemm.hpp) to widen bf16
// operands to fp32 (exact), multiply with the fp32 GEMM (LibTorch's, or fp32_gemm's blocked one
// where that is on) and round the result to bf16 once: the contract of LibTorch's own bf16 GEMM
// (fp32 accumulation, one rounding), so results differ from it only by summation order. Nothing
// else changes: autograd saves the same bf16 tensors (the memory of bf16 autocast is kept), other
// dtypes and shapes go to LibTorch's kernels, and on CPUs with avx512_bf16 or AMX the native
// kernel is kept.
//
//   memopt::bf16_gemm::enable();   // once: installs, measures, says what it chose
//   MEMOPT_BF16_GEMM=native|fp32|auto (default auto) overrides the measurement.
//
// The bf16 precision policies call enable() when a Trainer is built for the CPU (their
// prepare() hook, policies/precision.hpp): a user of the Trainer never calls it; code that runs
// bf16 products outside a Trainer calls it once. The widened operands and result are
// temporaries of at most the fp32 copy of the second operand plus kChunkBytes (row chunks), or
// an (m, n) fp32 sum plus kChunkBytes (a weight's gradient, in chunks of its depth).
#pragma once

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "memopt/detail/cpu_gemm.hpp"
#include "memopt/machine.hpp"

namespace memopt::bf16_gemm {

/// How this process's CPU bf16 GEMMs run: LibTorch's kernel, or widened to fp32.
enum class Mode { Native, Fp32Compute };

/// What enable() chose, and why (one line for a log): {Mode mode; std::string reason}.
using Choice = memopt::detail::cpu_gemm::Choice<Mode>;

namespace detail {

// The widened product and the registered kernels live in memopt/detail/cpu_gemm.hpp (shared with
// fp32_gemm.hpp's blocked fp32 products); bf16_gemm owns the switch's decision.
using memopt::detail::cpu_gemm::kChunkBytes;
using memopt::detail::cpu_gemm::rows_per_chunk;
using memopt::detail::cpu_gemm::widened_addmm;
using memopt::detail::cpu_gemm::widened_baddbmm;
using memopt::detail::cpu_gemm::widened_count;

inline constexpr char kName[] = "bf16_gemm";
using Switch = memopt::detail::cpu_gemm::Switch<&memopt::detail::cpu_gemm::widen_bf16, Mode, kName>;

/// GFLOP/s of the widened product at n^3 (machine.hpp's probe, the widened kernel called directly).
inline double widened_gflops(int64_t n, int reps) {
  return machine::detail::gemm_gflops(n, n, n, torch::kBFloat16, reps, [](const at::Tensor& a, const at::Tensor& b) {
    return widened_addmm(at::Tensor(), a, b, 0, 1);
  });
}

/// The choice for a MEMOPT_BF16_GEMM value (null: unset = auto): auto widens where the widened
/// product measures at least 1.2x the native bf16 one (machine::matmul_speed()).
inline Choice decide(const char* env) {
  const std::string_view value = env == nullptr ? "auto" : env;
  if (value == "native") return {Mode::Native, "LibTorch's bf16 kernels (MEMOPT_BF16_GEMM=native)"};
  if (value == "fp32") return {Mode::Fp32Compute, "widened to fp32, rounded once (MEMOPT_BF16_GEMM=fp32)"};
  TORCH_CHECK(value == "auto", "memopt::bf16_gemm: MEMOPT_BF16_GEMM must be native, fp32 or auto (got '", value,
              "'). HINT: unset it to let memopt measure this CPU's bf16 GEMM and choose.");
  const auto& native = machine::matmul_speed();
  const double widened = widened_gflops(native.size, 5);
  const bool wide = widened >= 1.2 * native.bf16_gflops;
  return {wide ? Mode::Fp32Compute : Mode::Native,
          fmt::format("{}: measured bf16 GEMM {:.1f} GFLOP/s natively, {:.1f} widened to fp32 ({}^3, {} threads, {} "
                      "CPU)",
                      wide ? "widened to fp32, rounded once" : "LibTorch's bf16 kernels", native.bf16_gflops, widened,
                      native.size, native.threads, memopt::cpu_kind())};
}

}  // namespace detail

/// Whether enable() has run in this process (a bf16 Trainer on the CPU runs it when built).
inline bool enabled() { return detail::Switch::enabled().load(); }

/// The mode CPU bf16 GEMMs run in now.
inline Mode mode() { return detail::Switch::mode(); }

/// A mode's name as MEMOPT_BF16_GEMM spells it: "native" or "fp32".
inline const char* mode_name(Mode mode) { return mode == Mode::Native ? "native" : "fp32"; }

/// Installs the kernels (once) and sets the mode for the whole process; enable() keeps it.
inline void set_mode(Mode mode) { detail::Switch::set(mode); }

/// Sets a mode for a scope, restores the previous one on exit (tests, benchmarks).
using ScopedMode = detail::Switch::Scoped;

/// Installs the kernels and sets the mode MEMOPT_BF16_GEMM asks for, or (auto) the faster one
/// measured here, unless the program chose one with set_mode() (then that one is kept). The
/// first call decides (~0.5 s where the native kernel is slow, ~0.1 s elsewhere); later calls
/// return that choice. It probes in Native mode, the default.
inline const Choice& enable() {
  return detail::Switch::enable([] { return detail::decide(std::getenv("MEMOPT_BF16_GEMM")); });
}

}  // namespace memopt::bf16_gemm
