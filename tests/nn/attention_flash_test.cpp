// Tests for memopt/nn/attention_flash.hpp: memopt's brgemm kernels against the fp64 math path
// in fp32 (key blocks ragged and whole, query chunks one and several, queries fewer and more
// than keys, grouped KV heads, strided projections, odd lengths), in bf16 within LibTorch's own bf16 error (SDPA's;
// on AMX tiles, or widened to the fp32 kernels on every CPU), under
// autocast, its memory linear in T, and the calls it hands to attention_sdpa (key padding,
// dropout). attention_test.cpp runs it through the fixtures' cases and the LLaMA model too.
#include <catch2/catch.hpp>

#include <cmath>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <memopt/detail/autocast.hpp>
#include <memopt/nn/attention_flash.hpp>

#include "nn/fixtures.hpp"
#include "support.hpp"

using namespace memopt::test::nn;  // NOLINT: the fixtures of these tests

namespace {

struct Shape {
  std::string name;
  int64_t B = 2, H = 4, KV = 4, Tq = 37, Tk = 37, D = 16;
  bool causal = true;
};

std::vector<Shape> shapes() {
  return {
      {.name = "causal, one ragged key block"},
      {.name = "bidirectional", .causal = false},
      {.name = "causal, 3 key blocks, the last ragged", .B = 1, .H = 2, .KV = 2, .Tq = 130, .Tk = 130, .D = 64},
      {.name = "causal, exactly 2 key blocks", .B = 1, .Tq = 128, .Tk = 128, .D = 32},
      {.name = "causal GQA H=8 KV=2, odd length", .H = 8, .KV = 2, .Tq = 67, .Tk = 67},
      {.name = "causal, fewer queries than keys", .B = 1, .Tq = 40, .Tk = 100, .D = 64},
      {.name = "causal, more queries than keys", .B = 1, .Tq = 100, .Tk = 40},
      {.name = "bidirectional, queries and keys apart, D=2", .B = 1, .H = 2, .KV = 1, .Tq = 33, .Tk = 77, .D = 2},
      {.name = "causal GQA, 2 query chunks, the last ragged", .B = 1, .H = 2, .KV = 1, .Tq = 601, .Tk = 601},
      {.name = "bidirectional, 3 query chunks against few keys", .B = 1, .H = 2, .KV = 2, .Tq = 1100, .Tk = 70,
       .D = 8},
  };
}

// q (B, H, Tq, D), k and v (B, KV, Tk, D) as views of (B, T, heads, D) projections, leaves.
struct Problem {
  torch::Tensor q, k, v, grad_out;
};

Problem make_problem(const Shape& s, c10::ScalarType dtype) {
  torch::manual_seed(21);
  auto leaf = [&](int64_t heads, int64_t T) {
    return torch::randn({s.B, T, heads, s.D}).to(dtype).transpose(1, 2).requires_grad_();
  };
  Problem p{leaf(s.H, s.Tq), leaf(s.KV, s.Tk), leaf(s.KV, s.Tk), {}};
  p.grad_out = torch::randn({s.B, s.H, s.Tq, s.D}).to(dtype);
  return p;
}

// softmax(q kᵀ / sqrt(D)) v with SDPA's causal mask (top-left: query i sees keys j <= i), in
// fp64 on the problem's values, and its gradients.
Result reference(const Shape& s, const Problem& p) {
  auto q = p.q.detach().to(torch::kDouble).requires_grad_();
  auto k = p.k.detach().to(torch::kDouble).requires_grad_();
  auto v = p.v.detach().to(torch::kDouble).requires_grad_();
  const int64_t rep = s.H / s.KV;
  auto scores = torch::matmul(q, memopt::nn::repeat_kv(k, rep).transpose(-2, -1)) / std::sqrt(double(s.D));
  if (s.causal)
    scores = scores.masked_fill(torch::ones({s.Tq, s.Tk}, torch::kBool).tril().logical_not(), -INFINITY);
  auto out = torch::matmul(torch::softmax(scores, -1), memopt::nn::repeat_kv(v, rep));
  out.backward(p.grad_out.to(torch::kDouble));
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

// One kernel's forward and backward on fresh leaves holding the problem's values.
template <class Attention>
Result run_on(const Problem& p, c10::ScalarType dtype, Attention attention) {
  auto q = p.q.detach().to(dtype).requires_grad_();
  auto k = p.k.detach().to(dtype).requires_grad_();
  auto v = p.v.detach().to(dtype).requires_grad_();
  auto out = attention(q, k, v);
  out.backward(p.grad_out.to(out.scalar_type()));
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

Result flash(const Shape& s, const Problem& p, c10::ScalarType dtype) {
  return run_on(p, dtype, [&](auto& q, auto& k, auto& v) {
    auto y = memopt::nn::attention_flash(q, k, v, s.causal, 0.0, true);
    REQUIRE(y.grad_fn());
    CHECK(y.grad_fn()->name().find("FlashAttentionFunction") != std::string::npos);  // memopt's backward ran
    return y;
  });
}

Result sdpa(const Shape& s, const Problem& p, c10::ScalarType dtype) {
  return run_on(p, dtype, [&](auto& q, auto& k, auto& v) {
    return memopt::nn::attention_sdpa(q, k, v, s.causal, 0.0, true);
  });
}

Result as_double(const Result& r) {
  return {r.out.to(torch::kDouble), r.dq.to(torch::kDouble), r.dk.to(torch::kDouble), r.dv.to(torch::kDouble)};
}

// Whether memopt's kernels run in `dtype` here (bf16: on AMX tiles, else widened to fp32);
// skips the case (skip_case) where they do not (no batch-reduce GEMM in this LibTorch).
bool runs_here(c10::ScalarType dtype) {
  if (memopt::nn::flash_supported(c10::kCPU, dtype, 16, false, false)) return true;
  memopt::test::skip_case(std::string("attention_flash runs attention_sdpa here in ") + c10::toString(dtype) +
                          " (no brgemm in this LibTorch)");
  return false;
}

}  // namespace

TEST_CASE("attention_flash equals the fp64 math path in fp32, values and gradients", "[attention][flash]") {
  if (!runs_here(torch::kFloat)) return;
  for (const auto& s : shapes()) {
    DYNAMIC_SECTION(s.name) {
      const auto p = make_problem(s, torch::kFloat);
      check_close(as_double(flash(s, p, torch::kFloat)), reference(s, p), kFp32Atol, s.name);
    }
  }
}

TEST_CASE("attention_flash in bf16 stays within SDPA's own bf16 error", "[attention][flash]") {
  if (!runs_here(torch::kBFloat16)) return;
  for (const auto& s : shapes()) {
    DYNAMIC_SECTION(s.name) {
      const auto p = make_problem(s, torch::kBFloat16);  // bf16 values; the fp64 reference runs on them exactly
      const auto got = flash(s, p, torch::kBFloat16);
      REQUIRE(got.out.scalar_type() == torch::kBFloat16);
      REQUIRE(got.dk.scalar_type() == torch::kBFloat16);
      check_within_reference_error(as_double(got), as_double(sdpa(s, p, torch::kBFloat16)), reference(s, p),
                                   "flash bf16 vs fp64");
    }
  }
}

TEST_CASE("attention_flash's bf16 widened to its fp32 kernels (CPUs without AMX) stays within SDPA's bf16 error",
          "[attention][flash]") {
  if (!runs_here(torch::kFloat)) return;
  for (const auto& s : shapes()) {
    DYNAMIC_SECTION(s.name) {
      const auto p = make_problem(s, torch::kBFloat16);
      const auto got = run_on(p, torch::kBFloat16, [&](auto& q, auto& k, auto& v) {
        return memopt::detail::flash::FlashAttentionFunction::apply(q, k, v, s.causal, /*widen=*/true);
      });
      REQUIRE(got.out.scalar_type() == torch::kBFloat16);
      REQUIRE(got.dq.scalar_type() == torch::kBFloat16);
      REQUIRE(got.dv.scalar_type() == torch::kBFloat16);
      // The output is the fp32 kernel's, rounded once.
      const auto fp32 = memopt::detail::flash::FlashAttentionFunction::apply(
          p.q.detach().to(torch::kFloat), p.k.detach().to(torch::kFloat), p.v.detach().to(torch::kFloat), s.causal,
          false);
      CHECK(torch::equal(got.out, fp32.to(torch::kBFloat16)));
      check_within_reference_error(as_double(got), as_double(sdpa(s, p, torch::kBFloat16)), reference(s, p),
                                   "widened flash bf16 vs fp64");
    }
  }
}

TEST_CASE("attention_flash under bf16 autocast runs its bf16 kernel and returns fp32 gradients",
          "[attention][flash]") {
  if (!runs_here(torch::kBFloat16)) return;
  const Shape s{.name = "causal GQA", .H = 8, .KV = 2, .Tq = 80, .Tk = 80};
  const auto p = make_problem(s, torch::kBFloat16);
  const auto bf16 = flash(s, p, torch::kBFloat16);
  Result autocast;
  {
    memopt::detail::AutocastGuard guard({c10::kCPU, true, c10::kBFloat16});
    autocast = flash(s, p, torch::kFloat);
  }
  REQUIRE(autocast.out.scalar_type() == torch::kBFloat16);
  REQUIRE(autocast.dq.scalar_type() == torch::kFloat);
  check_close(autocast, bf16, 0.0, "flash under autocast vs bf16");
}

TEST_CASE("attention_flash hands key padding and dropout to attention_sdpa", "[attention][flash]") {
  auto q = torch::randn({2, 2, 24, 8});
  auto mask = torch::ones({2, 24}, torch::kBool);
  mask[0][3] = false;
  CHECK_FALSE(memopt::nn::flash_supported(q, 0.0, false, mask));
  CHECK(torch::equal(memopt::nn::attention_flash(q, q, q, false, 0.0, false, mask),
                     memopt::nn::attention_sdpa(q, q, q, false, 0.0, false, mask)));
  CHECK_FALSE(memopt::nn::flash_supported(q, 0.3, true));
  CHECK(memopt::nn::flash_supported(q, 0.3, false) ==
        memopt::nn::flash_supported(c10::kCPU, torch::kFloat, 8, false, false));  // dropout off in eval
  torch::manual_seed(9);
  const auto dropped = memopt::nn::attention_flash(q, q, q, true, 0.3, true);
  torch::manual_seed(9);
  CHECK(torch::equal(dropped, memopt::nn::attention_sdpa(q, q, q, true, 0.3, true)));
  CHECK_FALSE(memopt::nn::flash_supported(c10::kCPU, torch::kFloat, 7, false, false));  // an odd head width
}

TEST_CASE("attention_flash keeps memory linear in T, as SDPA does", "[attention][flash][memory]") {
  const Case c{.name = "memory", .B = 1, .H = 4, .KV = 4, .T = 2048, .D = 32};
  const auto in = make_inputs(c, torch::kFloat);
  const int64_t sdpa_peak = peak_of([&] { run(c, in, Path::kSdpa, torch::kFloat); });
  const int64_t flash_peak = peak_of([&] { run(c, in, Path::kFlash, torch::kFloat); });
  const int64_t scores = c.B * c.H * c.T * c.T * 4;
  INFO("peak tracked bytes: sdpa " << sdpa_peak << ", flash " << flash_peak << " (one (B, H, T, T) fp32 tensor: "
                                   << scores << ")");
  CHECK(flash_peak < scores / 4);
  CHECK(flash_peak <= sdpa_peak * 2);  // its per-thread buffers: two (64, T) fp32 blocks, Qᵀ, dOᵀ, Kᵀ, dQᵀ
}

TEST_CASE("attention_flash names a bad shape", "[attention][flash]") {
  if (!runs_here(torch::kFloat)) return;
  const auto q = torch::randn({1, 4, 8, 16});
  const auto k = torch::randn({1, 3, 8, 16});
  memopt::test::require_error([&] { memopt::nn::attention_flash(q, k, k, true, 0.0, false); },
                              "memopt::nn::attention_flash", {"KV dividing H", "[1, 3, 8, 16]"});
}
