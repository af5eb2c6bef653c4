// memopt/nn/linear_shared.hpp — Linear layers that read the same input (a block's q, k and v
// projections; SwiGLU's gate and up) as one autograd node. Apart, each layer's backward makes
// its own (N, in) dX and autograd adds them, a pass over memory per extra layer; here dX is one
// GEMM and the others accumulate into it (addmm_, beta 1), and x is saved once:
//   dX = dY_1·W_1 + dY_2·W_2 + …,   dW_i = dY_iᵀ·x
// On the 8 × d512 trainer shape (4096 rows, 2 AMX cores) q, k, v's dX took 17.2 ms against
// 21.5 ms apart in fp32 (gate, up: 30.1 against 31.7), 2.1 against 2.7 ms in bf16. The same
// products as torch::linear's backward; only dX's summation order differs.
//   auto y = memopt::nn::linear_shared_input(x, {wq, wk, wv});  // (..., in) -> 3 × (..., out_i)
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include <ATen/native/CPUBlas.h>
#include <torch/torch.h>

#include "memopt/detail/autocast.hpp"
#include "memopt/detail/cpublas.hpp"
#include "memopt/detail/transpose.hpp"

namespace memopt::nn::detail {

/// The smallest of a weight's two sides for which weight_grad transposes an operand first.
inline constexpr int64_t kTransposedGradMin = 512;

/// dW = dyᵀ·x (out, in) for dy (N, out) and x (N, in): the product torch::linear's backward
/// takes. oneDNN's bf16 GEMM on AMX runs it, its first operand a transposed view, at
/// 1300–1500 GFLOP/s against ~2500 with both operands row-major (N = 4096 rows, 2 threads), so
/// in bf16 there the smaller of the two is transposed first: x when out > in (dWᵀ = xᵀ·dy, then
/// dWᵀ transposed back; xᵀ is made once into `xt` for every weight sharing x), dy when out < in.
/// On the 8 × d512 trainer shape: gate, up 4.4 -> 2.7 ms each (+0.6 for xᵀ), down 3.8 -> 3.2
/// (dyᵀ included), the 4096-wide head 14.7 -> 10.3; q, k, v (out = in) keep the view (1.3 ms;
/// 1.8 through xᵀ). At d256 (N = 2048) the gains were ±0.1 ms and the head lost (3.9 -> 5.1), so
/// both sides must reach kTransposedGradMin. Exact transposes: the same products, rounded once;
/// only the summation order may differ.
inline torch::Tensor weight_grad(const torch::Tensor& dy, const torch::Tensor& x, torch::Tensor& xt) {
  const int64_t out = dy.size(1), in = x.size(1);
  if (dy.scalar_type() != at::kBFloat16 || !dy.device().is_cpu() || out == in ||
      std::min(out, in) < kTransposedGradMin || !memopt::detail::bf16_tiles())
    return dy.t().mm(x);
  if (out < in) return memopt::detail::transposed_copy(dy).mm(x);
  if (!xt.defined()) xt = memopt::detail::transposed_copy(x);  // (in, N)
  return memopt::detail::transposed_copy(xt.mm(dy));          // (in, out) -> (out, in)
}

class SharedInputLinearFunction : public torch::autograd::Function<SharedInputLinearFunction> {
 public:
  // weights as a TensorList: apply() takes each of its tensors as an input of the node.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                                                at::TensorList weights) {
    ctx->set_materialize_grads(false);  // an output no loss reached: no dW, no dX term
    torch::autograd::variable_list saved{x};
    saved.insert(saved.end(), weights.begin(), weights.end());
    ctx->save_for_backward(saved);
    torch::autograd::variable_list y;
    for (const auto& w : weights) y.push_back(torch::linear(x, w));  // (..., out_i)
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& x = saved[0];
    const auto rows = x.reshape({-1, x.size(-1)});  // (N, in)
    torch::Tensor dx;                                // (N, in)
    torch::Tensor xt;                                // (in, N): weight_grad's xᵀ, made once
    torch::autograd::variable_list out{torch::Tensor()};
    for (size_t i = 0; i < grads.size(); ++i) {
      const auto& w = saved[i + 1];
      if (!grads[i].defined()) {  // an output no loss reached
        out.emplace_back();
        continue;
      }
      const auto dy = grads[i].reshape({-1, w.size(0)});  // (N, out_i)
      if (ctx->needs_input_grad(0)) dx = dx.defined() ? dx.addmm_(dy, w) : dy.mm(w);
      out.push_back(ctx->needs_input_grad(i + 1) ? weight_grad(dy, rows, xt) : torch::Tensor());  // (out_i, in)
    }
    if (dx.defined()) out[0] = dx.view(x.sizes());
    return out;
  }
};

}  // namespace memopt::nn::detail

namespace memopt::nn {

/// x·W_iᵀ (+ b_i) for each weight, as one autograd node (see the file comment); biases, when
/// given (one per weight, or none), are added outside it, so autograd's add gives db. Under
/// autocast x and the weights are cast as autocast casts linear's (its cached casts); operands
/// of mixed dtypes outside autocast run torch::linear per weight.
inline std::vector<torch::Tensor> linear_shared_input(const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                                                      const std::vector<torch::Tensor>& biases = {}) {
  TORCH_CHECK(!weights.empty() && (biases.empty() || biases.size() == weights.size()),
              "memopt::nn::linear_shared_input: one or more weights and a bias for each or none (got ", weights.size(),
              " weights, ", biases.size(), " biases). HINT: pass {} for bias-free layers.");
  const auto autocast = memopt::detail::AutocastState::current(x.device().type());
  const auto xc = autocast.cast(x);
  std::vector<torch::Tensor> wc;
  bool one_dtype = x.dim() > 0;
  for (const auto& w : weights) {
    wc.push_back(autocast.cast(w));
    one_dtype = one_dtype && wc.back().scalar_type() == xc.scalar_type() && w.dim() == 2;
  }
  std::vector<torch::Tensor> y;
  if (!one_dtype) {
    for (size_t i = 0; i < weights.size(); ++i)
      y.push_back(torch::linear(x, weights[i], biases.empty() ? torch::Tensor() : biases[i]));
    return y;
  }
  y = detail::SharedInputLinearFunction::apply(xc, at::TensorList(wc));  // (..., out_i) each
  for (size_t i = 0; i < biases.size(); ++i)
    if (biases[i].defined()) y[i] = y[i] + autocast.cast(biases[i]);
  return y;
}

}  // namespace memopt::nn
