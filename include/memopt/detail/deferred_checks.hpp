// memopt/detail/deferred_checks.hpp — not API. Input checks that need a tensor's value (a
// target outside the vocabulary) cost a host sync each: on a GPU the host waits for the
// queue to drain. Inside a DeferredChecks::Scope a building block records its check as
// a 0-dim flag instead, keeps computing on a safe substitute, and the scope's owner (the
// Trainer, before its optimizer step) reads every flag with the step's one host read and
// throws the first failed check's message. Outside a scope, checks run at once.
//   memopt::detail::check_or_defer(bad.any(), first_bad, [](double v) { return "target " + ...; });
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace memopt::detail {

class DeferredChecks {
 public:
  // The message of a failed check, given the detail value recorded with it (say, the bad target).
  using Message = std::function<std::string(double detail)>;

  /// Makes `checks` (cleared) this thread's collector while alive; `defer` false makes
  /// the scope a no-op, so checks run at once (an owner that updates weights inside
  /// backward has no later point to read them at).
  class Scope {
   public:
    Scope(DeferredChecks& checks, bool defer) : previous_(current()), defer_(defer) {
      if (!defer_) return;
      checks.clear();
      current() = &checks;
    }
    ~Scope() {
      if (defer_) current() = previous_;
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    DeferredChecks* previous_;
    bool defer_;
  };

  /// This thread's collector, or nullptr outside every Scope.
  static DeferredChecks*& current() {
    thread_local DeferredChecks* checks = nullptr;
    return checks;
  }

  /// Records a check: `failed` a 0-dim bool, `detail` a 0-dim number for the message.
  void add(torch::Tensor failed, torch::Tensor detail, Message message) {
    failed_.push_back(failed.reshape({}).to(torch::kBool));
    details_.push_back(detail.reshape({}).to(torch::kDouble));
    messages_.push_back(std::move(message));
  }

  bool empty() const { return failed_.empty(); }

  /// 0-dim bool, true when every recorded check passed (also when none was recorded); no host sync.
  torch::Tensor passed() const {
    if (failed_.empty()) return torch::ones({}, torch::kBool);
    return torch::stack(failed_).any().logical_not();
  }

  /// Throws the first failed check's message (host reads: call it once passed() read false).
  void throw_if_failed() const {
    for (size_t i = 0; i < failed_.size(); ++i) {
      if (failed_[i].item<bool>()) TORCH_CHECK(false, messages_[i](details_[i].item<double>()));
    }
  }

  void clear() {
    failed_.clear();
    details_.clear();
    messages_.clear();
  }

 private:
  std::vector<torch::Tensor> failed_;
  std::vector<torch::Tensor> details_;
  std::vector<Message> messages_;
};

/// Defers the check to this thread's DeferredChecks scope, or runs it now (one host read)
/// outside one. The caller must go on safely either way: the values that failed replaced.
inline void check_or_defer(const torch::Tensor& failed, const torch::Tensor& detail,
                           DeferredChecks::Message message) {
  if (auto* checks = DeferredChecks::current()) {
    checks->add(failed, detail, std::move(message));
    return;
  }
  if (failed.item<bool>()) TORCH_CHECK(false, message(detail.item<double>()));
}

}  // namespace memopt::detail
