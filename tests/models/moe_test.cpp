// models/moe.hpp: the MoE layer against a token-by-token python3-torch reference
// (tests/baselines/moe_reference.py), sort-based dispatch against the dense one-hot
// dispatch, capacity drops, the router losses, memory linear in tokens, determinism,
// the whole MoeLM under each recompute policy (dropout included) and bad input.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <string>

#include <torch/torch.h>

#include <memopt/memory/tracker.hpp>
#include <memopt/models/moe.hpp>

#include "support.hpp"

namespace {

using memopt::models::MoeDispatch;
using memopt::models::MoeLayer;
using memopt::models::MoeLayerOptions;
using memopt::test::TensorMap;

const TensorMap& moe_reference() {
  static const TensorMap ref = memopt::test::load_baseline("moe_reference.pt");
  return ref;
}
const torch::Tensor& moe_at(const std::string& key) {
  return memopt::test::baseline_at(moe_reference(), "moe_reference.pt", key);
}
using memopt::test::max_abs_diff;
// max |a − b| relative to the scale of b (at least 1): fp32 sums in another order differ
// by a few ulps of the largest term, whatever its size.
double scaled_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return max_abs_diff(a, b) / std::max(1.0, b.abs().max().item<double>());
}

// The reference's layer: its weights, the given capacity factor and dispatch.
MoeLayer reference_layer(double capacity_factor, MoeDispatch dispatch, bool checkpoint_experts = false) {
  MoeLayer layer(MoeLayerOptions(moe_at("config/hidden").item<int64_t>(), moe_at("config/ffn").item<int64_t>())
                     .num_experts(moe_at("config/experts").item<int64_t>())
                     .top_k(moe_at("config/top_k").item<int64_t>())
                     .capacity_factor(capacity_factor)
                     .dispatch(dispatch)
                     .checkpoint_experts(checkpoint_experts));
  torch::NoGradGuard no_grad;
  for (auto& item : layer->named_parameters()) item.value().copy_(moe_at("param/" + item.key()));
  return layer;
}

struct LayerRun {
  memopt::models::MoeLayerOutput out;
  torch::Tensor grad_x;
  std::map<std::string, torch::Tensor> grads;
};

// Forward the reference input, backward (y · upstream).sum() + lb + z.
template <class Recompute = memopt::recompute::None>
LayerRun run_layer(MoeLayer& layer, Recompute ckpt = {}) {
  auto x = moe_at("x").clone().requires_grad_(true);
  LayerRun run;
  run.out = layer->forward(x, ckpt);
  ((run.out.y * moe_at("upstream")).sum() + run.out.lb_loss + run.out.z_loss).backward();
  run.grad_x = x.grad();
  for (auto& item : layer->named_parameters()) {
    run.grads[item.key()] = item.value().grad().defined() ? item.value().grad().clone()
                                                          : torch::zeros_like(item.value());
    item.value().mutable_grad() = torch::Tensor();
  }
  return run;
}

constexpr double kRefAtol = 2e-5;  // C++ vs python: different summation orders, fp32

}  // namespace

TEST_CASE("MoE layer matches the token-by-token python3-torch reference", "[moe]") {
  for (const std::string c : {"drop", "dropless"}) {
    for (auto dispatch : {MoeDispatch::kSorted, MoeDispatch::kDense}) {
      DYNAMIC_SECTION(c << (dispatch == MoeDispatch::kSorted ? " sorted" : " dense")) {
        auto layer = reference_layer(moe_at(c + "/capacity_factor").item<double>(), dispatch);
        auto run = run_layer(layer);
        CHECK(max_abs_diff(run.out.y, moe_at(c + "/y")) < kRefAtol);
        CHECK(std::abs(run.out.lb_loss.item<double>() - moe_at(c + "/lb").item<double>()) < 1e-6);
        CHECK(std::abs(run.out.z_loss.item<double>() - moe_at(c + "/z").item<double>()) < 1e-5);
        CHECK(std::abs(run.out.dropped.item<double>() - moe_at(c + "/dropped").item<double>()) < 1e-6);
        CHECK(max_abs_diff(run.out.load, moe_at(c + "/load")) < 1e-6);
        CHECK(max_abs_diff(run.grad_x, moe_at(c + "/grad/x")) < kRefAtol);
        for (const auto& [name, grad] : run.grads) {
          INFO(name);
          CHECK(max_abs_diff(grad, moe_at(c + "/grad/" + name)) < kRefAtol);
        }
      }
    }
  }
  // The drop case really drops (its reference asserts whole tokens and single assignments).
  REQUIRE(moe_at("drop/dropped").item<double>() > 0.1);
}

// Tolerance 1e-6 relative to each tensor's scale (the router's gradient sums tokens'
// contributions in another order: a few ulps of values around 10).
TEST_CASE("sort-based dispatch equals the dense one-hot dispatch to 1e-6, with and without drops", "[moe]") {
  for (double cf : {0.5, 1.0, 1.25, 0.0}) {
    DYNAMIC_SECTION("capacity_factor " << cf) {
      auto sorted = reference_layer(cf, MoeDispatch::kSorted);
      auto dense = reference_layer(cf, MoeDispatch::kDense);
      auto a = run_layer(sorted), b = run_layer(dense);
      CHECK(scaled_diff(a.out.y, b.out.y) <= 1e-6);
      CHECK(scaled_diff(a.grad_x, b.grad_x) <= 1e-6);
      for (const auto& [name, grad] : a.grads) {
        INFO(name << ": max |grad| " << grad.abs().max().item<double>());
        CHECK(scaled_diff(grad, b.grads.at(name)) <= 1e-6);
      }
      CHECK(a.out.dropped.item<double>() == b.out.dropped.item<double>());
    }
  }
}

TEST_CASE("MoE expert checkpointing and Selective give the same outputs and gradients", "[moe]") {
  auto plain = reference_layer(0.5, MoeDispatch::kSorted);
  auto ckpt = reference_layer(0.5, MoeDispatch::kSorted, /*checkpoint_experts=*/true);
  auto selective = reference_layer(0.5, MoeDispatch::kSorted);
  auto a = run_layer(plain), b = run_layer(ckpt), c = run_layer(selective, memopt::recompute::Selective{});
  REQUIRE(torch::equal(a.out.y, b.out.y));
  REQUIRE(torch::equal(a.grad_x, b.grad_x));
  for (const auto& [name, grad] : a.grads) {
    INFO(name);
    CHECK(torch::equal(grad, b.grads.at(name)));
    CHECK(max_abs_diff(grad, c.grads.at(name)) <= 1e-6);
  }
}

TEST_CASE("tokens over capacity leave the layer as zero: the residual carries them", "[moe]") {
  auto layer = reference_layer(0.5, MoeDispatch::kSorted);
  torch::NoGradGuard no_grad;
  const auto x = moe_at("x");
  auto out = layer->forward(x);
  const auto all_dropped = moe_at("drop/all_dropped");
  REQUIRE(all_dropped.any().item<bool>());
  // Exactly zero rows (not merely small) for the tokens that lost every assignment.
  CHECK(out.y.index({all_dropped}).abs().max().item<float>() == 0.0f);
  CHECK(out.y.index({all_dropped.logical_not()}).abs().sum(1).min().item<float>() > 0.0f);

  // In a block: the MoE branch adds nothing, so the block's output is h = x + attn(norm(x)).
  auto cfg = memopt::models::MoeConfig()
                 .base(memopt::models::LlamaConfig().vocab_size(11).hidden_size(16).num_hidden_layers(1)
                           .num_attention_heads(2).intermediate_size(24))
                 .capacity_factor(0.25);
  memopt::models::MoeDecoderLayer block(cfg);
  block->eval();
  auto hidden = torch::randn({1, 12, 16});  // (B, T, C)
  auto [cos, sin] = memopt::nn::rope_tables(12, 8, 10000.0, torch::kCPU);
  auto packed = block->forward(hidden, cos, sin, memopt::recompute::None{});
  auto y = memopt::models::MoeBlockOutput::unpack(packed, hidden.sizes()).hidden;
  auto h = hidden + block->self_attn->forward(block->input_layernorm(hidden), cos, sin);
  // Which tokens dropped out entirely: route them again.
  auto normed = block->post_attention_layernorm(h).reshape({-1, 16});
  auto moe = block->block_sparse_moe->forward(normed);
  auto gone = moe.y.abs().sum(1).eq(0);  // (T)
  REQUIRE(gone.any().item<bool>());
  CHECK(torch::equal(y.reshape({-1, 16}).index({gone}), h.reshape({-1, 16}).index({gone})));
}

TEST_CASE("load-balancing loss is 1 under uniform routing, z-loss matches its formula", "[moe]") {
  auto layer = reference_layer(0.0, MoeDispatch::kSorted);
  const auto x = moe_at("x");
  torch::NoGradGuard no_grad;
  SECTION("uniform router") {
    layer->gate->weight.zero_();  // every probability 1/E
    auto out = layer->forward(x);
    CHECK(out.lb_loss.item<double>() == Approx(1.0).epsilon(1e-6));
    CHECK(out.load.sum().item<double>() == Approx(1.0));
    CHECK(out.z_loss.item<double>() == Approx(std::pow(std::log(4.0), 2)).epsilon(1e-6));
  }
  SECTION("collapsed router: every token prefers expert 0") {
    layer->gate->weight.zero_();
    layer->gate->weight[0].fill_(5.0);  // with every feature shifted by +3: logit 0 ≈ 240, the others 0
    auto out = layer->forward(x + 3);
    CHECK(out.lb_loss.item<double>() > 1.5);  // f_0 ≈ 1/2 (top-2), P_0 ≈ 1: lb ≈ E/2 = 2
  }
  SECTION("z-loss = mean logsumexp(x Wᵀ)²") {
    auto out = layer->forward(x);
    auto expected = torch::logsumexp(torch::matmul(x, layer->gate->weight.t()), -1).square().mean();
    CHECK(out.z_loss.item<double>() == Approx(expected.item<double>()).epsilon(1e-6));
  }
}

TEST_CASE("dispatch memory grows linearly with tokens (sorted), quadratically (dense)", "[moe]") {
  auto& tracker = memopt::memory::Tracker::instance();
  REQUIRE(tracker.installed());
  auto peak_for = [&](MoeDispatch dispatch, int64_t tokens) {
    torch::manual_seed(7);
    MoeLayer layer(MoeLayerOptions(32, 32).num_experts(8).top_k(2).capacity_factor(1.25).dispatch(dispatch));
    auto x = torch::randn({tokens, 32}).requires_grad_(true);
    const int64_t before = tracker.live_bytes();
    tracker.reset_peaks();
    auto out = layer->forward(x);
    (out.y.sum() + out.lb_loss).backward();
    return tracker.snapshot().peak_bytes - before;
  };
  const double sorted_ratio = static_cast<double>(peak_for(MoeDispatch::kSorted, 4096)) /
                              static_cast<double>(peak_for(MoeDispatch::kSorted, 2048));
  const double dense_ratio = static_cast<double>(peak_for(MoeDispatch::kDense, 4096)) /
                             static_cast<double>(peak_for(MoeDispatch::kDense, 2048));
  INFO("peak(4096 tokens) / peak(2048 tokens): sorted " << sorted_ratio << ", dense " << dense_ratio);
  CHECK(sorted_ratio > 1.8);
  CHECK(sorted_ratio < 2.2);
  CHECK(dense_ratio > 3.5);
}

TEST_CASE("routing is deterministic for a fixed seed (jitter included)", "[moe]") {
  auto run = [](uint64_t seed) {
    torch::manual_seed(static_cast<int64_t>(seed));
    MoeLayer layer(MoeLayerOptions(16, 24).num_experts(4).top_k(2).router_jitter(0.05));
    auto x = torch::randn({64, 16});
    torch::NoGradGuard no_grad;
    return std::make_pair(layer->route(x).experts, layer->forward(x).y);
  };
  auto [e1, y1] = run(11);
  auto [e2, y2] = run(11);
  auto [e3, y3] = run(12);
  CHECK(torch::equal(e1, e2));
  CHECK(torch::equal(y1, y2));
  CHECK_FALSE(torch::equal(y1, y3));
}

namespace {

memopt::models::MoeConfig tiny_moe_config(double dropout) {
  return memopt::models::MoeConfig()
      .base(memopt::models::LlamaConfig()
                .vocab_size(37)
                .hidden_size(16)
                .num_hidden_layers(2)
                .num_attention_heads(2)
                .intermediate_size(24)
                .max_position_embeddings(32)
                .dropout(dropout))
      .num_experts(4)
      .top_k(2)
      .capacity_factor(1.0)
      .router_jitter(0.02);
}

template <class Recompute>
std::map<std::string, torch::Tensor> model_grads(const memopt::models::MoeConfig& cfg, Recompute ckpt,
                                                 torch::Tensor* loss_out = nullptr) {
  torch::manual_seed(3);
  memopt::models::MoeLM model(cfg);
  auto inputs = torch::randint(0, 37, {2, 12});
  memopt::Batch batch{inputs, inputs.roll(-1, 1)};
  torch::manual_seed(99);  // dropout and jitter draws
  auto loss = model->loss_sum(batch, ckpt);
  loss.backward();
  if (loss_out) *loss_out = loss.detach();
  std::map<std::string, torch::Tensor> grads;
  for (auto& item : model->named_parameters())
    grads[item.key()] = item.value().grad().defined() ? item.value().grad() : torch::zeros_like(item.value());
  return grads;
}

}  // namespace

TEST_CASE("MoeLM: gradients match under each recompute policy, dropout and jitter included", "[moe]") {
  const auto cfg = tiny_moe_config(0.1);
  torch::Tensor loss_none, loss_ckpt;
  const auto none = model_grads(cfg, memopt::recompute::None{}, &loss_none);
  auto compare = [&](const std::map<std::string, torch::Tensor>& other) {
    for (const auto& [name, grad] : none) {
      INFO(name);
      CHECK(scaled_diff(grad, other.at(name)) <= 1e-6);
    }
  };
  SECTION("EveryBlock") {
    compare(model_grads(cfg, memopt::recompute::EveryBlock{}, &loss_ckpt));
    CHECK(torch::equal(loss_none, loss_ckpt));
  }
  SECTION("EveryNth<2>") { compare(model_grads(cfg, memopt::recompute::EveryNth<2>{})); }
  SECTION("Selective") { compare(model_grads(cfg, memopt::recompute::Selective{})); }
  SECTION("expert checkpointing inside EveryBlock") {
    compare(model_grads(memopt::models::MoeConfig(cfg).checkpoint_experts(true), memopt::recompute::EveryBlock{}));
  }
  SECTION("dense dispatch") {
    compare(model_grads(memopt::models::MoeConfig(cfg).dispatch(MoeDispatch::kDense), memopt::recompute::None{}));
  }
  // The router gets gradient from the aux losses through the packed block output.
  CHECK(none.at("model.layers.0.block_sparse_moe.gate.weight").abs().sum().item<double>() > 0);
}

TEST_CASE("MoeLM::loss_sum is the CE sum plus the weighted aux losses, stats average", "[moe]") {
  auto cfg = tiny_moe_config(0.0).router_jitter(0.0);
  torch::manual_seed(5);
  memopt::models::MoeLM model(cfg);
  model->eval();
  auto inputs = torch::randint(0, 37, {2, 12});
  memopt::Batch batch{inputs, inputs.roll(-1, 1)};
  torch::NoGradGuard no_grad;
  auto out = model->forward_hidden(inputs, memopt::recompute::None{});
  auto ce = torch::nn::functional::cross_entropy(
      model->lm_head(out.hidden).reshape({-1, 37}), batch.targets.reshape({-1}),
      torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
  const double n = 24;
  const double expected = ce.item<double>() + n * (0.01 * out.lb_loss.item<double>() + 0.001 * out.z_loss.item<double>());
  (void)model->take_stats();
  CHECK(model->loss_sum(batch, memopt::recompute::None{}).item<double>() == Approx(expected).epsilon(1e-6));
  CHECK(model->loss_sum(batch, memopt::recompute::EveryBlock{}).item<double>() == Approx(expected).epsilon(1e-6));
  auto stats = model->take_stats();
  CHECK(stats.forwards == 2);
  CHECK(stats.lb_loss == Approx(out.lb_loss.item<double>()));
  double load = 0;
  for (double l : stats.load) load += l;
  CHECK(load == Approx(1.0));
  CHECK(stats.dropped >= 0);
  CHECK(model->take_stats().forwards == 0);
  // Dense equivalent: the same active SwiGLU width per token.
  CHECK(cfg.dense_equivalent().ffn_size() == 2 * 24);
}

TEST_CASE("MoE bad input: a clear error naming the value and the allowed ones", "[moe]") {
  using memopt::test::require_error;
  auto layer_with = [](auto&& edit) {
    return [edit] { MoeLayer layer(edit(MoeLayerOptions(16, 24))); };
  };
  require_error(layer_with([](MoeLayerOptions o) { return o.num_experts(4).top_k(5); }), "memopt::models::MoE",
                {"top_k", "num_experts = 4", "got 5"});
  require_error(layer_with([](MoeLayerOptions o) { return o.num_experts(0).top_k(1); }), "memopt::models::MoE",
                {"num_experts must be >= 1", "got 0"});
  require_error(layer_with([](MoeLayerOptions o) { return o.capacity_factor(std::nan("")); }),
                "memopt::models::MoE", {"capacity_factor", "nan"});
  require_error([] { (void)memopt::models::MoeConfig::preset("moe-huge", 100); }, "memopt::models::MoeConfig",
                {"moe-huge", "moe-nano, moe-micro, moe-mini"});
  require_error([] { memopt::models::MoeLM model(tiny_moe_config(0).aux_loss_coef(-1)); }, "memopt::models::MoeConfig",
                {"aux_loss_coef", "-1"});
  require_error(
      [] {
        auto config = tiny_moe_config(0);
        config.base().tie_word_embeddings(true);
        memopt::models::MoeLM model(config);
      },
      "memopt::models::MoeConfig", {"tie_word_embeddings true", "own lm_head"});
}
