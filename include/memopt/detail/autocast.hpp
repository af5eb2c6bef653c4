// memopt/detail/autocast.hpp — not API. The one place that names LibTorch's autocast
// calls, which moved between versions (per-device in 2.4+). Everything else uses
// AutocastState / AutocastGuard, written against a device type.
#pragma once

#include <ATen/autocast_mode.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include "memopt/detail/version.hpp"

namespace memopt::detail {

/// Autocast on/off and its dtype for one device type: what a guard saves and restores,
/// and what activation checkpointing replays around its recompute.
struct AutocastState {
  c10::DeviceType device = c10::kCPU;
  bool enabled = false;
  c10::ScalarType dtype = c10::kBFloat16;

  static AutocastState current(c10::DeviceType device) {
#if MEMOPT_TORCH_AT_LEAST(2, 4)
    return {device, at::autocast::is_autocast_enabled(device), at::autocast::get_autocast_dtype(device)};
#else
    if (device == c10::kCUDA) return {device, at::autocast::is_enabled(), at::autocast::get_autocast_gpu_dtype()};
    return {device, at::autocast::is_cpu_enabled(), at::autocast::get_autocast_cpu_dtype()};
#endif
  }

  /// t as an op autocast covers would get it (a linear's operands): in autocast's dtype, through
  /// its cache of cast weights, when autocast is on and t defined; t otherwise.
  at::Tensor cast(const at::Tensor& t) const {
    return enabled && t.defined() ? at::autocast::cached_cast(dtype, t, device) : t;
  }

  void apply() const {
#if MEMOPT_TORCH_AT_LEAST(2, 4)
    at::autocast::set_autocast_enabled(device, enabled);
    at::autocast::set_autocast_dtype(device, dtype);
#else
    if (device == c10::kCUDA) {
      at::autocast::set_enabled(enabled);
      at::autocast::set_autocast_gpu_dtype(dtype);
    } else {
      at::autocast::set_cpu_enabled(enabled);
      at::autocast::set_autocast_cpu_dtype(dtype);
    }
#endif
  }
};

/// Sets an autocast state for a scope; restores the previous one on exit and clears
/// the cast cache when the outermost autocast scope closes (cached low-precision
/// copies of parameters go stale after an optimizer step otherwise).
class AutocastGuard {
 public:
  explicit AutocastGuard(AutocastState state) : previous_(AutocastState::current(state.device)) {
    state.apply();
    at::autocast::increment_nesting();
  }
  ~AutocastGuard() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    previous_.apply();
  }
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  AutocastState previous_;
};

/// Turns autocast's cast cache off for a scope: a parameter bound to new memory for each use
/// (dist::Zero3's gathered blocks) must not keep a low-precision copy for the whole forward.
class AutocastCacheOff {
 public:
  AutocastCacheOff() : previous_(at::autocast::is_autocast_cache_enabled()) {
    at::autocast::set_autocast_cache_enabled(false);
  }
  ~AutocastCacheOff() { at::autocast::set_autocast_cache_enabled(previous_); }
  AutocastCacheOff(const AutocastCacheOff&) = delete;
  AutocastCacheOff& operator=(const AutocastCacheOff&) = delete;

 private:
  bool previous_;
};

}  // namespace memopt::detail
