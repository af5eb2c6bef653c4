// memopt/data/prefetch.hpp — a bounded, in-order prefetcher: worker threads call
// produce(index) for the next indices (tokenization, collation) while the training loop
// consumes item index after index, so data preparation overlaps compute. Items come out
// in index order whatever the number of workers; a producer's exception comes out of the
// next() that would have returned its item; optional pinned memory for fast host→GPU copies.
#pragma once

#include <concepts>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

namespace memopt::data {

/// Threads and queue of a Prefetcher.
///   auto opts = memopt::data::PrefetchOptions().workers(2).depth(4).pin_memory(true);
struct PrefetchOptions {
  /// Worker threads; 0 produces each item inline, on the caller's thread, inside next().
  TORCH_ARG(int64_t, workers) = 1;
  /// At most this many items are produced (or being produced) and not yet consumed.
  TORCH_ARG(int64_t, depth) = 4;
  /// Pin each item (item.pin_memory()) when the type has pin_memory() and CUDA is
  /// available; a no-op otherwise (CPU builds, CPU-only machines).
  TORCH_ARG(bool, pin_memory) = false;
  /// The first index produced (to resume at step `start`).
  TORCH_ARG(int64_t, start) = 0;
};

namespace detail {

template <class T>
concept Pinnable = requires(const T& item) {
  { item.pin_memory() } -> std::convertible_to<T>;
};

}  // namespace detail

/// Calls produce(start), produce(start + 1), ... ahead of time on `workers` threads and
/// returns the items in index order from next().
///
/// Threads: the workers run produce() concurrently, so it must be thread-safe (GritBatcher::
/// batch is). LibTorch's intra-op pool is not resized: workers are meant for tokenization
/// and collation, which write tensors element by element or run ops below LibTorch's grain
/// size (32768 elements), so they stay single-threaded and do not compete with the training
/// step's at::get_num_threads() threads. Do not call at::set_num_threads() inside produce():
/// it changes process-wide state (the OpenMP/MKL thread count the training step uses). With
/// heavy torch ops in produce(), keep workers + at::get_num_threads() at most the core count.
///
/// Destruction stops the workers and joins them, also when they wait on a full queue; a
/// produce() call in progress is finished first.
///   memopt::data::Prefetcher<memopt::data::GritBatch> prefetch(
///       [&](int64_t i) { return batcher.batch(i); }, memopt::data::PrefetchOptions().workers(2));
///   auto batch = prefetch.next();   // batch 0, then 1, 2, ...
template <class T>
class Prefetcher {
 public:
  using Produce = std::function<T(int64_t index)>;

  explicit Prefetcher(Produce produce, PrefetchOptions options = {})
      : produce_(std::move(produce)), options_(std::move(options)) {
    TORCH_CHECK(produce_ != nullptr, "memopt::data::Prefetcher: the produce function is empty. HINT: pass "
                "a callable such as [&](int64_t i) { return batcher.batch(i); }");
    TORCH_CHECK(options_.workers() >= 0, "memopt::data::Prefetcher: workers must be >= 0 (got ",
                options_.workers(), "). HINT: 0 produces inline, 1-2 overlap data preparation with training");
    TORCH_CHECK(options_.depth() >= 1, "memopt::data::Prefetcher: depth must be >= 1 (got ", options_.depth(),
                "). HINT: 2-4 items are enough to hide data preparation");
    TORCH_CHECK(options_.start() >= 0, "memopt::data::Prefetcher: start must be >= 0 (got ", options_.start(),
                "). HINT: pass the index of the first item to produce (the resumed step)");
    if constexpr (detail::Pinnable<T>) pin_ = options_.pin_memory() && torch::cuda::is_available();
    consumed_ = claimed_ = options_.start();
    workers_.reserve(static_cast<size_t>(options_.workers()));
    for (int64_t w = 0; w < options_.workers(); ++w) workers_.emplace_back([this] { work(); });
  }

  ~Prefetcher() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    can_claim_.notify_all();
    for (auto& worker : workers_) worker.join();
  }

  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  /// The item of index(), then index() advances. Rethrows produce()'s exception for that
  /// item as a c10::Error naming the index.
  T next() {
    if (workers_.empty()) {
      const int64_t index = consumed_++;
      try {
        return finish(produce_(index));
      } catch (...) {
        rethrow(index, std::current_exception());
      }
    }
    std::unique_lock<std::mutex> lock(mutex_);
    const int64_t index = consumed_;
    ready_cv_.wait(lock, [&] { return ready_.count(index) > 0; });
    auto node = ready_.extract(index);
    ++consumed_;
    lock.unlock();
    can_claim_.notify_all();
    Slot& slot = node.mapped();
    if (slot.error) rethrow(index, slot.error);
    return std::move(*slot.value);
  }

  /// Skips `n` items (dropped if already produced): next() returns item index() + n.
  void skip(int64_t n) {
    TORCH_CHECK(n >= 0, "memopt::data::Prefetcher: cannot skip ", n, " items. HINT: skip(n) moves forward only; "
                "to resume, construct with PrefetchOptions().start(step)");
    {
      std::lock_guard<std::mutex> lock(mutex_);
      consumed_ += n;
      claimed_ = std::max(claimed_, consumed_);
      ready_.erase(ready_.begin(), ready_.lower_bound(consumed_));
    }
    can_claim_.notify_all();
  }

  /// The position, for a training checkpoint (Trainer::save_checkpoint): the index next() returns.
  nlohmann::json state() const { return {{"kind", "Prefetcher"}, {"index", index()}}; }

  /// Continues from state(): moves forward to its index (items are a function of their index,
  /// so the next one is the item the saving run would have drawn).
  void load_state(const nlohmann::json& state) {
    const bool ok = state.is_object() && state.value("kind", "") == "Prefetcher" && state.contains("index") &&
                    state["index"].is_number_integer();
    TORCH_CHECK(ok, "memopt::data::Prefetcher::load_state: expected {\"kind\": \"Prefetcher\", \"index\": N} (got ",
                state.dump(), "). HINT: resume with the loader type of the run that saved the checkpoint");
    const int64_t target = state["index"].get<int64_t>();
    TORCH_CHECK(target >= index(), "memopt::data::Prefetcher::load_state: the checkpoint is at item ", target,
                ", this prefetcher is past it (", index(), "). HINT: load the state into a new prefetcher");
    skip(target - index());
  }

  /// The index of the item next() returns.
  int64_t index() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return consumed_;
  }
  const PrefetchOptions& options() const { return options_; }

 private:
  struct Slot {
    std::optional<T> value;
    std::exception_ptr error;
  };

  T finish(T item) const {
    if constexpr (detail::Pinnable<T>) {
      if (pin_) return item.pin_memory();
    }
    return item;
  }

  [[noreturn]] static void rethrow(int64_t index, const std::exception_ptr& error) {
    std::string what;
    try {
      std::rethrow_exception(error);
    } catch (const c10::Error& e) {
      what = e.what_without_backtrace();
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
      what = "an exception that is not a std::exception";
    }
    TORCH_CHECK(false, "memopt::data::Prefetcher: producing item ", index, " failed: ", what,
                " HINT: the error comes from the produce function; call it with index ", index,
                " (or use workers(0)) to reproduce it on this thread");
  }

  void work() {
    while (true) {
      int64_t index = 0;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        can_claim_.wait(lock, [&] { return stop_ || claimed_ < consumed_ + options_.depth(); });
        if (stop_) return;
        index = claimed_++;
      }
      Slot slot;
      try {
        slot.value.emplace(finish(produce_(index)));
      } catch (...) {
        slot.error = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (index >= consumed_) ready_.emplace(index, std::move(slot));  // else skipped meanwhile
      }
      ready_cv_.notify_all();
    }
  }

  Produce produce_;
  PrefetchOptions options_;
  bool pin_ = false;
  mutable std::mutex mutex_;
  std::condition_variable can_claim_;  // workers: a slot in the depth window is free, or stop
  std::condition_variable ready_cv_;   // next(): an item was stored
  std::map<int64_t, Slot> ready_;      // produced, not consumed: index -> item or error
  int64_t consumed_ = 0;               // the index next() returns
  int64_t claimed_ = 0;                // the next index a worker takes
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace memopt::data
