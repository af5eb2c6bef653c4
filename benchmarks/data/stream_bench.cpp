// benchmarks/data/stream_bench.cpp — memopt::data::StreamLoader against loading a corpus
// whole, one mode per process (so each peak RSS is its own), one JSON line on stdout:
//   generate   a text corpus of --bytes bytes from data/kjv/train.txt's lines, their order
//              shuffled per pass (seeded), so it is not one block repeated; no tokenization
//   stream     StreamLoader (B 8, T 256, shuffle buffer 1000, one epoch) to the end of the
//              file (or --max_tokens): tokens/s, and RSS growth over the RSS before the loader
//   load_all   the seed's way: every document in memory, all tokenized into one id vector,
//              then int64 (N, T) input and target tensors of every window (--layout tensors,
//              as the seed's loader and estimate_memory_usage's full_load_bytes) or memopt's
//              in-memory TokenShard + RandomWindowLoader (--layout shard); batches drawn to
//              the end
//
//   memopt_bench_data --mode generate --bytes 268435456 --out build-release/bench-data/kjv-256MiB.txt
//   memopt_bench_data --mode stream --data build-release/bench-data/kjv-256MiB.txt \
//       --tokenizer data/kjv/tokenizer.model --workers 2
//   scripts/bench data               # the suite: corpora, runs, the trainer's rate, ratio lines
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "bench_main.hpp"
#include "memopt/data/loader.hpp"
#include "memopt/data/shard.hpp"
#include "memopt/data/stream.hpp"
#include "memopt/data/tokenizer.hpp"
#include "memopt/memopt.hpp"

namespace {

/// What one process measures (the command line).
struct BenchConfig {
  std::string mode = "stream";
  // generate
  int64_t bytes = int64_t{256} << 20;
  std::string out;
  std::string source = "data/kjv/train.txt";
  uint64_t seed = 1234;
  // stream, load_all
  std::string data;
  std::string tokenizer = "data/kjv/tokenizer.model";
  int64_t workers = 2;
  int64_t max_tokens = 0;  // 0: the whole corpus
  int64_t batch = 8;
  int64_t seq = 256;
  int64_t shuffle_buffer = 1000;
  std::string layout = "tensors";
};

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double rss_mib() { return memopt::memory::mib(memopt::memory::current_rss_bytes()); }
double peak_rss_mib() { return memopt::memory::mib(memopt::memory::peak_rss_bytes()); }
double tracked_peak_mib() { return memopt::memory::mib(memopt::memory::Tracker::instance().peak_bytes()); }

/// What stream and load_all both measure, from the moment they start (RSS noted, peaks reset,
/// the clock started) through each batch taken to the JSON keys they share.
class Consumption {
 public:
  Consumption() : rss_before_(rss_mib()) {
    memopt::memory::reset_peak_rss();
    memopt::memory::Tracker::instance().reset_peaks();
    start_ = Clock::now();
  }
  void take(const memopt::Batch& batch) {  // inputs, targets: (B, T) int64
    checksum_ += batch.targets.index({0, 0}).item<int64_t>();
    if (batches_++ == 0) first_batch_s_ = seconds_since(start_);
    tokens_ += batch.targets.numel();
  }
  int64_t tokens() const { return tokens_; }
  /// seconds, tokens, batches, tokens/s, time to the first batch, RSS before / peak / growth, checksum.
  nlohmann::ordered_json fields() const {
    const double seconds = seconds_since(start_), peak = peak_rss_mib();
    return {{"tokens", tokens_},
            {"batches", batches_},
            {"seconds", seconds},
            {"tokens_per_s", static_cast<double>(tokens_) / seconds},
            {"time_to_first_batch_s", first_batch_s_},
            {"rss_before_mib", rss_before_},
            {"peak_rss_mib", peak},
            {"rss_growth_mib", peak - rss_before_},
            {"checksum", checksum_}};
  }

 private:
  double rss_before_;
  Clock::time_point start_;
  int64_t tokens_ = 0, batches_ = 0, checksum_ = 0;
  double first_batch_s_ = 0;
};

// ---- generate ----

/// Writes exactly cfg.bytes bytes: passes over the source's non-blank lines, each pass in a
/// new seeded order, the last line cut short (and ended by '\n').
nlohmann::ordered_json generate(const BenchConfig& cfg) {
  TORCH_CHECK(!cfg.out.empty(), "memopt_bench_data: --mode generate needs --out FILE. HINT: e.g. --out "
              "build-release/bench-data/kjv-256MiB.txt");
  TORCH_CHECK(cfg.bytes >= 2, "memopt_bench_data: --bytes must be >= 2 (got ", cfg.bytes, "). HINT: 268435456 is 0.25 GiB");
  const auto start = Clock::now();
  std::ifstream in(cfg.source);
  TORCH_CHECK(in.good(), "memopt_bench_data: cannot read '", cfg.source, "'. HINT: scripts/fetch_corpus, then "
              "memopt_prepare_corpus (or scripts/demo) write data/kjv/train.txt");
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) lines.push_back(std::move(line));
  }
  TORCH_CHECK(!lines.empty(), "memopt_bench_data: '", cfg.source, "' has no non-blank line. HINT: pass a text file "
              "with one document a line");
  const auto out_path = std::filesystem::path(cfg.out);
  if (out_path.has_parent_path()) std::filesystem::create_directories(out_path.parent_path());
  const std::string tmp = cfg.out + ".tmp";
  std::FILE* out = std::fopen(tmp.c_str(), "wb");
  TORCH_CHECK(out != nullptr, "memopt_bench_data: cannot write '", tmp, "'. HINT: check the folder");
  std::vector<char> buffer(size_t{4} << 20);
  std::setvbuf(out, buffer.data(), _IOFBF, buffer.size());

  std::vector<size_t> order(lines.size());
  int64_t left = cfg.bytes, passes = 0;
  while (left > 0) {
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::mt19937_64 rng(cfg.seed ^ (0x9E3779B97F4A7C15ULL * static_cast<uint64_t>(passes + 1)));
    std::shuffle(order.begin(), order.end(), rng);
    ++passes;
    for (size_t i = 0; i < order.size() && left > 0; ++i) {
      const std::string& line = lines[order[i]];
      const int64_t take = std::min<int64_t>(static_cast<int64_t>(line.size()), left - 1);  // '\n' always fits
      std::fwrite(line.data(), 1, static_cast<size_t>(take), out);
      std::fputc('\n', out);
      left -= take + 1;
    }
  }
  TORCH_CHECK(std::fclose(out) == 0, "memopt_bench_data: writing '", tmp, "' failed. HINT: check the free disk space");
  std::filesystem::rename(tmp, cfg.out);
  return nlohmann::ordered_json{{"suite", "data"},
                                {"name", "generate"},
                                {"impl", "generate"},
                                {"corpus_bytes", static_cast<int64_t>(std::filesystem::file_size(cfg.out))},
                                {"passes", passes},
                                {"seconds", seconds_since(start)},
                                {"out", cfg.out}};
}

// ---- stream ----

/// The tokenizer, and torch's lazy start-up (allocator, intra-op pool) done with one tensor
/// of a batch's shape, so rss_before holds what a training process has before its loader.
std::shared_ptr<const memopt::data::Tokenizer> load_tokenizer(const BenchConfig& cfg) {
  auto tokenizer = std::make_shared<const memopt::data::Tokenizer>(cfg.tokenizer);
  torch::Tensor warm = torch::full({cfg.batch, cfg.seq}, 1, torch::kLong);  // (B, T)
  (void)warm.sum().item<int64_t>();
  return tokenizer;
}

int64_t corpus_bytes(const std::string& path) {
  TORCH_CHECK(std::filesystem::exists(path), "memopt_bench_data: --data '", path, "' does not exist. HINT: make it "
              "with --mode generate");
  return static_cast<int64_t>(std::filesystem::file_size(path));
}

/// The JSON line's common head.
nlohmann::ordered_json head(const BenchConfig& cfg, const std::string& impl, int64_t bytes) {
  const double gib = static_cast<double>(bytes) / static_cast<double>(int64_t{1} << 30);
  char size[32];
  std::snprintf(size, sizeof(size), "%.3gGiB", gib);
  std::string name = "data-" + std::string(size);
  if (impl == "stream") name += "-w" + std::to_string(cfg.workers);
  if (impl == "load_all") name += "-" + cfg.layout;
  if (cfg.max_tokens > 0) name += "-cap" + std::to_string(cfg.max_tokens / 1000000) + "M";
  return {{"suite", "data"}, {"name", name}, {"impl", impl}, {"corpus_bytes", bytes}, {"corpus_gib", gib}};
}

nlohmann::ordered_json stream(const BenchConfig& cfg) {
  const int64_t bytes = corpus_bytes(cfg.data);
  auto tokenizer = load_tokenizer(cfg);
  Consumption run;
  auto options = memopt::data::StreamOptions(cfg.batch, cfg.seq)
                     .shuffle_buffer(cfg.shuffle_buffer)
                     .workers(cfg.workers)
                     .seed(cfg.seed)
                     .source(memopt::data::SourceOptions().epochs(1));
  memopt::data::StreamLoader loader({cfg.data}, tokenizer, options);
  std::vector<double> trace;  // current RSS (MiB) as each tenth of the corpus (or of --max_tokens) is passed
  while ((cfg.max_tokens == 0 || run.tokens() < cfg.max_tokens) && loader.has_next()) {
    run.take(loader.next());
    const int64_t tokens = run.tokens();
    const auto& at = loader.position();
    const double read = at.epoch >= 1 ? 1.0 : static_cast<double>(at.offset) / static_cast<double>(bytes);
    const double done = cfg.max_tokens > 0 ? static_cast<double>(tokens) / static_cast<double>(cfg.max_tokens) : read;
    while (trace.size() < 10 && done >= 0.1 * static_cast<double>(trace.size() + 1)) trace.push_back(rss_mib());
  }
  const int64_t tokens = run.tokens();
  const bool complete = tokens > 0 && !loader.has_next();
  auto line = head(cfg, "stream", bytes);
  line.update(run.fields());
  line.update(nlohmann::ordered_json{
      {"workers", cfg.workers},
      {"complete", complete},  // streamed to the end of the corpus
      {"bytes_per_token", complete ? nlohmann::ordered_json(static_cast<double>(bytes) / static_cast<double>(tokens))
                                   : nlohmann::ordered_json(nullptr)},  // capped: the reader ran ahead
      {"rss_end_mib", rss_mib()},
      {"rss_trace_mib", trace},
      {"peak_tracked_mib", tracked_peak_mib()},  // tensors only: the batches
      {"batch", cfg.batch},
      {"seq", cfg.seq},
      {"shuffle_buffer", cfg.shuffle_buffer},
      {"max_tokens", cfg.max_tokens},
  });
  return line;
}

// ---- load_all ----

nlohmann::ordered_json load_all(const BenchConfig& cfg) {
  TORCH_CHECK(cfg.layout == "tensors" || cfg.layout == "shard", "memopt_bench_data: --layout must be tensors or shard "
              "(got '", cfg.layout, "'). HINT: tensors is the seed's loader");
  const int64_t bytes = corpus_bytes(cfg.data);
  auto tokenizer = load_tokenizer(cfg);
  Consumption run;
  const int64_t B = cfg.batch, T = cfg.seq;
  const auto eos = static_cast<int32_t>(tokenizer->eos_id());

  // ---- every document in memory, then every id in one vector ----
  std::vector<int32_t> ids;
  {
    std::vector<std::string> documents;
    std::ifstream in(cfg.data);
    for (std::string line; std::getline(in, line);) {
      if (!line.empty()) documents.push_back(std::move(line));
    }
    for (const auto& doc : documents) {
      const std::vector<int32_t> doc_ids = tokenizer->encode(doc);
      ids.insert(ids.end(), doc_ids.begin(), doc_ids.end());
      ids.push_back(eos);
      if (cfg.max_tokens > 0 && static_cast<int64_t>(ids.size()) > cfg.max_tokens) break;
    }
  }  // the text is freed here: the peak is the larger of text + ids and ids + windows
  const int64_t num_ids = static_cast<int64_t>(ids.size());
  const double rss_loaded = rss_mib();

  // ---- windows, then batches to the end of an epoch ----
  const int64_t num_windows = (num_ids - 1) / T;
  const int64_t num_batches = num_windows / B;
  if (cfg.layout == "tensors") {
    torch::Tensor inputs = torch::empty({num_windows, T}, torch::kLong);   // (N, T)
    torch::Tensor targets = torch::empty({num_windows, T}, torch::kLong);  // (N, T)
    int64_t* in = inputs.data_ptr<int64_t>();
    int64_t* tg = targets.data_ptr<int64_t>();
    for (int64_t i = 0; i < num_windows * T; ++i) {
      in[i] = ids[static_cast<size_t>(i)];
      tg[i] = ids[static_cast<size_t>(i + 1)];
    }
    ids = {};  // a loader holding the tensors need not keep the ids
    const torch::Tensor order = torch::randperm(num_windows, torch::kLong);  // (N,)
    for (int64_t b = 0; b < num_batches; ++b) {
      const torch::Tensor rows = order.slice(0, b * B, (b + 1) * B);  // (B,)
      run.take({inputs.index_select(0, rows), targets.index_select(0, rows)});  // (B, T) each
    }
  } else {
    auto shard = memopt::data::TokenShard::from_tokens(cfg.data, ids, tokenizer->vocab_size());
    ids = {};
    memopt::data::RandomWindowLoader loader(shard, memopt::data::LoaderOptions(B, T).seed(cfg.seed));
    for (int64_t b = 0; b < num_batches; ++b) run.take(loader.next());
  }
  auto line = head(cfg, "load_all", bytes);
  line.update(run.fields());
  line.update(nlohmann::ordered_json{
      {"layout", cfg.layout == "tensors" ? "int64 (N, T) input and target tensors of every window (the seed's)"
                                         : "TokenShard::from_tokens + RandomWindowLoader"},
      {"workers", 0},
      {"corpus_tokens", num_ids},
      {"complete", cfg.max_tokens == 0},
      {"bytes_per_token", static_cast<double>(bytes) / static_cast<double>(std::max<int64_t>(num_ids, 1))},
      {"rss_loaded_mib", rss_loaded},  // after tokenizing, the text freed
      {"peak_tracked_mib", tracked_peak_mib()},  // tensors only: the windows (tensors layout) and batches
      {"batch", B},
      {"seq", T},
      {"max_tokens", cfg.max_tokens},
  });
  return line;
}

}  // namespace

int main(int argc, char** argv) {
  BenchConfig cfg;
  CLI::App app{"memopt_bench_data: StreamLoader against loading the corpus whole, one mode per run, one JSON line"};
  app.add_option("--mode", cfg.mode, "generate | stream | load_all")
      ->check(CLI::IsMember({"generate", "stream", "load_all"}));
  app.add_option("--bytes", cfg.bytes, "generate: corpus size in bytes")->check(CLI::PositiveNumber);
  app.add_option("--out", cfg.out, "generate: the corpus file to write");
  app.add_option("--source", cfg.source, "generate: the text whose lines are cycled");
  app.add_option("--seed", cfg.seed, "line order (generate), shuffle buffer (stream), window order (load_all)");
  app.add_option("--data", cfg.data, "stream, load_all: the corpus (text, one document a line)");
  app.add_option("--tokenizer", cfg.tokenizer, "stream, load_all: the SentencePiece model");
  app.add_option("--workers", cfg.workers, "stream: tokenizer threads (0: inline in next())")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--max_tokens", cfg.max_tokens, "stop after this many tokens (0: the whole corpus)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--batch", cfg.batch, "B")->check(CLI::PositiveNumber);
  app.add_option("--seq", cfg.seq, "T")->check(CLI::PositiveNumber);
  app.add_option("--shuffle_buffer", cfg.shuffle_buffer, "stream: rows in the shuffle buffer")->check(CLI::PositiveNumber);
  app.add_option("--layout", cfg.layout, "load_all: tensors (the seed's) | shard")
      ->check(CLI::IsMember({"tensors", "shard"}));
  CLI11_PARSE(app, argc, argv);
  // memopt::init as a training process runs it: the tracker, preset:training malloc settings, threads.
  memopt::init();

  return memopt::bench::print_line([&] {
    TORCH_CHECK(cfg.mode == "generate" || !cfg.data.empty(), "memopt_bench_data: --mode ", cfg.mode,
                " needs --data FILE. HINT: make a corpus with --mode generate --bytes N --out FILE");
    if (cfg.mode == "generate") return generate(cfg);
    if (cfg.mode == "stream") return stream(cfg);
    return load_all(cfg);
  });
}
