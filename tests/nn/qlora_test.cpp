// tests/nn/qlora_test.cpp — memopt/nn/qlora.hpp: nf4_linear's forward equals torch::linear with
// the dequantised weight bit for bit in fp32 and its dX the dense path's, with no gradient for the
// weight or bias; a quantised memopt::nn::Linear with an adapter equals one over a dense Linear
// holding the dequantised weight (output, dX, lora_A and lora_B gradients) in fp32, and within
// twice the dense path's own error against fp64 in bf16 and under bf16 autocast; the graph keeps the NF4 buffers themselves and
// nothing of the dense weight's size between forward and backward (memopt's tracker); the NF4
// state is buffers a state dict saves and loads; and each bad input's error carries a HINT.
#include <catch2/catch.hpp>

#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memopt/detail/autocast.hpp>
#include <memopt/memory/tracker.hpp>
#include <memopt/nn/linear.hpp>
#include <memopt/nn/lora.hpp>
#include <memopt/nn/nf4.hpp>
#include <memopt/nn/qlora.hpp>

#include "support.hpp"

using memopt::nn::Linear;
using memopt::nn::LoraOptions;
using memopt::nn::Nf4Options;
using memopt::nn::Nf4Tensor;
using memopt::nn::nf4_linear;
using memopt::nn::quantize_nf4;
using memopt::test::max_abs_diff;
using memopt::test::require_error;

namespace {

/// A Linear (in -> out) with N(0, 0.05²) weights and N(0, 0.1²) bias from `seed` alone, in `dtype`.
torch::nn::Linear make_linear(int64_t in, int64_t out, bool bias, uint64_t seed,
                              torch::Dtype dtype = torch::kFloat) {
  torch::nn::Linear linear(torch::nn::LinearOptions(in, out).bias(bias));
  auto gen = at::detail::createCPUGenerator(seed);
  torch::NoGradGuard no_grad;
  linear->weight.copy_(torch::randn(linear->weight.sizes(), gen) * 0.05);
  if (bias) linear->bias.copy_(torch::randn({out}, gen) * 0.1);
  linear->to(dtype);
  return linear;
}

/// The dense path QLoRA stands for: a Linear in `dtype` holding q's dequantised weight and its bias.
torch::nn::Linear dense_of(const Linear& q, torch::Dtype dtype) {
  torch::nn::Linear linear(torch::nn::LinearOptions(q->in_features(), q->out_features()).bias(q->bias.defined()));
  linear->to(dtype);
  torch::NoGradGuard no_grad;
  linear->weight.copy_(q->dequantized_weight(dtype));
  if (q->bias.defined()) linear->bias.copy_(q->bias);
  return linear;
}

/// B = N(0, 0.1²) from `seed` in q (non-zero, so A's gradient is too), and q's A and B in lora.
void share_adapter(Linear& q, Linear& lora, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  torch::NoGradGuard no_grad;
  q->lora_B->weight.copy_(torch::randn(q->lora_B->weight.sizes(), gen) * 0.1);
  lora->lora_A->weight.copy_(q->lora_A->weight);
  lora->lora_B->weight.copy_(q->lora_B->weight);
}

/// A layer's output and, after y.backward(g), the gradients of x, lora_A and lora_B.
struct Run {
  torch::Tensor y, dx, da, db;
};

/// Runs `layer` on a fresh leaf copy of x (forward under CPU bf16 autocast if asked, backward outside it).
template <class Layer>
Run run(Layer& layer, const torch::Tensor& x0, const torch::Tensor& g, bool autocast = false) {
  torch::Tensor x = x0.detach().clone().requires_grad_(true);
  torch::Tensor y;
  {
    std::optional<memopt::detail::AutocastGuard> guard;
    if (autocast) guard.emplace(memopt::detail::AutocastState{c10::kCPU, true, c10::kBFloat16});
    y = layer(x);
  }
  y.backward(g.to(y.scalar_type()));
  return {y.detach(), x.grad(), layer->lora_A->weight.grad().clone(), layer->lora_B->weight.grad().clone()};
}

/// The same in fp64 from the given operands: y = x·wᵀ + b + (x·Aᵀ)·Bᵀ · scale.
Run reference64(const torch::Tensor& w, const torch::Tensor& b, const torch::Tensor& a_weight,
                const torch::Tensor& b_weight, double scale, const torch::Tensor& x0, const torch::Tensor& g) {
  auto d = [](const torch::Tensor& t) { return t.detach().to(torch::kDouble); };
  torch::Tensor x = d(x0).requires_grad_(true), a = d(a_weight).requires_grad_(true),
                bw = d(b_weight).requires_grad_(true);
  torch::Tensor y = torch::linear(x, d(w), b.defined() ? d(b) : torch::Tensor()) +
                    torch::linear(torch::linear(x, a), bw) * scale;
  y.backward(d(g));
  return {y.detach(), x.grad(), a.grad(), bw.grad()};
}

/// Each of memopt's errors against fp64 is at most twice the dense path's, + 1e-6.
void check_within_dense_error(const Run& mine, const Run& dense, const Run& ref) {
  const std::vector<std::pair<const char*, std::vector<torch::Tensor>>> parts{
      {"y", {mine.y, dense.y, ref.y}},
      {"dx", {mine.dx, dense.dx, ref.dx}},
      {"lora_A grad", {mine.da, dense.da, ref.da}},
      {"lora_B grad", {mine.db, dense.db, ref.db}}};
  for (const auto& [name, t] : parts) {
    const double mine_error = max_abs_diff(t[0], t[2]), dense_error = max_abs_diff(t[1], t[2]);
    INFO(name << ": error " << mine_error << ", the dense path's " << dense_error);
    CHECK(mine_error <= 2 * dense_error + 1e-6);
  }
}

}  // namespace

TEST_CASE("nf4_linear equals torch::linear with the dequantized weight and its dX the dense one, no weight grad",
          "[qlora][nn]") {
  // 37 x 99 = 3663 weights: odd, 57 blocks of 64 and a short one, blocks straddling rows.
  torch::nn::Linear linear = make_linear(99, 37, /*bias=*/true, 1);
  linear->weight.requires_grad_(false);
  linear->bias.requires_grad_(false);
  auto gen = at::detail::createCPUGenerator(2);
  const torch::Tensor x0 = torch::randn({2, 5, 99}, gen);  // (2, 5, in)
  const torch::Tensor g = torch::randn({2, 5, 37}, gen);   // (2, 5, out)
  for (const bool dq : {true, false}) {
    for (const bool with_bias : {true, false}) {
      INFO((dq ? "double quant" : "fp32 absmax") << (with_bias ? ", bias" : ", no bias"));
      const Nf4Tensor w = quantize_nf4(linear->weight, Nf4Options().double_quant(dq));
      const torch::Tensor bias = with_bias ? linear->bias : torch::Tensor();
      const torch::Tensor dense = w.dequantize(torch::kFloat);  // (out, in)

      torch::Tensor x = x0.clone().requires_grad_(true);
      const torch::Tensor y = nf4_linear(x, w, bias);
      CHECK(y.scalar_type() == torch::kFloat);
      CHECK(torch::equal(y, torch::linear(x0, dense, bias)));
      y.backward(g);

      torch::Tensor xd = x0.clone().requires_grad_(true);
      torch::linear(xd, dense, bias).backward(g);
      REQUIRE(x.grad().defined());
      CHECK(max_abs_diff(x.grad(), xd.grad()) <= 1e-6);
      // The codes and scales take no gradient, nor does the (frozen) bias; the node has no edge to them.
      CHECK_FALSE(w.packed.requires_grad());
      CHECK_FALSE(w.packed.grad().defined());
      if (with_bias) CHECK_FALSE(bias.grad().defined());
    }
  }
  // Without an input that needs grad there is no graph.
  CHECK_FALSE(nf4_linear(x0, quantize_nf4(linear->weight), linear->bias).requires_grad());
}

TEST_CASE("nf4_linear in tiles equals the whole-weight path, and its transient peak is a tile, not the weight",
          "[qlora][nn]") {
  auto& tracker = memopt::memory::Tracker::instance();
  REQUIRE(tracker.installed());
  // 300 x 197 (odd in: blocks straddle rows and tiles); tiles of 4 KiB: 6 rows forward (in fp32),
  // 4 columns backward, the last tile short.
  torch::nn::Linear linear = make_linear(197, 300, /*bias=*/true, 7);
  linear->weight.requires_grad_(false);
  linear->bias.requires_grad_(false);
  const Nf4Tensor w = quantize_nf4(linear->weight);
  auto gen = at::detail::createCPUGenerator(8);
  const torch::Tensor x0 = torch::randn({3, 7, 197}, gen);  // (3, 7, in)
  const torch::Tensor g = torch::randn({3, 7, 300}, gen);   // (3, 7, out)
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    INFO(c10::toString(dtype));
    auto run = [&](int64_t tile_bytes) {
      torch::Tensor x = x0.to(dtype).clone().requires_grad_(true);  // a leaf of its own
      const torch::Tensor y = nf4_linear(x, w, linear->bias, tile_bytes);
      y.backward(g.to(dtype));
      return std::pair{y.to(torch::kDouble), x.grad().to(torch::kDouble)};
    };
    const auto [y_whole, dx_whole] = run(0);
    const auto [y_tiled, dx_tiled] = run(4096);
    // fp32: the same products, summed in other blocks; bf16: fp32 sums rounded to bf16, the
    // tiled forward rounding once more when it adds the bias: two half-ulps, 2^-8 of a value.
    const double tol = dtype == torch::kFloat ? 1e-5 : 1.0 / 128;
    CHECK(max_abs_diff(y_tiled, y_whole) <= tol * y_whole.abs().max().item<double>());
    CHECK(max_abs_diff(dx_tiled, dx_whole) <= tol * dx_whole.abs().max().item<double>());
  }
  // The CPU kernel's values are code · absmax in fp32, then one rounding, bit for bit (what
  // the ATen path that other devices take computes); its tiles are dequantize()'s.
  const torch::Tensor scale = w.block_absmax().contiguous();
  const torch::Tensor codes = torch::stack({w.packed.bitwise_right_shift(4), w.packed.bitwise_and(15)}, 1);
  const torch::Tensor index = codes.view({-1}).slice(0, 0, w.numel).to(torch::kLong);  // (n,) 0..15
  const torch::Tensor want = memopt::nn::nf4_map().index_select(0, index) *
                             scale.repeat_interleave(w.blocksize).slice(0, 0, w.numel);  // (n,) fp32
  CHECK(torch::equal(w.dequantize(torch::kFloat).view({-1}), want));
  const torch::Tensor dense = w.dequantize(torch::kBFloat16);  // (300, 197)
  CHECK(torch::equal(dense.view({-1}), want.to(torch::kBFloat16)));
  using memopt::nn::detail::dequantize_nf4_cpu;
  CHECK(torch::equal(dequantize_nf4_cpu(w, scale, 11 * 197, 197, 5, 197, torch::kBFloat16), dense.narrow(0, 11, 5)));
  CHECK(torch::equal(dequantize_nf4_cpu(w, scale, 61, 197, 300, 9, torch::kBFloat16), dense.narrow(1, 61, 9)));
  // Peak: forward + backward of a 1024 x 1024 weight in 64 KiB tiles stays far below the 4 MiB
  // fp32 weight the whole-weight path makes: a tile, the blocks' fp32 scales (1/64 of the
  // weight's fp32 bytes) and what dequantising them takes, x, y, dx: measured 289 KiB.
  constexpr int64_t kDense = int64_t{1024} * 1024 * 4;
  const Nf4Tensor big = quantize_nf4(torch::randn({1024, 1024}));
  const torch::Tensor xb = torch::randn({4, 1024}).requires_grad_(true);
  for (const int64_t tile_bytes : {int64_t{0}, int64_t{1} << 16}) {
    INFO("tile_bytes " << tile_bytes);
    tracker.reset_peaks();
    const int64_t before = tracker.live_bytes();
    nf4_linear(xb, big, {}, tile_bytes).sum().backward();
    const int64_t transient = tracker.peak_bytes() - before;
    if (tile_bytes == 0) {
      CHECK(transient >= kDense);
    } else {
      CHECK(transient < kDense / 8);
    }
  }
}

TEST_CASE("A QLoRA Linear equals a LoRA Linear over the dequantized weight in fp32, with and without dropout",
          "[qlora][nn]") {
  for (const double dropout : {0.0, 0.25}) {
    INFO("dropout " << dropout);
    const auto options = LoraOptions().rank(4).alpha(8).dropout(dropout);
    torch::nn::Linear base = make_linear(96, 40, /*bias=*/true, 3);
    Linear q(base, options, Nf4Options());
    Linear lora(dense_of(q, torch::kFloat), options);
    share_adapter(q, lora, 4);
    CHECK(q->lora_A->weight.scalar_type() == torch::kFloat);
    CHECK(q->scale() == 2.0);

    auto gen = at::detail::createCPUGenerator(5);
    const torch::Tensor x = torch::randn({3, 4, 96}, gen), g = torch::randn({3, 4, 40}, gen);
    torch::manual_seed(6);  // the same dropout masks for both
    const Run mine = run(q, x, g);
    torch::manual_seed(6);
    const Run dense = run(lora, x, g);
    CHECK(max_abs_diff(mine.y, dense.y) <= 1e-6);
    CHECK(max_abs_diff(mine.dx, dense.dx) <= 1e-6);
    CHECK(max_abs_diff(mine.da, dense.da) <= 1e-6);
    CHECK(max_abs_diff(mine.db, dense.db) <= 1e-6);
    CHECK(mine.da.abs().max().item<double>() > 1e-4);  // B != 0: A's gradient is not trivially 0
    CHECK_FALSE(q->bias.grad().defined());
  }
}

TEST_CASE("A QLoRA Linear in bf16 and under bf16 autocast stays within twice the dense bf16 error against fp64",
          "[qlora][nn]") {
  const auto options = LoraOptions().rank(8).alpha(16);
  auto gen = at::detail::createCPUGenerator(7);
  const torch::Tensor x = torch::randn({4, 6, 128}, gen), g = torch::randn({4, 6, 64}, gen);

  SECTION("a bf16 base and bf16 input: fp32 adapter, bf16 output") {
    Linear q(make_linear(128, 64, /*bias=*/true, 8, torch::kBFloat16), options, Nf4Options());
    Linear lora(dense_of(q, torch::kBFloat16), options);
    share_adapter(q, lora, 9);
    CHECK(q->lora_A->weight.scalar_type() == torch::kFloat);  // lora_adapter_dtype, as a LoRA Linear
    CHECK(q->nf4().dtype == torch::kBFloat16);
    const torch::Tensor xb = x.to(torch::kBFloat16);
    const Run mine = run(q, xb, g), dense = run(lora, xb, g);
    CHECK(mine.y.scalar_type() == torch::kBFloat16);
    CHECK(mine.dx.scalar_type() == torch::kBFloat16);
    const Run ref = reference64(q->dequantized_weight(torch::kBFloat16), q->bias, q->lora_A->weight,
                                q->lora_B->weight, q->scale(), xb, g.to(torch::kBFloat16));
    check_within_dense_error(mine, dense, ref);
  }
  SECTION("an fp32 base under CPU bf16 autocast: the weight dequantized to bf16, dX in fp32") {
    Linear q(make_linear(128, 64, /*bias=*/true, 10), options, Nf4Options());
    Linear lora(dense_of(q, torch::kFloat), options);
    share_adapter(q, lora, 11);
    const Run mine = run(q, x, g, /*autocast=*/true), dense = run(lora, x, g, /*autocast=*/true);
    CHECK(mine.y.scalar_type() == torch::kBFloat16);
    CHECK(mine.dx.scalar_type() == torch::kFloat);
    const Run ref = reference64(q->dequantized_weight(torch::kFloat), q->bias, q->lora_A->weight, q->lora_B->weight,
                                q->scale(), x, g.to(torch::kBFloat16));
    CHECK(max_abs_diff(dense.y, ref.y) > 1e-4);  // bf16's own error is there to compare with
    check_within_dense_error(mine, dense, ref);
  }
}

TEST_CASE("nf4_linear keeps only the NF4 buffers between forward and backward, nothing of the dense weight's size",
          "[qlora][nn]") {
  auto& tracker = memopt::memory::Tracker::instance();
  REQUIRE(tracker.installed());
  constexpr int64_t kOut = 1024, kIn = 1024, kDense = kOut * kIn * 4;  // the fp32 weight: 4 MiB
  torch::nn::Linear base(torch::nn::LinearOptions(kIn, kOut));
  Linear q(base, LoraOptions().rank(8), Nf4Options());

  // 0.5159 B/param: n/2 codes + 1 B per block of 64 + 4 B per 256 blocks + 4 B of offset.
  constexpr int64_t n = kOut * kIn, blocks = n / 64;
  CHECK(q->base_nbytes() == n / 2 + blocks + 4 * ((blocks + 255) / 256) + 4);  // 540932
  CHECK(q->base_nbytes() == quantize_nf4(base->weight).nbytes());
  CHECK(static_cast<double>(q->base_nbytes()) / n == Approx(0.5159).margin(1e-4));

  const torch::Tensor x = torch::randn({4, kIn}).requires_grad_(true);  // (4, in): 16 KiB
  const int64_t before = tracker.live_bytes();
  {
    const torch::Tensor y = nf4_linear(x, q->nf4(), q->bias);  // (4, out)
    const int64_t kept = tracker.live_bytes() - before;
    INFO("kept after forward " << kept << " B, y " << y.nbytes() << " B");
    CHECK(kept - static_cast<int64_t>(y.nbytes()) < kDense / 64);
    // What the graph saved: q's own buffers (no copy, 0 new bytes), not x, no dense weight.
    auto* node = dynamic_cast<torch::autograd::CppNode<memopt::nn::detail::Nf4LinearFunction>*>(y.grad_fn().get());
    REQUIRE(node != nullptr);
    int64_t saved = 0;
    for (const torch::Tensor& t : node->ctx_.get_saved_variables()) {
      if (!t.defined()) continue;
      saved += static_cast<int64_t>(t.nbytes());
      CHECK_FALSE(t.is_same(x));
      CHECK((t.is_same(q->weight_nf4) || t.is_same(q->weight_absmax) || t.is_same(q->weight_nested_absmax) ||
             t.is_same(q->weight_nested_offset)));
    }
    CHECK(saved == q->base_nbytes());
    y.backward(torch::ones_like(y));
  }
  REQUIRE(x.grad().defined());
  CHECK(tracker.live_bytes() - before - static_cast<int64_t>(x.grad().nbytes()) < kDense / 64);  // nothing left

  // The measure sees a dense weight: dequantising, then torch::linear under autograd, keeps it.
  {
    const int64_t start = tracker.live_bytes();
    const torch::Tensor y = torch::linear(x, q->dequantized_weight(torch::kFloat), q->bias);
    CHECK(tracker.live_bytes() - start >= kDense);
  }
  // the QLoRA Linear's forward: the adapter's activations (of x's and y's size), no dense weight.
  {
    const int64_t start = tracker.live_bytes();
    const torch::Tensor y = q(x);
    INFO("kept after the QLoRA Linear's forward " << tracker.live_bytes() - start << " B");
    CHECK(tracker.live_bytes() - start < kDense / 16);
    y.sum().backward();
  }
}

TEST_CASE("A QLoRA Linear's NF4 base is buffers a state dict saves and loads, and to(dtype) leaves them as they are",
          "[qlora][nn]") {
  Linear q(make_linear(40, 24, /*bias=*/true, 12), LoraOptions().rank(4), Nf4Options());
  CHECK(q->named_parameters().keys() == std::vector<std::string>({"bias", "lora_A.weight", "lora_B.weight"}));
  CHECK(q->named_buffers().keys() ==
        std::vector<std::string>({"weight_nf4", "weight_absmax", "weight_nested_absmax", "weight_nested_offset"}));
  CHECK(q->weight_nf4.is_same(q->nf4().packed));
  CHECK(q->weight_absmax.is_same(q->nf4().absmax_quant.codes));
  CHECK(q->weight_nested_absmax.is_same(q->nf4().absmax_quant.absmax));
  CHECK(q->weight_nested_offset.is_same(q->nf4().absmax_offset));
  CHECK(q->weight_nf4.sizes() == torch::IntArrayRef({480}));  // 960 weights, two a byte
  CHECK(q->weight_absmax.scalar_type() == torch::kByte);
  CHECK(q->weight_absmax.numel() == 15);
  CHECK(q->weight_nested_absmax.scalar_type() == torch::kFloat);
  CHECK(q->weight_nested_offset.dim() == 0);
  CHECK_FALSE(q->bias.requires_grad());
  CHECK(q->in_features() == 40);
  CHECK(q->out_features() == 24);

  Linear plain(make_linear(40, 24, /*bias=*/false, 12), LoraOptions().rank(4), Nf4Options().double_quant(false));
  CHECK(plain->named_buffers().keys() == std::vector<std::string>({"weight_nf4", "weight_absmax"}));
  CHECK(plain->weight_absmax.scalar_type() == torch::kFloat);
  CHECK(plain->named_parameters().size() == 2);
  CHECK(plain->base_nbytes() == 480 + 15 * 4);

  // Saved and loaded into a layer quantised from another weight: the same codes, the same output.
  {
    torch::NoGradGuard no_grad;
    q->lora_B->weight.normal_(0, 0.1);
  }
  std::stringstream stream;
  torch::save(q, stream);
  Linear other(make_linear(40, 24, /*bias=*/true, 13), LoraOptions().rank(4), Nf4Options());
  const torch::Tensor x = torch::randn({3, 40});
  CHECK_FALSE(torch::equal(other(x), q(x)));
  torch::load(other, stream);
  CHECK(torch::equal(other->nf4().packed, q->nf4().packed));
  CHECK(other->weight_nf4.is_same(other->nf4().packed));  // nf4() follows the loaded buffers
  CHECK(torch::equal(other(x), q(x)));

  // to(bf16): the adapter and bias convert; codes and scales keep their dtypes; nf4() follows.
  q->to(torch::kBFloat16);
  CHECK(q->lora_A->weight.scalar_type() == torch::kBFloat16);
  CHECK(q->bias.scalar_type() == torch::kBFloat16);
  CHECK(q->weight_nf4.scalar_type() == torch::kByte);
  CHECK(q->weight_nested_absmax.scalar_type() == torch::kFloat);
  CHECK(q->nf4().dtype == torch::kBFloat16);
  CHECK(q->nf4().packed.is_same(q->weight_nf4));
  CHECK(q(x.to(torch::kBFloat16)).scalar_type() == torch::kBFloat16);
  q->to(torch::kCPU);  // a device move keeps every tensor's identity too
  CHECK(q->nf4().absmax_quant.absmax.is_same(q->weight_nested_absmax));
  CHECK(torch::equal(q->dequantized_weight(torch::kFloat), other->dequantized_weight(torch::kFloat)));
}

TEST_CASE("A QLoRA Linear takes any in_features and refuses bad input with a HINT", "[qlora][nn]") {
  // An odd in_features: NF4 pads the last byte with the code of 0 and scales a short last block;
  // no shape is refused (231 weights: 3 blocks of 64 and one of 39, 116 bytes).
  Linear odd(make_linear(33, 7, /*bias=*/true, 14), LoraOptions().rank(4), Nf4Options());
  CHECK(odd->nf4().packed.numel() == 116);
  CHECK(odd->nf4().num_blocks() == 4);
  const torch::Tensor x = torch::randn({5, 33});
  CHECK(torch::equal(odd(x), torch::linear(x, odd->dequantized_weight(torch::kFloat), odd->bias)));  // B = 0

  require_error([] { Linear layer(make_linear(8, 4, false, 15), LoraOptions().rank(5), Nf4Options()); },
                "memopt::nn::Linear", {"rank 5", "min(in 8, out 4) = 4"});
  require_error([] { Linear layer(make_linear(8, 4, false, 15), LoraOptions().rank(2).alpha(0), Nf4Options()); },
                "memopt::nn::Linear", {"alpha"});
  require_error([] { Linear layer(torch::nn::Linear(nullptr), LoraOptions(), Nf4Options()); }, "memopt::nn::Linear",
                {"empty"});
  require_error(
      [] { Linear layer(make_linear(8, 8, false, 16), LoraOptions().rank(2), Nf4Options().blocksize(48)); },
      "memopt::nn::Linear::quantize", {"blocksize", "48"});
  require_error([&] { odd->dequantized_weight(torch::kInt); }, "memopt::nn::Linear::dequantized_weight",
                {"Int", "floating"});

  require_error([&] { nf4_linear(torch::ones({2, 33}, torch::kLong), odd->nf4()); }, "memopt::nn::nf4_linear",
                {"floating-point", "Long"});
  require_error([&] { nf4_linear(torch::randn({2, 32}), odd->nf4()); }, "memopt::nn::nf4_linear",
                {"in = 33", "[2, 32]"});
  require_error([&] { nf4_linear(x, odd->nf4(), torch::zeros({7}, torch::requires_grad())); },
                "memopt::nn::nf4_linear", {"bias requires grad"});
  require_error([&] { nf4_linear(x, odd->nf4(), torch::zeros({6})); }, "memopt::nn::nf4_linear", {"out = 7", "[6]"});
  require_error([] { nf4_linear(torch::randn({4, 16}), quantize_nf4(torch::randn({16}))); },
                "memopt::nn::nf4_linear", {"2-d", "[16]"});
}
