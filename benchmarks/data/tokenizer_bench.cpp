// benchmarks/data/tokenizer_bench.cpp — memopt::data::Tokenizer's encode speed on a text file,
// one document a line, one JSON line on stdout: MB/s (input bytes over encode time, reading the
// file excluded), the token count and a checksum of the ids (the suite compares them with HF
// tokenizers' on the same file, so a fast but wrong tokenizer cannot pass).
//   memopt_bench_tokenizer --tokenizer build-release/bench-data/tok/llama3 --text corpus.txt --threads 2
//   scripts/bench tokenizer          # the suite: memopt next to HF tokenizers, 1 and 2 threads
#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "bench_main.hpp"
#include "memopt/data/tokenizer.hpp"

int main(int argc, char** argv) {
  std::string tokenizer, text;
  int64_t threads = 1;
  CLI::App app{"memopt_bench_tokenizer: encode speed of memopt::data::Tokenizer, one JSON line"};
  app.add_option("--tokenizer", tokenizer, "tokenizer.json, .model, or a folder holding one")->required();
  app.add_option("--text", text, "a UTF-8 text file, one document a line")->required();
  app.add_option("--threads", threads, "encoding threads (lines dealt round-robin)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  return memopt::bench::print_line([&] {
    const memopt::data::Tokenizer tok(tokenizer);
    std::ifstream in(text, std::ios::binary);
    TORCH_CHECK(in.good(), "memopt_bench_tokenizer: cannot read '", text, "'. HINT: pass an existing text file");
    std::vector<std::string> lines;
    for (std::string line; std::getline(in, line);) lines.push_back(std::move(line));
    const auto bytes = static_cast<int64_t>(std::filesystem::file_size(text));
    std::vector<uint64_t> tokens(static_cast<size_t>(threads)), checksum(static_cast<size_t>(threads));
    const auto start = std::chrono::steady_clock::now();
    std::vector<std::thread> pool;
    for (int64_t t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        for (size_t i = static_cast<size_t>(t); i < lines.size(); i += static_cast<size_t>(threads)) {
          for (const int32_t id : tok.encode(lines[i])) {
            ++tokens[static_cast<size_t>(t)];
            checksum[static_cast<size_t>(t)] += static_cast<uint64_t>(id) * 2654435761u;
          }
        }
      });
    }
    for (auto& thread : pool) thread.join();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    uint64_t total = 0, sum = 0;
    for (int64_t t = 0; t < threads; ++t) total += tokens[static_cast<size_t>(t)], sum += checksum[static_cast<size_t>(t)];
    return nlohmann::ordered_json{{"suite", "tokenizer"}, {"impl", "memopt"}, {"kind", tok.kind()},
                                  {"tokenizer", tokenizer}, {"threads", threads}, {"bytes", bytes},
                                  {"seconds", seconds}, {"mb_per_s", static_cast<double>(bytes) / seconds / 1e6},
                                  {"tokens", total}, {"checksum", sum % (uint64_t{1} << 53)}};
  });
}
