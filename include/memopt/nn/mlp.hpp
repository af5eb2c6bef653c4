// memopt/nn/mlp.hpp — the SwiGLU feed-forward of LLaMA: down(silu(gate(x)) · up(x)),
// no biases, HF parameter names (gate_proj, up_proj, down_proj). With row_tiles > 1 it runs
// tile by tile over the rows (B·T), each tile under activation checkpointing: no (B, T, F)
// tensor is kept for backward, and backward holds one tile's (B·T / tiles, F) at a time
// (Unsloth's and Arctic's "tiled MLP"; the tile's matmuls run again in backward).
#pragma once

#include <memory>
#include <vector>

#include <torch/torch.h>

#include "memopt/nn/fused.hpp"
#include "memopt/nn/linear.hpp"

#include "memopt/detail/checkpoint_function.hpp"

#include "memopt/policies/recompute.hpp"

namespace memopt::nn {

/// Options for SwiGLU.  SwiGLU(SwiGLUOptions(512, 1408))
struct SwiGLUOptions {
  SwiGLUOptions(int64_t hidden_size, int64_t intermediate_size)
      : hidden_size_(hidden_size), intermediate_size_(intermediate_size) {}
  TORCH_ARG(int64_t, hidden_size);
  TORCH_ARG(int64_t, intermediate_size);
  /// nn::fused_swiglu for silu(gate) · up (one pass each way; keeps gate and up only).
  TORCH_ARG(bool, fused) = false;
  /// gate and up projected as one autograd node (nn::forward_shared: one dX GEMM instead of
  /// two and an add) where both are dense; down through the same node (its dW by weight_grad).
  TORCH_ARG(bool, fused_projections) = false;
  /// > 1: the rows (B·T) in this many tiles, each recomputed in backward (forward_tiled):
  /// the same values; the (B, T, F) activations held are one tile's. A LoRA adapter's dropout
  /// draws its mask tile by tile (another draw than untiled, the same distribution).
  TORCH_ARG(int64_t, row_tiles) = 1;
};

class SwiGLUImpl : public torch::nn::Cloneable<SwiGLUImpl> {
 public:
  explicit SwiGLUImpl(SwiGLUOptions options) : options(options) { reset(); }
  void reset() override {
    TORCH_CHECK(options.row_tiles() >= 1, "memopt::nn::SwiGLU: row_tiles must be >= 1 (got ", options.row_tiles(),
                "). HINT: 1 runs the rows in one piece; 4 or 8 hold a quarter or an eighth of the (B, T, F) "
                "activations.");
    const int64_t C = options.hidden_size(), F = options.intermediate_size();
    gate_proj = register_module("gate_proj", nn::Linear(torch::nn::LinearOptions(C, F).bias(false)));
    up_proj = register_module("up_proj", nn::Linear(torch::nn::LinearOptions(C, F).bias(false)));
    down_proj = register_module("down_proj", nn::Linear(torch::nn::LinearOptions(F, C).bias(false)));
  }
  torch::Tensor forward(const torch::Tensor& x) {  // (B, T, C) -> (B, T, C)
    return forward(x, recompute::None{});
  }
  /// recompute::Selective recomputes silu(gate) · up in backward; the matmul outputs stay.
  /// With row_tiles > 1: forward_tiled, whatever the policy (it keeps less than any).
  /// `to_block_output`: the result only flows into a checkpointed block's output, so in the
  /// block's recompute the down projection's GEMM is skipped (nn::Linear::forward_to_output).
  template <RecomputePolicy Recompute>
  torch::Tensor forward(const torch::Tensor& x, const Recompute& ckpt,
                        bool to_block_output = false) {  // (B, T, C) -> (B, T, C)
    if (options.row_tiles() > 1) return forward_tiled(x);
    const bool fused = options.fused();
    auto gated = run_cheap(
        ckpt,
        [fused](const std::vector<torch::Tensor>& in) {
          return fused ? fused_swiglu(in[0], in[1]) : torch::silu(in[0]) * in[1];
        },
        forward_shared(x, {gate_proj, up_proj}, options.fused_projections()));  // (B, T, F) each
    if (to_block_output) return down_proj->forward_to_output(gated);                 // (B, T, C)
    return forward_shared(gated, {down_proj}, options.fused_projections()).front();  // (B, T, C)
  }

  /// The rows in row_tiles tiles, each under activation checkpointing when autograd records
  /// (memopt::detail::checkpointed: RNG and autocast replayed). Without grad mode (a checkpointed
  /// block's forward, evaluation) nothing is kept: the rows run whole, or tile by tile where an
  /// adapter's dropout draws masks (so its recompute draws the same ones).
  torch::Tensor forward_tiled(const torch::Tensor& x) {  // (B, T, C) -> (B, T, C)
    const auto self = std::static_pointer_cast<SwiGLUImpl>(shared_from_this());  // outlives backward
    const BlockFn tile = [self](const std::vector<torch::Tensor>& in) {           // (n, C) -> (n, C)
      const auto gu = forward_shared(in[0], {self->gate_proj, self->up_proj}, self->options.fused_projections());
      const auto gated = self->options.fused() ? fused_swiglu(gu[0], gu[1]) : torch::silu(gu[0]) * gu[1];
      return forward_shared(gated, {self->down_proj}, self->options.fused_projections()).front();
    };
    const bool record = torch::GradMode::is_enabled();
    if (!record && !draws_masks()) return tile({x});
    const auto params = record ? parameters() : std::vector<torch::Tensor>{};
    std::vector<torch::Tensor> outs;
    for (const auto& rows : x.reshape({-1, x.size(-1)}).chunk(options.row_tiles(), 0))  // (n, C) each
      outs.push_back(record ? memopt::detail::checkpointed(tile, {rows}, params) : tile({rows}));
    return torch::cat(outs).view(x.sizes());  // (B, T, C)
  }

  /// Whether a forward draws random numbers: an adapter's dropout, in training.
  bool draws_masks() const {
    const auto drops = [](const nn::Linear& l) { return l->has_adapter() && l->lora_options().dropout() > 0; };
    return is_training() && (drops(gate_proj) || drops(up_proj) || drops(down_proj));
  }

  SwiGLUOptions options;
  nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(SwiGLU);

}  // namespace memopt::nn
