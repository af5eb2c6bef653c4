// memopt/signals.hpp — a graceful stop on SIGTERM and SIGINT: the first one asks the
// training loop to finish its current optimizer step, write a checkpoint and return (a
// preempted job loses nothing); a second SIGINT exits at once (status 130), as a user
// pressing Ctrl-C twice expects. The handlers are installed for a scope and the previous
// ones restored after it.
#pragma once

#include <signal.h>
#include <unistd.h>

#include <atomic>

namespace memopt {

namespace detail {

inline std::atomic<int>& stop_signal() {  // 0, or the first SIGTERM/SIGINT received
  static std::atomic<int> signal{0};
  return signal;
}

extern "C" inline void memopt_on_stop_signal(int sig) {
  int expected = 0;
  if (stop_signal().compare_exchange_strong(expected, sig)) {  // the first: say so (write is async-signal-safe)
    static const char kInt[] = "\nmemopt: SIGINT: finishing this step, then a checkpoint (SIGINT again: exit now)\n";
    static const char kTerm[] = "\nmemopt: SIGTERM: finishing this step, then a checkpoint\n";
    const bool interrupt = sig == SIGINT;
    [[maybe_unused]] const auto n =
        ::write(STDERR_FILENO, interrupt ? kInt : kTerm, interrupt ? sizeof kInt - 1 : sizeof kTerm - 1);
  } else if (sig == SIGINT) {
    static const char kMessage[] = "\nmemopt: second SIGINT: exiting now, without a checkpoint\n";
    [[maybe_unused]] const auto n = ::write(STDERR_FILENO, kMessage, sizeof kMessage - 1);
    ::_exit(130);  // async-signal-safe
  }
}

}  // namespace detail

/// While alive, SIGTERM and SIGINT set a flag instead of killing the process; the Trainer
/// checks it after each step (TrainerOptions::handle_signals). Restores the previous
/// handlers when destroyed. Not nested across threads: one training loop at a time.
///   memopt::StopSignals stop;  for (...) { step(); if (stop.requested()) { save(); break; } }
class StopSignals {
 public:
  explicit StopSignals(bool enabled = true) : enabled_(enabled) {
    if (!enabled_) return;
    detail::stop_signal().store(0);
    struct sigaction action {};
    action.sa_handler = detail::memopt_on_stop_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;  // a read or write in the step goes on instead of failing with EINTR
    sigaction(SIGTERM, &action, &previous_term_);
    sigaction(SIGINT, &action, &previous_int_);
  }
  ~StopSignals() {
    if (!enabled_) return;
    sigaction(SIGTERM, &previous_term_, nullptr);
    sigaction(SIGINT, &previous_int_, nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  /// 0, or the signal (SIGTERM, SIGINT) that asked the loop to stop.
  int requested() const { return enabled_ ? detail::stop_signal().load(std::memory_order_relaxed) : 0; }

 private:
  bool enabled_;
  struct sigaction previous_term_ {};
  struct sigaction previous_int_ {};
};

/// "SIGTERM", "SIGINT", or "signal" for any other.
inline const char* signal_name(int sig) {
  switch (sig) {
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    default: return "signal";
  }
}

}  // namespace memopt
