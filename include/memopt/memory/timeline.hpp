// memopt/memory/timeline.hpp — the tracker's timeline (Tracker::start_timeline) as a Chrome
// Trace Event file, the format torch.profiler's export_chrome_trace writes and Perfetto
// (ui.perfetto.dev) and chrome://tracing open: a counter track of live tensor MiB, one point
// per allocation or free, and one slice per forward / backward / optimizer span.
#pragma once

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "memopt/io/safetensors.hpp"
#include "memopt/memory/tracker.hpp"

namespace memopt::memory {

/// The trace as JSON: {"traceEvents": [...], "displayTimeUnit": "ms"}; times in µs from the
/// first event, in non-decreasing order.
inline nlohmann::json chrome_trace(const std::vector<TimelineEvent>& events) {
  std::vector<nlohmann::json> timed;  // counter points and phase slices, sorted by start below
  const int64_t t0 = events.empty() ? 0 : events.front().time_ns;
  auto us = [t0](int64_t ns) { return static_cast<double>(ns - t0) / 1e3; };
  size_t span_begin = 0;  // the first event of the current phase span
  for (size_t i = 0; i < events.size(); ++i) {
    const TimelineEvent& e = events[i];
    timed.push_back({{"name", "tensor memory"}, {"ph", "C"}, {"pid", 1}, {"tid", 1}, {"ts", us(e.time_ns)},
                     {"args", {{"live MiB", static_cast<double>(e.live_bytes) / (1024.0 * 1024.0)}}}});
    const bool last = i + 1 == events.size();
    if (last || events[i + 1].phase != e.phase) {
      const TimelineEvent& first = events[span_begin];
      const int64_t end_ns = last ? e.time_ns : events[i + 1].time_ns;
      if (first.phase != Phase::kIdle) {
        timed.push_back({{"name", std::string(phase_name(first.phase))}, {"ph", "X"}, {"pid", 1}, {"tid", 2},
                         {"ts", us(first.time_ns)}, {"dur", us(end_ns) - us(first.time_ns)}});
      }
      span_begin = i + 1;
    }
  }
  auto ts = [](const nlohmann::json& event) { return event["ts"].get<double>(); };
  std::stable_sort(timed.begin(), timed.end(), [&](const auto& a, const auto& b) { return ts(a) < ts(b); });
  nlohmann::json trace = nlohmann::json::array();
  trace.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", 1}, {"args", {{"name", "memopt tracker"}}}});
  for (auto& event : timed) trace.push_back(std::move(event));
  return {{"traceEvents", trace}, {"displayTimeUnit", "ms"}};
}

/// Writes chrome_trace(events) to `path` (atomically).
///   memopt::memory::write_chrome_trace(memopt::memory::Tracker::instance().timeline(), "step.trace.json");
inline void write_chrome_trace(const std::vector<TimelineEvent>& events, const std::string& path) {
  const std::string text = chrome_trace(events).dump();
  io::detail::write_atomically(path, "memopt::memory: write_chrome_trace('" + path + "')", [&](std::FILE* file) {
    return std::fwrite(text.data(), 1, text.size(), file) == text.size();
  });
}

}  // namespace memopt::memory
