// Tests of memopt/models/gritlm.hpp and accum::GradCache: the contrastive loss and pooling
// against python3-torch (tests/baselines/gritlm_reference.py) and a brute-force
// cross-entropy; bidirectional, padding-blind embeddings and a causal generator on one
// backbone; GradCache's gradients equal one backward through the whole batch (chunks,
// split_emb, checkpointing, dropout replayed); its memory follows the chunk size; the
// Trainer steps the same with GradCache as without.
#include <catch2/catch.hpp>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <memopt/memopt.hpp>
#include <memopt/models/gritlm.hpp>

#include "support.hpp"

namespace {

using memopt::data::EmbedBatch;
using memopt::data::GritBatch;
using memopt::models::GritLM;
using memopt::models::GritLMOptions;
using memopt::models::LlamaConfig;

LlamaConfig tiny_config(double dropout = 0.0, int64_t hidden = 32) {
  return LlamaConfig()
      .vocab_size(64)
      .hidden_size(hidden)
      .num_hidden_layers(2)
      .num_attention_heads(4)
      .intermediate_size(2 * hidden)
      .max_position_embeddings(64)
      .dropout(dropout);
}

// n right-padded rows of random tokens: lengths in [4, T], instruction prefixes of 0-2 tokens.
EmbedBatch random_embed(int64_t n, int64_t T) {
  auto lengths = torch::randint(4, T + 1, {n, 1}, torch::kLong);        // (n, 1)
  auto instruction = torch::randint(0, 3, {n, 1}, torch::kLong);        // (n, 1)
  auto positions = torch::arange(T, torch::kLong).unsqueeze(0);         // (1, T)
  auto attention = positions < lengths;                                 // (n, T)
  auto tokens = torch::randint(1, 64, {n, T}, torch::kLong).masked_fill(attention.logical_not(), 0);
  return {tokens, attention, attention.logical_and(positions >= instruction)};
}

// B queries, B·G passages, Bg generative rows (targets: -100 on a 2-token prompt and padding).
GritBatch random_batch(int64_t B, int64_t G, int64_t Bg, int64_t T = 12) {
  GritBatch b;
  b.queries = random_embed(B, T);
  b.passages = random_embed(B * G, T);
  b.group_size = G;
  if (Bg > 0) {
    auto seq = torch::randint(1, 64, {Bg, T + 1}, torch::kLong);
    auto targets = seq.narrow(1, 1, T).clone();
    targets.narrow(1, 0, 2).fill_(memopt::kIgnoreIndex);
    targets.narrow(1, T - 2, 2).select(0, 0).fill_(memopt::kIgnoreIndex);  // row 0 padded at the end
    b.generative = {seq.narrow(1, 0, T).clone(), targets};
  }
  return b;
}

std::map<std::string, torch::Tensor> take_grads(torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> out;
  for (auto& p : m.named_parameters()) {
    out[p.key()] = p.value().grad().defined() ? p.value().grad().clone() : torch::zeros_like(p.value());
    p.value().mutable_grad() = torch::Tensor();
  }
  return out;
}

void require_same_grads(const std::map<std::string, torch::Tensor>& a, const std::map<std::string, torch::Tensor>& b,
                        double tol) {
  REQUIRE(a.size() == b.size());
  for (const auto& [name, g] : a) {
    const double diff = (g - b.at(name)).abs().max().item<double>();
    const double scale = std::max(1.0, b.at(name).abs().max().item<double>());
    INFO(name << ": max |diff| " << diff);
    CHECK(diff <= tol * scale);
  }
}

// The whole loss, one backward (the reference).
template <class Ckpt = memopt::recompute::None>
double full_backward(GritLM& model, const GritBatch& b, const Ckpt& ckpt = {}) {
  torch::Tensor loss = (*model)(b, ckpt);
  loss.backward();
  return loss.item<double>();
}

template <class Ckpt = memopt::recompute::None>
double gradcache_backward(GritLM& model, const GritBatch& b, memopt::accum::GradCacheOptions options,
                          const Ckpt& ckpt = {}) {
  memopt::precision::Fp32 precision;
  memopt::accum::GradCache cache(options);
  const torch::Tensor loss = cache.forward_backward(b, *model, ckpt, precision, c10::kCPU, torch::ones({}));
  return loss.item<double>();
}

}  // namespace

TEST_CASE("contrastive loss matches python3-torch and a brute-force cross-entropy", "[gritlm]") {
  const auto ref = memopt::test::load_baseline("gritlm_reference.pt");
  auto q = ref.at("q").clone().requires_grad_(true);
  auto p = ref.at("p").clone().requires_grad_(true);
  const double tau = ref.at("temperature").item<double>();
  namespace F = torch::nn::functional;
  auto qn = F::normalize(q, F::NormalizeFuncOptions().dim(-1));
  auto pn = F::normalize(p, F::NormalizeFuncOptions().dim(-1));
  auto loss = memopt::models::contrastive_loss(qn, pn, tau);
  loss.backward();
  CHECK(loss.item<double>() == Approx(ref.at("loss").item<double>()).epsilon(1e-5));
  CHECK((q.grad() - ref.at("grad_q")).abs().max().item<double>() < 1e-4);
  CHECK((p.grad() - ref.at("grad_p")).abs().max().item<double>() < 1e-4);

  // brute force: −log softmax of row i at column i·G, averaged, in double
  const int64_t B = qn.size(0), N = pn.size(0), G = ref.at("group_size").item<int64_t>();
  auto qd = qn.detach().to(torch::kDouble), pd = pn.detach().to(torch::kDouble);
  double total = 0;
  for (int64_t i = 0; i < B; ++i) {
    std::vector<double> s(static_cast<size_t>(N));
    double max_s = -1e300;
    for (int64_t j = 0; j < N; ++j) {
      double dot = 0;
      for (int64_t d = 0; d < qd.size(1); ++d) dot += qd[i][d].item<double>() * pd[j][d].item<double>();
      s[static_cast<size_t>(j)] = dot / tau;
      max_s = std::max(max_s, s[static_cast<size_t>(j)]);
    }
    double z = 0;
    for (double v : s) z += std::exp(v - max_s);
    total += -(s[static_cast<size_t>(i * G)] - max_s - std::log(z));
  }
  CHECK(loss.item<double>() == Approx(total / static_cast<double>(B)).epsilon(1e-5));

  memopt::test::require_error([&] { memopt::models::contrastive_loss(qn, pn.narrow(0, 0, 4), tau); },
                              "memopt::models::contrastive_loss", {"3 queries", "4 passages"});
}

TEST_CASE("mean pooling counts only the text: no instruction, no padding (python3-torch)", "[gritlm]") {
  const auto ref = memopt::test::load_baseline("gritlm_reference.pt");
  const auto& hidden = ref.at("hidden");                                              // (n, T, C)
  const auto& attention = ref.at("attention");                                        // (n, T)
  auto positions = torch::arange(hidden.size(1), torch::kLong).unsqueeze(0);          // (1, T)
  auto pool = attention.logical_and(positions >= ref.at("instruction_lens").unsqueeze(1));  // (n, T)
  namespace F = torch::nn::functional;
  auto pooled = F::normalize(memopt::models::mean_pool(hidden, pool), F::NormalizeFuncOptions().dim(-1));
  CHECK((pooled - ref.at("pooled")).abs().max().item<double>() < 1e-6);
  // whatever sits at instruction and pad positions does not matter
  auto scrambled = hidden.clone().masked_fill(pool.logical_not().unsqueeze(-1), 1e3);
  auto again = F::normalize(memopt::models::mean_pool(scrambled, pool), F::NormalizeFuncOptions().dim(-1));
  CHECK((again - pooled).abs().max().item<double>() < 1e-6);
}

TEST_CASE("one backbone: bidirectional, padding-blind embeddings and a causal generator", "[gritlm]") {
  for (auto kind : {memopt::nn::AttentionKind::kMath, memopt::nn::AttentionKind::kBlockwise}) {
    torch::manual_seed(3);
    GritLM model(tiny_config().attention_kind(kind).attention_block_size(4), GritLMOptions());
    model->eval();
    torch::NoGradGuard no_grad;
    auto tokens = torch::randint(1, 64, {1, 6}, torch::kLong);
    auto changed = tokens.clone();
    changed[0][5] = (tokens[0][5].item<int64_t>() % 63) + 1;
    const memopt::recompute::None none;
    auto all = torch::ones({1, 6}, torch::kBool);
    const memopt::nn::AttentionMask bidirectional{false, all};
    // embedding mode: the last token reaches the first position
    auto h0 = model->model->forward(tokens, none, bidirectional).select(1, 0);
    auto h1 = model->model->forward(changed, none, bidirectional).select(1, 0);
    CHECK((h0 - h1).abs().max().item<double>() > 1e-4);
    // generation mode: it does not
    auto c0 = model->model->forward(tokens, none).select(1, 0);
    auto c1 = model->model->forward(changed, none).select(1, 0);
    CHECK((c0 - c1).abs().max().item<double>() < 1e-6);
    CHECK((model->llama()->forward(tokens) - model->lm_head(model->model->forward(tokens, none))).abs().max()
              .item<double>() < 1e-6);

    // padding: the same 5 tokens padded to 9 with junk embed the same
    auto text = torch::randint(1, 64, {1, 5}, torch::kLong);
    auto padded = torch::cat({text, torch::randint(1, 64, {1, 4}, torch::kLong)}, 1);
    auto real = torch::arange(9, torch::kLong).unsqueeze(0) < 5;
    auto pool5 = torch::ones({1, 5}, torch::kBool);
    pool5[0][0] = false;  // a one-token instruction
    auto pool9 = real.clone();
    pool9[0][0] = false;
    auto short_e = model->embed(EmbedBatch{text, torch::ones({1, 5}, torch::kBool), pool5});
    auto long_e = model->embed(EmbedBatch{padded, real, pool9});
    INFO("attention kind " << static_cast<int>(kind));
    CHECK((short_e - long_e).abs().max().item<double>() < 1e-5);
    CHECK(short_e.norm().item<double>() == Approx(1.0).epsilon(1e-5));
  }
}

TEST_CASE("GradCache gives the gradients of one backward through the whole batch", "[gritlm][gradcache]") {
  torch::manual_seed(11);
  GritLM model(tiny_config(), GritLMOptions());
  const GritBatch batch = random_batch(/*B=*/5, /*G=*/2, /*Bg=*/3);
  const double full = full_backward(model, batch);
  const auto expected = take_grads(*model);

  SECTION("chunks of 3 rows (uneven)") {
    const double loss = gradcache_backward(model, batch, memopt::accum::GradCacheOptions().chunk_size(3));
    CHECK(loss == Approx(full).epsilon(1e-5));
    require_same_grads(take_grads(*model), expected, 1e-5);
  }
  SECTION("chunks of 1 row, blocks checkpointed") {
    const double loss = gradcache_backward(model, batch, memopt::accum::GradCacheOptions().chunk_size(1),
                                           memopt::recompute::EveryBlock{});
    CHECK(loss == Approx(full).epsilon(1e-5));
    require_same_grads(take_grads(*model), expected, 1e-5);
  }
  SECTION("split_emb") {
    const double loss = gradcache_backward(model, batch, memopt::accum::GradCacheOptions().chunk_size(2).split_emb(true));
    CHECK(loss == Approx(full).epsilon(1e-5));
    require_same_grads(take_grads(*model), expected, 1e-5);
  }
  SECTION("a chunk as large as the batch") {
    gradcache_backward(model, batch, memopt::accum::GradCacheOptions().chunk_size(64));
    require_same_grads(take_grads(*model), expected, 1e-5);
  }
}

TEST_CASE("GradCache replays each chunk's dropout masks", "[gritlm][gradcache]") {
  torch::manual_seed(12);
  GritLM model(tiny_config(/*dropout=*/0.2), GritLMOptions());
  model->train();
  const GritBatch batch = random_batch(4, 2, /*Bg=*/2);
  const int64_t chunk = 3;

  // Reference: the same masks (chunks drawn in GradCache's order), one backward through all.
  torch::manual_seed(99);
  const memopt::recompute::None none;
  auto loss = model->gen_loss(batch, 0, 2, none);  // 2 rows: one chunk
  std::vector<torch::Tensor> reps;
  for (int64_t role = 0; role < 2; ++role) {
    std::vector<torch::Tensor> parts;
    for (int64_t b = 0; b < model->rows(batch, role); b += chunk)
      parts.push_back(model->encode(batch, role, b, std::min(b + chunk, model->rows(batch, role)), none));
    reps.push_back(torch::cat(parts));
  }
  loss = loss + model->rep_loss(batch, reps);
  loss.backward();
  const auto expected = take_grads(*model);
  const auto rng_after_reference = torch::rand({4});

  torch::manual_seed(99);
  const double cached = gradcache_backward(model, batch, memopt::accum::GradCacheOptions().chunk_size(chunk));
  CHECK(cached == Approx(loss.item<double>()).epsilon(1e-5));
  require_same_grads(take_grads(*model), expected, 1e-5);
  CHECK(torch::equal(torch::rand({4}), rng_after_reference));  // the RNG moved on as after one pass

  // split_emb: whole roles, in order (what the whole loss draws)
  torch::manual_seed(5);
  const double whole = full_backward(model, batch);
  const auto expected_whole = take_grads(*model);
  torch::manual_seed(5);
  const double split = gradcache_backward(model, batch, memopt::accum::GradCacheOptions().chunk_size(2).split_emb(true));
  CHECK(split == Approx(whole).epsilon(1e-5));
  require_same_grads(take_grads(*model), expected_whole, 1e-5);
}

TEST_CASE("GradCache's peak memory follows the chunk size, not the batch size", "[gritlm][gradcache]") {
  auto& tracker = memopt::memory::Tracker::instance();
  REQUIRE(tracker.installed());
  torch::manual_seed(13);
  GritLM model(tiny_config(0.0, /*hidden=*/64), GritLMOptions());
  const GritBatch batch = random_batch(/*B=*/64, /*G=*/1, /*Bg=*/0, /*T=*/48);
  auto peak_of = [&](auto&& run) {
    const int64_t before = tracker.live_bytes();
    tracker.reset_peaks();
    run();
    const int64_t peak = tracker.snapshot().peak_bytes - before;
    take_grads(*model);
    return peak;
  };
  const int64_t full = peak_of([&] { full_backward(model, batch); });
  const int64_t chunk8 = peak_of([&] { gradcache_backward(model, batch, memopt::accum::GradCacheOptions().chunk_size(8)); });
  const int64_t chunk16 =
      peak_of([&] { gradcache_backward(model, batch, memopt::accum::GradCacheOptions().chunk_size(16)); });
  const int64_t split = peak_of([&] {
    gradcache_backward(model, batch, memopt::accum::GradCacheOptions().split_emb(true));
  });
  INFO("peak over live: full batch " << full << " B, chunk 8 " << chunk8 << " B, chunk 16 " << chunk16
                                     << " B, split_emb " << split << " B");
  CHECK(chunk8 < full / 4);
  CHECK(chunk16 > chunk8);
  CHECK(chunk16 < full / 2);
  CHECK(split < full * 3 / 4);  // one role's activations at a time
}

namespace {
struct FixedGritLoader {
  std::vector<GritBatch> batches;
  size_t next_index = 0;
  GritBatch next() { return batches[next_index++ % batches.size()]; }
};
}  // namespace

TEST_CASE("the Trainer steps the same with accum::GradCache as with one whole backward", "[gritlm][gradcache]") {
  torch::manual_seed(21);
  FixedGritLoader data{{random_batch(4, 2, 2), random_batch(4, 2, 2)}};
  GritLM a(tiny_config(), GritLMOptions());
  GritLM b(tiny_config(), GritLMOptions());
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < a->parameters().size(); ++i) b->parameters()[i].copy_(a->parameters()[i]);
  }
  // eps 1e-6: Adam's first update is g / (|g| + eps) · lr, a step of ±lr for any |g| >> eps; with
  // the default 1e-8 a gradient element near 1e-8 turns rounding noise between the two
  // (equal in exact arithmetic) backward orders into an lr-sized weight difference.
  const auto options = memopt::TrainerOptions().lr(1e-2).eps(1e-6).max_steps(2).log_interval(1).grad_clip(1.0);
  memopt::Trainer<memopt::recompute::None, memopt::precision::Fp32, memopt::accum::None> plain(*a, options);
  memopt::Trainer<memopt::recompute::None, memopt::precision::Fp32, memopt::accum::GradCache> cached(
      *b, options, memopt::accum::GradCache(memopt::accum::GradCacheOptions().chunk_size(3)));
  FixedGritLoader la = data, lb = data;
  const auto ra = plain.fit(la, *a);
  const auto rb = cached.fit(lb, *b);
  CHECK(rb.final_loss == Approx(ra.final_loss).epsilon(1e-5));
  for (size_t i = 0; i < a->parameters().size(); ++i)
    CHECK((a->parameters()[i] - b->parameters()[i]).abs().max().item<double>() < 1e-5);
  CHECK(ra.final_loss > 0);
}

TEST_CASE("GritLM and GradCache options reject bad values with a HINT", "[gritlm][gradcache]") {
  memopt::test::require_error([] { memopt::accum::GradCache(memopt::accum::GradCacheOptions().chunk_size(0)); },
                              "memopt::accum::GradCache", {"chunk_size", "(got 0)"});
  memopt::test::require_error([] { memopt::accum::GradCache(memopt::accum::GradCacheOptions().micro_steps(-1)); },
                              "memopt::accum::GradCache", {"micro_steps", "(got -1)"});
  memopt::test::require_error([] { GritLM(tiny_config(), GritLMOptions().temperature(0)); },
                              "memopt::models::GritLM", {"temperature", "(got 0)"});
  memopt::test::require_error([] { GritLM(tiny_config(), GritLMOptions().gen_loss_factor(-1)); },
                              "memopt::models::GritLM", {"gen_loss_factor", "(got -1)"});
}
