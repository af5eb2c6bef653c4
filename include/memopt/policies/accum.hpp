// memopt/policies/accum.hpp — gradient accumulation policies: how many micro-batches
// make one optimizer step. The Trainer divides every micro-batch's loss sum by the
// number of targets of the whole effective batch, so N micro-batches give the gradient
// of one big batch even when their target counts differ (padding, masked prompts).
#pragma once

#include <cstdint>

#include <c10/util/Exception.h>

namespace memopt::accum {

/// One micro-batch per step.
struct None {
  static constexpr int64_t micro_steps() { return 1; }
};

/// N micro-batches per step, fixed at compile time.
///   memopt::Trainer<memopt::checkpoint::None, memopt::precision::Fp32, memopt::accum::Fixed<4>>
template <int64_t N>
struct Fixed {
  static_assert(N >= 1, "memopt::accum::Fixed<N>: N must be >= 1 micro-batch per step");
  static constexpr int64_t micro_steps() { return N; }
};

/// N micro-batches per step, chosen at run time (TrainerOptions::accum_steps).
struct Runtime {
  explicit Runtime(int64_t n = 1) : n_(n) {
    TORCH_CHECK(n >= 1, "memopt::accum::Runtime: accumulation steps must be >= 1 (got ", n,
                "). HINT: pass --accum 1 or more.");
  }
  int64_t micro_steps() const { return n_; }

 private:
  int64_t n_;
};

}  // namespace memopt::accum
