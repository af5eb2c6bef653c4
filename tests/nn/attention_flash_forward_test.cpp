// Tests for memopt/nn/attention_flash_forward.hpp: its two forwards (rows and online) each
// against the fp64 math path in fp32 and within SDPA's own error in bf16, on ragged and whole
// chunks, causal and not, queries fewer and more than keys, grouped KV heads, strided
// projections and odd lengths; their log-sum-exps against logsumexp; attention_forward past the row forward's limit;
// max_of, whose integer keys must order like the floats; pack_rows, bit for bit against an
// interleave in LibTorch. attention_flash_test.cpp checks the
// forward and backward together through attention_flash.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <memopt/nn/attention_flash_forward.hpp>

#include "support.hpp"

#if MEMOPT_HAS_BRGEMM

namespace {

namespace fwd = memopt::detail::flash;

struct ForwardShape {
  std::string name;
  int64_t B = 2, H = 4, KV = 4, Tq = 37, Tk = 37, D = 16;
  bool causal = true;
};

std::vector<ForwardShape> forward_shapes() {
  return {
      {.name = "causal, one ragged query chunk"},
      {.name = "bidirectional", .causal = false},
      {.name = "causal, 3 query chunks, the last ragged", .B = 1, .H = 2, .KV = 2, .Tq = 150, .Tk = 150, .D = 64},
      {.name = "causal GQA H=8 KV=2, odd length", .H = 8, .KV = 2, .Tq = 67, .Tk = 67},
      {.name = "causal, fewer queries than keys", .B = 1, .Tq = 40, .Tk = 129, .D = 64},
      {.name = "causal, more queries than keys, odd keys", .B = 1, .Tq = 100, .Tk = 41},
      {.name = "bidirectional, queries and keys apart, D=2", .B = 1, .H = 2, .KV = 1, .Tq = 33, .Tk = 77, .D = 2},
  };
}

// q (B, H, Tq, D), k and v (B, KV, Tk, D): views of (B, T, heads, D) projections.
struct QKV {
  torch::Tensor q, k, v;
};

QKV make_qkv(const ForwardShape& s, c10::ScalarType dtype) {
  torch::manual_seed(5);
  auto proj = [&](int64_t heads, int64_t T) { return torch::randn({s.B, T, heads, s.D}).to(dtype).transpose(1, 2); };
  return {proj(s.H, s.Tq), proj(s.KV, s.Tk), proj(s.KV, s.Tk)};
}

double scale_of(const ForwardShape& s) { return 1.0 / std::sqrt(double(s.D)); }

// softmax(q kᵀ · scale) v in fp64 with SDPA's top-left causal mask, and logsumexp of the scaled
// scores.
std::pair<torch::Tensor, torch::Tensor> forward_reference(const ForwardShape& s, const QKV& in) {
  const int64_t rep = s.H / s.KV;
  auto q = in.q.to(torch::kDouble);
  auto k = memopt::nn::repeat_kv(in.k, rep).to(torch::kDouble);
  auto v = memopt::nn::repeat_kv(in.v, rep).to(torch::kDouble);
  auto scores = torch::matmul(q, k.transpose(-2, -1)) * scale_of(s);
  if (s.causal) scores = scores.masked_fill(torch::ones({s.Tq, s.Tk}, torch::kBool).tril().logical_not(), -INFINITY);
  return {torch::matmul(torch::softmax(scores, -1), v), torch::logsumexp(scores, -1)};
}

double forward_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
}

bool bf16_runs_here() {
  if (memopt::nn::flash_supported(c10::kCPU, torch::kFloat, 16, false, false) && memopt::detail::bf16_tiles())
    return true;  // elsewhere attention_flash widens bf16 to these forwards' fp32 kernels
  memopt::test::skip_case("no bf16 brgemm kernels for this CPU (cpublas::could_pack is false: no AMX)");
  return false;
}

using Forward = std::pair<torch::Tensor, torch::Tensor> (*)(const torch::Tensor&, const torch::Tensor&,
                                                            const torch::Tensor&, bool, double);

const std::vector<std::pair<std::string, Forward>>& forwards() {
  static const std::vector<std::pair<std::string, Forward>> all{{"rows", &fwd::attention_forward_rows},
                                                                {"online", &fwd::attention_forward_online}};
  return all;
}

}  // namespace

TEST_CASE("flash forwards equal the fp64 math path in fp32, output and log-sum-exp", "[attention][flash]") {
  for (const auto& s : forward_shapes()) {
    const auto in = make_qkv(s, torch::kFloat);
    const auto [want_out, want_lse] = forward_reference(s, in);
    for (const auto& [name, forward] : forwards()) {
      DYNAMIC_SECTION(s.name << " / " << name) {
        const auto [out, lse] = forward(in.q, in.k, in.v, s.causal, scale_of(s));
        REQUIRE(out.sizes() == want_out.sizes());
        REQUIRE(lse.scalar_type() == torch::kFloat);
        CHECK(out.transpose(1, 2).is_contiguous());  // (B, Tq, H, D) memory, as SDPA's
        CHECK(forward_diff(out, want_out) <= 1e-5);
        CHECK(forward_diff(lse, want_lse) <= 1e-5);
      }
    }
  }
}

TEST_CASE("flash forwards in bf16 stay within SDPA's own bf16 error", "[attention][flash]") {
  if (!bf16_runs_here()) return;
  for (const auto& s : forward_shapes()) {
    const auto in = make_qkv(s, torch::kBFloat16);  // bf16 values; the fp64 reference runs on them exactly
    const auto [want_out, want_lse] = forward_reference(s, in);
    const int64_t rep = s.H / s.KV;
    const auto sdpa = at::_scaled_dot_product_flash_attention_for_cpu(
        in.q, memopt::nn::repeat_kv(in.k, rep), memopt::nn::repeat_kv(in.v, rep), 0.0, s.causal, {}, scale_of(s));
    const double own = forward_diff(std::get<0>(sdpa), want_out);
    for (const auto& [name, forward] : forwards()) {
      DYNAMIC_SECTION(s.name << " / " << name) {
        const auto [out, lse] = forward(in.q, in.k, in.v, s.causal, scale_of(s));
        REQUIRE(out.scalar_type() == torch::kBFloat16);
        INFO("max abs diff " << forward_diff(out, want_out) << "; SDPA's " << own);
        CHECK(forward_diff(out, want_out) <= 2 * own + 1e-2);
        CHECK(forward_diff(lse, want_lse) <= 1e-4);  // scores in fp32 from exact bf16 products
      }
    }
  }
}

TEST_CASE("attention_forward past the fp32 row limit equals the math path", "[attention][flash]") {
  const int64_t past = fwd::row_keys(torch::kFloat) + 3;
  const ForwardShape s{.name = "past the fp32 row limit", .B = 1, .H = 2, .KV = 1, .Tq = 70, .Tk = past, .D = 4};
  const auto in = make_qkv(s, torch::kFloat);
  const auto [want_out, want_lse] = forward_reference(s, in);
  const auto [out, lse] = fwd::attention_forward(in.q, in.k, in.v, s.causal, scale_of(s));
  CHECK(forward_diff(out, want_out) <= 1e-5);
  CHECK(forward_diff(lse, want_lse) <= 1e-5);
  CHECK(fwd::row_keys(torch::kBFloat16) >= fwd::row_keys(torch::kFloat));
}

TEST_CASE("max_of orders floats as comparisons do", "[attention][flash]") {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<std::vector<float>> rows{
      {-3.f}, {-3.f, -7.f, -2.5f}, {-0.f, -1e-30f, -5.f}, {1.f, -inf, 2.f, 0.f}, {-inf, -inf}, {-2.f, inf, 3.f}};
  for (const auto& row : rows) {
    float want = row[0];
    for (float x : row) want = std::max(want, x);
    CHECK(fwd::max_of(row.data(), static_cast<int64_t>(row.size())) == want);
  }
  torch::manual_seed(3);
  const auto x = torch::randn({1000}) * 50;  // both signs, past one vector's width
  CHECK(fwd::max_of(x.data_ptr<float>(), x.numel()) == x.max().item<float>());
  const auto negative = -x.abs() - 1;
  CHECK(fwd::max_of(negative.data_ptr<float>(), negative.numel()) == negative.max().item<float>());
}

TEST_CASE("pack_rows interleaves row pairs as VNNI words, an odd last row with zeros", "[attention][flash]") {
  torch::manual_seed(4);
  for (const int64_t rows : {1, 6, 7}) {
    const int64_t cols = 37, stride = 45, ld = 40;  // a row stride past cols, a leading dimension past cols
    const auto src = torch::randn({rows, stride}).to(torch::kBFloat16);
    const auto rows2 = rows + rows % 2;
    // Pair p at dst + 2p · ld; 7 marks what pack_rows must not touch.
    auto dst = torch::full({rows2 / 2, 2 * ld}, 7.f, torch::kBFloat16);
    fwd::pack_rows(src.data_ptr<at::BFloat16>(), rows, cols, stride, dst.data_ptr<at::BFloat16>(), ld);
    // Want: pair p's word c holds (row 2p, row 2p + 1) of column c.
    const auto padded = torch::cat({src.narrow(1, 0, cols), torch::zeros({rows % 2, cols}, torch::kBFloat16)});
    const auto want = padded.view({rows2 / 2, 2, cols}).transpose(1, 2).reshape({rows2 / 2, 2 * cols});
    CHECK(torch::equal(dst.narrow(1, 0, 2 * cols), want));
    CHECK(dst.narrow(1, 2 * cols, 2 * (ld - cols)).eq(7).all().item<bool>());
  }
}

#endif
