// memopt/nn/attention_flash_forward.hpp — the forward of nn/attention_flash.hpp's flash
// attention, and the building blocks both its passes use: LibTorch's batch-reduce GEMM
// (at::native::cpublas::brgemm: oneDNN's micro-kernels, AMX tiles for bf16 where the CPU has
// them), VNNI packing, fbgemm's transposes. Two forwards, the faster for the key count:
//   rows     (Tk ≤ row_keys(dtype)) per chunk of 64 queries S = Q Kᵀ over every key the chunk
//            sees, a plain softmax per row (no rescaling), O = P V / l: only K is transposed
//            (once per KV head), and V is a B operand as it is.
//   online   per key block of 64, Sᵀ = K_j Qᵀ in the transposed layout the backward uses, with
//            FlashAttention's running max and sum: Oᵀ = alpha · Oᵀ + V_jᵀ P; O = (Oᵀ)ᵀ / l.
// Both give lse = m + log l (fp32) for the backward. Measured on 2 threads of an AMX Xeon
// (LibTorch 2.15, causal, D 64; medians of 25 interleaved calls): at B8 H8 T512 rows took
// 10.2 ms against online's 11.2 and SDPA's 21.2 in fp32, 4.8 against 6.6 and 6.8 in bf16; at B1
// H8 T2048 fp32 rows lost (26.0 against 17.3), bf16 rows won (7.1 against SDPA's 7.8), and at
// T4096 bf16 lost to SDPA (31.4 against 27.8), which runs the bf16 forward past row_keys.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/native/CPUBlas.h>
#include <ATen/record_function.h>
#include <torch/torch.h>

#include "memopt/detail/autocast.hpp"
#include "memopt/detail/cpublas.hpp"
#include "memopt/detail/transpose.hpp"
#include "memopt/nn/attention_kernels.hpp"
#include "memopt/nn/fused.hpp"

namespace memopt::nn {

/// Whether attention_flash runs memopt's kernels for attention on `device` whose matmuls run
/// in `dtype` (autocast's, else q's): a CPU build of LibTorch with the batch-reduce GEMM, fp32
/// or bf16 (on AMX tiles where oneDNN has them, detail::bf16_tiles; elsewhere the fp32 kernels
/// on widened copies); an even head width; no dropout and no key padding. Elsewhere
/// attention_flash is attention_sdpa.
inline bool flash_supported(c10::DeviceType device, c10::ScalarType dtype, int64_t head_dim, bool dropout,
                            bool padded) {
#if MEMOPT_HAS_BRGEMM
  const bool dtype_ok = dtype == torch::kFloat || dtype == torch::kBFloat16;
  return device == c10::kCPU && dtype_ok && head_dim > 0 && head_dim % 2 == 0 && !dropout && !padded;
#else
  (void)device, (void)dtype, (void)head_dim, (void)dropout, (void)padded;
  return false;
#endif
}

/// The same for a call attention_flash(q, k, v, causal, dropout, training, key_padding_mask).
inline bool flash_supported(const torch::Tensor& q, double dropout, bool training,
                            const torch::Tensor& key_padding_mask = {}) {
  return q.dim() == 4 && q.size(2) > 0 &&
         flash_supported(q.device().type(), memopt::detail::matmul_dtype(q), q.size(3),
                                  training && dropout > 0, key_padding_mask.defined());
}

}  // namespace memopt::nn

#if MEMOPT_HAS_BRGEMM
namespace memopt::detail::flash {

inline constexpr int64_t kKeyBlock = 64;
// Queries per GEMM against a key block: a (64, 512) fp32 block of scores (128 KiB) stays in the
// L2 cache; at T = 8192 one (64, T) block per call ran 1.4x slower than SDPA, chunked 0.7x.
inline constexpr int64_t kQueryChunk = 512;

// The loops below are plain C++ for GCC's vectoriser, cloned per ISA (nn/fused.hpp's
// MEMOPT_FUSED_CLONES): a header gets the user's flags, not ATen's per-ISA builds.

// The VNNI word of a bf16 pair: lo in the low half (the first row of a pair), hi in the high one.
inline uint32_t vnni_word(c10::BFloat16 lo, c10::BFloat16 hi) {
  return static_cast<uint32_t>(lo.x) | (static_cast<uint32_t>(hi.x) << 16);
}

// rows × cols bf16 src (row stride rs) as a VNNI B operand (rows deep, leading dimension ld):
// row pairs interleaved, an odd last row paired with zeros. One 32-bit word per pair, so the
// loop vectorises: element by element it ran scalar, 9% of a B8 H8 T512 bf16 forward+backward
// (15.3–16.9 ms a call now, against 18.3–19.9; interleaved runs, 2 AMX cores).
// (fp32 B operands are plain rows: the kernels pass them where they are.)
template <class T>
MEMOPT_FUSED_CLONES void pack_rows(const T* src, int64_t rows, int64_t cols, int64_t rs, T* dst, int64_t ld) {
  static_assert(std::is_same_v<T, c10::BFloat16>, "fp32 needs no VNNI packing");
  for (int64_t r = 0; r < rows; r += 2) {
    const T* a = src + r * rs;
    T* out = dst + r * ld;
    if (r + 1 < rows) {
      const T* b = a + rs;
      for (int64_t c = 0; c < cols; ++c) {
        const uint32_t word = vnni_word(a[c], b[c]);
        std::memcpy(out + 2 * c, &word, sizeof word);
      }
    } else {
      for (int64_t c = 0; c < cols; ++c) {
        const uint32_t word = vnni_word(a[c], T(0.f));
        std::memcpy(out + 2 * c, &word, sizeof word);
      }
    }
  }
}

using memopt::detail::transpose;  // detail/transpose.hpp: fbgemm's SIMD transpose

// The transpose of rows × cols src (row stride rs; cols even for bf16) as a B operand (cols
// deep, leading dimension ld): for bf16 each pair of columns is one 32-bit word, moved whole.
template <class T>
void pack_transposed(const T* src, int64_t rows, int64_t cols, int64_t rs, T* dst, int64_t ld) {
  using Word = std::conditional_t<std::is_same_v<T, float>, float, uint32_t>;
  constexpr int64_t per = sizeof(Word) / sizeof(T);
  transpose(reinterpret_cast<const Word*>(src), rows, cols / per, rs / per, reinterpret_cast<Word*>(dst), ld);
}

// src[r][c] · scale (· col_scale[c] when given) for a contiguous fp32 rows × cols src: in place
// for fp32, rounded into `low` (rows × cols) for bf16.
template <class T>
MEMOPT_FUSED_CLONES void scale_in_place(float* src, int64_t rows, int64_t cols, float scale, const float* col_scale,
                                        T* low) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float v = src[r * cols + c] * (col_scale ? scale * col_scale[c] : scale);
      if constexpr (std::is_same_v<T, float>) src[r * cols + c] = v;
      else low[r * cols + c] = fused::from_float<T>(v);
    }
}

// dst[c * ld + r] = scale · src[r][c] (· col_scale[c]) in T, for the contiguous fp32 rows × cols
// src (scaled in place; a bf16 T goes through `low`, rows × cols, then): an accumulator's
// transpose, the output's layout.
template <class T>
void store_transposed(float* src, int64_t rows, int64_t cols, float scale, const float* col_scale, T* low, T* dst,
                      int64_t ld) {
  scale_in_place<T>(src, rows, cols, scale, col_scale, low);
  if constexpr (std::is_same_v<T, float>) transpose(src, rows, cols, cols, dst, ld);
  else transpose(low, rows, cols, cols, dst, ld);
}

// dst[r * ld + c] = scale · src[r * cols + c] for a rows × cols src.
template <class Out>
MEMOPT_FUSED_CLONES void store_scaled(const float* src, int64_t rows, int64_t cols, Out* dst, int64_t ld,
                                      float scale) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[r * ld + c] = fused::from_float<Out>(src[r * cols + c] * scale);
}

// One key block of the forward against a chunk of queries (as softmax_grad_rows): the running
// max m and sum l of each query's exp(scale · s) over the keys so far move on to this block's,
// s becomes P = exp(scale · s − m) (0 where the mask hides the key, and in the pad columns), p_t
// its T copy (bf16 only), and alpha = exp(m_before − m) rescales the output so far.
template <class T>
MEMOPT_FUSED_CLONES void online_softmax_rows(float* s, T* p_t, int64_t nb, int64_t M, int64_t M2, int64_t diag,
                                             float scale, float* m, float* l, float* alpha, float* block_max) {
  for (int64_t i = 0; i < M; ++i) block_max[i] = -std::numeric_limits<float>::infinity();
  for (int64_t c = 0; c < nb; ++c) {
    const float* sr = s + c * M2;
    for (int64_t i = std::clamp<int64_t>(c + diag, 0, M); i < M; ++i)
      block_max[i] = std::max(block_max[i], sr[i] * scale);
  }
  for (int64_t i = 0; i < M; ++i) {
    const float m_new = std::max(m[i], block_max[i]);  // finite: every query of a chunk sees key n0
    alpha[i] = fused::exp(m[i] - m_new);                // m = -inf before the first block: 0
    m[i] = m_new;
    block_max[i] = 0.f;  // now this block's sum
  }
  for (int64_t c = 0; c < nb; ++c) {
    float* sr = s + c * M2;
    const int64_t seen = std::clamp<int64_t>(c + diag, 0, M);
    for (int64_t i = 0; i < seen; ++i) sr[i] = 0.f;
    for (int64_t i = seen; i < M; ++i) {
      sr[i] = fused::exp(sr[i] * scale - m[i]);
      block_max[i] += sr[i];
    }
    for (int64_t i = M; i < M2; ++i) sr[i] = 0.f;
    if constexpr (!std::is_same_v<T, float>)
      for (int64_t i = 0; i < M2; ++i) p_t[c * M2 + i] = fused::from_float<T>(sr[i]);
  }
  for (int64_t i = 0; i < M; ++i) l[i] = alpha[i] * l[i] + block_max[i];
}

// Columns [0, M) of the D rows of oᵀ (leading dimension ld) times alpha.
MEMOPT_FUSED_CLONES inline void scale_columns(float* o_t, int64_t D, int64_t M, int64_t ld, const float* alpha) {
  for (int64_t d = 0; d < D; ++d)
    for (int64_t i = 0; i < M; ++i) o_t[d * ld + i] *= alpha[i];
}

template <class T>
inline void brgemm(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add, const T* A,
                   const T* B, float* C) {
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add, A, B, C, /*is_vnni=*/!std::is_same_v<T, float>);
}

// Every (batch b, KV head kv) task of a kernel, in T = fp32 or bf16 as q's dtype, over LibTorch's
// threads: task(workspace, b, kv) with a thread's Workspace<T>, made from `args` on its first task
// and reused by its later ones; oneDNN's AMX tile state released after each task.
template <template <class> class Workspace, class Task, class... Args>
void run_head_tasks(const torch::Tensor& q, int64_t KV, Task&& task, const Args&... args) {
  auto run = [&](auto type_tag) {
    using T = decltype(type_tag);
    std::vector<std::unique_ptr<Workspace<T>>> ws(at::get_num_threads());
    memopt::detail::parallel_tasks(q.size(0) * KV, true, [&](int64_t t, int64_t slot) {
      if (!ws[slot]) ws[slot] = std::make_unique<Workspace<T>>(args...);
      task(*ws[slot], t / KV, t % KV);
      at::native::cpublas::brgemm_release(/*is_vnni=*/!std::is_same_v<T, float>);
    });
  };
  if (q.scalar_type() == torch::kFloat) run(float{});
  else run(at::BFloat16{});
}

// x with rows of D contiguous elements, bf16 pairs on 32-bit boundaries (packing moves pairs
// whole): x itself, or a contiguous copy.
inline torch::Tensor aligned_rows(const torch::Tensor& x) {
  return x.stride(-1) == 1 && x.stride(-2) % 2 == 0 && x.storage_offset() % 2 == 0 ? x : x.contiguous();
}

// The forward's buffers for one thread (as Workspace).
template <class T>
struct ForwardWorkspace {
  torch::Tensor f32, low;
  float *scores, *m, *l, *alpha, *block_max, *o_t;
  T *q_t, *v_t, *p_rows, *p_b;

  ForwardWorkspace(int64_t Tq, int64_t Tk, int64_t D, c10::ScalarType dtype) {
    const int64_t Tq2 = Tq + Tq % 2, Tk2 = Tk + Tk % 2, block = kKeyBlock * std::min(Tq2, kQueryChunk);
    const int64_t rounded = std::is_same_v<T, float> ? 0 : 1;
    f32 = torch::empty({block + 4 * Tq + D * Tq}, torch::kFloat);
    low = torch::zeros({D * Tq2 + D * Tk2 + rounded * 2 * block}, dtype);  // Vᵀ's pad column stays 0
    float* f = f32.data_ptr<float>();
    scores = std::exchange(f, f + block);
    for (float** part : {&m, &l, &alpha, &block_max}) *part = std::exchange(f, f + Tq);
    o_t = f;
    T* lo = low.data_ptr<T>();
    q_t = std::exchange(lo, lo + D * Tq2);
    v_t = std::exchange(lo, lo + D * Tk2);
    for (T** part : {&p_rows, &p_b}) *part = std::exchange(lo, lo + rounded * block);
  }
};

// The (batch b, KV head kv) task of the forward: out and lse of its G query heads. Per key
// block j: Sᵀ = K_j Qᵀ, the online softmax over the keys so far (FlashAttention's), and
// Oᵀ = alpha · Oᵀ + V_jᵀ P; at the end O = (Oᵀ)ᵀ / l and lse = m + log l.
template <class T>
void forward_task(ForwardWorkspace<T>& w, int64_t b, int64_t kv, int64_t G, bool causal, float scale,
                  const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& out,
                  const torch::Tensor& lse) {
  const int64_t Tq = q.size(2), Tk = k.size(2), D = q.size(3), Tq2 = Tq + Tq % 2, Tk2 = Tk + Tk % 2;
  const T* k_ptr = k.const_data_ptr<T>() + b * k.stride(0) + kv * k.stride(1);
  const T* v_ptr = v.const_data_ptr<T>() + b * v.stride(0) + kv * v.stride(1);
  const int64_t ks = k.stride(2);
  transpose(v_ptr, Tk, D, v.stride(2), w.v_t, Tk2);  // Vᵀ (D, Tk2): A of Oᵀ += V_jᵀ P
  for (int64_t g = 0; g < G; ++g) {
    const int64_t h = kv * G + g;
    const T* q_ptr = q.const_data_ptr<T>() + b * q.stride(0) + h * q.stride(1);
    pack_transposed(q_ptr, Tq, D, q.stride(2), w.q_t, Tq2);  // Qᵀ (D, Tq): B of Sᵀ = K_j Qᵀ
    std::fill(w.m, w.m + Tq, -std::numeric_limits<float>::infinity());
    std::fill(w.l, w.l + Tq, 0.f);
    std::fill(w.o_t, w.o_t + D * Tq, 0.f);
    for (int64_t n0 = 0; n0 < Tk; n0 += kKeyBlock) {
      const int64_t nb = std::min(kKeyBlock, Tk - n0), nb2 = nb + nb % 2;
      for (int64_t r0 = causal ? n0 : 0; r0 < Tq; r0 += kQueryChunk) {  // as in backward_task
        const int64_t M = std::min(kQueryChunk, Tq - r0), M2 = M + M % 2, diag = causal ? n0 - r0 : -nb;
        const int64_t col = std::is_same_v<T, float> ? r0 : 2 * r0;
        brgemm<T>(nb, M, D, ks, Tq2, M2, false, k_ptr + n0 * ks, w.q_t + col, w.scores);  // Sᵀ (nb, M)
        online_softmax_rows<T>(w.scores, w.p_rows, nb, M, M2, diag, scale, w.m + r0, w.l + r0, w.alpha,
                               w.block_max);
        scale_columns(w.o_t + r0, D, M, Tq, w.alpha);
        const T* p_b = reinterpret_cast<const T*>(w.scores);
        if constexpr (!std::is_same_v<T, float>) {
          pack_rows(static_cast<const T*>(w.p_rows), nb, M2, M2, w.p_b, M2);  // P (nb2, M) as the B of Oᵀ
          p_b = w.p_b;
        }
        const int64_t nk = std::is_same_v<T, float> ? nb : nb2;
        brgemm<T>(D, M, nk, Tk2, M2, Tq, true, w.v_t + n0, p_b, w.o_t + r0);  // Oᵀ += V_jᵀ P
      }
    }
    for (int64_t t = 0; t < Tq; ++t) w.alpha[t] = 1.f / w.l[t];
    T* out_ptr = out.data_ptr<T>() + b * out.stride(0) + h * out.stride(1);
    store_transposed<T>(w.o_t, D, Tq, 1.f, w.alpha, w.q_t, out_ptr, out.stride(2));  // O = (Oᵀ)ᵀ / l (as dQ)
    float* lse_ptr = lse.data_ptr<float>() + b * lse.stride(0) + h * lse.stride(1);
    for (int64_t t = 0; t < Tq; ++t) lse_ptr[t * lse.stride(2)] = w.m[t] + std::log(w.l[t]);
  }
}

// out (B, H, Tq, D), a view of (B, Tq, H, D) memory as SDPA returns it, and lse (B, H, Tq) fp32.
inline std::pair<torch::Tensor, torch::Tensor> attention_forward_online(const torch::Tensor& q, const torch::Tensor& k,
                                                                        const torch::Tensor& v, bool causal,
                                                                        double scale) {
  RECORD_FUNCTION("memopt::attention_flash_forward", std::vector<c10::IValue>());  // a span in profiles
  const int64_t B = q.size(0), H = q.size(1), KV = k.size(1), Tq = q.size(2), Tk = k.size(2), D = q.size(3);
  auto out = torch::empty({B, Tq, H, D}, q.options()).transpose(1, 2);
  auto lse = torch::empty({B, H, Tq}, q.options().dtype(torch::kFloat));
  run_head_tasks<ForwardWorkspace>(
      q, KV,
      [&](auto& w, int64_t b, int64_t kv) {
        forward_task(w, b, kv, H / KV, causal, static_cast<float>(scale), q, k, v, out, lse);
      },
      Tq, Tk, D, q.scalar_type());
  return {out, lse};
}

// Query rows per chunk of the row forward. A chunk's fp32 scores are (64, Tk + 16): rows padded
// past a power-of-two stride (64 / 0 padding: 10.5 ms at B8 T512 fp32; 32 and 128: no better).
inline constexpr int64_t kRowChunk = 64;
inline constexpr int64_t kRowPad = 16;

// The most keys the row forward takes in `dtype` (see the file comment): past it the scores no
// longer stay in the L2 cache and the online forward (fp32) or SDPA's (bf16) is faster.
inline int64_t row_keys(c10::ScalarType dtype) { return dtype == torch::kFloat ? 1024 : 2048; }

// The largest of x[0, n) (n ≥ 1), on integer keys that order like the floats, so the loop
// vectorises without -ffast-math (a float max reduction does not: 27% of the row forward's
// time with a scalar max, against 18% for the whole softmax of the online forward).
MEMOPT_FUSED_CLONES inline float max_of(const float* x, int64_t n) {
  int32_t key = std::numeric_limits<int32_t>::min();
  for (int64_t j = 0; j < n; ++j) {
    int32_t bits;
    std::memcpy(&bits, x + j, sizeof bits);
    key = std::max(key, bits ^ ((bits >> 31) & 0x7FFFFFFF));  // negative floats: order reversed
  }
  const int32_t bits = key ^ ((key >> 31) & 0x7FFFFFFF);
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// M rows of scores s (leading dimension ld) of queries r0, r0 + 1, …, nk keys computed, nk2 ≥ nk
// the depth of the GEMM that follows: P = exp(scale · s − m) with m the row's largest over the
// keys it sees (all nk; under the causal mask, query i sees keys ≤ i), zero past them up to
// nk2; p_low its T copy (bf16 only); lse = m + log Σ P and inv_l = 1 / Σ P per row.
template <class T>
MEMOPT_FUSED_CLONES void softmax_rows(float* s, T* p_low, int64_t M, int64_t ld, int64_t nk, int64_t nk2, int64_t r0,
                                      bool causal, float scale, float* lse, float* inv_l) {
  for (int64_t i = 0; i < M; ++i) {
    float* row = s + i * ld;
    const int64_t seen = causal ? std::min(nk, r0 + i + 1) : nk;
    const float m = max_of(row, seen) * scale;
    const float sum = fused::lane_sum(seen, [&](int64_t c) { return row[c] = fused::exp(row[c] * scale - m); });
    for (int64_t c = seen; c < nk2; ++c) row[c] = 0.f;
    if constexpr (!std::is_same_v<T, float>)  // one pass of its own: inside the sum's loop, 1.3x slower
      for (int64_t c = 0; c < nk2; ++c) p_low[i * ld + c] = fused::from_float<T>(row[c]);
    lse[i] = m + std::log(sum);
    inv_l[i] = 1.f / sum;
  }
}

// dst[i * ld + d] = T(src[i * D + d] · row_scale[i]) for M rows.
template <class T>
MEMOPT_FUSED_CLONES void store_rows(const float* src, int64_t M, int64_t D, const float* row_scale, T* dst,
                                    int64_t ld) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t d = 0; d < D; ++d) dst[i * ld + d] = fused::from_float<T>(src[i * D + d] * row_scale[i]);
}

// The row forward's buffers for one thread (as Workspace).
template <class T>
struct RowWorkspace {
  torch::Tensor f32, low;
  float *scores, *o, *inv_l, *lse;
  T *k_b, *v_b, *p;

  RowWorkspace(int64_t Tk, int64_t D, c10::ScalarType dtype) {
    const int64_t Tk2 = Tk + Tk % 2, ld = Tk2 + kRowPad, rounded = std::is_same_v<T, float> ? 0 : 1;
    f32 = torch::empty({kRowChunk * (ld + D + 2)}, torch::kFloat);
    low = torch::zeros({D * Tk2 + rounded * (Tk2 * D + kRowChunk * ld)}, dtype);  // V's pad row stays 0
    float* f = f32.data_ptr<float>();
    scores = std::exchange(f, f + kRowChunk * ld);
    o = std::exchange(f, f + kRowChunk * D);
    inv_l = std::exchange(f, f + kRowChunk);
    lse = f;
    T* lo = low.data_ptr<T>();
    k_b = std::exchange(lo, lo + D * Tk2);
    v_b = std::exchange(lo, lo + rounded * Tk2 * D);
    p = lo;
  }
};

// The (batch b, KV head kv) task of the row forward: out and lse of its G query heads.
template <class T>
void row_forward_task(RowWorkspace<T>& w, int64_t b, int64_t kv, int64_t G, bool causal, float scale,
                      const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& out,
                      const torch::Tensor& lse) {
  const int64_t Tq = q.size(2), Tk = k.size(2), D = q.size(3), Tk2 = Tk + Tk % 2, ld = Tk2 + kRowPad;
  const T* k_ptr = k.const_data_ptr<T>() + b * k.stride(0) + kv * k.stride(1);
  const T* v_ptr = v.const_data_ptr<T>() + b * v.stride(0) + kv * v.stride(1);
  pack_transposed(k_ptr, Tk, D, k.stride(2), w.k_b, Tk2);  // Kᵀ (D, Tk): B of S = Q Kᵀ
  const T* v_b = v_ptr;  // V (Tk, D) as the B of O = P V: as it is in fp32, VNNI-packed in bf16
  int64_t v_ld = v.stride(2);
  if constexpr (!std::is_same_v<T, float>) {
    pack_rows(v_ptr, Tk, D, v_ld, w.v_b, D);
    v_b = w.v_b, v_ld = D;
  }
  const T* p = std::is_same_v<T, float> ? reinterpret_cast<const T*>(w.scores) : w.p;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t h = kv * G + g;
    const T* q_ptr = q.const_data_ptr<T>() + b * q.stride(0) + h * q.stride(1);
    T* out_ptr = out.data_ptr<T>() + b * out.stride(0) + h * out.stride(1);
    float* lse_ptr = lse.data_ptr<float>() + b * lse.stride(0) + h * lse.stride(1);
    for (int64_t r0 = 0; r0 < Tq; r0 += kRowChunk) {
      const int64_t M = std::min(kRowChunk, Tq - r0);
      const int64_t nk = causal ? std::min(Tk, r0 + M) : Tk;         // keys the chunk's last query sees
      const int64_t nk2 = std::is_same_v<T, float> ? nk : nk + nk % 2;  // VNNI pairs need an even depth
      brgemm<T>(M, nk, D, q.stride(2), Tk2, ld, false, q_ptr + r0 * q.stride(2), w.k_b, w.scores);  // S (M, nk)
      softmax_rows<T>(w.scores, w.p, M, ld, nk, nk2, r0, causal, scale, w.lse, w.inv_l);
      brgemm<T>(M, D, nk2, ld, v_ld, D, false, p, v_b, w.o);  // O (M, D) = P V
      store_rows(w.o, M, D, w.inv_l, out_ptr + r0 * out.stride(2), out.stride(2));
      for (int64_t i = 0; i < M; ++i) lse_ptr[(r0 + i) * lse.stride(2)] = w.lse[i];
    }
  }
}

// attention_forward_online's result, by the row forward (Tk ≤ row_keys(dtype)).
inline std::pair<torch::Tensor, torch::Tensor> attention_forward_rows(const torch::Tensor& q, const torch::Tensor& k,
                                                                      const torch::Tensor& v, bool causal,
                                                                      double scale) {
  RECORD_FUNCTION("memopt::attention_flash_forward", std::vector<c10::IValue>());
  const int64_t B = q.size(0), H = q.size(1), KV = k.size(1), Tq = q.size(2), Tk = k.size(2), D = q.size(3);
  auto out = torch::empty({B, Tq, H, D}, q.options()).transpose(1, 2);
  auto lse = torch::empty({B, H, Tq}, q.options().dtype(torch::kFloat));
  run_head_tasks<RowWorkspace>(
      q, KV,
      [&](auto& w, int64_t b, int64_t kv) {
        row_forward_task(w, b, kv, H / KV, causal, static_cast<float>(scale), q, k, v, out, lse);
      },
      Tk, D, q.scalar_type());
  return {out, lse};
}

// The forward attention_flash runs (see the file comment): out (B, H, Tq, D), a view of
// (B, Tq, H, D) memory, and lse (B, H, Tq) fp32, with grouped KV heads never repeated except
// for SDPA's (bf16 past row_keys).
inline std::pair<torch::Tensor, torch::Tensor> attention_forward(const torch::Tensor& q, const torch::Tensor& k,
                                                                 const torch::Tensor& v, bool causal, double scale) {
  if (k.size(2) <= row_keys(q.scalar_type()))
    return attention_forward_rows(aligned_rows(q), aligned_rows(k), aligned_rows(v), causal, scale);
  if (q.scalar_type() == torch::kFloat)
    return attention_forward_online(aligned_rows(q), aligned_rows(k), aligned_rows(v), causal, scale);
  const int64_t G = q.size(1) / k.size(1);
  auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, nn::repeat_kv(k, G), nn::repeat_kv(v, G), 0.0,
                                                                    causal, {}, scale);
  return {out, lse};
}

}  // namespace memopt::detail::flash
#endif
