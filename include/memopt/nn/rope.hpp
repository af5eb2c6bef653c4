// memopt/nn/rope.hpp — rotary position embeddings (RoPE) in the HuggingFace LLaMA
// layout: the head dimension is split in two halves that rotate together
// (rotate_half), so weights converted from HF checkpoints work unchanged.
#pragma once

#include <torch/torch.h>

namespace memopt::nn {

/// cos and sin tables for positions [0, seq_len): each (T, D), fp32, on `device`.
///   auto [cos, sin] = memopt::nn::rope_tables(T, head_dim, 10000.0, x.device());
inline std::pair<torch::Tensor, torch::Tensor> rope_tables(int64_t seq_len, int64_t head_dim, double theta,
                                                          torch::Device device) {
  auto opts = torch::TensorOptions().dtype(torch::kFloat).device(device);
  auto inv_freq = 1.0 / torch::pow(theta, torch::arange(0, head_dim, 2, opts) / static_cast<double>(head_dim));
  auto freqs = torch::outer(torch::arange(seq_len, opts), inv_freq);  // (T, D/2)
  auto emb = torch::cat({freqs, freqs}, -1);                           // (T, D)
  return {emb.cos(), emb.sin()};
}

/// (x1, x2) -> (-x2, x1) over the last dimension's halves.
inline torch::Tensor rotate_half(const torch::Tensor& x) {
  auto halves = x.chunk(2, -1);
  return torch::cat({-halves[1], halves[0]}, -1);
}

/// Rotates q or k of shape (B, H, T, D) by the tables of rope_tables(); keeps x's dtype.
inline torch::Tensor apply_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  return (x * cos + rotate_half(x) * sin).to(x.scalar_type());
}

}  // namespace memopt::nn
