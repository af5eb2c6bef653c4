// memopt/nn/cross_entropy.hpp — the output projection fused with cross-entropy, over row
// chunks: the sum of CE(hidden Wᵀ, targets) without ever holding the (N, V) logits.
// Forward keeps one log-sum-exp per row; backward recomputes a chunk's logits and forms
// dHidden and dWeight chunk by chunk. Logits in the matmul dtype (autocast's when it is
// on), softmax and loss in fp32, dWeight accumulated in fp32.
#pragma once

#include <algorithm>
#include <cstdint>

#include <torch/torch.h>

#include "memopt/batch.hpp"
#include "memopt/detail/autocast.hpp"
#include "memopt/detail/deferred_checks.hpp"
#include "memopt/detail/parallel.hpp"
#include "memopt/nn/fused.hpp"

namespace memopt::nn {

/// Default rows per chunk of chunked_cross_entropy_sum: (1024, V) fp32 logits at a time
/// (125 MiB at V = 32000). Measured in benchmarks/nn/attention_bench.cpp.
inline constexpr int64_t kCrossEntropyChunk = 1024;

/// Options of chunked_cross_entropy_sum.  memopt::nn::ChunkedCrossEntropyOptions().chunk_size(512)
struct ChunkedCrossEntropyOptions {
  /// Rows of logits computed at a time.
  TORCH_ARG(int64_t, chunk_size) = kCrossEntropyChunk;
  /// Targets equal to this take no loss (and give no gradient).
  TORCH_ARG(int64_t, ignore_index) = kIgnoreIndex;
  /// The chunk's log-sum-exp and softmax gradient as fused CPU row kernels (one read pass
  /// forward after the max, one read-write pass backward) instead of ATen's four and five.
  TORCH_ARG(bool, fused) = false;
};

}  // namespace memopt::nn

namespace memopt::detail {

namespace fused {

// lse[r] = log Σ_j exp(l[r, j] − m) + m with m the row's max; l (rows, V) fp32.
MEMOPT_FUSED_CLONES inline void log_sum_exp_rows(const float* l, float* lse, int64_t begin, int64_t end, int64_t V) {
  for (int64_t r = begin; r < end; ++r) {
    const float* row = l + r * V;
    float acc[kLanes];
    for (int64_t k = 0; k < kLanes; ++k) acc[k] = row[std::min<int64_t>(k, V - 1)];
    int64_t j = 0;
    for (; j + kLanes <= V; j += kLanes)
      for (int64_t k = 0; k < kLanes; ++k) acc[k] = acc[k] > row[j + k] ? acc[k] : row[j + k];
    float m = acc[0];
    for (int64_t k = 1; k < kLanes; ++k) m = m > acc[k] ? m : acc[k];
    for (; j < V; ++j) m = m > row[j] ? m : row[j];
    lse[r] = std::log(lane_sum(V, [row, m](int64_t i) { return fused::exp(row[i] - m); })) + m;
  }
}

// In place: l[r, j] ← g · (exp(l[r, j] − lse[r]) − [j = t[r]]), 0 on rows whose target is ignored.
MEMOPT_FUSED_CLONES inline void softmax_grad_rows(float* l, const float* lse, const int64_t* t, float g,
                                                  int64_t ignore_index, int64_t begin, int64_t end, int64_t V) {
  for (int64_t r = begin; r < end; ++r) {
    float* row = l + r * V;
    if (t[r] == ignore_index) {
      std::fill(row, row + V, 0.f);
      continue;
    }
    const float s = lse[r];
    for (int64_t j = 0; j < V; ++j) row[j] = g * fused::exp(row[j] - s);
    row[t[r]] -= g;
  }
}

}  // namespace fused

// chunked_cross_entropy_sum's autograd Function: hidden (N, C) and weight (V, C) in their
// own dtypes, the matmuls in `dtype`; saves the inputs and the fp32 log-sum-exp (N).
struct ChunkedCrossEntropyFunction : torch::autograd::Function<ChunkedCrossEntropyFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& hidden,
                               const torch::Tensor& weight, const torch::Tensor& targets, int64_t dtype,
                               int64_t chunk, int64_t ignore_index, bool fused) {
    AutocastGuard no_autocast(without_autocast(hidden.device().type()));
    const auto ct = static_cast<c10::ScalarType>(dtype);
    const int64_t N = hidden.size(0), V = weight.size(0);
    const auto f32 = hidden.options().dtype(torch::kFloat);
    const auto w = weight.to(ct);                            // (V, C)
    auto lse = torch::empty({N}, f32);                       // (N) log-sum-exp of each row's logits
    auto total = torch::zeros({}, f32.dtype(torch::kDouble));
    Buffers buf(std::min(chunk, N), V, hidden.options(), ct);
    for (int64_t r0 = 0; r0 < N; r0 += chunk) {
      const int64_t n = std::min(chunk, N - r0);
      auto logits = buf.logits(hidden.narrow(0, r0, n).to(ct), w);  // (n, V) fp32
      const auto t = targets.narrow(0, r0, n);
      const auto ignored = t.eq(ignore_index);
      const auto picked = logits.gather(1, t.masked_fill(ignored, 0).unsqueeze(1)).squeeze(1);  // (n)
      auto lse_c = lse.narrow(0, r0, n);
      if (fused) {
        parallel_chunks(n, fused::grain_rows(V), [&](int64_t begin, int64_t end, int64_t) {
          fused::log_sum_exp_rows(logits.data_ptr<float>(), lse_c.data_ptr<float>(), begin, end, V);
        });
      } else {
        const auto max = logits.amax(1, /*keepdim=*/true);  // (n, 1)
        lse_c.copy_(logits.sub_(max).exp_().sum(1).log_().add_(max.squeeze(1)));
      }
      total.add_((lse_c - picked).masked_fill_(ignored, 0.0).sum(torch::kDouble));
    }
    ctx->save_for_backward({hidden, weight, targets, lse});
    ctx->saved_data["dtype"] = dtype;
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["fused"] = fused;
    return total.to(torch::kFloat);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto &hidden = saved[0], &weight = saved[1], &targets = saved[2], &lse = saved[3];
    const auto ct = static_cast<c10::ScalarType>(ctx->saved_data["dtype"].toInt());
    const int64_t chunk = ctx->saved_data["chunk"].toInt(), ignore_index = ctx->saved_data["ignore_index"].toInt();
    const bool fused = ctx->saved_data["fused"].toBool();
    const bool need_hidden = ctx->needs_input_grad(0), need_weight = ctx->needs_input_grad(1);
    AutocastGuard no_autocast(without_autocast(hidden.device().type()));
    const int64_t N = hidden.size(0), C = hidden.size(1), V = weight.size(0);
    const auto f32 = hidden.options().dtype(torch::kFloat);
    const auto g = grad_outputs[0].to(torch::kFloat);  // 0-dim
    const auto w = weight.to(ct);                      // (V, C)
    torch::Tensor d_hidden, d_weight, d_weight_part;
    if (need_hidden) d_hidden = torch::empty({N, C}, hidden.options().dtype(ct));  // (N, C)
    if (need_weight) d_weight = torch::zeros({V, C}, f32);                        // (V, C) fp32 accumulator
    if (need_weight && ct != torch::kFloat) d_weight_part = torch::empty({V, C}, w.options());
    Buffers buf(std::min(chunk, N), V, hidden.options(), ct);
    // g read from memory: a CPU tensor, no item() (the Trainer counts host reads).
    const float g_value = fused ? *g.contiguous().data_ptr<float>() : 0.f;
    for (int64_t r0 = 0; r0 < N && (need_hidden || need_weight); r0 += chunk) {
      const int64_t n = std::min(chunk, N - r0);
      const auto h = hidden.narrow(0, r0, n).to(ct);  // (n, C)
      auto p = buf.logits(h, w);                      // (n, V) fp32
      const auto t = targets.narrow(0, r0, n);
      if (fused) {
        parallel_chunks(n, fused::grain_rows(V), [&](int64_t begin, int64_t end, int64_t) {
          fused::softmax_grad_rows(p.data_ptr<float>(), lse.data_ptr<float>() + r0, t.data_ptr<int64_t>(), g_value,
                                   ignore_index, begin, end, V);
        });
      } else {
        const auto ignored = t.eq(ignore_index).unsqueeze(1);  // (n, 1)
        p.sub_(lse.narrow(0, r0, n).unsqueeze(1)).exp_();      // softmax
        p.scatter_add_(1, t.unsqueeze(1).masked_fill(ignored, 0), torch::full({n, 1}, -1.0, f32));  // - one-hot
        p.mul_(g).masked_fill_(ignored, 0.0);                  // dLogits (n, V)
      }
      const auto dl = buf.in_matmul_dtype(p);                // (n, V) in ct
      if (need_hidden) {
        auto dh = d_hidden.narrow(0, r0, n);  // (n, C)
        torch::mm_out(dh, dl, w);             // dHidden = dLogits W
      }
      if (need_weight && ct == torch::kFloat) {
        d_weight.addmm_(dl.t(), h);  // dW += dLogitsᵀ hidden
      } else if (need_weight) {
        d_weight.add_(torch::mm_out(d_weight_part, dl.t(), h));
      }
    }
    return {need_hidden ? d_hidden.to(hidden.scalar_type()) : torch::Tensor(),
            need_weight ? d_weight.to(weight.scalar_type()) : torch::Tensor(),
            torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }

 private:
  static AutocastState without_autocast(c10::DeviceType device) {
    auto state = AutocastState::current(device);
    state.enabled = false;
    return state;
  }

  // One chunk's logits, reused for every chunk: (rows, V) in the matmul dtype and, when
  // that is not fp32, an fp32 copy.
  struct Buffers {
    torch::Tensor ct_flat, f32_flat;
    Buffers(int64_t rows, int64_t V, const torch::TensorOptions& options, c10::ScalarType ct)
        : ct_flat(torch::empty({rows * V}, options.dtype(ct))),
          f32_flat(ct == torch::kFloat ? ct_flat : torch::empty({rows * V}, options.dtype(torch::kFloat))) {}

    // h (n, C) @ wᵀ -> (n, V) fp32, a view of the buffer.
    torch::Tensor logits(const torch::Tensor& h, const torch::Tensor& w) {
      const int64_t n = h.size(0), V = w.size(0);
      auto out = ct_flat.narrow(0, 0, n * V).view({n, V});
      torch::mm_out(out, h, w.t());
      if (ct_flat.scalar_type() == torch::kFloat) return out;
      return f32_flat.narrow(0, 0, n * V).view({n, V}).copy_(out);
    }
    // x (n, V) fp32 in the matmul dtype (the ct buffer when a cast is needed).
    torch::Tensor in_matmul_dtype(const torch::Tensor& x) {
      if (ct_flat.scalar_type() == torch::kFloat) return x;
      return ct_flat.narrow(0, 0, x.numel()).view(x.sizes()).copy_(x);
    }
  };
};

}  // namespace memopt::detail

namespace memopt::nn {

/// Sum over the targets not equal to ignore_index of cross_entropy(hidden Wᵀ, target):
/// the same value and gradients as
///   cross_entropy(hidden.matmul(weight.t()).to(kFloat), targets, reduction sum, ignore_index)
/// without the (N, V) logits: they are computed chunk_size rows at a time, in forward and
/// again in backward. hidden (N, C), weight (V, C), targets (N) int64; returns a 0-dim
/// fp32 tensor. The matmuls run in autocast's dtype when autocast is on, else in the
/// inputs' (promoted) dtype.
///   auto loss = memopt::nn::chunked_cross_entropy_sum(h.reshape({-1, C}), lm_head->weight, targets.reshape({-1}));
inline torch::Tensor chunked_cross_entropy_sum(const torch::Tensor& hidden, const torch::Tensor& weight,
                                               const torch::Tensor& targets,
                                               const ChunkedCrossEntropyOptions& options = {}) {
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1),
              "memopt::nn::chunked_cross_entropy_sum: hidden must be (N, C) and weight (V, C) (got hidden ",
              hidden.sizes(), ", weight ", weight.sizes(), "). HINT: flatten (B, T, C) to (B·T, C); weight is the "
              "output projection's, as stored by torch::nn::Linear.");
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == hidden.size(0) && targets.scalar_type() == torch::kLong,
              "memopt::nn::chunked_cross_entropy_sum: targets must be int64 (N) = (", hidden.size(0), ") (got ",
              targets.scalar_type(), " ", targets.sizes(), "). HINT: flatten (B, T) targets to (B·T).");
  TORCH_CHECK(options.chunk_size() >= 1, "memopt::nn::chunked_cross_entropy_sum: chunk_size must be >= 1 (got ",
              options.chunk_size(), "). HINT: the default is ", kCrossEntropyChunk, " rows.");
  TORCH_CHECK(hidden.is_floating_point() && weight.is_floating_point(),
              "memopt::nn::chunked_cross_entropy_sum: hidden and weight must be floating point (got ",
              hidden.scalar_type(), " and ", weight.scalar_type(), "). HINT: pass activations, not token ids.");
  // A target outside [0, V) that is not ignore_index is an error, checked without a host sync
  // inside a Trainer step (detail/deferred_checks.hpp); meanwhile it counts as ignored.
  const int64_t V = weight.size(0);
  const int64_t ignore_index = options.ignore_index();
  const auto out_of_range = targets.ne(ignore_index).logical_and(targets.lt(0).logical_or(targets.ge(V)));  // (N,)
  if (targets.numel() > 0) {
    const auto first_bad = targets.gather(0, out_of_range.to(torch::kByte).argmax().reshape({1}));  // (1,)
    memopt::detail::check_or_defer(out_of_range.any(), first_bad, [V, ignore_index](double bad) {
      return c10::str("memopt::nn::chunked_cross_entropy_sum: target ", static_cast<int64_t>(bad),
                      " lies outside [0, ", V, ") and is not ignore_index ", ignore_index,
                      ". HINT: check vocab_size, or mark padding with ignore_index.");
    });
  }
  const auto safe_targets = targets.masked_fill(out_of_range, ignore_index);  // (N,)
  const auto autocast = memopt::detail::AutocastState::current(hidden.device().type());
  const auto dtype = autocast.enabled ? autocast.dtype : at::promote_types(hidden.scalar_type(), weight.scalar_type());
  const bool fused = options.fused() && hidden.is_cpu() && weight.is_cpu();  // the row kernels are the CPU's
  return memopt::detail::ChunkedCrossEntropyFunction::apply(hidden, weight, safe_targets, static_cast<int64_t>(dtype),
                                                    options.chunk_size(), options.ignore_index(), fused);
}

}  // namespace memopt::nn
