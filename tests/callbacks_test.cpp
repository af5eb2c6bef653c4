// tests/callbacks_test.cpp — memopt/callbacks.hpp: MemoryTrace traces its steps and writes the
// file once, format_duration's ETA, ProgressBar's plain lines and JsonlMetrics' parsable lines.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <memopt/callbacks.hpp>
#include <memopt/memory/report.hpp>
#include <memopt/memory/tracker.hpp>
#include <memopt/models/llama.hpp>
#include <memopt/trainer.hpp>

#include "memory/fixtures.hpp"
#include "support.hpp"

using namespace memopt::test::memory;  // NOLINT: the fixtures of the memory tests (tiny_llama, TinyLoader)

TEST_CASE("MemoryTrace traces its steps, then stops and writes the file once", "[memory][timeline][callbacks]") {
  auto& tracker = memopt::memory::Tracker::instance();
  memopt::test::TempDir dir;
  const std::string path = dir.file("t.json");
  memopt::callbacks::MemoryTrace trace(path, /*steps=*/2);
  memopt::StepStats stats;
  for (int64_t step = 1; step <= 3; ++step) {
    trace.on_step_begin(step);
    CHECK(tracker.timeline_recording() == (step <= 2));
    auto t = torch::empty({64});
    stats.step = step;
    trace.on_step_end(stats);
    CHECK(trace.written() == (step >= 2));
  }
  CHECK_FALSE(tracker.timeline_recording());
  std::ifstream file(path);
  const auto json = nlohmann::json::parse(file);
  int counters = 0;
  for (const auto& e : json.at("traceEvents")) counters += e.value("ph", "") == "C";
  CHECK(counters == 4);  // start, step 1 allocation and free, step 2 allocation (freed after the trace stopped)
  memopt::test::require_error([] { memopt::callbacks::MemoryTrace bad("x.json", -1); },
                              "memopt::callbacks::MemoryTrace", {"steps must be >= 0 (got -1)"});
}

TEST_CASE("format_duration writes an ETA for a human", "[callbacks]") {
  using memopt::callbacks::format_duration;
  CHECK(format_duration(0) == "0s");
  CHECK(format_duration(12.4) == "12s");
  CHECK(format_duration(185) == "3m05s");
  CHECK(format_duration(3720) == "1h02m");
  CHECK(format_duration(-1) == "--");
  CHECK(format_duration(std::nan("")) == "--");
}

TEST_CASE("ProgressBar prints plain lines with the ETA when not on a terminal", "[callbacks]") {
  std::FILE* out = std::tmpfile();  // not a TTY: one line per log
  REQUIRE(out != nullptr);
  memopt::callbacks::ProgressBar bar(out);
  memopt::LogLine line;
  line.step = 40;
  line.max_steps = 100;
  line.loss = 3.21;
  line.tokens_per_s = 1234;
  line.eta_seconds = 185;
  line.memory.tensors.live_bytes = 40 << 20;
  line.memory.tensors.peak_bytes = 95 << 20;
  bar.on_log(line);
  line.step = 100;
  line.skipped_steps = 2;
  line.eta_seconds = 0;
  line.memory.tensors.peak_bytes = 50 << 20;  // a per-step peak (MemoryMonitor resets it): the run's stays 95
  bar.on_log(line);
  std::rewind(out);
  std::string text;
  for (int c = std::fgetc(out); c != EOF; c = std::fgetc(out)) text += static_cast<char>(c);
  std::fclose(out);
  INFO(text);
  CHECK(std::count(text.begin(), text.end(), '\n') == 2);
  CHECK(text.find('\r') == std::string::npos);
  CHECK_THAT(text, Catch::Contains("step    40/100") && Catch::Contains("loss 3.2100") &&
                       Catch::Contains("1234 tok/s") && Catch::Contains("tensors 40 MiB (peak 95)") &&
                       Catch::Contains("| ETA 3m05s\n"));
  CHECK_THAT(text, Catch::Contains("step   100/100") && Catch::Contains("skipped 2 | ETA 0s\n"));
}

TEST_CASE("JsonlMetrics lines parse and carry skipped steps, peaks, step time and ETA", "[callbacks][precision]") {
  torch::manual_seed(0);
  memopt::models::Llama model = tiny_llama();
  TinyLoader loader;
  memopt::Trainer<memopt::recompute::None, memopt::precision::Scaled<c10::kFloat>> trainer(
      *model, memopt::TrainerOptions().max_steps(6).log_interval(2));
  memopt::test::TempDir dir;
  const std::string path = dir.file("metrics.jsonl");
  auto metrics = std::make_shared<memopt::callbacks::JsonlMetrics>(path);
  std::FILE* progress = std::tmpfile();
  REQUIRE(progress != nullptr);
  trainer.add_callback(std::make_shared<memopt::callbacks::ProgressBar>(progress)).add_callback(metrics);
  int calls = 0;
  trainer.fit(loader, [&](const memopt::Batch& b, const auto& c) {
    auto loss = model->loss_sum(b, c);
    return ++calls == 3 ? loss * std::numeric_limits<float>::infinity() : loss;  // step 3 overflows: skipped
  });

  std::ifstream file(path);
  std::vector<nlohmann::json> lines;
  for (std::string text; std::getline(file, text);) lines.push_back(nlohmann::json::parse(text));
  REQUIRE(lines.size() == 3);  // steps 2, 4, 6
  for (size_t i = 0; i < lines.size(); ++i) {
    const auto& j = lines[i];
    INFO(j.dump());
    for (const char* key : {"event", "step", "max_steps", "loss", "lr", "grad_norm", "tokens_per_s", "step_seconds",
                            "eta_seconds", "skipped_steps", "tracked_mib", "peak_mib", "rss_mib", "peak_rss_mib"})
      CHECK(j.contains(key));
    CHECK(j["event"] == "train");
    CHECK(j["step"] == 2 * static_cast<int64_t>(i + 1));
    CHECK(j["max_steps"] == 6);
    CHECK(j["skipped_steps"] == (i == 0 ? 0 : 1));  // cumulative: step 3 was skipped
    CHECK(j["step_seconds"].get<double>() > 0);
    CHECK(j["eta_seconds"].get<double>() >= 0);
    CHECK(j["peak_mib"].get<double>() >= j["tracked_mib"].get<double>());
    CHECK(j["peak_mib"].get<double>() > 0);
    CHECK(j["peak_rss_mib"].get<double>() >= j["rss_mib"].get<double>());
  }
  CHECK(lines[0]["eta_seconds"].get<double>() > 0);
  CHECK(lines[2]["eta_seconds"].get<double>() == 0);
  CHECK(lines[2]["peak_mib"].get<double>() == Approx(memopt::memory::mib(metrics->run_peak())));

  std::rewind(progress);
  std::string text;
  for (int c = std::fgetc(progress); c != EOF; c = std::fgetc(progress)) text += static_cast<char>(c);
  std::fclose(progress);
  INFO(text);
  CHECK(std::count(text.begin(), text.end(), '\n') == 4);  // 3 log lines and the skipped step's
  CHECK_THAT(text, Catch::Contains("step 3 skipped: loss inf") && Catch::Contains("weights and optimizer state left"));
  CHECK_THAT(text, Catch::Contains("step     4/6") && Catch::Contains("skipped 1 | ETA ") &&
                       Catch::Contains("| ETA 0s\n"));
}
