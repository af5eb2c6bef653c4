// memopt/nn/linear.hpp — the Linear layer memopt's models are built of: torch::nn::Linear's
// parameters (weight (out, in), bias (out,)), initialisation and forward, plus the two things a
// fine-tune does to a Linear in place, so that a model keeps its types and Hugging Face names:
//   add_adapter(LoraOptions)  a LoRA adapter (memopt/nn/lora.hpp): y = x·Wᵀ + b + B(A(dropout(x)))
//                             · scale, W and b frozen, lora_A.weight / lora_B.weight trainable
//                             (PEFT's names and initialisation); merge() / unmerge() fold it in;
//   quantize(Nf4Options)      the frozen weight held in NF4 (memopt/nn/nf4.hpp), computed by
//                             nf4_linear (memopt/nn/qlora.hpp): QLoRA, with an adapter on top.
// memopt::lora::apply (memopt/lora.hpp) does both over a whole model by name.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <ostream>
#include <tuple>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "memopt/detail/checkpoint_function.hpp"
#include "memopt/memory/allocator.hpp"
#include "memopt/nn/linear_shared.hpp"
#include "memopt/nn/linear_unread.hpp"
#include "memopt/nn/lora.hpp"
#include "memopt/nn/nf4.hpp"
#include "memopt/nn/qlora.hpp"

namespace memopt::nn {

namespace detail {

/// The NF4 options memopt::nn::QuantizeOnInit set for this thread, if any.
inline std::optional<Nf4Options>& quantize_on_init() {
  thread_local std::optional<Nf4Options> options;
  return options;
}

}  // namespace detail

/// While alive, every memopt::nn::Linear built on this thread is quantised to NF4 right after
/// its initialisation, so a model too large for memory in fp32 never exists whole in fp32: each
/// layer's dense weight lives only until its own constructor returns. The weights keep
/// nn.Linear's initialisation (a model's later init_weights() sees no dense weight to redraw).
///   { memopt::nn::QuantizeOnInit nf4;   // QLoRA's defaults: blocksize 64, double quantisation
///     model = memopt::models::Llama(config); }   // 7B-shaped: 3.5 GB of NF4 instead of 27 GB
class QuantizeOnInit {
 public:
  explicit QuantizeOnInit(Nf4Options options = {}) : previous_(detail::quantize_on_init()) {
    detail::check_blocksize(options.blocksize(), "memopt::nn::QuantizeOnInit");
    detail::quantize_on_init() = options;
  }
  ~QuantizeOnInit() { detail::quantize_on_init() = previous_; }
  QuantizeOnInit(const QuantizeOnInit&) = delete;
  QuantizeOnInit& operator=(const QuantizeOnInit&) = delete;

 private:
  std::optional<Nf4Options> previous_;
};

/// torch::nn::Linear's layer (same parameters, names, initialisation and forward) that can take a
/// LoRA adapter and hold its frozen weight in NF4.
///
/// Plain: `weight` (out, in) and `bias` (out,) trainable, forward x·Wᵀ + b.
/// add_adapter(options): weight and bias frozen (requires_grad false), submodules `lora_A`
///   (in -> rank; weight (rank, in), Kaiming-uniform with a = √5) and `lora_B` (rank -> out;
///   weight (out, rank), zeros) trainable, in fp32 for a fp16/bf16 weight (PEFT's
///   autocast_adapter_dtype); forward x·Wᵀ + b + B(A(dropout(x))) · scale, as PEFT's
///   lora.Linear, so the layer starts as the base did.
/// quantize(nf4): the weight parameter goes (and its memory, when nothing else holds it); the
///   buffers below, bitsandbytes' Linear4bit state keys with `_` for `.`, hold it instead, and
///   forward runs nf4_linear (no dW; dequantised one layer at a time):
///     weight_nf4            (⌈out·in/2⌉,) uint8  packed codes, two a byte
///     weight_absmax         (blocks,) fp32 absmax, or with double quantisation uint8 codes
///     weight_nested_absmax  (⌈blocks/256⌉,) fp32, double quantisation only
///     weight_nested_offset  () fp32, double quantisation only
///   ->to(dtype) then converts the adapter and bias and sets nf4().dtype; codes and scales keep
///   their dtypes (->to(device) moves them).
///   memopt::nn::Linear q_proj(torch::nn::LinearOptions(4096, 4096).bias(false));
///   q_proj->add_adapter(memopt::nn::LoraOptions().rank(16).alpha(32));
///   q_proj->quantize();                 // 64 MiB of fp32 weight -> 8.7 MB of NF4
///   torch::Tensor y = q_proj(x);        // (B, T, 4096) -> (B, T, 4096)
class LinearImpl : public torch::nn::Cloneable<LinearImpl> {
 public:
  explicit LinearImpl(torch::nn::LinearOptions options) : options(std::move(options)) { reset(); }
  LinearImpl(int64_t in_features, int64_t out_features)
      : LinearImpl(torch::nn::LinearOptions(in_features, out_features)) {}

  /// An adapted layer around an existing torch::nn::Linear: it shares that layer's weight and bias
  /// (no copy; frozen there too, and merge() changes them there too), quantised if `nf4` is given
  /// (then the Linear's weight is not kept: drop the Linear to free it).
  ///   memopt::nn::Linear lora(torch_linear, memopt::nn::LoraOptions().rank(8));
  ///   memopt::nn::Linear qlora(torch_linear, memopt::nn::LoraOptions().rank(8), memopt::nn::Nf4Options());
  LinearImpl(const torch::nn::Linear& base, const LoraOptions& lora, std::optional<Nf4Options> nf4 = std::nullopt) {
    TORCH_CHECK(!base.is_empty() && base->weight.defined() && base->weight.dim() == 2,
                "memopt::nn::Linear: the base Linear is empty or has no 2-d weight. HINT: pass a constructed "
                "torch::nn::Linear, e.g. torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false))");
    options = torch::nn::LinearOptions(base->weight.size(1), base->weight.size(0)).bias(base->bias.defined());
    register_dense(base->weight, base->bias);
    add_adapter(lora);
    if (nf4) quantize(*nf4);
  }

  /// The same around a new torch::nn::Linear of `base`'s options (nn.Linear's initialisation).
  LinearImpl(const torch::nn::LinearOptions& base, const LoraOptions& lora,
             std::optional<Nf4Options> nf4 = std::nullopt)
      : LinearImpl(torch::nn::Linear(base), lora, std::move(nf4)) {}

  /// A fresh layer in this one's state (Cloneable::clone copies the tensors in after): a dense
  /// weight with nn.Linear's initialisation, then the adapter and NF4 storage it has.
  void reset() override {
    {
      torch::nn::Linear init(options);  // nn.Linear's parameters and initialisation, draw for draw
      register_dense(init->weight, init->bias);
    }  // `init` gone: only this module holds the weight (quantize frees it)
    if (lora_) register_adapter();
    if (!nf4_options_ && detail::quantize_on_init()) nf4_options_ = detail::quantize_on_init();
    if (nf4_options_) register_nf4();
  }

  /// Freezes weight and bias and adds a LoRA adapter (see the class comment). Checks the options
  /// (rank 1..min(in, out)); one adapter per layer.   layer->add_adapter(LoraOptions().rank(8));
  void add_adapter(const LoraOptions& lora) {
    const char* who = "memopt::nn::Linear::add_adapter";
    TORCH_CHECK(!lora_, who, ": the layer already has a LoRA adapter (rank ", lora_ ? lora_->rank() : 0,
                "). HINT: one adapter per layer; change its alpha or dropout with set_lora_options()");
    detail::check_lora_shape(out_features(), in_features(), lora, who);
    lora_ = lora;
    register_adapter();
  }

  /// Replaces the weight with its NF4 codes and scales (blocksize 64 and double quantisation by
  /// default; any numel, the last block short, an odd count padded) and freezes the bias. Not on
  /// a merged layer.   layer->quantize(memopt::nn::Nf4Options().double_quant(false));
  void quantize(const Nf4Options& nf4 = {}) {
    const char* who = "memopt::nn::Linear::quantize";
    TORCH_CHECK(!nf4_options_, who, ": the layer is already NF4. HINT: quantise once; dequantized_weight() "
                "gives the dense weight back");
    TORCH_CHECK(!merged_, who, ": the layer is merged, and NF4 would freeze scale * B·A into the base. HINT: call "
                "unmerge() first");
    TORCH_CHECK(weight.is_floating_point(), who, ": the weight is ", weight.scalar_type(), ". HINT: NF4 quantises "
                "a floating-point weight (fp32, bf16 or fp16)");
    detail::check_blocksize(nf4.blocksize(), who);
    nf4_options_ = nf4;
    register_nf4();
  }

  /// x·Wᵀ + b (nf4_linear when quantised) + B(A(dropout(x))) · scale when an adapter is on and
  /// not merged. As PEFT's lora.Linear: the adapter's input is x cast to A's dtype, the sum is
  /// returned in the base output's dtype; dropout only in training.
  torch::Tensor forward(const torch::Tensor& x) {  // (..., in) -> (..., out)
    torch::Tensor y = nf4_options_ ? nf4_linear(x, nf4_, bias) : torch::linear(x, weight, bias);  // (..., out)
    if (!lora_ || merged_) return y;
    return detail::add_lora(y, x, lora_A, lora_B, *lora_, is_training());  // (..., out)
  }

  /// forward(x) for a value that only flows into a checkpointed block's output (LLaMA's down
  /// projection: y = h + mlp(...)). In the block's recompute (memopt::detail::replaying()),
  /// where that output is the root of backward and never read, a dense layer without an active
  /// adapter builds its autograd node on an uninitialised output instead of running the GEMM
  /// (nn::linear_unread: the same gradients). Everywhere else, forward(x).
  torch::Tensor forward_to_output(const torch::Tensor& x) {  // (..., in) -> (..., out)
    return dense() && memopt::detail::replaying() ? linear_unread(x, weight, bias) : forward(x);
  }

  /// Whether forward() is x·Wᵀ + b alone: not NF4, no adapter or a merged one.
  bool dense() const { return !nf4_options_ && (!lora_ || merged_); }

  bool has_adapter() const { return lora_.has_value(); }
  bool quantized() const { return nf4_options_.has_value(); }

  /// The adapter's options (add_adapter's, or set_lora_options()'s).
  const LoraOptions& lora_options() const {
    TORCH_CHECK(lora_, "memopt::nn::Linear: the layer has no LoRA adapter. HINT: add_adapter() first, or "
                "check has_adapter()");
    return *lora_;
  }

  /// PEFT's `scaling`: lora_options().scale().
  double scale() const { return lora_options().scale(); }

  /// Replaces alpha, dropout, use_rslora and targets (memopt::io::load_adapter sets an adapter
  /// config's); the rank stays, and the layer must not be merged.
  ///   layer->set_lora_options(layer->lora_options().alpha(32));
  void set_lora_options(LoraOptions lora) {
    const char* who = "memopt::nn::Linear::set_lora_options";
    lora.check(who);
    TORCH_CHECK(lora.rank() == lora_options().rank(), who, ": rank ", lora.rank(), " differs from the layer's ",
                lora_options().rank(), ". HINT: the rank is the shape of lora_A and lora_B; build a new adapter "
                "for another rank");
    TORCH_CHECK(!merged_, who, ": the layer is merged, and a new scale would unmerge a different update. HINT: call "
                "unmerge() first");
    lora_ = std::move(lora);
  }

  /// A Kaiming-uniform with a = √5 (bound 1/√in), B zeros: PEFT's init_lora_weights=True.
  void reset_adapter() {
    (void)lora_options();
    detail::reset_lora(lora_A, lora_B);
  }

  /// scale · B·A (out, in), the update merge() adds, in the adapter's dtype, computed in fp32
  /// (double for a double adapter) as PEFT's get_delta_weight on the CPU.
  torch::Tensor delta_weight() const {  // (out, in)
    return delta(compute_dtype(lora_B->weight.scalar_type())).to(lora_B->weight.scalar_type());
  }

  /// Adds scale · B·A to the dense weight in place (computed in fp32, or double for a double
  /// weight): forward() then skips the adapter. Not on an NF4 layer.   layer->merge();
  void merge() {
    TORCH_CHECK(!merged_, "memopt::nn::Linear: merge() on a layer already merged. HINT: merging twice would add "
                "scale * B·A to the weight twice; call unmerge() first, or check merged()");
    TORCH_CHECK(!nf4_options_, "memopt::nn::Linear: merge() on an NF4 layer. HINT: folding B·A into 4-bit codes "
                "would requantise the base; merge into a dense copy: memopt::nn::Linear(torch::nn::Linear with "
                "dequantized_weight(), ...)");
    add_delta(+1);
    merged_ = true;
  }

  /// Subtracts scale · B·A from the weight again (the adapter as it is now).   layer->unmerge();
  void unmerge() {
    TORCH_CHECK(merged_, "memopt::nn::Linear: unmerge() on a layer that is not merged. HINT: the weight holds no "
                "adapter update to take out; call merge() first, or check merged()");
    add_delta(-1);
    merged_ = false;
  }

  /// Whether scale · B·A is in the weight (merge()).
  bool merged() const { return merged_; }

  /// The NF4 base (its tensors are this module's buffers).
  const Nf4Tensor& nf4() const {
    TORCH_CHECK(nf4_options_, "memopt::nn::Linear::nf4: the layer is not quantised. HINT: quantize() first, or "
                "check quantized()");
    return nf4_;
  }

  /// The weight (out, in) in `dtype` (a floating type), dequantised when NF4: a new tensor, no grad.
  ///   torch::Tensor w = layer->dequantized_weight(torch::kBFloat16);
  torch::Tensor dequantized_weight(torch::ScalarType dtype) const {
    TORCH_CHECK(at::isFloatingType(dtype), "memopt::nn::Linear::dequantized_weight: dtype must be a floating type "
                "(got ", dtype, "). HINT: ask for torch::kFloat, torch::kBFloat16 or torch::kFloat16 (nf4().packed "
                "holds the raw 4-bit codes)");
    if (nf4_options_) return nf4_.dequantize(dtype);
    return weight.detach().to(dtype, /*non_blocking=*/false, /*copy=*/true);
  }

  /// Bytes of the base weight as held: NF4 codes and scales, or the dense weight's (bias not counted).
  int64_t base_nbytes() const {
    return nf4_options_ ? nf4_.nbytes() : weight.numel() * static_cast<int64_t>(weight.element_size());
  }

  int64_t in_features() const { return options.in_features(); }
  int64_t out_features() const { return options.out_features(); }

  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override {
    move(device, dtype, non_blocking);
  }
  void to(torch::Dtype dtype, bool non_blocking = false) override { move(std::nullopt, dtype, non_blocking); }
  void to(torch::Device device, bool non_blocking = false) override { move(device, std::nullopt, non_blocking); }

  void pretty_print(std::ostream& stream) const override {
    stream << "memopt::nn::Linear(in_features=" << in_features() << ", out_features=" << out_features()
           << ", bias=" << (options.bias() ? "true" : "false");
    if (nf4_options_)
      stream << ", nf4 blocksize=" << nf4_.blocksize << (nf4_.double_quant() ? ", double quant" : "");
    if (lora_)
      stream << ", lora rank=" << lora_->rank() << ", alpha=" << lora_->alpha() << ", dropout=" << lora_->dropout()
             << (lora_->use_rslora() ? ", rslora" : "") << (merged_ ? ", merged" : "");
    stream << ")";
  }

  torch::nn::LinearOptions options{0, 0};
  torch::Tensor weight;                // (out, in); undefined once quantised
  torch::Tensor bias;                  // (out,); undefined without one; frozen with an adapter or NF4
  torch::nn::Linear lora_A{nullptr};   // in -> rank, no bias: weight (rank, in)
  torch::nn::Linear lora_B{nullptr};   // rank -> out, no bias: weight (out, rank)
  torch::Tensor weight_nf4;            // (⌈out·in/2⌉,) uint8, shared with nf4().packed
  torch::Tensor weight_absmax;         // (blocks,) uint8 codes (double quant) or fp32
  torch::Tensor weight_nested_absmax;  // (⌈blocks/256⌉,) fp32; double quant only
  torch::Tensor weight_nested_offset;  // () fp32; double quant only

 private:
  void register_dense(const torch::Tensor& w, const torch::Tensor& b) {
    weight = register_parameter("weight", w);  // (out, in)
    bias = b.defined() ? register_parameter("bias", b) : torch::Tensor();  // (out,)
  }

  void freeze_base() {
    if (weight.defined()) weight.requires_grad_(false);
    if (bias.defined()) bias.requires_grad_(false);
  }

  void register_adapter() {
    freeze_base();
    const torch::Device device = weight.defined() ? weight.device() : nf4_.packed.device();
    const torch::Dtype dtype = weight.defined() ? weight.scalar_type() : nf4_.dtype;
    std::tie(lora_A, lora_B) =
        detail::register_lora(*this, out_features(), in_features(), lora_->rank(), device, dtype);
  }

  // The weight parameter becomes the NF4 buffers (parameters_ is Module's protected table).
  void register_nf4() {
    freeze_base();
    nf4_ = quantize_nf4(weight.detach(), *nf4_options_);
    parameters_.erase("weight");
    weight = torch::Tensor();
    weight_nf4 = register_buffer("weight_nf4", nf4_.packed);
    if (nf4_.double_quant()) {
      weight_absmax = register_buffer("weight_absmax", nf4_.absmax_quant.codes);
      weight_nested_absmax = register_buffer("weight_nested_absmax", nf4_.absmax_quant.absmax);
      weight_nested_offset = register_buffer("weight_nested_offset", nf4_.absmax_offset);
    } else {
      weight_absmax = register_buffer("weight_absmax", nf4_.absmax);
    }
    // The dense weight's pages go back to the system now (when nothing else holds it): the
    // heap would keep them, and a model quantised layer by layer, every layer's (7B: 20 GB).
    memory::release_free_host_memory();
  }

  static torch::Dtype compute_dtype(torch::Dtype dtype) { return torch::promote_types(dtype, torch::kFloat); }

  torch::Tensor delta(torch::Dtype dtype) const {  // (out, in)
    return lora_B->weight.to(dtype).matmul(lora_A->weight.to(dtype)) * lora_options().scale();
  }

  void add_delta(double sign) {
    (void)lora_options();
    torch::NoGradGuard no_grad;
    const torch::Dtype dtype = compute_dtype(weight.scalar_type());
    weight.copy_(weight.to(dtype) + delta(dtype).to(weight.device()) * sign);  // in place: storage stays shared
  }

  // Module::to, but NF4 codes and scales only change device, never dtype: set_data keeps each
  // tensor's identity, so nf4_ (which shares them) follows.
  void move(std::optional<torch::Device> device, std::optional<torch::Dtype> dtype, bool non_blocking) {
    if (!nf4_options_) {
      if (device && dtype) torch::nn::Module::to(*device, *dtype, non_blocking);
      else if (device) torch::nn::Module::to(*device, non_blocking);
      else torch::nn::Module::to(*dtype, non_blocking);
      return;
    }
    for (const auto& child : children()) {
      if (device && dtype) child->to(*device, *dtype, non_blocking);
      else if (device) child->to(*device, non_blocking);
      else child->to(*dtype, non_blocking);
    }
    torch::TensorOptions to;
    if (device) to = to.device(*device);
    if (dtype) to = to.dtype(*dtype);
    for (auto& parameter : named_parameters(/*recurse=*/false)) parameter->set_data(parameter->to(to, non_blocking));
    if (device)
      for (auto& buffer : named_buffers(/*recurse=*/false)) buffer->set_data(buffer->to(*device, non_blocking));
    if (dtype) nf4_.dtype = *dtype;
  }

  std::optional<LoraOptions> lora_;
  std::optional<Nf4Options> nf4_options_;
  Nf4Tensor nf4_;
  bool merged_ = false;
};
TORCH_MODULE(Linear);

/// layers[i](x) for Linear layers that read the same x (q, k and v; gate and up): with
/// `shared` and every layer dense(), one autograd node (nn::linear_shared_input: one dX GEMM,
/// the others accumulated into it); otherwise each layer's forward, in order (an adapter's
/// dropout draws from the generator in the order PEFT calls them).
///   auto qkv = memopt::nn::forward_shared(x, {q_proj, k_proj, v_proj}, true);
inline std::vector<torch::Tensor> forward_shared(const torch::Tensor& x, const std::vector<Linear>& layers,
                                                 bool shared) {
  std::vector<torch::Tensor> y;
  const bool dense = std::all_of(layers.begin(), layers.end(), [](const Linear& l) { return l->dense(); });
  if (!shared || !dense) {
    for (auto layer : layers) y.push_back(layer->forward(x));
    return y;
  }
  std::vector<torch::Tensor> weights, biases;  // a bias-free layer's: undefined, added nowhere
  for (const auto& layer : layers) {
    weights.push_back(layer->weight);
    biases.push_back(layer->bias);
  }
  return linear_shared_input(x, weights, biases);
}

}  // namespace memopt::nn
