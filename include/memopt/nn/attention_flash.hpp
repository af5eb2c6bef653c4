// memopt/nn/attention_flash.hpp — AttentionKind::kFlash on the CPU: flash attention written on
// LibTorch's batch-reduce GEMM (at::native::cpublas::brgemm: oneDNN's micro-kernels, AMX tiles
// for bf16 where the CPU has them). SDPA's own CPU backward multiplies blocks through
// cpublas::gemm, one small GEMM after another: in bf16 on an AMX Xeon it took 5.8x its
// forward's time, 29% of a training step at 8 × d512 (docs/benchmarks.md). Here each
// (batch, KV head) task walks key blocks of 64 and multiplies each against every query that
// sees it in one call, in the transposed layout (keys as rows), so every A operand is a plain
// row-major buffer and every B operand is packed once per head (VNNI pairs for bf16):
//   forward   nn/attention_flash_forward.hpp's: S = Q Kᵀ row by row, or Sᵀ = K_j Qᵀ with an
//             online softmax; O and lse = m + log l
//   backward  Sᵀ = K_j Qᵀ, P = exp(scale·Sᵀ − lse)       dV_j += P-rows · dO
//             dPᵀ = V_j dOᵀ, dS = P ∘ (dPᵀ − rowsum(dO∘O))  dK_j += dS-rows · Q
//             dQᵀ += K_jᵀ dSᵀ   (scale applied to dQ and dK once at the end)
// In bf16 past 2048 keys the forward is SDPA's (attention_flash_forward.hpp's row_keys).
// fp32 accumulators throughout (O, dQ, dK, dV, the scores); bf16 only where SDPA rounds too (P
// and dS as GEMM operands). On a CPU without AMX (oneDNN has no bf16 brgemm for it) bf16 runs
// the fp32 kernels on widened copies and rounds O, dQ, dK and dV to bf16 once, keeping bf16
// tensors for backward as SDPA does: on a 2-core AVX512-BF16 EPYC at B8 H8 T256 D32 the widened
// forward + backward took 8–9 ms where SDPA's bf16 took 20–22 (attention_auto measures both).
// Grouped KV heads are never repeated: the G query heads of a KV head run in its task and add
// into one dK, dV. No dropout and no mask but the causal one (top-left
// aligned, SDPA's): attention_flash runs SDPA otherwise.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/native/CPUBlas.h>
#include <ATen/record_function.h>
#include <torch/torch.h>

#include "memopt/detail/autocast.hpp"
#include "memopt/nn/attention_flash_forward.hpp"
#include "memopt/nn/attention_kernels.hpp"
#include "memopt/nn/fused.hpp"

#if MEMOPT_HAS_BRGEMM
namespace memopt::detail::flash {

// One key block's rows against a chunk of queries (keys c < nb, queries i < M, leading
// dimension M2; key c is hidden from queries i < c + diag: diag = n0 − c0 under the causal mask,
// −nb without it): scores s -> P and dPᵀ dp -> dS, in fp32 in place; their T copies p_t and
// ds_t (bf16 only); the hidden prefix and the pad columns zero.
template <class T>
MEMOPT_FUSED_CLONES void softmax_grad_rows(float* s, float* dp, T* p_t, T* ds_t, int64_t nb, int64_t M, int64_t M2,
                                           int64_t diag, float scale, const float* lse, const float* delta) {
  for (int64_t c = 0; c < nb; ++c) {
    float* sr = s + c * M2;
    float* dr = dp + c * M2;
    const int64_t seen = std::clamp<int64_t>(c + diag, 0, M);
    for (int64_t i = 0; i < seen; ++i) sr[i] = dr[i] = 0.f;
    for (int64_t i = seen; i < M; ++i) {
      const float p = fused::exp(sr[i] * scale - lse[i]);
      sr[i] = p;
      dr[i] = p * (dr[i] - delta[i]);
    }
    for (int64_t i = M; i < M2; ++i) sr[i] = dr[i] = 0.f;
    if constexpr (!std::is_same_v<T, float>) {
      for (int64_t i = 0; i < M2; ++i) {
        p_t[c * M2 + i] = fused::from_float<T>(sr[i]);
        ds_t[c * M2 + i] = fused::from_float<T>(dr[i]);
      }
    }
  }
}

// rowsum(dO ∘ O) of Tq rows of D.
template <class T>
MEMOPT_FUSED_CLONES void row_dots(const T* a, int64_t as, const T* b, int64_t bs, int64_t rows, int64_t D,
                                  float* out) {
  for (int64_t r = 0; r < rows; ++r)
    out[r] = fused::lane_sum(D, [&](int64_t d) {
      return fused::to_float(a[r * as + d]) * fused::to_float(b[r * bs + d]);
    });
}

// One thread's buffers, sized for the largest task and reused by every task it runs: two
// LibTorch tensors (fp32 and T), so the memory tracker counts them.
template <class T>
struct Workspace {
  torch::Tensor f32, low;
  float *scores, *dscores, *delta, *lse, *dq_t, *dk, *dv;
  T *q_t, *do_t, *q_b, *do_b, *k_t, *p_rows, *ds_rows, *ds_b;

  Workspace(int64_t Tq, int64_t Tk, int64_t D, c10::ScalarType dtype) {
    const int64_t Tq2 = Tq + Tq % 2, Tk2 = Tk + Tk % 2, block = kKeyBlock * std::min(Tq2, kQueryChunk);
    // fp32 multiplies P, dS, Q and dO where they are; bf16 needs their copies and VNNI packings.
    const int64_t rounded = std::is_same_v<T, float> ? 0 : 1;
    f32 = torch::empty({2 * block + 2 * Tq + D * Tq + 2 * Tk * D}, torch::kFloat);
    // The pad row of an odd Tq in q_b and do_b, and the pad column of an odd Tk in k_t, stay 0.
    low = torch::zeros({2 * D * Tq2 + D * Tk2 + rounded * (2 * Tq2 * D + 3 * block)}, dtype);
    float* f = f32.data_ptr<float>();
    for (float** part : {&scores, &dscores}) *part = std::exchange(f, f + block);
    for (float** part : {&delta, &lse}) *part = std::exchange(f, f + Tq);
    dq_t = std::exchange(f, f + D * Tq);
    for (float** part : {&dk, &dv}) *part = std::exchange(f, f + Tk * D);
    T* l = low.data_ptr<T>();
    for (T** part : {&q_t, &do_t}) *part = std::exchange(l, l + D * Tq2);
    k_t = std::exchange(l, l + D * Tk2);
    for (T** part : {&q_b, &do_b}) *part = std::exchange(l, l + rounded * Tq2 * D);
    for (T** part : {&p_rows, &ds_rows, &ds_b}) *part = std::exchange(l, l + rounded * block);
  }
};

// The (batch b, KV head kv) task: dq of its G query heads, dk and dv of the KV head.
template <class T>
void backward_task(Workspace<T>& w, int64_t b, int64_t kv, int64_t G, bool causal, float scale,
                   const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& out,
                   const torch::Tensor& grad_out, const torch::Tensor& lse, const torch::Tensor& dq,
                   const torch::Tensor& dk, const torch::Tensor& dv) {
  const int64_t Tq = q.size(2), Tk = k.size(2), D = q.size(3), Tq2 = Tq + Tq % 2, Tk2 = Tk + Tk % 2;
  const T* k_ptr = k.const_data_ptr<T>() + b * k.stride(0) + kv * k.stride(1);
  const T* v_ptr = v.const_data_ptr<T>() + b * v.stride(0) + kv * v.stride(1);
  const int64_t ks = k.stride(2), vs = v.stride(2);
  // Kᵀ (D, Tk2) as a plain A operand of dQᵀ += K_jᵀ dSᵀ.
  transpose(k_ptr, Tk, D, ks, w.k_t, Tk2);
  std::fill(w.dk, w.dk + Tk * D, 0.f);
  std::fill(w.dv, w.dv + Tk * D, 0.f);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t h = kv * G + g;
    const T* q_ptr = q.const_data_ptr<T>() + b * q.stride(0) + h * q.stride(1);
    const T* o_ptr = out.const_data_ptr<T>() + b * out.stride(0) + h * out.stride(1);
    const T* do_ptr = grad_out.const_data_ptr<T>() + b * grad_out.stride(0) + h * grad_out.stride(1);
    const float* lse_ptr = lse.const_data_ptr<float>() + b * lse.stride(0) + h * lse.stride(1);
    const int64_t qs = q.stride(2), dos = grad_out.stride(2);
    pack_transposed(q_ptr, Tq, D, qs, w.q_t, Tq2);    // Qᵀ (D, Tq): B of Sᵀ = K_j Qᵀ
    pack_transposed(do_ptr, Tq, D, dos, w.do_t, Tq2);  // dOᵀ: B of dPᵀ = V_j dOᵀ
    // Q and dO (Tq, D) as the B operands of dK_j += dS Q and dV_j += P dO: as they are in fp32,
    // VNNI-packed (Tq2 rows) in bf16.
    const T* q_b = q_ptr;
    const T* do_b = do_ptr;
    int64_t q_ld = qs, do_ld = dos;
    if constexpr (!std::is_same_v<T, float>) {
      pack_rows(q_ptr, Tq, D, qs, w.q_b, D);
      pack_rows(do_ptr, Tq, D, dos, w.do_b, D);
      q_b = w.q_b, do_b = w.do_b, q_ld = do_ld = D;
    }
    row_dots(do_ptr, dos, o_ptr, out.stride(2), Tq, D, w.delta);
    for (int64_t t = 0; t < Tq; ++t) w.lse[t] = lse_ptr[t * lse.stride(2)];
    std::fill(w.dq_t, w.dq_t + D * Tq, 0.f);
    for (int64_t n0 = 0; n0 < Tk; n0 += kKeyBlock) {
      const int64_t nb = std::min(kKeyBlock, Tk - n0), nb2 = nb + nb % 2;
      // Queries before the block see none of it under the causal mask; the rest in chunks.
      for (int64_t r0 = causal ? n0 : 0; r0 < Tq; r0 += kQueryChunk) {
        const int64_t M = std::min(kQueryChunk, Tq - r0), M2 = M + M % 2, diag = causal ? n0 - r0 : -nb;
        const int64_t col = std::is_same_v<T, float> ? r0 : 2 * r0;  // column r0 of a packed Qᵀ, dOᵀ
        brgemm<T>(nb, M, D, ks, Tq2, M2, false, k_ptr + n0 * ks, w.q_t + col, w.scores);     // Sᵀ (nb, M)
        brgemm<T>(nb, M, D, vs, Tq2, M2, false, v_ptr + n0 * vs, w.do_t + col, w.dscores);  // dPᵀ
        softmax_grad_rows<T>(w.scores, w.dscores, w.p_rows, w.ds_rows, nb, M, M2, diag, scale, w.lse + r0,
                             w.delta + r0);
        const T* p_rows = w.p_rows;
        const T* ds_rows = w.ds_rows;
        const T* ds_b = w.ds_rows;
        if constexpr (std::is_same_v<T, float>) {
          p_rows = w.scores;
          ds_rows = ds_b = w.dscores;
        } else {
          pack_rows(ds_rows, nb, M2, M2, w.ds_b, M2);  // dSᵀ (nb2, M) as the B of dQᵀ
          ds_b = w.ds_b;
        }
        const int64_t depth = std::is_same_v<T, float> ? M : M2;  // VNNI pairs need an even depth
        const int64_t nk = std::is_same_v<T, float> ? nb : nb2;
        brgemm<T>(nb, D, depth, M2, do_ld, D, true, p_rows, do_b + r0 * do_ld, w.dv + n0 * D);  // dV_j += P dO
        brgemm<T>(nb, D, depth, M2, q_ld, D, true, ds_rows, q_b + r0 * q_ld, w.dk + n0 * D);    // dK_j += dS Q
        brgemm<T>(D, M, nk, Tk2, M2, Tq, true, w.k_t + n0, ds_b, w.dq_t + r0);                 // dQᵀ += K_jᵀ dSᵀ
      }
    }
    T* dq_ptr = dq.data_ptr<T>() + b * dq.stride(0) + h * dq.stride(1);
    // dQ = scale · (dQᵀ)ᵀ; Qᵀ's buffer, done with for this head, holds bf16's rounded dQᵀ.
    store_transposed<T>(w.dq_t, D, Tq, scale, nullptr, w.q_t, dq_ptr, dq.stride(2));
  }
  T* dk_ptr = dk.data_ptr<T>() + b * dk.stride(0) + kv * dk.stride(1);
  T* dv_ptr = dv.data_ptr<T>() + b * dv.stride(0) + kv * dv.stride(1);
  store_scaled(w.dk, Tk, D, dk_ptr, dk.stride(2), scale);
  store_scaled(w.dv, Tk, D, dv_ptr, dv.stride(2), 1.f);
}

// Gradients of q (B, H, Tq, D), k and v (B, KV, Tk, D) from the forward's out and lse (B, H, Tq).
inline std::vector<torch::Tensor> attention_backward(const torch::Tensor& grad_out, const torch::Tensor& q,
                                                     const torch::Tensor& k, const torch::Tensor& v,
                                                     const torch::Tensor& out, const torch::Tensor& lse, bool causal,
                                                     double scale) {
  RECORD_FUNCTION("memopt::attention_flash_backward", std::vector<c10::IValue>());
  const auto q_ = aligned_rows(q), k_ = aligned_rows(k), v_ = aligned_rows(v), o_ = aligned_rows(out);
  const auto go = aligned_rows(grad_out.to(q.scalar_type()));
  const int64_t H = q.size(1), KV = k.size(1), Tq = q.size(2), Tk = k.size(2), D = q.size(3);
  auto dq = torch::empty_like(q_), dk = torch::empty_like(k_), dv = torch::empty_like(v_);
  run_head_tasks<Workspace>(
      q, KV,
      [&](auto& w, int64_t b, int64_t kv) {
        backward_task(w, b, kv, H / KV, causal, static_cast<float>(scale), q_, k_, v_, o_, go, lse, dq, dk, dv);
      },
      Tq, Tk, D, q.scalar_type());
  return {dq, dk, dv};
}

// `t` in fp32 where `widen`, else `t`.
inline torch::Tensor widened(const torch::Tensor& t, bool widen) { return widen ? t.to(torch::kFloat) : t; }

// memopt's forward (SDPA's in bf16 past row_keys) and backward; with `widen`, bf16 inputs run
// the fp32 kernels on widened copies and the results are rounded to bf16. Saves q, k, v, the
// output (in the inputs' dtype) and the fp32 log-sum-exp: what SDPA's own autograd node keeps.
struct FlashAttentionFunction : torch::autograd::Function<FlashAttentionFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, bool causal, bool widen) {
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
    auto [out, lse] = attention_forward(widened(q, widen), widened(k, widen), widened(v, widen), causal, scale);
    out = out.to(q.scalar_type());
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["widen"] = widen;
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const bool widen = ctx->saved_data["widen"].toBool();
    auto g = attention_backward(widened(grads[0], widen), widened(s[0], widen), widened(s[1], widen),
                                widened(s[2], widen), widened(s[3], widen), s[4], ctx->saved_data["causal"].toBool(),
                                ctx->saved_data["scale"].toDouble());
    for (auto& d : g) d = d.to(s[0].scalar_type());
    return {g[0], g[1], g[2], torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace memopt::detail::flash
#endif

namespace memopt::nn {

/// attention_sdpa's conventions (q (B, H, Tq, D), k and v (B, KV, Tk, D), grouped heads never
/// repeated), on memopt's brgemm kernels where flash_supported says so, else attention_sdpa
/// itself. Under autocast q, k and v run in autocast's dtype, as SDPA does (bf16 without AMX:
/// the fp32 kernels on widened copies, the results in bf16).
///   auto y = memopt::nn::attention_flash(q, k, v, /*causal=*/true, 0.0, /*training=*/true);
inline torch::Tensor attention_flash(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                     bool causal, double dropout, bool training,
                                     const torch::Tensor& key_padding_mask = {}) {
#if MEMOPT_HAS_BRGEMM
  if (flash_supported(q, dropout, training, key_padding_mask) && k.dim() == 4 && k.size(2) > 0) {
    TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes() && k.size(0) == q.size(0) && k.size(3) == q.size(3) &&
                    k.size(1) > 0 && q.size(1) % k.size(1) == 0,
                "memopt::nn::attention_flash: q must be (B, H, T, D) and k, v (B, KV, Tk, D) with KV dividing H "
                "(got q ",
                q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), "). HINT: transpose(1, 2) a (B, T, H, D) projection.");
    const auto dtype = memopt::detail::matmul_dtype(q);
    const auto off = memopt::detail::autocast_off(c10::kCPU);
    memopt::detail::AutocastGuard plain(off);
    const bool widen = dtype == torch::kBFloat16 && !memopt::detail::bf16_tiles();
    return memopt::detail::flash::FlashAttentionFunction::apply(q.to(dtype), k.to(dtype), v.to(dtype), causal, widen);
  }
#endif
  return attention_sdpa(q, k, v, causal, dropout, training, key_padding_mask);
}

}  // namespace memopt::nn

