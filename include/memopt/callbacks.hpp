// memopt/callbacks.hpp — hooks the Trainer calls at step boundaries, and the built-in
// ones: a progress bar/log printer (with an ETA), a cache release (malloc_trim on CPU, the CUDA
// caching allocator's empty_cache in CUDA builds), a per-step memory monitor, a
// metrics.jsonl writer and a memory timeline written as a Chrome trace.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <ios>
#include <string>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "memopt/detail/version.hpp"
#include "memopt/dist/env.hpp"
#include "memopt/loop_types.hpp"
#include "memopt/memory/allocator.hpp"
#include "memopt/memory/report.hpp"
#include "memopt/memory/timeline.hpp"

#if MEMOPT_HAS_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace memopt {

/// What one optimizer step produced. Tensors stay on the device: reading them syncs.
struct StepStats {
  int64_t step = 0;            // 1-based index of the step just taken
  double lr = 0;               // learning rate used
  torch::Tensor loss;          // 0-dim: mean loss over the effective batch
  torch::Tensor grad_norm;     // 0-dim: global gradient norm before clipping
  torch::Tensor num_targets;   // 0-dim: targets in the effective batch
  int64_t tokens = 0;          // input tokens in the effective batch
  double seconds = 0;          // wall time of the step (host view)
  bool stepped = true;         // false: the precision policy skipped the update (inf/nan gradient)
};

/// A log line: StepStats read back to the host, plus throughput and memory.
struct LogLine {
  int64_t step = 0;
  int64_t max_steps = 0;
  double loss = 0;
  double lr = 0;
  double grad_norm = 0;
  double tokens_per_s = 0;  // since the previous log line
  memory::Report memory;
  int64_t skipped_steps = 0;  // steps the precision policy skipped (StepStats::stepped false) since fit() began
  double step_seconds = 0;    // mean step wall time since the previous log line
  double eta_seconds = 0;     // time left: the mean wall time per step since fit() began × the steps left
};

/// fit()'s counters: its totals (the FitResult's) and the window since the last log line.
///   FitMeter meter(max_steps);  meter.add(stats);  if (due) emit(meter.log_line(stats));  meter.finish(result);
class FitMeter {
 public:
  explicit FitMeter(int64_t max_steps) : max_steps_(max_steps) {}

  void add(const StepStats& s) {
    steps_ += 1, window_steps_ += 1;
    tokens_ += s.tokens, window_tokens_ += s.tokens;
    seconds_ += s.seconds, window_seconds_ += s.seconds;
    skipped_ += s.stepped ? 0 : 1;
  }
  /// The log line after step `s` (reads loss and gradient norm: one host sync); starts a new window.
  LogLine log_line(const StepStats& s) {
    LogLine line{s.step, max_steps_, s.loss.item<double>(), s.lr, s.grad_norm.item<double>(),
                 static_cast<double>(window_tokens_) / std::max(window_seconds_, 1e-9), memory::Report::now()};
    line.skipped_steps = skipped_;
    line.step_seconds = window_seconds_ / static_cast<double>(window_steps_);
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    line.eta_seconds = wall / static_cast<double>(steps_) * static_cast<double>(max_steps_ - s.step);
    window_steps_ = window_tokens_ = 0;
    window_seconds_ = 0;
    return line;
  }
  /// The totals, into `result`.
  void finish(FitResult& result) const {
    result.steps = steps_;
    result.seconds = seconds_;
    result.skipped_steps = skipped_;
    result.tokens_per_s = static_cast<double>(tokens_) / std::max(seconds_, 1e-9);
  }

 private:
  int64_t max_steps_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();  // the ETA's origin
  int64_t steps_ = 0, tokens_ = 0, skipped_ = 0, window_steps_ = 0, window_tokens_ = 0;
  double seconds_ = 0, window_seconds_ = 0;
};

/// Override what you need; the Trainer calls these in order at each step, on every rank of a
/// data-parallel run (a callback that frees memory or clears gradients must run everywhere);
/// one that only reports (prints, writes a file) says so with main_rank_only(), and then runs
/// on rank 0 alone.
///   struct Print : memopt::Callback { void on_log(const memopt::LogLine& l) override { ... } };
struct Callback {
  virtual ~Callback() = default;
  /// true: a reporter, called on rank 0 only (it reports for all ranks).
  virtual bool main_rank_only() const { return false; }
  virtual void on_step_begin(int64_t /*step*/) {}
  virtual void on_step_end(const StepStats& /*stats*/) {}
  virtual void on_log(const LogLine& /*line*/) {}
  /// After a checkpoint of the state after `step` was written to `path` ("interval", "end", "SIGTERM", ...).
  virtual void on_checkpoint(int64_t /*step*/, const std::string& /*path*/, const std::string& /*reason*/) {}
  /// Something the user should know that is not an error (the Trainer cut its micro-batches).
  virtual void on_notice(const std::string& /*text*/) {}
  virtual void on_train_end(const memory::Report& /*report*/) {}
};

namespace callbacks {

/// "12s", "3m05s", "1h02m": a duration for a human (an ETA); "--" when unknown (NaN, negative).
inline std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "--";
  const auto s = static_cast<int64_t>(std::llround(seconds));
  if (s < 60) return fmt::format("{}s", s);
  if (s < 3600) return fmt::format("{}m{:02d}s", s / 60, s % 60);
  return fmt::format("{}h{:02d}m", s / 3600, s % 3600 / 60);
}

/// At each log line (TrainerOptions::log_interval(): reading the loss syncs, so not more often):
/// on a terminal, one progress bar redrawn in place — step/max, loss, tokens/s, live and peak
/// tracked tensor memory, ETA; otherwise (CI logs, files) one plain line per log with lr, the
/// gradient norm and RSS too. The peak is the run's: it survives MemoryMonitor's per-step reset.
///   trainer.add_callback(std::make_shared<memopt::callbacks::ProgressBar>());
///   // [##########..............] 40/100 | loss 3.2100 | 1234 tok/s | tensors 40 MiB, peak 95 MiB | ETA 1m05s
class ProgressBar : public Callback {
 public:
  explicit ProgressBar(std::FILE* out = stderr) : out_(out), tty_(isatty(fileno(out)) != 0) {}
  bool main_rank_only() const override { return true; }

  void on_step_end(const StepStats& stats) override {
    run_peak_ = std::max(run_peak_, memory::Tracker::instance().peak_bytes());  // an atomic load
    if (!stats.stepped)  // rare: reading the loss and norm back costs nothing that matters
      note(fmt::format("step {} skipped: loss {:.4f}, gradient norm {:.4f} (inf/nan: weights and optimizer state "
                       "left as they were)",
                       stats.step, stats.loss.item<double>(), stats.grad_norm.item<double>()));
  }

  void on_checkpoint(int64_t step, const std::string& path, const std::string& reason) override {
    note(fmt::format("checkpoint: the state after step {} saved to {} ({})", step, path, reason));
  }

  void on_notice(const std::string& text) override { note(text); }

  void on_log(const LogLine& l) override {
    using memory::mib;
    run_peak_ = std::max(run_peak_, l.memory.tensors.peak_bytes);
    constexpr int kWidth = 24;
    const int filled =
        l.max_steps > 0 ? static_cast<int>(kWidth * std::clamp<int64_t>(l.step, 0, l.max_steps) / l.max_steps) : 0;
    const std::string bar = std::string(filled, '#') + std::string(kWidth - filled, '.');
    const std::string skipped = l.skipped_steps > 0 ? fmt::format(" | skipped {}", l.skipped_steps) : "";
    if (tty_) {
      // \r: back to the line's start; \x1b[K: erase what a longer previous line left.
      fmt::print(out_, "\r[{}] {}/{} | loss {:.4f} | {:.0f} tok/s | tensors {:.0f} MiB, peak {:.0f} MiB{} | ETA {}",
                 bar, l.step, l.max_steps, l.loss, l.tokens_per_s, mib(l.memory.tensors.live_bytes),
                 mib(run_peak_), skipped, format_duration(l.eta_seconds));
      fmt::print(out_, "\x1b[K");
      if (l.step >= l.max_steps) fmt::print(out_, "\n");
    } else {
      fmt::print(out_,
                 "[{}] step {:>5}/{} | loss {:.4f} | lr {:.2e} | |g| {:.3f} | {:.0f} tok/s | tensors {:.0f} MiB (peak "
                 "{:.0f}) | RSS {:.0f} MiB{} | ETA {}\n",
                 bar, l.step, l.max_steps, l.loss, l.lr, l.grad_norm, l.tokens_per_s, mib(l.memory.tensors.live_bytes),
                 mib(run_peak_), mib(l.memory.rss_bytes), skipped, format_duration(l.eta_seconds));
    }
    std::fflush(out_);
  }

 private:
  // A line of its own (on a terminal, below the bar, which the next log redraws).
  void note(const std::string& text) {
    fmt::print(out_, "{}{}\n", tty_ ? "\r\x1b[K" : "", text);
    std::fflush(out_);
  }

  std::FILE* out_;
  bool tty_;
  int64_t run_peak_ = 0;
};

/// Every N steps, returns freed memory to the system: malloc_trim(0) on CPU (glibc keeps
/// freed arenas otherwise), the caching allocator's empty_cache in CUDA builds. It runs on
/// every rank of a data-parallel job; `barrier` (e.g. World::barrier) is called before the
/// release, as accelerate's wait_for_everyone() around empty_cache(), so every rank releases
/// at the same step and none while another still reduces.
///   trainer.add_callback(std::make_shared<ReleaseCache>(10, [&world] { world.barrier("release"); }));
class ReleaseCache : public Callback {
 public:
  explicit ReleaseCache(int64_t every_n_steps, std::function<void()> barrier = {})
      : every_(every_n_steps), barrier_(std::move(barrier)) {
    TORCH_CHECK(every_n_steps >= 1, "memopt::callbacks::ReleaseCache: every_n_steps must be >= 1 (got ",
                every_n_steps, "). HINT: use 1 to release after every step.");
  }
  void on_step_end(const StepStats& s) override {
    if (s.step % every_ != 0) return;
    if (barrier_) barrier_();
    memory::release_free_host_memory();  // malloc_trim(0)
#if MEMOPT_HAS_CUDA
    c10::cuda::CUDACachingAllocator::emptyCache();
#endif
    ++releases_;
  }
  int64_t releases() const { return releases_; }

 private:
  int64_t every_;
  std::function<void()> barrier_;
  int64_t releases_ = 0;
};

/// One line of memory figures per step: the step's tracked tensor peak and the peak of each
/// phase (the tracker's peaks are reset when the step begins), live bytes and RSS.
///   trainer.add_callback(std::make_shared<memopt::callbacks::MemoryMonitor>());
///   // memory step 12 | live 40.1 MiB | peak 95.3 MiB | forward 80.2 | backward 95.3 | optimizer 52.0 MiB | RSS …
class MemoryMonitor : public Callback {
 public:
  explicit MemoryMonitor(std::FILE* out = stderr) : out_(out) {}
  bool main_rank_only() const override { return true; }

  void on_step_begin(int64_t /*step*/) override { memory::Tracker::instance().reset_peaks(); }

  void on_step_end(const StepStats& s) override {
    using memory::mib;
    last_ = memory::Report::now();
    if (last_.tracked) {
      const auto& peaks = last_.tensors.phase_peak_bytes;
      auto phase = [&](memory::Phase p) { return mib(peaks[static_cast<int>(p)]); };
      fmt::print(out_, "memory step {} | live {:.1f} MiB | peak {:.1f} MiB | {} {:.1f} | {} {:.1f} | {} {:.1f} MiB | ",
                 s.step, mib(last_.tensors.live_bytes), mib(last_.tensors.peak_bytes),
                 memory::phase_name(memory::Phase::kForward), phase(memory::Phase::kForward),
                 memory::phase_name(memory::Phase::kBackward), phase(memory::Phase::kBackward),
                 memory::phase_name(memory::Phase::kOptimizer), phase(memory::Phase::kOptimizer));
    } else {
      if (!warned_)
        fmt::print(out_, "memory: tensor bytes are not tracked (the tracker is not installed). HINT: call "
                         "memopt::init() or memopt::memory::Tracker::install() first in main()\n");
      warned_ = true;
      fmt::print(out_, "memory step {} | ", s.step);
    }
    fmt::print(out_, "RSS {:.0f} MiB (peak {:.0f})\n", mib(last_.rss_bytes), mib(last_.peak_rss_bytes));
    std::fflush(out_);
  }

  /// The report of the last line printed (default-constructed before the first step).
  const memory::Report& last() const { return last_; }

 private:
  std::FILE* out_;
  memory::Report last_;
  bool warned_ = false;
};

/// Records the tracker's timeline from the first step on, for `steps` steps (0: the whole run),
/// and writes it to `path` as a Chrome trace (memory/timeline.hpp) — open it in Perfetto.
/// The ring keeps the last `capacity` events, so a long run keeps its end.
///   trainer.add_callback(std::make_shared<memopt::callbacks::MemoryTrace>("runs/a/memory.trace.json", 2));
class MemoryTrace : public Callback {
 public:
  explicit MemoryTrace(std::string path, int64_t steps = 0, size_t capacity = size_t{1} << 18)
      : path_(std::move(path)), steps_(steps), capacity_(capacity) {
    TORCH_CHECK(steps >= 0, "memopt::callbacks::MemoryTrace: steps must be >= 0 (got ", steps,
                "). HINT: 0 traces the whole run; 2 traces the first two steps.");
  }
  bool main_rank_only() const override { return true; }
  void on_step_begin(int64_t /*step*/) override {
    if (!started_) memory::Tracker::instance().start_timeline(capacity_);
    started_ = true;
  }
  void on_step_end(const StepStats& s) override {
    if (steps_ > 0 && s.step >= steps_) finish();
  }
  void on_train_end(const memory::Report& /*report*/) override { finish(); }
  /// Whether the trace file was written.
  bool written() const { return written_; }

 private:
  void finish() {
    if (!started_ || written_) return;
    auto& tracker = memory::Tracker::instance();
    tracker.stop_timeline();
    memory::write_chrome_trace(tracker.timeline(), path_);
    written_ = true;
  }
  std::string path_;
  int64_t steps_;
  size_t capacity_;
  bool started_ = false, written_ = false;
};

/// Writes a JSON object per log line to `path` (metrics.jsonl): event "train", step, max_steps,
/// loss, lr, grad_norm, tokens_per_s, step_seconds, eta_seconds, skipped_steps, tracked_mib (live
/// tensors), peak_mib (the run's tracked peak so far), rss_mib, peak_rss_mib (on a GPU also
/// cuda_allocated_mib, cuda_reserved_mib, cuda_peak_mib: one value per device), plus what `extra`
/// adds; write() appends other lines (a summary). Keeps the run's tracked peak, which survives
/// MemoryMonitor resetting the tracker's peak every step. scripts/plot draws the file.
///   auto log = std::make_shared<memopt::callbacks::JsonlMetrics>("runs/a/metrics.jsonl");
///   trainer.add_callback(log);  ...  log->write({{"event", "summary"}, {"peak", log->run_peak()}});
class JsonlMetrics : public Callback {
 public:
  using Extra = std::function<void(const LogLine&, nlohmann::json&)>;
  /// Data parallel: only rank 0 (RANK, read without starting the process group) opens and
  /// truncates the file; on other ranks write() writes nothing.
  explicit JsonlMetrics(const std::string& path, bool append = false, Extra extra = {}) : extra_(std::move(extra)) {
    if (dist::Env::from_environment().rank != 0) return;
    out_.open(path, append ? std::ios::app : std::ios::trunc);
    TORCH_CHECK(out_.good(), "memopt::callbacks::JsonlMetrics: cannot write '", path,
                "'. HINT: check that the output directory exists and is writable.");
  }
  bool main_rank_only() const override { return true; }
  void on_step_end(const StepStats&) override {
    run_peak_ = std::max(run_peak_, memory::Tracker::instance().snapshot().peak_bytes);
  }
  void on_log(const LogLine& l) override {
    run_peak_ = std::max(run_peak_, l.memory.tensors.peak_bytes);
    nlohmann::json j = {{"event", "train"},
                        {"step", l.step},
                        {"max_steps", l.max_steps},
                        {"loss", l.loss},
                        {"lr", l.lr},
                        {"grad_norm", l.grad_norm},
                        {"tokens_per_s", l.tokens_per_s},
                        {"step_seconds", l.step_seconds},
                        {"eta_seconds", l.eta_seconds},
                        {"skipped_steps", l.skipped_steps},
                        {"tracked_mib", memory::mib(l.memory.tensors.live_bytes)},
                        {"peak_mib", memory::mib(run_peak_)},
                        {"rss_mib", memory::mib(l.memory.rss_bytes)},
                        {"peak_rss_mib", memory::mib(l.memory.peak_rss_bytes)}};
    for (const auto& c : l.memory.cuda) {  // CUDA builds with a GPU: the caching allocator's figures
      j["cuda_allocated_mib"].push_back(memory::mib(c.allocated_bytes));
      j["cuda_reserved_mib"].push_back(memory::mib(c.reserved_bytes));
      j["cuda_peak_mib"].push_back(memory::mib(c.peak_allocated_bytes));
    }
    if (extra_) extra_(l, j);
    write(j);
  }
  /// Appends one line and flushes it (a crash loses nothing written).
  void write(const nlohmann::json& j) {
    out_ << j.dump() << '\n';
    out_.flush();
  }
  /// The largest tracked tensor peak of any step so far (bytes).
  int64_t run_peak() const { return run_peak_; }

 private:
  std::ofstream out_;
  Extra extra_;
  int64_t run_peak_ = 0;
};

}  // namespace callbacks
}  // namespace memopt
