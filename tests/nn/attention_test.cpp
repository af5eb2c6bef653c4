// Tests for memopt/nn/attention.hpp and attention_kernels.hpp: the blockwise attention,
// LibTorch's SDPA (attention_sdpa), attention_flash (nn/attention_flash.hpp, whose own tests are
// in attention_flash_test.cpp) and attention_auto (the measured one of those) against the
// math path (values and gradients: causal, bidirectional, padded
// keys and fully padded rows, grouped KV heads, ragged blocks, bf16), their memory against the
// math path's, their errors, and the LLaMA model with each attention.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include <torch/torch.h>

#include <memopt/batch.hpp>
#include <memopt/detail/autocast.hpp>
#include <memopt/memory/tracker.hpp>
#include <memopt/models/llama.hpp>
#include <memopt/nn/attention.hpp>
#include <memopt/nn/cross_entropy.hpp>
#include <memopt/policies/recompute.hpp>

#include "nn/fixtures.hpp"
#include "support.hpp"

using namespace memopt::test::nn;  // NOLINT: the fixtures of these tests

// The CPU kernels (LibTorch's flash kernel, the blockwise path's slices) hold buffers per thread:
// the memory tests run at 2 threads, whatever the machine, so their bounds hold on any core count
// (on 16 threads the blockwise peak was 25.8 MB, at 2 threads 9.1 MB).
struct TwoThreads {
  int saved = at::get_num_threads();
  TwoThreads() { at::set_num_threads(2); }
  ~TwoThreads() { at::set_num_threads(saved); }
  TwoThreads(const TwoThreads&) = delete;
  TwoThreads& operator=(const TwoThreads&) = delete;
};

TEST_CASE("attention_blockwise, attention_sdpa, attention_flash and attention_auto equal the math path in fp32, "
          "values and gradients", "[attention]") {
  for (const auto path : {Path::kBlockwise, Path::kSdpa, Path::kAuto, Path::kFlash}) {
    const char* name = path == Path::kSdpa    ? "sdpa: "
                       : path == Path::kAuto  ? "auto: "
                       : path == Path::kFlash ? "flash: "
                                              : "blockwise: ";
    for (const auto& c : attention_cases()) {
      DYNAMIC_SECTION(name << c.name) {
        const auto in = make_inputs(c, torch::kFloat);
        const auto want = run(c, in, Path::kMath, torch::kFloat);
        const auto got = run(c, in, path, torch::kFloat);
        check_close(got, want, kFp32Atol, c.name);
        if (c.padded) {  // rows with no key: output 0, gradients 0, no NaN
          CHECK(got.out[c.B - 1].abs().max().item<double>() == 0.0);
          CHECK(got.dq[c.B - 1].abs().max().item<double>() == 0.0);
          CHECK(got.dk[c.B - 1].abs().max().item<double>() == 0.0);
          if (c.causal) CHECK(got.out[0].select(1, 0).abs().max().item<double>() == 0.0);
        }
      }
    }
  }
}

TEST_CASE("attention_sdpa in bf16 stays within the bf16 math path's own error of fp32", "[attention]") {
  for (const auto& c : {Case{.name = "causal GQA", .H = 8, .KV = 2},
                        Case{.name = "bidirectional padded", .causal = false, .padded = true}}) {
    DYNAMIC_SECTION(c.name) {
      const auto in = make_inputs(c, torch::kBFloat16);
      const auto reference = run(c, in, Path::kMath, torch::kFloat);
      const auto math = run(c, in, Path::kMath, torch::kBFloat16);
      const auto sdpa = run(c, in, Path::kSdpa, torch::kBFloat16);
      REQUIRE(sdpa.out.scalar_type() == torch::kBFloat16);
      check_within_reference_error(sdpa, math, reference, "sdpa bf16 vs fp32");
    }
  }
}

TEST_CASE("attention_sdpa keeps far less memory than the math path at T = 2048", "[attention][memory]") {
  // The same problem as the blockwise memory test; LibTorch's CPU flash kernel holds no
  // (T, T) tensor. With a key padding mask (bidirectional) it stays linear too.
  const TwoThreads threads;
  for (const bool padded : {false, true}) {
    Case c{.name = "memory", .B = 1, .H = 4, .KV = 4, .T = 2048, .D = 32, .causal = !padded, .padded = padded};
    const auto in = make_inputs(c, torch::kFloat);
    const int64_t math = peak_of([&] { run(c, in, Path::kMath, torch::kFloat); });
    const int64_t sdpa = peak_of([&] { run(c, in, Path::kSdpa, torch::kFloat); });
    const int64_t scores = c.B * c.H * c.T * c.T * 4;
    INFO("padded " << padded << ": peak tracked bytes: math " << math << ", sdpa " << sdpa
                   << " (one (B, H, T, T) fp32 tensor: " << scores << ")");
    CHECK(math >= scores);
    CHECK(sdpa < scores / 4);
  }
}

TEST_CASE("attention_blockwise in bf16 stays within the bf16 math path's own error of fp32", "[attention]") {
  for (const auto& c : {Case{.name = "causal GQA", .H = 8, .KV = 2},
                        Case{.name = "bidirectional padded", .causal = false, .padded = true}}) {
    DYNAMIC_SECTION(c.name) {
      const auto in = make_inputs(c, torch::kBFloat16);  // bf16 values; the fp32 reference runs on them exactly
      const auto reference = run(c, in, Path::kMath, torch::kFloat);
      const auto math = run(c, in, Path::kMath, torch::kBFloat16);
      const auto blockwise = run(c, in, Path::kBlockwise, torch::kBFloat16);
      REQUIRE(blockwise.out.scalar_type() == torch::kBFloat16);
      REQUIRE(blockwise.dq.scalar_type() == torch::kBFloat16);
      check_within_reference_error(blockwise, math, reference, "blockwise bf16 vs fp32");

      // Under bf16 autocast, fp32 inputs run the same bf16 kernels: identical values, and
      // fp32 gradients for the fp32 leaves.
      Result autocast;
      {
        memopt::detail::AutocastGuard guard({c10::kCPU, true, c10::kBFloat16});
        autocast = run(c, in, Path::kBlockwise, torch::kFloat);
      }
      REQUIRE(autocast.out.scalar_type() == torch::kBFloat16);
      REQUIRE(autocast.dq.scalar_type() == torch::kFloat);
      check_close(autocast, blockwise, 0.0, "blockwise under autocast vs bf16");
    }
  }
}

TEST_CASE("attention_blockwise with key padding reads its block flags without item()", "[attention]") {
  // Two item() per key block would be two host syncs per block on a GPU; it copies them all at once.
  const Case c{.name = "causal, padded, 5 key blocks", .T = 80, .causal = true, .padded = true, .kv_block = 16};
  const auto in = make_inputs(c, torch::kFloat);
  {
    memopt::test::HostReads probe;
    (void)torch::ones({}).item<float>();
    REQUIRE(probe.count() == 1);  // the counter sees item()
  }
  memopt::test::HostReads reads;
  const auto got = run(c, in, Path::kBlockwise, torch::kFloat);
  CHECK(reads.count() == 0);
  check_close(got, run(c, in, Path::kMath, torch::kFloat), kFp32Atol, c.name);
}

TEST_CASE("attention_blockwise runs under NoGradGuard and InferenceMode", "[attention]") {
  // Long enough for several parallel tasks: the worker threads must see the caller's mode.
  const Case c{.name = "no grad", .B = 1, .H = 4, .KV = 2, .T = 300, .D = 16, .causal = true, .q_block = 32,
               .kv_block = 32};
  const auto in = make_inputs(c, torch::kFloat);
  const auto options = memopt::nn::BlockwiseAttentionOptions().q_block(c.q_block).kv_block(c.kv_block);
  const auto want = run(c, in, Path::kMath, torch::kFloat).out;
  {
    torch::NoGradGuard no_grad;
    const auto y = memopt::nn::attention_blockwise(in.q, in.k, in.v, options);
    CHECK(!y.requires_grad());
    CHECK(max_abs_diff(y, want) <= kFp32Atol);
  }
  {
    c10::InferenceMode inference;
    const auto q = in.q.detach().clone(), k = in.k.detach().clone(), v = in.v.detach().clone();  // inference tensors
    CHECK(max_abs_diff(memopt::nn::attention_blockwise(q, k, v, options), want) <= kFp32Atol);
  }
}

TEST_CASE("attention_blockwise keeps far less memory than the math path at T = 2048", "[attention][memory]") {
  // B=1, H=4, D=32, causal: the math path holds several (4, 2048, 2048) fp32 tensors (64 MiB
  // each); the blockwise path a few (4, 256, 256) blocks plus T-sized tensors. Measured:
  // 198 MiB vs 9.1 MiB (0.046x). The bound (a quarter) fails if a T² tensor comes back.
  constexpr double kMaxFraction = 0.25;
  const TwoThreads threads;
  Case c{.name = "memory", .B = 1, .H = 4, .KV = 4, .T = 2048, .D = 32, .causal = true};
  c.q_block = memopt::nn::kAttentionQBlock;
  c.kv_block = memopt::nn::kAttentionKvBlock;
  const auto in = make_inputs(c, torch::kFloat);
  const int64_t math = peak_of([&] { run(c, in, Path::kMath, torch::kFloat); });
  const int64_t blockwise = peak_of([&] { run(c, in, Path::kBlockwise, torch::kFloat); });
  const int64_t scores = c.B * c.H * c.T * c.T * 4;
  INFO("peak tracked bytes: math " << math << ", blockwise " << blockwise << " (one (B, H, T, T) fp32 tensor: "
                                   << scores << ")");
  CHECK(math >= scores);
  CHECK(static_cast<double>(blockwise) <= kMaxFraction * static_cast<double>(math));
  CHECK(blockwise < scores / 4);
}

TEST_CASE("the blockwise attention rejects dropout and bad inputs with a HINT", "[attention]") {
  using memopt::nn::AttentionKind;
  memopt::test::require_error(
      [] {
        memopt::nn::Attention(memopt::nn::AttentionOptions(64, 4).kind(AttentionKind::kBlockwise).dropout(0.1));
      },
      "memopt::nn::Attention", {"dropout 0.1", "kMath"});
  memopt::test::require_error(
      [] { memopt::models::Llama(small_llama(true).attention_kind(AttentionKind::kBlockwise).dropout(0.1)); },
      "memopt::models::LlamaConfig", {"dropout 0.1", "kMath"});
  REQUIRE_NOTHROW(memopt::nn::Attention(memopt::nn::AttentionOptions(64, 4).kind(AttentionKind::kMath).dropout(0.1)));
  REQUIRE_NOTHROW(memopt::nn::Attention(memopt::nn::AttentionOptions(64, 4).kind(AttentionKind::kSdpa).dropout(0.1)));
  const auto x = torch::randn({1, 4, 8, 16});
  memopt::test::require_error(
      [&] { memopt::nn::attention_sdpa(x, x, x, /*causal=*/true, 0.1, /*training=*/true, torch::ones({1, 8}, torch::kBool)); },
      "memopt::nn::attention_sdpa", {"dropout 0.1", "blockwise"});
  memopt::test::require_error(
      [&] { memopt::nn::attention_sdpa(x, x, x, /*causal=*/false, 0.0, false, torch::ones({1, 7}, torch::kBool)); },
      "memopt::nn::attention_sdpa", {"key_padding_mask", "[1, 7]"});

  const auto q = torch::randn({1, 4, 8, 16}), kv = torch::randn({1, 3, 8, 16});
  memopt::test::require_error([&] { memopt::nn::attention_blockwise(q, kv, kv); },
                              "memopt::nn::attention_blockwise", {"multiple of KV heads", "4 and 3"});
  const auto k2 = torch::randn({1, 2, 8, 16});
  memopt::test::require_error(
      [&] {
        memopt::nn::attention_blockwise(q, k2, k2,
                                        memopt::nn::BlockwiseAttentionOptions().key_padding_mask(torch::ones({1, 7})));
      },
      "memopt::nn::attention_blockwise", {"key_padding_mask", "[1, 7]"});
  memopt::test::require_error(
      [&] { memopt::nn::attention_blockwise(q, k2, k2, memopt::nn::BlockwiseAttentionOptions().q_block(0)); },
      "memopt::nn::attention_blockwise", {"q_block"});
}

TEST_CASE("Llama gives the same logits and gradients with blockwise attention, SDPA, flash and auto",
          "[attention][llama]") {
  using memopt::nn::AttentionKind;
  for (const auto& [causal, kind] : {std::pair{true, AttentionKind::kBlockwise}, std::pair{false, AttentionKind::kBlockwise},
                                     std::pair{true, AttentionKind::kSdpa}, std::pair{false, AttentionKind::kSdpa},
                                     std::pair{true, AttentionKind::kFlash}, std::pair{false, AttentionKind::kFlash},
                                     std::pair{true, AttentionKind::kAuto}, std::pair{false, AttentionKind::kAuto}}) {
    DYNAMIC_SECTION((causal ? "causal " : "bidirectional ") << memopt::nn::attention_kind_name(kind)) {
      torch::manual_seed(11);
      memopt::models::Llama math(small_llama(causal));
      auto blockwise = copy_of(math, small_llama(causal)
                                         .attention_kind(kind)
                                         .attention_block_size(16));  // T = 40: ragged blocks
      const auto batch = small_batch(2, 40, 97);
      {
        torch::NoGradGuard no_grad;
        const double diff = max_abs_diff(blockwise->forward(batch.inputs), math->forward(batch.inputs));
        INFO("logits max abs diff " << diff);
        CHECK(diff <= kFp32Atol);
      }
      check_same_training(blockwise, math, batch, memopt::recompute::None{});
      check_same_training(blockwise, math, batch, memopt::recompute::EveryBlock{});
    }
  }
}

TEST_CASE("CUDA: attention_sdpa on the GPU equals the math path in fp32, and in bf16 stays within its error",
          "[attention][cuda]") {
  MEMOPT_REQUIRE_CUDA();
  const torch::Device cuda(torch::kCUDA, 0);
  auto on = [](const Inputs& in, torch::Device device) {
    return Inputs{in.q.detach().to(device), in.k.detach().to(device), in.v.detach().to(device),
                  in.grad_out.to(device), in.mask.defined() ? in.mask.to(device) : in.mask};
  };
  auto cpu = [](const Result& r) { return Result{r.out.cpu(), r.dq.cpu(), r.dk.cpu(), r.dv.cpu()}; };
  for (const auto& c : attention_cases()) {
    DYNAMIC_SECTION("fp32: " << c.name) {
      const auto in = make_inputs(c, torch::kFloat);
      const auto got = cpu(run(c, on(in, cuda), Path::kSdpa, torch::kFloat));
      check_close(got, run(c, in, Path::kMath, torch::kFloat), kFp32Atol, c.name);
      if (c.padded) CHECK(got.out[c.B - 1].abs().max().item<double>() == 0.0);  // a row of padding only: 0, no NaN
    }
  }
  // bf16 (the GPU's flash kernel where no mask is given): the CPU bf16 math path's own error of fp32.
  for (const auto& c : {Case{.name = "causal GQA", .H = 8, .KV = 2, .T = 128, .D = 64},
                        Case{.name = "bidirectional padded", .causal = false, .padded = true}}) {
    DYNAMIC_SECTION("bf16: " << c.name) {
      const auto in = make_inputs(c, torch::kBFloat16);
      const auto reference = run(c, in, Path::kMath, torch::kFloat);
      const auto math = run(c, in, Path::kMath, torch::kBFloat16);
      const auto sdpa = cpu(run(c, on(in, cuda), Path::kSdpa, torch::kBFloat16));
      REQUIRE(sdpa.out.scalar_type() == torch::kBFloat16);
      check_within_reference_error(sdpa, math, reference, "sdpa bf16 on CUDA vs fp32");
    }
  }
}
