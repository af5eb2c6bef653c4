// tests/dist/gather_test.cpp — memopt/dist/gather.hpp on two ranks (run by tests/dist/dist_test.sh):
// all_gather_with_grad puts each rank's rows in rank order (different row counts, CPU bf16
// widened on the wire), its backward sums the gradient over the ranks, and mismatched widths
// fail on both ranks naming them; a world of one returns its input. With a tiny GritLM, each
// rank's contrastive loss over its queries against both ranks' passages
// (gathered_contrastive_loss) averages, loss and parameter gradient, to models::contrastive_loss
// on the global batch in one process; and a data-parallel Trainer step with that loss (the
// loss examples/03_gritlm trains with) has the single-process step's loss and gradient norm,
// plain, with accum::GradCache and with its split_emb.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memopt/dist.hpp>
#include <memopt/dist/gather.hpp>
#include <memopt/dist/grit_loss.hpp>
#include <memopt/memopt.hpp>
#include <memopt/models/gritlm.hpp>

#include "dist/fixtures.hpp"
#include "support.hpp"

using namespace memopt::test::dist;  // dist/fixtures.hpp: launched()

namespace {

using memopt::data::EmbedBatch;
using memopt::data::GritBatch;
using memopt::models::GritLM;

// fp32 sums of 2 rows against 4, and of two ranks' partial gradients against one pass, differ
// in reduction order only: a few ulps (~1e-7) of the largest terms, times 1/τ = 20 through the
// scores. 1e-5 relative leaves a 5x margin; a missing rank's negatives move the loss by ~0.7.
constexpr double kTolerance = 1e-5;

memopt::models::LlamaConfig tiny_grit_config() {
  return memopt::models::LlamaConfig().vocab_size(64).hidden_size(32).num_hidden_layers(1).num_attention_heads(4)
      .intermediate_size(64).max_position_embeddings(16);
}

GritLM tiny_grit() {
  torch::manual_seed(1);  // the same weights on every rank
  return GritLM(tiny_grit_config(), memopt::models::GritLMOptions().temperature(0.05));
}

// n right-padded rows of random tokens (lengths 3..T, a 1-token instruction prefix), from `seed`.
EmbedBatch random_embed(int64_t n, int64_t T, int64_t seed) {
  torch::manual_seed(seed);
  auto lengths = torch::randint(3, T + 1, {n, 1}, torch::kLong);  // (n, 1)
  auto positions = torch::arange(T, torch::kLong).unsqueeze(0);   // (1, T)
  auto attention = positions < lengths;                           // (n, T)
  auto tokens = torch::randint(1, 64, {n, T}, torch::kLong).masked_fill(attention.logical_not(), 0);
  return {tokens, attention, attention.logical_and(positions >= 1)};
}

// The global batch (the same on every rank): 4 queries, 4·2 passages, no generative part.
GritBatch global_batch() {
  GritBatch b;
  b.queries = random_embed(4, 6, 11);
  b.passages = random_embed(8, 8, 12);
  b.group_size = 2;
  return b;
}

// Rank r's half: queries [2r, 2r + 2), their passages [4r, 4r + 4).
GritBatch rank_batch(int rank) {
  const GritBatch g = global_batch();
  auto rows = [](const EmbedBatch& e, int64_t begin, int64_t n) {
    return EmbedBatch{e.tokens.narrow(0, begin, n), e.attention.narrow(0, begin, n), e.pool.narrow(0, begin, n)};
  };
  GritBatch b = g;
  b.queries = rows(g.queries, 2 * rank, 2);
  b.passages = rows(g.passages, 4 * rank, 4);
  return b;
}

torch::Tensor flat_grads(torch::nn::Module& m) {
  std::vector<torch::Tensor> parts;
  for (const auto& p : m.parameters())
    parts.push_back(p.grad().defined() ? p.grad().reshape({-1}) : torch::zeros({p.numel()}));
  return torch::cat(parts);
}

struct OneBatch {  // a loader that always returns the same batch
  GritBatch batch;
  GritBatch next() { return batch; }
};

// Step 1's loss and gradient norm of a Trainer with `Accum`: data parallel on this rank's half,
// or one process (data_parallel(false), a world of one) on the global batch.
template <class Accum>
std::pair<double, double> first_step(Accum accum, bool data_parallel) {
  auto& world = data_parallel ? memopt::dist::world() : memopt::dist::local_world();
  GritLM model = tiny_grit();
  OneBatch loader{data_parallel ? rank_batch(world.rank()) : global_batch()};
  const auto options = memopt::TrainerOptions().lr(1e-3).warmup_steps(1).max_steps(1).handle_signals(false)
                           .log_interval(1000).data_parallel(data_parallel);
  memopt::Trainer<memopt::recompute::None, memopt::precision::Fp32, Accum> trainer(*model, options, std::move(accum));
  memopt::dist::GatheredGritLoss loss{model, &world};  // what examples/03_gritlm trains with
  const auto stats = trainer.step(loader, loss);
  return {stats.loss.template item<double>(), stats.grad_norm.template item<double>()};
}

}  // namespace

TEST_CASE("all_gather_with_grad gathers rows in rank order and sums their gradient over the ranks", "[dist]") {
  if (!launched()) return;
  auto& world = memopt::dist::world();
  const int r = world.rank();
  // rank r holds r + 1 rows of 3 values: 100·r + 0, 1, 2, ...
  torch::Tensor local = (torch::arange((r + 1) * 3, torch::kFloat).view({r + 1, 3}) + 100 * r).requires_grad_(true);
  const auto gathered = memopt::dist::gather_rows_with_grad(world, local);
  const auto expected = torch::cat({torch::arange(3, torch::kFloat).view({1, 3}),
                                    torch::arange(6, torch::kFloat).view({2, 3}) + 100});  // (3, 3)
  const std::vector<int64_t> counts{1, 2};
  CHECK(gathered.counts == counts);
  CHECK(gathered.begin == r);
  CHECK(torch::equal(gathered.rows, expected));
  // rank r's loss weighs every gathered row by r + 1: each rank's rows get 1 + 2 = 3
  (gathered.rows * (r + 1)).sum().backward();
  CHECK(torch::equal(local.grad(), torch::full_like(local, 3)));

  SECTION("CPU bf16 rows travel as fp32 and come back bf16") {
    const auto rows = memopt::dist::all_gather_with_grad(world, torch::full({2, 2}, 0.5 + r, torch::kBFloat16));
    CHECK(rows.scalar_type() == torch::kBFloat16);
    CHECK(torch::equal(rows.to(torch::kFloat), torch::cat({torch::full({2, 2}, 0.5), torch::full({2, 2}, 1.5)})));
  }
  SECTION("a world of one returns the rows themselves") {
    CHECK(memopt::dist::all_gather_with_grad(memopt::dist::local_world(), local).is_same(local));
  }
  SECTION("rows of different widths fail on both ranks, naming them") {
    const std::string prefix = "memopt::dist::all_gather_with_grad";
    memopt::test::require_error(
        [&] { memopt::dist::all_gather_with_grad(world, torch::zeros({2, 3 + r})); }, prefix,
        {r == 0 ? "rank 1's rows have 2 dims, 4 elements per row" : "rank 0's rows have 2 dims, 3 elements per row",
         "same width"});
  }
}

TEST_CASE("Gathered contrastive loss: the ranks' mean loss and gradient are the global batch's", "[dist]") {
  if (!launched()) return;
  auto& world = memopt::dist::world();
  GritLM model = tiny_grit();
  const memopt::recompute::None none;
  // ---- data parallel: this rank's 2 queries against both ranks' 8 passages ----
  const GritBatch mine = rank_batch(world.rank());
  auto q = model->encode(mine, 0, 0, 2, none);  // (2, C)
  auto p = model->encode(mine, 1, 0, 4, none);  // (4, C)
  torch::Tensor loss = memopt::dist::gathered_contrastive_loss(world, q, p, 0.05);
  const double local_only = memopt::models::contrastive_loss(q, p, 0.05).item<double>();  // this rank's negatives only
  loss.backward();
  torch::Tensor summed = torch::cat({flat_grads(*model), loss.detach().reshape({1})});
  world.all_reduce_sum({summed}, "test: gradients");
  const torch::Tensor mean = summed / world.size();  // what the Trainer's sum of loss ÷ 2 gives
  // ---- one process: models::contrastive_loss over the global batch (4 queries, 8 passages) ----
  model->zero_grad();
  const GritBatch global = global_batch();
  auto all_q = model->encode(global, 0, 0, 4, none);  // (4, C)
  auto all_p = model->encode(global, 1, 0, 8, none);  // (8, C)
  torch::Tensor ref = model->rep_loss(global, {all_q, all_p});  // models::contrastive_loss
  ref.backward();
  const torch::Tensor ref_grads = flat_grads(*model);

  const double dp_loss = mean[-1].item<double>(), ref_loss = ref.item<double>();
  INFO("loss: 2 ranks " << dp_loss << ", one process " << ref_loss << ", this rank's negatives only " << local_only);
  CHECK(std::abs(dp_loss - ref_loss) <= kTolerance * std::abs(ref_loss));
  CHECK(std::abs(local_only - ref_loss) > 1e-3);  // the gather matters: without it the loss differs
  const double scale = ref_grads.abs().max().item<double>();
  const double diff = (mean.narrow(0, 0, ref_grads.numel()) - ref_grads).abs().max().item<double>();
  INFO("max |grad_dp - grad_ref| = " << diff << ", max |grad_ref| = " << scale);
  CHECK(scale > 0);
  CHECK(diff <= kTolerance * scale);
}

TEST_CASE("A data-parallel GritLM step with gathered negatives is the global batch's step", "[dist]") {
  if (!launched()) return;
  // data parallel (collectives) first, then one process (none): the same sequence on both ranks
  auto check = [](auto accum) {
    const auto dp = first_step(accum, true), ref = first_step(accum, false);
    INFO("loss " << dp.first << " vs " << ref.first << ", grad norm " << dp.second << " vs " << ref.second);
    CHECK(std::abs(dp.first - ref.first) <= kTolerance * std::abs(ref.first));
    CHECK(std::abs(dp.second - ref.second) <= kTolerance * std::abs(ref.second));
  };
  using memopt::accum::GradCache;
  using memopt::accum::GradCacheOptions;
  SECTION("one graph") { check(memopt::accum::Runtime(1)); }
  SECTION("GradCache, chunks of 1: the cached gradients are the global loss's") {
    check(GradCache(GradCacheOptions().chunk_size(1)));
  }
  SECTION("GradCache split_emb") { check(GradCache(GradCacheOptions().chunk_size(1).split_emb(true))); }
}
