// benchmarks/io/load_bench.cpp — memopt::io::load_pretrained of a HF checkpoint folder (one
// process per load, so the peak RSS is the load's own), one JSON line on stdout: wall time of
// the call (load_s) and of the call plus one read of every weight on one thread (ready_s), the
// growth of the peak RSS over the RSS just before the call at both points (the peak reset
// first, /proc/self/clear_refs), the peak of tracked tensor bytes, and the checkpoint's bytes
// (every .safetensors file of the folder, headers included). Then, apart from the load, the time to
// build and randomly initialize the same model in the same dtype (init_s): the part of load_s
// that writes weights the file then overwrites. benchmarks/peer/load_peer.py measures
// transformers' from_pretrained the same way, with the same keys.
//
//   memopt_bench_load --dir build-release/bench-load/llama-134m --dtype bf16
//   scripts/bench load        # the suite: a transformers checkpoint, memopt and transformers loads, ratios
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <string>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "bench_main.hpp"
#include "memopt/io/pretrained.hpp"
#include "memopt/memory/rss.hpp"
#include "memopt/memory/tracker.hpp"
#include "memopt/memopt.hpp"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

/// The bytes of every .safetensors file in `dir`, and how many there are.
std::pair<int64_t, int64_t> checkpoint_bytes(const std::string& dir) {
  int64_t bytes = 0, files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() != ".safetensors") continue;
    bytes += static_cast<int64_t>(entry.file_size());
    ++files;
  }
  return {bytes, files};
}

torch::Dtype parse_dtype(const std::string& name) {
  if (name == "bf16") return torch::kBFloat16;
  if (name == "fp16") return torch::kFloat16;
  return torch::kFloat32;
}

nlohmann::ordered_json measure(const std::string& dir, const std::string& dtype_name) {
  const torch::Dtype dtype = parse_dtype(dtype_name);
  const auto [ckpt_bytes, files] = checkpoint_bytes(dir);
  TORCH_CHECK(files > 0, "memopt_bench_load: '", dir, "' holds no .safetensors file. HINT: scripts/bench load "
              "writes one with benchmarks/io/load_peer.py generate");
  auto& tracker = memopt::memory::Tracker::instance();

  // ---- the load: RSS and tracked bytes from here ----
  memopt::memory::reset_peak_rss();
  tracker.reset_peaks();
  const int64_t rss_before = memopt::memory::current_rss_bytes();
  const int64_t tracked_before = tracker.live_bytes();
  const auto start = Clock::now();
  memopt::models::Llama model = memopt::io::load_pretrained(dir, memopt::io::LoadPretrainedOptions().dtype(dtype));
  const double load_s = seconds_since(start);
  const int64_t peak_growth = memopt::memory::peak_rss_bytes() - rss_before;
  const int64_t rss_growth = memopt::memory::current_rss_bytes() - rss_before;
  const int64_t peak_tracked = tracker.peak_bytes() - tracked_before;

  // ---- every weight read once: transformers 5 returns weights still mapped from the file, read
  // (and made resident) on first use, so its load is compared at this point too. One thread: a
  // parallel region per tensor costs milliseconds each on a busy machine, whichever library ----
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  double checksum = 0;
  {
    torch::NoGradGuard no_grad;
    for (const auto& p : model->parameters()) checksum += p.sum().item<double>();
  }
  at::set_num_threads(threads);
  const double ready_s = seconds_since(start);
  const int64_t ready_peak_growth = memopt::memory::peak_rss_bytes() - rss_before;

  int64_t params = 0, param_bytes = 0;
  for (const auto& p : model->parameters()) {
    TORCH_CHECK(p.scalar_type() == dtype, "memopt_bench_load: a parameter is ", p.scalar_type(), ", not ", dtype,
                ". HINT: load_pretrained must build the model in the dtype asked for");
    params += p.numel();
    param_bytes += static_cast<int64_t>(p.nbytes());
  }

  // ---- apart from the load: building and initializing the same model in the same dtype ----
  const auto build_start = Clock::now();
  {
    memopt::io::detail::DefaultDtypeGuard in_dtype(dtype);
    memopt::models::Llama fresh(model->config);
  }
  const double init_s = seconds_since(build_start);

  return nlohmann::ordered_json{
      {"suite", "load"},
      {"name", std::filesystem::path(dir).filename().string()},
      {"impl", "memopt"},
      {"dtype", dtype_name},
      {"params", params},
      {"param_bytes", param_bytes},
      {"ckpt_bytes", ckpt_bytes},
      {"ckpt_files", files},
      {"load_s", load_s},
      {"ready_s", ready_s},
      {"rss_before_bytes", rss_before},
      {"load_peak_rss_growth_bytes", peak_growth},
      {"load_rss_growth_bytes", rss_growth},
      {"ready_peak_rss_growth_bytes", ready_peak_growth},
      {"peak_to_ckpt", static_cast<double>(ready_peak_growth) / static_cast<double>(ckpt_bytes)},
      {"peak_tracked_bytes", peak_tracked},
      {"checksum", checksum},
      {"init_s", init_s},
      {"threads", threads},
  };
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir, dtype = "bf16";
  CLI::App app{"memopt_bench_load: load_pretrained of a HF checkpoint folder, one JSON line"};
  app.add_option("--dir", dir, "the checkpoint folder (config.json, model.safetensors or shards)")->required();
  app.add_option("--dtype", dtype, "the model's dtype")->check(CLI::IsMember({"bf16", "fp16", "fp32"}));
  CLI11_PARSE(app, argc, argv);
  memopt::init();  // as a program's first line: the tracker (exact tensor bytes), threads, allocator settings
  return memopt::bench::print_line([&] { return measure(dir, dtype); });
}
