// memopt/nn/attention.hpp — multi-head attention with rotary embeddings and optional
// grouped KV heads (LLaMA's self_attn, HF parameter names), causal or bidirectional.
// Scores are computed on the math path here (softmax in fp32); see the memory levers
// issue for the blockwise version that never stores the (T, T) matrix.
#pragma once

#include <cmath>

#include <torch/torch.h>

#include "memopt/nn/rope.hpp"

namespace memopt::nn {

/// softmax(q kᵀ / sqrt(D) + mask) v for q (B, H, T, D), k and v (B, H, T, D).
/// The softmax runs in fp32; dropout applies to the probabilities when p > 0.
inline torch::Tensor attention_math(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                    bool causal, double dropout, bool training) {
  const int64_t T = q.size(2);
  auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(-1)));  // (B, H, T, T)
  if (causal) {
    auto future = torch::ones({T, T}, torch::TensorOptions().dtype(torch::kBool).device(q.device())).triu(1);
    scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
  }
  auto probs = torch::softmax(scores, -1, torch::kFloat).to(q.scalar_type());  // (B, H, T, T)
  probs = torch::dropout(probs, dropout, training);
  return torch::matmul(probs, v);  // (B, H, T, D)
}

/// Repeats each of the KV heads n_rep times: (B, KV, T, D) -> (B, KV·n_rep, T, D).
inline torch::Tensor repeat_kv(const torch::Tensor& x, int64_t n_rep) {
  if (n_rep == 1) return x;
  const auto B = x.size(0), KV = x.size(1), T = x.size(2), D = x.size(3);
  return x.unsqueeze(2).expand({B, KV, n_rep, T, D}).reshape({B, KV * n_rep, T, D});
}

/// Options for Attention.  Attention(AttentionOptions(512, 8).num_kv_heads(2))
struct AttentionOptions {
  AttentionOptions(int64_t hidden_size, int64_t num_heads) : hidden_size_(hidden_size), num_heads_(num_heads) {}
  TORCH_ARG(int64_t, hidden_size);
  TORCH_ARG(int64_t, num_heads);
  /// 0 means num_heads (no grouping).
  TORCH_ARG(int64_t, num_kv_heads) = 0;
  TORCH_ARG(bool, causal) = true;
  TORCH_ARG(double, dropout) = 0.0;
};

/// LLaMA self-attention: q_proj, k_proj, v_proj, o_proj (no biases), RoPE on q and k.
class AttentionImpl : public torch::nn::Cloneable<AttentionImpl> {
 public:
  explicit AttentionImpl(AttentionOptions options) : options(options) { reset(); }

  void reset() override {
    const int64_t C = options.hidden_size(), H = options.num_heads(), KV = kv_heads();
    TORCH_CHECK(C % H == 0, "memopt::nn::Attention: hidden_size must be divisible by num_heads (got ", C, " and ",
                H, "). HINT: pick num_heads dividing hidden_size.");
    TORCH_CHECK(KV >= 1 && H % KV == 0, "memopt::nn::Attention: num_heads must be a multiple of num_kv_heads (got ",
                H, " and ", KV, "). HINT: num_kv_heads = 0 means num_heads.");
    const int64_t D = C / H;
    q_proj = register_module("q_proj", torch::nn::Linear(torch::nn::LinearOptions(C, H * D).bias(false)));
    k_proj = register_module("k_proj", torch::nn::Linear(torch::nn::LinearOptions(C, KV * D).bias(false)));
    v_proj = register_module("v_proj", torch::nn::Linear(torch::nn::LinearOptions(C, KV * D).bias(false)));
    o_proj = register_module("o_proj", torch::nn::Linear(torch::nn::LinearOptions(H * D, C).bias(false)));
  }

  int64_t kv_heads() const { return options.num_kv_heads() > 0 ? options.num_kv_heads() : options.num_heads(); }

  /// x (B, T, C), cos/sin (T, D) -> (B, T, C)
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
    const int64_t B = x.size(0), T = x.size(1), H = options.num_heads(), KV = kv_heads();
    const int64_t D = options.hidden_size() / H;
    auto q = q_proj(x).view({B, T, H, D}).transpose(1, 2);   // (B, H, T, D)
    auto k = k_proj(x).view({B, T, KV, D}).transpose(1, 2);  // (B, KV, T, D)
    auto v = v_proj(x).view({B, T, KV, D}).transpose(1, 2);  // (B, KV, T, D)
    q = apply_rope(q, cos, sin);
    k = apply_rope(k, cos, sin);
    auto y = attention_math(q, repeat_kv(k, H / KV), repeat_kv(v, H / KV), options.causal(), options.dropout(),
                            is_training());                   // (B, H, T, D)
    return o_proj(y.transpose(1, 2).reshape({B, T, H * D}));  // (B, T, C)
  }

  AttentionOptions options;
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
};
TORCH_MODULE(Attention);

}  // namespace memopt::nn
