// memopt/nn/attention.hpp — LLaMA self-attention as a module (HF parameter names q_proj,
// k_proj, v_proj, o_proj), rotary embeddings on q and k, optional grouped KV heads, causal or
// bidirectional, running the attention its options name (AttentionKind): math, blockwise,
// SDPA, flash (memopt's brgemm flash attention, CPU), or auto, the fastest of blockwise,
// SDPA and flash on each shape, measured here (attention_choice.hpp). The attention functions
// themselves are in attention_kernels.hpp and attention_flash.hpp.
#pragma once

#include <utility>
#include <vector>

#include <torch/torch.h>

#include "memopt/nn/attention_choice.hpp"
#include "memopt/nn/attention_kernels.hpp"
#include "memopt/nn/fused.hpp"
#include "memopt/nn/linear.hpp"
#include "memopt/nn/rope.hpp"
#include "memopt/policies/recompute.hpp"

namespace memopt::nn {

/// Options for Attention.  Attention(AttentionOptions(512, 8).num_kv_heads(2).kind(AttentionKind::kBlockwise))
struct AttentionOptions {
  AttentionOptions(int64_t hidden_size, int64_t num_heads) : hidden_size_(hidden_size), num_heads_(num_heads) {}
  TORCH_ARG(int64_t, hidden_size);
  TORCH_ARG(int64_t, num_heads);
  /// 0 means num_heads (no grouping).
  TORCH_ARG(int64_t, num_kv_heads) = 0;
  /// Width of one head; 0 means hidden_size / num_heads.
  TORCH_ARG(int64_t, head_dim) = 0;
  TORCH_ARG(bool, causal) = true;
  TORCH_ARG(double, dropout) = 0.0;
  /// kBlockwise: attention_blockwise (memory linear in T; dropout must be 0); kSdpa: attention_sdpa;
  /// kFlash: attention_flash; kAuto: attention_auto (the fastest of those three on each shape,
  /// measured on its first call).
  TORCH_ARG(AttentionKind, kind) = AttentionKind::kMath;
  /// Blocks of the blockwise path: query and key positions per block.
  TORCH_ARG(int64_t, q_block) = kAttentionQBlock;
  TORCH_ARG(int64_t, kv_block) = kAttentionKvBlock;
  /// RoPE on q and k as nn::fused_rope (one pass each way on the CPU) instead of apply_rope.
  TORCH_ARG(bool, fused_rope) = false;
  /// q, k and v projected as one autograd node (nn::forward_shared: one dX GEMM instead of
  /// three and two adds) where the three are dense.
  TORCH_ARG(bool, fused_projections) = false;
};

/// The attention pattern of one call, overriding the module's options: causal or not, and
/// which keys are real. One backbone then serves both GritLM modes (models/gritlm.hpp).
///   attn->forward(x, cos, sin, ckpt, memopt::nn::AttentionMask{false, attention});  // bidirectional, padded
struct AttentionMask {
  /// Empty: the module's options.causal().
  std::optional<bool> causal;
  /// (B, Tk) bool, true = a real token; undefined: every key is real.
  torch::Tensor key_padding;
};

/// LLaMA self-attention: q_proj (H·D, C), k_proj and v_proj (KV·D, C), o_proj (C, H·D), no
/// biases; RoPE on q and k.
class AttentionImpl : public torch::nn::Cloneable<AttentionImpl> {
 public:
  explicit AttentionImpl(AttentionOptions options) : options(options) { reset(); }

  void reset() override {
    const int64_t C = options.hidden_size(), H = options.num_heads(), KV = kv_heads();
    TORCH_CHECK(options.head_dim() > 0 || C % H == 0, "memopt::nn::Attention: hidden_size must be divisible by "
                "num_heads (got ", C, " and ", H, "). HINT: pick num_heads dividing hidden_size, or set head_dim.");
    TORCH_CHECK(options.head_dim() >= 0, "memopt::nn::Attention: head_dim must be >= 0 (got ", options.head_dim(),
                "). HINT: 0 means hidden_size / num_heads.");
    TORCH_CHECK(KV >= 1 && H % KV == 0, "memopt::nn::Attention: num_heads must be a multiple of num_kv_heads (got ",
                H, " and ", KV, "). HINT: num_kv_heads = 0 means num_heads.");
    TORCH_CHECK(options.kind() != AttentionKind::kBlockwise || options.dropout() == 0.0,
                "memopt::nn::Attention: the blockwise attention has no dropout (got dropout ", options.dropout(),
                "). HINT: use AttentionKind::kMath for attention dropout, or set dropout 0.");
    TORCH_CHECK(options.q_block() >= 1 && options.kv_block() >= 1,
                "memopt::nn::Attention: q_block and kv_block must be >= 1 (got ", options.q_block(), " and ",
                options.kv_block(), "). HINT: the defaults are ", kAttentionQBlock, " and ", kAttentionKvBlock, ".");
    const int64_t D = head_dim();
    q_proj = register_module("q_proj", nn::Linear(torch::nn::LinearOptions(C, H * D).bias(false)));
    k_proj = register_module("k_proj", nn::Linear(torch::nn::LinearOptions(C, KV * D).bias(false)));
    v_proj = register_module("v_proj", nn::Linear(torch::nn::LinearOptions(C, KV * D).bias(false)));
    o_proj = register_module("o_proj", nn::Linear(torch::nn::LinearOptions(H * D, C).bias(false)));
  }

  int64_t kv_heads() const { return options.num_kv_heads() > 0 ? options.num_kv_heads() : options.num_heads(); }
  int64_t head_dim() const {
    return options.head_dim() > 0 ? options.head_dim() : options.hidden_size() / options.num_heads();
  }

  /// x (B, T, C), cos/sin (T, D) -> (B, T, C)
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
    return forward(x, cos, sin, recompute::None{});
  }

  /// The same under a recompute policy: recompute::Selective recomputes the math path's
  /// scores and softmax in backward (the blockwise path keeps no (T, T) tensor anyway).
  template <RecomputePolicy Recompute>
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const Recompute& ckpt, const AttentionMask& mask = {}) {
    const int64_t B = x.size(0), T = x.size(1), H = options.num_heads(), KV = kv_heads();
    const bool causal = mask.causal.value_or(options.causal());
    const torch::Tensor key_padding = mask.key_padding;
    const int64_t D = head_dim();
    // q, k, v in this order (forward_shared keeps it: an adapter's dropout draws from the
    // generator in the order PEFT's LlamaAttention calls them).
    const auto qkv = forward_shared(x, {q_proj, k_proj, v_proj}, options.fused_projections());
    const auto q_raw = qkv[0].view({B, T, H, D});                // (B, T, H, D)
    const auto k_raw = qkv[1].view({B, T, KV, D});               // (B, T, KV, D)
    const auto v = qkv[2].view({B, T, KV, D}).transpose(1, 2);  // (B, KV, T, D)
    const auto [q, k] = rotate(q_raw, k_raw, cos, sin);            // (B, H, T, D), (B, KV, T, D)
    torch::Tensor y;  // (B, H, T, D)
    if (options.kind() == AttentionKind::kBlockwise) {
      auto blockwise = BlockwiseAttentionOptions().causal(causal).key_padding_mask(key_padding);
      y = attention_blockwise(q, k, v, blockwise.q_block(options.q_block()).kv_block(options.kv_block()));
    } else if (options.kind() == AttentionKind::kSdpa) {
      y = attention_sdpa(q, k, v, causal, options.dropout(), is_training(), key_padding);
    } else if (options.kind() == AttentionKind::kFlash) {
      y = attention_flash(q, k, v, causal, options.dropout(), is_training(), key_padding);
    } else if (options.kind() == AttentionKind::kAuto) {
      y = attention_auto(q, k, v, causal, options.dropout(), is_training(), key_padding, options.q_block(),
                         options.kv_block());
    } else {
      const bool training = is_training();
      const double dropout = options.dropout();
      const int64_t n_rep = H / KV;
      y = run_cheap(ckpt, [=](const std::vector<torch::Tensor>& in) {
        return attention_math(in[0], repeat_kv(in[1], n_rep), repeat_kv(in[2], n_rep), causal, dropout, training,
                              key_padding);
      }, {q, k, v});
    }
    return o_proj(y.transpose(1, 2).reshape({B, T, H * D}));  // (B, T, C)
  }

  AttentionOptions options;
  nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};

 private:
  // RoPE on q (B, T, H, D) and k (B, T, KV, D) -> (B, H, T, D), (B, KV, T, D).
  std::pair<torch::Tensor, torch::Tensor> rotate(const torch::Tensor& q, const torch::Tensor& k,
                                                 const torch::Tensor& cos, const torch::Tensor& sin) const {
    return options.fused_rope() ? fused_rope(q, k, cos, sin) : apply_rope_qk(q, k, cos, sin);
  }
};
TORCH_MODULE(Attention);

}  // namespace memopt::nn
