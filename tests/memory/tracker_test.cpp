// Tests for memopt/memory/tracker.hpp, report.hpp and allocator.hpp: exact byte counts of
// a known allocation, per-phase peaks from the Trainer, the measured effect of
// checkpointing, and the allocator settings string (MEMOPT_ALLOC_CONF).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>

#include <memopt/memopt.hpp>
#include <memopt/plot.hpp>

#include "support.hpp"

namespace {

// Peak tracked bytes of one forward+backward of an 8-block model under a checkpoint policy.
template <class Checkpoint>
int64_t peak_of_step(memopt::models::Llama& model, const memopt::Batch& batch) {
  auto& tracker = memopt::memory::Tracker::instance();
  for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
  tracker.reset_peaks();
  const int64_t before = tracker.live_bytes();
  (model->loss_sum(batch, Checkpoint{}) / batch.num_targets()).backward();
  return tracker.peak_bytes() - before;
}

// A 2-block LLaMA over 128 tokens and its random (4, 32) batches: the Trainer tests' model.
memopt::models::Llama tiny_llama() {
  return memopt::models::Llama(memopt::models::LlamaConfig()
                                   .vocab_size(128)
                                   .hidden_size(32)
                                   .num_hidden_layers(2)
                                   .num_attention_heads(4)
                                   .max_position_embeddings(64));
}
struct TinyLoader {
  memopt::Batch next() {
    auto t = torch::randint(128, {4, 33});
    return {t.slice(1, 0, 32), t.slice(1, 1, 33)};
  }
};

}  // namespace

TEST_CASE("the tracker is installed by the test runner and counts a known allocation exactly", "[memory]") {
  auto& tracker = memopt::memory::Tracker::instance();
  REQUIRE(tracker.installed());
  const int64_t live = tracker.live_bytes();
  const int64_t allocs = tracker.snapshot().allocations;
  {
    auto t = torch::empty({1000, 250}, torch::kFloat);  // 1,000,000 bytes
    CHECK(tracker.live_bytes() - live == 1000000);
    CHECK(tracker.snapshot().allocations - allocs == 1);
    auto u = torch::empty({3, 7}, torch::kDouble);  // 168 bytes
    CHECK(tracker.live_bytes() - live == 1000168);
    CHECK(tracker.peak_bytes() >= live + 1000168);
  }
  CHECK(tracker.live_bytes() == live);
  CHECK(tracker.snapshot().frees - tracker.snapshot().allocations <= 0);
}

TEST_CASE("reset_peaks starts a new window and phases keep their own peaks", "[memory]") {
  using memopt::memory::Phase;
  auto& tracker = memopt::memory::Tracker::instance();
  tracker.reset_peaks();
  const int64_t base = tracker.live_bytes();
  CHECK(tracker.peak_bytes() == base);
  {
    memopt::memory::PhaseScope fwd(Phase::kForward);
    auto a = torch::empty({1 << 20}, torch::kByte);  // 1 MiB in forward
  }
  {
    memopt::memory::PhaseScope bwd(Phase::kBackward);
    auto b = torch::empty({3 << 20}, torch::kByte);  // 3 MiB in backward
  }
  const auto snap = tracker.snapshot();
  CHECK(snap.phase_peak_bytes[static_cast<int>(Phase::kForward)] == base + (1 << 20));
  CHECK(snap.phase_peak_bytes[static_cast<int>(Phase::kBackward)] == base + (3 << 20));
  CHECK(snap.peak_bytes == base + (3 << 20));
  CHECK(tracker.phase() == Phase::kIdle);
}

TEST_CASE("the Trainer reports per-phase peaks and the report prints them", "[memory][trainer]") {
  torch::manual_seed(0);
  memopt::models::Llama model = tiny_llama();
  TinyLoader loader;
  memopt::Trainer<> trainer(*model, memopt::TrainerOptions().max_steps(2).log_interval(1));
  memopt::memory::Tracker::instance().reset_peaks();
  auto result = trainer.fit(loader, [&](const memopt::Batch& b, const auto& c) { return model->loss_sum(b, c); });
  const auto& s = result.memory.tensors;
  using memopt::memory::Phase;
  const int64_t fwd = s.phase_peak_bytes[static_cast<int>(Phase::kForward)];
  const int64_t bwd = s.phase_peak_bytes[static_cast<int>(Phase::kBackward)];
  const int64_t opt = s.phase_peak_bytes[static_cast<int>(Phase::kOptimizer)];
  CHECK(fwd > 0);
  CHECK(bwd > 0);
  CHECK(opt > 0);
  CHECK(s.peak_bytes == std::max({fwd, bwd, opt, s.phase_peak_bytes[0]}));
  CHECK(result.memory.peak_rss_bytes >= result.memory.rss_bytes);
  CHECK(result.memory.rss_bytes > 0);
  const std::string table = result.memory.table();
  CHECK_THAT(table, Catch::Contains("peak in forward") && Catch::Contains("peak in backward") &&
                        Catch::Contains("peak in optimizer") && Catch::Contains("RSS peak"));
}

TEST_CASE("checkpointing lowers the measured peak of an 8-block model at least 2x", "[memory][checkpoint]") {
  torch::manual_seed(0);
  memopt::models::Llama model(memopt::models::LlamaConfig()
                                  .vocab_size(256)
                                  .hidden_size(128)
                                  .num_hidden_layers(8)
                                  .num_attention_heads(4)
                                  .max_position_embeddings(256));
  auto tokens = torch::randint(256, {4, 257});
  const memopt::Batch batch{tokens.slice(1, 0, 256), tokens.slice(1, 1, 257)};
  const int64_t plain = peak_of_step<memopt::checkpoint::None>(model, batch);
  const int64_t every = peak_of_step<memopt::checkpoint::EveryBlock>(model, batch);
  const int64_t nth = peak_of_step<memopt::checkpoint::EveryNth<2>>(model, batch);
  const int64_t selective = peak_of_step<memopt::checkpoint::Selective>(model, batch);
  INFO("peak above the model: none " << plain << " B, every block " << every << " B, every 2nd " << nth
                                     << " B, selective " << selective << " B");
  CHECK(plain >= 2 * every);
  CHECK(nth < plain);
  CHECK(nth > every);
  // Selective drops the (T, T) scores and probabilities and the norm/SwiGLU temporaries,
  // keeps the matmul outputs: between the two, and at least 1.5x below None at T = 256.
  CHECK(selective * 3 <= plain * 2);
  CHECK(selective > every);
}

TEST_CASE("allocator settings: parsed with units, applied by mallopt, bad input named", "[memory][allocator]") {
  using memopt::memory::AllocatorOptions;
  const auto o = AllocatorOptions::parse(" arena_max:2, trim_threshold:64MB,mmap_threshold:512kb ,top_pad:0,"
                                         "expandable_segments:True,max_split_size_mb:128");
  CHECK(o.arena_max() == 2);
  CHECK(o.trim_threshold() == (int64_t{64} << 20));
  CHECK(o.mmap_threshold() == (int64_t{512} << 10));
  CHECK(o.top_pad() == 0);
  CHECK(o.cuda() == "expandable_segments:True,max_split_size_mb:128");  // passed through to CUDA's allocator
  CHECK_NOTHROW(o.apply());
  CHECK(AllocatorOptions::parse("").empty());
  CHECK_NOTHROW(AllocatorOptions().apply());  // nothing set: glibc's defaults stay
  // memopt's default for training: every block from the heap, 1 GB kept at its top; the other keys override it.
  const auto training = AllocatorOptions::parse("preset:training,trim_threshold:256MB,arena_max:2");
  CHECK(training.mmap_max() == 0);
  CHECK(training.trim_threshold() == (int64_t{256} << 20));
  CHECK(training.arena_max() == 2);
  CHECK(AllocatorOptions::parse("preset:glibc").empty());
  const char* env = std::getenv("MEMOPT_ALLOC_CONF");
  const std::string saved = env ? env : "";
  ::unsetenv("MEMOPT_ALLOC_CONF");
  CHECK(AllocatorOptions::from_env().mmap_max() == 0);  // unset: the training preset
  CHECK(AllocatorOptions::from_env().trim_threshold() == (int64_t{1} << 30));
  ::setenv("MEMOPT_ALLOC_CONF", "preset:glibc", 1);
  CHECK(AllocatorOptions::from_env().empty());
  if (env) ::setenv("MEMOPT_ALLOC_CONF", saved.c_str(), 1);
  else ::unsetenv("MEMOPT_ALLOC_CONF");

  using memopt::test::require_error;
  const std::string prefix = "memopt::memory::AllocatorOptions: MEMOPT_ALLOC_CONF";
  require_error([] { AllocatorOptions::parse("arena_max:2,max_arenas:4"); }, prefix,
                {"unknown key 'max_arenas'", "arena_max, trim_threshold"});
  require_error([] { AllocatorOptions::parse("trim_threshold:lots"); }, prefix, {"trim_threshold", "(got 'lots')"});
  require_error([] { AllocatorOptions::parse("arena_max:2MB"); }, prefix, {"arena_max", "integer", "(got '2MB')"});
  require_error([] { AllocatorOptions::parse("mmap_threshold:64MB"); }, prefix, {"at most 32MB", "(got 64MB)"});
  require_error([] { AllocatorOptions::parse("arena_max"); }, prefix, {"'arena_max' has no value"});
  require_error([] { AllocatorOptions::parse("arena_max:0"); }, prefix, {"arena_max must be >= 1 (got 0)"});
  require_error([] { AllocatorOptions::parse("preset:fast"); }, prefix, {"preset must be training or glibc (got 'fast')"});
  require_error([] { AllocatorOptions::parse("mmap_max:-1"); }, prefix, {"mmap_max", "(got '-1')"});
  // memopt::init(RuntimeOptions().alloc_conf(...)) names its option (the process's setting, never a Trainer's).
  require_error([] { AllocatorOptions::parse("arena:1", "RuntimeOptions::alloc_conf"); },
                "memopt::memory::AllocatorOptions: RuntimeOptions::alloc_conf", {"unknown key 'arena'"});
}

TEST_CASE("the timeline records allocations, frees and phases; the Chrome trace is ordered JSON", "[memory][timeline]") {
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

// ---- callbacks.hpp: ProgressBar, JsonlMetrics and the LogLine the Trainer fills; plot.hpp ----

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
  memopt::Trainer<memopt::checkpoint::None, memopt::precision::Scaled<c10::kFloat>> trainer(
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

TEST_CASE("plot_metrics draws a PNG, and says what is wrong with bad input", "[callbacks][plot]") {
  memopt::test::TempDir dir;
  const std::string empty = dir.file("empty.jsonl");
  std::ofstream(empty) << R"({"event":"summary","steps":3})" << "\n";
  auto require_plot_error = [](const std::function<void()>& fn, const std::string& part) {
    try {
      fn();
      FAIL("expected an error mentioning " << part);
    } catch (const std::runtime_error& e) {
      CHECK_THAT(e.what(), Catch::Contains("memopt::plot_metrics") && Catch::Contains(part) &&
                               Catch::Contains("HINT: "));
    }
  };
  require_plot_error([&] { memopt::plot_metrics(dir.file("missing.jsonl"), dir.file("a.png")); }, "cannot read");
  require_plot_error([&] { memopt::plot_metrics(empty, dir.file("a.png")); }, "no \"train\" line");
  if (!memopt::gnuplot_available()) {
    WARN("gnuplot is not installed: plot_metrics' drawing is not tested. HINT: apt-get install gnuplot-nox");
    return;
  }
  const std::string jsonl = dir.file("metrics.jsonl");
  {
    std::ofstream out(jsonl);
    out << R"({"event":"start"})" << "\n";
    for (int step = 1; step <= 4; ++step)
      out << nlohmann::json{{"event", "train"}, {"step", step}, {"loss", 5.0 / step}, {"tracked_mib", 10 + step},
                            {"peak_mib", 20}, {"rss_mib", 100 + step}}.dump()
          << "\n";
    out << R"({"event":"train","step":5,"lo)" << "\n";  // cut by a crash: skipped
  }
  const auto summary = memopt::plot_metrics(jsonl, dir.file("metrics.png"));
  CHECK(summary.points == 4);
  CHECK(summary.first_step == 1);
  CHECK(summary.last_step == 4);
  std::ifstream png(dir.file("metrics.png"), std::ios::binary);
  char magic[8] = {};
  png.read(magic, 8);
  CHECK(std::string(magic, 8) == std::string("\x89PNG\r\n\x1a\n", 8));
}
