// memopt/bf16_gemm.hpp — bf16 matrix products on the CPU at fp32 GEMM speed where this CPU has
// no bf16 units. LibTorch computes a bf16 `mm` on an AVX2-only CPU with a scalar fallback:
// 1.2 GFLOP/s against fp32's 87 on a 2-core EPYC (LibTorch 2.15), so one bf16-autocast step of
// a 3 M-parameter model took 116 s, 96% of it in aten::mm. enable() measures that, and where
// the native kernel loses it replaces the CPU kernels of aten::mm, addmm, bmm and baddbmm with
// ones that widen bf16 operands to fp32 (exact), multiply with LibTorch's fp32 GEMM and round
// the result to bf16 once: the contract of LibTorch's own bf16 GEMM (fp32 accumulation, one
// rounding), so results differ from it only by summation order. Nothing else changes: autograd
// saves the same bf16 tensors (the memory of bf16 autocast is kept), other dtypes and shapes go
// to LibTorch's kernels, and on CPUs with avx512_bf16 or AMX the native kernel is kept.
//
//   memopt::bf16_gemm::enable();   // once: installs, measures, says what it chose
//   MEMOPT_BF16_GEMM=native|fp32|auto (default auto) overrides the measurement.
//
// The bf16 precision policies call enable() when a Trainer is built for the CPU (their
// prepare() hook, policies/precision.hpp): a user of the Trainer never calls it; code that runs
// bf16 products outside a Trainer calls it once. The widened operands and result are
// temporaries of at most the fp32 copy of the second operand plus kChunkBytes (row chunks).
#pragma once

#include <ATen/ExpandUtils.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/baddbmm_cpu_dispatch.h>
#include <ATen/ops/bmm_cpu_dispatch.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <c10/util/Exception.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "memopt/machine.hpp"

namespace memopt::bf16_gemm {

/// How this process's CPU bf16 GEMMs run: LibTorch's kernel, or widened to fp32.
enum class Mode { Native, Fp32Compute };

/// What enable() chose, and why (one line for a log).
struct Choice {
  Mode mode = Mode::Native;
  std::string reason;
};

namespace detail {

/// Bytes of fp32 temporaries (operand rows and result rows) one chunk of a widened product may
/// take, beside the fp32 copy of the second operand.
inline constexpr int64_t kChunkBytes = int64_t{8} << 20;

inline std::atomic<Mode>& mode_flag() {
  static std::atomic<Mode> mode{Mode::Native};
  return mode;
}
inline std::atomic<bool>& enabled_flag() {  // enable() has decided
  static std::atomic<bool> enabled{false};
  return enabled;
}
inline std::atomic<bool>& mode_set_by_program() {  // set_mode() was called: enable() keeps that mode
  static std::atomic<bool> set{false};
  return set;
}

/// Products computed widened so far in this process (tests and logs see that the path ran).
inline std::atomic<int64_t>& widened_count() {
  static std::atomic<int64_t> count{0};
  return count;
}

inline bool widen(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16; }
inline bool widening() { return mode_flag().load(std::memory_order_relaxed) == Mode::Fp32Compute; }

/// Slices of `rows` along dim 0 such that each slice's fp32 temporaries (`bytes_per_row` each)
/// stay within `chunk_bytes`; at least 1.
inline int64_t rows_per_chunk(int64_t bytes_per_row, int64_t chunk_bytes) {
  return std::max<int64_t>(1, chunk_bytes / std::max<int64_t>(bytes_per_row, 1));
}

/// beta·self + alpha·(a @ b) for bf16 a (m, k), b (k, n) and bf16 self broadcastable to (m, n)
/// (undefined: a @ b), computed in fp32 a chunk of rows at a time and rounded to bf16 once.
inline at::Tensor widened_addmm(const at::Tensor& self, const at::Tensor& a, const at::Tensor& b,
                                const at::Scalar& beta, const at::Scalar& alpha, int64_t chunk_bytes = kChunkBytes) {
  widened_count().fetch_add(1, std::memory_order_relaxed);
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  auto out = at::empty({m, n}, a.options());
  const auto b32 = b.to(at::kFloat);
  const auto bias = self.defined() ? self.expand({m, n}) : at::Tensor();
  const int64_t rows = rows_per_chunk(4 * (k + n), chunk_bytes);
  for (int64_t r = 0; r < m; r += rows) {
    const int64_t len = std::min(rows, m - r);
    const auto a32 = a.narrow(0, r, len).to(at::kFloat);
    out.narrow(0, r, len)
        .copy_(bias.defined() ? at::cpu::addmm(bias.narrow(0, r, len).to(at::kFloat), a32, b32, beta, alpha)
                              : at::cpu::mm(a32, b32));
  }
  return out;
}

/// The batched form: beta·self + alpha·(a @ b) for bf16 a (B, m, k), b (B, k, n), a chunk of
/// batch entries at a time.
inline at::Tensor widened_baddbmm(const at::Tensor& self, const at::Tensor& a, const at::Tensor& b,
                                  const at::Scalar& beta, const at::Scalar& alpha, int64_t chunk_bytes = kChunkBytes) {
  widened_count().fetch_add(1, std::memory_order_relaxed);
  const int64_t batch = a.size(0), m = a.size(1), k = a.size(2), n = b.size(2);
  auto out = at::empty({batch, m, n}, a.options());
  const auto bias = self.defined() ? self.expand({batch, m, n}) : at::Tensor();
  const int64_t per = rows_per_chunk(4 * (m * k + k * n + m * n), chunk_bytes);
  for (int64_t i = 0; i < batch; i += per) {
    const int64_t len = std::min(per, batch - i);
    const auto a32 = a.narrow(0, i, len).to(at::kFloat), b32 = b.narrow(0, i, len).to(at::kFloat);
    out.narrow(0, i, len)
        .copy_(bias.defined() ? at::cpu::baddbmm(bias.narrow(0, i, len).to(at::kFloat), a32, b32, beta, alpha)
                              : at::cpu::bmm(a32, b32));
  }
  return out;
}

/// Whether `self` can be expanded to `sizes` (addmm's and baddbmm's broadcast of their input).
inline bool expands_to(const at::Tensor& self, at::IntArrayRef sizes) {
  return self.dim() <= static_cast<int64_t>(sizes.size()) && at::is_expandable_to(self.sizes(), sizes);
}

// The CPU kernels. Anything but well-formed all-bf16 operands in Fp32Compute mode goes to
// LibTorch's own kernel, which also raises LibTorch's own errors for bad shapes and dtypes.
inline at::Tensor mm(const at::Tensor& a, const at::Tensor& b) {
  if (widening() && widen(a) && widen(b) && a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0))
    return widened_addmm(at::Tensor(), a, b, 0, 1);
  return at::cpu::mm(a, b);
}
inline at::Tensor addmm(const at::Tensor& self, const at::Tensor& a, const at::Tensor& b, const at::Scalar& beta,
                        const at::Scalar& alpha) {
  if (widening() && widen(self) && widen(a) && widen(b) && a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0) &&
      expands_to(self, {a.size(0), b.size(1)}))
    return widened_addmm(self, a, b, beta, alpha);
  return at::cpu::addmm(self, a, b, beta, alpha);
}
inline at::Tensor bmm(const at::Tensor& a, const at::Tensor& b) {
  if (widening() && widen(a) && widen(b) && a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) &&
      a.size(2) == b.size(1))
    return widened_baddbmm(at::Tensor(), a, b, 0, 1);
  return at::cpu::bmm(a, b);
}
inline at::Tensor baddbmm(const at::Tensor& self, const at::Tensor& a, const at::Tensor& b, const at::Scalar& beta,
                          const at::Scalar& alpha) {
  if (widening() && widen(self) && widen(a) && widen(b) && a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) &&
      a.size(2) == b.size(1) && expands_to(self, {a.size(0), a.size(1), b.size(2)}))
    return widened_baddbmm(self, a, b, beta, alpha);
  return at::cpu::baddbmm(self, a, b, beta, alpha);
}

/// Drops LibTorch's one warning that a registration overrides a kernel (this file's purpose),
/// passes every other warning on.
class QuietOverride : public c10::WarningHandler {
 public:
  explicit QuietOverride(c10::WarningHandler* next) : next_(next) {}
  void process(const c10::Warning& warning) override {
    if (warning.msg().find("Overriding a previously registered kernel") == std::string::npos) next_->process(warning);
  }

 private:
  c10::WarningHandler* next_;
};

/// Registers the four kernels at the CPU dispatch key, once per process. They start in Native
/// mode, which forwards to LibTorch's kernels, so installing alone changes nothing.
inline void install() {
  static const bool installed = [] {
    QuietOverride quiet(c10::WarningUtils::get_warning_handler());
    c10::WarningUtils::WarningHandlerGuard guard(&quiet);
    static torch::Library library(torch::Library::IMPL, "aten", c10::DispatchKey::CPU, __FILE__, __LINE__);
    library.impl("mm", TORCH_FN(mm));
    library.impl("addmm", TORCH_FN(addmm));
    library.impl("bmm", TORCH_FN(bmm));
    library.impl("baddbmm", TORCH_FN(baddbmm));
    return true;
  }();
  (void)installed;
}

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
inline bool enabled() { return detail::enabled_flag().load(); }

/// The mode CPU bf16 GEMMs run in now.
inline Mode mode() { return detail::mode_flag().load(); }

/// Installs the kernels (once) and sets the mode for the whole process; enable() keeps it.
inline void set_mode(Mode mode) {
  detail::install();
  detail::mode_flag().store(mode);
  detail::mode_set_by_program().store(true);
}

/// Sets a mode for a scope, restores the previous one on exit (tests, benchmarks).
class ScopedMode {
 public:
  explicit ScopedMode(Mode mode) : previous_(bf16_gemm::mode()) { set_mode(mode); }
  ~ScopedMode() { set_mode(previous_); }
  ScopedMode(const ScopedMode&) = delete;
  ScopedMode& operator=(const ScopedMode&) = delete;

 private:
  Mode previous_;
};

/// Installs the kernels and sets the mode MEMOPT_BF16_GEMM asks for, or (auto) the faster one
/// measured here, unless the program chose one with set_mode() (then that one is kept). The
/// first call decides (~0.5 s where the native kernel is slow, ~0.1 s elsewhere); later calls
/// return that choice.
inline const Choice& enable() {
  static const Choice choice = [] {
    detail::install();
    const Choice c = detail::mode_set_by_program().load()
                         ? Choice{mode(), "set by the program (bf16_gemm::set_mode)"}
                         : detail::decide(std::getenv("MEMOPT_BF16_GEMM"));  // probes in Native mode, the default
    detail::mode_flag().store(c.mode);
    detail::enabled_flag().store(true);
    return c;
  }();
  return choice;
}

}  // namespace memopt::bf16_gemm
