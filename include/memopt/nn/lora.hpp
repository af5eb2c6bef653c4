// memopt/nn/lora.hpp — LoRA (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models",
// 2021) as PEFT 0.21.2 implements it for a Linear layer: y = x·Wᵀ + b + B(A(dropout(x))) · scale,
// W (and b) frozen, A (rank, in) Kaiming-uniform and B (out, rank) zero at the start, scale =
// alpha / rank, or alpha / √rank with rsLoRA (Kalajdzievski, 2023). The base parameters keep the
// Hugging Face names (weight, bias) and the adapter PEFT's saved ones (lora_A.weight,
// lora_B.weight), so a checkpoint loads unchanged and memopt/io/peft.hpp reads and writes adapters
// PEFT loads. This header holds the adapter's options and pieces; memopt::nn::Linear
// (memopt/nn/linear.hpp) is the layer that carries one, merge() and unmerge() included.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace memopt::nn {

/// What a LoRA adapter is: PEFT's LoraConfig fields r, lora_alpha, lora_dropout, target_modules
/// and use_rslora, with PEFT's defaults but for alpha (PEFT's lora_alpha is 8; 16 = 2 x rank is the
/// usual choice) and targets (PEFT picks per architecture: q_proj and v_proj for LLaMA).
///   memopt::nn::LoraOptions().rank(16).alpha(32).targets({"q_proj", "k_proj", "v_proj", "o_proj"})
struct LoraOptions {
  /// r: the rank of B·A, 1..min(in, out).
  TORCH_ARG(int64_t, rank) = 8;
  /// lora_alpha: with rank, sets scale() (alpha / rank; alpha / √rank with rsLoRA).
  TORCH_ARG(double, alpha) = 16;
  /// lora_dropout: the probability of zeroing an input of A, in training only; 0 to < 1.
  TORCH_ARG(double, dropout) = 0;
  /// target_modules: the Linear layers to adapt, by the last parts of their path ("q_proj" matches
  /// "model.layers.0.self_attn.q_proj", as in PEFT); {"all-linear"}: every Linear but the output layer.
  TORCH_ARG(std::vector<std::string>, targets) = std::vector<std::string>{"q_proj", "v_proj"};
  /// use_rslora: scale = alpha / √rank (rank-stabilized LoRA), which keeps the update's size
  /// from shrinking as the rank grows.
  TORCH_ARG(bool, use_rslora) = false;

 public:
  /// The factor of B·A: alpha / rank, or alpha / √rank with rsLoRA (PEFT's `scaling`).
  ///   double s = memopt::nn::LoraOptions().rank(8).alpha(16).scale();   // 2.0
  double scale() const {
    return use_rslora_ ? alpha_ / std::sqrt(static_cast<double>(rank_)) : alpha_ / static_cast<double>(rank_);
  }

  /// Whether PEFT would adapt the module at `path` (e.g. "model.layers.0.self_attn.q_proj"): a
  /// target equal to the path or to its last dot-separated parts, or the target "all-linear"
  /// (the caller leaves the output layer out, as PEFT does). Regular expressions are not read.
  ///   bool adapt = options.targets_module("model.layers.0.self_attn.q_proj");
  bool targets_module(const std::string& path) const {
    for (const auto& target : targets_) {
      if (target == "all-linear" || path == target) return true;
      if (path.size() > target.size() && path.ends_with(target) && path[path.size() - target.size() - 1] == '.')
        return true;
    }
    return false;
  }

  /// Rejects a rank < 1, an alpha that is not a positive number, a dropout outside [0, 1) and
  /// empty targets; `who` starts each message.   options.check("memopt::lora::apply");
  void check(const char* who) const {
    TORCH_CHECK(rank_ >= 1, who, ": LoRA rank must be >= 1 (got ", rank_,
                "). HINT: the rank is the inner size of B·A; 8 or 16 is usual, e.g. LoraOptions().rank(8)");
    TORCH_CHECK(alpha_ > 0 && std::isfinite(alpha_), who, ": LoRA alpha must be a positive number (got ", alpha_,
                "). HINT: the update is scaled by alpha / rank; alpha = 2 x rank is usual, e.g. .alpha(16) for rank 8");
    TORCH_CHECK(dropout_ >= 0 && dropout_ < 1, who, ": LoRA dropout must be in [0, 1) (got ", dropout_,
                "). HINT: it is the probability of zeroing an input of lora_A in training: 0 (off), 0.05 or 0.1");
    TORCH_CHECK(!targets_.empty(), who, ": LoRA targets are empty. HINT: name the Linear layers to adapt, "
                "e.g. .targets({\"q_proj\", \"v_proj\"}), or .targets({\"all-linear\"})");
  }
};

namespace detail {

/// The adapter's dtype for a base weight of `base`: fp32 for fp16 and bf16 bases (PEFT's
/// get_peft_model(autocast_adapter_dtype=True), its default), else the base's.
inline torch::Dtype lora_adapter_dtype(torch::Dtype base) {
  return base == torch::kHalf || base == torch::kBFloat16 ? torch::kFloat : base;
}

/// Checks a LoRA adapter for an (out, in) weight (`who` starts each message): valid options and
/// a rank of at most min(in, out).
inline void check_lora_shape(int64_t out, int64_t in, const LoraOptions& options, const char* who) {
  options.check(who);
  TORCH_CHECK(options.rank() <= std::min(in, out), who, ": LoRA rank ", options.rank(), " exceeds min(in ", in,
              ", out ", out, ") = ", std::min(in, out),
              ". HINT: B·A of a larger rank is no longer low-rank: rank min(in, out) already reaches every "
              "(out, in) update, with more parameters than the weight itself past that; use a rank <= ",
              std::min(in, out), " (PEFT accepts larger ranks; memopt refuses them)");
}

/// A (rank, in) Kaiming-uniform with a = √5 (bound 1/√in, as nn.Linear's reset_parameters), B
/// (out, rank) zeros: PEFT's init_lora_weights=True.
inline void reset_lora(const torch::nn::Linear& lora_A, const torch::nn::Linear& lora_B) {
  torch::NoGradGuard no_grad;
  torch::nn::init::kaiming_uniform_(lora_A->weight, std::sqrt(5.0));
  torch::nn::init::zeros_(lora_B->weight);
}

/// Registers `lora_A` (in -> rank) and `lora_B` (rank -> out), bias-free, on `owner`, on `device`
/// in lora_adapter_dtype(base_dtype), initialised by reset_lora.
inline std::pair<torch::nn::Linear, torch::nn::Linear> register_lora(torch::nn::Module& owner, int64_t out,
                                                                     int64_t in, int64_t rank, torch::Device device,
                                                                     torch::Dtype base_dtype) {
  auto lora_A = owner.register_module("lora_A", torch::nn::Linear(torch::nn::LinearOptions(in, rank).bias(false)));
  auto lora_B = owner.register_module("lora_B", torch::nn::Linear(torch::nn::LinearOptions(rank, out).bias(false)));
  lora_A->to(device, lora_adapter_dtype(base_dtype));
  lora_B->to(device, lora_adapter_dtype(base_dtype));
  reset_lora(lora_A, lora_B);
  return {lora_A, lora_B};
}

/// result + B(A(dropout(x))) · scale in result's dtype, as PEFT's lora.Linear.forward: the
/// adapter's input is x cast to A's dtype; dropout only in training. Where result is in the
/// adapter's dtype, one addmm(result, A(x), Bᵀ, alpha = scale) forms the sum: one (..., out)
/// tensor instead of PEFT's three (B(h), its scaled copy, the sum) in forward, and none more in
/// backward (the sum's gradient passes to result as it is, and scale applies to (..., rank)).
inline torch::Tensor add_lora(const torch::Tensor& result, const torch::Tensor& x, torch::nn::Linear lora_A,
                              torch::nn::Linear lora_B, const LoraOptions& options, bool training) {
  torch::Tensor input = x.to(lora_A->weight.scalar_type());  // (..., in)
  if (options.dropout() > 0 && training) {
    namespace F = torch::nn::functional;
    input = F::dropout(input, F::DropoutFuncOptions().p(options.dropout()).training(true));
  }
  if (result.scalar_type() != lora_B->weight.scalar_type())  // a bf16 base: PEFT's sum, cast back
    return (result + lora_B(lora_A(input)) * options.scale()).to(result.scalar_type());  // (..., out)
  const torch::Tensor h = lora_A(input);  // (..., rank)
  const int64_t out = result.size(-1), rank = h.size(-1);
  return torch::addmm(result.reshape({-1, out}), h.reshape({-1, rank}), lora_B->weight.t(), 1.0, options.scale())
      .view(result.sizes());  // (..., out)
}

}  // namespace detail

}  // namespace memopt::nn
