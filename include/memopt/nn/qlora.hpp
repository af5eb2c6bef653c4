// memopt/nn/qlora.hpp — QLoRA (Dettmers et al., 2023): a LoRA adapter over a frozen base weight
// held in NF4 (memopt/nn/nf4.hpp, 0.516 B/param with double quantisation instead of 2 or 4).
// nf4_linear is the base's matmul as an autograd Function: it dequantises the weight for the
// forward and again for the backward, each time freed on return, and saves only the 4-bit codes
// and scales, never x or a dense weight, since the frozen weight needs no dW. On the CPU it
// dequantises kNf4TileBytes at a time (rows of the weight forward, columns backward), so no
// dense copy of a weight larger than that exists at any moment.
// A quantised memopt::nn::Linear (memopt/nn/linear.hpp) runs it, with a LoRA adapter on top.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include <torch/torch.h>

#include "memopt/detail/autocast.hpp"
#include "memopt/nn/nf4.hpp"

namespace memopt::nn {

/// Bytes of dequantised weight nf4_linear makes at a time on the CPU (rows of the (out, in)
/// weight forward, columns backward); 0: the whole weight at once. 4 MiB: as fast as the whole
/// weight within the noise (0.8-1.0x its time, forward + dX, fp32 and bf16 on a 2-core AVX2
/// EPYC) at 0.19-0.26x its peak for a 7B model's 11008 x 4096 projection; tiles of 1 MiB and
/// less cost 1.15-2.8x the time, the products too narrow for the GEMM (`scripts/bench fused`).
inline constexpr int64_t kNf4TileBytes = int64_t{4} << 20;

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

/// Rows (forward) or columns (backward) of w that nf4_linear dequantises at a time, `lines` of
/// `line_elements` each: 0 (the whole weight at once) off the CPU, for tile_bytes 0, and where
/// one tile would hold them all; else ⌈tile_bytes / line bytes⌉.
inline int64_t nf4_tile_lines(const Nf4Tensor& w, torch::ScalarType dtype, const torch::Device& device,
                              int64_t tile_bytes, int64_t lines, int64_t line_elements) {
  if (!device.is_cpu() || tile_bytes <= 0 || !w.packed.is_contiguous()) return 0;
  const int64_t line_bytes = line_elements * static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t n = std::max<int64_t>(1, (tile_bytes + line_bytes - 1) / line_bytes);
  return n >= lines ? 0 : n;
}

/// a (..., K) · B -> (..., N), B (K, N) made `cols` columns at a time by block(n0, t) -> (K, t),
/// so no more of B than a block exists at once. torch::mm, not mm_out: bf16_gemm (bf16 on CPUs
/// without bf16 units) replaces mm's kernel, not mm.out's.
template <class Block>
torch::Tensor matmul_by_column_blocks(const torch::Tensor& a, int64_t N, int64_t cols, const Block& block) {
  const torch::Tensor a2 = a.reshape({-1, a.size(-1)});           // (M, K)
  torch::Tensor y = torch::empty({a2.size(0), N}, a2.options());  // (M, N)
  for (int64_t n0 = 0; n0 < N; n0 += cols) {
    const int64_t t = std::min(cols, N - n0);
    y.narrow(1, n0, t).copy_(torch::mm(a2, block(n0, t)));  // (M, t)
  }
  auto shape = a.sizes().vec();
  shape.back() = N;
  return y.view(shape);  // (..., N)
}

/// y = x · deq(w)ᵀ + b with dX = dY · deq(w) and no gradient for w or b. Saved for backward:
/// w's packed codes and scales (references to the tensors the caller holds, no copy) and its
/// metadata; the dense (out, in) weight lives only inside forward() and inside backward().
struct Nf4LinearFunction : torch::autograd::Function<Nf4LinearFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const std::optional<torch::Tensor>& bias,  // none: no bias (not an input then)
                               const Nf4Tensor& w, int64_t tile_bytes) {  // (..., in) -> (..., out)
    const torch::ScalarType dtype = nf4_compute_dtype(x);
    ctx->save_for_backward({w.packed, w.absmax, w.absmax_quant.codes, w.absmax_quant.absmax, w.absmax_offset});
    ctx->saved_data["shape"] = w.shape;
    ctx->saved_data["dtype"] = static_cast<int64_t>(w.dtype);
    ctx->saved_data["blocksize"] = w.blocksize;
    ctx->saved_data["numel"] = w.numel;
    ctx->saved_data["compute_dtype"] = static_cast<int64_t>(dtype);
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["tile_bytes"] = tile_bytes;
    memopt::detail::AutocastGuard no_autocast(nf4_autocast_off(x.device().type()));
    const auto b = bias ? std::optional<torch::Tensor>(bias->to(dtype)) : std::nullopt;
    const int64_t out = w.shape[0], in = w.shape[1];
    const int64_t rows = nf4_tile_lines(w, dtype, x.device(), tile_bytes, out, in);
    if (rows == 0) return torch::linear(x.to(dtype), w.dequantize(dtype), b);  // (out, in) freed on return
    const torch::Tensor scale = w.block_absmax().contiguous();
    torch::Tensor y = matmul_by_column_blocks(x.to(dtype), out, rows, [&](int64_t o0, int64_t t) {
      return nn::detail::dequantize_nf4_cpu(w, scale, o0 * in, in, t, in, dtype).t();  // rows of w: (in, t)
    });  // (..., out)
    if (b) y.add_(*b);
    return y;
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
      const auto x_dtype = static_cast<torch::ScalarType>(ctx->saved_data["x_dtype"].toInt());
      const int64_t out = w.shape[0], in = w.shape[1];
      const int64_t cols = nf4_tile_lines(w, dtype, dy.device(), ctx->saved_data["tile_bytes"].toInt(), in, out);
      if (cols == 0) {
        dx = dy.to(dtype).matmul(w.dequantize(dtype)).to(x_dtype);  // (out, in) freed on return
      } else {  // tiled: columns of w, each a block of dx's columns
        const torch::Tensor scale = w.block_absmax().contiguous();
        dx = matmul_by_column_blocks(dy.to(dtype), in, cols, [&](int64_t i0, int64_t t) {
               return nn::detail::dequantize_nf4_cpu(w, scale, i0, in, out, t, dtype);  // columns of w: (out, t)
             }).to(x_dtype);
      }
    }
    return {dx, torch::Tensor(), torch::Tensor(), torch::Tensor()};  // x, bias (frozen), w, tile_bytes
  }
};

}  // namespace detail

/// x · deq(w)ᵀ + bias for an (out, in) NF4 weight w, in autocast's dtype when autocast is on
/// for x's device, else in x's (w is dequantised to it, bias cast to it). Gradient for x only:
/// the weight is frozen, and a bias must be too (requires_grad false, or detached). Saves w's codes and scales
/// for backward, not x and no dense weight: backward dequantises w again, freed after. On the
/// CPU, tile_bytes of dense weight at a time (0: the whole weight at once).
///   memopt::nn::Nf4Tensor w = memopt::nn::quantize_nf4(linear->weight);
///   torch::Tensor y = memopt::nn::nf4_linear(x, w, linear->bias.detach());   // (B, T, in) -> (B, T, out)
inline torch::Tensor nf4_linear(const torch::Tensor& x, const Nf4Tensor& w, const torch::Tensor& bias = {},
                                int64_t tile_bytes = kNf4TileBytes) {
  const char* who = "memopt::nn::nf4_linear";
  TORCH_CHECK(w.shape.size() == 2 && w.packed.defined(), who,
              ": w must be a quantised 2-d (out, in) weight (got shape ", c10::IntArrayRef(w.shape),
              "). HINT: pass quantize_nf4(linear->weight), or a quantised memopt::nn::Linear's nf4().");
  const int64_t out = w.shape[0], in = w.shape[1];
  TORCH_CHECK(x.defined() && x.is_floating_point(), who, ": x must be a floating-point tensor (got ",
              x.defined() ? c10::toString(x.scalar_type()) : "undefined", "). HINT: the weight is dequantised to x's "
              "dtype (or autocast's); cast x with .to(torch::kFloat) or .to(torch::kBFloat16).");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in, who, ": x must be (..., in = ", in, ") for a weight of shape (", out,
              ", ", in, ") (got ", x.sizes(), "). HINT: the last dimension of x is the layer's input features.");
  TORCH_CHECK(x.device() == w.packed.device(), who, ": x is on ", x.device(), " but w on ", w.packed.device(),
              ". HINT: move the layer (memopt::nn::Linear's ->to(device) moves its NF4 buffers) or x.");
  if (bias.defined()) {
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == out, who, ": bias must be (out = ", out, ") (got ", bias.sizes(),
                "). HINT: pass the base Linear's bias, or none.");
    TORCH_CHECK(!bias.requires_grad(), who, ": bias requires grad, but nf4_linear returns none for it (QLoRA's base "
                "is frozen). HINT: freeze it with bias.requires_grad_(false), or add a trainable bias outside.");
  }
  // An undefined Tensor argument would count as an input without a device; an empty optional does not.
  TORCH_CHECK(tile_bytes >= 0, who, ": tile_bytes must be >= 0 (got ", tile_bytes,
              "). HINT: 0 dequantises the whole weight at once; kNf4TileBytes is the default.");
  return detail::Nf4LinearFunction::apply(x, bias.defined() ? std::optional<torch::Tensor>(bias) : std::nullopt, w,
                                          tile_bytes);
}

}  // namespace memopt::nn
