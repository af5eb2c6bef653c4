// memopt/nn/fused_dropout.hpp — dropout fused into the residual add that follows it:
// y = x + mask · r / (1 − p), one pass, with the mask drawn from a counter-based hash of a
// seed and each element's index, so backward regenerates it instead of keeping it. On the
// CPU LibTorch's dropout keeps its scaled noise for backward, a (B, T, C) tensor in r's
// dtype per dropout (two per LLaMA block); this keeps 16 bytes. The seed is one draw from
// the default CPU generator, so torch::manual_seed makes runs repeat and a checkpointed
// block that replays the generator (detail/checkpoint_function.hpp, preserve_rng_state)
// regenerates the forward's mask in its recompute. The masks differ from LibTorch's draws
// (another generator): the same distribution, keep probability 1 − p, quantised to 2⁻²⁴.
// Contiguous fp32/bf16 CPU tensors of one shape and dtype; otherwise x + torch::dropout(r).
//   auto h = memopt::nn::fused_dropout_add(x, attn_out, 0.1, is_training());  // (B, T, C)
#pragma once

#include <ATen/CPUGeneratorImpl.h>

#include <cstdint>
#include <mutex>
#include <type_traits>

#include <torch/torch.h>

#include "memopt/detail/parallel.hpp"
#include "memopt/nn/fused.hpp"

namespace memopt::detail::fused {

// lowbias32 (Chris Wellons' integer hash): full avalanche on 32 bits, vectorisable.
inline uint32_t hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// Element i's keep bit for `seed`: a 24-bit uniform draw at or above `threshold` (p · 2²⁴).
inline bool keep(uint64_t seed, int64_t i, uint32_t threshold) {
  const auto index = static_cast<uint64_t>(i);
  const uint32_t h = hash32(hash32(static_cast<uint32_t>(index) ^ static_cast<uint32_t>(seed)) ^
                            (static_cast<uint32_t>(index >> 32) + static_cast<uint32_t>(seed >> 32)));
  return (h >> 8) >= threshold;
}

// A dropout mask that backward regenerates: one seed drawn from the default CPU generator, the
// keep threshold p · 2²⁴ and the scale 1 / (1 − p); kept in an autograd context's saved_data.
struct DropoutMask {
  uint64_t seed = 0;
  uint32_t threshold = 0;
  float scale = 1.f;

  static DropoutMask draw(double p) {
    DropoutMask m;
    {
      auto gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(gen.mutex());
      m.seed = at::check_generator<at::CPUGeneratorImpl>(gen)->random64();
    }
    m.threshold = static_cast<uint32_t>(p * 16777216.0);  // p · 2²⁴
    m.scale = static_cast<float>(1.0 / (1.0 - p));
    return m;
  }
  // Element i's factor: scale where kept, 0 where dropped.
  float factor(int64_t i) const { return keep(seed, i, threshold) ? scale : 0.f; }

  void save(torch::autograd::AutogradContext* ctx) const {
    ctx->saved_data["mask_seed"] = static_cast<int64_t>(seed);
    ctx->saved_data["mask_threshold"] = static_cast<int64_t>(threshold);
    ctx->saved_data["mask_scale"] = static_cast<double>(scale);
  }
  static DropoutMask load(torch::autograd::AutogradContext* ctx) {
    return {static_cast<uint64_t>(ctx->saved_data["mask_seed"].toInt()),
            static_cast<uint32_t>(ctx->saved_data["mask_threshold"].toInt()),
            static_cast<float>(ctx->saved_data["mask_scale"].toDouble())};
  }
};

// out[i] = (base ? base[i] : 0) + v[i] · mask.factor(i) over [begin, end): a multiply, as
// LibTorch's CPU dropout does, so a dropped NaN still shows.
template <class T>
MEMOPT_FUSED_CLONES void dropout_add_range(const T* base, const T* v, T* out, DropoutMask mask, int64_t begin,
                                           int64_t end) {
  if (base == nullptr) {
    for (int64_t i = begin; i < end; ++i) out[i] = from_float<T>(to_float(v[i]) * mask.factor(i));
  } else {
    for (int64_t i = begin; i < end; ++i) out[i] = from_float<T>(to_float(base[i]) + to_float(v[i]) * mask.factor(i));
  }
}

class DropoutAddFunction : public torch::autograd::Function<DropoutAddFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& r,
                               double p) {
    const auto mask = DropoutMask::draw(p);
    auto y = torch::empty_like(x);
    run(&x, r, y, mask);
    mask.save(ctx);
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto dy = grads[0].contiguous();  // dx = dy; dr = mask · dy / (1 − p), the mask regenerated
    auto dr = torch::empty_like(dy);
    run(nullptr, dy, dr, DropoutMask::load(ctx));
    return {dy, dr, torch::Tensor()};
  }

 private:
  static void run(const torch::Tensor* base, const torch::Tensor& v, torch::Tensor& out, DropoutMask mask) {
    with_type(v.scalar_type(), [&](auto* t) {
      using T = std::remove_pointer_t<decltype(t)>;
      const T* b = base != nullptr ? base->data_ptr<T>() : nullptr;
      const T* src = v.data_ptr<T>();
      T* dst = out.data_ptr<T>();
      parallel_chunks(v.numel(), kGrainElements,
                      [&](int64_t begin, int64_t end, int64_t) { dropout_add_range(b, src, dst, mask, begin, end); });
    });
  }
};

}  // namespace memopt::detail::fused

namespace memopt::nn {

/// x + dropout(r, p) in training, x + r otherwise; fused (mask regenerated in backward, not
/// kept) for contiguous fp32/bf16 CPU tensors of one shape and dtype with 0 < p < 1.
inline torch::Tensor fused_dropout_add(const torch::Tensor& x, const torch::Tensor& r, double p, bool training) {
  TORCH_CHECK(p >= 0 && p < 1, "memopt::nn::fused_dropout_add: p must be in [0, 1) (got ", p,
              "). HINT: dropout 0 turns it off.");
  if (!training || p == 0) return x + r;
  if (!memopt::detail::fused::kernel_pair(x, r)) return x + torch::dropout(r, p, training);
  return memopt::detail::fused::DropoutAddFunction::apply(x, r, p);
}

}  // namespace memopt::nn
