// memopt/nn/linear_unread.hpp — a Linear's autograd node without its product, for an output
// whose value nobody reads: a checkpointed block's output in the block's recompute, which is
// only the root of the block's backward (memopt::detail::replaying()). The linear's backward
// reads x and W, never y, so the recompute can skip the GEMM that makes y: PyTorch's
// non-reentrant checkpoint gets the same by stopping its recompute once the last tensor
// backward needs is saved. In LLaMA's block that is the MLP's down projection, about a fifth
// of the recompute's FLOPs (nn::SwiGLU's forward with `to_block_output`).
//   y = memopt::nn::linear_unread(x, w, b);  // (..., in) -> (..., out), y uninitialised
// Gradients: dx = dy·W, dW = dyᵀ·x (nn/linear_shared.hpp's weight_grad; db = Σ dy through an
// add), as torch::linear's backward (the same products; summation order may differ). Under
// autocast the operands are cast as autocast casts linear's (the same cached casts), so the
// gradients keep their dtypes and casts.
#pragma once

#include <vector>

#include <torch/torch.h>

#include "memopt/detail/autocast.hpp"
#include "memopt/nn/linear_shared.hpp"

namespace memopt::nn::detail {

class LinearUnreadFunction : public torch::autograd::Function<LinearUnreadFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w) {
    ctx->save_for_backward({x, w});
    auto sizes = x.sizes().vec();
    sizes.back() = w.size(0);
    return torch::empty(sizes, x.options());  // (..., out): never read
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &w = saved[1];
    const auto dy = grads[0].reshape({-1, w.size(0)});  // (N, out)
    torch::Tensor dx, dw;
    if (ctx->needs_input_grad(0)) dx = dy.mm(w).view(x.sizes());                // (..., in)
    torch::Tensor xt;  // weight_grad's xᵀ
    if (ctx->needs_input_grad(1)) dw = weight_grad(dy, x.reshape({-1, w.size(1)}), xt);  // (out, in)
    return {dx, dw};
  }
};

}  // namespace memopt::nn::detail

namespace memopt::nn {

/// x·Wᵀ + b as an autograd node whose output is left uninitialised: for a value only
/// backpropagated through, never read (see the file comment). Autocast's casts are applied as
/// for torch::linear; operands of mixed dtypes outside autocast run torch::linear.
inline torch::Tensor linear_unread(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b = {}) {
  const auto autocast = memopt::detail::AutocastState::current(x.device().type());
  const auto xc = autocast.cast(x), wc = autocast.cast(w), bc = autocast.cast(b);
  const bool one_dtype =
      xc.scalar_type() == wc.scalar_type() && (!bc.defined() || bc.scalar_type() == wc.scalar_type());
  if (!one_dtype || x.dim() == 0) return torch::linear(x, w, b);
  auto y = detail::LinearUnreadFunction::apply(xc, wc);  // (..., out)
  return bc.defined() ? y + bc : y;                      // a bias: autograd's add gives db = Σ dy
}

}  // namespace memopt::nn
