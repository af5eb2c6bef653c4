// Tests for include/memopt/optim/adamw8bit.hpp and offload::Int8State: the dynamic maps,
// block-wise quantisation error bounds, the state's bytes, equivalence with
// torch::optim::AdamW (one step exactly, training closely), save/load, the Trainer with
// 8-bit state, and bad options rejected with the value and a HINT.
#include <catch2/catch.hpp>

#include <cmath>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

#include <memopt/detail/optimizer_state.hpp>
#include <memopt/memopt.hpp>
#include <memopt/optim/adamw8bit.hpp>

#include "support.hpp"

namespace {

using memopt::optim::AdamW8bit;
using memopt::optim::AdamW8bitParamState;
using memopt::optim::kQuantBlockSize;

// torch::optim::AdamW's state of p (detail::optimizer_state_key: the key in either LibTorch).
torch::optim::AdamWParamState& adamw_state(torch::optim::Optimizer& opt, const torch::Tensor& p) {
  return static_cast<torch::optim::AdamWParamState&>(
      *opt.state().at(memopt::detail::optimizer_state_key(opt.state(), p)));
}

// Half the widest gap between neighbouring codes: the worst nearest-code error, in units of absmax.
double half_widest_gap(const torch::Tensor& map) {
  return ((map.slice(0, 1) - map.slice(0, 0, -1)).max() / 2).item<double>();
}

// n values whose magnitudes span ~5 decades across and within blocks, a zero block, and a
// partial last block.
torch::Tensor spread_values(int64_t n, bool is_signed, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  torch::Tensor magnitude = torch::pow(10.0, torch::rand({n}, gen) * 5 - 4);  // 1e-4 .. 1e1
  torch::Tensor x = magnitude * torch::randn({n}, gen).sign();
  x.slice(0, 3 * kQuantBlockSize, 4 * kQuantBlockSize).zero_();
  return is_signed ? x : x.abs();
}

struct Problem {  // a fixed regression: y = tanh(x W1) W2 + noise, a 2-layer MLP to fit it
  torch::Tensor x, y;
  Problem() {
    auto gen = at::detail::createCPUGenerator(5);
    x = torch::randn({512, 64}, gen);
    y = torch::tanh(x.mm(torch::randn({64, 96}, gen) / 8)).mm(torch::randn({96, 32}, gen)) +
        0.01 * torch::randn({512, 32}, gen);
  }
};

torch::nn::Sequential make_mlp(uint64_t seed) {
  torch::manual_seed(static_cast<int64_t>(seed));
  return torch::nn::Sequential(torch::nn::Linear(64, 128), torch::nn::Tanh(), torch::nn::Linear(128, 32));
}

// Two groups as memopt's param_groups makes them: decay on matrices, none on biases.
std::vector<torch::optim::OptimizerParamGroup> mlp_groups(torch::nn::Sequential& net,
                                                          const torch::optim::AdamWOptions& o) {
  std::vector<torch::Tensor> matrices, biases;
  for (auto& p : net->parameters()) (p.dim() >= 2 ? matrices : biases).push_back(p);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(matrices, std::make_unique<torch::optim::AdamWOptions>(o));
  groups.emplace_back(biases, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(o).weight_decay(0)));
  return groups;
}

double train_step(torch::nn::Sequential& net, torch::optim::Optimizer& opt, const Problem& problem) {
  opt.zero_grad();
  torch::Tensor loss = torch::mse_loss(net->forward(problem.x), problem.y);
  loss.backward();
  opt.step();
  return loss.item<double>();
}

double max_param_diff(torch::nn::Sequential& a, torch::nn::Sequential& b) {
  double d = 0;
  auto pa = a->parameters(), pb = b->parameters();
  for (size_t i = 0; i < pa.size(); ++i) d = std::max(d, (pa[i] - pb[i]).abs().max().item<double>());
  return d;
}

memopt::Batch random_batch(int64_t B, int64_t T, int64_t vocab, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  auto tokens = torch::randint(vocab, {B, T + 1}, gen);
  return {tokens.slice(1, 0, T), tokens.slice(1, 1, T + 1)};
}

struct ListLoader {
  std::vector<memopt::Batch> batches;
  size_t next_index = 0;
  memopt::Batch next() { return batches.at(next_index++ % batches.size()); }
};

// A LLaMA whose matrices reach min_8bit_size (64 x 64 = 4096), so most state is 8-bit.
memopt::models::LlamaConfig small_llama() {
  return memopt::models::LlamaConfig()
      .vocab_size(128)
      .hidden_size(64)
      .num_hidden_layers(2)
      .num_attention_heads(4)
      .max_position_embeddings(32);
}

}  // namespace

TEST_CASE("dynamic maps are bitsandbytes' create_dynamic_map: 256 sorted codes", "[adamw8bit]") {
  const torch::Tensor s = memopt::optim::dynamic_map(true);
  const torch::Tensor u = memopt::optim::dynamic_map(false);
  REQUIRE(s.numel() == 256);
  REQUIRE(u.numel() == 256);
  CHECK(torch::equal(std::get<0>(s.sort()), s));
  CHECK(torch::equal(std::get<0>(u.sort()), u));
  CHECK((s.slice(0, 1) > s.slice(0, 0, -1)).all().item<bool>());  // no duplicate codes
  CHECK((u.slice(0, 1) > u.slice(0, 0, -1)).all().item<bool>());
  CHECK(s[127].item<float>() == 0.0f);  // 127 negative codes, 0, 127 positive codes, 1
  CHECK(s[255].item<float>() == 1.0f);
  CHECK(s[0].item<double>() == Approx(-(1 - 0.9 / 128)));
  CHECK(s[128].item<double>() == Approx(0.55e-6));  // smallest magnitude: the midpoint of [0.1, 1]·1e-6
  CHECK(u[0].item<float>() == 0.0f);
  CHECK(u[1].item<double>() == Approx(0.325e-6));
  CHECK(u[254].item<double>() == Approx(1 - 0.9 / 256));
  CHECK(half_widest_gap(s) == Approx(0.9 / 128).epsilon(1e-5));  // the step of the top decade, 64 codes
  CHECK(half_widest_gap(u) == Approx(0.9 / 256).epsilon(1e-5));  // 128 codes
}

TEST_CASE("block-wise quantisation: absmax per block, nearest code, error <= half the widest gap x absmax",
          "[adamw8bit]") {
  const int64_t n = 37 * kQuantBlockSize + 100;  // a partial last block
  for (const bool is_signed : {true, false}) {
    INFO((is_signed ? "signed map" : "unsigned map"));
    const torch::Tensor map = memopt::optim::dynamic_map(is_signed);
    const torch::Tensor x = spread_values(n, is_signed, is_signed ? 1 : 2);  // (n,)
    const auto q = memopt::optim::quantize_blockwise(x, map);
    REQUIRE(q.codes.scalar_type() == torch::kByte);
    REQUIRE(q.codes.numel() == n);
    REQUIRE(q.absmax.numel() == 38);
    const torch::Tensor x_hat = memopt::optim::dequantize_blockwise(q, map);  // (n,)

    // Block scales are the blocks' max |x|; zero blocks stay exactly zero.
    const torch::Tensor padded = torch::constant_pad_nd(x, {0, 38 * kQuantBlockSize - n});
    const torch::Tensor absmax = padded.view({38, kQuantBlockSize}).abs().amax(1);  // (38,)
    CHECK(torch::equal(q.absmax, absmax));
    CHECK((x_hat.slice(0, 3 * kQuantBlockSize, 4 * kQuantBlockSize) == 0).all().item<bool>());

    // Per block: max error <= half the widest code gap (0.00703 signed, 0.00352 unsigned) x absmax.
    const double bound = half_widest_gap(map);
    const torch::Tensor err = torch::constant_pad_nd((x_hat - x).abs(), {0, 38 * kQuantBlockSize - n});
    const torch::Tensor block_err = err.view({38, kQuantBlockSize}).amax(1);  // (38,)
    const torch::Tensor ratio = block_err / absmax.clamp_min(1e-30);
    CHECK(ratio.max().item<double>() <= bound * (1 + 1e-5));
    // The relative error of the elements within a decade of their block's absmax is a few %.
    const torch::Tensor top = x.abs() >= 0.1 * padded.view({38, kQuantBlockSize}).abs().amax(1, true)
                                               .expand({38, kQuantBlockSize}).reshape({-1}).slice(0, 0, n);
    const double top_rel = ((x_hat - x).abs() / x.abs().clamp_min(1e-30)).masked_select(top).max().item<double>();
    CHECK(top_rel <= 10 * bound * (1 + 1e-5));

    // Nearest code: no neighbour of the chosen code is closer to x / absmax.
    const torch::Tensor codes = q.codes.to(torch::kLong);
    const torch::Tensor scale = q.absmax.repeat_interleave(kQuantBlockSize).slice(0, 0, n);
    const torch::Tensor y = x / scale.clamp_min(1e-30);
    const torch::Tensor d = (y - map.index_select(0, codes)).abs();
    const torch::Tensor d_below = (y - map.index_select(0, (codes - 1).clamp_min(0))).abs();
    const torch::Tensor d_above = (y - map.index_select(0, (codes + 1).clamp_max(255))).abs();
    CHECK((d <= d_below + 1e-7).all().item<bool>());
    CHECK((d <= d_above + 1e-7).all().item<bool>());
  }
}

TEST_CASE("the CPU kernel's table rounds as torch::bucketize on the boundaries", "[adamw8bit]") {
  for (const bool is_signed : {true, false}) {
    const torch::Tensor map = memopt::optim::dynamic_map(is_signed);
    const torch::Tensor bounds = memopt::optim::detail::map_boundaries(map, /*keep_nonzero=*/!is_signed);
    const memopt::optim::detail::CodeBook book(map, bounds);
    // Spread values, ±0, ±1, each boundary and its float neighbours.
    std::vector<torch::Tensor> parts{spread_values(20000, true, 3) / 10, torch::tensor({0.0f, -0.0f, 1.0f, -1.0f}),
                                     bounds, torch::nextafter(bounds, torch::full_like(bounds, 2)),
                                     torch::nextafter(bounds, torch::full_like(bounds, -2))};
    torch::Tensor y = torch::cat(parts);  // (n,)
    if (!is_signed) y = y.abs();
    const torch::Tensor expected = torch::bucketize(y, bounds, /*out_int32=*/true, /*right=*/false);
    const float* py = y.data_ptr<float>();
    const int32_t* pe = expected.data_ptr<int32_t>();
    int64_t mismatches = 0;
    for (int64_t i = 0; i < y.numel(); ++i) mismatches += book.encode(py[i]) != pe[i];
    CHECK(mismatches == 0);
  }
}

TEST_CASE("the second moment's quantisation: dynamic maps keep the AdamW update, linear maps do not",
          "[adamw8bit]") {
  // The moments of a small LLaMA after 1 and after 30 fp32 AdamW steps; the update
  // m̂ / (sqrt(v̂) + eps) recomputed from quantised moments, against the fp32 one.
  torch::manual_seed(0);
  memopt::models::Llama model(small_llama());
  torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(3e-3).betas({0.9, 0.95}));
  const torch::Tensor dyn_s = memopt::optim::dynamic_map(true), dyn_u = memopt::optim::dynamic_map(false);
  const torch::Tensor lin_s = torch::linspace(-1, 1, 256), lin_u = torch::linspace(0, 1, 256);
  auto roundtrip = [](const torch::Tensor& t, const torch::Tensor& map, bool keep_nonzero) {
    return memopt::optim::dequantize_blockwise(memopt::optim::quantize_blockwise(t, map, keep_nonzero), map).view_as(t);
  };
  for (int step = 1; step <= 30; ++step) {
    adamw.zero_grad();
    const memopt::Batch b = random_batch(4, 16, 128, 100 + step);
    (model->loss_sum(b, memopt::checkpoint::None{}) / b.num_targets()).backward();
    adamw.step();
    if (step != 1 && step != 30) continue;
    const double bc1 = 1 - std::pow(0.9, step), bc2 = 1 - std::pow(0.95, step);
    auto update = [&](const torch::Tensor& m, const torch::Tensor& v) { return (m / bc1) / ((v / bc2).sqrt() + 1e-8); };
    double ref_sq = 0, dynamic_sq = 0, dynamic_zero_sq = 0, linear_sq = 0;
    for (const auto& p : model->parameters()) {
      if (p.numel() < 4096) continue;
      auto& s = adamw_state(adamw, p);
      const torch::Tensor ref = update(s.exp_avg(), s.exp_avg_sq());
      const torch::Tensor m_hat = roundtrip(s.exp_avg(), dyn_s, false);
      ref_sq += ref.pow(2).sum().item<double>();
      dynamic_sq += (update(m_hat, roundtrip(s.exp_avg_sq(), dyn_u, true)) - ref).pow(2).sum().item<double>();
      dynamic_zero_sq += (update(m_hat, roundtrip(s.exp_avg_sq(), dyn_u, false)) - ref).pow(2).sum().item<double>();
      linear_sq += (update(roundtrip(s.exp_avg(), lin_s, false), roundtrip(s.exp_avg_sq(), lin_u, false)) - ref)
                       .pow(2).sum().item<double>();
    }
    const double dynamic = std::sqrt(dynamic_sq / ref_sq), dynamic_zero = std::sqrt(dynamic_zero_sq / ref_sq),
                 linear = std::sqrt(linear_sq / ref_sq);
    INFO("step " << step << ": relative L2 error of the update: dynamic " << dynamic << ", dynamic with v -> 0 "
                 << dynamic_zero << ", linear " << linear);
    CHECK(dynamic < 0.05);          // measured: 3.9% after 1 step, 1.6% after 30
    CHECK(linear > 100 * dynamic);  // measured: 2.6e4 and 3.8e3 (one v rounded to 0 beside a nonzero m suffices)
    if (step == 1) CHECK(dynamic_zero > 100 * dynamic);  // bitsandbytes' rounding of v to 0: 25
  }
}

TEST_CASE("8-bit state takes 2 B/param + 4 B per 256-element block per moment + the step", "[adamw8bit]") {
  // Sizes: a partial last block, whole blocks, a 2-D matrix, and one under min_8bit_size.
  std::vector<torch::Tensor> params{torch::randn({5000}), torch::randn({20 * kQuantBlockSize}),
                                    torch::randn({64, 80}), torch::randn({100})};
  for (auto& p : params) p.set_requires_grad(true);
  AdamW8bit opt(params, torch::optim::AdamWOptions(1e-3));
  CHECK(opt.state_bytes() == 0);  // created lazily, as torch::optim::AdamW
  for (auto& p : params) p.mutable_grad() = torch::randn_like(p);
  opt.step();

  int64_t counted = 0, formula = 0;
  for (const auto& p : params) {
    REQUIRE(opt.param_state(p) != nullptr);
    const AdamW8bitParamState& s = *opt.param_state(p);
    const int64_t n = p.numel();
    for (const auto* t : {&s.exp_avg(), &s.exp_avg_sq(), &s.exp_avg_absmax(), &s.exp_avg_sq_absmax()})
      if (t->defined()) counted += static_cast<int64_t>(t->nbytes());
    counted += static_cast<int64_t>(sizeof(int64_t));  // the step counter
    if (n >= 4096) {
      CHECK(s.quantized());
      CHECK(s.exp_avg().scalar_type() == torch::kByte);
      CHECK(s.exp_avg_sq_absmax().scalar_type() == torch::kFloat);
      formula += 2 * n + 2 * 4 * ((n + 255) / 256) + 8;
    } else {
      CHECK_FALSE(s.quantized());
      formula += 2 * 4 * n + 8;
    }
  }
  CHECK(counted == formula);
  CHECK(opt.state_bytes() == formula);
  CHECK(formula == (2 * 5000 + 8 * 20) + (2 * 5120 + 8 * 20) + (2 * 5120 + 8 * 20) + 800 + 4 * 8);
}

TEST_CASE("fp32_params keep fp32 moments whatever their size", "[adamw8bit]") {
  std::vector<torch::Tensor> params{torch::randn({64, 128}, torch::requires_grad()),
                                    torch::randn({64, 128}, torch::requires_grad())};
  AdamW8bit opt(params, torch::optim::AdamWOptions(1e-3), memopt::optim::AdamW8bitOptions().fp32_params({params[1]}));
  for (auto& p : params) p.mutable_grad() = torch::randn_like(p);
  opt.step();
  CHECK(opt.param_state(params[0])->quantized());
  CHECK_FALSE(opt.param_state(params[1])->quantized());
  CHECK(opt.state_bytes() == (2 * 8192 + 8 * 32 + 8) + (8 * 8192 + 8));
}

TEST_CASE("one step equals torch::optim::AdamW; training stays close to it", "[adamw8bit]") {
  const Problem problem;
  auto ref_net = make_mlp(3), net = make_mlp(3);
  const auto options = torch::optim::AdamWOptions(1e-4).betas({0.9, 0.95}).weight_decay(0.1);
  torch::optim::AdamW ref(mlp_groups(ref_net, options), options);
  AdamW8bit opt(mlp_groups(net, options), options);
  // The first step starts from zero moments, which 8 bits hold exactly: the same update.
  train_step(ref_net, ref, problem);
  train_step(net, opt, problem);
  CHECK(max_param_diff(ref_net, net) <= 1e-7);
  // Later steps read quantised moments: the parameters drift by a small fraction of how far they moved (L2).
  auto start = make_mlp(3);
  for (int i = 0; i < 19; ++i) {
    train_step(ref_net, ref, problem);
    train_step(net, opt, problem);
  }
  double moved_sq = 0, drift_sq = 0;
  for (size_t i = 0; i < net->parameters().size(); ++i) {
    moved_sq += (ref_net->parameters()[i] - start->parameters()[i]).pow(2).sum().item<double>();
    drift_sq += (ref_net->parameters()[i] - net->parameters()[i]).pow(2).sum().item<double>();
  }
  INFO("moved " << std::sqrt(moved_sq) << ", drift " << std::sqrt(drift_sq) << " max " << max_param_diff(ref_net, net));
  CHECK(std::sqrt(drift_sq) < 0.05 * std::sqrt(moved_sq));
}

TEST_CASE("the fused CPU kernel steps as the tensor path (the path of other devices)", "[adamw8bit]") {
  const Problem problem;
  auto a = make_mlp(9), b = make_mlp(9);
  const auto options = torch::optim::AdamWOptions(1e-2).betas({0.9, 0.95}).weight_decay(0.1);
  AdamW8bit fused(mlp_groups(a, options), options);
  AdamW8bit tensors(mlp_groups(b, options), options, memopt::optim::AdamW8bitOptions().fused_cpu(false).chunk_size(1024));
  for (int i = 0; i < 3; ++i) {
    train_step(a, fused, problem);
    train_step(b, tensors, problem);
  }
  CHECK(max_param_diff(a, b) <= 1e-6);
  int64_t codes = 0, differ = 0;
  for (size_t i = 0; i < a->parameters().size(); ++i) {
    const AdamW8bitParamState& x = *fused.param_state(a->parameters()[i]);
    const AdamW8bitParamState& y = *tensors.param_state(b->parameters()[i]);
    if (!x.quantized()) continue;
    codes += 2 * x.exp_avg().numel();
    differ += (x.exp_avg() != y.exp_avg()).sum().item<int64_t>() + (x.exp_avg_sq() != y.exp_avg_sq()).sum().item<int64_t>();
    CHECK(torch::allclose(x.exp_avg_absmax(), y.exp_avg_absmax(), 1e-5, 0));
  }
  INFO(differ << " of " << codes << " codes differ (float rounding at a boundary)");
  CHECK(codes == 2 * (64 * 128 + 128 * 32));
  CHECK(differ <= codes / 1000);

  // Enough blocks for every thread, partial last blocks, parameters split between threads.
  auto gen = at::detail::createCPUGenerator(11);
  std::vector<torch::Tensor> x{torch::randn({70001}, gen), torch::randn({300, 401}, gen), torch::randn({5000}, gen)};
  std::vector<torch::Tensor> y;
  for (auto& t : x) {
    y.push_back(t.clone().requires_grad_());
    t.requires_grad_();
  }
  AdamW8bit fused_x(x, options);
  AdamW8bit tensors_y(y, options, memopt::optim::AdamW8bitOptions().fused_cpu(false));
  for (int step = 0; step < 3; ++step) {
    for (size_t i = 0; i < x.size(); ++i) {
      x[i].mutable_grad() = torch::randn(x[i].sizes(), gen) * std::pow(10.0, -step);
      y[i].mutable_grad() = x[i].grad().clone();
    }
    fused_x.step();
    tensors_y.step();
  }
  for (size_t i = 0; i < x.size(); ++i) {
    CHECK((x[i] - y[i]).abs().max().item<double>() <= 1e-6);
    const auto& sx = *fused_x.param_state(x[i]);
    const auto& sy = *tensors_y.param_state(y[i]);
    CHECK((sx.exp_avg() != sy.exp_avg()).sum().item<int64_t>() <= x[i].numel() / 1000);
    CHECK((sx.exp_avg_sq() != sy.exp_avg_sq()).sum().item<int64_t>() <= x[i].numel() / 1000);
  }
}

TEST_CASE("AdamW8bit converges like AdamW on a small regression: 200 steps, final loss within 1.2x", "[adamw8bit]") {
  const Problem problem;
  auto ref_net = make_mlp(4), net = make_mlp(4);
  const auto options = torch::optim::AdamWOptions(1e-2).betas({0.9, 0.95}).weight_decay(0.01);
  torch::optim::AdamW ref(mlp_groups(ref_net, options), options);
  AdamW8bit opt(mlp_groups(net, options), options);
  const double first = train_step(ref_net, ref, problem);
  train_step(net, opt, problem);
  double ref_loss = 0, loss = 0;
  for (int i = 1; i < 200; ++i) {
    ref_loss = train_step(ref_net, ref, problem);
    loss = train_step(net, opt, problem);
  }
  INFO("first " << first << ", AdamW " << ref_loss << ", AdamW8bit " << loss);
  CHECK(ref_loss < 0.05 * first);
  CHECK(loss < 1.2 * ref_loss);
  CHECK(loss > ref_loss / 1.2);
}

TEST_CASE("save, load into a fresh optimizer: the next step is identical", "[adamw8bit]") {
  const Problem problem;
  auto net = make_mlp(6);
  const auto options = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  AdamW8bit opt(mlp_groups(net, options), options);
  for (int i = 0; i < 3; ++i) train_step(net, opt, problem);

  std::stringstream bytes;
  {
    torch::serialize::OutputArchive archive;
    opt.save(archive);
    archive.save_to(bytes);
  }
  auto twin = make_mlp(0);
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < twin->parameters().size(); ++i) twin->parameters()[i].copy_(net->parameters()[i]);
  }
  AdamW8bit loaded(mlp_groups(twin, options), options);
  {
    torch::serialize::InputArchive archive;
    archive.load_from(bytes);
    loaded.load(archive);
  }
  CHECK(loaded.state_bytes() == opt.state_bytes());
  train_step(net, opt, problem);
  train_step(twin, loaded, problem);
  CHECK(max_param_diff(net, twin) == 0.0);
  for (size_t i = 0; i < net->parameters().size(); ++i) {
    const AdamW8bitParamState& a = *opt.param_state(net->parameters()[i]);
    const AdamW8bitParamState& b = *loaded.param_state(twin->parameters()[i]);
    CHECK(a.step() == b.step());
    CHECK(torch::equal(a.exp_avg(), b.exp_avg()));
    CHECK(torch::equal(a.exp_avg_sq(), b.exp_avg_sq()));
  }
}

TEST_CASE("AdamW8bit loads torch::optim::AdamW's state and quantises its large moments", "[adamw8bit]") {
  const Problem problem;
  auto ref_net = make_mlp(8);
  const auto options = torch::optim::AdamWOptions(1e-3);
  torch::optim::AdamW ref(mlp_groups(ref_net, options), options);
  for (int i = 0; i < 3; ++i) train_step(ref_net, ref, problem);
  auto net = make_mlp(0);
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < net->parameters().size(); ++i) net->parameters()[i].copy_(ref_net->parameters()[i]);
  }
  AdamW8bit opt(mlp_groups(net, options), options);
  std::stringstream bytes;
  torch::serialize::OutputArchive out;
  ref.save(out);
  out.save_to(bytes);
  torch::serialize::InputArchive in;
  in.load_from(bytes);
  opt.load(in);
  int64_t quantized = 0;
  for (const auto& item : opt.state()) quantized += static_cast<const AdamW8bitParamState&>(*item.second).quantized();
  CHECK(quantized == 2);  // the two matrices; the biases keep fp32
  std::vector<torch::Tensor> start_params;
  for (const auto& p : ref_net->parameters()) start_params.push_back(p.detach().clone());
  train_step(ref_net, ref, problem);
  train_step(net, opt, problem);
  auto ref_params = ref_net->parameters(), params = net->parameters();
  for (size_t i = 0; i < params.size(); ++i) {  // the step taken differs by a few % of its size
    const double err = (params[i] - ref_params[i]).norm().item<double>();
    const double moved = (ref_params[i] - start_params[i]).norm().item<double>();
    INFO("param " << i << " err " << err << " moved " << moved);
    CHECK(err < 0.05 * moved);
  }
}

TEST_CASE("Trainer with offload::Int8State trains a small LLaMA with 8-bit state", "[adamw8bit][trainer]") {
  torch::manual_seed(0);
  memopt::models::Llama model(small_llama());
  ListLoader loader{{random_batch(4, 16, 128, 1), random_batch(4, 16, 128, 2)}};
  memopt::Trainer<memopt::checkpoint::None, memopt::precision::Fp32, memopt::accum::None, memopt::offload::Int8State>
      trainer(*model, memopt::TrainerOptions().lr(3e-3).max_steps(30).log_interval(10).warmup_steps(2));
  auto loss_fn = [&](const memopt::Batch& b, const auto& ckpt) { return model->loss_sum(b, ckpt); };
  const double first = trainer.step(loader, loss_fn).loss.item<double>();
  const auto result = trainer.fit(loader, loss_fn);
  CHECK(result.final_loss < first * 0.8);

  auto* opt = dynamic_cast<AdamW8bit*>(&trainer.optimizer());
  REQUIRE(opt != nullptr);
  int64_t params = 0, fp32_state = 0;
  for (const auto& p : model->parameters()) {
    params += p.numel();
    fp32_state += 8 * p.numel() + 8;  // what torch::optim::AdamW would hold
  }
  INFO(params << " parameters, 8-bit state " << opt->state_bytes() << " B, fp32 state " << fp32_state << " B");
  CHECK(opt->state_bytes() < fp32_state / 3);
}

TEST_CASE("bad AdamW8bit options fail with the option, the value and a HINT", "[adamw8bit]") {
  using memopt::test::require_error;
  const std::string who = "memopt::optim::AdamW8bit";
  std::vector<torch::Tensor> params{torch::zeros({8}, torch::requires_grad())};
  auto make = [&](torch::optim::AdamWOptions o, memopt::optim::AdamW8bitOptions q = {}) {
    return [=] { AdamW8bit opt(params, o, q); };
  };
  require_error(make(torch::optim::AdamWOptions(-0.5)), who, {"lr must be >= 0", "(got -0.5)"});
  require_error(make(torch::optim::AdamWOptions().betas({1.0, 0.95})), who, {"betas", "(got 1, 0.95)"});
  require_error(make(torch::optim::AdamWOptions().betas({0.9, -0.1})), who, {"betas", "(got 0.9, -0.1)"});
  require_error(make(torch::optim::AdamWOptions().eps(-1)), who, {"eps", "(got -1)"});
  require_error(make(torch::optim::AdamWOptions().weight_decay(-0.1)), who, {"weight_decay", "(got -0.1)"});
  require_error(make(torch::optim::AdamWOptions().amsgrad(true)), who, {"amsgrad"});
  require_error(make({}, memopt::optim::AdamW8bitOptions().chunk_size(1000)), who, {"chunk_size", "(got 1000)"});
  require_error(make({}, memopt::optim::AdamW8bitOptions().min_8bit_size(-1)), who, {"min_8bit_size", "(got -1)"});

  AdamW8bit opt(params, torch::optim::AdamWOptions(1e-3));
  opt.param_groups()[0].options().set_lr(-2);  // a bad schedule is caught at the step
  params[0].mutable_grad() = torch::ones({8});
  require_error([&] { opt.step(); }, who, {"param group 0", "lr must be >= 0", "(got -2)"});
}
