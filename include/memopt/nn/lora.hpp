// memopt/nn/lora.hpp — LoRA (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models",
// 2021) as PEFT 0.21.2 implements it for a Linear layer: y = x·Wᵀ + b + B(A(dropout(x))) · scale,
// W (and b) frozen, A (rank, in) Kaiming-uniform and B (out, rank) zero at the start, scale =
// alpha / rank, or alpha / √rank with rsLoRA (Kalajdzievski, 2023). The base parameters keep the
// Hugging Face names (weight, bias) and the adapter PEFT's saved ones (lora_A.weight,
// lora_B.weight), so a checkpoint loads unchanged and memopt/io/peft.hpp reads and writes adapters
// PEFT loads. merge() folds scale · B·A into W for inference; unmerge() takes it out again.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <ostream>
#include <string>
#include <tuple>
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
  /// empty targets; `who` starts each message.   options.check("memopt::nn::LoraLinear");
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

/// Checks a LoRA layer's base Linear and options (`who` starts each message): a 2-d weight,
/// valid options, a rank of at most min(in, out).
inline void check_lora_base(const torch::nn::Linear& base, const LoraOptions& options, const char* who) {
  TORCH_CHECK(!base.is_empty() && base->weight.defined() && base->weight.dim() == 2, who,
              ": the base Linear is empty or has no 2-d weight. HINT: pass a constructed torch::nn::Linear, "
              "e.g. torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false))");
  options.check(who);
  const int64_t out = base->weight.size(0), in = base->weight.size(1);
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

/// Registers `lora_A` (in -> rank) and `lora_B` (rank -> out), bias-free, on `owner`, on `base`'s
/// device in lora_adapter_dtype(base's dtype), initialised by reset_lora.
inline std::pair<torch::nn::Linear, torch::nn::Linear> register_lora(torch::nn::Module& owner,
                                                                     const torch::Tensor& base, int64_t rank) {
  const int64_t out = base.size(0), in = base.size(1);
  auto lora_A = owner.register_module("lora_A", torch::nn::Linear(torch::nn::LinearOptions(in, rank).bias(false)));
  auto lora_B = owner.register_module("lora_B", torch::nn::Linear(torch::nn::LinearOptions(rank, out).bias(false)));
  lora_A->to(base.device(), lora_adapter_dtype(base.scalar_type()));
  lora_B->to(base.device(), lora_adapter_dtype(base.scalar_type()));
  reset_lora(lora_A, lora_B);
  return {lora_A, lora_B};
}

/// result + B(A(dropout(x))) · scale in result's dtype, as PEFT's lora.Linear.forward: the
/// adapter's input is x cast to A's dtype; dropout only in training.
inline torch::Tensor add_lora(const torch::Tensor& result, const torch::Tensor& x, torch::nn::Linear lora_A,
                              torch::nn::Linear lora_B, const LoraOptions& options, bool training) {
  torch::Tensor input = x.to(lora_A->weight.scalar_type());  // (..., in)
  if (options.dropout() > 0 && training) {
    namespace F = torch::nn::functional;
    input = F::dropout(input, F::DropoutFuncOptions().p(options.dropout()).training(true));
  }
  return (result + lora_B(lora_A(input)) * options.scale()).to(result.scalar_type());  // (..., out)
}

}  // namespace detail

/// A Linear layer with a LoRA adapter: parameters `weight` (out, in) and `bias` (out,), if the
/// base has one, frozen (requires_grad false), and the trainable `lora_A.weight` (rank, in) and
/// `lora_B.weight` (out, rank). Built around an existing Linear, it shares that layer's weight
/// and bias tensors (no copy; they are frozen there too, and merge() changes them there too).
/// A is initialised Kaiming-uniform with a = √5 (|A| <= 1/√in) and B with zeros, so at first the
/// layer computes what the base Linear does (PEFT's init_lora_weights=True). A and B are created
/// on the base weight's device, in its dtype, but in fp32 for a fp16 or bf16 base (PEFT's
/// autocast_adapter_dtype); ->to() moves them like any parameter.
///   torch::nn::Linear q_proj(torch::nn::LinearOptions(512, 512).bias(false));
///   memopt::nn::LoraLinear lora(q_proj, memopt::nn::LoraOptions().rank(8).alpha(16));
///   torch::Tensor y = lora(x);   // (B, T, 512) -> (B, T, 512)
class LoraLinearImpl : public torch::nn::Module {
 public:
  LoraLinearImpl(const torch::nn::Linear& base, LoraOptions options) : options_(std::move(options)) {
    detail::check_lora_base(base, options_, "memopt::nn::LoraLinear");
    weight = register_parameter("weight", base->weight, /*requires_grad=*/false);  // (out, in), shared
    if (base->bias.defined()) bias = register_parameter("bias", base->bias, /*requires_grad=*/false);  // (out,)

    std::tie(lora_A, lora_B) = detail::register_lora(*this, weight, options_.rank());
  }

  /// The same around a new Linear of `base`'s shape (nn.Linear's initialisation).
  ///   memopt::nn::LoraLinear lora(torch::nn::LinearOptions(512, 512).bias(false), memopt::nn::LoraOptions());
  LoraLinearImpl(const torch::nn::LinearOptions& base, LoraOptions options)
      : LoraLinearImpl(torch::nn::Linear(base), std::move(options)) {}

  /// A Kaiming-uniform with a = √5 (bound 1/√in, as nn.Linear's reset_parameters), B zeros.
  void reset_adapter() { detail::reset_lora(lora_A, lora_B); }

  /// x·Wᵀ + b + B(A(dropout(x))) · scale, the adapter skipped while merged. As PEFT's
  /// lora.Linear.forward: the adapter's input is x cast to A's dtype, the sum is returned in the
  /// base output's dtype (under autocast both Linears run in the autocast dtype anyway).
  torch::Tensor forward(const torch::Tensor& x) {  // (..., in) -> (..., out)
    torch::Tensor result = torch::linear(x, weight, bias);  // (..., out), as F.linear
    if (merged_) return result;
    return detail::add_lora(result, x, lora_A, lora_B, options_, is_training());  // (..., out)
  }

  /// scale · B·A (out, in), the update merge() adds to the weight, in the adapter's dtype,
  /// computed in fp32 (double for a double adapter) as PEFT's get_delta_weight on the CPU.
  torch::Tensor delta_weight() const {  // (out, in)
    return delta(compute_dtype(lora_B->weight.scalar_type())).to(lora_B->weight.scalar_type());
  }

  /// Adds scale · B·A to the weight in place (in fp32, or double for a double weight, cast back
  /// to the weight's dtype): forward() then runs the base Linear alone. Shared with the wrapped
  /// Linear, whose weight changes too.   lora->merge();   // inference without the adapter's matmuls
  void merge() {
    TORCH_CHECK(!merged_, "memopt::nn::LoraLinear: merge() on a layer already merged. HINT: merging twice "
                "would add scale * B·A to the weight twice; call unmerge() first, or check merged()");
    add_delta(+1);
    merged_ = true;
  }

  /// Subtracts scale · B·A from the weight again (the adapter as it is now, so A and B should
  /// not change while merged).   lora->unmerge();   // back to training the adapter
  void unmerge() {
    TORCH_CHECK(merged_, "memopt::nn::LoraLinear: unmerge() on a layer that is not merged. HINT: the weight "
                "holds no adapter update to take out; call merge() first, or check merged()");
    add_delta(-1);
    merged_ = false;
  }

  /// Whether scale · B·A is in the weight (merge()).
  bool merged() const { return merged_; }

  /// The options the layer was built with (or set_options() gave).
  const LoraOptions& options() const { return options_; }

  /// PEFT's `scaling`: options().scale().
  double scale() const { return options_.scale(); }

  int64_t in_features() const { return weight.size(1); }
  int64_t out_features() const { return weight.size(0); }

  /// Replaces alpha, dropout, use_rslora and targets (memopt::io::load_adapter sets an adapter
  /// config's); the rank must stay the same and the layer must not be merged.
  ///   lora->set_options(lora->options().alpha(32));
  void set_options(LoraOptions options) {
    const char* who = "memopt::nn::LoraLinear::set_options";
    options.check(who);
    TORCH_CHECK(options.rank() == lora_A->weight.size(0), who, ": rank ", options.rank(), " differs from the "
                "layer's ", lora_A->weight.size(0), ". HINT: the rank is the shape of lora_A and lora_B; build a "
                "new LoraLinear for another rank");
    TORCH_CHECK(!merged_, who, ": the layer is merged, and a new scale would unmerge a different update. "
                "HINT: call unmerge() first");
    options_ = std::move(options);
  }

  void pretty_print(std::ostream& stream) const override {
    stream << "memopt::nn::LoraLinear(in_features=" << in_features() << ", out_features=" << out_features()
           << ", bias=" << (bias.defined() ? "true" : "false") << ", rank=" << options_.rank()
           << ", alpha=" << options_.alpha() << ", dropout=" << options_.dropout()
           << (options_.use_rslora() ? ", rslora" : "") << (merged_ ? ", merged" : "") << ")";
  }

  torch::Tensor weight;  // (out, in), frozen, shared with the base Linear
  torch::Tensor bias;    // (out,), frozen; undefined when the base has none
  torch::nn::Linear lora_A{nullptr};  // in -> rank, no bias: weight (rank, in)
  torch::nn::Linear lora_B{nullptr};  // rank -> out, no bias: weight (out, rank)

 private:
  static torch::Dtype compute_dtype(torch::Dtype dtype) { return torch::promote_types(dtype, torch::kFloat); }

  torch::Tensor delta(torch::Dtype dtype) const {  // (out, in)
    return lora_B->weight.to(dtype).matmul(lora_A->weight.to(dtype)) * options_.scale();
  }

  void add_delta(double sign) {
    torch::NoGradGuard no_grad;
    const torch::Dtype dtype = compute_dtype(weight.scalar_type());
    weight.copy_(weight.to(dtype) + delta(dtype).to(weight.device()) * sign);  // in place: storage stays shared
  }

  LoraOptions options_;
  bool merged_ = false;
};
TORCH_MODULE(LoraLinear);

}  // namespace memopt::nn
