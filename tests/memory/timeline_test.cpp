// tests/memory/timeline_test.cpp — memopt/memory/timeline.hpp and the tracker's timeline: the
// recorded allocations, frees and phases in order, their Chrome trace (ordered JSON: a counter
// point per event, a slice per phase), and a small ring keeping the last events.
#include <catch2/catch.hpp>

#include <cstdint>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <memopt/memory/timeline.hpp>
#include <memopt/memory/tracker.hpp>

#include "support.hpp"

TEST_CASE("the timeline records allocations, frees and phases, the Chrome trace is ordered JSON", "[memory][timeline]") {
  namespace mm = memopt::memory;
  auto& tracker = mm::Tracker::instance();
  CHECK_FALSE(tracker.timeline_recording());
  tracker.start_timeline();
  const int64_t base = tracker.live_bytes();
  {
    mm::PhaseScope forward(mm::Phase::kForward);
    auto a = torch::empty({1024}, torch::kFloat);  // 4096 bytes
    {
      mm::PhaseScope backward(mm::Phase::kBackward);
      auto b = torch::empty({2048}, torch::kFloat);  // 8192 bytes
    }
  }
  tracker.stop_timeline();
  auto after_stop = torch::empty({16});  // not recorded
  const auto events = tracker.timeline();
  // start, phase forward, alloc a, phase backward, alloc b, free b, phase forward, free a, phase idle
  REQUIRE(events.size() == 9);
  std::vector<int64_t> live;
  std::vector<std::string_view> phases;
  for (const auto& e : events) {
    live.push_back(e.live_bytes - base);
    phases.push_back(mm::phase_name(e.phase));
  }
  CHECK(live == std::vector<int64_t>{0, 0, 4096, 4096, 4096 + 8192, 4096, 4096, 0, 0});
  CHECK(phases == std::vector<std::string_view>{"idle", "forward", "forward", "backward", "backward", "backward",
                                                "forward", "forward", "idle"});
  for (size_t i = 1; i < events.size(); ++i) CHECK(events[i].time_ns >= events[i - 1].time_ns);

  memopt::test::TempDir dir;
  const std::string path = dir.file("memory.trace.json");
  mm::write_chrome_trace(events, path);
  std::ifstream file(path);
  const auto trace = nlohmann::json::parse(file);
  double last_ts = -1;
  int counters = 0;
  std::vector<std::string> slices;
  for (const auto& e : trace.at("traceEvents")) {
    if (!e.contains("ts")) continue;
    CHECK(e["ts"].get<double>() >= last_ts);
    last_ts = e["ts"].get<double>();
    if (e["ph"] == "C") ++counters;
    if (e["ph"] == "X") {
      slices.push_back(e["name"].get<std::string>());
      CHECK(e["dur"].get<double>() >= 0);
    }
  }
  CHECK(counters == 9);
  CHECK(slices == std::vector<std::string>{"forward", "backward", "forward"});

  // A small ring keeps the last events and counts them all.
  tracker.start_timeline(4);
  for (int i = 0; i < 5; ++i) auto t = torch::empty({256});
  tracker.stop_timeline();
  uint64_t recorded = 0;
  CHECK(tracker.timeline(&recorded).size() == 4);
  CHECK(recorded == 11);  // start + 5 allocations + 5 frees
  memopt::test::require_error([&] { tracker.start_timeline(1); }, "memopt::memory: start_timeline",
                              {"capacity must be >= 2 events (got 1)"});
}
