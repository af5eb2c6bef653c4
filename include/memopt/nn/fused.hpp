// memopt/nn/fused.hpp — fused CPU kernels for the elementwise parts of a LLaMA block, each
// an autograd function that replaces an ATen composite's passes over memory with one, and
// keeps fewer tensors for backward:
//   rms_norm(x, w, eps)  one pass forward (sum of squares, then scale), one backward (dx, dw);
//                        keeps x and one fp32 rstd per row (the composite keeps x·rsqrt too,
//                        and for a bf16 x its fp32 copy);
//   rope(q, k)           q and k rotated in one node, one pass each, from the projections
//                        (B, T, heads, D) layout; keeps the cos/sin tables only;
//   swiglu(g, u)         silu(g)·u; keeps g and u (the composite keeps silu(g) too: one
//                        (B, T, F) tensor less per layer), backward in one pass.
// Same mathematics and roundings as the composites in nn/rmsnorm.hpp, nn/rope.hpp and
// nn/mlp.hpp (fp32 ≤ 1e-6 of the largest entry; bf16 rounded where the composite rounds),
// threads through detail/parallel.hpp (at::parallel_for is serial in code built without
// -fopenmp). They run for contiguous fp32 or bf16 CPU tensors; anything else (a GPU, fp16,
// fp64) runs the composite, so a model may choose them everywhere (LlamaConfig::fused_kernels).
// nn/cross_entropy.hpp's chunked loss uses the same pieces for its softmax rows. `scripts/bench
// fused` measures them all.
//
// Plain C++ loops written for GCC's auto-vectoriser (at -O3), cloned per ISA (AVX-512, AVX2,
// baseline; picked at load) since a header-only library gets the user's flags, not ATen's
// per-ISA builds; and an exp of our own (Cephes' polynomial, ≤ 2 ulp): std::exp does not
// vectorise.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "memopt/detail/parallel.hpp"
#include "memopt/nn/rope.hpp"

namespace memopt::detail::fused {

// e^x for float, within 2 ulp on [-87, 87]; |x| clamped to 87 beyond (±inf too); NaN stays NaN
// (a NaN logit must not vanish from a loss). Branch-free, its tests on the bits: a float
// compare would stop GCC from vectorising the loop (-ftrapping-math), as would a libm call.
inline float exp(float x) {
  int32_t xi;
  std::memcpy(&xi, &x, sizeof xi);
  constexpr int32_t kMaxMagnitude = 0x42AE0000;  // 87.0f
  const int32_t nan = (0x7F800000 - (xi & 0x7FFFFFFF)) >> 31;  // all ones for NaN (no compare: see above)
  const int32_t magnitude = std::min(xi & 0x7FFFFFFF, kMaxMagnitude);
  const int32_t clamped = (xi & static_cast<int32_t>(0x80000000u)) | magnitude;
  std::memcpy(&x, &clamped, sizeof x);
  const float shifted = x * 1.44269504088896341f + 12582912.f;  // 1.5·2^23 + round(x / ln 2)
  const float n = shifted - 12582912.f;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // x − n ln 2, ln 2 in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  int32_t bits;
  std::memcpy(&bits, &shifted, sizeof bits);  // n sits in the low mantissa bits
  bits = (bits - 0x4B400000 + 127) << 23;     // 2^n
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const float value = p * scale;
  int32_t out;
  std::memcpy(&out, &value, sizeof out);
  out = (out & ~nan) | (xi & nan);  // NaN in, the same NaN out
  float result;
  std::memcpy(&result, &out, sizeof result);
  return result;
}

inline float sigmoid(float x) { return 1.f / (1.f + fused::exp(-x)); }

// fp32/bf16 to and from float. bf16 on the bits (round to nearest even, NaN kept, as
// c10::BFloat16 does), branch-free: c10's conversion tests isnan, which stops vectorisation.
inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}
template <class T>
inline T from_float(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    const bool nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
    return c10::BFloat16(static_cast<uint16_t>(nan ? 0x7FC0u : rounded), c10::BFloat16::from_bits());
  }
}

// Rounds to T and back (the composite's cast to the input dtype); identity for float.
template <class T>
inline float round_to(float v) {
  return to_float(from_float<T>(v));
}

// Σ f(j) for j < n in kLanes independent partial sums: a float reduction the compiler may
// vectorise without -ffast-math (it keeps each partial sum's order).
inline constexpr int64_t kLanes = 16;
template <class F>
inline float lane_sum(int64_t n, F&& f) {
  float acc[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int64_t k = 0; k < kLanes; ++k) acc[k] += f(j + k);
  for (; j < n; ++j) acc[0] += f(j);
  float total = 0.f;
  for (int64_t k = 0; k < kLanes; ++k) total += acc[k];
  return total;
}

// Rows per parallel task: about 16 K elements.
inline int64_t grain_rows(int64_t C) { return std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(C, 1)); }

// The row and element loops, cloned per ISA where GCC can (ifunc: the best for the running
// CPU is picked at load), so they vectorise with AVX2/AVX-512 without the user's -m flags.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && __GNUC__ >= 11
#define MEMOPT_FUSED_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MEMOPT_FUSED_CLONES
#endif

// ---- RMSNorm: y = w · T(x · rstd), rstd = 1 / sqrt(mean(x²) + eps) in fp32 ----

template <class T, class W, class O>
MEMOPT_FUSED_CLONES void rms_norm_forward_rows(const T* x, const W* w, O* y, float* rstd, int64_t begin,
                                               int64_t end, int64_t C, float eps) {
  for (int64_t r = begin; r < end; ++r) {
    const T* xr = x + r * C;
    O* yr = y + r * C;
    const float ss = lane_sum(C, [xr](int64_t j) {
      const float v = to_float(xr[j]);
      return v * v;
    });
    const float s = 1.f / std::sqrt(ss / static_cast<float>(C) + eps);
    rstd[r] = s;
    for (int64_t j = 0; j < C; ++j)
      yr[j] = from_float<O>(to_float(w[j]) * round_to<T>(to_float(xr[j]) * s));
  }
}

// The C++ type of promote(A, B) for two kernel types: fp32 if either is, else bf16.
template <class A, class B>
using Promoted = std::conditional_t<std::is_same_v<A, float> || std::is_same_v<B, float>, float, A>;

// dx = rstd · (g − xn · mean(g · xn)) with g = T(P(dy · w)) and xn = x · rstd, P the dtype of
// the product w · T(xn) (an output rounded further, to O, passes its gradient through as it
// is); dw += Σ_rows dy · T(xn). g: C floats of scratch.
template <class T, class W, class O>
MEMOPT_FUSED_CLONES void rms_norm_backward_rows(const O* dy, const T* x, const W* w, const float* rstd, T* dx,
                                                float* dw, float* g, int64_t begin, int64_t end, int64_t C) {
  using P = Promoted<T, W>;
  for (int64_t r = begin; r < end; ++r) {
    const O* dyr = dy + r * C;
    const T* xr = x + r * C;
    const float s = rstd[r];
    for (int64_t j = 0; j < C; ++j) {
      const float d = to_float(dyr[j]);
      g[j] = round_to<T>(round_to<P>(d * to_float(w[j])));
      dw[j] += d * round_to<T>(to_float(xr[j]) * s);
    }
    const float mean = lane_sum(C, [&](int64_t j) { return g[j] * to_float(xr[j]) * s; }) /
                       static_cast<float>(C);
    T* dxr = dx + r * C;
    for (int64_t j = 0; j < C; ++j) dxr[j] = from_float<T>(s * (g[j] - to_float(xr[j]) * s * mean));
  }
}

template <class T, class W, class O>
void rms_norm_forward(const T* x, const W* w, O* y, float* rstd, int64_t rows, int64_t C, float eps) {
  parallel_chunks(rows, grain_rows(C), [&](int64_t begin, int64_t end, int64_t) {
    rms_norm_forward_rows(x, w, y, rstd, begin, end, C, eps);
  });
}

// fn(begin, end, dw_part, scratch) over chunks of `rows` rows of width C in parallel, each chunk
// with C floats of its own partial weight gradient (zeroed) and C of scratch; then dw (C) += the
// partials, in chunk order (the same sum whichever threads ran them).
template <class F>
void rows_with_weight_grad(int64_t rows, int64_t C, float* dw, const F& fn) {
  const int64_t chunks = parallel_chunk_count(rows, grain_rows(C));
  std::vector<float> partial(static_cast<size_t>(chunks * C), 0.f);  // per-chunk dw
  std::vector<float> scratch(static_cast<size_t>(chunks * C));        // per-chunk row scratch
  parallel_chunks(rows, grain_rows(C), [&](int64_t begin, int64_t end, int64_t chunk) {
    fn(begin, end, partial.data() + chunk * C, scratch.data() + chunk * C);
  });
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t j = 0; j < C; ++j) dw[j] += partial[c * C + j];
}

template <class T, class W, class O>
void rms_norm_backward(const O* dy, const T* x, const W* w, const float* rstd, T* dx, float* dw, int64_t rows,
                       int64_t C) {
  rows_with_weight_grad(rows, C, dw, [&](int64_t begin, int64_t end, float* dw_part, float* g) {
    rms_norm_backward_rows(dy, x, w, rstd, dx, dw_part, g, begin, end, C);
  });
}

// ---- SwiGLU: y = T(T(silu(g)) · u) ----

inline constexpr int64_t kGrainElements = int64_t{1} << 14;

template <class T>
MEMOPT_FUSED_CLONES void swiglu_forward_range(const T* g, const T* u, T* y, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const float a = to_float(g[i]);
    y[i] = from_float<T>(round_to<T>(a * sigmoid(a)) * to_float(u[i]));
  }
}

// du = T(dy · T(silu(g))); dg = T(T(dy · u) · σ(g)(1 + g(1 − σ(g)))).
template <class T>
MEMOPT_FUSED_CLONES void swiglu_backward_range(const T* dy, const T* g, const T* u, T* dg, T* du, int64_t begin,
                                               int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const float a = to_float(g[i]), d = to_float(dy[i]);
    const float sg = sigmoid(a);
    du[i] = from_float<T>(d * round_to<T>(a * sg));
    dg[i] = from_float<T>(round_to<T>(d * to_float(u[i])) * (sg * (1.f + a * (1.f - sg))));
  }
}

template <class T>
void swiglu_forward(const T* g, const T* u, T* y, int64_t n) {
  parallel_chunks(n, kGrainElements,
                  [&](int64_t begin, int64_t end, int64_t) { swiglu_forward_range(g, u, y, begin, end); });
}

template <class T>
void swiglu_backward(const T* dy, const T* g, const T* u, T* dg, T* du, int64_t n) {
  parallel_chunks(n, kGrainElements,
                  [&](int64_t begin, int64_t end, int64_t) { swiglu_backward_range(dy, g, u, dg, du, begin, end); });
}

// Calls fn with a null pointer of the C++ type of `dtype` (fp32 or bf16).
template <class Fn>
void with_type(c10::ScalarType dtype, Fn&& fn) {
  if (dtype == torch::kFloat) {
    fn(static_cast<float*>(nullptr));
  } else {
    fn(static_cast<c10::BFloat16*>(nullptr));
  }
}

inline bool kernel_dtype(c10::ScalarType t) { return t == torch::kFloat || t == torch::kBFloat16; }

/// A tensor the kernels take: a contiguous fp32 or bf16 CPU tensor.
inline bool kernel_tensor(const torch::Tensor& t) {
  return t.is_cpu() && kernel_dtype(t.scalar_type()) && t.is_contiguous();
}

/// Two kernel tensors of one dtype and shape (SwiGLU's g and u, dropout-add's x and r).
inline bool kernel_pair(const torch::Tensor& a, const torch::Tensor& b) {
  return kernel_tensor(a) && kernel_tensor(b) && a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes();
}

/// fn(static_cast<A*>(nullptr), static_cast<B*>(nullptr), static_cast<C*>(nullptr)) for the
/// C++ types of three kernel dtypes.
template <class Fn>
void with_types(c10::ScalarType a, c10::ScalarType b, c10::ScalarType c, Fn&& fn) {
  with_type(a, [&](auto* ta) { with_type(b, [&](auto* tb) { with_type(c, [&](auto* tc) { fn(ta, tb, tc); }); }); });
}

/// The same for four kernel dtypes.
template <class Fn>
void with_types(c10::ScalarType a, c10::ScalarType b, c10::ScalarType c, c10::ScalarType d, Fn&& fn) {
  with_types(a, b, c, [&](auto* ta, auto* tb, auto* tc) { with_type(d, [&](auto* td) { fn(ta, tb, tc, td); }); });
}

class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  // out_type: the output's dtype (fp32 or bf16); -1: promote(x, w).
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w,
                               double eps, int64_t out_type_or_promote) {
    const int64_t C = x.size(-1), rows = x.numel() / std::max<int64_t>(C, 1);
    const auto out_type = out_type_or_promote < 0 ? at::promote_types(x.scalar_type(), w.scalar_type())
                                                  : static_cast<c10::ScalarType>(out_type_or_promote);
    auto y = torch::empty(x.sizes(), x.options().dtype(out_type));
    auto rstd = torch::empty({rows}, x.options().dtype(torch::kFloat));
    with_types(x.scalar_type(), w.scalar_type(), out_type, [&](auto* t, auto* wt, auto* ot) {
      using T = std::remove_pointer_t<decltype(t)>;
      using W = std::remove_pointer_t<decltype(wt)>;
      using O = std::remove_pointer_t<decltype(ot)>;
      rms_norm_forward(x.data_ptr<T>(), w.data_ptr<W>(), y.data_ptr<O>(), rstd.data_ptr<float>(), rows, C,
                       static_cast<float>(eps));
    });
    ctx->save_for_backward({x, w, rstd});
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &w = saved[1], &rstd = saved[2];
    const auto dy = grads[0].contiguous();
    const int64_t C = x.size(-1), rows = x.numel() / std::max<int64_t>(C, 1);
    auto dx = torch::empty_like(x);
    auto dw = torch::zeros({C}, w.options().dtype(torch::kFloat));
    with_types(x.scalar_type(), w.scalar_type(), dy.scalar_type(), [&](auto* t, auto* wt, auto* ot) {
      using T = std::remove_pointer_t<decltype(t)>;
      using W = std::remove_pointer_t<decltype(wt)>;
      using O = std::remove_pointer_t<decltype(ot)>;
      rms_norm_backward(dy.data_ptr<O>(), x.data_ptr<T>(), w.data_ptr<W>(), rstd.data_ptr<float>(), dx.data_ptr<T>(),
                        dw.data_ptr<float>(), rows, C);
    });
    return {dx, dw.to(w.scalar_type()), torch::Tensor(), torch::Tensor()};
  }
};

// ---- RoPE: y = T(x · cos + rotate_half(x) · sin), rotate_half(x) = (−x₂, x₁) over the halves ----

// Rows of D (b, t, h) in a (B, T, heads, D) tensor; cos/sin (T, D) fp32. sign +1 applies the
// rotation (forward), −1 its transpose (backward: dx = dy · cos + rotate_halfᵀ(dy · sin)).
template <class T>
MEMOPT_FUSED_CLONES void rope_rows(const T* x, const float* cos, const float* sin, T* y, int64_t begin, int64_t end,
                                   int64_t T_len, int64_t heads, int64_t D, float sign) {
  const int64_t half = D / 2;
  for (int64_t r = begin; r < end; ++r) {
    const int64_t t = (r / heads) % T_len;
    const T* xr = x + r * D;
    T* yr = y + r * D;
    const float* c = cos + t * D;
    const float* s = sin + t * D;
    // forward: y₁ = x₁c₁ − x₂s₁, y₂ = x₂c₂ + x₁s₂; backward: dx₁ = dy₁c₁ + dy₂s₂, dx₂ = dy₂c₂ − dy₁s₁.
    const float* s_first = sign > 0 ? s : s + half;
    const float* s_second = sign > 0 ? s + half : s;
    for (int64_t j = 0; j < half; ++j)
      yr[j] = from_float<T>(to_float(xr[j]) * c[j] - sign * to_float(xr[j + half]) * s_first[j]);
    for (int64_t j = 0; j < half; ++j)
      yr[half + j] = from_float<T>(to_float(xr[half + j]) * c[half + j] + sign * to_float(xr[j]) * s_second[j]);
  }
}

// x (B, T, heads, D) contiguous -> the rotated copy, same layout.
inline torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, float sign) {
  auto y = torch::empty_like(x);
  const int64_t T_len = x.size(1), heads = x.size(2), D = x.size(3), rows = x.numel() / D;
  with_type(x.scalar_type(), [&](auto* t) {
    using T = std::remove_pointer_t<decltype(t)>;
    parallel_chunks(rows, grain_rows(D), [&](int64_t begin, int64_t end, int64_t) {
      rope_rows(x.data_ptr<T>(), cos.data_ptr<float>(), sin.data_ptr<float>(), y.data_ptr<T>(), begin, end, T_len,
                heads, D, sign);
    });
  });
  return y;
}

class RopeFunction : public torch::autograd::Function<RopeFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q,
                                                const torch::Tensor& k, const torch::Tensor& cos,
                                                const torch::Tensor& sin) {
    ctx->save_for_backward({cos, sin});  // the tables only: the rotation needs no activation
    return {rope(q, cos, sin, 1.f), rope(k, cos, sin, 1.f)};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto back = [&](const torch::Tensor& g) {
      return g.defined() ? rope(g.contiguous(), saved[0], saved[1], -1.f) : g;
    };
    return {back(grads[0]), back(grads[1]), torch::Tensor(), torch::Tensor()};
  }
};

class SwigluFunction : public torch::autograd::Function<SwigluFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& g, const torch::Tensor& u) {
    auto y = torch::empty_like(g);
    with_type(g.scalar_type(), [&](auto* t) {
      using T = std::remove_pointer_t<decltype(t)>;
      swiglu_forward(g.data_ptr<T>(), u.data_ptr<T>(), y.data_ptr<T>(), g.numel());
    });
    ctx->save_for_backward({g, u});
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &g = saved[0], &u = saved[1];
    const auto dy = grads[0].to(g.scalar_type()).contiguous();
    auto dg = torch::empty_like(g), du = torch::empty_like(u);
    with_type(g.scalar_type(), [&](auto* t) {
      using T = std::remove_pointer_t<decltype(t)>;
      swiglu_backward(dy.data_ptr<T>(), g.data_ptr<T>(), u.data_ptr<T>(), dg.data_ptr<T>(), du.data_ptr<T>(),
                      g.numel());
    });
    return {dg, du};
  }
};

}  // namespace memopt::detail::fused

namespace memopt::nn {

/// The composite RMSNorm of nn/rmsnorm.hpp: w · T(x · rsqrt(mean(x²) + eps)), in fp32, T = x's dtype.
inline torch::Tensor rms_norm_composite(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  auto h = x.to(torch::kFloat);
  h = h * torch::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return w * h.to(x.scalar_type());
}

/// RMSNorm over the last dimension, fused (one pass each way) for contiguous fp32/bf16 CPU
/// tensors, the composite otherwise. x (..., C), w (C) -> (..., C) in promote(x, w), or in
/// `out` (fp32 or bf16): the fp32 result rounded once, as a cast after it would.
inline torch::Tensor fused_rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps,
                                    std::optional<c10::ScalarType> out = std::nullopt) {
  namespace f = memopt::detail::fused;
  const bool kernel = f::kernel_tensor(x) && f::kernel_tensor(w) && w.dim() == 1 && x.dim() >= 1 &&
                      x.size(-1) == w.size(0) && (!out || f::kernel_dtype(*out));
  if (!kernel) return out ? rms_norm_composite(x, w, eps).to(*out) : rms_norm_composite(x, w, eps);
  return f::RmsNormFunction::apply(x, w, eps, out ? static_cast<int64_t>(*out) : int64_t{-1});
}

/// silu(g) · u, fused (one pass each way, keeps g and u only) for contiguous fp32/bf16 CPU
/// tensors of one shape and dtype, the composite otherwise. g, u (..., F) -> (..., F).
inline torch::Tensor fused_swiglu(const torch::Tensor& g, const torch::Tensor& u) {
  namespace f = memopt::detail::fused;
  if (!f::kernel_pair(g, u)) return torch::silu(g) * u;
  return memopt::detail::fused::SwigluFunction::apply(g, u);
}

/// RoPE on q (B, T, H, D) and k (B, T, KV, D), as projections make them, with cos/sin (T, D)
/// fp32: returns the rotated q and k as (B, H, T, D) and (B, KV, T, D) (transposed views, as
/// attention takes them). One pass each way for contiguous fp32/bf16 CPU inputs, keeping
/// nothing but the tables; nn/rope.hpp's apply_rope_qk otherwise.
inline std::pair<torch::Tensor, torch::Tensor> fused_rope(const torch::Tensor& q, const torch::Tensor& k,
                                                          const torch::Tensor& cos, const torch::Tensor& sin) {
  namespace f = memopt::detail::fused;
  auto fits = [&](const torch::Tensor& x) {
    return f::kernel_tensor(x) && x.dim() == 4 && x.size(3) % 2 == 0 && cos.dim() == 2 && cos.size(0) == x.size(1) && cos.size(1) == x.size(3);
  };
  const bool tables = cos.is_cpu() && sin.is_cpu() && cos.scalar_type() == torch::kFloat &&
                      sin.scalar_type() == torch::kFloat && cos.is_contiguous() && sin.is_contiguous() &&
                      cos.sizes() == sin.sizes();
  if (!(tables && fits(q) && fits(k) && q.scalar_type() == k.scalar_type())) return apply_rope_qk(q, k, cos, sin);
  const auto out = f::RopeFunction::apply(q, k, cos, sin);
  return {out[0].transpose(1, 2), out[1].transpose(1, 2)};
}

}  // namespace memopt::nn
