// memopt/nn/qlora.hpp — QLoRA (Dettmers et al., 2023): a LoRA adapter over a frozen base weight
// held in NF4 (memopt/nn/nf4.hpp, 0.516 B/param with double quantisation instead of 2 or 4).
// nf4_linear is the base's matmul as an autograd Function: it dequantises the weight for the
// forward and again for the backward, each time freed on return, and saves only the 4-bit codes
// and scales, never x or a dense weight, since the frozen weight needs no dW. QLoraLinear is
// LoraLinear (memopt/nn/lora.hpp) with that base: same adapter, init, scale and dropout.
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <tuple>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "memopt/detail/autocast.hpp"
#include "memopt/nn/lora.hpp"
#include "memopt/nn/nf4.hpp"

namespace memopt::nn {

namespace detail {

/// The dtype nf4_linear computes in: autocast's when autocast is on for x's device, else x's
/// (the rule of memopt::detail::matmul_dtype in memopt/nn/attention.hpp).
inline torch::ScalarType nf4_compute_dtype(const torch::Tensor& x) {
  const auto state = memopt::detail::AutocastState::current(x.device().type());
  return state.enabled && x.is_floating_point() ? state.dtype : x.scalar_type();
}

/// Autocast off on `device`: nf4_linear casts its operands itself.
inline memopt::detail::AutocastState nf4_autocast_off(c10::DeviceType device) {
  auto state = memopt::detail::AutocastState::current(device);
  state.enabled = false;
  return state;
}

/// y = x · deq(w)ᵀ + b with dX = dY · deq(w) and no gradient for w or b. Saved for backward:
/// w's packed codes and scales (references to the tensors the caller holds, no copy) and its
/// metadata; the dense (out, in) weight lives only inside forward() and inside backward().
struct Nf4LinearFunction : torch::autograd::Function<Nf4LinearFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const std::optional<torch::Tensor>& bias,  // none: no bias (not an input then)
                               const Nf4Tensor& w) {  // (..., in) -> (..., out)
    const torch::ScalarType dtype = nf4_compute_dtype(x);
    ctx->save_for_backward({w.packed, w.absmax, w.absmax_quant.codes, w.absmax_quant.absmax, w.absmax_offset});
    ctx->saved_data["shape"] = w.shape;
    ctx->saved_data["dtype"] = static_cast<int64_t>(w.dtype);
    ctx->saved_data["blocksize"] = w.blocksize;
    ctx->saved_data["numel"] = w.numel;
    ctx->saved_data["compute_dtype"] = static_cast<int64_t>(dtype);
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    memopt::detail::AutocastGuard no_autocast(nf4_autocast_off(x.device().type()));
    const torch::Tensor weight = w.dequantize(dtype);  // (out, in), freed on return
    return torch::linear(x.to(dtype), weight, bias ? std::optional<torch::Tensor>(bias->to(dtype)) : std::nullopt);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    torch::Tensor dx;  // (..., in); undefined when x needs none
    if (ctx->needs_input_grad(0) && grad_outputs[0].defined()) {
      const auto saved = ctx->get_saved_variables();
      Nf4Tensor w;
      w.packed = saved[0];
      w.absmax = saved[1];
      w.absmax_quant = {saved[2], saved[3]};
      w.absmax_offset = saved[4];
      w.shape = ctx->saved_data["shape"].toIntVector();
      w.dtype = static_cast<torch::ScalarType>(ctx->saved_data["dtype"].toInt());
      w.blocksize = ctx->saved_data["blocksize"].toInt();
      w.numel = ctx->saved_data["numel"].toInt();
      const auto dtype = static_cast<torch::ScalarType>(ctx->saved_data["compute_dtype"].toInt());
      const torch::Tensor& dy = grad_outputs[0];  // (..., out)
      memopt::detail::AutocastGuard no_autocast(nf4_autocast_off(dy.device().type()));
      const torch::Tensor weight = w.dequantize(dtype);  // (out, in), freed on return
      dx = dy.to(dtype).matmul(weight).to(static_cast<torch::ScalarType>(ctx->saved_data["x_dtype"].toInt()));
    }
    return {dx, torch::Tensor(), torch::Tensor()};  // x, bias (frozen), w (no tensor input)
  }
};

}  // namespace detail

/// x · deq(w)ᵀ + bias for an (out, in) NF4 weight w, in autocast's dtype when autocast is on
/// for x's device, else in x's (w is dequantised to it, bias cast to it). Gradient for x only:
/// the weight is frozen, and a bias must be too (requires_grad false, or detached). Saves w's codes and scales
/// for backward, not x and no dense weight: backward dequantises w again, freed after.
///   memopt::nn::Nf4Tensor w = memopt::nn::quantize_nf4(linear->weight);
///   torch::Tensor y = memopt::nn::nf4_linear(x, w, linear->bias.detach());   // (B, T, in) -> (B, T, out)
inline torch::Tensor nf4_linear(const torch::Tensor& x, const Nf4Tensor& w, const torch::Tensor& bias = {}) {
  const char* who = "memopt::nn::nf4_linear";
  TORCH_CHECK(w.shape.size() == 2 && w.packed.defined(), who,
              ": w must be a quantised 2-d (out, in) weight (got shape ", c10::IntArrayRef(w.shape),
              "). HINT: pass quantize_nf4(linear->weight), or QLoraLinear's base().");
  const int64_t out = w.shape[0], in = w.shape[1];
  TORCH_CHECK(x.defined() && x.is_floating_point(), who, ": x must be a floating-point tensor (got ",
              x.defined() ? c10::toString(x.scalar_type()) : "undefined", "). HINT: the weight is dequantised to x's "
              "dtype (or autocast's); cast x with .to(torch::kFloat) or .to(torch::kBFloat16).");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in, who, ": x must be (..., in = ", in, ") for a weight of shape (", out,
              ", ", in, ") (got ", x.sizes(), "). HINT: the last dimension of x is the layer's input features.");
  TORCH_CHECK(x.device() == w.packed.device(), who, ": x is on ", x.device(), " but w on ", w.packed.device(),
              ". HINT: move the layer (QLoraLinear's ->to(device) moves its NF4 buffers) or x.");
  if (bias.defined()) {
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == out, who, ": bias must be (out = ", out, ") (got ", bias.sizes(),
                "). HINT: pass the base Linear's bias, or none.");
    TORCH_CHECK(!bias.requires_grad(), who, ": bias requires grad, but nf4_linear returns none for it (QLoRA's base "
                "is frozen). HINT: freeze it with bias.requires_grad_(false), or add a trainable bias outside.");
  }
  // An undefined Tensor argument would count as an input without a device; an empty optional does not.
  return detail::Nf4LinearFunction::apply(x, bias.defined() ? std::optional<torch::Tensor>(bias) : std::nullopt, w);
}

/// A Linear layer whose frozen weight is held in NF4 (QLoRA), with a trainable LoRA adapter:
/// y = nf4_linear(x, base(), bias) + B(A(dropout(x))) · scale. Built from an existing Linear:
/// its weight is quantised (Nf4Options, QLoRA's defaults: blocksize 64, double quantisation)
/// and not kept (drop the Linear to free it); its bias, if any, is shared and frozen as in
/// LoraLinear. The adapter is LoraLinear's: `lora_A.weight` (rank, in) Kaiming-uniform (a = √5),
/// `lora_B.weight` (out, rank) zeros, on the weight's device, fp32 for a fp16/bf16 weight
/// (detail::lora_adapter_dtype), scale and dropout from LoraOptions. No merge(): folding B·A into
/// 4-bit codes would requantise it; dequantized_weight() + LoraLinear merges in full precision.
///
/// State: parameters `bias` (frozen, if the base has one), `lora_A.weight`, `lora_B.weight`;
/// buffers, bitsandbytes' Linear4bit state keys with `_` for `.`:
///   weight_nf4            (⌈out·in/2⌉,) uint8  packed codes, two a byte (bnb: weight, as (n/2, 1))
///   weight_absmax         (blocks,) fp32 absmax per block, or with double quantisation
///                         (blocks,) uint8 codes of absmax - offset (bnb: weight.absmax)
///   weight_nested_absmax  (⌈blocks/256⌉,) fp32, double quantisation only (bnb: weight.nested_absmax)
///   weight_nested_offset  () fp32 mean absmax, double quantisation only (bnb: quant state's nested_offset)
/// base() shares these tensors. ->to(device) moves them; ->to(dtype) converts the adapter and
/// bias only and makes dtype base().dtype (dequantize()'s default): codes and scales keep theirs.
///   torch::nn::Linear q_proj(torch::nn::LinearOptions(4096, 4096).bias(false));
///   memopt::nn::QLoraLinear layer(q_proj, memopt::nn::LoraOptions().rank(16).alpha(32));
///   q_proj = nullptr;                    // the dense weight's 64 MiB go; layer->base_nbytes(): 8.7 MB
///   torch::Tensor y = layer(x);          // (B, T, 4096) -> (B, T, 4096)
class QLoraLinearImpl : public torch::nn::Module {
 public:
  QLoraLinearImpl(const torch::nn::Linear& base, LoraOptions options, const Nf4Options& nf4 = {})
      : options_(std::move(options)) {
    detail::check_lora_base(base, options_, "memopt::nn::QLoraLinear");
    base_ = quantize_nf4(base->weight, nf4);  // any numel: a short last block, an odd one padded
    weight_nf4 = register_buffer("weight_nf4", base_.packed);
    if (base_.double_quant()) {
      weight_absmax = register_buffer("weight_absmax", base_.absmax_quant.codes);
      weight_nested_absmax = register_buffer("weight_nested_absmax", base_.absmax_quant.absmax);
      weight_nested_offset = register_buffer("weight_nested_offset", base_.absmax_offset);
    } else {
      weight_absmax = register_buffer("weight_absmax", base_.absmax);
    }
    if (base->bias.defined()) bias = register_parameter("bias", base->bias, /*requires_grad=*/false);  // (out,)

    std::tie(lora_A, lora_B) = detail::register_lora(*this, base->weight, options_.rank());
  }

  /// A Kaiming-uniform with a = √5 (bound 1/√in), B zeros: LoraLinear's (PEFT's) init.
  void reset_adapter() { detail::reset_lora(lora_A, lora_B); }

  /// nf4_linear(x, base(), bias) + B(A(dropout(x))) · scale, in the base output's dtype; the
  /// adapter's input is x cast to A's dtype (LoraLinear's forward with an NF4 base).
  torch::Tensor forward(const torch::Tensor& x) {  // (..., in) -> (..., out)
    return detail::add_lora(nf4_linear(x, base_, bias), x, lora_A, lora_B, options_, is_training());  // (..., out)
  }

  /// The frozen base in NF4 (its tensors are this module's buffers).
  const Nf4Tensor& base() const { return base_; }

  /// The base weight (out, in) dequantised to `dtype` (a floating type): a new tensor, no grad.
  ///   torch::Tensor w = layer->dequantized_weight(torch::kBFloat16);
  torch::Tensor dequantized_weight(torch::ScalarType dtype) const {
    TORCH_CHECK(at::isFloatingType(dtype), "memopt::nn::QLoraLinear::dequantized_weight: dtype must be a floating "
                "type (got ", dtype, "). HINT: NF4 codes times their block's absmax are real numbers; ask for "
                "torch::kFloat, torch::kBFloat16 or torch::kFloat16 (base().packed holds the raw 4-bit codes).");
    return base_.dequantize(dtype);
  }

  /// Bytes of the NF4 base (codes and scales, base().nbytes(); the bias not counted).
  int64_t base_nbytes() const { return base_.nbytes(); }

  const LoraOptions& options() const { return options_; }
  double scale() const { return options_.scale(); }
  int64_t in_features() const { return base_.shape[1]; }
  int64_t out_features() const { return base_.shape[0]; }

  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override {
    move(device, dtype, non_blocking);
  }
  void to(torch::Dtype dtype, bool non_blocking = false) override { move(std::nullopt, dtype, non_blocking); }
  void to(torch::Device device, bool non_blocking = false) override { move(device, std::nullopt, non_blocking); }

  void pretty_print(std::ostream& stream) const override {
    stream << "memopt::nn::QLoraLinear(in_features=" << in_features() << ", out_features=" << out_features()
           << ", bias=" << (bias.defined() ? "true" : "false") << ", nf4 blocksize=" << base_.blocksize
           << (base_.double_quant() ? ", double quant" : "") << ", rank=" << options_.rank()
           << ", alpha=" << options_.alpha() << ", dropout=" << options_.dropout()
           << (options_.use_rslora() ? ", rslora" : "") << ")";
  }

  torch::Tensor weight_nf4;            // (⌈out·in/2⌉,) uint8, shared with base().packed
  torch::Tensor weight_absmax;         // (blocks,) uint8 codes (double quant) or fp32
  torch::Tensor weight_nested_absmax;  // (⌈blocks/256⌉,) fp32; undefined without double quant
  torch::Tensor weight_nested_offset;  // () fp32; undefined without double quant
  torch::Tensor bias;                  // (out,), frozen; undefined when the base has none
  torch::nn::Linear lora_A{nullptr};   // in -> rank, no bias: weight (rank, in)
  torch::nn::Linear lora_B{nullptr};   // rank -> out, no bias: weight (out, rank)

 private:
  // Module::to with the NF4 buffers moved between devices but never converted: set_data keeps
  // each tensor's identity, so base_ (which shares them) follows.
  void move(std::optional<torch::Device> device, std::optional<torch::Dtype> dtype, bool non_blocking) {
    for (const auto& child : children()) {
      if (device && dtype) child->to(*device, *dtype, non_blocking);
      else if (device) child->to(*device, non_blocking);
      else child->to(*dtype, non_blocking);
    }
    torch::TensorOptions options;
    if (device) options = options.device(*device);
    if (dtype) options = options.dtype(*dtype);
    for (auto& parameter : named_parameters(/*recurse=*/false)) {
      parameter->set_data(parameter->to(options, non_blocking));
    }
    if (device) {
      for (auto& buffer : named_buffers(/*recurse=*/false)) buffer->set_data(buffer->to(*device, non_blocking));
    }
    if (dtype) base_.dtype = *dtype;
  }

  Nf4Tensor base_;
  LoraOptions options_;
};
TORCH_MODULE(QLoraLinear);

}  // namespace memopt::nn
