// memopt/optim/schedule.hpp — learning-rate schedules: linear warmup, then constant,
// linear or cosine decay down to min_lr_ratio · lr at max_steps.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>

namespace memopt::optim {

enum class Decay { kConstant, kLinear, kCosine };

/// Learning rate for optimizer step `step` (0-based).
///   double lr = memopt::optim::scheduled_lr(step, 3e-4, 100, 1000, Decay::kCosine, 0.1);
inline double scheduled_lr(int64_t step, double lr, int64_t warmup_steps, int64_t max_steps, Decay decay,
                           double min_lr_ratio) {
  if (step < warmup_steps) return lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  if (decay == Decay::kConstant || max_steps <= warmup_steps) return lr;
  const double progress =
      std::clamp(static_cast<double>(step - warmup_steps) / static_cast<double>(max_steps - warmup_steps), 0.0, 1.0);
  const double shape = decay == Decay::kLinear ? 1.0 - progress : 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
  return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * shape);
}

}  // namespace memopt::optim
