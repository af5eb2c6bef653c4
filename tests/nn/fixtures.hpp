// tests/nn/fixtures.hpp — what the attention, cross-entropy and fused-kernel tests share: tolerances from
// the references' own errors, random inputs, the math path and the full logits' loss as references.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
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


#include "support.hpp"

namespace memopt::test::nn {

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

using memopt::test::max_abs_diff;

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

inline Inputs make_inputs(const Case& c, c10::ScalarType dtype) {
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

enum class Path { kMath, kBlockwise, kSdpa, kAuto, kFlash };

// Forward + backward of one path on fresh leaves holding the inputs' values.
inline Result run(const Case& c, const Inputs& in, Path path, c10::ScalarType dtype) {
  auto q = in.q.detach().to(dtype).requires_grad_();
  auto k = in.k.detach().to(dtype).requires_grad_();
  auto v = in.v.detach().to(dtype).requires_grad_();
  torch::Tensor out;
  if (path == Path::kSdpa) {
    out = memopt::nn::attention_sdpa(q, k, v, c.causal, 0.0, false, in.mask);
  } else if (path == Path::kFlash) {
    out = memopt::nn::attention_flash(q, k, v, c.causal, 0.0, false, in.mask);
  } else if (path == Path::kAuto) {
    out = memopt::nn::attention_auto(q, k, v, c.causal, 0.0, false, in.mask, c.q_block, c.kv_block);
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

inline void check_close(const Result& got, const Result& want, double atol, const std::string& what) {
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
inline void check_within_reference_error(const Result& got, const Result& baseline, const Result& reference,
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

inline std::vector<Case> attention_cases() {
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

inline memopt::models::LlamaConfig small_llama(bool causal) {
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
inline memopt::models::Llama copy_of(const memopt::models::Llama& source, const memopt::models::LlamaConfig& config) {
  memopt::models::Llama model(config);
  torch::NoGradGuard no_grad;
  const auto from = source->named_parameters();
  for (auto& item : model->named_parameters()) item.value().copy_(from[item.key()]);
  return model;
}

inline memopt::Batch small_batch(int64_t B, int64_t T, int64_t vocab) {
  torch::manual_seed(3);
  auto tokens = torch::randint(vocab, {B, T + 1});
  auto targets = tokens.slice(1, 1).clone();
  targets.slice(1, 0, 5).fill_(memopt::kIgnoreIndex);  // a prompt that takes no loss
  return {tokens.slice(1, 0, T).contiguous(), targets};
}

// Loss, then every parameter's gradient, compared relative to the largest reference entry.
template <class Recompute>
inline void check_same_training(memopt::models::Llama& got, memopt::models::Llama& want, const memopt::Batch& batch,
                         const Recompute& ckpt) {
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

inline torch::Tensor full_cross_entropy_sum(const torch::Tensor& hidden, const torch::Tensor& weight,
                                     const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(
      hidden.matmul(weight.t()).to(torch::kFloat), targets,
      torch::nn::functional::CrossEntropyFuncOptions().ignore_index(memopt::kIgnoreIndex).reduction(torch::kSum));
}

// ---- The fused kernels against their composites (tests/nn/fused*_test.cpp) ----

// fp32: the kernels sum x² and g·x̂ in 16 partial sums (the composite in ATen's order):
// measured ≤ 3.7e-7 of the largest entry; 1e-6 fails on a real mistake (a dropped eps, a
// mean over C − 1, a missing bf16 rounding move entries by ≥ 1e-3 here).
constexpr double kFusedFp32Rel = 1e-6;

struct FusedGrads {
  torch::Tensor y, da, db;
};

// y = f(a, b) and the gradients of sum(y · dy), in double for comparison.
template <class F>
FusedGrads run_both(F&& f, const torch::Tensor& a0, const torch::Tensor& b0, const torch::Tensor& dy) {
  auto a = a0.detach().clone().requires_grad_(), b = b0.detach().clone().requires_grad_();
  auto y = f(a, b);
  y.backward(dy.to(y.scalar_type()));
  return {y.detach().to(torch::kDouble), a.grad().to(torch::kDouble), b.grad().to(torch::kDouble)};
}

inline double fused_rel_diff(const torch::Tensor& got, const torch::Tensor& want) {
  return memopt::test::max_abs_diff(got, want) / std::max(want.abs().max().item<double>(), 1e-30);
}

// fp32 kernel vs composite within kFusedFp32Rel, for y and both gradients.
inline void check_fused_fp32(const FusedGrads& got, const FusedGrads& want) {
  INFO("y " << fused_rel_diff(got.y, want.y) << ", da " << fused_rel_diff(got.da, want.da) << ", db "
            << fused_rel_diff(got.db, want.db));
  CHECK(fused_rel_diff(got.y, want.y) <= kFusedFp32Rel);
  CHECK(fused_rel_diff(got.da, want.da) <= kFusedFp32Rel);
  CHECK(fused_rel_diff(got.db, want.db) <= kFusedFp32Rel);
}

// bf16: the kernel's error against fp64 within twice the composite's own (plus a bf16 ulp at
// the largest entry, for entries the composite happens to round exactly).
inline void check_fused_bf16(const FusedGrads& got, const FusedGrads& composite, const FusedGrads& exact) {
  auto within = [](const torch::Tensor& g, const torch::Tensor& c, const torch::Tensor& e, const char* what) {
    const double ulp = std::ldexp(e.abs().max().item<double>(), -8);
    INFO(what << ": fused error " << memopt::test::max_abs_diff(g, e) << ", composite error "
              << memopt::test::max_abs_diff(c, e));
    CHECK(memopt::test::max_abs_diff(g, e) <= 2 * memopt::test::max_abs_diff(c, e) + ulp);
  };
  within(got.y, composite.y, exact.y, "y");
  within(got.da, composite.da, exact.da, "da");
  within(got.db, composite.db, exact.db, "db");
}

}  // namespace memopt::test::nn
