// memopt/nn/rope.hpp — rotary position embeddings (RoPE) in the HuggingFace LLaMA
// layout: the head dimension is split in two halves that rotate together
// (rotate_half), so weights converted from HF checkpoints work unchanged. The frequencies
// follow HF's rope types for LLaMA (transformers' modeling_rope_utils.py): default, linear
// (every frequency / factor), dynamic (NTK-aware: a larger base for sequences longer than
// max_position_embeddings) and llama3 (Llama 3.1 / 3.2: low frequencies / factor, high ones
// kept, a smooth blend in between), computed op for op as transformers computes them.
#pragma once

#include <cmath>
#include <cstdint>
#include <numbers>
#include <utility>

#include <torch/torch.h>

namespace memopt::nn {

/// HF's rope_type.
enum class RopeType { kDefault, kLinear, kDynamic, kLlama3 };

/// HF's name of a rope type: "default", "linear", "dynamic", "llama3".
inline const char* rope_type_name(RopeType type) {
  switch (type) {
    case RopeType::kLinear: return "linear";
    case RopeType::kDynamic: return "dynamic";
    case RopeType::kLlama3: return "llama3";
    default: return "default";
  }
}

/// RoPE's frequency scaling: HF's rope_scaling (rope_parameters in transformers 5) less theta.
///   RopeScaling().type(RopeType::kLlama3).factor(8).low_freq_factor(1).high_freq_factor(4)
///       .original_max_position_embeddings(8192)   // Llama 3.1
struct RopeScaling {
  TORCH_ARG(RopeType, type) = RopeType::kDefault;
  /// linear: every frequency is divided by it; dynamic: how fast the base grows past
  /// max_position_embeddings; llama3: the low frequencies are divided by it.
  TORCH_ARG(double, factor) = 1.0;
  /// llama3: wavelengths above original_max_position_embeddings / low_freq_factor are scaled,
  /// those below original_max_position_embeddings / high_freq_factor kept, those between blended.
  TORCH_ARG(double, low_freq_factor) = 1.0;
  TORCH_ARG(double, high_freq_factor) = 4.0;
  TORCH_ARG(int64_t, original_max_position_embeddings) = 8192;

 public:
  void validate() const {
    if (type_ == RopeType::kDefault) return;
    TORCH_CHECK(std::isfinite(factor_) && factor_ > 0, "memopt::nn::RopeScaling: factor must be finite and > 0 (got ",
                factor_, ") for rope type ", rope_type_name(type_), ". HINT: published configs use 2 to 32.");
    if (type_ != RopeType::kLlama3) return;
    TORCH_CHECK(low_freq_factor_ > 0 && high_freq_factor_ > low_freq_factor_ && std::isfinite(high_freq_factor_),
                "memopt::nn::RopeScaling: llama3 needs 0 < low_freq_factor < high_freq_factor (got ", low_freq_factor_,
                " and ", high_freq_factor_, "). HINT: Llama 3.1 uses 1 and 4.");
    TORCH_CHECK(original_max_position_embeddings_ >= 1,
                "memopt::nn::RopeScaling: llama3's original_max_position_embeddings must be >= 1 (got ",
                original_max_position_embeddings_, "). HINT: Llama 3.1 uses 8192.");
  }
};

/// What rope_tables() computes from: the head width, theta, the scaling and, for dynamic
/// scaling, the length past which the base grows.
///   RopeOptions(128).theta(500000.0).scaling(RopeScaling().type(RopeType::kLinear).factor(4))
struct RopeOptions {
  explicit RopeOptions(int64_t head_dim) : head_dim_(head_dim) {}
  TORCH_ARG(int64_t, head_dim);
  TORCH_ARG(double, theta) = 10000.0;
  TORCH_ARG(RopeScaling, scaling) = {};
  /// dynamic: sequences up to this length keep theta (HF's config.max_position_embeddings).
  TORCH_ARG(int64_t, max_position_embeddings) = 2048;
};

/// The D/2 inverse frequencies for a sequence of `seq_len` positions, fp32 on `device`, as
/// transformers computes them (the same ops in the same order, so the same bits):
///   default  θ^(-2j/D)
///   linear   θ^(-2j/D) / factor
///   dynamic  base^(-2j/D), base = θ · (factor · T / max_pos − (factor − 1))^(D / (D − 2)) when
///            T > max_pos (HF's dynamic update, in fp32 from the int64 length), else θ
///   llama3   wavelength λ = 2π / f: f / factor above orig / low_freq_factor, f below
///            orig / high_freq_factor, between them (1 − s) · f / factor + s · f with
///            s = (orig / λ − low_freq_factor) / (high_freq_factor − low_freq_factor)
/// transformers keeps a grown dynamic base for later shorter sequences (still longer than
/// max_pos) until one fits in max_pos; this is computed for each length afresh.
///   auto inv_freq = memopt::nn::rope_inv_freq(RopeOptions(64), T, x.device());  // (D/2)
inline torch::Tensor rope_inv_freq(const RopeOptions& options, int64_t seq_len, torch::Device device) {
  const int64_t D = options.head_dim();
  const auto& s = options.scaling();
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat).device(device);
  const auto exponents = torch::arange(0, D, 2, f32) / static_cast<double>(D);  // (D/2): 2j / D
  if (s.type() == RopeType::kDynamic && seq_len > options.max_position_embeddings()) {
    const auto T = torch::full({}, seq_len, torch::TensorOptions().dtype(torch::kLong).device(device));
    const auto growth = s.factor() * T / options.max_position_embeddings() - (s.factor() - 1);  // 0-dim fp32
    const auto base = options.theta() * torch::pow(growth, static_cast<double>(D) / static_cast<double>(D - 2));
    return 1.0 / torch::pow(base, exponents);
  }
  auto inv_freq = 1.0 / torch::pow(options.theta(), exponents);  // (D/2)
  if (s.type() == RopeType::kLinear) return inv_freq / s.factor();
  if (s.type() != RopeType::kLlama3) return inv_freq;
  const auto old_len = static_cast<double>(s.original_max_position_embeddings());
  const double low_wavelen = old_len / s.low_freq_factor(), high_wavelen = old_len / s.high_freq_factor();
  // Python's `number / tensor` is tensor.reciprocal() * number (torch/_tensor.py's __rdiv__),
  // which rounds differently from a division: written the same way here.
  const auto wavelen = inv_freq.reciprocal() * (2 * std::numbers::pi);  // (D/2)
  const auto scaled = torch::where(wavelen > low_wavelen, inv_freq / s.factor(), inv_freq);
  const auto smooth = (wavelen.reciprocal() * old_len - s.low_freq_factor()) /
                      (s.high_freq_factor() - s.low_freq_factor());
  const auto smoothed = (1 - smooth) * scaled / s.factor() + smooth * scaled;
  const auto medium = (wavelen < high_wavelen).logical_not().logical_and((wavelen > low_wavelen).logical_not());
  return torch::where(medium, smoothed, scaled);
}

/// cos and sin tables for positions [0, seq_len): each (T, D), fp32, on `device`.
///   auto [cos, sin] = memopt::nn::rope_tables(T, config.rope(), x.device());
inline std::pair<torch::Tensor, torch::Tensor> rope_tables(int64_t seq_len, const RopeOptions& options,
                                                          torch::Device device) {
  const auto inv_freq = rope_inv_freq(options, seq_len, device);  // (D/2)
  auto freqs = torch::outer(torch::arange(seq_len, inv_freq.options()), inv_freq);  // (T, D/2)
  auto emb = torch::cat({freqs, freqs}, -1);                                          // (T, D)
  return {emb.cos(), emb.sin()};
}

/// The same for plain RoPE with base `theta`.
///   auto [cos, sin] = memopt::nn::rope_tables(T, head_dim, 10000.0, x.device());
inline std::pair<torch::Tensor, torch::Tensor> rope_tables(int64_t seq_len, int64_t head_dim, double theta,
                                                          torch::Device device) {
  return rope_tables(seq_len, RopeOptions(head_dim).theta(theta), device);
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

/// apply_rope on q (B, T, H, D) and k (B, T, KV, D) as the projections make them: the rotated
/// (B, H, T, D) and (B, KV, T, D) views attention takes (nn/fused.hpp's fused_rope does it in
/// one node).
inline std::pair<torch::Tensor, torch::Tensor> apply_rope_qk(const torch::Tensor& q, const torch::Tensor& k,
                                                             const torch::Tensor& cos, const torch::Tensor& sin) {
  return {apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)};
}

}  // namespace memopt::nn
