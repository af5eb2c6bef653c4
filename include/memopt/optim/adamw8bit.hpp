// memopt/optim/adamw8bit.hpp — AdamW whose two moments are stored in 8 bits, block-wise
// quantised as in bitsandbytes' 8-bit optimizers (Dettmers et al., "8-bit Optimizers via
// Block-wise Quantization", 2022): 2 B/param of state instead of 8, the same AdamW math.
// A drop-in torch::optim::Optimizer: param groups carry torch::optim::AdamWOptions.
//
// Format and maps: optim/quantize.hpp (block-wise codes, bitsandbytes' dynamic tree maps, a
// positive v never rounding to the code 0).
//
// Step (per parameter, AdamW of LibTorch 1.13 to the operation): p *= 1 - lr·wd;
// m = β1·m + (1-β1)·g, v = β2·v + (1-β2)·g²; p -= lr/(1-β1^t) · m / (sqrt(v)/sqrt(1-β2^t) + eps),
// with m and v dequantised to fp32 before and requantised (nearest code: #{boundaries < x},
// as torch::bucketize on the midpoints of the map) after. On the CPU a fused kernel does this
// per block of 256, the blocks of all 8-bit parameters split over LibTorch's threads
// (detail::adamw8bit_cpu_step: ~3.6x the time of torch::optim::AdamW's step on the
// benchmark's LM); elsewhere (CUDA, bf16 or strided parameters) tensor operations do it chunk
// by chunk, so fp32 temporaries stay bounded (AdamW8bitOptions::chunk_size). Parameters with
// fewer than min_8bit_size (4096, bitsandbytes' min_8bit_size) elements keep fp32 moments,
// stepped exactly as torch::optim::AdamW: their state is small, and norms and biases are where
// quantisation error would hurt most.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <deque>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "memopt/detail/optimizer_state.hpp"
#include "memopt/detail/parallel.hpp"
#include "memopt/optim/quantize.hpp"

namespace memopt::optim {

namespace detail {

/// AdamW's scalars for one parameter's step, in the float the tensor operations use.
struct StepScalars {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, decay, sqrt_bias_correction2, eps, neg_step_size;
  bool weight_decay;
};

/// One parameter's share of a fused CPU step: contiguous fp32 parameter and gradient of
/// `numel` elements, its codes and block scales.
struct FusedWork {
  float* param;
  const float* grad;
  uint8_t* codes1;
  float* absmax1;
  uint8_t* codes2;
  float* absmax2;
  int64_t numel;
  StepScalars k;
};

/// Block `block` of w: dequantise → AdamW update → requantise, with 2 KB of fp32 temporaries.
inline void adamw8bit_cpu_block(const FusedWork& w, int64_t block, const CodeBook& book1, const CodeBook& book2) {
  std::array<float, kQuantBlockSize> m_block, v_block;
  const StepScalars& k = w.k;
  const int64_t lo = block * kQuantBlockSize, len = std::min(kQuantBlockSize, w.numel - lo);
  const float a1 = w.absmax1[block], a2 = w.absmax2[block];
  float max1 = 0, max2 = 0;
  for (int64_t j = 0; j < len; ++j) {
    const int64_t i = lo + j;
    const float g = w.grad[i];
    const float m = book1.codes[w.codes1[i]] * a1 * k.beta1 + k.one_minus_beta1 * g;
    const float v = book2.codes[w.codes2[i]] * a2 * k.beta2 + k.one_minus_beta2 * g * g;
    float p = w.param[i];
    if (k.weight_decay) p *= k.decay;
    w.param[i] = p + k.neg_step_size * m / (std::sqrt(v) / k.sqrt_bias_correction2 + k.eps);
    m_block[j] = m;
    v_block[j] = v;
    max1 = std::max(max1, std::abs(m));
    max2 = std::max(max2, std::abs(v));
  }
  w.absmax1[block] = max1;
  w.absmax2[block] = max2;
  const float scale1 = max1 > 0 ? max1 : 1, scale2 = max2 > 0 ? max2 : 1;
  for (int64_t j = 0; j < len; ++j) {
    w.codes1[lo + j] = book1.encode(m_block[j] / scale1);
    w.codes2[lo + j] = book2.encode(v_block[j] / scale2);
  }
}

/// Steps every block of `work`, in contiguous runs of blocks on LibTorch's threads
/// (detail/parallel.hpp: at::parallel_for runs serially in code built without -fopenmp).
inline void adamw8bit_cpu_step(const std::vector<FusedWork>& work, const CodeBook& book1, const CodeBook& book2) {
  constexpr int64_t kMinBlocksPerThread = 256;  // 64K elements: below that a thread costs more than it saves
  std::vector<int64_t> first_block{0};          // prefix sums of the blocks of each work item
  for (const auto& w : work) first_block.push_back(first_block.back() + num_quant_blocks(w.numel));
  memopt::detail::parallel_chunks(first_block.back(), kMinBlocksPerThread, [&](int64_t lo, int64_t hi, int64_t) {
    size_t item = static_cast<size_t>(std::upper_bound(first_block.begin(), first_block.end(), lo) -
                                      first_block.begin() - 1);
    for (int64_t block = lo; block < hi; ++block) {  // global blocks [lo, hi)
      while (block >= first_block[item + 1]) ++item;
      adamw8bit_cpu_block(work[item], block - first_block[item], book1, book2);
    }
  });
}

}  // namespace detail

/// What AdamW8bit adds to the AdamW options of its param groups.
///   auto opts = memopt::optim::AdamW8bitOptions().min_8bit_size(4096).chunk_size(1 << 18);
struct AdamW8bitOptions {
  /// Parameters with fewer elements keep fp32 moments (bitsandbytes' min_8bit_size).
  TORCH_ARG(int64_t, min_8bit_size) = 4096;
  /// Parameters that keep fp32 moments whatever their size. bitsandbytes keeps the token
  /// embedding's state in 32 bits (its StableEmbedding); on benchmarks/optim/adamw8bit_bench.cpp's
  /// LM, 8-bit state everywhere ends 150 steps 1.0% above fp32 AdamW's loss, with the
  /// embedding in fp32 0.4%, with embedding and output head in fp32 0.04%.
  ///   AdamW8bitOptions().fp32_params({model->model->embed_tokens->weight})
  TORCH_ARG(std::vector<torch::Tensor>, fp32_params);
  /// true: contiguous fp32 CPU parameters step in one fused pass per block of 256 (parallel,
  /// 2 KB of fp32 temporaries per thread); false: chunked tensor operations, the path every
  /// other parameter (CUDA, bf16, strided) takes.
  TORCH_ARG(bool, fused_cpu) = true;
  /// Elements the tensor path updates at a time (a multiple of 256): bounds its fp32
  /// temporaries to ~24 bytes × chunk_size.
  TORCH_ARG(int64_t, chunk_size) = int64_t{1} << 18;
};

/// The state of one parameter: step count and both moments, 8-bit or fp32.
struct AdamW8bitParamState : public torch::optim::OptimizerCloneableParamState<AdamW8bitParamState> {
  TORCH_ARG(int64_t, step) = 0;
  /// First moment: (n,) uint8 codes into dynamic_map(true), or fp32 in the parameter's shape.
  TORCH_ARG(torch::Tensor, exp_avg);
  /// Second moment: (n,) uint8 codes into dynamic_map(false), or fp32 in the parameter's shape.
  TORCH_ARG(torch::Tensor, exp_avg_sq);
  /// (⌈n/256⌉,) fp32 block scales of exp_avg; undefined when the moments are fp32.
  TORCH_ARG(torch::Tensor, exp_avg_absmax);
  /// (⌈n/256⌉,) fp32 block scales of exp_avg_sq; undefined when the moments are fp32.
  TORCH_ARG(torch::Tensor, exp_avg_sq_absmax);

 public:
  bool quantized() const { return exp_avg_absmax_.defined(); }
  /// Bytes of the state: its tensors plus the int64 step counter.
  int64_t bytes() const {
    int64_t n = static_cast<int64_t>(sizeof(int64_t));
    for (const auto* t : {&exp_avg_, &exp_avg_sq_, &exp_avg_absmax_, &exp_avg_sq_absmax_})
      if (t->defined()) n += static_cast<int64_t>(t->nbytes());
    return n;
  }

  void serialize(torch::serialize::OutputArchive& archive) const override {
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(step);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_absmax);  // skipped when undefined (fp32 moments)
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq_absmax);
  }
  void serialize(torch::serialize::InputArchive& archive) override {
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, step);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg_sq);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg_absmax);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg_sq_absmax);
  }
};

/// AdamW with 8-bit block-quantised moments (2 B/param + 8 B per 256 elements).
/// Param groups take torch::optim::AdamWOptions, so it replaces torch::optim::AdamW as is;
/// save()/load() write and read its state like any LibTorch optimizer (torch::save(opt, path)).
///   memopt::optim::AdamW8bit opt(model->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
///   loss.backward(); opt.step(); opt.zero_grad();
class AdamW8bit : public torch::optim::Optimizer {
 public:
  explicit AdamW8bit(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                     torch::optim::AdamWOptions defaults = {}, AdamW8bitOptions options = {})
      : Optimizer(std::move(param_groups), std::make_unique<torch::optim::AdamWOptions>(defaults)),
        options_(options) {
    check_options(defaults, "defaults");
    for (size_t i = 0; i < param_groups_.size(); ++i) check_options(options_of(i), "param group " + std::to_string(i));
    TORCH_CHECK(options_.min_8bit_size() >= 0, "memopt::optim::AdamW8bit: min_8bit_size must be >= 0 (got ",
                options_.min_8bit_size(), "). HINT: 4096 keeps the moments of small tensors in fp32; 0 quantises all.");
    TORCH_CHECK(options_.chunk_size() >= kQuantBlockSize && options_.chunk_size() % kQuantBlockSize == 0,
                "memopt::optim::AdamW8bit: chunk_size must be a positive multiple of ", kQuantBlockSize, " (got ",
                options_.chunk_size(), "). HINT: try 262144.");
  }
  explicit AdamW8bit(std::vector<torch::Tensor> params, torch::optim::AdamWOptions defaults = {},
                     AdamW8bitOptions options = {})
      : AdamW8bit(std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(std::move(params))},
                  defaults, options) {}

  /// One AdamW step on every parameter with a gradient.
  torch::Tensor step(LossClosure closure = nullptr) override {
    torch::NoGradGuard no_grad;
    torch::Tensor loss;
    if (closure != nullptr) {
      at::AutoGradMode enable_grad(true);
      loss = closure();
    }
    std::vector<detail::FusedWork> fused;  // 8-bit fp32 CPU parameters
    for (size_t i = 0; i < param_groups_.size(); ++i) {
      const torch::optim::AdamWOptions& o = options_of(i);
      check_options(o, "param group " + std::to_string(i));  // set_lr() may have changed it
      for (auto& p : param_groups_[i].params()) {
        if (!p.grad().defined()) continue;
        TORCH_CHECK(!p.grad().is_sparse(), "memopt::optim::AdamW8bit: sparse gradients are not supported (got a ",
                    p.grad().layout(), " gradient of shape ", p.sizes(),
                    "). HINT: use a dense embedding (sparse=false).");
        AdamW8bitParamState& s = state_of(p);
        s.step(s.step() + 1);
        if (!s.quantized()) {
          step_fp32(p, p.grad(), s, o);
        } else if (fusable(p, p.grad(), s)) {
          fused.push_back(fused_work(p, p.grad(), s, o));  // stepped together below, on every thread
          p.unsafeGetTensorImpl()->bump_version();         // as an in-place op would: stale graphs see it
        } else {
          step_quantized(p, p.grad(), s, o);
        }
      }
    }
    if (!fused.empty()) {
      const Maps& maps = maps_on(torch::kCPU);
      detail::adamw8bit_cpu_step(fused, *maps.signed_book, *maps.unsigned_book);
    }
    return loss;
  }

  /// Bytes of all optimizer state: 2·n + 8·⌈n/256⌉ (8-bit) or 8·n (fp32) per parameter of n
  /// elements, + 8 for each step counter. Parameters not stepped yet have no state.
  ///   double mib = opt.state_bytes() / 1048576.0;
  int64_t state_bytes() const {
    int64_t n = 0;
    for (const auto& item : state_) n += static_cast<const AdamW8bitParamState&>(*item.second).bytes();
    return n;
  }

  /// The state of parameter p, or nullptr before its first step.
  ///   const auto* s = opt.param_state(p); if (s && s->quantized()) { ... }
  const AdamW8bitParamState* param_state(const torch::Tensor& p) const {
    auto it = state_.find(memopt::detail::optimizer_state_key(state_, p));
    return it == state_.end() ? nullptr : static_cast<const AdamW8bitParamState*>(it->second.get());
  }

  const AdamW8bitOptions& options() const { return options_; }

  void save(torch::serialize::OutputArchive& archive) const override {
    torch::optim::serialize<AdamW8bitParamState, torch::optim::AdamWOptions>(archive, *this);
  }

  /// Reads a state written by save() — or by torch::optim::AdamW, whose fp32 moments are
  /// quantised here for parameters of min_8bit_size elements or more.
  void load(torch::serialize::InputArchive& archive) override {
    torch::optim::serialize<AdamW8bitParamState, torch::optim::AdamWOptions>(archive, *this);
    for (auto& group : param_groups_)
      for (auto& p : group.params()) adopt_loaded_state(p);
  }

 private:
  static constexpr int64_t kSignedZeroCode = 127;  // dynamic_map(true)[127] == 0: 127 negative codes below it

  struct Maps {
    torch::Tensor signed_map, signed_boundaries;      // (256,), (255,) first moment
    torch::Tensor unsigned_map, unsigned_boundaries;  // (256,), (255,) second moment: only 0 rounds to 0
    std::shared_ptr<const detail::CodeBook> signed_book, unsigned_book;  // the fused CPU kernel's (CPU only)
  };

  static void check_options(const torch::optim::AdamWOptions& o, const std::string& where) {
    const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
    TORCH_CHECK(o.lr() >= 0, "memopt::optim::AdamW8bit: ", where, ": lr must be >= 0 (got ", o.lr(),
                "). HINT: try 1e-3.");
    TORCH_CHECK(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1, "memopt::optim::AdamW8bit: ", where,
                ": betas must lie in [0, 1) (got ", beta1, ", ", beta2, "). HINT: try 0.9, 0.95.");
    TORCH_CHECK(o.eps() >= 0, "memopt::optim::AdamW8bit: ", where, ": eps must be >= 0 (got ", o.eps(),
                "). HINT: try 1e-8.");
    TORCH_CHECK(o.weight_decay() >= 0, "memopt::optim::AdamW8bit: ", where, ": weight_decay must be >= 0 (got ",
                o.weight_decay(), "). HINT: 0 turns weight decay off; 0.1 is usual.");
    TORCH_CHECK(!o.amsgrad(), "memopt::optim::AdamW8bit: ", where,
                ": amsgrad is not supported (got amsgrad=true). HINT: use torch::optim::AdamW for AMSGrad.");
  }

  const torch::optim::AdamWOptions& options_of(size_t group) const {
    const auto* o = dynamic_cast<const torch::optim::AdamWOptions*>(&param_groups_[group].options());
    TORCH_CHECK(o != nullptr, "memopt::optim::AdamW8bit: param group ", group,
                " has the options of another optimizer. HINT: give groups torch::optim::AdamWOptions.");
    return *o;
  }

  const Maps& maps_on(const c10::Device& device) {
    for (const auto& [d, maps] : maps_)
      if (d == device) return maps;
    Maps maps;
    maps.signed_map = dynamic_map(true).to(device);
    maps.signed_boundaries = detail::map_boundaries(maps.signed_map, /*keep_nonzero=*/false);
    maps.unsigned_map = dynamic_map(false).to(device);
    maps.unsigned_boundaries = detail::map_boundaries(maps.unsigned_map, /*keep_nonzero=*/true);
    if (device.is_cpu()) {
      maps.signed_book = std::make_shared<const detail::CodeBook>(maps.signed_map, maps.signed_boundaries);
      maps.unsigned_book = std::make_shared<const detail::CodeBook>(maps.unsigned_map, maps.unsigned_boundaries);
    }
    maps_.emplace_back(device, std::move(maps));
    return maps_.back().second;
  }

  // Small parameters and those listed in fp32_params keep fp32 moments.
  bool keeps_fp32(const torch::Tensor& p) const {
    if (p.numel() < options_.min_8bit_size()) return true;
    return std::any_of(options_.fp32_params().begin(), options_.fp32_params().end(),
                       [&](const torch::Tensor& q) { return q.is_same(p); });
  }

  // The state of p, created on its first step: 8-bit unless keeps_fp32(p).
  AdamW8bitParamState& state_of(const torch::Tensor& p) {
    const auto key = memopt::detail::optimizer_state_key(state_, p);
    auto it = state_.find(key);
    if (it == state_.end()) {
      auto s = std::make_unique<AdamW8bitParamState>();
      if (!keeps_fp32(p)) {
        const auto byte = p.options().dtype(torch::kByte);
        const auto fp32 = p.options().dtype(torch::kFloat);
        const int64_t blocks = num_quant_blocks(p.numel());
        s->exp_avg(torch::full({p.numel()}, kSignedZeroCode, byte));  // zero moments: the code of 0, absmax 0
        s->exp_avg_sq(torch::zeros({p.numel()}, byte));
        s->exp_avg_absmax(torch::zeros({blocks}, fp32));
        s->exp_avg_sq_absmax(torch::zeros({blocks}, fp32));
      } else {
        s->exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
        s->exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
      }
      it = state_.emplace(key, std::move(s)).first;
    }
    return static_cast<AdamW8bitParamState&>(*it->second);
  }

  // torch::optim::AdamW (1.13), operation for operation.
  static void step_fp32(torch::Tensor& p, const torch::Tensor& grad, AdamW8bitParamState& s,
                        const torch::optim::AdamWOptions& o) {
    const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
    if (o.weight_decay() != 0) p.mul_(1 - o.lr() * o.weight_decay());
    const double bias_correction1 = 1 - std::pow(beta1, s.step());
    const double bias_correction2 = 1 - std::pow(beta2, s.step());
    s.exp_avg().mul_(beta1).add_(grad, 1 - beta1);
    s.exp_avg_sq().mul_(beta2).addcmul_(grad, grad, 1 - beta2);
    const torch::Tensor denom = (s.exp_avg_sq().sqrt() / std::sqrt(bias_correction2)).add_(o.eps());
    p.addcdiv_(s.exp_avg(), denom, -o.lr() / bias_correction1);
  }

  // Whether the fused CPU kernel can step p: fp32, contiguous, on the CPU, with its gradient.
  bool fusable(const torch::Tensor& p, const torch::Tensor& grad, const AdamW8bitParamState& s) const {
    return options_.fused_cpu() && p.is_cpu() && p.scalar_type() == torch::kFloat && p.is_contiguous() &&
           grad.is_cpu() && grad.scalar_type() == torch::kFloat && grad.is_contiguous() &&
           s.exp_avg().is_contiguous() && s.exp_avg_sq().is_contiguous();
  }

  static detail::FusedWork fused_work(torch::Tensor& p, const torch::Tensor& grad, AdamW8bitParamState& s,
                                      const torch::optim::AdamWOptions& o) {
    const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
    const double step_size = o.lr() / (1 - std::pow(beta1, s.step()));
    const double sqrt_bias_correction2 = std::sqrt(1 - std::pow(beta2, s.step()));
    const detail::StepScalars k{static_cast<float>(beta1),
                                static_cast<float>(1 - beta1),
                                static_cast<float>(beta2),
                                static_cast<float>(1 - beta2),
                                static_cast<float>(1 - o.lr() * o.weight_decay()),
                                static_cast<float>(sqrt_bias_correction2),
                                static_cast<float>(o.eps()),
                                static_cast<float>(-step_size),
                                o.weight_decay() != 0};
    return {p.data_ptr<float>(),
            grad.data_ptr<float>(),
            s.exp_avg().data_ptr<uint8_t>(),
            s.exp_avg_absmax().data_ptr<float>(),
            s.exp_avg_sq().data_ptr<uint8_t>(),
            s.exp_avg_sq_absmax().data_ptr<float>(),
            p.numel(),
            k};
  }

  // The same math with tensor operations, one chunk at a time: dequantise → update → requantise.
  void step_quantized(torch::Tensor& p, const torch::Tensor& grad, AdamW8bitParamState& s,
                      const torch::optim::AdamWOptions& o) {
    const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
    const double decay = 1 - o.lr() * o.weight_decay();
    const double step_size = o.lr() / (1 - std::pow(beta1, s.step()));
    const double sqrt_bias_correction2 = std::sqrt(1 - std::pow(beta2, s.step()));
    const Maps& maps = maps_on(p.device());
    torch::Tensor flat_p = p.is_contiguous() ? p.view({-1}) : p.contiguous().view({-1});  // (n,)
    const torch::Tensor flat_g = grad.reshape({-1});                                      // (n,)

    detail::for_each_block_range(p.numel(), options_.chunk_size(), [&](int64_t offset, int64_t len, int64_t width) {
      const int64_t block = offset / kQuantBlockSize, blocks = len / width;
      torch::Tensor codes1 = s.exp_avg().slice(0, offset, offset + len);              // (len,) uint8
      torch::Tensor codes2 = s.exp_avg_sq().slice(0, offset, offset + len);           // (len,) uint8
      torch::Tensor absmax1 = s.exp_avg_absmax().slice(0, block, block + blocks);     // (blocks,)
      torch::Tensor absmax2 = s.exp_avg_sq_absmax().slice(0, block, block + blocks);  // (blocks,)
      torch::Tensor p_chunk = flat_p.slice(0, offset, offset + len);                  // (len,)
      torch::Tensor p32 = p_chunk.to(torch::kFloat);  // p_chunk itself for fp32 parameters
      const torch::Tensor g32 = flat_g.slice(0, offset, offset + len).to(torch::kFloat);

      torch::Tensor m = detail::dequantize(codes1, absmax1, width, maps.signed_map);    // (len,) fp32
      torch::Tensor v = detail::dequantize(codes2, absmax2, width, maps.unsigned_map);  // (len,) fp32
      if (o.weight_decay() != 0) p32.mul_(decay);
      m.mul_(beta1).add_(g32, 1 - beta1);
      v.mul_(beta2).addcmul_(g32, g32, 1 - beta2);
      const torch::Tensor denom = (v.sqrt() / sqrt_bias_correction2).add_(o.eps());  // (len,)
      p32.addcdiv_(m, denom, -step_size);
      if (!p32.is_same(p_chunk)) p_chunk.copy_(p32);
      detail::quantize_into(m, width, maps.signed_boundaries, codes1, absmax1);
      detail::quantize_into(v, width, maps.unsigned_boundaries, codes2, absmax2);
    });
    if (!p.is_contiguous()) p.copy_(flat_p.view(p.sizes()));
  }

  // Checks a loaded state against its parameter, moves it to the parameter's device and
  // quantises fp32 moments of large parameters.
  void adopt_loaded_state(const torch::Tensor& p) {
    auto it = state_.find(memopt::detail::optimizer_state_key(state_, p));
    if (it == state_.end()) return;
    auto& s = static_cast<AdamW8bitParamState&>(*it->second);
    const int64_t n = p.numel();
    TORCH_CHECK(s.exp_avg().defined() && s.exp_avg_sq().defined() && s.exp_avg().numel() == n &&
                    s.exp_avg_sq().numel() == n,
                "memopt::optim::AdamW8bit::load: the state of a parameter of shape ", p.sizes(), " holds moments of ",
                s.exp_avg().defined() ? s.exp_avg().numel() : 0, " and ",
                s.exp_avg_sq().defined() ? s.exp_avg_sq().numel() : 0,
                " elements. HINT: load into an optimizer built over the same parameters, in the same order.");
    if (s.quantized()) {
      TORCH_CHECK(s.exp_avg().scalar_type() == torch::kByte && s.exp_avg_sq().scalar_type() == torch::kByte &&
                      s.exp_avg_absmax().numel() == num_quant_blocks(n) &&
                      s.exp_avg_sq_absmax().defined() && s.exp_avg_sq_absmax().numel() == num_quant_blocks(n),
                  "memopt::optim::AdamW8bit::load: the 8-bit state of a parameter of ", n, " elements must hold uint8 ",
                  "codes and ", num_quant_blocks(n), " block scales per moment (got ", s.exp_avg().scalar_type(),
                  " codes, ", s.exp_avg_absmax().numel(), " scales). HINT: the archive was written by another "
                  "optimizer or memopt version; start the optimizer state afresh.");
      s.exp_avg(s.exp_avg().to(p.device()));
      s.exp_avg_sq(s.exp_avg_sq().to(p.device()));
      s.exp_avg_absmax(s.exp_avg_absmax().to(p.device(), torch::kFloat));
      s.exp_avg_sq_absmax(s.exp_avg_sq_absmax().to(p.device(), torch::kFloat));
    } else if (!keeps_fp32(p)) {
      const Maps& maps = maps_on(p.device());
      const BlockQuantized m = quantize_blockwise(s.exp_avg().to(p.device()), maps.signed_map);
      const BlockQuantized v = quantize_blockwise(s.exp_avg_sq().to(p.device()), maps.unsigned_map, true);
      s.exp_avg(m.codes).exp_avg_absmax(m.absmax).exp_avg_sq(v.codes).exp_avg_sq_absmax(v.absmax);
    } else {
      s.exp_avg(s.exp_avg().to(p.options()).view(p.sizes()));
      s.exp_avg_sq(s.exp_avg_sq().to(p.options()).view(p.sizes()));
    }
  }

  AdamW8bitOptions options_;
  std::deque<std::pair<c10::Device, Maps>> maps_;  // the maps on each device seen (references stay valid)
};

}  // namespace memopt::optim
