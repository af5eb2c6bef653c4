// tests/bf16_gemm_test.cpp — memopt/bf16_gemm.hpp: bf16 products widened to fp32 are LibTorch's
// bf16 products up to summation order (each within the native kernel's own error of an fp64
// product), the native mode is LibTorch's kernel bit for bit, and everything that is not a
// well-formed bf16 product is left to LibTorch (CUDA products among them).
#include <catch2/catch.hpp>

#include <ATen/record_function.h>

#include <atomic>
#include <set>
#include <string>

#include <memopt/bf16_gemm.hpp>
#include <memopt/models/gritlm.hpp>
#include <memopt/models/llama.hpp>
#include <memopt/models/moe.hpp>
#include <memopt/policies/precision.hpp>
#include <memopt/policies/recompute.hpp>

#include "nn/fixtures.hpp"
#include "support.hpp"

namespace {

namespace bgemm = memopt::bf16_gemm;

torch::Tensor gemm_randn(at::IntArrayRef sizes) { return torch::randn(sizes).to(torch::kBFloat16); }

/// Largest |x - reference| over the fp64 reference.
double gemm_max_error(const torch::Tensor& x, const torch::Tensor& reference) {
  return (x.to(torch::kFloat64) - reference).abs().max().item<double>();
}

/// `widened` (Fp32Compute) is within the error LibTorch's own bf16 kernel makes against the fp64
/// product `exact`, computed from the same operands (`native`), plus one bf16 rounding of the
/// largest entry (the two round the same fp32 sum differently in at most the last bit).
void gemm_check_within_native(const torch::Tensor& widened, const torch::Tensor& native, const torch::Tensor& exact) {
  REQUIRE(widened.scalar_type() == torch::kBFloat16);
  REQUIRE(widened.sizes() == native.sizes());
  const double ulp = exact.abs().max().item<double>() * std::ldexp(1.0, -8);
  const double native_error = gemm_max_error(native, exact);
  INFO("widened error " << gemm_max_error(widened, exact) << ", native error " << native_error << ", ulp " << ulp);
  CHECK(gemm_max_error(widened, exact) <= native_error + ulp);
}

torch::Tensor gemm_f64(const torch::Tensor& t) { return t.to(torch::kFloat64); }

}  // namespace

TEST_CASE("bf16 mm, addmm, bmm and baddbmm widened to fp32 are LibTorch's within its own error", "[bf16_gemm]") {
  torch::manual_seed(0);
  const auto a = gemm_randn({67, 48}), b = gemm_randn({48, 33}), bias = gemm_randn({33}), c = gemm_randn({67, 33});
  const auto x = gemm_randn({5, 19, 24}), y = gemm_randn({5, 24, 13}), z = gemm_randn({5, 19, 13});
  // Native first (LibTorch's kernels through the installed forwarders), then widened.
  const auto count = [] { return bgemm::detail::widened_count().load(); };
  const auto before = count();
  torch::Tensor n_mm, n_mmt, n_addmm, n_addmm_2d, n_bmm, n_baddbmm;
  {
    bgemm::ScopedMode native(bgemm::Mode::Native);
    n_mm = torch::mm(a, b);
    n_mmt = torch::mm(b.t(), a.t());  // transposed operands: strided, not copied
    n_addmm = torch::addmm(bias, a, b);
    n_addmm_2d = torch::addmm(c, a, b, 0.5, -2.0);
    n_bmm = torch::bmm(x, y);
    n_baddbmm = torch::baddbmm(z, x, y, 0.25, 3.0);
  }
  CHECK(count() == before);  // Native: LibTorch's kernels ran, nothing widened
  bgemm::ScopedMode widened(bgemm::Mode::Fp32Compute);
  gemm_check_within_native(torch::mm(a, b), n_mm, gemm_f64(a).mm(gemm_f64(b)));
  gemm_check_within_native(torch::mm(b.t(), a.t()), n_mmt, gemm_f64(b).t().mm(gemm_f64(a).t()));
  gemm_check_within_native(torch::addmm(bias, a, b), n_addmm, torch::addmm(gemm_f64(bias), gemm_f64(a), gemm_f64(b)));
  gemm_check_within_native(torch::addmm(c, a, b, 0.5, -2.0), n_addmm_2d,
                            torch::addmm(gemm_f64(c), gemm_f64(a), gemm_f64(b), 0.5, -2.0));
  gemm_check_within_native(torch::bmm(x, y), n_bmm, gemm_f64(x).bmm(gemm_f64(y)));
  gemm_check_within_native(torch::baddbmm(z, x, y, 0.25, 3.0), n_baddbmm,
                            torch::baddbmm(gemm_f64(z), gemm_f64(x), gemm_f64(y), 0.25, 3.0));
  // Linear layers reach them through addmm and matmul (3-D inputs fold into 2-D products).
  const auto w = gemm_randn({33, 48});
  const auto in = gemm_randn({3, 7, 48});
  const auto exact = torch::nn::functional::linear(gemm_f64(in), gemm_f64(w), gemm_f64(bias));
  torch::Tensor native_linear;
  {
    bgemm::ScopedMode native(bgemm::Mode::Native);
    native_linear = torch::nn::functional::linear(in, w, bias);
  }
  gemm_check_within_native(torch::nn::functional::linear(in, w, bias), native_linear, exact);
  CHECK(count() == before + 7);  // each product above (and the linear layer's addmm) ran widened
}

TEST_CASE("mm_out and addmm_ widen into their own outputs", "[bf16_gemm]") {
  torch::manual_seed(5);
  const auto a = gemm_randn({67, 48}), b = gemm_randn({48, 33}), c = gemm_randn({67, 33});
  torch::Tensor n_mm_out = torch::empty({67, 33}, torch::kBFloat16), n_addmm_ = c.clone(), n_scaled = c.clone();
  {
    bgemm::ScopedMode native(bgemm::Mode::Native);
    torch::mm_out(n_mm_out, a, b);
    n_addmm_.addmm_(a, b);
    n_scaled.addmm_(a, b, 0.5, -2.0);
  }
  bgemm::ScopedMode widened(bgemm::Mode::Fp32Compute);
  const auto mm_ref = torch::mm(a, b), addmm_ref = torch::addmm(c, a, b), scaled_ref = torch::addmm(c, a, b, 0.5, -2.0);
  const auto before = bgemm::detail::widened_count().load();
  auto resized = torch::empty({0}, torch::kBFloat16);  // mm_out resizes an empty out, as LibTorch's does
  torch::mm_out(resized, a, b);
  auto rows = torch::zeros({100, 33}, torch::kBFloat16);  // into a slice of rows (the loss head's dHidden)
  auto rows_view = rows.narrow(0, 10, 67);
  torch::mm_out(rows_view, a, b);
  auto in_place = c.clone(), scaled = c.clone();
  in_place.addmm_(a, b);
  scaled.addmm_(a, b, 0.5, -2.0);
  CHECK(bgemm::detail::widened_count().load() == before + 4);
  CHECK(torch::equal(resized, mm_ref));  // the same widened product as mm's
  CHECK(torch::equal(rows.narrow(0, 10, 67), mm_ref));
  CHECK(torch::equal(rows.narrow(0, 0, 10), torch::zeros({10, 33}, torch::kBFloat16)));
  CHECK(torch::equal(rows.narrow(0, 77, 23), torch::zeros({23, 33}, torch::kBFloat16)));
  CHECK(torch::equal(in_place, addmm_ref));
  CHECK(torch::equal(scaled, scaled_ref));
  gemm_check_within_native(resized, n_mm_out, gemm_f64(a).mm(gemm_f64(b)));
  gemm_check_within_native(in_place, n_addmm_, torch::addmm(gemm_f64(c), gemm_f64(a), gemm_f64(b)));
  gemm_check_within_native(scaled, n_scaled, torch::addmm(gemm_f64(c), gemm_f64(a), gemm_f64(b), 0.5, -2.0));
  // An out that overlaps an operand, or of another dtype, is LibTorch's to handle (and refuse).
  auto f32 = torch::empty({67, 33});
  CHECK_THROWS(torch::mm_out(f32, a, b));
}

TEST_CASE("addmm.out, bmm.out and baddbmm_ widen into their own outputs", "[bf16_gemm]") {
  torch::manual_seed(6);
  const auto a = gemm_randn({67, 48}), b = gemm_randn({48, 33}), c = gemm_randn({67, 33});
  const auto x = gemm_randn({5, 19, 24}), y = gemm_randn({5, 24, 13}), z = gemm_randn({5, 19, 13});
  auto n_addmm_out = torch::empty({67, 33}, torch::kBFloat16), n_bmm_out = torch::empty({5, 19, 13}, torch::kBFloat16);
  auto n_baddbmm_ = z.clone();
  {
    bgemm::ScopedMode native(bgemm::Mode::Native);
    torch::addmm_out(n_addmm_out, c, a, b, 0.5, -2.0);
    torch::bmm_out(n_bmm_out, x, y);
    n_baddbmm_.baddbmm_(x, y);
  }
  bgemm::ScopedMode widened(bgemm::Mode::Fp32Compute);
  const auto addmm_ref = torch::addmm(c, a, b, 0.5, -2.0), bmm_ref = torch::bmm(x, y), baddbmm_ref = torch::baddbmm(z, x, y);
  const auto before = bgemm::detail::widened_count().load();
  const auto native_before = memopt::detail::cpu_gemm::native_bf16_count().load();
  auto addmm_out = torch::empty({0}, torch::kBFloat16);  // resized, as LibTorch's does
  torch::addmm_out(addmm_out, c, a, b, 0.5, -2.0);
  auto self_out = c.clone();  // out is self
  torch::addmm_out(self_out, self_out, a, b, 0.5, -2.0);
  auto scores = torch::zeros({7, 19, 13}, torch::kBFloat16);  // into a slice (the blockwise attention's buffer)
  auto scores_view = scores.narrow(0, 1, 5);
  torch::bmm_out(scores_view, x, y);
  auto acc = z.clone();  // acc += x·y (the blockwise attention's accumulators)
  acc.baddbmm_(x, y);
  CHECK(bgemm::detail::widened_count().load() == before + 4);
  CHECK(memopt::detail::cpu_gemm::native_bf16_count().load() == native_before);
  CHECK(torch::equal(addmm_out, addmm_ref));  // the same widened products as addmm's, bmm's, baddbmm's
  CHECK(torch::equal(self_out, addmm_ref));
  CHECK(torch::equal(scores.narrow(0, 1, 5), bmm_ref));
  CHECK(torch::equal(scores.narrow(0, 0, 1), torch::zeros({1, 19, 13}, torch::kBFloat16)));
  CHECK(torch::equal(acc, baddbmm_ref));
  gemm_check_within_native(addmm_out, n_addmm_out,
                           torch::addmm(gemm_f64(c), gemm_f64(a), gemm_f64(b), 0.5, -2.0));
  gemm_check_within_native(scores_view.contiguous(), n_bmm_out, torch::bmm(gemm_f64(x), gemm_f64(y)));
  gemm_check_within_native(acc, n_baddbmm_, torch::baddbmm(gemm_f64(z), gemm_f64(x), gemm_f64(y)));
  // An out of another dtype is LibTorch's to refuse.
  auto f32 = torch::empty({5, 19, 13});
  CHECK_THROWS(torch::bmm_out(f32, x, y));
}

namespace {
std::atomic<int64_t> g_bf16_products{0};  // bf16 GEMM ops dispatched while the observer below is on
thread_local int g_gemm_depth = 0;         // bf16 GEMM ops under way on this thread (calls within calls)
struct GemmMark : at::ObserverContext {};  // what the observer's start hands its end for a bf16 GEMM op

/// Runs one bf16-autocast step `loss()` (its backward outside autocast, as the Trainer runs it)
/// with widening on, counting each GEMM op dispatched with bf16 operands (mm, addmm, addmm_, bmm,
/// baddbmm, baddbmm_ and the out= forms) by a RecordFunction observer, once per product
/// (autocast's kernel dispatches the op again inside the first call). Each must be a widened
/// product: on a CPU without bf16 units one left to LibTorch runs at ~1 GFLOP/s (the fused loss
/// head's mm_out and a shared-input node's addmm_ did: a 4 x d256 LLaMA step took 20 s, not ~1).
template <class Loss>
void check_step_widens_every_product(const Loss& loss) {
  const memopt::precision::Bf16Autocast policy;
  bgemm::ScopedMode widened(bgemm::Mode::Fp32Compute);
  g_bf16_products = 0;
  const auto handle = at::addGlobalCallback(
      at::RecordFunctionCallback(
          [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
            static const std::set<std::string> gemms{"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm",
                                                     "aten::baddbmm", "aten::baddbmm_"};
            const auto inputs = fn.inputs();
            if (!gemms.count(fn.name()) || inputs.size() < 2 || !inputs[1].isTensor() ||
                inputs[1].toTensor().scalar_type() != torch::kBFloat16)
              return nullptr;
            // Autocast's kernel calls the op again (recorded again) inside the first call: one product.
            if (g_gemm_depth++ == 0) g_bf16_products.fetch_add(1);
            return std::make_unique<GemmMark>();
          },
          [](const at::RecordFunction&, at::ObserverContext* mark) {
            if (mark != nullptr) --g_gemm_depth;
          })
          .needsInputs(true));
  const auto before = bgemm::detail::widened_count().load();
  const auto native_before = memopt::detail::cpu_gemm::native_bf16_count().load();
  torch::Tensor sum;
  {
    auto guard = policy.autocast(c10::kCPU);
    sum = loss();
  }
  sum.backward();
  at::removeCallback(handle);
  INFO("bf16 GEMM ops " << g_bf16_products.load() << ", widened " << bgemm::detail::widened_count().load() - before);
  CHECK(g_bf16_products.load() > 10);
  CHECK(bgemm::detail::widened_count().load() - before == g_bf16_products.load());
  CHECK(memopt::detail::cpu_gemm::native_bf16_count().load() == native_before);  // none fell through
}

}  // namespace

TEST_CASE("Widened, a LLaMA's bf16-autocast step sends every bf16 product through the widened kernels",
          "[bf16_gemm]") {
  torch::manual_seed(4);
  memopt::models::Llama model(memopt::test::nn::small_llama(true).fused_kernels(true).loss_chunk_size(24));
  const auto batch = memopt::test::nn::small_batch(2, 40, 97);
  check_step_widens_every_product([&] { return model->loss_sum(batch, memopt::recompute::None{}); });
}

TEST_CASE("Widened, a MoE LM's bf16-autocast step sends every bf16 product through the widened kernels",
          "[bf16_gemm]") {
  const auto batch = memopt::test::nn::small_batch(2, 40, 97);
  for (const auto dispatch : {memopt::models::MoeDispatch::kSorted, memopt::models::MoeDispatch::kDense}) {
    INFO("dispatch " << static_cast<int>(dispatch));
    torch::manual_seed(5);
    memopt::models::MoeLM model(memopt::models::MoeConfig()
                                    .base(memopt::test::nn::small_llama(true).fused_kernels(true).loss_chunk_size(24))
                                    .num_experts(4)
                                    .top_k(2)
                                    .dispatch(dispatch));
    check_step_widens_every_product([&] { return model->loss_sum(batch, memopt::recompute::None{}); });
  }
}

TEST_CASE("Widened, a GritLM bf16-autocast step (padded embeddings, generation) widens every bf16 product",
          "[bf16_gemm]") {
  torch::manual_seed(6);
  for (const auto kind : {memopt::nn::AttentionKind::kSdpa, memopt::nn::AttentionKind::kBlockwise}) {
    INFO("attention kind " << static_cast<int>(kind));
    memopt::models::GritLM model(memopt::test::nn::small_llama(true).attention_kind(kind).attention_block_size(8),
                                 memopt::models::GritLMOptions());
    const auto embed = [](int64_t n, int64_t T) {  // right-padded rows, lengths in [T/2, T]
      const auto lengths = torch::randint(T / 2, T + 1, {n, 1}, torch::kLong);
      const auto attention = torch::arange(T, torch::kLong).unsqueeze(0) < lengths;  // (n, T)
      return memopt::data::EmbedBatch{torch::randint(1, 97, {n, T}, torch::kLong).masked_fill(~attention, 0),
                                      attention, attention};
    };
    memopt::data::GritBatch batch;
    batch.queries = embed(3, 24);
    batch.passages = embed(6, 32);
    batch.group_size = 2;
    batch.generative = memopt::test::nn::small_batch(2, 40, 97);
    check_step_widens_every_product([&] { return (*model)(batch, memopt::recompute::None{}); });
  }
}

TEST_CASE("a widened product in many chunks equals the product in one", "[bf16_gemm]") {
  torch::manual_seed(1);
  const auto a = gemm_randn({50, 16}), b = gemm_randn({16, 9}), bias = gemm_randn({50, 1});
  const auto whole = bgemm::detail::widened_addmm(bias, a, b, 1, 1);
  // 4 * (16 + 9) bytes a row: 7 rows a chunk, the last one short.
  const auto chunked = bgemm::detail::widened_addmm(bias, a, b, 1, 1, 4 * (16 + 9) * 7);
  CHECK(torch::equal(chunked, whole));
  const auto x = gemm_randn({7, 5, 6}), y = gemm_randn({7, 6, 4});
  CHECK(torch::equal(bgemm::detail::widened_baddbmm({}, x, y, 0, 1, 1), bgemm::detail::widened_baddbmm({}, x, y, 0, 1)));
  CHECK(bgemm::detail::rows_per_chunk(0, 0) == 1);
  CHECK(bgemm::detail::rows_per_chunk(100, 50) == 1);
  CHECK(bgemm::detail::rows_per_chunk(10, 95) == 9);
  // Equal chunks: 512 rows at most 455 a chunk are two of 256.
  CHECK(memopt::detail::cpu_gemm::balanced_chunk(512, 455) == 256);
  CHECK(memopt::detail::cpu_gemm::balanced_chunk(50, 7) == 7);
  CHECK(memopt::detail::cpu_gemm::balanced_chunk(10, 100) == 10);
  CHECK(memopt::detail::cpu_gemm::balanced_chunk(0, 5) == 1);
  // A transposed first operand in chunks of its rows, each converted as its transpose's rows and
  // multiplied transposed: the fp32 product of the widened operands, rounded.
  const auto dy = gemm_randn({40, 50}), in = gemm_randn({40, 9});
  const auto rows = bgemm::detail::widened_addmm({}, dy.t(), in, 0, 1, 4 * (40 + 9) * 7);
  CHECK(torch::equal(rows, bgemm::detail::widened_addmm({}, dy.t(), in, 0, 1)));
  CHECK(torch::equal(rows, dy.to(torch::kFloat).t().mm(in.to(torch::kFloat)).to(torch::kBFloat16)));
  // A weight's gradient dYᵀ·X deeper than tall (m 8 < k 60), too big for one chunk of rows: chunks
  // of the depth summed in fp32, as exact as the product in one (summation order aside).
  const auto g = gemm_randn({60, 8}), h = gemm_randn({60, 5});
  const auto one = bgemm::detail::widened_addmm({}, g.t(), h, 0, 1);
  const auto before = bgemm::detail::widened_count().load();
  const auto depth = bgemm::detail::widened_addmm({}, g.t(), h, 0, 1, 4 * (60 + 5) * 3);  // 3 rows, 15 deep
  CHECK(bgemm::detail::widened_count().load() == before + 1);
  gemm_check_within_native(depth, one, gemm_f64(g).t().mm(gemm_f64(h)));
  CHECK_FALSE(torch::equal(depth, torch::zeros_like(depth)));
}

TEST_CASE("Native mode is LibTorch's bf16 kernel bit for bit, other dtypes are never touched", "[bf16_gemm]") {
  torch::manual_seed(2);
  const auto a = gemm_randn({9, 8}), b = gemm_randn({8, 5});
  {
    bgemm::ScopedMode native(bgemm::Mode::Native);
    CHECK(torch::equal(torch::mm(a, b), at::cpu::mm(a, b)));
  }
  bgemm::ScopedMode widened(bgemm::Mode::Fp32Compute);
  CHECK(bgemm::mode() == bgemm::Mode::Fp32Compute);
  const auto widened_before = bgemm::detail::widened_count().load();
  for (const auto dtype : {torch::kFloat32, torch::kFloat64, torch::kHalf}) {
    const auto p = torch::randn({9, 8}).to(dtype), q = torch::randn({8, 5}).to(dtype);
    CHECK(torch::equal(torch::mm(p, q), at::cpu::mm(p, q)));
    CHECK(torch::equal(torch::bmm(p.unsqueeze(0), q.unsqueeze(0)), at::cpu::bmm(p.unsqueeze(0), q.unsqueeze(0))));
  }
  CHECK(bgemm::detail::widened_count().load() == widened_before);
  // Empty products: the shapes LibTorch gives, zeros where the inner size is 0.
  CHECK(torch::mm(gemm_randn({0, 8}), b).sizes() == at::IntArrayRef({0, 5}));
  CHECK(torch::equal(torch::mm(gemm_randn({3, 0}), gemm_randn({0, 4})), torch::zeros({3, 4}, torch::kBFloat16)));
}

TEST_CASE("Bad products get LibTorch's own errors in either mode", "[bf16_gemm]") {
  bgemm::ScopedMode widened(bgemm::Mode::Fp32Compute);
  const auto a = gemm_randn({4, 3});
  CHECK_THROWS_WITH(torch::mm(a, gemm_randn({4, 3})), Catch::Contains("cannot be multiplied"));
  CHECK_THROWS_WITH(torch::mm(a, torch::randn({3, 2})), Catch::Contains("dtype"));
  CHECK_THROWS(torch::mm(a, gemm_randn({3})));
  CHECK_THROWS(torch::bmm(gemm_randn({2, 4, 3}), gemm_randn({3, 3, 2})));
  CHECK_THROWS(torch::addmm(gemm_randn({5}), a, gemm_randn({3, 2})));  // (5) does not broadcast to (4, 2)
}

TEST_CASE("A bf16-autocast step has the native kernel's gradients within its own error", "[bf16_gemm]") {
  torch::manual_seed(3);
  auto layer = torch::nn::Linear(24, 16);
  const auto input = torch::randn({4, 10, 24});
  const memopt::precision::Bf16Autocast policy;
  const auto gradients = [&](std::optional<bgemm::Mode> mode) {  // weight gradient; nullopt: fp64, no autocast
    layer->zero_grad();
    std::optional<bgemm::ScopedMode> scoped;
    if (mode) scoped.emplace(*mode);
    if (!mode) {
      auto w = layer->weight.to(torch::kFloat64).detach().requires_grad_();
      torch::nn::functional::linear(input.to(torch::kFloat64), w, layer->bias.to(torch::kFloat64)).pow(2).sum().backward();
      return w.grad();
    }
    {
      auto guard = policy.autocast(c10::kCPU);
      layer->forward(input).to(torch::kFloat32).pow(2).sum().backward();
    }
    return layer->weight.grad().clone();
  };
  const auto exact = gradients(std::nullopt);
  const auto native = gradients(bgemm::Mode::Native);
  const auto before = bgemm::detail::widened_count().load();
  const auto widened = gradients(bgemm::Mode::Fp32Compute);
  CHECK(bgemm::detail::widened_count().load() >= before + 2);  // the forward and the weight gradient
  CHECK(native.scalar_type() == torch::kFloat32);  // fp32 master gradients either way
  const double native_error = gemm_max_error(native, exact), widened_error = gemm_max_error(widened, exact);
  INFO("native error " << native_error << ", widened error " << widened_error);
  CHECK(widened_error <= 1.5 * native_error);
  CHECK(widened_error < 0.05 * exact.abs().max().item<double>());
}

TEST_CASE("MEMOPT_BF16_GEMM picks a mode or measures, a bad value is an error with a HINT", "[bf16_gemm]") {
  CHECK(bgemm::detail::decide("native").mode == bgemm::Mode::Native);
  CHECK(bgemm::detail::decide("fp32").mode == bgemm::Mode::Fp32Compute);
  for (const char* name : {"native", "fp32"})  // mode_name spells a mode as the variable does
    CHECK(std::string(bgemm::mode_name(bgemm::detail::decide(name).mode)) == name);
  CHECK_THROWS_WITH(bgemm::detail::decide("fast"), Catch::Contains("'fast'") && Catch::Contains("HINT"));
  bgemm::ScopedMode native(bgemm::Mode::Native);  // what enable() probes
  torch::manual_seed(7);
  const auto expected = torch::randn({4});
  torch::manual_seed(7);
  const auto measured = bgemm::detail::decide(nullptr);
  CHECK(torch::equal(torch::randn({4}), expected));  // the probes drew from generators of their own
  CHECK_THAT(measured.reason, Catch::Contains("GFLOP/s") && Catch::Contains(memopt::cpu_kind()));
  // Where the native kernel is 5x slower than fp32 (an AVX2-only CPU), widening must win.
  const auto& speed = memopt::machine::matmul_speed();
  if (speed.bf16_over_fp32() < 0.2) CHECK(measured.mode == bgemm::Mode::Fp32Compute);
  // enable() decides once per process.
  const auto& first = bgemm::enable();
  CHECK(&bgemm::enable() == &first);
}

TEST_CASE("CUDA: bf16 products on the GPU never reach the CPU kernels, whatever the mode", "[bf16_gemm][cuda]") {
  MEMOPT_REQUIRE_CUDA();
  const torch::Device cuda(torch::kCUDA, 0);
  torch::manual_seed(4);
  const auto a = gemm_randn({64, 48}), b = gemm_randn({48, 40});
  bgemm::ScopedMode widened(bgemm::Mode::Fp32Compute);
  const auto before = bgemm::detail::widened_count().load();
  const auto on_gpu = torch::mm(a.to(cuda), b.to(cuda));
  CHECK(on_gpu.device().is_cuda());
  CHECK(bgemm::detail::widened_count().load() == before);  // LibTorch's CUDA kernel ran
  // The CPU's widened product is within the GPU kernel's own error of the fp64 product.
  gemm_check_within_native(torch::mm(a, b), on_gpu.cpu(), gemm_f64(a).mm(gemm_f64(b)));
}
