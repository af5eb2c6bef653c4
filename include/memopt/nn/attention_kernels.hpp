// memopt/nn/attention_kernels.hpp — the attention computations, as functions of q, k and v
// (B, H, T, D) with grouped KV heads: attention_math keeps the (T, T) scores (the reference;
// dropout); attention_sdpa calls LibTorch 2.x's scaled_dot_product_attention (its flash kernel
// on the CPU: memory linear in T); attention_blockwise is memopt's FlashAttention-2 (online
// softmax over query and key blocks, scores recomputed in backward from the saved
// log-sum-exp, grouped KV heads never repeated), which also runs causal attention with key
// padding, where SDPA would need a (T, T) mask. Which one runs on a shape: attention_choice.hpp
// measures it; docs/memory_levers.md has the figures. The module is nn/attention.hpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>
#include <ATen/ThreadLocalState.h>
#include <torch/torch.h>

#include "memopt/detail/autocast.hpp"

namespace memopt::nn {

/// softmax(q kᵀ / sqrt(D) + mask) v for q (B, H, T, D), k and v (B, H, Tk, D).
/// The softmax runs in fp32; dropout applies to the probabilities when p > 0.
/// key_padding_mask (B, Tk) bool, true = a real token: padded keys get no weight, and a
/// query left with no key (all padded, or all before it when causal) outputs 0.
///   auto y = memopt::nn::attention_math(q, k, v, /*causal=*/true, 0.0, false);  // (B, H, T, D)
inline torch::Tensor attention_math(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                    bool causal, double dropout, bool training,
                                    const torch::Tensor& key_padding_mask = {}) {
  const int64_t T = q.size(2);
  auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(-1)));  // (B, H, T, Tk)
  const auto bool_opts = torch::TensorOptions().dtype(torch::kBool).device(q.device());
  if (!key_padding_mask.defined()) {
    if (causal) {
      auto future = torch::ones({T, T}, bool_opts).triu(1);
      scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
    }
    auto probs = torch::softmax(scores, -1, torch::kFloat).to(q.scalar_type());  // (B, H, T, T)
    probs = torch::dropout(probs, dropout, training);
    return torch::matmul(probs, v);  // (B, H, T, D)
  }
  const int64_t B = k.size(0), Tk = k.size(2);
  auto blocked = key_padding_mask.logical_not().view({B, 1, 1, Tk});          // (B, 1, 1, Tk)
  if (causal) blocked = blocked.logical_or(torch::ones({T, Tk}, bool_opts).triu(1));  // (B, 1, T, Tk)
  // Rows with no key left keep their scores (a finite softmax, so finite gradients) and
  // get zero probabilities afterwards.
  auto dead = blocked.all(-1, /*keepdim=*/true);  // (B, 1, T or 1, 1)
  scores = scores.masked_fill(blocked.logical_and(dead.logical_not()), -std::numeric_limits<float>::infinity());
  auto probs = torch::softmax(scores, -1, torch::kFloat).masked_fill(dead, 0.0).to(q.scalar_type());  // (B, H, T, Tk)
  probs = torch::dropout(probs, dropout, training);
  return torch::matmul(probs, v);  // (B, H, T, D)
}

/// Which attention the Attention module runs.
enum class AttentionKind {
  kMath,       ///< attention_math: (B, H, T, T) scores in memory; supports dropout.
  kBlockwise,  ///< attention_blockwise: memory linear in T; no dropout.
  kSdpa,       ///< attention_sdpa: LibTorch's SDPA (CPU flash kernel), memory linear in T.
  kAuto,       ///< attention_auto: the fastest of kBlockwise, kSdpa and kFlash on each shape, measured here.
  kFlash,      ///< attention_flash (nn/attention_flash.hpp): memopt's brgemm flash attention (CPU).
};

/// "math", "blockwise", "sdpa", "auto" or "flash": the kind's name on command lines and in logs.
inline const char* attention_kind_name(AttentionKind kind) {
  switch (kind) {
    case AttentionKind::kMath: return "math";
    case AttentionKind::kBlockwise: return "blockwise";
    case AttentionKind::kSdpa: return "sdpa";
    case AttentionKind::kAuto: return "auto";
    case AttentionKind::kFlash: return "flash";
  }
  return "?";
}

/// The kind attention_kind_name names; an error naming `who` and the value otherwise.
///   auto kind = memopt::nn::parse_attention_kind("auto", "--attention");
inline AttentionKind parse_attention_kind(const std::string& name, const std::string& who) {
  for (auto kind : {AttentionKind::kMath, AttentionKind::kBlockwise, AttentionKind::kSdpa, AttentionKind::kAuto,
                    AttentionKind::kFlash})
    if (name == attention_kind_name(kind)) return kind;
  TORCH_CHECK(false, who, " must be math, blockwise, sdpa, flash or auto (got '", name, "'). HINT: sdpa, flash and "
              "blockwise keep memory linear in the sequence length, auto measures which is fastest; math is the only "
              "one with attention dropout under key padding and causality");
}

/// Default blocks of attention_blockwise (query and key positions per head). At B=1, H=8,
/// D=64, L=4096, causal, fp32, 2 threads (benchmarks/nn/attention_bench.cpp) 128 and 256
/// ran within noise of each other (~0.7-0.9 s on a quiet machine) and 512 about 2x slower
/// (its score blocks leave the cache); 256 makes the fewest ops of the two.
inline constexpr int64_t kAttentionQBlock = 256;
inline constexpr int64_t kAttentionKvBlock = 256;

/// Options of attention_blockwise.
///   memopt::nn::BlockwiseAttentionOptions().causal(false).key_padding_mask(mask)
struct BlockwiseAttentionOptions {
  TORCH_ARG(bool, causal) = true;
  /// Query positions per block.
  TORCH_ARG(int64_t, q_block) = kAttentionQBlock;
  /// Key positions per block.
  TORCH_ARG(int64_t, kv_block) = kAttentionKvBlock;
  /// (B, Tk) bool, true = a real token; undefined: no padding.
  TORCH_ARG(torch::Tensor, key_padding_mask) = {};
};

}  // namespace memopt::nn

namespace memopt::detail {

// A key padding mask must be bool (B, Tk) for keys k (B, KV, Tk, D); `who` names the caller.
inline void check_key_padding_mask(const torch::Tensor& mask, const torch::Tensor& k, const char* who) {
  TORCH_CHECK(mask.scalar_type() == torch::kBool && mask.dim() == 2 && mask.size(0) == k.size(0) &&
                  mask.size(1) == k.size(2),
              who, ": key_padding_mask must be bool (B, Tk) = (", k.size(0), ", ", k.size(2), ") (got ",
              mask.scalar_type(), " ", mask.sizes(), "). HINT: true marks a real token.");
}

// The dtype x's matmuls run in: autocast's when autocast is on for x's device, else x's.
inline c10::ScalarType matmul_dtype(const torch::Tensor& x) {
  const auto state = AutocastState::current(x.device().type());
  return state.enabled && x.is_floating_point() ? state.dtype : x.scalar_type();
}

// Autocast off on `device` (the fused kernels pick every dtype themselves).
inline AutocastState autocast_off(c10::DeviceType device) {
  auto state = AutocastState::current(device);
  state.enabled = false;
  return state;
}

// A contiguous (n0, n1, n2) view of the front of a flat buffer: one allocation serves
// every block, the smaller edge blocks included.
inline torch::Tensor view_front(const torch::Tensor& flat, int64_t n0, int64_t n1, int64_t n2) {
  return flat.narrow(0, 0, n0 * n1 * n2).view({n0, n1, n2});
}

// acc (fp32) += a @ b: in place when a and b are fp32, else through their dtype's product.
inline void add_bmm(const torch::Tensor& acc, const torch::Tensor& a, const torch::Tensor& b) {
  if (a.scalar_type() == acc.scalar_type()) {
    acc.baddbmm_(a, b);
  } else {
    acc.add_(torch::bmm(a, b));
  }
}

// Geometry of attention_blockwise. Queries live as rows (B·KV, T·G, D), G = H / KV: row
// t·G + g holds head kv·G + g at position t, so one query block of the G heads sharing a
// KV head is one contiguous bmm operand against that head's keys (B·KV, Tk, D).
struct BlockwisePlan {
  int64_t B, H, KV, G, Tq, Tk, D, q_block, kv_block;
  bool causal;
  torch::Tensor key_blocked;                    // (B, Tk) bool, true = padded; undefined: none
  std::vector<uint8_t> kv_has_pad, kv_all_pad;  // per key block

  BlockwisePlan(int64_t B, int64_t H, int64_t KV, int64_t Tq, int64_t Tk, int64_t D,
                const c10::optional<torch::Tensor>& mask, bool causal, int64_t q_block, int64_t kv_block)
      : B(B), H(H), KV(KV), G(H / KV), Tq(Tq), Tk(Tk), D(D), q_block(q_block), kv_block(kv_block), causal(causal) {
    if (!mask) return;
    key_blocked = mask->logical_not();  // (B, Tk)
    std::vector<torch::Tensor> flags;   // per key block: any padded, all padded
    for (int64_t j0 = 0; j0 < Tk; j0 += kv_block) {
      const auto block = key_blocked.narrow(1, j0, std::min(kv_block, Tk - j0));
      flags.push_back(block.any());
      flags.push_back(block.all());
    }
    // One read of the device for every block (a GPU's one host sync), not two per block.
    const auto host = torch::stack(flags).to(torch::kCPU);  // (2 · blocks,)
    const bool* f = host.data_ptr<bool>();
    for (int64_t b = 0; b < host.numel(); b += 2) {
      kv_has_pad.push_back(f[b]);
      kv_all_pad.push_back(f[b + 1]);
    }
  }

  int64_t BK() const { return B * KV; }
  // Rows of the B·KV batch per task: few enough that a task's score block stays in cache
  // (kBlockElems fp32 values) and that num_blocks block rows make about 4 tasks per thread.
  int64_t batch_slice(int64_t num_blocks) const {
    constexpr int64_t kBlockElems = int64_t{1} << 17;  // 512 KiB of fp32 scores
    const int64_t block = G * std::min(q_block, Tq) * std::min(kv_block, Tk);
    const int64_t want_slices = (4 * std::max(1, at::get_num_threads()) + num_blocks - 1) / num_blocks;
    const int64_t per_task = std::min((BK() + want_slices - 1) / want_slices, kBlockElems / block);
    return std::clamp<int64_t>(per_task, 1, BK());
  }
  bool all_padded(int64_t j0) const { return key_blocked.defined() && kv_all_pad[j0 / kv_block]; }
  // Causal: key block [j0, …) lies after every query of the block ending at i1.
  bool in_future(int64_t i1, int64_t j0) const { return causal && j0 > i1 - 1; }

  // (B, T, H, E) -> rows (B·KV, T·G, E), a contiguous copy.
  torch::Tensor to_rows(const torch::Tensor& x) const {
    const int64_t E = x.size(-1);
    auto rows = torch::empty({B, KV, Tq, G, E}, x.options());
    rows.copy_(x.reshape({B, Tq, KV, G, E}).permute({0, 2, 1, 3, 4}));
    return rows.view({B * KV, Tq * G, E});
  }
  // rows (B·KV, T·G, D) -> (B, T, H, D), contiguous, in `dtype`.
  torch::Tensor from_rows(const torch::Tensor& rows, c10::ScalarType dtype) const {
    auto out = torch::empty({B, Tq, H, D}, rows.options().dtype(dtype));
    out.view({B, Tq, KV, G, D}).permute({0, 2, 1, 3, 4}).copy_(rows.view({B, KV, Tq, G, D}));
    return out;
  }

  // Sets the blocked scores of the block (queries [i0, i1), keys [j0, j1)) to -inf;
  // p is (nb, G·(i1 - i0), j1 - j0) for rows [b0, b0 + nb) of the B·KV batch.
  void mask(const torch::Tensor& p, int64_t b0, int64_t i0, int64_t i1, int64_t j0, int64_t j1) const {
    const double inf = std::numeric_limits<double>::infinity();
    if (causal && j1 - 1 > i0) {  // the block crosses the diagonal
      const auto opts = torch::TensorOptions().dtype(torch::kLong).device(p.device());
      const auto pos = torch::arange(i0, i1, opts).repeat_interleave(G);                 // (rows) each row's position
      p.masked_fill_(torch::arange(j0, j1, opts).unsqueeze(0) > pos.unsqueeze(1), -inf);  // (rows, cols)
    }
    if (key_blocked.defined() && kv_has_pad[j0 / kv_block]) {
      const int64_t cols = j1 - j0, nb = p.size(0);
      const auto batch = torch::arange(b0, b0 + nb, key_blocked.options().dtype(torch::kLong)).div_(KV, "floor");
      const auto blocked = key_blocked.narrow(1, j0, cols).index_select(0, batch);  // (nb, cols)
      p.masked_fill_(blocked.unsqueeze(1), -inf);
    }
  }
};

// Runs task(t, slot) for t in [0, n) on LibTorch's intra-op threads in one parallel region
// (slot: the thread, < at::get_num_threads(); the ops inside a task run single-threaded,
// BLAS included, under the caller's grad, inference and autocast state), or in order in
// slot 0 with one thread, off the CPU, or when already in a parallel region. Thousands of
// small two-thread ops stall on a loaded machine (each waits for a descheduled thread);
// one region per pass does not. TensorIterator::for_each is LibTorch's compiled parallel
// loop, so this needs no OpenMP flags in the user's build.
inline void parallel_tasks(int64_t n, bool on_cpu, const std::function<void(int64_t, int64_t)>& task) {
  if (!on_cpu || n <= 1 || at::get_num_threads() <= 1 || at::in_parallel_region()) {
    for (int64_t t = 0; t < n; ++t) task(t, 0);
    return;
  }
  const auto ids = torch::arange(n, torch::kLong);
  auto sink = torch::empty({n}, torch::kLong);
  auto iter = at::TensorIteratorConfig().add_output(sink).add_input(ids).build();
  const at::ThreadLocalState caller_state;
  iter.for_each(
      [&](char** data, const int64_t* strides, int64_t size) {
        at::ThreadLocalStateGuard same_state(caller_state);
        const int64_t slot = at::get_thread_num();
        for (int64_t i = 0; i < size; ++i) task(*reinterpret_cast<const int64_t*>(data[1] + i * strides[1]), slot);
      },
      /*grain_size=*/1);
}

// The p-th of n blocks in the order 0, n-1, 1, n-2, …: any run of consecutive positions
// pairs cheap causal blocks with dear ones, so the threads' contiguous shares balance.
inline int64_t zigzag(int64_t p, int64_t n) { return p % 2 == 0 ? p / 2 : n - 1 - p / 2; }

// attention_blockwise's autograd Function. Inputs q (B, Tq, H, D), k and v (B, KV, Tk, D)
// in one dtype, output (B, Tq, H, D) in that dtype. Forward saves the scaled query rows,
// k, v, the output and the fp32 log-sum-exp (B·KV, Tq·G, 1), nothing of size T². The
// mask travels as an optional (a non-variable argument: no gradient, maybe absent).
// Work is split in tasks of one block row (forward: a query block; backward: a key
// block) for a slice of the B·KV batch, run in parallel (parallel_tasks).
struct BlockwiseAttentionFunction : torch::autograd::Function<BlockwiseAttentionFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const c10::optional<torch::Tensor>& key_padding_mask,
                               bool causal, int64_t q_block, int64_t kv_block) {
    AutocastGuard no_autocast(autocast_off(q.device().type()));
    const BlockwisePlan plan(q.size(0), q.size(2), k.size(1), q.size(1), k.size(2), q.size(3), key_padding_mask,
                             causal, q_block, kv_block);
    const int64_t BK = plan.BK(), G = plan.G, Tq = plan.Tq, Tk = plan.Tk, D = plan.D;
    const auto f32 = q.options().dtype(torch::kFloat);
    const bool fp32 = q.scalar_type() == torch::kFloat;
    const double inf = std::numeric_limits<double>::infinity();

    // Detached: the tasks run on threads whose grad mode is on, and must record nothing.
    auto qs = plan.to_rows(q.detach()).mul_(1.0 / std::sqrt(static_cast<double>(D)));  // (B·KV, Tq·G, D) q/sqrt(D)
    const auto kc = k.detach().reshape({BK, Tk, D});                                    // (B·KV, Tk, D)
    const auto vc = v.detach().reshape({BK, Tk, D});                                    // (B·KV, Tk, D)
    auto out = torch::zeros({BK, Tq * G, D}, f32);                                      // (B·KV, Tq·G, D)
    auto lse = torch::empty({BK, Tq * G, 1}, f32);                                      // (B·KV, Tq·G, 1)

    const int64_t num_q = (Tq + q_block - 1) / q_block;
    const int64_t per_task = plan.batch_slice(num_q);
    const int64_t slices = (BK + per_task - 1) / per_task;
    parallel_tasks(num_q * slices, q.device().is_cpu(), [&](int64_t task, int64_t) {
      const int64_t i0 = zigzag(task / slices, num_q) * q_block, i1 = std::min(i0 + q_block, Tq);
      const int64_t b0 = task % slices * per_task, nb = std::min(per_task, BK - b0), rows = G * (i1 - i0);
      const auto qb = qs.narrow(0, b0, nb).narrow(1, i0 * G, rows);   // (nb, rows, D)
      const auto acc = out.narrow(0, b0, nb).narrow(1, i0 * G, rows);  // (nb, rows, D)
      const int64_t block_numel = nb * rows * std::min(kv_block, Tk);
      auto s_buf = torch::empty({block_numel}, q.options());          // scores in the input dtype
      auto p_buf = fp32 ? s_buf : torch::empty({block_numel}, f32);  // probabilities in fp32
      auto m = torch::full({nb, rows, 1}, -inf, f32);  // running max of the scores
      auto l = torch::zeros({nb, rows, 1}, f32);       // running sum of exp(score - m)
      for (int64_t j0 = 0; j0 < Tk && !plan.in_future(i1, j0); j0 += kv_block) {
        if (plan.all_padded(j0)) continue;
        const int64_t j1 = std::min(j0 + kv_block, Tk), cols = j1 - j0;
        auto s = view_front(s_buf, nb, rows, cols);
        torch::bmm_out(s, qb, kc.narrow(0, b0, nb).narrow(1, j0, cols).transpose(1, 2));  // (nb, rows, cols)
        auto p = fp32 ? s : view_front(p_buf, nb, rows, cols).copy_(s);
        plan.mask(p, b0, i0, i1, j0, j1);
        auto m_new = torch::maximum(m, p.amax(-1, /*keepdim=*/true));  // (nb, rows, 1)
        auto shift = m_new.masked_fill(m_new.isinf(), 0.0);            // 0 on rows with no key yet
        p.sub_(shift).exp_();                                          // (nb, rows, cols)
        auto correction = (m - shift).exp_();                          // rescales what came before
        l.mul_(correction).add_(p.sum(-1, /*keepdim=*/true));
        acc.mul_(correction);
        add_bmm(acc, fp32 ? p : s.copy_(p), vc.narrow(0, b0, nb).narrow(1, j0, cols));  // += P V
        m = std::move(m_new);
      }
      // l >= 1 on every row that saw a key; a row with none keeps output 0 and gets
      // lse = +inf, so backward's exp(score - lse) is 0 there.
      lse.narrow(0, b0, nb).narrow(1, i0 * G, rows).copy_((m + l.log()).masked_fill_(l.eq(0), inf));
      acc.div_(l.clamp_min(1.0));
    });

    auto y = plan.from_rows(out, q.scalar_type());  // (B, Tq, H, D)
    ctx->save_for_backward({qs, kc, vc, y, lse});
    if (key_padding_mask) ctx->saved_data["key_padding_mask"] = *key_padding_mask;
    ctx->saved_data["shape"] = std::vector<int64_t>{plan.B, plan.H, plan.KV, Tq, Tk, D, q_block, kv_block};
    ctx->saved_data["causal"] = causal;
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto qs = saved[0].detach(), kc = saved[1].detach(), vc = saved[2].detach();
    const auto y = saved[3].detach(), lse = saved[4].detach();
    const auto s = ctx->saved_data["shape"].toIntVector();
    c10::optional<torch::Tensor> mask;
    if (ctx->saved_data.count("key_padding_mask")) mask = ctx->saved_data["key_padding_mask"].toTensor();
    const BlockwisePlan plan(s[0], s[1], s[2], s[3], s[4], s[5], mask, ctx->saved_data["causal"].toBool(), s[6], s[7]);
    const int64_t BK = plan.BK(), G = plan.G, Tq = plan.Tq, Tk = plan.Tk, D = plan.D;
    const int64_t q_block = plan.q_block, kv_block = plan.kv_block;
    AutocastGuard no_autocast(autocast_off(qs.device().type()));
    const auto f32 = qs.options().dtype(torch::kFloat);
    const bool fp32 = qs.scalar_type() == torch::kFloat;

    const auto dy = grad_outputs[0].detach();                                    // (B, Tq, H, D)
    const auto dout = plan.to_rows(dy.to(qs.scalar_type()));                      // (B·KV, Tq·G, D)
    const auto delta = plan.to_rows((dy.to(torch::kFloat) * y.to(torch::kFloat)).sum(-1, true));  // (B·KV, Tq·G, 1)
    auto dk = torch::zeros({BK, Tk, D}, f32);  // (B·KV, Tk, D)
    auto dv = torch::zeros({BK, Tk, D}, f32);  // (B·KV, Tk, D)
    // dQ gathers from every key block: one fp32 accumulator per thread, summed at the end.
    std::vector<torch::Tensor> dq_parts(std::max(1, at::get_num_threads()));

    const int64_t num_kv = (Tk + kv_block - 1) / kv_block;
    const int64_t per_task = plan.batch_slice(num_kv);
    const int64_t slices = (BK + per_task - 1) / per_task;
    parallel_tasks(num_kv * slices, qs.device().is_cpu(), [&](int64_t task, int64_t slot) {
      const int64_t j0 = zigzag(task / slices, num_kv) * kv_block, j1 = std::min(j0 + kv_block, Tk), cols = j1 - j0;
      if (plan.all_padded(j0)) return;
      const int64_t b0 = task % slices * per_task, nb = std::min(per_task, BK - b0);
      auto& dq = dq_parts[slot];
      if (!dq.defined()) dq = torch::zeros({BK, Tq * G, D}, f32);  // (B·KV, Tq·G, D) of the scaled rows
      const auto kb = kc.narrow(0, b0, nb).narrow(1, j0, cols), vb = vc.narrow(0, b0, nb).narrow(1, j0, cols);
      const auto dkb = dk.narrow(0, b0, nb).narrow(1, j0, cols), dvb = dv.narrow(0, b0, nb).narrow(1, j0, cols);
      const int64_t block_numel = nb * G * std::min(q_block, Tq) * cols;
      auto s_buf = torch::empty({block_numel}, qs.options());          // scores, then P, in the input dtype
      auto dp_buf = torch::empty({block_numel}, qs.options());         // dP, then dS, in the input dtype
      auto p_buf = fp32 ? s_buf : torch::empty({block_numel}, f32);   // P in fp32
      auto ds_buf = fp32 ? dp_buf : torch::empty({block_numel}, f32);  // dS in fp32
      // Causal: start at the query block holding position j0; earlier ones see none of these keys.
      for (int64_t i0 = plan.causal ? j0 / q_block * q_block : 0; i0 < Tq; i0 += q_block) {
        const int64_t i1 = std::min(i0 + q_block, Tq), rows = G * (i1 - i0);
        if (plan.in_future(i1, j0)) continue;
        const auto qb = qs.narrow(0, b0, nb).narrow(1, i0 * G, rows);     // (nb, rows, D)
        const auto dob = dout.narrow(0, b0, nb).narrow(1, i0 * G, rows);  // (nb, rows, D)
        auto sc = view_front(s_buf, nb, rows, cols);
        torch::bmm_out(sc, qb, kb.transpose(1, 2));  // (nb, rows, cols)
        auto p = fp32 ? sc : view_front(p_buf, nb, rows, cols).copy_(sc);
        plan.mask(p, b0, i0, i1, j0, j1);
        p.sub_(lse.narrow(0, b0, nb).narrow(1, i0 * G, rows)).exp_();  // P, as in forward
        const auto pc = fp32 ? p : sc.copy_(p);
        add_bmm(dvb, pc.transpose(1, 2), dob);  // dV += Pᵀ dO
        auto dp = view_front(dp_buf, nb, rows, cols);
        torch::bmm_out(dp, dob, vb.transpose(1, 2));  // dP = dO Vᵀ
        auto ds = fp32 ? dp : view_front(ds_buf, nb, rows, cols).copy_(dp);
        ds.sub_(delta.narrow(0, b0, nb).narrow(1, i0 * G, rows)).mul_(p);  // dS = P ∘ (dP − rowsum(dO ∘ O))
        const auto dsc = fp32 ? ds : dp.copy_(ds);
        add_bmm(dq.narrow(0, b0, nb).narrow(1, i0 * G, rows), dsc, kb);  // dQs += dS K
        add_bmm(dkb, dsc.transpose(1, 2), qb);                           // dK += dSᵀ Qs
      }
    });

    torch::Tensor dq;
    for (auto& part : dq_parts) {
      if (!part.defined()) continue;
      dq = dq.defined() ? dq.add_(part) : part;
      part = torch::Tensor();
    }
    if (!dq.defined()) dq = torch::zeros({BK, Tq * G, D}, f32);  // every key padded
    dq.mul_(1.0 / std::sqrt(static_cast<double>(D)));
    const auto dtype = qs.scalar_type();
    return {plan.from_rows(dq, dtype), dk.view({plan.B, plan.KV, Tk, D}).to(dtype),
            dv.view({plan.B, plan.KV, Tk, D}).to(dtype), torch::Tensor(), torch::Tensor(), torch::Tensor(),
            torch::Tensor()};
  }
};

}  // namespace memopt::detail

namespace memopt::nn {

/// Memory-efficient attention: softmax(q kᵀ / sqrt(D) + mask) v computed over blocks of
/// queries and keys with an online softmax (FlashAttention-2), in fp32 accumulators,
/// never holding more than one (q_block, kv_block) score block per head. Backward
/// recomputes each block's scores from the saved log-sum-exp. q (B, H, Tq, D), k and v
/// (B, KV, Tk, D) with H a multiple of KV (grouped heads are never repeated in memory);
/// causal means key j <= query i. Runs in autocast's dtype when autocast is on, else in
/// q's; returns (B, H, Tq, D) in that dtype. A query with no key left outputs 0.
///   auto y = memopt::nn::attention_blockwise(q, k, v, memopt::nn::BlockwiseAttentionOptions().causal(true));
inline torch::Tensor attention_blockwise(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                         const BlockwiseAttentionOptions& options = {}) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && k.sizes() == v.sizes(),
              "memopt::nn::attention_blockwise: q must be (B, H, T, D) and k, v the same (B, KV, T, D) (got q ",
              q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), "). HINT: heads before time, as in attention_math.");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(3),
              "memopt::nn::attention_blockwise: q and k must share batch and head size (got q ", q.sizes(), ", k ",
              k.sizes(), "). HINT: q (B, H, T, D), k (B, KV, T, D).");
  TORCH_CHECK(k.size(1) >= 1 && q.size(1) % k.size(1) == 0,
              "memopt::nn::attention_blockwise: query heads must be a multiple of KV heads (got ", q.size(1), " and ",
              k.size(1), "). HINT: grouped-query attention shares each KV head among H / KV query heads.");
  TORCH_CHECK(q.is_floating_point() && k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "memopt::nn::attention_blockwise: q, k and v must share one floating dtype (got ", q.scalar_type(), ", ",
              k.scalar_type(), ", ", v.scalar_type(), "). HINT: cast them, or run under autocast.");
  TORCH_CHECK(options.q_block() >= 1 && options.kv_block() >= 1,
              "memopt::nn::attention_blockwise: q_block and kv_block must be >= 1 (got ", options.q_block(), " and ",
              options.kv_block(), "). HINT: the defaults are ", kAttentionQBlock, " and ", kAttentionKvBlock, ".");
  const auto& mask = options.key_padding_mask();
  if (mask.defined()) memopt::detail::check_key_padding_mask(mask, k, "memopt::nn::attention_blockwise");
  const auto dtype = memopt::detail::matmul_dtype(q);
  const auto maybe_mask = mask.defined() ? c10::optional<torch::Tensor>(mask) : c10::nullopt;
  auto y = memopt::detail::BlockwiseAttentionFunction::apply(q.transpose(1, 2).to(dtype), k.to(dtype), v.to(dtype),
                                                     maybe_mask, options.causal(), options.q_block(),
                                                     options.kv_block());
  return y.transpose(1, 2);  // (B, H, Tq, D)
}

/// ATen's scaled_dot_product_attention, with attention_math's conventions: q (B, H, T, D), k
/// and v (B, KV, Tk, D) (grouped heads through enable_gqa, never repeated), key_padding_mask
/// (B, Tk) bool with true = a real token, a batch row with no real key outputs 0. LibTorch
/// 2.x runs its flash kernel (memory linear in T) where it can: no mask, causal or not, or a
/// key padding mask without causality. Causal attention with key padding would need a
/// (T, T) mask, so it runs attention_blockwise instead (dropout must then be 0).
///   auto y = memopt::nn::attention_sdpa(q, k, v, /*causal=*/true, 0.0, false);  // (B, H, T, D)
inline torch::Tensor attention_sdpa(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                    bool causal, double dropout, bool training,
                                    const torch::Tensor& key_padding_mask = {}) {
  const bool gqa = q.size(1) != k.size(1);
  const double p = training ? dropout : 0.0;
  if (!key_padding_mask.defined()) return at::scaled_dot_product_attention(q, k, v, {}, p, causal, {}, gqa);
  if (causal) {
    TORCH_CHECK(p == 0.0, "memopt::nn::attention_sdpa: causal attention with a key padding mask runs the blockwise "
                "path, which has no dropout (got dropout ", dropout, "). HINT: use attention_math for attention "
                "dropout with padding, or set dropout 0.");
    return attention_blockwise(q, k, v, BlockwiseAttentionOptions().causal(true).key_padding_mask(key_padding_mask));
  }
  memopt::detail::check_key_padding_mask(key_padding_mask, k, "memopt::nn::attention_sdpa");
  const int64_t B = k.size(0), Tk = k.size(2);
  // A row with no real key would be all -inf (NaN in SDPA): let it see every key, then zero it.
  const auto alive = key_padding_mask.any(-1).view({B, 1, 1, 1});                    // (B, 1, 1, 1)
  const auto allowed = key_padding_mask.view({B, 1, 1, Tk}).logical_or(alive.logical_not());  // (B, 1, 1, Tk)
  auto y = at::scaled_dot_product_attention(q, k, v, allowed, p, false, {}, gqa);  // (B, H, T, D)
  return y * alive.to(y.scalar_type());
}

/// Repeats each of the KV heads n_rep times: (B, KV, T, D) -> (B, KV·n_rep, T, D).
inline torch::Tensor repeat_kv(const torch::Tensor& x, int64_t n_rep) {
  if (n_rep == 1) return x;
  const auto B = x.size(0), KV = x.size(1), T = x.size(2), D = x.size(3);
  return x.unsqueeze(2).expand({B, KV, n_rep, T, D}).reshape({B, KV * n_rep, T, D});
}

}  // namespace memopt::nn
