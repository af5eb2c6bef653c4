// benchmarks/profile.hpp — where a training step's time goes: LibTorch's profiler (Kineto, CPU
// activity) around one step, and each op's self time (its span less the ops it called), summed
// by name over the step, largest first: torch.profiler's key_averages() table, self-CPU column;
// and the GEMMs by shape with the rate each ran at (key_averages(group_by_input_shape=True)).
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

/// One GEMM shape's calls in a profiled step: `op` with these input shapes, its self time and
/// the rate it ran at (2·m·k·n FLOPs a product, every batch).
struct GemmTime {
  std::string op, shapes;  // "aten::mm", "(4096, 512) x (512, 1408)"
  double flops = 0, self_ms = 0;
  int64_t calls = 0;
};

/// A profiled step: its wall time and the ops' self times, largest first; the GEMMs (mm, addmm,
/// bmm, baddbmm, in and out of place) again by input shapes. The time in no op (the loop's own
/// C++, the optimizer's scalar work between kernels) is wall_ms less the sum.
struct StepProfile {
  double wall_ms = 0;
  std::vector<OpTime> ops;
  std::vector<GemmTime> gemms;  // largest self time first

  nlohmann::ordered_json top(size_t n) const {  // [{"op", "self_ms", "share", "calls"}], share of wall_ms
    auto out = nlohmann::ordered_json::array();
    for (size_t i = 0; i < std::min(n, ops.size()); ++i)
      out.push_back({{"op", ops[i].name}, {"self_ms", ops[i].self_ms}, {"share", ops[i].self_ms / wall_ms},
                     {"calls", ops[i].calls}});
    return out;
  }

  /// [{"op", "shapes", "calls", "self_ms", "share", "gflops"}] for the n GEMM shapes of most
  /// self time; gflops is their FLOPs over their self time.
  nlohmann::ordered_json top_gemms(size_t n) const {
    auto out = nlohmann::ordered_json::array();
    for (size_t i = 0; i < std::min(n, gemms.size()); ++i)
      out.push_back({{"op", gemms[i].op}, {"shapes", gemms[i].shapes}, {"calls", gemms[i].calls},
                     {"self_ms", gemms[i].self_ms}, {"share", gemms[i].self_ms / wall_ms},
                     {"gflops", gemms[i].flops / gemms[i].self_ms / 1e6}});
    return out;
  }
};

/// Where a GEMM op's two operands start among its inputs (addmm's and baddbmm's self comes
/// first), or -1 for an op that is not a GEMM.
inline int gemm_first_operand(const std::string& op) {
  if (op == "aten::mm" || op == "aten::bmm") return 0;
  if (op == "aten::addmm" || op == "aten::addmm_" || op == "aten::baddbmm" || op == "aten::baddbmm_") return 1;
  return -1;
}

/// FLOPs of one GEMM op given its input shapes: 2·m·k·n for each (m, k) · (k, n) product, every
/// batch; 0 where the op is no GEMM or its shapes did not come.
inline double gemm_flops(const std::string& op, c10::ArrayRef<std::vector<int64_t>> shapes) {
  const int first = gemm_first_operand(op);
  if (first < 0 || shapes.size() < static_cast<size_t>(first) + 2) return 0;
  const auto &a = shapes[first], &b = shapes[first + 1];
  if (a.size() != b.size() || a.size() < 2 || a.size() > 3) return 0;
  const double batch = a.size() == 3 ? static_cast<double>(a[0]) : 1.0;
  return 2.0 * batch * static_cast<double>(a[a.size() - 2]) * static_cast<double>(a.back()) *
         static_cast<double>(b.back());
}

/// "(4096, 512) x (512, 1408)": a GEMM op's two operands' shapes (requires gemm_flops > 0).
inline std::string gemm_shapes(const std::string& op, c10::ArrayRef<std::vector<int64_t>> shapes) {
  const size_t first = static_cast<size_t>(gemm_first_operand(op));
  std::string out;
  for (size_t i = first; i < first + 2; ++i) {
    out += i > first ? " x (" : "(";
    for (size_t d = 0; d < shapes[i].size(); ++d) out += (d ? ", " : "") + std::to_string(shapes[i][d]);
    out += ")";
  }
  return out;
}

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
  std::map<std::string, GemmTime> by_shape;
  std::vector<Span*> open;
  auto close = [&](const Span& s) {
    const std::string name = s.event->name();
    const double self_ms = static_cast<double>(s.end - s.start - std::min(s.children, s.end - s.start)) / 1e6;
    auto& op = by_name[name];
    op.name = name;
    op.self_ms += self_ms;
    op.calls += 1;
    if (const double flops = gemm_flops(name, s.event->shapes()); flops > 0) {
      const auto shapes = gemm_shapes(name, s.event->shapes());
      auto& g = by_shape[name + shapes];
      g.op = name, g.shapes = shapes;
      g.flops += flops, g.self_ms += self_ms, g.calls += 1;
    }
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
  for (auto& [key, g] : by_shape) p.gemms.push_back(g);
  std::sort(p.gemms.begin(), p.gemms.end(), [](const GemmTime& a, const GemmTime& b) { return a.self_ms > b.self_ms; });
  return p;
}

/// Runs `step` once under the profiler (CPU ops, with input shapes) and returns where its time
/// went.
template <class Step>
StepProfile profile_step(Step&& step) {
  namespace prof = torch::autograd::profiler;
  using torch::profiler::impl::ActivityType;
  const torch::profiler::impl::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO,
                                                    /*report_input_shapes=*/true);
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
