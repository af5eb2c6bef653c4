// memopt/models/gritlm.hpp — GritLM (Muennighoff et al. 2024, "Generative Representational
// Instruction Tuning"; ContextualAI/gritlm): one LLaMA backbone that both embeds and
// generates. Embedding mode runs the blocks with bidirectional attention over the real
// (non-padding) tokens and mean-pools the final hidden states over the text's tokens (not
// the instruction/format prefix, not padding), L2-normalised; generation mode is the
// causal LM. Losses (training/model.py of the reference):
//   representation: scores = q · pᵀ / τ for the B queries against all B·G passages of the
//     batch (each query's group: 1 positive at row i·G, G − 1 hard negatives; every other
//     passage is an in-batch negative); cross-entropy with target i·G, mean over queries.
//   generative: next-token cross-entropy over the non-ignored targets, 'mixed' = mean over
//     the micro-batch's targets, 'token' = sum ÷ the number of sequences; × gen_loss_factor.
//   total = representation + generative.
// GritLMImpl is the Trainer's loss function, whole (f(batch, ckpt)) or in stages for
// accum::GradCache (memopt::RepresentationLoss: roles, rows, encode, rep_loss, gen_rows,
// gen_loss). Chunked generative shares divide by the whole batch's target count, so the
// chunks add up to the unchunked loss exactly (the reference averages chunk means instead).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include "memopt/batch.hpp"
#include "memopt/concepts.hpp"
#include "memopt/data/grit.hpp"
#include "memopt/models/llama.hpp"
#include "memopt/policies/recompute.hpp"

namespace memopt::models {

/// How the generative loss is normalised (the reference's --loss_gen_type).
enum class GenLossType { kMixed, kToken };

/// Options of the GritLM objective.  GritLMOptions().temperature(0.02).gen_loss_factor(1.0)
struct GritLMOptions {
  /// τ of the contrastive scores (the reference trains with 0.02).
  TORCH_ARG(double, temperature) = 0.02;
  TORCH_ARG(GenLossType, gen_loss_type) = GenLossType::kMixed;
  TORCH_ARG(double, gen_loss_factor) = 1.0;
  /// L2-normalise the pooled embeddings (the reference's --normalized).
  TORCH_ARG(bool, normalized) = true;

 public:
  void validate() const {
    TORCH_CHECK(temperature_ > 0 && std::isfinite(temperature_),
                "memopt::models::GritLM: temperature must be a positive number (got ", temperature_,
                "). HINT: GritLM trains with 0.02.");
    TORCH_CHECK(gen_loss_factor_ >= 0 && std::isfinite(gen_loss_factor_),
                "memopt::models::GritLM: gen_loss_factor must be >= 0 (got ", gen_loss_factor_,
                "). HINT: 1 weighs both losses alike; 0 trains embeddings only.");
  }
};

/// Mean of hidden (n, T, C) over the positions where pool (n, T) is true → (n, C) fp32.
/// A row with no pooled position gives 0 (no host sync to check it here: data::GritBatcher
/// never builds one).
///   auto e = memopt::models::mean_pool(hidden, batch.pool);
inline torch::Tensor mean_pool(const torch::Tensor& hidden, const torch::Tensor& pool) {
  auto weights = pool.to(torch::kFloat).unsqueeze(-1);                         // (n, T, 1)
  return (hidden.to(torch::kFloat) * weights).sum(1) / weights.sum(1).clamp_min(1);  // (n, C)
}

/// GritLM's contrastive loss: q (B, D), p (B·G, D), scores q pᵀ / τ (B, B·G), target of
/// query i the column i·G, cross-entropy averaged over queries.
///   auto loss = memopt::models::contrastive_loss(q, p, 0.02);
inline torch::Tensor contrastive_loss(const torch::Tensor& q, const torch::Tensor& p, double temperature) {
  const int64_t B = q.size(0);
  TORCH_CHECK(B >= 1 && p.size(0) % B == 0,
              "memopt::models::contrastive_loss: passages must be a whole number of groups per query (got ", B,
              " queries and ", p.size(0), " passages). HINT: each query needs group_size passages.");
  auto scores = torch::matmul(q.to(torch::kFloat), p.to(torch::kFloat).t()) / temperature;  // (B, B·G)
  auto target = torch::arange(B, torch::TensorOptions().dtype(torch::kLong).device(q.device())) * (p.size(0) / B);
  return torch::nn::functional::cross_entropy(scores, target);  // 0-dim, mean over queries
}

/// GritLM over a LLaMA (HF names: model.*, lm_head.*). Embeds with bidirectional attention,
/// generates with causal attention, and is the Trainer's loss function over data::GritBatch:
///   memopt::models::GritLM model(llama_config, memopt::models::GritLMOptions());
///   trainer.fit(loader, *model);                 // accum::None / Fixed<N> / GradCache alike
///   auto e = model->embed(batch.queries);        // (n, C), L2-normalised
class GritLMImpl : public torch::nn::Cloneable<GritLMImpl> {
 public:
  GritLMImpl(LlamaConfig config, GritLMOptions options) : config(config), options(options) { reset(); }

  void reset() override {
    options.validate();
    Llama llama(config);
    model = register_module("model", llama->model);
    lm_head = register_module("lm_head", llama->lm_head);
    llama_ = llama;
  }

  /// Embeddings of rows [begin, end) of `e`: (end − begin, C) fp32.
  template <RecomputePolicy Recompute>
  torch::Tensor embed(const data::EmbedBatch& e, int64_t begin, int64_t end, const Recompute& ckpt) {
    auto tokens = e.tokens.narrow(0, begin, end - begin);        // (n, T)
    auto attention = e.attention.narrow(0, begin, end - begin);  // (n, T) bool
    auto hidden = model->forward(tokens, ckpt, nn::AttentionMask{false, attention});  // (n, T, C)
    auto pooled = mean_pool(hidden, e.pool.narrow(0, begin, end - begin));          // (n, C)
    return options.normalized() ? torch::nn::functional::normalize(
                                      pooled, torch::nn::functional::NormalizeFuncOptions().dim(-1))
                                : pooled;
  }
  torch::Tensor embed(const data::EmbedBatch& e) { return embed(e, 0, e.tokens.size(0), recompute::None{}); }

  // ---- the loss in stages (memopt::RepresentationLoss) ----
  /// 2 (queries, passages) or 0 for a batch without an embedding part.
  int64_t roles(const data::GritBatch& b) const { return b.queries.tokens.defined() ? 2 : 0; }
  int64_t rows(const data::GritBatch& b, int64_t role) const { return part(b, role).tokens.size(0); }
  template <RecomputePolicy Recompute>
  torch::Tensor encode(const data::GritBatch& b, int64_t role, int64_t begin, int64_t end, const Recompute& ckpt) {
    return embed(part(b, role), begin, end, ckpt);  // (end − begin, C)
  }
  /// reps[0] (B, C) queries, reps[1] (B·G, C) passages.
  torch::Tensor rep_loss(const data::GritBatch&, const std::vector<torch::Tensor>& reps) const {
    return contrastive_loss(reps.at(0), reps.at(1), options.temperature());
  }
  int64_t gen_rows(const data::GritBatch& b) const {
    return b.generative.inputs.defined() ? b.generative.inputs.size(0) : 0;
  }
  /// Rows [begin, end) of the generative part: their share of its loss (see GenLossType).
  template <RecomputePolicy Recompute>
  torch::Tensor gen_loss(const data::GritBatch& b, int64_t begin, int64_t end, const Recompute& ckpt) {
    const Batch rows{b.generative.inputs.narrow(0, begin, end - begin), b.generative.targets.narrow(0, begin, end - begin)};
    torch::Tensor sum = llama_->loss_sum(rows, ckpt);  // 0-dim fp32, CE summed over the rows' targets
    torch::Tensor denominator = options.gen_loss_type() == GenLossType::kMixed
                                    ? b.generative.num_targets().clamp_min(1).to(torch::kFloat)
                                    : torch::full({}, static_cast<float>(gen_rows(b)), sum.options());
    return sum / denominator * options.gen_loss_factor();
  }

  /// The whole loss: generative first, then representations (the order GradCache runs them in,
  /// so dropout draws the same masks).
  template <RecomputePolicy Recompute>
  torch::Tensor operator()(const data::GritBatch& b, const Recompute& ckpt) {
    return loss_with(b, ckpt, [this](const data::GritBatch& batch, const std::vector<torch::Tensor>& reps) {
      return rep_loss(batch, reps);
    });
  }

  /// The whole loss, as operator(), with `score(b, {q, p})` in place of rep_loss (a cross-rank
  /// one: dist/grit_loss.hpp).
  template <RecomputePolicy Recompute, class Score>
  torch::Tensor loss_with(const data::GritBatch& b, const Recompute& ckpt, Score&& score) {
    torch::Tensor loss = torch::zeros({}, torch::TensorOptions().device(lm_head->weight.device()));
    if (gen_rows(b) > 0) loss = loss + gen_loss(b, 0, gen_rows(b), ckpt);
    if (roles(b) > 0) {
      auto q = encode(b, 0, 0, rows(b, 0), ckpt);  // (B, C)
      auto p = encode(b, 1, 0, rows(b, 1), ckpt);  // (B·G, C)
      loss = loss + score(b, std::vector<torch::Tensor>{q, p});
    }
    return loss;
  }

  /// The causal LM (shares every parameter): generation, perplexity.
  Llama& llama() { return llama_; }

  LlamaConfig config;
  GritLMOptions options;
  LlamaModel model{nullptr};
  torch::nn::Linear lm_head{nullptr};

 private:
  static const data::EmbedBatch& part(const data::GritBatch& b, int64_t role) {
    TORCH_CHECK(role == 0 || role == 1, "memopt::models::GritLM: role must be 0 (queries) or 1 (passages) (got ",
                role, ")");
    return role == 0 ? b.queries : b.passages;
  }
  Llama llama_{nullptr};
};
TORCH_MODULE(GritLM);

}  // namespace memopt::models
