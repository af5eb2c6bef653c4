// memopt/memory/model_desc.hpp — ModelDesc: a model's shape as the memory estimator and the
// planner see it (parameter tensors, activation-size classes, FLOPs per token). Each model
// header builds its own (models::describe), so the estimator depends on no model.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "memopt/nn/attention.hpp"  // AttentionKind
#include "memopt/nn/lora.hpp"       // LoraOptions

namespace memopt::memory {

/// The model's shape as the estimator needs it: a LLaMA, a LLaMA whose feed-forward is a
/// mixture of experts, a distillation step. Models describe themselves: models::describe(cfg)
/// (models/llama.hpp, models/moe.hpp), models::describe_distill (models/distill.hpp).
///   auto desc = memopt::models::describe(cfg);
struct ModelDesc {
  int64_t vocab_size = 0, hidden_size = 0, num_layers = 0, num_heads = 0, num_kv_heads = 0, ffn_size = 0;
  int64_t head_size = 0;         // the width of one head; 0: hidden_size / num_heads
  bool tied_embeddings = false;  // lm_head computes with embed_tokens' weight: no tensor of its own
  nn::AttentionKind attention = nn::AttentionKind::kMath;
  int64_t loss_chunk_size = 0;  // > 0: the head and loss run fused by chunks (no (B·T, V) logits)
  bool dropout = false;         // dropout masks are saved too
  bool fused_kernels = false;   // nn/fused.hpp's norms, RoPE and SwiGLU: no x·rsqrt, no silu(gate) kept
  int64_t mlp_row_tiles = 1;    // > 1: the SwiGLU in row tiles, each recomputed: no (B, T, F) kept
  int64_t frozen_parameter_bytes = 0;  // a distillation teacher's weights (no gradients, no state)
  int64_t teacher_target_bytes = 0;    // per token: the teacher's logits (dense) or top-k values + indices
  int64_t teacher_vocab = 0;           // > 0: the teacher's (B, T, V) logits exist while its targets are made
  bool kd = false;                     // the loss adds a KD term: a second (B, T, V) log-softmax
  int64_t kd_classes = 0;              //   over the teacher's top-k (or all V) classes per token
  int64_t num_experts = 0;      // > 0: a mixture of experts (sorted dispatch) replaces the SwiGLU
  int64_t top_k = 0;            //   experts per token; ffn_size is each expert's width
  bool checkpoint_experts = false;
  int64_t lora_rank = 0;       // > 0: LoRA (with_lora): adapters of this rank, every other weight frozen
  unsigned lora_targets = 0;   //   the blocks' Linears adapted: bit i = kLinearNames[i]
  bool nf4_base = false;       //   QLoRA: the blocks' Linear weights held in NF4

  /// The names of a block's Linear layers, in block_linears() order (a target's last name).
  static constexpr std::array<const char*, 7> kLinearNames = {"q_proj", "k_proj", "v_proj", "o_proj",
                                                              "gate_proj", "up_proj", "down_proj"};

  /// The description of the same model fine-tuned with LoRA `options` (memopt::lora::apply),
  /// over NF4 base weights if `nf4` (memopt::lora::quantize). A target names a block Linear by its
  /// last name ("q_proj", "self_attn.q_proj") or is "all-linear"; others (a user module) adapt nothing here.
  ///   auto desc = memopt::models::describe(cfg).with_lora(LoraOptions().rank(16).targets({"all-linear"}), true);
  ModelDesc with_lora(const nn::LoraOptions& options, bool nf4) const {
    ModelDesc d = *this;
    d.lora_rank = options.rank();
    d.nf4_base = nf4;
    d.lora_targets = 0;
    for (size_t i = 0; i < kLinearNames.size(); ++i)
      if (options.targets_module(std::string("model.layers.0.") + (i < 4 ? "self_attn." : "mlp.") + kLinearNames[i]))
        d.lora_targets |= 1u << i;
    return d;
  }
  bool lora() const { return lora_rank > 0; }

  /// A block's Linear weights as (out, in), in kLinearNames' order; a mixture of experts' gate, up
  /// and down once per expert (their count: experts_per_linear(i)).
  std::array<std::pair<int64_t, int64_t>, 7> block_linears() const {
    const int64_t C = hidden_size, Q = q_dim(), KV = kv_dim(), F = ffn_size;
    return {{{Q, C}, {KV, C}, {KV, C}, {C, Q}, {F, C}, {F, C}, {C, F}}};
  }
  int64_t experts_per_linear(size_t i) const { return i >= 4 ? std::max<int64_t>(num_experts, 1) : 1; }

  /// Rows each token sends through the feed-forward: 1, or top_k for a mixture of experts.
  int64_t ffn_rows() const { return num_experts > 0 ? top_k : 1; }
  int64_t head_dim() const { return head_size > 0 ? head_size : hidden_size / num_heads; }
  int64_t q_dim() const { return num_heads * head_dim(); }
  int64_t kv_dim() const { return num_kv_heads * head_dim(); }

  /// Every parameter tensor's element count, in the model's registration order (a tied
  /// head's weight is the embedding's, counted once).
  std::vector<int64_t> parameter_numels() const {
    const int64_t C = hidden_size, Q = q_dim(), KV = kv_dim(), F = ffn_size;
    std::vector<int64_t> n{vocab_size * C};  // embed_tokens
    for (int64_t l = 0; l < num_layers; ++l) {
      for (int64_t x : {Q * C, KV * C, KV * C, C * Q}) n.push_back(x);  // q, k, v, o
      if (num_experts > 0) n.push_back(num_experts * C);                 // the router
      for (int64_t e = 0; e < std::max<int64_t>(num_experts, 1); ++e)
        for (int64_t x : {F * C, F * C, C * F}) n.push_back(x);          // gate, up, down
      n.push_back(C);  // the norms
      n.push_back(C);
    }
    n.push_back(C);                                   // norm
    if (!tied_embeddings) n.push_back(vocab_size * C);  // lm_head
    return n;
  }
  int64_t num_parameters() const {
    int64_t s = 0;
    for (int64_t x : parameter_numels()) s += x;
    return s;
  }

  /// What the optimizer steps: parameter_numels(), or with LoRA each adapter's lora_A (rank, in)
  /// and lora_B (out, rank), block by block.
  std::vector<int64_t> trainable_numels() const {
    if (!lora()) return parameter_numels();
    std::vector<int64_t> n;
    const auto linears = block_linears();
    for (int64_t l = 0; l < num_layers; ++l)
      for (size_t i = 0; i < linears.size(); ++i)
        if (lora_targets & (1u << i))
          for (int64_t e = 0; e < experts_per_linear(i); ++e) {
            n.push_back(lora_rank * linears[i].second);
            n.push_back(linears[i].first * lora_rank);
          }
    return n;
  }

  /// Bytes of the frozen weights as LoRA holds them: every parameter at `dense_bytes` each (4
  /// fp32, 2 bf16), the blocks' Linear weights in NF4 instead with nf4_base (codes, one-byte
  /// absmax codes per 64, fp32 per 256 of those, one offset: memopt::nn::Nf4Tensor::nbytes). 0
  /// without LoRA (then every parameter trains).
  int64_t frozen_bytes(int64_t dense_bytes) const {
    if (!lora()) return 0;
    int64_t linear = 0, nf4 = 0;
    for (size_t i = 0; i < block_linears().size(); ++i) {
      const int64_t n = block_linears()[i].first * block_linears()[i].second, blocks = (n + 63) / 64;
      linear += n * experts_per_linear(i);
      nf4 += ((n + 1) / 2 + blocks + 4 * ((blocks + 255) / 256) + 4) * experts_per_linear(i);
    }
    const int64_t dense = num_parameters() - (nf4_base ? linear * num_layers : 0);
    return dense * dense_bytes + (nf4_base ? nf4 * num_layers : 0);
  }
  /// Forward FLOPs of one token through the model (matmuls; attention at sequence length T).
  /// A tied head still multiplies by the (V, C) weight.
  double forward_flops_per_token(int64_t T) const {
    const double C = hidden_size, Q = q_dim(), KV = kv_dim(), F = ffn_size;
    const double block = 2 * (C * Q + 2 * C * KV + Q * C + 3 * C * F * static_cast<double>(ffn_rows()) +
                               C * static_cast<double>(num_experts)) + 4.0 * T * Q;
    return num_layers * block + 2 * C * vocab_size;
  }
};

}  // namespace memopt::memory
