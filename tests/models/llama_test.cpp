// tests/models/llama_test.cpp — memopt::models::Llama against an independent python3-torch
// LLaMA (tests/baselines/llama_reference.py, HF maths and names): the same weights must
// give the same logits, loss and parameter gradients, with and without activation
// checkpointing, causal and bidirectional; plus greedy generation and bad-input errors.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "support.hpp"

#include <memopt/batch.hpp>
#include <memopt/models/llama.hpp>
#include <memopt/policies/recompute.hpp>

namespace {

// Tolerances. Python and C++ both run float32 on the CPU. The reference's own float32
// error against float64 (same script, float64 weights) is 9e-8 on logits, 7e-8 relative
// on loss_sum and 6e-7 of each gradient tensor's largest entry; memopt measures 0 (bit
// for bit) against it on LibTorch 1.13. The bounds leave 10-100x room over float32
// noise (another LibTorch, thread count or op order) yet fail on real mistakes: a wrong
// mask moves logits by 0.24, and a 0.1% error in one gradient tensor fails kGradRtol.
// Gradient tensors differ in scale by 100x (q_proj's largest entry is 4e-4), so their
// bound is relative to each tensor's largest reference entry.
constexpr double kLogitsAtol = 1e-5;
constexpr double kLossRtol = 1e-6;
constexpr double kGradRtol = 2e-5;

using memopt::test::TensorMap;

// tests/baselines/llama_reference.pt: a torch.save(dict) zip of tensors.
const TensorMap& reference() {
  static const TensorMap ref = memopt::test::load_baseline("llama_reference.pt");
  return ref;
}

const torch::Tensor& ref_at(const std::string& key) {
  return memopt::test::baseline_at(reference(), "llama_reference.pt", key);
}

// Keys under `prefix`, with the prefix removed.
std::set<std::string> ref_names(const std::string& prefix) {
  std::set<std::string> names;
  for (const auto& [key, value] : reference())
    if (key.rfind(prefix, 0) == 0) names.insert(key.substr(prefix.size()));
  return names;
}

memopt::models::LlamaConfig reference_config(bool causal, int64_t mlp_tiles = 1) {
  auto i = [](const char* field) { return ref_at(std::string("config/") + field).item<int64_t>(); };
  auto d = [](const char* field) { return ref_at(std::string("config/") + field).item<double>(); };
  return memopt::models::LlamaConfig()
      .vocab_size(i("vocab_size"))
      .hidden_size(i("hidden_size"))
      .num_hidden_layers(i("num_hidden_layers"))
      .num_attention_heads(i("num_attention_heads"))
      .num_key_value_heads(i("num_key_value_heads"))
      .intermediate_size(i("intermediate_size"))
      .max_position_embeddings(i("max_position_embeddings"))
      .rope_theta(d("rope_theta"))
      .rms_norm_eps(d("rms_norm_eps"))
      .dropout(0.0)
      .causal(causal)
      .mlp_row_tiles(mlp_tiles);
}

// A Llama holding the reference weights; every name must exist on both sides with the
// same shape (this is what proves the HF naming).
memopt::models::Llama reference_model(bool causal, int64_t mlp_tiles = 1) {
  torch::manual_seed(0);
  memopt::models::Llama model(reference_config(causal, mlp_tiles));
  const auto ref_params = ref_names("param/");
  std::set<std::string> ours;
  torch::NoGradGuard no_grad;
  for (auto& item : model->named_parameters()) {
    ours.insert(item.key());
    INFO("memopt parameter " << item.key() << " must exist in the reference");
    REQUIRE(ref_params.count(item.key()) == 1);
    const auto& src = ref_at("param/" + item.key());
    INFO("shape of " << item.key() << ": memopt " << item.value().sizes() << ", reference " << src.sizes());
    REQUIRE(item.value().sizes() == src.sizes());
    item.value().copy_(src);
  }
  for (const auto& name : ref_params) {
    INFO("reference parameter " << name << " must exist in memopt");
    REQUIRE(ours.count(name) == 1);
  }
  return model;
}

memopt::Batch reference_batch() { return {ref_at("inputs"), ref_at("targets")}; }

using memopt::test::max_abs_diff;

// Forward + backward of loss_sum / num_targets under `ckpt`; checks logits, loss and the
// gradients named in the reference under `prefix` ("" or "bidir/").
template <class Recompute>
void check_against_reference(memopt::models::Llama& model, const Recompute& ckpt, const std::string& prefix) {
  const auto batch = reference_batch();
  {
    torch::NoGradGuard no_grad;
    const torch::Tensor logits = model->forward(batch.inputs, ckpt);  // (B, T, V)
    const auto& ref = ref_at(prefix + "logits");
    REQUIRE(logits.sizes() == ref.sizes());
    const double diff = max_abs_diff(logits, ref);
    INFO(prefix << "logits max abs diff " << diff);
    CHECK(diff <= kLogitsAtol);
  }

  model->zero_grad();
  const torch::Tensor loss_sum = model->loss_sum(batch, ckpt);
  const double ref_loss = ref_at(prefix + "loss_sum").item<double>();
  const double loss_rel = std::abs(loss_sum.item<double>() - ref_loss) / std::abs(ref_loss);
  INFO(prefix << "loss_sum " << loss_sum.item<double>() << " vs " << ref_loss << " (rel diff " << loss_rel << ")");
  CHECK(loss_rel <= kLossRtol);
  REQUIRE(batch.num_targets().item<int64_t>() == ref_at("num_targets").item<int64_t>());
  (loss_sum / batch.num_targets()).backward();

  const auto grad_names = ref_names(prefix + "grad/");
  REQUIRE(!grad_names.empty());
  const auto params = model->named_parameters();
  double worst = 0.0;  // largest diff relative to its tensor's largest reference entry
  for (const auto& name : grad_names) {
    const auto* param = params.find(name);
    REQUIRE(param != nullptr);
    INFO("gradient of " << name);
    REQUIRE(param->grad().defined());
    const auto& ref = ref_at(prefix + "grad/" + name);
    const double scale = ref.abs().max().item<double>();
    REQUIRE(scale > 0);
    const double rel = max_abs_diff(param->grad(), ref) / scale;
    worst = std::max(worst, rel);
    INFO(prefix << "grad max abs diff / max abs reference = " << rel << " (max abs reference " << scale << ")");
    CHECK(rel <= kGradRtol);
  }
  INFO(prefix << "worst relative grad diff " << worst);
  CHECK(worst <= kGradRtol);
}

}  // namespace

TEST_CASE("Llama matches the python3-torch reference (causal)", "[llama]") {
  auto model = reference_model(/*causal=*/true);
  REQUIRE(ref_names("grad/").size() == model->named_parameters().size());  // every parameter has a reference grad
  SECTION("recompute::None") { check_against_reference(model, memopt::recompute::None{}, ""); }
  SECTION("recompute::EveryBlock") { check_against_reference(model, memopt::recompute::EveryBlock{}, ""); }
  SECTION("recompute::EveryNth<2>") { check_against_reference(model, memopt::recompute::EveryNth<2>{}, ""); }
}

TEST_CASE("Llama matches the python3-torch reference (bidirectional)", "[llama]") {
  auto model = reference_model(/*causal=*/false);
  SECTION("recompute::None") { check_against_reference(model, memopt::recompute::None{}, "bidir/"); }
  SECTION("recompute::EveryBlock") { check_against_reference(model, memopt::recompute::EveryBlock{}, "bidir/"); }
}

TEST_CASE("Llama with its MLP in row tiles matches the python3-torch reference", "[llama][mlp]") {
  auto model = reference_model(/*causal=*/true, /*mlp_tiles=*/3);  // the B·T rows in 3 tiles
  SECTION("recompute::None") { check_against_reference(model, memopt::recompute::None{}, ""); }
  SECTION("recompute::Selective") { check_against_reference(model, memopt::recompute::Selective{}, ""); }
  SECTION("recompute::EveryBlock") { check_against_reference(model, memopt::recompute::EveryBlock{}, ""); }
}

TEST_CASE("the reference tells a causal model from a bidirectional one", "[llama]") {
  // Guards the tolerances above: the two references differ far beyond them.
  REQUIRE(max_abs_diff(ref_at("logits"), ref_at("bidir/logits")) > 1000 * kLogitsAtol);
  auto causal = reference_model(/*causal=*/true);
  torch::NoGradGuard no_grad;
  REQUIRE(max_abs_diff(causal->forward(ref_at("inputs")), ref_at("bidir/logits")) > 1000 * kLogitsAtol);
}

TEST_CASE("Llama::generate is greedy and deterministic", "[llama]") {
  auto model = reference_model(/*causal=*/true);
  const auto& prompt = ref_at("generate/prompt");
  const auto& expected = ref_at("generate/tokens");
  const int64_t new_tokens = expected.numel() - prompt.numel();
  const auto options = memopt::models::SampleOptions().max_new_tokens(new_tokens);

  const auto first = model->generate(prompt, options);
  const auto second = model->generate(prompt, options);
  REQUIRE(first.numel() == prompt.numel() + new_tokens);
  REQUIRE(torch::equal(first, second));
  REQUIRE(torch::equal(first.slice(0, 0, prompt.numel()), prompt));
  REQUIRE(first.min().item<int64_t>() >= 0);
  REQUIRE(first.max().item<int64_t>() < model->config.vocab_size());
  INFO("memopt " << first << "\nreference " << expected);
  REQUIRE(torch::equal(first, expected));  // the reference's top-2 logit gaps are >= 1.7e-2
}

TEST_CASE("Llama::generate slides its context past max_position_embeddings", "[llama]") {
  auto model = reference_model(/*causal=*/true);
  const int64_t max_pos = model->config.max_position_embeddings();
  const auto prompt = torch::arange(max_pos, torch::kLong).remainder(model->config.vocab_size());
  const auto out = model->generate(prompt, memopt::models::SampleOptions().max_new_tokens(3));
  REQUIRE(out.numel() == max_pos + 3);
}

TEST_CASE("Llama rejects sequences longer than max_position_embeddings", "[llama]") {
  auto model = reference_model(/*causal=*/true);
  const int64_t too_long = model->config.max_position_embeddings() + 1;
  const auto tokens = torch::zeros({1, too_long}, torch::kLong);
  REQUIRE_THROWS_AS(model->forward(tokens), c10::Error);
  REQUIRE_THROWS_WITH(model->forward(tokens),
                      Catch::Contains("max_position_embeddings") && Catch::Contains("HINT"));
  const memopt::Batch batch{tokens, tokens};
  REQUIRE_THROWS_WITH(model->loss_sum(batch, memopt::recompute::EveryBlock{}),
                      Catch::Contains("max_position_embeddings") && Catch::Contains("HINT"));
  // At the limit it runs.
  REQUIRE_NOTHROW(model->forward(tokens.slice(1, 0, too_long - 1)));
}

TEST_CASE("shape_for_params sizes a LLaMA to about the target, with LLaMA-like proportions", "[llama]") {
  const auto base = memopt::models::LlamaConfig().vocab_size(4096).max_position_embeddings(64);
  for (const int64_t target : {int64_t{2'000'000}, int64_t{5'300'000}, int64_t{30'000'000}, int64_t{125'000'000},
                               int64_t{1'000'000'000}}) {
    const auto c = memopt::models::shape_for_params(target, base);
    const auto params = static_cast<double>(memopt::models::describe(c).num_parameters());
    INFO(target << " -> " << c.num_hidden_layers() << " layers, d" << c.hidden_size() << ", " << params);
    CHECK(std::abs(std::log(params / static_cast<double>(target))) < 0.1);  // within ~10%
    CHECK(c.hidden_size() % 64 == 0);
    CHECK(c.hidden_size() / c.num_hidden_layers() >= 32);
    CHECK(c.hidden_size() / c.num_hidden_layers() <= 128);
    CHECK(c.vocab_size() == 4096);
    CHECK_NOTHROW(c.validate());
  }
  // The counting matches the built model.
  const auto c = memopt::models::shape_for_params(3'000'000, base);
  memopt::models::Llama model(c);
  int64_t built = 0;
  for (const auto& p : model->parameters()) built += p.numel();
  CHECK(built == memopt::models::describe(c).num_parameters());
  // The reference shape (4 layers, d256) is what 5.3 M parameters give.
  const auto ref = memopt::models::shape_for_params(5'310'720, base);
  CHECK(ref.hidden_size() == 256);
  CHECK(ref.num_hidden_layers() == 4);
  memopt::test::require_error([&] { memopt::models::shape_for_params(0, base); }, "shape_for_params",
                              {"target_params must be >= 1 (got 0)"});
}

namespace {

memopt::models::LlamaConfig tied_config() {
  return memopt::models::LlamaConfig()
      .vocab_size(40)
      .hidden_size(32)
      .num_hidden_layers(2)
      .num_attention_heads(4)
      .num_key_value_heads(2)
      .head_dim(12)  // not 32 / 4
      .intermediate_size(48)
      .max_position_embeddings(16)
      .tie_word_embeddings(true);
}

}  // namespace

TEST_CASE("a tied Llama holds one weight: the head's is the embedding's, listed once", "[llama]") {
  torch::manual_seed(2);
  memopt::models::Llama tied(tied_config());
  CHECK(tied->lm_head->weight.is_same(tied->model->embed_tokens->weight));
  CHECK(tied->lm_head->parameters().empty());
  const auto named = tied->named_parameters();
  CHECK_FALSE(named.contains("lm_head.weight"));
  CHECK(named.contains("model.embed_tokens.weight"));
  memopt::models::Llama untied(tied_config().tie_word_embeddings(false));
  CHECK(named.size() + 1 == untied->named_parameters().size());
  std::vector<int64_t> numels;
  for (const auto& p : tied->parameters()) numels.push_back(p.numel());
  CHECK(memopt::models::describe(tied_config()).parameter_numels() == numels);  // the estimator counts it once

  // head_dim 12: q_proj (H·D, C), k/v_proj (KV·D, C), o_proj (C, H·D).
  CHECK(named["model.layers.0.self_attn.q_proj.weight"].sizes() == torch::IntArrayRef({48, 32}));
  CHECK(named["model.layers.0.self_attn.k_proj.weight"].sizes() == torch::IntArrayRef({24, 32}));
  CHECK(named["model.layers.0.self_attn.o_proj.weight"].sizes() == torch::IntArrayRef({32, 48}));

  // The tied gradient is the sum of the untied model's embedding and head gradients.
  {
    torch::NoGradGuard no_grad;
    for (auto& item : untied->named_parameters())
      item.value().copy_(item.key() == "lm_head.weight" ? named["model.embed_tokens.weight"] : named[item.key()]);
  }
  const auto tokens = torch::arange(24, torch::kLong).remainder(40).view({2, 12});
  const memopt::Batch batch{tokens, tokens.roll(-1, 1)};
  tied->loss_sum(batch, memopt::recompute::None{}).backward();
  untied->loss_sum(batch, memopt::recompute::None{}).backward();
  const auto untied_named = untied->named_parameters();
  const auto sum = untied_named["model.embed_tokens.weight"].grad() + untied_named["lm_head.weight"].grad();
  CHECK(max_abs_diff(tied->model->embed_tokens->weight.grad(), sum) <= 1e-5 * sum.abs().max().item<double>());

  // An optimizer step moves the one tensor; the head follows.
  torch::optim::AdamW adamw(tied->parameters(), torch::optim::AdamWOptions(1e-2));
  const auto before = tied->lm_head->weight.clone();
  adamw.step();
  CHECK_FALSE(torch::equal(tied->lm_head->weight, before));
  CHECK(tied->lm_head->weight.is_same(tied->model->embed_tokens->weight));

  // A dtype change and a clone keep the tie.
  tied->to(torch::kBFloat16);
  CHECK(tied->lm_head->weight.scalar_type() == torch::kBFloat16);
  CHECK(tied->lm_head->weight.is_same(tied->model->embed_tokens->weight));
  auto copy = std::dynamic_pointer_cast<memopt::models::LlamaImpl>(tied->clone());
  REQUIRE(copy != nullptr);
  CHECK(copy->lm_head->weight.is_same(copy->model->embed_tokens->weight));
  CHECK_FALSE(copy->lm_head->weight.is_same(tied->lm_head->weight));
  CHECK(torch::equal(copy->lm_head->weight, tied->lm_head->weight));
  CHECK(copy->named_parameters().size() == named.size());
}

TEST_CASE("dynamic RoPE runs past max_position_embeddings and equals plain RoPE within it", "[llama]") {
  torch::manual_seed(3);
  const auto plain_config = tied_config().max_position_embeddings(16);
  const auto dynamic_config = memopt::models::LlamaConfig(plain_config).rope_scaling(
      memopt::nn::RopeScaling().type(memopt::nn::RopeType::kDynamic).factor(2.0));
  memopt::models::Llama plain(plain_config), dynamic(dynamic_config);
  {
    torch::NoGradGuard no_grad;
    const auto from = plain->named_parameters();
    for (auto& item : dynamic->named_parameters()) item.value().copy_(from[item.key()]);
  }
  torch::NoGradGuard no_grad;
  const auto tokens = torch::arange(24, torch::kLong).remainder(40).view({1, 24});
  const auto within = tokens.narrow(1, 0, 16);
  CHECK(torch::equal(dynamic->forward(within), plain->forward(within)));  // the base grows only past 16
  CHECK_THROWS_WITH(plain->forward(tokens), Catch::Contains("exceeds max_position_embeddings 16"));
  const auto longer = dynamic->forward(tokens);  // (1, 24, V)
  CHECK(longer.size(1) == 24);
  CHECK(torch::isfinite(longer).all().item<bool>());
}
