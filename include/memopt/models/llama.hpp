// memopt/models/llama.hpp — a LLaMA-style decoder: token embedding, N blocks of
// (RMSNorm → attention with RoPE and optional grouped KV heads → RMSNorm → SwiGLU),
// final norm and an output head, its own or tied to the embedding (tie_word_embeddings). Heads
// may be narrower or wider than hidden_size / heads (head_dim); RoPE may be scaled (linear,
// dynamic, llama3: nn/rope.hpp). Parameter names follow HuggingFace
// (model.layers.N.self_attn.q_proj.weight, lm_head.weight, …) so real checkpoints load.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "memopt/batch.hpp"
#include "memopt/concepts.hpp"
#include "memopt/memory/model_desc.hpp"
#include "memopt/nn/attention.hpp"
#include "memopt/nn/cross_entropy.hpp"
#include "memopt/nn/fused_add_norm.hpp"
#include "memopt/nn/fused_dropout.hpp"
#include "memopt/nn/linear_shared.hpp"
#include "memopt/nn/mlp.hpp"
#include "memopt/nn/rmsnorm.hpp"
#include "memopt/nn/rope.hpp"
#include "memopt/policies/recompute.hpp"

namespace memopt::models {

/// Model size and options, with HuggingFace's config.json field names.
///   auto cfg = memopt::models::LlamaConfig().vocab_size(4096).hidden_size(256).num_hidden_layers(4);
struct LlamaConfig {
  TORCH_ARG(int64_t, vocab_size) = 32000;
  TORCH_ARG(int64_t, hidden_size) = 512;
  TORCH_ARG(int64_t, num_hidden_layers) = 8;
  TORCH_ARG(int64_t, num_attention_heads) = 8;
  /// 0 means num_attention_heads (no grouped-query attention).
  TORCH_ARG(int64_t, num_key_value_heads) = 0;
  /// Width of one attention head; 0 means hidden_size / num_attention_heads.
  TORCH_ARG(int64_t, head_dim) = 0;
  /// 0 means LLaMA's rule: 8/3 · hidden_size rounded up to a multiple of 64.
  TORCH_ARG(int64_t, intermediate_size) = 0;
  TORCH_ARG(int64_t, max_position_embeddings) = 2048;
  TORCH_ARG(double, rope_theta) = 10000.0;
  /// HF's rope_scaling (rope_parameters in transformers 5): default (none), linear, dynamic, llama3.
  TORCH_ARG(nn::RopeScaling, rope_scaling) = {};
  /// true: lm_head computes with model.embed_tokens.weight, one tensor registered once.
  TORCH_ARG(bool, tie_word_embeddings) = false;
  TORCH_ARG(double, rms_norm_eps) = 1e-5;
  /// Dropout on attention probabilities and on each residual branch (training only).
  TORCH_ARG(double, dropout) = 0.0;
  /// false: bidirectional attention (a LLaDA student).
  TORCH_ARG(bool, causal) = true;
  /// Standard deviation of the normal init of linear and embedding weights.
  TORCH_ARG(double, initializer_range) = 0.02;
  /// kSdpa (LibTorch's SDPA, its CPU flash kernel), kFlash (memopt's brgemm flash attention on
  /// the CPU; nn/attention_flash.hpp), kBlockwise (memopt's; needs dropout 0) or kAuto (the
  /// fastest of the three on each shape, measured; nn/attention_choice.hpp):
  /// memory-efficient attention, no (T, T) scores. A runtime choice: not part of config.json.
  TORCH_ARG(nn::AttentionKind, attention_kind) = nn::AttentionKind::kMath;
  /// Query and key block of the blockwise attention; 0: nn::kAttentionQBlock / kAttentionKvBlock.
  TORCH_ARG(int64_t, attention_block_size) = 0;
  /// Rows per chunk of the output projection fused with the loss in loss_sum (the (B·T, V)
  /// logits are never held); 0: the full logits. A runtime choice: not part of config.json.
  TORCH_ARG(int64_t, loss_chunk_size) = 0;
  /// The norms, RoPE, the SwiGLU product and the chunked loss's softmax as fused CPU kernels
  /// (nn/fused.hpp; same values: fp32 within 1e-6; less kept for backward), and the residual
  /// dropouts fused into their adds (nn/fused_dropout.hpp: masks from another generator, not
  /// kept), the attention's residual add with the norm after it (nn/fused_add_norm.hpp), and
  /// q, k, v (and gate, up) as one node each (nn/linear_shared.hpp: one dX GEMM per group),
  /// with down and the output head, their bf16 dW by weight_grad (operands transposed first).
  /// A runtime choice: not part of config.json.
  TORCH_ARG(bool, fused_kernels) = false;
  /// > 1: each block's SwiGLU runs its rows (B·T) in this many tiles, each recomputed in
  /// backward (nn::SwiGLUOptions::row_tiles): no (B, T, F) activation kept, one tile's held in
  /// backward, for one more pass of the MLP's matmuls. A runtime choice: not part of config.json.
  TORCH_ARG(int64_t, mlp_row_tiles) = 1;


 public:
  nn::RMSNormOptions norm_options() const {
    return nn::RMSNormOptions(hidden_size_).eps(rms_norm_eps_).fused(fused_kernels_);
  }
  /// A block's two norms, which feed Linear layers only: with fused_kernels their output comes
  /// in autocast's dtype under autocast (nn::RMSNormOptions::autocast_output).
  nn::RMSNormOptions block_norm_options() const { return norm_options().autocast_output(fused_kernels_); }
  int64_t ffn_size() const {
    if (intermediate_size_ > 0) return intermediate_size_;
    const int64_t raw = (8 * hidden_size_ + 2) / 3;
    return (raw + 63) / 64 * 64;
  }
  int64_t kv_heads() const { return num_key_value_heads_ > 0 ? num_key_value_heads_ : num_attention_heads_; }
  /// head_dim, or hidden_size / num_attention_heads when 0.
  int64_t head_size() const { return head_dim_ > 0 ? head_dim_ : hidden_size_ / num_attention_heads_; }

  /// The RoPE tables' options: head_size(), rope_theta, rope_scaling, max_position_embeddings.
  nn::RopeOptions rope() const {
    return nn::RopeOptions(head_size()).theta(rope_theta_).scaling(rope_scaling_).max_position_embeddings(
        max_position_embeddings_);
  }

  /// Fails when a sequence of T tokens is longer than max_position_embeddings, unless RoPE is
  /// dynamic (which grows its base for such sequences, as transformers does).
  void check_seq_len(int64_t T, const char* who) const {
    TORCH_CHECK(T <= max_position_embeddings_ || rope_scaling_.type() == nn::RopeType::kDynamic, who,
                ": sequence length ", T, " exceeds max_position_embeddings ", max_position_embeddings_,
                ". HINT: lower --seq_len or raise max_position_embeddings.");
  }

  /// The self-attention of one block.
  nn::AttentionOptions attention_options() const {
    return nn::AttentionOptions(hidden_size_, num_attention_heads_)
        .num_kv_heads(kv_heads())
        .head_dim(head_dim_)
        .causal(causal_)
        .dropout(dropout_)
        .kind(attention_kind_)
        .q_block(attention_block_size_ > 0 ? attention_block_size_ : nn::kAttentionQBlock)
        .kv_block(attention_block_size_ > 0 ? attention_block_size_ : nn::kAttentionKvBlock)
        .fused_rope(fused_kernels_)
        .fused_projections(fused_kernels_);
  }

  void validate() const {
    auto positive = [](int64_t v, const char* name) {
      TORCH_CHECK(v >= 1, "memopt::models::LlamaConfig: ", name, " must be >= 1 (got ", v,
                  "). HINT: check the model preset or config.json.");
    };
    positive(vocab_size_, "vocab_size");
    positive(hidden_size_, "hidden_size");
    positive(num_hidden_layers_, "num_hidden_layers");
    positive(num_attention_heads_, "num_attention_heads");
    positive(max_position_embeddings_, "max_position_embeddings");
    TORCH_CHECK(head_dim_ >= 0, "memopt::models::LlamaConfig: head_dim must be >= 0 (got ", head_dim_,
                "). HINT: 0 means hidden_size / num_attention_heads.");
    if (head_dim_ > 0) {
      TORCH_CHECK(head_dim_ % 2 == 0, "memopt::models::LlamaConfig: head_dim must be even (got ", head_dim_,
                  "). HINT: RoPE rotates pairs of head dimensions.");
    } else {
      TORCH_CHECK(hidden_size_ % num_attention_heads_ == 0 && (hidden_size_ / num_attention_heads_) % 2 == 0,
                  "memopt::models::LlamaConfig: hidden_size / num_attention_heads must be an even integer (got ",
                  hidden_size_, " / ", num_attention_heads_, "). HINT: RoPE rotates pairs of head dimensions; "
                  "or set head_dim.");
    }
    rope_scaling_.validate();
    TORCH_CHECK(rope_scaling_.type() != nn::RopeType::kDynamic || head_size() > 2,
                "memopt::models::LlamaConfig: dynamic RoPE needs heads wider than 2 (got head size ", head_size(),
                "). HINT: its base grows with the power D / (D - 2).");
    TORCH_CHECK(num_attention_heads_ % kv_heads() == 0,
                "memopt::models::LlamaConfig: num_attention_heads must be a multiple of num_key_value_heads (got ",
                num_attention_heads_, " and ", kv_heads(), "). HINT: each key/value head serves an equal group of "
                "query heads; pick a divisor of num_attention_heads (equal to it: no grouping).");
    TORCH_CHECK(dropout_ >= 0 && dropout_ < 1, "memopt::models::LlamaConfig: dropout must lie in [0, 1) (got ",
                dropout_, "). HINT: a probability of zeroing an activation; 0 turns dropout off.");
    TORCH_CHECK(attention_kind_ != nn::AttentionKind::kBlockwise || dropout_ == 0,
                "memopt::models::LlamaConfig: the blockwise attention has no dropout (got dropout ", dropout_,
                "). HINT: use attention_kind(AttentionKind::kMath) for dropout, or set dropout 0.");
    TORCH_CHECK(mlp_row_tiles_ >= 1, "memopt::models::LlamaConfig: mlp_row_tiles must be >= 1 (got ", mlp_row_tiles_,
                "). HINT: 1 runs the MLP's rows in one piece; 4 or 8 keep a quarter or an eighth of its activations.");
    TORCH_CHECK(attention_block_size_ >= 0 && loss_chunk_size_ >= 0,
                "memopt::models::LlamaConfig: attention_block_size and loss_chunk_size must be >= 0 (got ",
                attention_block_size_, " and ", loss_chunk_size_, "). HINT: 0 picks the default.");
  }
};

/// This model's shape as the memory estimator and the planner see it (memory/model_desc.hpp).
///   auto e = memopt::memory::estimate(memopt::models::describe(cfg), run, policies);
inline memory::ModelDesc describe(const LlamaConfig& c) {
  memory::ModelDesc d;
  d.vocab_size = c.vocab_size();
  d.hidden_size = c.hidden_size();
  d.num_layers = c.num_hidden_layers();
  d.num_heads = c.num_attention_heads();
  d.num_kv_heads = c.kv_heads();
  d.head_size = c.head_size();
  d.tied_embeddings = c.tie_word_embeddings();
  d.ffn_size = c.ffn_size();
  d.attention = c.attention_kind();
  d.loss_chunk_size = c.loss_chunk_size();
  d.dropout = c.dropout() > 0;
  d.fused_kernels = c.fused_kernels();
  d.mlp_row_tiles = c.mlp_row_tiles();
  return d;
}

/// `base` (vocab, positions, dropout, ...) with the shape whose parameter count is nearest
/// `target_params` (on a log scale) among shapes of width a multiple of 64, heads of 64
/// dimensions (32 below width 128) and width / layers between 32 and 128 (GPT-2's and
/// LLaMA's aspect ratios); among counts within 2% of the best, the aspect nearest 64. The
/// embeddings count too, so a small target with a large vocabulary gets a thin model; a
/// target below the smallest shape gets the smallest (check num_parameters()).
///   auto cfg = memopt::models::shape_for_params(25'000'000, LlamaConfig().vocab_size(4096));
inline LlamaConfig shape_for_params(int64_t target_params, LlamaConfig base) {
  TORCH_CHECK(target_params >= 1, "memopt::models::shape_for_params: target_params must be >= 1 (got ", target_params,
              "). HINT: pass a parameter count such as 25000000 (25M)");
  struct Shape {
    int64_t dim, layers;
    double error, aspect;
  };
  std::vector<Shape> shapes;
  for (int64_t dim = 64; dim <= 16384; dim += 64) {
    auto c = base;
    c.hidden_size(dim).num_attention_heads(dim >= 128 ? dim / 64 : dim / 32).num_key_value_heads(0).head_dim(0)
        .intermediate_size(0);
    const auto one = static_cast<double>(describe(c.num_hidden_layers(1)).num_parameters());
    const double per_layer = static_cast<double>(describe(c.num_hidden_layers(2)).num_parameters()) - one;
    for (int64_t layers = (dim + 127) / 128; layers <= dim / 32; ++layers) {
      const double p = one + per_layer * static_cast<double>(layers - 1);
      shapes.push_back({dim, layers, std::abs(std::log(p / static_cast<double>(target_params))),
                        std::abs(std::log(static_cast<double>(dim) / static_cast<double>(layers) / 64.0))});
    }
  }
  const double best = std::min_element(shapes.begin(), shapes.end(), [](const Shape& a, const Shape& b) {
                        return a.error < b.error;
                      })->error;
  const Shape* pick = nullptr;
  for (const auto& s : shapes) {
    if (s.error <= best + 0.02 && (pick == nullptr || s.aspect < pick->aspect)) pick = &s;
  }
  return base.hidden_size(pick->dim).num_hidden_layers(pick->layers)
      .num_attention_heads(pick->dim >= 128 ? pick->dim / 64 : pick->dim / 32).num_key_value_heads(0).head_dim(0)
      .intermediate_size(0);
}

/// RMSNorm through the policy: recomputed in backward under recompute::Selective.
template <RecomputePolicy Recompute>
torch::Tensor cheap_norm(const Recompute& ckpt, const nn::RMSNorm& layer, const torch::Tensor& x) {
  auto module = layer.ptr();  // shared: outlives this call, as the recompute needs
  return run_cheap(ckpt, [module](const std::vector<torch::Tensor>& in) { return module->forward(in[0]); }, {x},
                   {layer->weight});
}

/// One decoder block: h = x + attn(norm(x)); y = h + mlp(norm(h)).
class LlamaDecoderLayerImpl : public torch::nn::Cloneable<LlamaDecoderLayerImpl> {
 public:
  explicit LlamaDecoderLayerImpl(LlamaConfig config) : config(config) { reset(); }
  void reset() override {
    self_attn = register_module("self_attn", nn::Attention(config.attention_options()));
    mlp = register_module(
        "mlp", nn::SwiGLU(nn::SwiGLUOptions(config.hidden_size(), config.ffn_size())
                                  .fused(config.fused_kernels())
                                  .fused_projections(config.fused_kernels())
                                  .row_tiles(config.mlp_row_tiles())));
    input_layernorm = register_module("input_layernorm", nn::RMSNorm(config.block_norm_options()));
    post_attention_layernorm = register_module("post_attention_layernorm", nn::RMSNorm(config.block_norm_options()));
  }

  /// x (B, T, C), cos/sin (T, D) -> (B, T, C)
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
    return forward(x, cos, sin, recompute::None{});
  }

  /// The same; recompute::Selective recomputes the norms, the attention core and the
  /// SwiGLU product in backward (memopt::run_cheap), keeping the matmul outputs.
  template <RecomputePolicy Recompute>
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const Recompute& ckpt, const nn::AttentionMask& mask = {}) {
    const double p = config.dropout();
    auto a = self_attn->forward(cheap_norm(ckpt, input_layernorm, x), cos, sin, ckpt, mask);  // (B, T, C)
    auto [h, n] = residual_norm(x, a, p, ckpt);                                          // (B, T, C) each
    auto m = mlp->forward(n, ckpt, /*to_block_output=*/true);                           // (B, T, C)
    return residual(h, m, p);                                                            // (B, T, C)
  }

  /// h = x + dropout(branch) and post_attention_layernorm(h): with fused_kernels one node
  /// (nn/fused_add_norm.hpp: the add, its dropout and the norm in one pass each way), except
  /// under a policy that recomputes the norms (recompute::Selective's run_cheap).
  template <RecomputePolicy Recompute>
  std::pair<torch::Tensor, torch::Tensor> residual_norm(const torch::Tensor& x, const torch::Tensor& branch, double p,
                                                        const Recompute& ckpt) {
    if constexpr (!hooks::RunCheap<Recompute>) {
      if (config.fused_kernels())
        return nn::fused_add_rms_norm(x, branch, post_attention_layernorm->weight, config.rms_norm_eps(), p,
                                      is_training(), post_attention_layernorm->output_dtype(x));
    }
    auto h = residual(x, branch, p);
    return {h, cheap_norm(ckpt, post_attention_layernorm, h)};
  }

  /// x + dropout(branch): with fused_kernels the dropout is fused into the add (its mask is
  /// regenerated in backward, not kept; nn/fused_dropout.hpp).
  torch::Tensor residual(const torch::Tensor& x, const torch::Tensor& branch, double p) {
    if (config.fused_kernels()) return nn::fused_dropout_add(x, branch, p, is_training());
    return x + torch::dropout(branch, p, is_training());
  }

  LlamaConfig config;
  nn::Attention self_attn{nullptr};
  nn::SwiGLU mlp{nullptr};
  nn::RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
};
TORCH_MODULE(LlamaDecoderLayer);

/// The stack without the head (HF's LlamaModel): embed_tokens, layers, norm.
class LlamaModelImpl : public torch::nn::Cloneable<LlamaModelImpl> {
 public:
  explicit LlamaModelImpl(LlamaConfig config) : config(config) { reset(); }
  void reset() override {
    embed_tokens = register_module("embed_tokens", torch::nn::Embedding(config.vocab_size(), config.hidden_size()));
    layers = register_module("layers", torch::nn::ModuleList());
    for (int64_t i = 0; i < config.num_hidden_layers(); ++i) layers->push_back(LlamaDecoderLayer(config));
    norm = register_module("norm", nn::RMSNorm(config.norm_options()));
  }

  /// tokens (B, T) -> hidden states (B, T, C); each block runs through the policy. `mask`
  /// overrides the config's causal flag and marks padded keys (see nn::AttentionMask).
  template <RecomputePolicy Recompute>
  torch::Tensor forward(const torch::Tensor& tokens, const Recompute& ckpt, const nn::AttentionMask& mask = {}) {
    const int64_t T = tokens.size(1);
    config.check_seq_len(T, "memopt::models::Llama");
    auto [cos, sin] = nn::rope_tables(T, config.rope(), tokens.device());  // (T, D) each
    auto x = embed_tokens(tokens);                                          // (B, T, C)
    for (int64_t i = 0; i < static_cast<int64_t>(layers->size()); ++i) {
      auto layer = layers->ptr<LlamaDecoderLayerImpl>(i);
      x = ckpt.run_block(
          i, *layer,
          [layer, ckpt, mask](const std::vector<torch::Tensor>& in) {
            return layer->forward(in[0], in[1], in[2], ckpt, mask);
          },
          {x, cos, sin});  // (B, T, C)
    }
    return norm(x);  // (B, T, C)
  }

  LlamaConfig config;
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  nn::RMSNorm norm{nullptr};
};
TORCH_MODULE(LlamaModel);

/// lm_head of a tied Llama: a Linear that registers no weight (the model sets its `weight` to
/// the embedding's). LibTorch's named_parameters() lists a tensor once per name it is
/// registered under (PyTorch's drops the repeats), so a second registration would have the
/// optimizer step the shared weight twice.
class TiedHeadImpl : public torch::nn::LinearImpl {
 public:
  explicit TiedHeadImpl(const torch::nn::LinearOptions& options) : torch::nn::LinearImpl(options) {
    parameters_.erase("weight");
  }
};

/// Sampling options for Llama::generate.  SampleOptions().max_new_tokens(64).temperature(0.8)
struct SampleOptions {
  TORCH_ARG(int64_t, max_new_tokens) = 64;
  /// 0 means greedy decoding.
  TORCH_ARG(double, temperature) = 0.0;
  /// Keep the k most likely tokens before sampling; 0 keeps all.
  TORCH_ARG(int64_t, top_k) = 0;
  TORCH_ARG(uint64_t, seed) = 0;
  /// Stop after this token (-1: never).
  TORCH_ARG(int64_t, eos_id) = -1;
};

/// LLaMA for causal LM (HF's LlamaForCausalLM): model + lm_head. With tie_word_embeddings,
/// lm_head->weight is model->embed_tokens->weight (one tensor) and lm_head registers no
/// parameter of its own, so named_parameters() lists it once, as model.embed_tokens.weight.
///   memopt::models::Llama model(memopt::models::LlamaConfig().vocab_size(4096));
///   auto logits = model->forward(tokens);                          // (B, T, V)
///   auto loss = model->loss_sum(batch, memopt::recompute::EveryBlock{});
class LlamaImpl : public torch::nn::Cloneable<LlamaImpl> {
 public:
  explicit LlamaImpl(LlamaConfig config) : config(config) {
    config.validate();
    reset();
  }
  void reset() override {
    model = register_module("model", LlamaModel(config));
    const auto head = torch::nn::LinearOptions(config.hidden_size(), config.vocab_size()).bias(false);
    if (config.tie_word_embeddings()) {
      std::shared_ptr<torch::nn::LinearImpl> tied = std::make_shared<TiedHeadImpl>(head);
      lm_head = register_module("lm_head", torch::nn::Linear(tied));
      lm_head->weight = model->embed_tokens->weight;  // one tensor, registered in embed_tokens
    } else {
      lm_head = register_module("lm_head", torch::nn::Linear(head));
    }
    init_weights();
  }

  /// A deep copy (on `device` if given). Cloneable's copies each submodule apart, which would
  /// untie the head, so a tied model is built afresh and takes a copy of every parameter.
  std::shared_ptr<torch::nn::Module> clone(const std::optional<torch::Device>& device = std::nullopt) const override {
    if (!config.tie_word_embeddings()) return torch::nn::Cloneable<LlamaImpl>::clone(device);
    torch::NoGradGuard no_grad;
    auto copy = std::make_shared<LlamaImpl>(config);
    const auto from = named_parameters();
    for (auto& item : copy->named_parameters()) {
      const torch::Tensor& source = from[item.key()];
      item.value().set_data(device && source.device() != *device ? source.to(*device) : source.clone());
    }
    copy->train(is_training());
    return copy;
  }

  /// Normal(0, initializer_range) for linear and embedding weights, ones for norms.
  void init_weights() {
    torch::NoGradGuard no_grad;
    for (auto& item : named_parameters()) {
      if (item.value().dim() >= 2) item.value().normal_(0.0, config.initializer_range());
    }
  }

  /// tokens (B, T) -> logits (B, T, V)
  template <RecomputePolicy Recompute>
  torch::Tensor forward(const torch::Tensor& tokens, const Recompute& ckpt) {
    auto hidden = model->forward(tokens, ckpt);  // (B, T, C)
    if (!config.fused_kernels()) return lm_head(hidden);
    return nn::linear_shared_input(hidden, {lm_head->weight}).front();  // (B, T, V): its weight_grad
  }
  torch::Tensor forward(const torch::Tensor& tokens) { return forward(tokens, recompute::None{}); }

  /// Sum of next-token cross-entropies over the batch's non-ignored targets (fp32). With
  /// loss_chunk_size > 0 the head and the loss run fused, chunk by chunk, without logits.
  template <RecomputePolicy Recompute>
  torch::Tensor loss_sum(const Batch& batch, const Recompute& ckpt) {
    if (config.loss_chunk_size() > 0) {
      auto hidden = model->forward(batch.inputs, ckpt);  // (B, T, C)
      return nn::chunked_cross_entropy_sum(
          hidden.reshape({-1, hidden.size(-1)}), lm_head->weight, batch.targets.reshape({-1}),
          nn::ChunkedCrossEntropyOptions().chunk_size(config.loss_chunk_size()).ignore_index(kIgnoreIndex).fused(
              config.fused_kernels()));
    }
    auto logits = forward(batch.inputs, ckpt);  // (B, T, V)
    return torch::nn::functional::cross_entropy(
        logits.reshape({-1, logits.size(-1)}).to(torch::kFloat), batch.targets.reshape({-1}),
        torch::nn::functional::CrossEntropyFuncOptions().ignore_index(kIgnoreIndex).reduction(torch::kSum));
  }

  /// Continues `prompt` (1-D token ids); greedy when temperature is 0.
  torch::Tensor generate(const torch::Tensor& prompt, const SampleOptions& options) {
    TORCH_CHECK(prompt.dim() == 1 && prompt.numel() >= 1, "memopt::models::Llama::generate: prompt must be a "
                "non-empty 1-D tensor of token ids (got shape ", prompt.sizes(), ").");
    TORCH_CHECK(prompt.max().item<int64_t>() < config.vocab_size() && prompt.min().item<int64_t>() >= 0,
                "memopt::models::Llama::generate: prompt token ids must lie in [0, ", config.vocab_size(),
                "). HINT: use the tokenizer the model was trained with.");
    torch::NoGradGuard no_grad;
    const bool was_training = is_training();
    eval();
    std::mt19937_64 rng(options.seed());
    std::vector<int64_t> ids(prompt.data_ptr<int64_t>(), prompt.data_ptr<int64_t>() + prompt.numel());
    for (int64_t n = 0; n < options.max_new_tokens(); ++n) {
      const int64_t start = std::max<int64_t>(0, static_cast<int64_t>(ids.size()) - config.max_position_embeddings());
      auto context = torch::tensor(std::vector<int64_t>(ids.begin() + start, ids.end())).unsqueeze(0);  // (1, T)
      auto logits = forward(context.to(lm_head->weight.device())).select(1, -1).squeeze(0).to(torch::kFloat).cpu();  // (V)
      const int64_t next = pick_token(logits, options, rng);
      ids.push_back(next);
      if (next == options.eos_id()) break;
    }
    train(was_training);
    return torch::tensor(ids);
  }

  LlamaConfig config;
  LlamaModel model{nullptr};
  torch::nn::Linear lm_head{nullptr};

 private:
  static int64_t pick_token(torch::Tensor logits, const SampleOptions& options, std::mt19937_64& rng) {
    if (options.temperature() <= 0) return logits.argmax().item<int64_t>();
    logits = logits / options.temperature();
    if (options.top_k() > 0 && options.top_k() < logits.size(0)) {
      auto kth = std::get<0>(logits.topk(options.top_k())).min();
      logits = logits.masked_fill(logits < kth, -std::numeric_limits<float>::infinity());
    }
    auto probs = torch::softmax(logits, 0).contiguous();
    std::discrete_distribution<int64_t> pick(probs.data_ptr<float>(), probs.data_ptr<float>() + probs.numel());
    return pick(rng);
  }
};
TORCH_MODULE(Llama);

}  // namespace memopt::models
