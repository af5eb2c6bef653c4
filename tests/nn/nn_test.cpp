// tests/nn/nn_test.cpp — memopt/nn/attention.hpp and memopt/nn/cross_entropy.hpp. The
// blockwise attention and LibTorch's SDPA (attention_sdpa) against the math path (values and
// gradients: causal, bidirectional, padded keys and fully padded rows, grouped KV heads,
// ragged blocks, bf16), their memory against the math path's, and their errors; the chunked
// cross-entropy against the full logits; and the LLaMA model with each attention and loss.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include <torch/torch.h>

#include "support.hpp"

#include <memopt/batch.hpp>
#include <memopt/detail/autocast.hpp>
#include <memopt/memory/tracker.hpp>
#include <memopt/models/llama.hpp>
#include <memopt/nn/attention.hpp>
#include <memopt/nn/cross_entropy.hpp>
#include <memopt/policies/checkpoint.hpp>

namespace {

// Tolerances. fp32: the blockwise path sums the same products in another order (online
// softmax, per-block matmuls): measured <= 1.8e-6 on outputs and gradients of magnitude
// ~1 here (LLaMA logits: 1.5e-7); 1e-5 leaves room for another BLAS or thread count and
// fails on real mistakes (a key masked wrongly moves outputs by ~0.1). bf16: both paths
// round matmul inputs and outputs to bf16 (8 bits of mantissa), so each is compared with
// the fp32 math path on the same bf16-rounded inputs. How far LibTorch's own bf16 math path
// lands from fp32 depends on the CPU's bf16 kernels (<= 2.3e-2 on AMX and avx512_bf16
// machines, 0.105 on dv on an AVX2-only one), so the blockwise path's tolerance is measured
// in the test: within kBf16RefFactor x the math path's own error (per output and gradient)
// plus kBf16Floor (2.6 bf16 ulps at magnitude 1), never a constant fitted on one CPU.
constexpr double kFp32Atol = 1e-5;
constexpr double kBf16RefFactor = 2.0;
constexpr double kBf16Floor = 1e-2;
constexpr double kLossRtol = 1e-6;
constexpr double kGradRtol = 2e-5;

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
}

// One attention problem: q (B, H, T, D), k and v (B, KV, T, D).
struct Case {
  std::string name;
  int64_t B = 2, H = 4, KV = 4, T = 37, D = 16;
  bool causal = true;
  bool padded = false;  // row 0: some keys padded; the last row: every key padded
  int64_t q_block = 8, kv_block = 16;
};

struct Inputs {
  torch::Tensor q, k, v, grad_out, mask;  // mask undefined unless padded
};

Inputs make_inputs(const Case& c, c10::ScalarType dtype) {
  torch::manual_seed(7);
  Inputs in;
  in.q = torch::randn({c.B, c.H, c.T, c.D}).to(dtype).requires_grad_();
  in.k = torch::randn({c.B, c.KV, c.T, c.D}).to(dtype).requires_grad_();
  in.v = torch::randn({c.B, c.KV, c.T, c.D}).to(dtype).requires_grad_();
  in.grad_out = torch::randn({c.B, c.H, c.T, c.D}).to(dtype);
  if (c.padded) {
    in.mask = torch::rand({c.B, c.T}) > 0.3;  // (B, T) true = real
    in.mask[0][0] = false;                     // causal: query 0 of row 0 has no key at all
    in.mask[0][c.T - 1] = true;
    in.mask[c.B - 1].fill_(false);  // a row of padding only
  }
  return in;
}

struct Result {
  torch::Tensor out, dq, dk, dv;
};

enum class Path { kMath, kBlockwise, kSdpa };

// Forward + backward of one path on fresh leaves holding the inputs' values.
Result run(const Case& c, const Inputs& in, Path path, c10::ScalarType dtype) {
  auto q = in.q.detach().to(dtype).requires_grad_();
  auto k = in.k.detach().to(dtype).requires_grad_();
  auto v = in.v.detach().to(dtype).requires_grad_();
  torch::Tensor out;
  if (path == Path::kSdpa) {
    out = memopt::nn::attention_sdpa(q, k, v, c.causal, 0.0, false, in.mask);
  } else if (path == Path::kBlockwise) {
    out = memopt::nn::attention_blockwise(q, k, v,
                                          memopt::nn::BlockwiseAttentionOptions()
                                              .causal(c.causal)
                                              .q_block(c.q_block)
                                              .kv_block(c.kv_block)
                                              .key_padding_mask(in.mask));
  } else {
    const int64_t rep = c.H / c.KV;
    out = memopt::nn::attention_math(q, memopt::nn::repeat_kv(k, rep), memopt::nn::repeat_kv(v, rep), c.causal, 0.0,
                                     false, in.mask);
  }
  out.backward(in.grad_out.to(out.scalar_type()));
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

void check_close(const Result& got, const Result& want, double atol, const std::string& what) {
  REQUIRE(got.out.sizes() == want.out.sizes());
  const std::vector<std::pair<const char*, std::pair<torch::Tensor, torch::Tensor>>> parts{
      {"output", {got.out, want.out}}, {"dq", {got.dq, want.dq}}, {"dk", {got.dk, want.dk}},
      {"dv", {got.dv, want.dv}}};
  for (const auto& [name, pair] : parts) {
    REQUIRE(pair.first.defined());
    REQUIRE(torch::isfinite(pair.first).all().item<bool>());
    const double diff = max_abs_diff(pair.first, pair.second);
    INFO(what << ": " << name << " max abs diff " << diff << " (tolerance " << atol << ")");
    CHECK(diff <= atol);
  }
}

/// got's error against `reference` stays within kBf16RefFactor x `baseline`'s own error
/// against it (+ kBf16Floor), part by part: output, dq, dk, dv.
void check_within_reference_error(const Result& got, const Result& baseline, const Result& reference,
                                  const std::string& what) {
  const std::vector<std::pair<const char*, torch::Tensor Result::*>> parts{
      {"output", &Result::out}, {"dq", &Result::dq}, {"dk", &Result::dk}, {"dv", &Result::dv}};
  for (const auto& [name, part] : parts) {
    REQUIRE(torch::isfinite(got.*part).all().item<bool>());
    const double own = max_abs_diff(baseline.*part, reference.*part);
    const double tolerance = kBf16RefFactor * own + kBf16Floor;
    const double diff = max_abs_diff(got.*part, reference.*part);
    INFO(what << ": " << name << " max abs diff " << diff << "; LibTorch's bf16 math path " << own
              << " (tolerance " << tolerance << ")");
    CHECK(diff <= tolerance);
  }
}

std::vector<Case> attention_cases() {
  std::vector<Case> cases;
  cases.push_back({.name = "causal"});
  cases.push_back({.name = "bidirectional", .causal = false});
  cases.push_back({.name = "causal, padded keys", .causal = true, .padded = true});
  cases.push_back({.name = "bidirectional, padded keys", .causal = false, .padded = true});
  cases.push_back({.name = "causal, GQA H=8 KV=2", .H = 8, .KV = 2});
  cases.push_back({.name = "bidirectional, GQA H=8 KV=2, padded", .H = 8, .KV = 2, .causal = false, .padded = true});
  cases.push_back({.name = "causal, one block", .q_block = 64, .kv_block = 64});
  cases.push_back({.name = "causal, q blocks larger than kv blocks", .q_block = 16, .kv_block = 5});
  return cases;
}

// Peak tracked bytes above the live bytes before one forward + backward.
template <class Fn>
int64_t peak_of(Fn&& fn) {
  auto& tracker = memopt::memory::Tracker::instance();
  tracker.reset_peaks();
  const int64_t before = tracker.live_bytes();
  fn();
  return tracker.peak_bytes() - before;
}

memopt::models::LlamaConfig small_llama(bool causal) {
  return memopt::models::LlamaConfig()
      .vocab_size(97)
      .hidden_size(64)
      .num_hidden_layers(2)
      .num_attention_heads(4)
      .num_key_value_heads(2)
      .max_position_embeddings(64)
      .causal(causal);
}

// A Llama built from `config` holding `source`'s weights.
memopt::models::Llama copy_of(const memopt::models::Llama& source, const memopt::models::LlamaConfig& config) {
  memopt::models::Llama model(config);
  torch::NoGradGuard no_grad;
  const auto from = source->named_parameters();
  for (auto& item : model->named_parameters()) item.value().copy_(from[item.key()]);
  return model;
}

memopt::Batch small_batch(int64_t B, int64_t T, int64_t vocab) {
  torch::manual_seed(3);
  auto tokens = torch::randint(vocab, {B, T + 1});
  auto targets = tokens.slice(1, 1).clone();
  targets.slice(1, 0, 5).fill_(memopt::kIgnoreIndex);  // a prompt that takes no loss
  return {tokens.slice(1, 0, T).contiguous(), targets};
}

// Loss, then every parameter's gradient, compared relative to the largest reference entry.
template <class Checkpoint>
void check_same_training(memopt::models::Llama& got, memopt::models::Llama& want, const memopt::Batch& batch,
                         const Checkpoint& ckpt) {
  got->zero_grad();
  want->zero_grad();
  const torch::Tensor loss_got = got->loss_sum(batch, ckpt);
  const torch::Tensor loss_want = want->loss_sum(batch, ckpt);
  const double rel = std::abs(loss_got.item<double>() - loss_want.item<double>()) / std::abs(loss_want.item<double>());
  INFO("loss_sum " << loss_got.item<double>() << " vs " << loss_want.item<double>() << " (rel diff " << rel << ")");
  CHECK(rel <= kLossRtol);
  loss_got.backward();
  loss_want.backward();
  const auto want_params = want->named_parameters();
  for (const auto& item : got->named_parameters()) {
    const auto& ref = want_params[item.key()].grad();
    REQUIRE(item.value().grad().defined());
    const double scale = ref.abs().max().item<double>();
    REQUIRE(scale > 0);
    const double diff = max_abs_diff(item.value().grad(), ref) / scale;
    INFO("gradient of " << item.key() << ": max abs diff / max abs reference " << diff);
    CHECK(diff <= kGradRtol);
  }
}

torch::Tensor full_cross_entropy_sum(const torch::Tensor& hidden, const torch::Tensor& weight,
                                     const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(
      hidden.matmul(weight.t()).to(torch::kFloat), targets,
      torch::nn::functional::CrossEntropyFuncOptions().ignore_index(memopt::kIgnoreIndex).reduction(torch::kSum));
}

}  // namespace

TEST_CASE("attention_blockwise and attention_sdpa equal the math path in fp32, values and gradients", "[attention]") {
  for (const auto path : {Path::kBlockwise, Path::kSdpa}) {
    for (const auto& c : attention_cases()) {
      DYNAMIC_SECTION((path == Path::kSdpa ? "sdpa: " : "blockwise: ") << c.name) {
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

TEST_CASE("Llama gives the same logits and gradients with blockwise attention and SDPA", "[attention][llama]") {
  using memopt::nn::AttentionKind;
  for (const auto& [causal, kind] : {std::pair{true, AttentionKind::kBlockwise}, std::pair{false, AttentionKind::kBlockwise},
                                     std::pair{true, AttentionKind::kSdpa}, std::pair{false, AttentionKind::kSdpa}}) {
    DYNAMIC_SECTION((causal ? "causal " : "bidirectional ") << (kind == AttentionKind::kSdpa ? "sdpa" : "blockwise")) {
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
      check_same_training(blockwise, math, batch, memopt::checkpoint::None{});
      check_same_training(blockwise, math, batch, memopt::checkpoint::EveryBlock{});
    }
  }
}

TEST_CASE("chunked_cross_entropy_sum equals the full logits' cross-entropy", "[cross_entropy]") {
  torch::manual_seed(5);
  const int64_t N = 50, C = 16, V = 37;
  const auto hidden0 = torch::randn({N, C});
  const auto weight0 = torch::randn({V, C}) * 0.5;
  auto targets = torch::randint(V, {N});
  targets.index_put_({torch::rand({N}) < 0.2}, memopt::kIgnoreIndex);
  targets[0] = memopt::kIgnoreIndex;
  for (const int64_t chunk : {int64_t{1}, int64_t{8}, int64_t{50}, int64_t{1000}}) {
    DYNAMIC_SECTION("chunk " << chunk) {
      auto h_full = hidden0.clone().requires_grad_(), w_full = weight0.clone().requires_grad_();
      auto h = hidden0.clone().requires_grad_(), w = weight0.clone().requires_grad_();
      const auto want = full_cross_entropy_sum(h_full, w_full, targets);
      const auto got = memopt::nn::chunked_cross_entropy_sum(
          h, w, targets, memopt::nn::ChunkedCrossEntropyOptions().chunk_size(chunk));
      REQUIRE(got.scalar_type() == torch::kFloat);
      REQUIRE(got.dim() == 0);
      const double rel = std::abs(got.item<double>() - want.item<double>()) / want.item<double>();
      INFO("loss " << got.item<double>() << " vs " << want.item<double>() << " (rel diff " << rel << ")");
      CHECK(rel <= kLossRtol);
      (got * 0.5).backward();
      (want * 0.5).backward();
      CHECK(max_abs_diff(h.grad(), h_full.grad()) <= kFp32Atol);
      CHECK(max_abs_diff(w.grad(), w_full.grad()) <= kFp32Atol);
      CHECK(h.grad()[0].abs().max().item<double>() == 0.0);  // an ignored row gets no gradient
    }
  }
  SECTION("bf16 autocast: logits in bf16, loss and dWeight in fp32") {
    auto h_full = hidden0.clone().requires_grad_(), w_full = weight0.clone().requires_grad_();
    auto h = hidden0.clone().requires_grad_(), w = weight0.clone().requires_grad_();
    torch::Tensor want, got;
    {
      memopt::detail::AutocastGuard guard({c10::kCPU, true, c10::kBFloat16});
      want = full_cross_entropy_sum(h_full, w_full, targets);
      got = memopt::nn::chunked_cross_entropy_sum(h, w, targets,
                                                  memopt::nn::ChunkedCrossEntropyOptions().chunk_size(8));
    }
    REQUIRE(got.scalar_type() == torch::kFloat);
    CHECK(std::abs(got.item<double>() - want.item<double>()) <= 1e-5 * std::abs(want.item<double>()));
    got.backward();
    want.backward();
    REQUIRE(w.grad().scalar_type() == torch::kFloat);
    // The full path rounds dWeight to bf16 once; the chunked one accumulates it in fp32.
    const double scale = w_full.grad().abs().max().item<double>();
    CHECK(max_abs_diff(w.grad(), w_full.grad()) <= 1e-2 * scale);
    CHECK(max_abs_diff(h.grad(), h_full.grad()) <= 1e-2 * h_full.grad().abs().max().item<double>());
  }
}

TEST_CASE("chunked_cross_entropy_sum rejects bad targets with a HINT", "[cross_entropy]") {
  const auto h = torch::randn({4, 8}), w = torch::randn({10, 8});
  memopt::test::require_error(
      [&] { memopt::nn::chunked_cross_entropy_sum(h, w, torch::tensor({1, 2, 10, 3}, torch::kLong)); },
      "memopt::nn::chunked_cross_entropy_sum", {"target 10", "[0, 10)"});
  memopt::test::require_error([&] { memopt::nn::chunked_cross_entropy_sum(h, w, torch::tensor({1, 2, 3}, torch::kLong)); },
                              "memopt::nn::chunked_cross_entropy_sum", {"targets"});
  memopt::test::require_error(
      [&] { memopt::models::Llama(small_llama(true).loss_chunk_size(-1)); }, "memopt::models::LlamaConfig",
      {"loss_chunk_size", "-1"});
}

TEST_CASE("Llama::loss_sum with loss_chunk_size equals the full logits' loss", "[cross_entropy][llama]") {
  torch::manual_seed(13);
  memopt::models::Llama full(small_llama(true));
  auto chunked = copy_of(full, small_llama(true).loss_chunk_size(24));  // 80 rows: ragged chunks
  const auto batch = small_batch(2, 40, 97);
  check_same_training(chunked, full, batch, memopt::checkpoint::None{});
  check_same_training(chunked, full, batch, memopt::checkpoint::EveryBlock{});
}
