// tests/nn/nf4_test.cpp — memopt/nn/nf4.hpp: codes, absmax, double-quant state and dequantised
// values equal bitsandbytes 0.50.2's quantize_4bit / dequantize_4bit on the CPU bit for bit
// (tests/baselines/nf4_reference.py, run with the tests' Python; skipped without bitsandbytes),
// the error stays within bitsandbytes' own and within half the widest NF4 gap per block, the
// nibble order and tie rule by hand, the bytes held, and each bad input's error with a HINT.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memopt/io/safetensors.hpp>
#include <memopt/nn/nf4.hpp>

#include "python_reference.hpp"
#include "support.hpp"

using memopt::nn::Nf4Options;
using memopt::nn::Nf4Tensor;
using memopt::nn::quantize_nf4;
using memopt::test::max_abs_diff;

namespace {

/// Same dtype, shape and bytes.
bool same_bits(const torch::Tensor& a, const torch::Tensor& b) {
  if (!a.defined() || !b.defined() || a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const torch::Tensor x = a.contiguous(), y = b.contiguous();
  return x.nbytes() == 0 || std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

/// Half the widest gap between neighbouring codes of a sorted map: the worst nearest-code
/// error in units of absmax (NF4: between -1 and -0.6961928, (1 - 0.6961928) / 2 = 0.1519).
double half_widest_gap(const torch::Tensor& map) {
  return ((map.slice(0, 1) - map.slice(0, 0, -1)).max() / 2).item<double>();
}

/// N(0, 0.02²) weights with an outlier (×25) every 97th element and, past 256 elements, the
/// all-zero block [64, 128): the outliers set a block's absmax, the zero block has absmax 0.
torch::Tensor weight(std::vector<int64_t> shape, torch::ScalarType dtype, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  torch::Tensor w = torch::randn(shape, gen) * 0.02;
  torch::Tensor flat = w.view({-1});
  flat.slice(0, 0, flat.numel(), 97).mul_(25);
  if (flat.numel() > 256) flat.slice(0, 64, 128).zero_();
  return w.to(dtype);
}

struct Nf4Case {
  std::string name;
  torch::Tensor w;
  int64_t blocksize;
};

/// The cases compared with bitsandbytes: fp32, bf16 and fp16, blocksize 32, 64 and 128, numels
/// that are not multiples of 64 (an odd one too), more than 256 blocks (the double
/// quantisation's second block), a single short block and a constant weight (both make
/// absmax - offset zero: the 1e-38 of a short zero block).
std::vector<Nf4Case> reference_cases() {
  return {
      {"f32_64x192_b64", weight({64, 192}, torch::kFloat, 1), 64},
      {"bf16_37x99_b64", weight({37, 99}, torch::kBFloat16, 2), 64},      // 3663: odd, 57 blocks + 15
      {"f16_300x256_b128", weight({300, 256}, torch::kHalf, 3), 128},     // 600 blocks: 256 + 256 + 88
      {"f32_5000_b128", weight({5000}, torch::kFloat, 4), 128},           // 39 blocks + 8
      {"f32_40_b64", weight({40}, torch::kFloat, 5), 64},                 // one short block
      {"f32_3x4x96_b32", weight({3, 4, 96}, torch::kFloat, 6), 32},
      {"f32_130x7_const_b64", torch::full({130, 7}, 0.5f), 64},           // 910: 14 blocks + 14, all absmax 0.5
  };
}

/// Writes the cases with memopt's safetensors writer, runs nf4_reference.py, opens its output.
std::shared_ptr<const memopt::io::SafetensorsFile> run_reference(const memopt::test::TempDir& dir,
                                                                 const std::vector<Nf4Case>& cases) {
  std::vector<std::pair<std::string, torch::Tensor>> in;
  for (const auto& c : cases) {
    in.emplace_back(c.name + "/w", c.w);
    in.emplace_back(c.name + "/blocksize", torch::tensor(c.blocksize, torch::kLong));
  }
  memopt::io::save_safetensors(dir.file("in.safetensors"), in);
  return memopt::test::run_reference_script(dir, "nf4_reference.py", "bitsandbytes");
}

/// max |w - deq| in double, over all elements.
double max_error(const torch::Tensor& w, const torch::Tensor& deq) { return max_abs_diff(w, deq); }

}  // namespace

TEST_CASE("quantize_nf4 and dequantize_nf4 equal bitsandbytes' quantize_4bit and dequantize_4bit bit for bit",
          "[nn][nf4]") {
  if (!memopt::test::python_imports("bitsandbytes, safetensors")) {
    memopt::test::skip_case(std::string(MEMOPT_TEST_PYTHON) +
                            " cannot import bitsandbytes and safetensors (HINT: run scripts/deps)");
    return;
  }
  memopt::test::TempDir dir("memopt_nf4_test");
  const std::vector<Nf4Case> cases = reference_cases();
  const auto ref = run_reference(dir, cases);
  CHECK(same_bits(memopt::nn::nf4_map(), ref->get("nf4_code", /*copy=*/true)));
  CHECK(same_bits(memopt::nn::detail::nested_map(), ref->get("dynamic_code", /*copy=*/true)));
  // memopt's 8-bit optimizer map holds the same codes up to the last bit (it computes in double).
  CHECK(max_abs_diff(memopt::optim::dynamic_map(true), ref->get("dynamic_code")) <= 1e-7);

  const torch::Tensor nested = memopt::nn::detail::nested_map();
  int64_t cpu_codes = 0, cpu_neighbours = 0;
  for (const auto& c : cases) {
    INFO(c.name << ": shape " << c.w.sizes() << ", " << c.w.scalar_type() << ", blocksize " << c.blocksize);
    auto get = [&](const std::string& key) { return ref->get(c.name + "/" + key, /*copy=*/true); };
    const torch::Tensor w32 = c.w.to(torch::kFloat);

    // ---- fp32 absmax per block ----
    const Nf4Tensor q = quantize_nf4(c.w, Nf4Options().blocksize(c.blocksize).double_quant(false));
    CHECK(same_bits(q.packed, get("packed")));  // bnb's (⌈n/2⌉, 1) flattened
    CHECK(same_bits(q.absmax, get("absmax")));
    CHECK(same_bits(q.dequantize(c.w.scalar_type()), get("deq")));
    CHECK(same_bits(q.dequantize(torch::kFloat), get("deq_f32")));
    CHECK(max_error(w32, q.dequantize(torch::kFloat)) <= max_error(w32, get("deq_f32")));

    // ---- double quantisation, against bnb's nearest-code (pure-torch) kernel of the 8-bit step ----
    const Nf4Tensor d = quantize_nf4(c.w, Nf4Options().blocksize(c.blocksize));
    REQUIRE(d.double_quant());
    CHECK(same_bits(d.packed, get("packed")));
    CHECK(same_bits(d.absmax_offset, get("dq/offset")));
    CHECK(same_bits(d.absmax_quant.codes, get("dq/codes")));
    CHECK(same_bits(d.absmax_quant.absmax, get("dq/absmax2")));
    CHECK(same_bits(d.dequantize(c.w.scalar_type()), get("dq/deq")));
    CHECK(same_bits(d.dequantize(torch::kFloat), get("dq/deq_f32")));
    CHECK(max_error(w32, d.dequantize(torch::kFloat)) <= max_error(w32, get("dq/deq_f32")));

    // ---- and as quantize_4bit(compress_statistics=True) runs on the CPU ----
    // Its C kernel rounds v = (absmax - offset) / absmax2 through a table of 65536 steps over
    // [-1, 1]: rounding v by at most one step 2/65535 first, so its code may be a neighbour of
    // the nearest, never farther from v than the nearest code + 2 · (1/65535). A zero 256-block
    // keeps absmax2 0 and code 0 there (-1 · 0: the same dequantised 0).
    CHECK(same_bits(d.absmax_offset, get("dq/cpu_offset")));
    const torch::Tensor absmax2 = d.absmax_quant.absmax;  // (⌈blocks/256⌉,)
    const torch::Tensor zero_block = absmax2 <= 1e-37;    // the 1e-38 of a zero short block
    CHECK(same_bits(absmax2.masked_fill(zero_block, 0), get("dq/cpu_absmax2")));
    const int64_t blocks = q.num_blocks();
    const torch::Tensor scale2 = absmax2.repeat_interleave(memopt::optim::kQuantBlockSize).slice(0, 0, blocks);
    const torch::Tensor v = (q.absmax - d.absmax_offset) / scale2.masked_fill(scale2 <= 1e-37, 1);  // (blocks,)
    const torch::Tensor counted = (scale2 > 1e-37);
    const torch::Tensor cpu = get("dq/cpu_codes").to(torch::kLong), mine = d.absmax_quant.codes.to(torch::kLong);
    const torch::Tensor extra = ((v - nested.index_select(0, cpu)).abs() - (v - nested.index_select(0, mine)).abs())
                                    .to(torch::kDouble).masked_select(counted);
    if (extra.numel() > 0) CHECK(extra.max().item<double>() <= 2.0 / 65535 + 1e-6);
    cpu_codes += counted.sum().item<int64_t>();
    cpu_neighbours += (cpu != mine).logical_and(counted).sum().item<int64_t>();
  }
  WARN("bitsandbytes' CPU kernel took a neighbour of the nearest code for " << cpu_neighbours << " of " << cpu_codes
       << " double-quantised absmax (memopt and bnb's pure-torch kernel: the nearest)");
}

TEST_CASE("NF4's error per block is at most half the widest code gap times the block's absmax", "[nn][nf4]") {
  const double half_gap = half_widest_gap(memopt::nn::nf4_map());  // 0.1519
  const double half_gap8 = half_widest_gap(memopt::nn::detail::nested_map());  // 0.00703
  CHECK(half_gap == Approx((1 - 0.6961928009986877) / 2));
  const std::vector<std::pair<torch::Tensor, int64_t>> inputs{
      {weight({96, 160}, torch::kFloat, 11), 64},    {weight({37, 99}, torch::kBFloat16, 12), 64},
      {weight({70000}, torch::kFloat, 13), 128},     {weight({5, 7, 11}, torch::kHalf, 14), 32},
      {weight({1024, 40}, torch::kFloat, 15), 4096}, {torch::randn({3, 300}) * 1e-30, 256},  // tiny values
  };
  for (const auto& [w, bs] : inputs) {
    for (const bool dq : {false, true}) {
      INFO("shape " << w.sizes() << ", " << w.scalar_type() << ", blocksize " << bs << (dq ? ", double quant" : ""));
      const Nf4Tensor q = quantize_nf4(w, Nf4Options().blocksize(bs).double_quant(dq));
      const torch::Tensor deq = q.dequantize(torch::kFloat);
      REQUIRE(deq.sizes() == w.sizes());
      CHECK(q.dequantize().scalar_type() == w.scalar_type());
      const int64_t n = w.numel(), blocks = q.num_blocks(), pad = blocks * bs - n;
      const torch::Tensor w32 = w.to(torch::kFloat).reshape({-1});
      const torch::Tensor absmax = torch::constant_pad_nd(w32, {0, pad}).view({blocks, bs}).abs().amax(1);  // (blocks,)
      const torch::Tensor err =
          torch::constant_pad_nd((deq.reshape({-1}) - w32).abs(), {0, pad}).view({blocks, bs}).amax(1);  // (blocks,)
      // Double quantisation moves each absmax by at most half the 8-bit map's widest gap x absmax2.
      const torch::Tensor moved = (q.block_absmax() - absmax).abs();  // (blocks,)
      if (dq) {
        const torch::Tensor absmax2 =
            q.absmax_quant.absmax.repeat_interleave(memopt::optim::kQuantBlockSize).slice(0, 0, blocks);
        CHECK((moved <= absmax2 * (half_gap8 * (1 + 1e-5)) + absmax * 1e-6 + 1e-37).all().item<bool>());
      } else {
        CHECK((moved <= 1e-37).all().item<bool>());  // exact but for the short zero block's 1e-38
      }
      const torch::Tensor bound = absmax * (half_gap + 1e-6) + moved * (1 + 1e-6) + 1e-37;
      INFO("worst error / bound " << (err / bound).max().item<double>());
      CHECK((err <= bound).all().item<bool>());

      // Without double quantisation the code is the nearest: no neighbour is closer to w / absmax.
      if (!dq) {
        const torch::Tensor map = memopt::nn::nf4_map();
        const torch::Tensor idx = torch::stack({q.packed.bitwise_right_shift(4), q.packed.bitwise_and(15)}, 1)
                                      .view({-1}).slice(0, 0, n).to(torch::kLong);  // (n,)
        const torch::Tensor y = w32 / absmax.clamp_min(1e-38).repeat_interleave(bs).slice(0, 0, n);
        const torch::Tensor dist = (y - map.index_select(0, idx)).abs();
        CHECK((dist <= (y - map.index_select(0, (idx - 1).clamp_min(0))).abs() + 1e-6).all().item<bool>());
        CHECK((dist <= (y - map.index_select(0, (idx + 1).clamp_max(15))).abs() + 1e-6).all().item<bool>());
      }
    }
  }
}

TEST_CASE("NF4 packs the even element in the high nibble, and a value on a midpoint takes the lower code",
          "[nn][nf4]") {
  const auto& codes = memopt::nn::kNf4Codes;
  const float mid = (codes[14] + codes[15]) / 2;  // the boundary between 0.7229568 and 1, in fp32
  // One short block (absmax 1): 1 -> 15, -1 -> 0, 0 -> 7, 0.5 -> 12, -0.25 -> 4, mid -> 14, just above -> 15.
  const torch::Tensor w =
      torch::tensor({1.0f, -1.0f, 0.0f, 0.5f, -0.25f, mid, std::nextafter(mid, 2.0f)}, torch::kFloat);
  const Nf4Tensor q = quantize_nf4(w, Nf4Options().double_quant(false));
  REQUIRE(q.packed.numel() == 4);  // 7 codes and the pad nibble 7 (the code of 0)
  CHECK(q.packed[0].item<int>() == 0xF0);
  CHECK(q.packed[1].item<int>() == 0x7C);
  CHECK(q.packed[2].item<int>() == 0x4E);
  CHECK(q.packed[3].item<int>() == 0xF7);
  CHECK(q.absmax.item<float>() == 1.0f);
  CHECK(torch::equal(q.dequantize(torch::kFloat),
                     torch::tensor({1.0f, -1.0f, 0.0f, codes[12], codes[4], codes[14], 1.0f})));
}

TEST_CASE("quantize_nf4 computes in fp32: a float64 or strided weight quantises as its fp32 contiguous copy",
          "[nn][nf4]") {
  const torch::Tensor w64 = weight({48, 80}, torch::kDouble, 21);
  const Nf4Tensor a = quantize_nf4(w64), b = quantize_nf4(w64.to(torch::kFloat));
  CHECK(torch::equal(a.packed, b.packed));
  CHECK(torch::equal(a.block_absmax(), b.block_absmax()));
  CHECK(a.dequantize().scalar_type() == torch::kDouble);
  CHECK(a.shape == std::vector<int64_t>({48, 80}));
  const torch::Tensor base = weight({80, 48}, torch::kFloat, 22).requires_grad_();
  const torch::Tensor t = base.t();  // (48, 80), not contiguous, requires grad
  const Nf4Tensor c = quantize_nf4(t), e = quantize_nf4(t.detach().contiguous());
  CHECK(torch::equal(c.packed, e.packed));
  CHECK(torch::equal(c.dequantize(), e.dequantize()));
  CHECK_FALSE(c.dequantize().requires_grad());
}

TEST_CASE("Nf4Tensor::nbytes is 0.5 B per parameter + 4 B per block, or + 1 B per block + 4 per 256 + 4",
          "[nn][nf4]") {
  const torch::Tensor w = weight({512, 2048}, torch::kBFloat16, 31);  // 2^20 parameters, 16384 blocks of 64
  const int64_t n = w.numel();
  const Nf4Tensor plain = quantize_nf4(w, Nf4Options().double_quant(false));
  const Nf4Tensor dq = quantize_nf4(w);
  CHECK(plain.nbytes() == 589824);  // 524288 + 4 · 16384: 0.5625 B/param
  CHECK(plain.nbytes() == n / 2 + 4 * n / 64);
  CHECK(dq.nbytes() == 540932);     // 524288 + 16384 + 4 · 64 + 4: 0.5159 B/param
  CHECK(static_cast<double>(dq.nbytes()) == static_cast<double>(n) * (0.5 + 1.0 / 64 + 4.0 / (64 * 256)) + 4);
  CHECK(quantize_nf4(w, Nf4Options().blocksize(128).double_quant(false)).nbytes() == n / 2 + 4 * n / 128);
  // Short last blocks: 201 elements are 101 bytes (one pad nibble) and 4 blocks, 303 are 152 and 5.
  CHECK(quantize_nf4(torch::randn({3, 67}), Nf4Options().double_quant(false)).nbytes() == 101 + 4 * 4);
  CHECK(quantize_nf4(torch::randn({3, 101}), Nf4Options().double_quant(false)).nbytes() == 152 + 4 * 5);
  CHECK(quantize_nf4(torch::randn({3, 101})).nbytes() == 152 + 5 + 4 + 4);
}

TEST_CASE("quantize_nf4 and dequantize_nf4 reject bad inputs with the value seen and a HINT", "[nn][nf4]") {
  auto rejects = [](const torch::Tensor& w, const Nf4Options& options, const std::vector<std::string>& parts) {
    memopt::test::require_error([&] { quantize_nf4(w, options); }, "memopt::nn::quantize_nf4", parts);
  };
  const Nf4Options defaults;
  rejects(torch::arange(10), defaults, {"floating-point", "Long"});
  rejects(torch::ones({4}, torch::kBool), defaults, {"floating-point", "Bool"});
  rejects(torch::Tensor(), defaults, {"undefined"});
  rejects(torch::zeros({0, 4}), defaults, {"empty", "[0, 4]"});
  for (const int64_t bs : {0, -64, 16, 48, 100, 8192})
    rejects(torch::ones({256}), Nf4Options().blocksize(bs), {"blocksize", "32 to 4096", "(got " + std::to_string(bs)});
  torch::Tensor w = torch::ones({2, 8});
  w[0][5] = std::numeric_limits<float>::quiet_NaN();
  rejects(w, defaults, {"1 non-finite", "nan", "flat index 5"});
  w[0][5] = 1;
  w[0][3] = std::numeric_limits<float>::infinity();
  w[1][7] = -std::numeric_limits<float>::infinity();
  rejects(w, defaults, {"2 non-finite", "inf", "flat index 3"});
  rejects(torch::tensor({1.0, 1e300}, torch::kDouble), defaults, {"1 non-finite", "1e+300", "flat index 1", "fp32"});

  const Nf4Tensor q = quantize_nf4(torch::randn({4, 64}));
  memopt::test::require_error([&] { memopt::nn::dequantize_nf4(q, torch::kLong); }, "memopt::nn::dequantize_nf4",
                              {"floating type", "Long"});
  Nf4Tensor cut = q;
  cut.packed = q.packed.slice(0, 0, 100);
  memopt::test::require_error([&] { cut.dequantize(); }, "memopt::nn::dequantize_nf4",
                              {"256 elements need 128 packed uint8 bytes", "got 100"});
  Nf4Tensor plain = quantize_nf4(torch::randn({4, 64}), Nf4Options().double_quant(false));
  plain.absmax = plain.absmax.slice(0, 0, 3);
  memopt::test::require_error([&] { plain.dequantize(); }, "memopt::nn::dequantize_nf4",
                              {"need 4 absmax", "got 3"});
}
