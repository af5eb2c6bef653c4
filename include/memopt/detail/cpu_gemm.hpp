// memopt/detail/cpu_gemm.hpp — memopt's CPU kernels for aten::mm, mm.out, addmm, addmm_,
// addmm.out, bmm, bmm.out, baddbmm and baddbmm_, registered once at LibTorch's CPU dispatch key,
// and the two switches they read:
//   - widen_bf16 (memopt/bf16_gemm.hpp): bf16 products widened to fp32 (exact), multiplied in
//     fp32 and rounded to bf16 once, where this CPU has no bf16 units;
//   - blocked_fp32 (memopt/fp32_gemm.hpp): fp32 products on oneDNN's brgemm micro-kernels
//     (detail/blocked_gemm.hpp), where those beat LibTorch's GEMM (MKL) here.
// Both start off, and then every product goes to LibTorch's own kernel: installing alone changes
// nothing. Anything the switches do not cover (other dtypes, shapes blocked_gemm does not take,
// scalars other than beta 0 or 1 and alpha 1) also goes to LibTorch's kernel, which raises
// LibTorch's own errors for bad operands. CUDA products never reach these kernels. Switch<> is
// the state both switches keep: the mode, whether enable() decided, set_mode(), ScopedMode.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>

#include <ATen/ExpandUtils.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/baddbmm_cpu_dispatch.h>
#include <ATen/ops/bmm_cpu_dispatch.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <c10/util/Exception.h>
#include <torch/library.h>
#include <torch/torch.h>

#include "memopt/detail/blocked_gemm.hpp"

namespace memopt::detail::cpu_gemm {

inline std::atomic<bool>& widen_bf16() {
  static std::atomic<bool> on{false};
  return on;
}
inline std::atomic<bool>& blocked_fp32() {
  static std::atomic<bool> on{false};
  return on;
}

/// Products computed widened / blocked so far in this process (tests and logs see a path ran).
inline std::atomic<int64_t>& widened_count() {
  static std::atomic<int64_t> count{0};
  return count;
}
inline std::atomic<int64_t>& blocked_count() {
  static std::atomic<int64_t> count{0};
  return count;
}
/// bf16 products that went to LibTorch's kernel while widening was on: aliased or malformed
/// operands only (a Trainer's bf16 step counts none; tests/bf16_gemm_test.cpp checks it).
inline std::atomic<int64_t>& native_bf16_count() {
  static std::atomic<int64_t> n{0};
  return n;
}

// ---- fp32: blocked_gemm where it is switched on and takes the operands ----

/// Whether `self` can be expanded to `sizes` (addmm's and baddbmm's broadcast of their input).
inline bool expands_to(const at::Tensor& self, at::IntArrayRef sizes) {
  return self.dim() <= static_cast<int64_t>(sizes.size()) && at::is_expandable_to(self.sizes(), sizes);
}

inline bool blocking() { return blocked_fp32().load(std::memory_order_relaxed); }
inline bool is_one(const at::Scalar& s) { return !s.isComplex() && s.toDouble() == 1.0; }
inline bool is_zero(const at::Scalar& s) { return !s.isComplex() && s.toDouble() == 0.0; }

/// out = a·b (fp32 rules: blocked or LibTorch's).
inline at::Tensor fp32_mm(const at::Tensor& a, const at::Tensor& b) {
  if (blocking() && blocked_gemm::takes(a, b)) {
    blocked_count().fetch_add(1, std::memory_order_relaxed);
    auto out = at::empty({a.size(0), b.size(1)}, a.options());
    blocked_gemm::run(out, a, b, /*accumulate=*/false);
    return out;
  }
  return at::cpu::mm(a, b);
}

/// beta·self + alpha·(a·b), self broadcast to (m, n).
inline at::Tensor fp32_addmm(const at::Tensor& self, const at::Tensor& a, const at::Tensor& b, const at::Scalar& beta,
                             const at::Scalar& alpha) {
  if (blocking() && blocked_gemm::takes(a, b) && is_one(alpha) && (is_zero(beta) || is_one(beta)) &&
      self.scalar_type() == at::kFloat && expands_to(self, {a.size(0), b.size(1)})) {
    blocked_count().fetch_add(1, std::memory_order_relaxed);
    auto out = at::empty({a.size(0), b.size(1)}, a.options());
    if (is_one(beta)) out.copy_(self.expand({a.size(0), b.size(1)}));
    blocked_gemm::run(out, a, b, /*accumulate=*/is_one(beta));
    return out;
  }
  return at::cpu::addmm(self, a, b, beta, alpha);
}

/// self = beta·self + alpha·(a·b) in place (a gradient accumulated: beta 1).
inline at::Tensor& fp32_addmm_(at::Tensor& self, const at::Tensor& a, const at::Tensor& b, const at::Scalar& beta,
                               const at::Scalar& alpha) {
  if (blocking() && blocked_gemm::takes(self, a, b) && is_one(alpha) && (is_zero(beta) || is_one(beta)) &&
      !self.is_alias_of(a) && !self.is_alias_of(b)) {
    blocked_count().fetch_add(1, std::memory_order_relaxed);
    blocked_gemm::run(self, a, b, /*accumulate=*/is_one(beta));
    return self;
  }
  return at::cpu::addmm_(self, a, b, beta, alpha);
}

// ---- bf16: widened to fp32 where it is switched on ----

/// Bytes of fp32 temporaries (operand rows and result rows) one chunk of a widened product may
/// take, beside the fp32 copy of the second operand.
inline constexpr int64_t kChunkBytes = int64_t{8} << 20;

inline bool widen(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16; }
inline bool widening() { return widen_bf16().load(std::memory_order_relaxed); }

/// Slices of `rows` along dim 0 such that each slice's fp32 temporaries (`bytes_per_row` each)
/// stay within `chunk_bytes`; at least 1.
inline int64_t rows_per_chunk(int64_t bytes_per_row, int64_t chunk_bytes) {
  return std::max<int64_t>(1, chunk_bytes / std::max<int64_t>(bytes_per_row, 1));
}

/// `total` rows in as few chunks of at most `per` as fit, of equal size (the last one no
/// larger): 512 rows at 455 a chunk are 256 + 256, not 455 + 57, whose second product is a
/// sliver the GEMM runs at a fraction of its rate.
inline int64_t balanced_chunk(int64_t total, int64_t per) {
  const int64_t chunks = std::max<int64_t>(1, (total + per - 1) / per);
  return std::max<int64_t>(1, (total + chunks - 1) / chunks);
}

/// The 2-D bf16 `t` (a slice of an operand) in fp32, in its layout: a row-major slice converts as
/// it is; a column-major one (a slice of a transposed view: dW's dYᵀ) converts as its transpose
/// and comes back transposed. The GEMM takes either layout; a transposing conversion (strided
/// reads, one element at a time) cost more than the product's own packing.
inline at::Tensor widened_slice(const at::Tensor& t) {
  if (t.stride(0) == 1 && t.stride(1) != 1) return t.t().to(at::kFloat).t();
  return t.to(at::kFloat);
}

/// out (m, n) = beta·self + alpha·(a @ b) for bf16 a (m, k), b (k, n), out and self broadcastable
/// to (m, n) (undefined: a @ b), computed in fp32 (by the fp32 rules above) and rounded to bf16
/// once, in chunks whose fp32 temporaries stay within `chunk_bytes` (beside b's fp32 copy):
///   rows   chunks of a's rows (every product with self; any with m ≥ k), each against all of b.
///   depth  a plain product deeper than it is tall (m < k: a weight's gradient dYᵀ·X), when its
///          rows would not fit one chunk: chunks of the depth, a's columns against b's rows,
///          summed into one fp32 (m, n) — no fp32 copy of b, and b packed once for the product
///          rather than once per row chunk (gate and up's dW on the AVX2 EPYC: 0.79x fp32's
///          rate in row chunks).
/// out may be self (addmm_): each row chunk reads its rows of self before it writes them; out
/// must not overlap a or b.
inline void widened_addmm_into(const at::Tensor& out, const at::Tensor& self, const at::Tensor& a,
                               const at::Tensor& b, const at::Scalar& beta, const at::Scalar& alpha,
                               int64_t chunk_bytes = kChunkBytes) {
  widened_count().fetch_add(1, std::memory_order_relaxed);
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  const int64_t rows = balanced_chunk(m, rows_per_chunk(4 * (k + n), chunk_bytes));
  if (!self.defined() && m < k && rows < m) {
    const int64_t depth = balanced_chunk(k, rows_per_chunk(4 * (m + n), chunk_bytes));
    at::Tensor sum;  // (m, n) fp32
    for (int64_t d = 0; d < k; d += depth) {
      const int64_t len = std::min(depth, k - d);
      const auto a32 = widened_slice(a.narrow(1, d, len)), b32 = widened_slice(b.narrow(0, d, len));
      if (sum.defined()) fp32_addmm_(sum, a32, b32, 1, 1);
      else sum = fp32_mm(a32, b32);
    }
    out.copy_(sum);
    return;
  }
  const auto b32 = b.to(at::kFloat);
  const auto bias = self.defined() ? self.expand({m, n}) : at::Tensor();
  for (int64_t r = 0; r < m; r += rows) {
    const int64_t len = std::min(rows, m - r);
    const auto a32 = widened_slice(a.narrow(0, r, len));
    out.narrow(0, r, len)
        .copy_(bias.defined() ? fp32_addmm(bias.narrow(0, r, len).to(at::kFloat), a32, b32, beta, alpha)
                              : fp32_mm(a32, b32));
  }
}

/// The same into a new (m, n) bf16 tensor.
inline at::Tensor widened_addmm(const at::Tensor& self, const at::Tensor& a, const at::Tensor& b,
                                const at::Scalar& beta, const at::Scalar& alpha, int64_t chunk_bytes = kChunkBytes) {
  auto out = at::empty({a.size(0), b.size(1)}, a.options());
  widened_addmm_into(out, self, a, b, beta, alpha, chunk_bytes);
  return out;
}

/// The batched form: out (B, m, n) = beta·self + alpha·(a @ b) for bf16 a (B, m, k), b (B, k, n),
/// self broadcastable to (B, m, n) (undefined: a @ b), a chunk of batch entries at a time. out may
/// be self (baddbmm_); it must not overlap a or b.
inline void widened_baddbmm_into(const at::Tensor& out, const at::Tensor& self, const at::Tensor& a,
                                 const at::Tensor& b, const at::Scalar& beta, const at::Scalar& alpha,
                                 int64_t chunk_bytes = kChunkBytes) {
  widened_count().fetch_add(1, std::memory_order_relaxed);
  const int64_t batch = a.size(0), m = a.size(1), k = a.size(2), n = b.size(2);
  const auto bias = self.defined() ? self.expand({batch, m, n}) : at::Tensor();
  const int64_t per = balanced_chunk(batch, rows_per_chunk(4 * (m * k + k * n + m * n), chunk_bytes));
  for (int64_t i = 0; i < batch; i += per) {
    const int64_t len = std::min(per, batch - i);
    const auto a32 = a.narrow(0, i, len).to(at::kFloat), b32 = b.narrow(0, i, len).to(at::kFloat);
    out.narrow(0, i, len)
        .copy_(bias.defined() ? at::cpu::baddbmm(bias.narrow(0, i, len).to(at::kFloat), a32, b32, beta, alpha)
                              : at::cpu::bmm(a32, b32));
  }
}

/// The same into a new (B, m, n) bf16 tensor.
inline at::Tensor widened_baddbmm(const at::Tensor& self, const at::Tensor& a, const at::Tensor& b,
                                  const at::Scalar& beta, const at::Scalar& alpha, int64_t chunk_bytes = kChunkBytes) {
  auto out = at::empty({a.size(0), a.size(1), b.size(2)}, a.options());
  widened_baddbmm_into(out, self, a, b, beta, alpha, chunk_bytes);
  return out;
}

// ---- the registered kernels ----

/// Counts a bf16 product about to go to LibTorch's kernel while widening is on.
inline void count_native(const at::Tensor& a) {
  if (widening() && widen(a)) native_bf16_count().fetch_add(1, std::memory_order_relaxed);
}

inline at::Tensor mm(const at::Tensor& a, const at::Tensor& b) {
  if (widening() && widen(a) && widen(b) && a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0))
    return widened_addmm(at::Tensor(), a, b, 0, 1);
  count_native(a);
  return fp32_mm(a, b);
}
inline at::Tensor addmm(const at::Tensor& self, const at::Tensor& a, const at::Tensor& b, const at::Scalar& beta,
                        const at::Scalar& alpha) {
  if (widening() && widen(self) && widen(a) && widen(b) && a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0) &&
      expands_to(self, {a.size(0), b.size(1)}))
    return widened_addmm(self, a, b, beta, alpha);
  count_native(a);
  return fp32_addmm(self, a, b, beta, alpha);
}
/// Whether a bf16 product a (m, k) · b (k, n) into `out` widens: 2-D bf16 operands that fit, an
/// out that overlaps neither.
inline bool widens_into(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  return widening() && widen(out) && widen(a) && widen(b) && a.dim() == 2 && b.dim() == 2 &&
         a.size(1) == b.size(0) && !out.is_alias_of(a) && !out.is_alias_of(b);
}
inline at::Tensor& addmm_(at::Tensor& self, const at::Tensor& a, const at::Tensor& b, const at::Scalar& beta,
                          const at::Scalar& alpha) {
  if (widens_into(self, a, b) && self.dim() == 2 && self.size(0) == a.size(0) && self.size(1) == b.size(1)) {
    widened_addmm_into(self, self, a, b, beta, alpha);  // dX += dY W of a node's later outputs
    return self;
  }
  count_native(a);
  return fp32_addmm_(self, a, b, beta, alpha);
}
/// mm.out (torch::mm_out: the fused loss head's logits and dHidden), by mm's rules.
inline at::Tensor& mm_out(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {
  if (widens_into(out, a, b)) {
    at::native::resize_output(out, {a.size(0), b.size(1)});
    widened_addmm_into(out, at::Tensor(), a, b, 0, 1);
    return out;
  }
  if (blocking() && blocked_gemm::takes(a, b) && !out.is_alias_of(a) && !out.is_alias_of(b)) {
    at::native::resize_output(out, {a.size(0), b.size(1)});
    if (blocked_gemm::takes(out, a, b)) {
      blocked_count().fetch_add(1, std::memory_order_relaxed);
      blocked_gemm::run(out, a, b, /*accumulate=*/false);
      return out;
    }
  }
  count_native(a);
  return at::cpu::mm_out(out, a, b);
}
/// addmm.out, by addmm's rules (out may be self).
inline at::Tensor& addmm_out(const at::Tensor& self, const at::Tensor& a, const at::Tensor& b, const at::Scalar& beta,
                             const at::Scalar& alpha, at::Tensor& out) {
  if (widens_into(out, a, b) && widen(self) && expands_to(self, {a.size(0), b.size(1)}) &&
      (out.is_same(self) || !out.is_alias_of(self))) {
    at::native::resize_output(out, {a.size(0), b.size(1)});
    widened_addmm_into(out, self, a, b, beta, alpha);
    return out;
  }
  count_native(a);
  return at::cpu::addmm_out(out, self, a, b, beta, alpha);
}
/// Whether a bf16 batched product a (B, m, k) · b (B, k, n) widens: 3-D bf16 operands that fit.
inline bool widens_batched(const at::Tensor& a, const at::Tensor& b) {
  return widening() && widen(a) && widen(b) && a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) &&
         a.size(2) == b.size(1);
}
/// ... into `out`: a bf16 out that overlaps neither operand.
inline bool widens_batched_into(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  return widens_batched(a, b) && widen(out) && !out.is_alias_of(a) && !out.is_alias_of(b);
}
inline at::Tensor bmm(const at::Tensor& a, const at::Tensor& b) {
  if (widens_batched(a, b)) return widened_baddbmm(at::Tensor(), a, b, 0, 1);
  count_native(a);
  return at::cpu::bmm(a, b);
}
/// bmm.out (the blockwise attention's scores and dP), into an out that overlaps neither operand.
inline at::Tensor& bmm_out(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {
  if (widens_batched_into(out, a, b)) {
    at::native::resize_output(out, {a.size(0), a.size(1), b.size(2)});
    widened_baddbmm_into(out, at::Tensor(), a, b, 0, 1);
    return out;
  }
  count_native(a);
  return at::cpu::bmm_out(out, a, b);
}
inline at::Tensor baddbmm(const at::Tensor& self, const at::Tensor& a, const at::Tensor& b, const at::Scalar& beta,
                          const at::Scalar& alpha) {
  if (widens_batched(a, b) && widen(self) && expands_to(self, {a.size(0), a.size(1), b.size(2)}))
    return widened_baddbmm(self, a, b, beta, alpha);
  count_native(a);
  return at::cpu::baddbmm(self, a, b, beta, alpha);
}
/// baddbmm_ (the blockwise attention's accumulators: acc += a·b) in place.
inline at::Tensor& baddbmm_(at::Tensor& self, const at::Tensor& a, const at::Tensor& b, const at::Scalar& beta,
                            const at::Scalar& alpha) {
  if (widens_batched_into(self, a, b) && self.dim() == 3 && self.size(0) == a.size(0) && self.size(1) == a.size(1) &&
      self.size(2) == b.size(2)) {
    widened_baddbmm_into(self, self, a, b, beta, alpha);
    return self;
  }
  count_native(a);
  return at::cpu::baddbmm_(self, a, b, beta, alpha);
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

/// Registers the kernels at the CPU dispatch key, once per process.
inline void install() {
  static const bool installed = [] {
    QuietOverride quiet(c10::WarningUtils::get_warning_handler());
    c10::WarningUtils::WarningHandlerGuard guard(&quiet);
    static torch::Library library(torch::Library::IMPL, "aten", c10::DispatchKey::CPU, __FILE__, __LINE__);
    library.impl("mm", TORCH_FN(mm));
    library.impl("mm.out", TORCH_FN(mm_out));
    library.impl("addmm", TORCH_FN(addmm));
    library.impl("addmm_", TORCH_FN(addmm_));
    library.impl("addmm.out", TORCH_FN(addmm_out));
    library.impl("bmm", TORCH_FN(bmm));
    library.impl("bmm.out", TORCH_FN(bmm_out));
    library.impl("baddbmm", TORCH_FN(baddbmm));
    library.impl("baddbmm_", TORCH_FN(baddbmm_));
    return true;
  }();
  (void)installed;
}

/// What a switch's enable() chose, and why (one line for a log): bf16_gemm::Choice and
/// fp32_gemm::Choice.
template <class Mode>
struct Choice {
  Mode mode = Mode::Native;
  std::string reason;
};

/// One switch's state and its once-only decision (bf16_gemm's on `widen_bf16`, fp32_gemm's on
/// `blocked_fp32`): Mode an enum class whose Native is 0 and whose other value turns `on` on.
/// `who` names the switch in the reason.
template <std::atomic<bool>& (*on)(), class Mode, const char* who>
struct Switch {
  using Choice = cpu_gemm::Choice<Mode>;
  static_assert(static_cast<int>(Mode::Native) == 0, "Native is the switch's off state");
  static Mode mode() { return static_cast<Mode>(on().load()); }
  static std::atomic<bool>& enabled() {  // enable() has decided
    static std::atomic<bool> decided{false};
    return decided;
  }
  static std::atomic<bool>& set_by_program() {  // set() was called: enable() keeps that mode
    static std::atomic<bool> set{false};
    return set;
  }
  /// Installs the kernels (once) and sets the mode for the whole process; enable() keeps it.
  static void set(Mode mode) {
    install();
    on().store(mode != Mode::Native);
    set_by_program().store(true);
  }
  /// Installs the kernels; the first call decides (the mode set() set, else `decide()`), later
  /// calls return that choice.
  static const Choice& enable(Choice (*decide)()) {
    static const Choice choice = [decide] {
      install();
      const std::string set_here = std::string("set by the program (") + who + "::set_mode)";
      const Choice c = set_by_program().load() ? Choice{mode(), set_here} : decide();
      on().store(c.mode != Mode::Native);
      enabled().store(true);
      return c;
    }();
    return choice;
  }
  /// Sets a mode for a scope, restores the previous one on exit (tests, benchmarks).
  class Scoped {
   public:
    explicit Scoped(Mode mode) : previous_(Switch::mode()) { set(mode); }
    ~Scoped() { set(previous_); }
    Scoped(const Scoped&) = delete;
    Scoped& operator=(const Scoped&) = delete;

   private:
    Mode previous_;
  };
};

}  // namespace memopt::detail::cpu_gemm
