// benchmarks/profile.hpp — where a training step's time goes: LibTorch's profiler (Kineto, CPU
// activity) around one step, and each op's self time (its span less the ops it called), summed
// by name over the step, largest first. torch.profiler's key_averages() table, self-CPU column.
//   const auto ops = memopt::bench::profile_step([&] { trainer.step(...); });
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/torch.h>

namespace memopt::bench {

/// One op's share of a profiled step.
struct OpTime {
  std::string name;  // aten::mm, autograd::engine::evaluate_function: MmBackward0, ...
  double self_ms = 0;
  int64_t calls = 0;
};

/// A profiled step: its wall time and the ops' self times, largest first. The time in no op
/// (the loop's own C++, the optimizer's scalar work between kernels) is wall_ms less the sum.
struct StepProfile {
  double wall_ms = 0;
  std::vector<OpTime> ops;

  nlohmann::ordered_json top(size_t n) const {  // [{"op", "self_ms", "share", "calls"}], share of wall_ms
    auto out = nlohmann::ordered_json::array();
    for (size_t i = 0; i < std::min(n, ops.size()); ++i)
      out.push_back({{"op", ops[i].name}, {"self_ms", ops[i].self_ms}, {"share", ops[i].self_ms / wall_ms},
                     {"calls", ops[i].calls}});
    return out;
  }
};

/// Self time of each event: its duration less its direct children's, per thread. Events nest on
/// a thread (an op's span holds the ops it dispatches), so a stack of open spans finds each
/// event's parent.
inline StepProfile self_times(const std::vector<torch::autograd::profiler::KinetoEvent>& events, double wall_ms) {
  struct Span {
    uint64_t start, end, thread;
    const torch::autograd::profiler::KinetoEvent* event;
    uint64_t children = 0;
  };
  std::vector<Span> spans;
  for (const auto& e : events)
    if (e.deviceType() == c10::DeviceType::CPU && !e.isAsync() && e.endNs() > e.startNs())
      spans.push_back({e.startNs(), e.endNs(), e.startThreadId(), &e});
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return a.thread != b.thread ? a.thread < b.thread : a.start != b.start ? a.start < b.start : a.end > b.end;
  });
  std::map<std::string, OpTime> by_name;
  std::vector<Span*> open;
  auto close = [&by_name](const Span& s) {
    auto& op = by_name[s.event->name()];
    op.name = s.event->name();
    op.self_ms += static_cast<double>(s.end - s.start - std::min(s.children, s.end - s.start)) / 1e6;
    op.calls += 1;
  };
  for (auto& s : spans) {
    while (!open.empty() && (open.back()->thread != s.thread || open.back()->end <= s.start)) {
      close(*open.back());
      open.pop_back();
    }
    if (!open.empty()) open.back()->children += s.end - s.start;
    open.push_back(&s);
  }
  for (auto it = open.rbegin(); it != open.rend(); ++it) close(**it);
  StepProfile p{wall_ms, {}};
  for (auto& [name, op] : by_name) p.ops.push_back(op);
  std::sort(p.ops.begin(), p.ops.end(), [](const OpTime& a, const OpTime& b) { return a.self_ms > b.self_ms; });
  return p;
}

/// Runs `step` once under the profiler (CPU ops) and returns where its time went.
template <class Step>
StepProfile profile_step(Step&& step) {
  namespace prof = torch::autograd::profiler;
  using torch::profiler::impl::ActivityType;
  const torch::profiler::impl::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO);
  const std::set<ActivityType> activities{ActivityType::CPU};
  prof::prepareProfiler(config, activities);
  prof::enableProfiler(config, activities);
  const auto start = std::chrono::steady_clock::now();
  step();
  const double wall_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  const auto result = prof::disableProfiler();
  return self_times(result->events(), wall_ms);
}

}  // namespace memopt::bench
