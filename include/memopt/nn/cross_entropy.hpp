// memopt/nn/cross_entropy.hpp — the output projection fused with cross-entropy, over row
// chunks: the sum of CE(hidden Wᵀ, targets) without ever holding the (N, V) logits.
// Forward forms each chunk's logits once, its loss, and (when a graph is recorded) its share
// of dHidden and dWeight for a gradient of 1; backward scales them by the incoming gradient.
// Logits in the matmul dtype (autocast's when it is on), softmax and loss in fp32, dWeight
// accumulated in fp32.
#pragma once

#include <algorithm>
#include <cstdint>

#include <torch/torch.h>

#include "memopt/batch.hpp"
#include "memopt/detail/autocast.hpp"
#include "memopt/detail/deferred_checks.hpp"
#include "memopt/detail/parallel.hpp"
#include "memopt/nn/fused.hpp"
#include "memopt/nn/linear_shared.hpp"

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
// own dtypes, the matmuls in `dtype`. With `grads` (a graph will be recorded), each chunk's
// gradients are formed in forward, right after its loss, as Liger-Kernel's fused linear
// cross-entropy does: the loss is the graph's last node, so its backward only scales them by
// the incoming gradient, and no chunk's logits are computed twice. Saves dHidden (N, C) in the
// matmul dtype (instead of hidden) and dWeight (V, C) fp32 for what needs a gradient.
struct ChunkedCrossEntropyFunction : torch::autograd::Function<ChunkedCrossEntropyFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& hidden,
                               const torch::Tensor& weight, const torch::Tensor& targets, int64_t dtype,
                               int64_t chunk, int64_t ignore_index, bool fused, bool grads) {
    AutocastGuard no_autocast(without_autocast(hidden.device().type()));
    const auto ct = static_cast<c10::ScalarType>(dtype);
    const int64_t N = hidden.size(0), C = hidden.size(1), V = weight.size(0);
    const bool need_hidden = grads && hidden.requires_grad(), need_weight = grads && weight.requires_grad();
    const auto f32 = hidden.options().dtype(torch::kFloat);
    const auto w = weight.to(ct);  // (V, C)
    auto lse = torch::empty({N}, f32);  // (N) log-sum-exp of each row's logits
    auto total = torch::zeros({}, f32.dtype(torch::kDouble));
    torch::Tensor d_hidden, d_weight;
    if (need_hidden) d_hidden = torch::empty({N, C}, hidden.options().dtype(ct));  // (N, C)
    if (need_weight) d_weight = torch::zeros({V, C}, f32);                        // (V, C) fp32 accumulator
    Buffers buf(std::min(chunk, N), V, hidden.options(), ct);
    for (int64_t r0 = 0; r0 < N; r0 += chunk) {
      const int64_t n = std::min(chunk, N - r0);
      const auto h = hidden.narrow(0, r0, n).to(ct);  // (n, C)
      auto logits = buf.logits(h, w);                 // (n, V) fp32
      const auto t = targets.narrow(0, r0, n);
      const auto ignored = t.eq(ignore_index);
      const auto picked = logits.gather(1, t.masked_fill(ignored, 0).unsqueeze(1)).squeeze(1);  // (n)
      auto lse_c = lse.narrow(0, r0, n);
      torch::Tensor sum;  // (n, 1) unfused: Σ exp(logits - max) of each row
      if (fused) {
        parallel_chunks(n, fused::grain_rows(V), [&](int64_t begin, int64_t end, int64_t) {
          fused::log_sum_exp_rows(logits.data_ptr<float>(), lse_c.data_ptr<float>(), begin, end, V);
        });
      } else {  // logits <- exp(logits - max), in place
        const auto max = logits.amax(1, /*keepdim=*/true);  // (n, 1)
        sum = logits.sub_(max).exp_().sum(1, /*keepdim=*/true);  // (n, 1)
        lse_c.copy_(sum.log().add_(max).squeeze(1));
      }
      total.add_((lse_c - picked).masked_fill_(ignored, 0.0).sum(torch::kDouble));
      if (!need_hidden && !need_weight) continue;
      if (fused) {  // logits <- softmax - one-hot (0 on ignored rows), in place
        parallel_chunks(n, fused::grain_rows(V), [&](int64_t begin, int64_t end, int64_t) {
          fused::softmax_grad_rows(logits.data_ptr<float>(), lse_c.data_ptr<float>(), t.data_ptr<int64_t>(), 1.f,
                                   ignore_index, begin, end, V);
        });
      } else {
        logits.div_(sum);  // softmax
        logits.scatter_add_(1, t.masked_fill(ignored, 0).unsqueeze(1), torch::full({n, 1}, -1.0, f32));  // - one-hot
        logits.masked_fill_(ignored.unsqueeze(1), 0.0);
      }
      const auto dl = buf.in_matmul_dtype(logits);  // dLoss/dLogits (n, V) in ct
      if (need_hidden) {
        auto dh = d_hidden.narrow(0, r0, n);  // (n, C)
        torch::mm_out(dh, dl, w);             // dHidden = dLogits W
      }
      if (need_weight && ct == torch::kFloat) {
        d_weight.addmm_(dl.t(), h);  // dW += dLogitsᵀ hidden
      } else if (need_weight) {
        torch::Tensor ht;                                    // weight_grad's hᵀ
        d_weight.add_(nn::detail::weight_grad(dl, h, ht));  // dW += dLogitsᵀ hidden (nn/linear_shared.hpp)
      }
    }
    ctx->save_for_backward({d_hidden, d_weight});
    ctx->saved_data["hidden_dtype"] = static_cast<int64_t>(hidden.scalar_type());
    ctx->saved_data["weight_dtype"] = static_cast<int64_t>(weight.scalar_type());
    ctx->saved_data["used"] = false;
    return total.to(torch::kFloat);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    TORCH_CHECK(!ctx->saved_data["used"].toBool(), "memopt::nn::chunked_cross_entropy_sum: backward ran twice "
                "through one loss (retain_graph). HINT: its gradients are formed in forward and scaled in place by "
                "the first backward; compute the loss again for another backward.");
    ctx->saved_data["used"] = true;
    const auto saved = ctx->get_saved_variables();
    torch::Tensor d_hidden = saved[0], d_weight = saved[1];  // formed in forward for a gradient of 1
    const auto hidden_dtype = static_cast<c10::ScalarType>(ctx->saved_data["hidden_dtype"].toInt());
    const auto weight_dtype = static_cast<c10::ScalarType>(ctx->saved_data["weight_dtype"].toInt());
    const auto& g = grad_outputs[0];  // 0-dim
    const bool need_hidden = ctx->needs_input_grad(0) && d_hidden.defined() && g.defined();
    const bool need_weight = ctx->needs_input_grad(1) && d_weight.defined() && g.defined();
    // In place: the saved gradients are this node's own, and freed with it. g multiplies as a
    // 0-dim tensor: in fp32 (opmath) for a bf16 dHidden, rounded once.
    if (need_hidden) d_hidden.mul_(g);
    if (need_weight) d_weight.mul_(g);
    return {need_hidden ? d_hidden.to(hidden_dtype) : torch::Tensor(),
            need_weight ? d_weight.to(weight_dtype) : torch::Tensor(),
            torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
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
/// without the (N, V) logits: they are computed chunk_size rows at a time, once (the gradients
/// are formed in forward when a graph is recorded: no backward runs through the loss twice,
/// and retain_graph is refused). hidden (N, C), weight (V, C), targets (N) int64; returns a 0-dim
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
  const bool grads = torch::GradMode::is_enabled() && (hidden.requires_grad() || weight.requires_grad());
  return memopt::detail::ChunkedCrossEntropyFunction::apply(hidden, weight, safe_targets, static_cast<int64_t>(dtype),
                                                            options.chunk_size(), options.ignore_index(), fused, grads);
}

}  // namespace memopt::nn
