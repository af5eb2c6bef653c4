// benchmarks/nn/attention_bench.cpp — peak tracked memory and time of one forward +
// backward, one path per process (so each peak is that path's alone):
//   attention (B=1, H=8, D=64, causal, fp32 or --dtype bf16) on the math path (--impl math),
//   ATen's SDPA (--impl sdpa: LibTorch 2.x's CPU flash kernel, memory linear in L) or memopt's
//   blockwise path (--impl blockwise); or the LM head's loss with the full (N, V) logits
//   (--impl ce_full) or chunked and fused with the projection (--impl ce_chunked; with its
//   softmax as fused row kernels: ce_chunked_fused); or RMSNorm, SwiGLU's silu(g)·u and RoPE on
//   q and k, the residual dropout-add (p 0.1) and that add with the RMSNorm after it as ATen
//   composites (--impl rms_norm | swiglu | rope | dropout_add | add_rms_norm) or memopt's fused
//   kernels (--impl rms_norm_fused | swiglu_fused | rope_fused | dropout_add_fused |
//   add_rms_norm_fused; add_rms_norm_pair_fused: fused_dropout_add, then fused_rms_norm),
//   --dtype fp32 | bf16.
// Prints one JSON line; math prints a "skipped" line where it would need more than --max_gib.
//
//   memopt_bench_attention --impl blockwise --L 4096
//   memopt_bench_attention --impl ce_chunked --rows 4096 --vocab 32000
//   memopt_bench_attention --impl swiglu_fused --rows 2048 --ffn 1408
//   scripts/bench attention            # the whole suite, with blockwise/math and blockwise/sdpa ratios

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "bench_main.hpp"
#include "memopt/bf16_gemm.hpp"
#include "memopt/detail/version.hpp"
#include "memopt/memory/report.hpp"
#include "memopt/memory/tracker.hpp"
#include "memopt/nn/attention.hpp"
#include "memopt/nn/cross_entropy.hpp"
#include "memopt/nn/fused.hpp"
#include "memopt/nn/fused_add_norm.hpp"
#include "memopt/nn/fused_dropout.hpp"
#include "memopt/nn/nf4.hpp"
#include "memopt/nn/qlora.hpp"
#include "memopt/nn/rope.hpp"
#include "memopt/runtime.hpp"

namespace {

/// What one process benchmarks (the command line).
struct BenchConfig {
  std::string impl = "blockwise";
  int64_t L = 4096;  // sequence length
  int64_t batch = 1;
  int64_t heads = 8;
  int64_t head_dim = 64;
  bool bidirectional = false;
  int64_t q_block = memopt::nn::kAttentionQBlock;
  int64_t kv_block = memopt::nn::kAttentionKvBlock;
  int64_t rows = 4096;  // cross-entropy: N
  int64_t hidden = 512;  // cross-entropy: C
  int64_t vocab = 32000;  // cross-entropy: V
  int64_t chunk = memopt::nn::kCrossEntropyChunk;
  int64_t ffn = 1408;           // swiglu: F; nf4_linear: out features
  int64_t tile_kib = memopt::nn::kNf4TileBytes >> 10;  // nf4_linear_fused
  std::string dtype = "fp32";  // attention, rms_norm, swiglu
  int64_t steps = 3;
  int64_t warmup = 1;
  int threads = 0;  // 0: every CPU this process may run on
  double max_gib = 8.0;
  uint64_t seed = 1234;

  bool is_attention() const { return impl == "math" || impl == "sdpa" || impl == "blockwise" || impl == "flash"; }
  bool is_nf4() const { return impl.rfind("nf4_linear", 0) == 0; }
  bool is_linear() const { return impl == "linear" || impl == "linear_blocked"; }
  bool is_elementwise() const {
    return impl.rfind("rms_norm", 0) == 0 || impl.rfind("swiglu", 0) == 0 || impl.rfind("rope", 0) == 0 ||
           impl.rfind("dropout_add", 0) == 0 || impl.rfind("add_rms_norm", 0) == 0;
  }
};

// The math path's peak, in fp32 (B, H, L, L) tensors: measured 3.0 at L = 2048 and 4096
// (scores, probabilities, their gradients; one dies as the next is made). The skip rule
// for math and sdpa uses it with a little room.
constexpr double kMathScoreTensors = 3.5;

double mib(int64_t bytes) { return memopt::memory::mib(bytes); }

/// Times warmup + steps calls of `step`; the tracker's peak covers the timed steps only.
struct Timing {
  double ms = 0, ms_min = 0;
  int64_t peak_bytes = 0, live_before = 0;
};

Timing time_steps(const BenchConfig& cfg, const std::function<void()>& step) {
  auto& tracker = memopt::memory::Tracker::instance();
  for (int64_t s = 0; s < cfg.warmup; ++s) step();
  tracker.reset_peaks();
  Timing t;
  t.live_before = tracker.live_bytes();
  std::vector<double> ms;
  for (int64_t s = 0; s < cfg.steps; ++s) {
    const auto start = std::chrono::steady_clock::now();
    step();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    std::cerr << "  " << cfg.impl << " step " << s << ": " << ms.back() << " ms\n";
  }
  double total = 0;
  for (double m : ms) total += m;
  t.ms = total / static_cast<double>(ms.size());
  t.ms_min = *std::min_element(ms.begin(), ms.end());
  t.peak_bytes = tracker.peak_bytes();
  return t;
}

/// bf16 products as a bf16 Trainer runs them: widened to fp32 where that wins here (bf16_gemm);
/// "native" or "fp32" for the line.
const char* enable_bf16_gemm() {
  memopt::bf16_gemm::enable();
  return memopt::bf16_gemm::mode_name(memopt::bf16_gemm::mode());
}

nlohmann::ordered_json run_attention(const BenchConfig& cfg) {
  const int64_t B = cfg.batch, H = cfg.heads, T = cfg.L, D = cfg.head_dim;
  const bool causal = !cfg.bidirectional;
  nlohmann::ordered_json line{{"suite", "attention"}, {"name", "attention"}, {"impl", cfg.impl}, {"L", T},
                              {"dtype", cfg.dtype}};
  const double scores_bytes = static_cast<double>(B * H * T) * static_cast<double>(T) * 4.0;
  if (cfg.impl == "math" && kMathScoreTensors * scores_bytes > cfg.max_gib * 1024 * 1024 * 1024) {
    line["skipped"] = "needs ~" + std::to_string(static_cast<int>(kMathScoreTensors * scores_bytes / (1 << 30))) +
                      " GiB > --max_gib " + std::to_string(static_cast<int>(cfg.max_gib));
    return line;
  }
  torch::manual_seed(static_cast<int64_t>(cfg.seed));
  const auto dtype = cfg.dtype == "bf16" ? torch::kBFloat16 : torch::kFloat;
  if (dtype == torch::kBFloat16) line["bf16_gemm"] = enable_bf16_gemm();  // widens math's, blockwise's products
  auto q = torch::randn({B, H, T, D}).to(dtype).requires_grad_();  // (B, H, T, D)
  auto k = torch::randn({B, H, T, D}).to(dtype).requires_grad_();
  auto v = torch::randn({B, H, T, D}).to(dtype).requires_grad_();
  const auto grad_out = torch::randn({B, H, T, D}).to(dtype);
  const auto options =
      memopt::nn::BlockwiseAttentionOptions().causal(causal).q_block(cfg.q_block).kv_block(cfg.kv_block);
  auto step = [&] {
    for (auto* x : {&q, &k, &v}) x->mutable_grad() = torch::Tensor();
    torch::Tensor y;  // (B, H, T, D)
    if (cfg.impl == "blockwise") {
      y = memopt::nn::attention_blockwise(q, k, v, options);
    } else if (cfg.impl == "math") {
      y = memopt::nn::attention_math(q, k, v, causal, 0.0, /*training=*/true);
    } else if (cfg.impl == "flash") {
      y = memopt::nn::attention_flash(q, k, v, causal, 0.0, /*training=*/true);
    } else {
#if MEMOPT_TORCH_AT_LEAST(2, 0)
      y = at::scaled_dot_product_attention(q, k, v, {}, 0.0, causal);
#else
      y = std::get<0>(at::_scaled_dot_product_attention(q, k, v, {}, 0.0, false, causal));
#endif
    }
    y.backward(grad_out);
  };
  const auto t = time_steps(cfg, step);
  line["peak_tracked_mib"] = mib(t.peak_bytes);
  line["ms"] = t.ms;
  line["ms_min"] = t.ms_min;
  line["inputs_mib"] = mib(t.live_before);
  line["B"] = B;
  line["H"] = H;
  line["D"] = D;
  line["causal"] = causal;
  if (cfg.impl == "blockwise") {
    line["q_block"] = cfg.q_block;
    line["kv_block"] = cfg.kv_block;
  }
  return line;
}

nlohmann::ordered_json run_cross_entropy(const BenchConfig& cfg) {
  const int64_t N = cfg.rows, C = cfg.hidden, V = cfg.vocab;
  torch::manual_seed(static_cast<int64_t>(cfg.seed));
  auto hidden = torch::randn({N, C}).requires_grad_();         // (N, C)
  auto weight = (torch::randn({V, C}) * 0.02).requires_grad_();  // (V, C)
  const auto targets = torch::randint(V, {N});                  // (N)
  auto step = [&] {
    hidden.mutable_grad() = torch::Tensor();
    weight.mutable_grad() = torch::Tensor();
    torch::Tensor loss;
    if (cfg.impl.rfind("ce_chunked", 0) == 0) {
      loss = memopt::nn::chunked_cross_entropy_sum(
          hidden, weight, targets,
          memopt::nn::ChunkedCrossEntropyOptions().chunk_size(cfg.chunk).fused(cfg.impl == "ce_chunked_fused"));
    } else {
      loss = torch::nn::functional::cross_entropy(hidden.matmul(weight.t()), targets,
                                                  torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
    }
    loss.backward();
  };
  const auto t = time_steps(cfg, step);
  nlohmann::ordered_json line{{"suite", "attention"}, {"name", "cross_entropy"}, {"impl", cfg.impl}, {"N", N},
                              {"C", C}, {"V", V}};
  line["peak_tracked_mib"] = mib(t.peak_bytes);
  line["ms"] = t.ms;
  line["ms_min"] = t.ms_min;
  line["inputs_mib"] = mib(t.live_before);
  if (cfg.impl != "ce_full") line["chunk"] = cfg.chunk;
  return line;
}

// RMSNorm over (rows, C), silu(g)·u over (rows, F), RoPE on q and k (1, rows, heads,
// head_dim), x + dropout(r) over (rows, C), or that and RMSNorm after it: forward + backward,
// composite or fused.
nlohmann::ordered_json run_elementwise(const BenchConfig& cfg) {
  const bool pair = cfg.impl == "add_rms_norm_pair_fused";  // two fused nodes: dropout-add, then RMSNorm
  const std::string kernel = pair ? "add_rms_norm" : cfg.impl.substr(0, cfg.impl.find("_fused"));
  const bool fused = kernel != cfg.impl;
  const auto dtype = cfg.dtype == "bf16" ? torch::kBFloat16 : torch::kFloat;
  const auto rand = [&](std::vector<int64_t> shape) { return torch::randn(shape).to(dtype).requires_grad_(); };
  torch::manual_seed(static_cast<int64_t>(cfg.seed));
  torch::Tensor a, b;  // x and an fp32 weight (as in training); g and u; q and k; x and r
  const auto norm_weight = (torch::rand({cfg.hidden}) + 0.5).requires_grad_();  // add_rms_norm's (fp32)
  int64_t width = 0;
  if (kernel == "rms_norm") {
    width = cfg.hidden;
    a = rand({cfg.rows, width});
    b = (torch::rand({width}) + 0.5).requires_grad_();
  } else if (kernel == "swiglu" || kernel == "dropout_add" || kernel == "add_rms_norm") {
    width = kernel == "swiglu" ? cfg.ffn : cfg.hidden;
    a = rand({cfg.rows, width});
    b = rand({cfg.rows, width});
  } else {
    width = cfg.heads * cfg.head_dim;
    a = rand({1, cfg.rows, cfg.heads, cfg.head_dim});
    b = rand({1, cfg.rows, cfg.heads, cfg.head_dim});
  }
  const auto [cos, sin] = memopt::nn::rope_tables(cfg.rows, cfg.head_dim, 10000.0, torch::kCPU);  // (rows, D)
  const bool two_outputs = kernel == "rope" || kernel == "add_rms_norm";
  const auto grad_out = torch::randn({two_outputs ? 2 * cfg.rows * width : cfg.rows * width});
  auto step = [&] {
    a.mutable_grad() = torch::Tensor();
    b.mutable_grad() = torch::Tensor();
    norm_weight.mutable_grad() = torch::Tensor();
    torch::Tensor y;  // every output, flattened
    if (kernel == "rms_norm") {
      y = fused ? memopt::nn::fused_rms_norm(a, b, 1e-5) : memopt::nn::rms_norm_composite(a, b, 1e-5);
    } else if (kernel == "swiglu") {
      y = fused ? memopt::nn::fused_swiglu(a, b) : torch::silu(a) * b;
    } else if (kernel == "dropout_add") {  // the residual dropout of a LLaMA block, p 0.1
      y = fused ? memopt::nn::fused_dropout_add(a, b, 0.1, true) : a + torch::dropout(b, 0.1, true);
    } else if (kernel == "add_rms_norm") {  // a LLaMA block's middle: h = x + dropout(r), RMSNorm(h)
      std::pair<torch::Tensor, torch::Tensor> hy;
      if (pair) {
        auto h = memopt::nn::fused_dropout_add(a, b, 0.1, true);
        hy = {h, memopt::nn::fused_rms_norm(h, norm_weight, 1e-5)};
      } else {
        hy = fused ? memopt::nn::fused_add_rms_norm(a, b, norm_weight, 1e-5, 0.1, true)
                   : memopt::nn::add_rms_norm_composite(a, b, norm_weight, 1e-5, 0.1, true);
      }
      y = torch::cat({hy.first.reshape({-1}).to(hy.second.scalar_type()), hy.second.reshape({-1})});
    } else {
      const auto [q, k] = fused ? memopt::nn::fused_rope(a, b, cos, sin)
                                : std::pair{memopt::nn::apply_rope(a.transpose(1, 2), cos, sin),
                                            memopt::nn::apply_rope(b.transpose(1, 2), cos, sin)};
      y = torch::cat({q.reshape({-1}), k.reshape({-1})});
    }
    y.backward(grad_out.view_as(y).to(y.scalar_type()));
  };
  const auto t = time_steps(cfg, step);
  nlohmann::ordered_json line{{"suite", "fused"},   {"name", kernel},       {"impl", cfg.impl},
                              {"dtype", cfg.dtype}, {"rows", cfg.rows}, {"width", width}};
  line["peak_tracked_mib"] = mib(t.peak_bytes);
  line["ms"] = t.ms;
  line["ms_min"] = t.ms_min;
  line["inputs_mib"] = mib(t.live_before);
  return line;
}
// QLoRA's base matmul, y = x · deq(w)ᵀ over (rows, hidden) x and an NF4 (ffn, hidden) w, forward
// + backward (dx): the whole weight dequantised at once, or tiles of --tile_kib (_fused).
nlohmann::ordered_json run_nf4_linear(const BenchConfig& cfg) {
  const bool tiled = cfg.impl == "nf4_linear_fused";
  const auto dtype = cfg.dtype == "bf16" ? torch::kBFloat16 : torch::kFloat;
  const char* bf16_gemm = dtype == torch::kBFloat16 ? enable_bf16_gemm() : nullptr;
  torch::manual_seed(static_cast<int64_t>(cfg.seed));
  const auto w = memopt::nn::quantize_nf4(torch::randn({cfg.ffn, cfg.hidden}) * 0.02);
  auto x = torch::randn({cfg.rows, cfg.hidden}).to(dtype).requires_grad_();
  const auto grad_out = torch::randn({cfg.rows, cfg.ffn}).to(dtype);
  const int64_t tile_bytes = tiled ? cfg.tile_kib * 1024 : 0;
  auto step = [&] {
    x.mutable_grad() = torch::Tensor();
    memopt::nn::nf4_linear(x, w, {}, tile_bytes).backward(grad_out);
  };
  const auto t = time_steps(cfg, step);
  nlohmann::ordered_json line{{"suite", "fused"}, {"name", "nf4_linear"}, {"impl", cfg.impl}, {"dtype", cfg.dtype},
                              {"rows", cfg.rows}, {"width", cfg.ffn},      {"in", cfg.hidden}};
  if (tiled) line["tile_kib"] = cfg.tile_kib;
  if (bf16_gemm != nullptr) line["bf16_gemm"] = bf16_gemm;
  line["peak_tracked_mib"] = mib(t.peak_bytes);
  line["ms"] = t.ms;
  line["ms_min"] = t.ms_min;
  line["inputs_mib"] = mib(t.live_before);
  return line;
}
// An fp32 linear layer's three GEMMs, y = x·wᵀ, dX = dy·w and dW = dyᵀ·x, over (rows, hidden) x
// and an (ffn, hidden) w: LibTorch's GEMM (linear) or memopt's blocked one (linear_blocked,
// memopt/fp32_gemm.hpp), whatever enable() would measure.
nlohmann::ordered_json run_linear(const BenchConfig& cfg) {
  namespace fgemm = memopt::fp32_gemm;
  fgemm::set_mode(cfg.impl == "linear_blocked" ? fgemm::Mode::Blocked : fgemm::Mode::Native);
  torch::manual_seed(static_cast<int64_t>(cfg.seed));
  auto w = (torch::randn({cfg.ffn, cfg.hidden}) * 0.02).requires_grad_();
  auto x = torch::randn({cfg.rows, cfg.hidden}).requires_grad_();
  const auto grad_out = torch::randn({cfg.rows, cfg.ffn});
  auto step = [&] {
    x.mutable_grad() = torch::Tensor();
    w.mutable_grad() = torch::Tensor();
    torch::linear(x, w).backward(grad_out);
  };
  const auto t = time_steps(cfg, step);
  nlohmann::ordered_json line{{"suite", "fused"}, {"name", "linear"},  {"impl", cfg.impl}, {"dtype", "fp32"},
                              {"rows", cfg.rows}, {"width", cfg.ffn}, {"in", cfg.hidden}};
  line["fp32_gemm"] = fgemm::mode_name(fgemm::mode());
  line["peak_tracked_mib"] = mib(t.peak_bytes);
  line["ms"] = t.ms;
  line["ms_min"] = t.ms_min;
  line["gflops"] = 6.0 * static_cast<double>(cfg.rows * cfg.hidden * cfg.ffn) / (t.ms_min * 1e6);
  line["inputs_mib"] = mib(t.live_before);
  return line;
}
}  // namespace

int main(int argc, char** argv) {
  BenchConfig cfg;
  CLI::App app{"memopt_bench_attention: one forward+backward of attention or of the LM loss, one path per run"};
  app.add_option("--impl", cfg.impl, "math | sdpa | blockwise | flash (attention); ce_full | ce_chunked | ce_chunked_fused "
                 "(LM loss); rms_norm | swiglu | rope | dropout_add | add_rms_norm | nf4_linear, each also _fused "
                 "(nn/fused.hpp, nn/fused_dropout.hpp, nn/fused_add_norm.hpp; nf4_linear: nn/qlora.hpp's tiles); "
                 "add_rms_norm_pair_fused (fused dropout-add, then fused RMSNorm); linear | linear_blocked (an fp32 "
                 "layer's three GEMMs: LibTorch's or fp32_gemm's blocked kernel)")
      ->check(CLI::IsMember({"math", "sdpa", "blockwise", "flash", "ce_full", "ce_chunked", "ce_chunked_fused", "rms_norm",
                             "rms_norm_fused", "swiglu", "swiglu_fused", "rope", "rope_fused", "dropout_add",
                             "dropout_add_fused", "add_rms_norm", "add_rms_norm_fused", "add_rms_norm_pair_fused",
                             "nf4_linear", "nf4_linear_fused", "linear", "linear_blocked"}));
  app.add_option("--L", cfg.L, "sequence length")->check(CLI::PositiveNumber);
  app.add_option("--batch", cfg.batch, "B")->check(CLI::PositiveNumber);
  app.add_option("--heads", cfg.heads, "H")->check(CLI::PositiveNumber);
  app.add_option("--head_dim", cfg.head_dim, "D")->check(CLI::PositiveNumber);
  app.add_flag("--bidirectional", cfg.bidirectional, "no causal mask");
  app.add_option("--q_block", cfg.q_block, "blockwise: query positions per block")->check(CLI::PositiveNumber);
  app.add_option("--kv_block", cfg.kv_block, "blockwise: key positions per block")->check(CLI::PositiveNumber);
  app.add_option("--rows", cfg.rows, "cross-entropy, rms_norm, swiglu: rows N")->check(CLI::PositiveNumber);
  app.add_option("--hidden", cfg.hidden, "cross-entropy, rms_norm: hidden size C")->check(CLI::PositiveNumber);
  app.add_option("--vocab", cfg.vocab, "cross-entropy: vocabulary V")->check(CLI::PositiveNumber);
  app.add_option("--chunk", cfg.chunk, "ce_chunked: rows per chunk")->check(CLI::PositiveNumber);
  app.add_option("--ffn", cfg.ffn, "swiglu: width F")->check(CLI::PositiveNumber);
  app.add_option("--tile_kib", cfg.tile_kib, "nf4_linear_fused: KiB of weight dequantised at a time")
      ->check(CLI::PositiveNumber);
  app.add_option("--dtype", cfg.dtype, "attention, rms_norm, swiglu: fp32 | bf16")->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--steps", cfg.steps, "timed forward+backward passes")->check(CLI::PositiveNumber);
  app.add_option("--warmup", cfg.warmup, "untimed passes first")->check(CLI::NonNegativeNumber);
  app.add_option("--threads", cfg.threads, "intra-op threads (0: all available CPUs)")->check(CLI::NonNegativeNumber);
  app.add_option("--max_gib", cfg.max_gib, "math/sdpa: skip when the estimated peak exceeds this")
      ->check(CLI::PositiveNumber);
  app.add_option("--seed", cfg.seed, "seed of the random inputs");
  CLI11_PARSE(app, argc, argv);
  memopt::init(memopt::RuntimeOptions().threads(cfg.threads));  // tracker before any tensor

  return memopt::bench::print_line([&] {
    auto line = cfg.is_attention()     ? run_attention(cfg)
                : cfg.is_elementwise() ? run_elementwise(cfg)
                : cfg.is_nf4()         ? run_nf4_linear(cfg)
                : cfg.is_linear()      ? run_linear(cfg)
                                       : run_cross_entropy(cfg);
    line["steps"] = cfg.steps;
    line["threads"] = at::get_num_threads();
    return line;
  });
}
