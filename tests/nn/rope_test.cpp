// tests/nn/rope_test.cpp — memopt/nn/rope.hpp: the cos/sin tables are cos/sin of t · θ^(-2j/D)
// repeated over both halves (HF's layout), rotate_half maps (x1, x2) to (-x2, x1), and apply_rope
// rotates each pair (x_j, x_{j+D/2}) by its angle: values and gradients against the rotation
// written out in double, norms kept, q·k depending only on the positions' difference. The scaled
// frequencies (linear, dynamic, llama3) against their formulas written out in double, and against
// transformers' own LlamaRotaryEmbedding (tests/models/hf_llama_reference.py --rope) on the same cases.
#include <catch2/catch.hpp>

#include <sys/wait.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <numbers>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <memopt/io/safetensors.hpp>
#include <memopt/nn/rope.hpp>

#include "support.hpp"

using memopt::nn::RopeOptions;
using memopt::nn::RopeScaling;
using memopt::nn::RopeType;
using memopt::test::max_abs_diff;

namespace {

// angle[t][j] = t · θ^(-2j / D) for j < D / 2, in double: (T, D/2).
torch::Tensor angles(int64_t T, int64_t D, double theta) {
  auto opts = torch::TensorOptions().dtype(torch::kDouble);
  auto j = torch::arange(D / 2, opts);
  return torch::arange(T, opts).unsqueeze(1) * torch::exp(-(2.0 * j / static_cast<double>(D)) * std::log(theta));
}

// x (…, T, D) with each pair (x_j, x_{j+D/2}) at position t rotated by sign · angle[t][j].
torch::Tensor rotate_pairs(const torch::Tensor& x, const torch::Tensor& angle, double sign) {
  const int64_t half = x.size(-1) / 2;
  const auto x1 = x.narrow(-1, 0, half).to(torch::kDouble), x2 = x.narrow(-1, half, half).to(torch::kDouble);
  const auto c = angle.cos(), s = angle.sin() * sign;
  return torch::cat({x1 * c - x2 * s, x2 * c + x1 * s}, -1);
}

}  // namespace

TEST_CASE("rope_tables are cos and sin of t · theta^(-2j/D), the same over both halves", "[nn][rope]") {
  const int64_t T = 16, D = 8;
  for (const double theta : {10000.0, 500000.0, 2.0}) {
    INFO("theta " << theta);
    const auto [cos, sin] = memopt::nn::rope_tables(T, D, theta, torch::kCPU);
    REQUIRE(cos.sizes() == torch::IntArrayRef({T, D}));
    REQUIRE(sin.sizes() == torch::IntArrayRef({T, D}));
    CHECK(cos.scalar_type() == torch::kFloat);
    CHECK(sin.scalar_type() == torch::kFloat);
    const auto angle = angles(T, D, theta);
    // fp32 angles up to 15 rad carry ~15 · 2^-24 ≈ 1e-6 of error; a wrong frequency or
    // layout moves entries by far more than 1e-5.
    CHECK(max_abs_diff(cos, torch::cat({angle, angle}, -1).cos()) <= 1e-5);
    CHECK(max_abs_diff(sin, torch::cat({angle, angle}, -1).sin()) <= 1e-5);
  }
  // By hand: position 0 does not rotate; position 1's first frequency is 1 rad.
  const auto [cos, sin] = memopt::nn::rope_tables(2, 4, 10000.0, torch::kCPU);
  CHECK(torch::equal(cos[0], torch::ones({4})));
  CHECK(torch::equal(sin[0], torch::zeros({4})));
  CHECK(cos[1][0].item<double>() == Approx(std::cos(1.0)).epsilon(1e-6));
  CHECK(sin[1][2].item<double>() == Approx(std::sin(1.0)).epsilon(1e-6));
  CHECK(sin[1][1].item<double>() == Approx(std::sin(0.01)).epsilon(1e-5));  // 10000^(-2/4)
}

TEST_CASE("rotate_half maps the halves (x1, x2) to (-x2, x1)", "[nn][rope]") {
  CHECK(torch::equal(memopt::nn::rotate_half(torch::tensor({1.0F, 2.0F, 3.0F, 4.0F})),
                     torch::tensor({-3.0F, -4.0F, 1.0F, 2.0F})));
  const auto x = torch::arange(12, torch::kFloat).view({2, 6});
  CHECK(torch::equal(memopt::nn::rotate_half(x), torch::tensor({{-3.0F, -4.0F, -5.0F, 0.0F, 1.0F, 2.0F},
                                                                {-9.0F, -10.0F, -11.0F, 6.0F, 7.0F, 8.0F}})));
}

TEST_CASE("apply_rope rotates each pair of halves by its angle: values, gradients, norms", "[nn][rope]") {
  torch::manual_seed(4);
  const int64_t B = 2, H = 3, T = 12, D = 16;
  const double theta = 10000.0;
  const auto [cos, sin] = memopt::nn::rope_tables(T, D, theta, torch::kCPU);
  const auto angle = angles(T, D, theta);
  auto x = torch::randn({B, H, T, D}).requires_grad_();
  const auto y = memopt::nn::apply_rope(x, cos, sin);
  REQUIRE(y.sizes() == x.sizes());
  CHECK(y.scalar_type() == torch::kFloat);
  // Inputs ~1, angles up to 11 rad: the tables' ~1e-6 error plus fp32 rounding.
  CHECK(max_abs_diff(y, rotate_pairs(x.detach(), angle, 1.0)) <= 1e-5);
  // A rotation keeps every vector's length (squared lengths ~16: fp32 sums to ~1e-5).
  CHECK(max_abs_diff(y.pow(2).sum(-1), x.detach().pow(2).sum(-1)) <= 1e-4);
  // The gradient of a rotation is the rotation back (its transpose).
  const auto grad_out = torch::randn_like(y);
  y.backward(grad_out);
  CHECK(max_abs_diff(x.grad(), rotate_pairs(grad_out, angle, -1.0)) <= 1e-5);

  // bf16 in, bf16 out (the tables stay fp32).
  CHECK(memopt::nn::apply_rope(x.detach().to(torch::kBFloat16), cos, sin).scalar_type() == torch::kBFloat16);
}

TEST_CASE("after apply_rope, q · k depends on the positions' difference only", "[nn][rope]") {
  torch::manual_seed(5);
  const int64_t T = 10, D = 8;
  const auto [cos, sin] = memopt::nn::rope_tables(T, D, 10000.0, torch::kCPU);
  // One q and one k, placed at every position.
  const auto q = memopt::nn::apply_rope(torch::randn({1, 1, 1, D}).expand({1, 1, T, D}), cos, sin)[0][0];
  const auto k = memopt::nn::apply_rope(torch::randn({1, 1, 1, D}).expand({1, 1, T, D}), cos, sin)[0][0];
  const auto scores = q.matmul(k.t());  // (T, T): scores[m][n] = q_m · k_n
  for (int64_t shift = 1; shift < 4; ++shift) {
    INFO("shift " << shift);
    // (m, n) and (m + shift, n + shift) see the same offset; magnitudes ~D, fp32 error ~1e-5.
    const auto a = scores.narrow(0, 0, T - shift).narrow(1, 0, T - shift);
    const auto b = scores.narrow(0, shift, T - shift).narrow(1, shift, T - shift);
    CHECK(max_abs_diff(a, b) <= 1e-4);
  }
  // …and it does depend on the offset (the diagonal 0 differs from offset 3).
  CHECK(std::abs(scores[0][0].item<double>() - scores[0][3].item<double>()) > 1e-3);
}

namespace {

// A scaled-RoPE case: published values (Llama 3.1 8B, Llama 3.2 1B) and small ones whose bands
// and lengths the model tests (tests/models/llama_hf_test.cpp) use.
struct ScaledCase {
  std::string name;
  int64_t head_dim;
  double theta;
  RopeScaling scaling;
  int64_t max_position_embeddings, seq_len;
  RopeOptions options() const {
    return RopeOptions(head_dim).theta(theta).scaling(scaling).max_position_embeddings(max_position_embeddings);
  }
};

std::vector<ScaledCase> scaled_cases() {
  const auto llama3 = [](double factor, int64_t original) {
    return RopeScaling().type(RopeType::kLlama3).factor(factor).low_freq_factor(1.0).high_freq_factor(4.0)
        .original_max_position_embeddings(original);
  };
  const auto dynamic = RopeScaling().type(RopeType::kDynamic).factor(2.0);
  return {
      {"llama3_1_8b", 128, 500000.0, llama3(8.0, 8192), 131072, 32},
      {"llama3_2_1b", 64, 500000.0, llama3(32.0, 8192), 131072, 32},
      {"llama3_small", 24, 500000.0, llama3(8.0, 32), 64, 40},
      {"linear", 16, 10000.0, RopeScaling().type(RopeType::kLinear).factor(4.0), 64, 20},
      {"dynamic_past", 16, 10000.0, dynamic, 16, 40},
      {"dynamic_odd", 24, 500000.0, RopeScaling().type(RopeType::kDynamic).factor(3.0), 16, 23},
      {"dynamic_within", 16, 10000.0, dynamic, 16, 16},
      {"default", 16, 10000.0, RopeScaling(), 16, 16},
  };
}

// The case's inverse frequencies by their formulas, in double: (D/2).
std::vector<double> formula_inv_freq(const ScaledCase& c) {
  const auto& s = c.scaling;
  const auto D = static_cast<double>(c.head_dim);
  double base = c.theta;
  if (s.type() == RopeType::kDynamic && c.seq_len > c.max_position_embeddings)
    base *= std::pow(s.factor() * static_cast<double>(c.seq_len) / static_cast<double>(c.max_position_embeddings) -
                         (s.factor() - 1),
                     D / (D - 2));
  std::vector<double> out;
  for (int64_t j = 0; j < c.head_dim / 2; ++j) {
    const double f = std::pow(base, -2.0 * static_cast<double>(j) / D);
    if (s.type() == RopeType::kLinear) {
      out.push_back(f / s.factor());
    } else if (s.type() == RopeType::kLlama3) {
      const auto original = static_cast<double>(s.original_max_position_embeddings());
      const double wavelength = 2 * std::numbers::pi / f;
      if (wavelength < original / s.high_freq_factor()) {
        out.push_back(f);  // high frequencies: kept
      } else if (wavelength > original / s.low_freq_factor()) {
        out.push_back(f / s.factor());  // low frequencies: scaled
      } else {
        const double smooth =
            (original / wavelength - s.low_freq_factor()) / (s.high_freq_factor() - s.low_freq_factor());
        out.push_back((1 - smooth) * f / s.factor() + smooth * f);
      }
    } else {
      out.push_back(f);
    }
  }
  return out;
}

// transformers' LlamaRotaryEmbedding on every case (cos, sin, inv_freq per case name).
std::shared_ptr<const memopt::io::SafetensorsFile> transformers_rope(const memopt::test::TempDir& dir) {
  nlohmann::json cases = nlohmann::json::array();
  for (const auto& c : scaled_cases()) {
    nlohmann::json rope = {{"rope_type", memopt::nn::rope_type_name(c.scaling.type())}, {"rope_theta", c.theta}};
    if (c.scaling.type() != RopeType::kDefault) rope["factor"] = c.scaling.factor();
    if (c.scaling.type() == RopeType::kLlama3) {
      rope["low_freq_factor"] = c.scaling.low_freq_factor();
      rope["high_freq_factor"] = c.scaling.high_freq_factor();
      rope["original_max_position_embeddings"] = c.scaling.original_max_position_embeddings();
    }
    cases.push_back({{"name", c.name}, {"head_dim", c.head_dim}, {"seq_len", c.seq_len},
                     {"max_position_embeddings", c.max_position_embeddings}, {"rope_parameters", rope}});
  }
  memopt::test::write_text(dir.file("cases.json"), cases.dump(2));
  const std::string script = std::string(MEMOPT_TEST_BASELINES) + "/../models/hf_llama_reference.py";
  const std::string log = dir.file("rope.log");
  const int status = std::system((std::string(MEMOPT_TEST_PYTHON) + " '" + script + "' --rope '" +
                                  dir.file("cases.json") + "' '" + dir.file("rope.safetensors") + "' > '" + log +
                                  "' 2>&1").c_str());
  INFO(memopt::test::read_text(log));
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    FAIL(MEMOPT_TEST_PYTHON << " could not run transformers' LlamaRotaryEmbedding. HINT: run scripts/deps "
                               "(requirements.txt installs transformers into .venv)");
  return memopt::io::SafetensorsFile::open(dir.file("rope.safetensors"));
}

}  // namespace

TEST_CASE("scaled RoPE frequencies follow their formulas: linear, dynamic, llama3", "[nn][rope]") {
  for (const auto& c : scaled_cases()) {
    INFO(c.name);
    const auto got = memopt::nn::rope_inv_freq(c.options(), c.seq_len, torch::kCPU);
    REQUIRE(got.sizes() == torch::IntArrayRef({c.head_dim / 2}));
    CHECK(got.scalar_type() == torch::kFloat);
    const auto want = torch::tensor(formula_inv_freq(c), torch::kDouble);
    // fp32 powers carry ~1e-7 relative error (the dynamic base too); a wrong band, factor or
    // base exponent moves some frequency by far more than 1e-6.
    const auto relative = ((got.to(torch::kDouble) - want) / want).abs().max().item<double>();
    INFO("max relative difference from the formula " << relative);
    CHECK(relative <= 1e-6);
  }
  // llama3's bands, exactly: high frequencies are plain RoPE's, low ones plain RoPE's / factor.
  const auto c = scaled_cases().front();  // Llama 3.1 8B
  const auto plain = memopt::nn::rope_inv_freq(RopeOptions(c.head_dim).theta(c.theta), c.seq_len, torch::kCPU);
  const auto scaled = memopt::nn::rope_inv_freq(c.options(), c.seq_len, torch::kCPU);
  const auto wavelength = 2 * std::numbers::pi / plain.to(torch::kDouble);
  const auto high = wavelength < 8192.0 / 4, low = wavelength > 8192.0;
  REQUIRE(high.any().item<bool>());
  REQUIRE(low.any().item<bool>());
  REQUIRE(high.logical_or(low).logical_not().any().item<bool>());  // and some blended in between
  CHECK(torch::equal(scaled.masked_select(high), plain.masked_select(high)));
  CHECK(torch::equal(scaled.masked_select(low), (plain / 8.0).masked_select(low)));
  // Dynamic scaling changes nothing up to max_position_embeddings, then lowers every frequency but the first.
  const auto dynamic = scaled_cases()[4].options();
  CHECK(torch::equal(memopt::nn::rope_inv_freq(dynamic, 16, torch::kCPU),
                     memopt::nn::rope_inv_freq(RopeOptions(16), 16, torch::kCPU)));
  const auto past = memopt::nn::rope_inv_freq(dynamic, 17, torch::kCPU);
  CHECK((past.narrow(0, 1, 7) < memopt::nn::rope_inv_freq(RopeOptions(16), 17, torch::kCPU).narrow(0, 1, 7))
            .all()
            .item<bool>());
}

TEST_CASE("scaled RoPE tables equal transformers' LlamaRotaryEmbedding", "[nn][rope][hf]") {
  memopt::test::TempDir dir("memopt_rope");
  const auto theirs = transformers_rope(dir);
  for (const auto& c : scaled_cases()) {
    INFO(c.name);
    const auto inv_freq = memopt::nn::rope_inv_freq(c.options(), c.seq_len, torch::kCPU);
    const auto [cos, sin] = memopt::nn::rope_tables(c.seq_len, c.options(), torch::kCPU);  // (T, D) each
    const auto& want_inv = theirs->get(c.name + ".inv_freq");
    REQUIRE(inv_freq.sizes() == want_inv.sizes());
    REQUIRE(cos.sizes() == theirs->get(c.name + ".cos").sizes());
    // The same ops in the same order as transformers' (a Python re-run of memopt's ops gives the
    // same bits); 1e-6 relative and, for angles up to 40 rad, 1e-5 absolute leave room for
    // another LibTorch build, and fail on any formula difference.
    const double inv_diff = ((inv_freq - want_inv) / want_inv).abs().max().item<double>();
    const double table_diff = std::max(max_abs_diff(cos, theirs->get(c.name + ".cos")),
                                       max_abs_diff(sin, theirs->get(c.name + ".sin")));
    INFO("inv_freq max relative difference " << inv_diff << ", cos/sin max difference " << table_diff);
    CHECK(inv_diff <= 1e-6);
    CHECK(table_diff <= 1e-5);
  }
}
