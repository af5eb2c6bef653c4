// memopt/nn/fused_add_norm.hpp — a LLaMA block's middle: the residual add (with the branch's
// dropout) and the RMSNorm after it, one autograd node, one pass over the rows each way:
//   h = x + dropout(r, p)          the residual stream, returned (the next add reads it)
//   y = w · H(h · rstd)            rstd = 1 / sqrt(mean(h²) + eps) in fp32, H = h's dtype (y in
//                                  promote(h, w), or rounded once to a dtype asked for: bf16 under
//                                  autocast in LLaMA's blocks, nn::RMSNormOptions::autocast_output)
// Backward: g = dh + RMSNorm's dx (what autograd sums for h), dx = g, dr = mask · g / (1 − p).
// The composite (x + torch::dropout(r), then nn::RMSNorm) runs the add, the norm and autograd's
// sum of h's two gradients as separate passes; here h is read once more than written, in cache.
// It keeps h and one fp32 rstd per row (as the fused RMSNorm alone does) and no mask: the
// dropout's mask comes from nn/fused_dropout.hpp's counter-based hash of one seed, regenerated in
// backward. Same roundings as the ATen composite: dropout(r) rounded to r's dtype, the sum to
// h's (the promoted type: fp32 for autocast's fp32 residual stream and bf16 branch), the norm
// as nn/fused.hpp's (fp32 within 1e-6 of the largest entry; bf16 where the composite rounds).
// Contiguous fp32/bf16 CPU tensors, x and r of one shape; otherwise the composite with
// nn/fused_dropout.hpp's and nn/fused.hpp's kernels (each falls back in turn).
//   auto [h, y] = memopt::nn::fused_add_rms_norm(x, attn_out, norm->weight, 1e-5, 0.1, is_training());
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "memopt/detail/parallel.hpp"
#include "memopt/nn/fused.hpp"
#include "memopt/nn/fused_dropout.hpp"

namespace memopt::detail::fused {

// Rows [begin, end) of (rows, C): h = H(x + R(r · mask)), y = O(w · H(h · rstd)).
template <class X, class R, class H, class W, class O>
MEMOPT_FUSED_CLONES void add_rms_norm_forward_rows(const X* x, const R* r, const W* w, H* h, O* y, float* rstd,
                                                   DropoutMask mask, bool drop, int64_t begin, int64_t end, int64_t C,
                                                   float eps) {
  for (int64_t row = begin; row < end; ++row) {
    const X* xr = x + row * C;
    const R* rr = r + row * C;
    H* hr = h + row * C;
    if (drop) {
      for (int64_t j = 0; j < C; ++j)
        hr[j] = from_float<H>(to_float(xr[j]) + round_to<R>(to_float(rr[j]) * mask.factor(row * C + j)));
    } else {
      for (int64_t j = 0; j < C; ++j) hr[j] = from_float<H>(to_float(xr[j]) + to_float(rr[j]));
    }
    const float ss = lane_sum(C, [hr](int64_t j) {
      const float v = to_float(hr[j]);
      return v * v;
    });
    const float s = 1.f / std::sqrt(ss / static_cast<float>(C) + eps);
    rstd[row] = s;
    O* yr = y + row * C;
    for (int64_t j = 0; j < C; ++j) yr[j] = from_float<O>(to_float(w[j]) * round_to<H>(to_float(hr[j]) * s));
  }
}

// g = H(dh + H(RMSNorm's dx)); dx = X(g); dr = R(R(g) · mask). dw += Σ_rows dy · H(h · rstd).
// gn: C floats of scratch.
template <class X, class R, class H, class W, class O>
MEMOPT_FUSED_CLONES void add_rms_norm_backward_rows(const H* dh, const O* dy, const H* h, const W* w,
                                                    const float* rstd, X* dx, R* dr, float* dw, float* gn,
                                                    DropoutMask mask, bool drop, int64_t begin, int64_t end,
                                                    int64_t C) {
  for (int64_t row = begin; row < end; ++row) {
    const O* dyr = dy + row * C;
    const H* hr = h + row * C;
    const H* dhr = dh + row * C;
    const float s = rstd[row];
    for (int64_t j = 0; j < C; ++j) {
      const float d = to_float(dyr[j]);
      gn[j] = round_to<H>(round_to<Promoted<H, W>>(d * to_float(w[j])));  // the product's rounding, not y's
      dw[j] += d * round_to<H>(to_float(hr[j]) * s);
    }
    const float mean = lane_sum(C, [&](int64_t j) { return gn[j] * to_float(hr[j]) * s; }) / static_cast<float>(C);
    X* dxr = dx + row * C;
    R* drr = dr + row * C;
    for (int64_t j = 0; j < C; ++j) {  // gn becomes g, in place
      const float hv = to_float(hr[j]);
      gn[j] = round_to<H>(to_float(dhr[j]) + round_to<H>(s * (gn[j] - hv * s * mean)));
      dxr[j] = from_float<X>(gn[j]);
    }
    // Separate loops, so each vectorises (a select between the two does not).
    if (drr == reinterpret_cast<R*>(dxr)) continue;  // dr is dx (no dropout, one dtype): written
    if (drop) {
      for (int64_t j = 0; j < C; ++j) drr[j] = from_float<R>(round_to<R>(gn[j]) * mask.factor(row * C + j));
    } else {
      for (int64_t j = 0; j < C; ++j) drr[j] = from_float<R>(gn[j]);
    }
  }
}

class AddRmsNormFunction : public torch::autograd::Function<AddRmsNormFunction> {
 public:
  // p 0: no dropout; y_type_or_promote: y's dtype (fp32 or bf16), -1: promote(h, w). Returns {h, y}.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                                                const torch::Tensor& r, const torch::Tensor& w, double eps, double p,
                                                int64_t y_type_or_promote) {
    const int64_t C = x.size(-1), rows = x.numel() / std::max<int64_t>(C, 1);
    const auto h_type = at::promote_types(x.scalar_type(), r.scalar_type());
    const auto y_type = y_type_or_promote < 0 ? at::promote_types(h_type, w.scalar_type())
                                              : static_cast<c10::ScalarType>(y_type_or_promote);
    auto h = torch::empty(x.sizes(), x.options().dtype(h_type));
    auto y = torch::empty(x.sizes(), x.options().dtype(y_type));
    auto rstd = torch::empty({rows}, x.options().dtype(torch::kFloat));
    const bool drop = p > 0;
    const auto mask = drop ? DropoutMask::draw(p) : DropoutMask{};
    const auto x_type = x.scalar_type(), r_type = r.scalar_type(), w_type = w.scalar_type();
    with_types(x_type, r_type, w_type, y_type, [&](auto* xt, auto* rt, auto* wt, auto* ot) {
      using X = std::remove_pointer_t<decltype(xt)>;
      using R = std::remove_pointer_t<decltype(rt)>;
      using W = std::remove_pointer_t<decltype(wt)>;
      using H = Promoted<X, R>;
      using O = std::remove_pointer_t<decltype(ot)>;
      const X* xp = x.data_ptr<X>();
      const R* rp = r.data_ptr<R>();
      const W* wp = w.data_ptr<W>();
      H* hp = h.data_ptr<H>();
      O* yp = y.data_ptr<O>();
      float* sp = rstd.data_ptr<float>();
      parallel_chunks(rows, grain_rows(C), [&](int64_t begin, int64_t end, int64_t) {
        add_rms_norm_forward_rows(xp, rp, wp, hp, yp, sp, mask, drop, begin, end, C, static_cast<float>(eps));
      });
    });
    ctx->save_for_backward({h, w, rstd});
    ctx->saved_data["x_type"] = static_cast<int64_t>(x_type);
    ctx->saved_data["r_type"] = static_cast<int64_t>(r_type);
    ctx->saved_data["y_type"] = static_cast<int64_t>(y_type);
    ctx->saved_data["drop"] = drop;
    mask.save(ctx);
    return {h, y};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &h = saved[0], &w = saved[1], &rstd = saved[2];
    const int64_t C = h.size(-1), rows = h.numel() / std::max<int64_t>(C, 1);
    const auto dh = grads[0].defined() ? grads[0].to(h.scalar_type()).contiguous() : torch::zeros_like(h);
    const auto y_type = static_cast<c10::ScalarType>(ctx->saved_data["y_type"].toInt());
    const auto dy = grads[1].defined() ? grads[1].to(y_type).contiguous()
                                       : torch::zeros(h.sizes(), h.options().dtype(y_type));
    const auto x_type = static_cast<c10::ScalarType>(ctx->saved_data["x_type"].toInt());
    const auto r_type = static_cast<c10::ScalarType>(ctx->saved_data["r_type"].toInt());
    const bool drop = ctx->saved_data["drop"].toBool();
    const auto mask = DropoutMask::load(ctx);
    auto dx = torch::empty(h.sizes(), h.options().dtype(x_type));
    // Without dropout dr = dx where the dtypes agree: one tensor for both (h is still alive here).
    const bool shared = !drop && x_type == r_type;
    auto dr = shared ? dx : torch::empty(h.sizes(), h.options().dtype(r_type));
    auto dw = torch::zeros({C}, w.options().dtype(torch::kFloat));
    with_types(x_type, r_type, w.scalar_type(), y_type, [&](auto* xt, auto* rt, auto* wt, auto* ot) {
      using X = std::remove_pointer_t<decltype(xt)>;
      using R = std::remove_pointer_t<decltype(rt)>;
      using W = std::remove_pointer_t<decltype(wt)>;
      using H = Promoted<X, R>;
      using O = std::remove_pointer_t<decltype(ot)>;
      const H* dhp = dh.data_ptr<H>();
      const O* dyp = dy.data_ptr<O>();
      const H* hp = h.data_ptr<H>();
      const W* wp = w.data_ptr<W>();
      const float* sp = rstd.data_ptr<float>();
      X* dxp = dx.data_ptr<X>();
      R* drp = dr.data_ptr<R>();
      rows_with_weight_grad(rows, C, dw.data_ptr<float>(), [&](int64_t begin, int64_t end, float* dw_part, float* gn) {
        add_rms_norm_backward_rows(dhp, dyp, hp, wp, sp, dxp, drp, dw_part, gn, mask, drop, begin, end, C);
      });
    });
    return {dx, dr, dw.to(w.scalar_type()), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace memopt::detail::fused

namespace memopt::nn {

/// h = x + dropout(r, p) (x + r outside training or at p 0) and y = RMSNorm(h) with weight w
/// (see the file comment): one node for contiguous fp32/bf16 CPU x and r of one shape and a
/// fp32/bf16 w (C); otherwise fused_dropout_add and fused_rms_norm. x, r (..., C) -> {h, y}, y
/// in promote(h, w) or in `y_dtype` (fp32 or bf16: the fp32 result rounded once).
inline std::pair<torch::Tensor, torch::Tensor> fused_add_rms_norm(
    const torch::Tensor& x, const torch::Tensor& r, const torch::Tensor& w, double eps, double p, bool training,
    std::optional<c10::ScalarType> y_dtype = std::nullopt) {
  TORCH_CHECK(p >= 0 && p < 1, "memopt::nn::fused_add_rms_norm: p must be in [0, 1) (got ", p,
              "). HINT: dropout 0 turns it off.");
  namespace f = memopt::detail::fused;
  const bool kernel = f::kernel_tensor(x) && f::kernel_tensor(r) && f::kernel_tensor(w) && x.sizes() == r.sizes() &&
                      x.dim() >= 1 && w.dim() == 1 && x.size(-1) == w.size(0) &&
                      (!y_dtype || f::kernel_dtype(*y_dtype));
  if (!kernel) {
    auto h = fused_dropout_add(x, r, p, training);
    return {h, fused_rms_norm(h, w, eps, y_dtype)};
  }
  const auto out = f::AddRmsNormFunction::apply(x, r, w, eps, training ? p : 0.0,
                                                y_dtype ? static_cast<int64_t>(*y_dtype) : int64_t{-1});
  return {out[0], out[1]};
}

/// The ATen composite it replaces: x + torch::dropout(r, p), then nn/rmsnorm.hpp's formula.
inline std::pair<torch::Tensor, torch::Tensor> add_rms_norm_composite(const torch::Tensor& x, const torch::Tensor& r,
                                                                      const torch::Tensor& w, double eps, double p,
                                                                      bool training) {
  auto h = x + torch::dropout(r, p, training);
  return {h, rms_norm_composite(h, w, eps)};
}

}  // namespace memopt::nn
