// memopt/nn/attention_choice.hpp — AttentionKind::kAuto: of memopt's blockwise attention,
// LibTorch's SDPA and attention_flash (memopt's brgemm flash attention on the CPU; where it runs:
// nn/attention_flash.hpp), whichever is fastest on this shape on this machine, measured rather
// than assumed. None wins everywhere: at D=64, causal, fp32 on two AVX-512 cores, SDPA was 1.5x
// faster than blockwise at T=512 and blockwise 1.2x faster at T=1024
// (benchmarks/results/attention.jsonl), and the order moves with the CPU kind, the dtype and the GPU.
//
// The first call on a shape (device, dtypes, autocast, B, H, KV, Tq, Tk, D, causal, padded)
// times a forward and backward of each on inputs of that shape (one warm-up, the fastest of
// `reps`), keeps the fastest, and remembers it for the rest of the process: every later call on
// the shape, the recompute of a checkpointed block included, runs the same kernel. Where times
// are within `tie` of the fastest, the one that keeps fewer bytes for backward wins, then SDPA
// (LibTorch's own). The probe draws from a generator of its own (the global RNG never
// moves) and its tensors stay out of the tracked peaks.
//
// The choice is per process, and the kernels' results differ in the last bits: a Trainer's
// checkpoint keeps the choices and its resume replays them (memopt/kernel_choices.hpp), so a
// resumed run matches an unbroken one bitwise. Other processes (a new run, an evaluation) measure
// afresh: name kSdpa, kFlash or kBlockwise where bitwise repeatability across them matters.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include "memopt/memory/report.hpp"
#include "memopt/memory/tracker.hpp"
#include "memopt/nn/attention_flash.hpp"
#include "memopt/nn/attention_kernels.hpp"

namespace memopt::nn {

/// What the choice depends on: one attention call's geometry, dtypes and autocast state.
struct AttentionShape {
  c10::DeviceType device = c10::kCPU;
  c10::DeviceIndex device_index = -1;
  c10::ScalarType dtype = c10::kFloat;     // q's (k and v share it)
  c10::ScalarType autocast = c10::kFloat;  // autocast's dtype on the device; q's dtype when off
  int64_t batch = 0, heads = 0, kv_heads = 0, q_len = 0, kv_len = 0, head_dim = 0;
  bool causal = true;
  bool padded = false;  // a key padding mask is given
  // The strides of q, k and v: a (B, T, H, D) projection seen as (B, H, T, D) runs slower in
  // some kernels than a contiguous one, so the probe copies the layout too.
  std::array<int64_t, 4> q_strides{}, k_strides{}, v_strides{};
  // The blockwise kernel's query and key blocks (what it would run with: part of its speed).
  int64_t q_block = kAttentionQBlock, kv_block = kAttentionKvBlock;

  /// The shape of attention(q, k, v): q (B, H, Tq, D), k and v (B, KV, Tk, D); the blockwise
  /// kernel with q_block × kv_block blocks.
  static AttentionShape of(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, bool causal,
                           bool padded, int64_t q_block = kAttentionQBlock, int64_t kv_block = kAttentionKvBlock) {
    auto strides = [](const torch::Tensor& x) {
      std::array<int64_t, 4> s{};
      for (int64_t d = 0; d < 4; ++d) s[d] = x.stride(d);
      return s;
    };
    return {q.device().type(), q.device().index(), q.scalar_type(), memopt::detail::matmul_dtype(q),
            q.size(0),         q.size(1),          k.size(1),       q.size(2),
            k.size(2),         q.size(3),          causal,          padded,
            strides(q),        strides(k),         strides(v),      q_block,
            kv_block};
  }

  bool contiguous() const {
    auto dense = [&](const std::array<int64_t, 4>& s, int64_t h, int64_t t) {
      return s == std::array<int64_t, 4>{h * t * head_dim, t * head_dim, head_dim, 1};
    };
    return dense(q_strides, heads, q_len) && dense(k_strides, kv_heads, kv_len) && dense(v_strides, kv_heads, kv_len);
  }

  auto key() const {
    return std::make_tuple(static_cast<int>(device), static_cast<int>(device_index), static_cast<int>(dtype),
                           static_cast<int>(autocast), batch, heads, kv_heads, q_len, kv_len, head_dim, causal, padded,
                           q_strides, k_strides, v_strides, q_block, kv_block);
  }
  bool operator<(const AttentionShape& o) const { return key() < o.key(); }

  /// "B8 H8/8 T512x512 D64 causal Float" (for logs and benchmark lines; "strided" when q, k or v
  /// is a view of another layout, "blocks 64x128" when not the default blocks).
  std::string str() const {
    const bool default_blocks = q_block == kAttentionQBlock && kv_block == kAttentionKvBlock;
    return fmt::format("B{} H{}/{} T{}x{} D{} {}{} {}{}{}{}", batch, heads, kv_heads, q_len, kv_len, head_dim,
                       causal ? "causal" : "bidirectional", padded ? " padded" : "", c10::toString(autocast),
                       contiguous() ? "" : " strided",
                       default_blocks ? "" : fmt::format(" blocks {}x{}", q_block, kv_block),
                       device == c10::kCUDA ? " cuda" : "");
  }

  /// The blockwise kernel's options on this shape (causal, blocks), with `key_padding_mask`.
  BlockwiseAttentionOptions blockwise(const torch::Tensor& key_padding_mask = {}) const {
    return BlockwiseAttentionOptions().causal(causal).key_padding_mask(key_padding_mask).q_block(q_block).kv_block(
        kv_block);
  }
};

/// One kernel's measurement: the fastest forward + backward, and the bytes its forward left
/// allocated (output and what autograd keeps for backward).
struct AttentionTiming {
  double ms = 0;
  int64_t saved_bytes = 0;
};

/// Which kernel runs on a shape, with the figures that decided it.
struct AttentionChoice {
  AttentionKind kind = AttentionKind::kSdpa;  // kSdpa, kBlockwise or kFlash
  AttentionTiming sdpa, blockwise;
  std::optional<AttentionTiming> flash;  // measured where flash_supported says it runs
};

/// How attention_auto measures.  AttentionChoiceOptions().reps(5).tie(0.03)
struct AttentionChoiceOptions {
  /// Timed forward + backward passes of each kernel (after one warm-up); the fastest counts.
  TORCH_ARG(int, reps) = 3;
  /// Times within this fraction of each other are a tie, settled by memory, then SDPA.
  TORCH_ARG(double, tie) = 0.05;
};

/// The decision alone: the fastest kernel, unless a slower one is within `tie` of it and keeps
/// fewer bytes; on a full tie the one listed first (SDPA, what LibTorch already provides).
inline AttentionKind pick_attention(const std::vector<std::pair<AttentionKind, AttentionTiming>>& candidates,
                                    double tie) {
  TORCH_CHECK(!candidates.empty(), "memopt::nn::pick_attention: no candidates. HINT: pass at least SDPA's timing.");
  double fast = candidates.front().second.ms;
  for (const auto& [kind, t] : candidates) fast = std::min(fast, t.ms);
  const std::pair<AttentionKind, AttentionTiming>* best = nullptr;
  for (const auto& c : candidates)
    if (c.second.ms <= fast * (1 + tie) && (!best || c.second.saved_bytes < best->second.saved_bytes)) best = &c;
  return best->first;
}

/// Of SDPA and the blockwise kernel.
inline AttentionKind pick_attention(const AttentionTiming& sdpa, const AttentionTiming& blockwise, double tie) {
  return pick_attention({{AttentionKind::kSdpa, sdpa}, {AttentionKind::kBlockwise, blockwise}}, tie);
}

}  // namespace memopt::nn

namespace memopt::detail {

// Bytes live on `shape`'s device now: the tracker's on the CPU (0 when it is not installed),
// the caching allocator's on a GPU.
inline int64_t attention_live_bytes(const nn::AttentionShape& shape) {
  if (shape.device != c10::kCUDA) return memory::Tracker::instance().live_bytes();
  for (const auto& d : memory::CudaMemory::now())
    if (d.device == std::max<int>(shape.device_index, 0)) return d.allocated_bytes;
  return 0;
}

inline void attention_sync(const nn::AttentionShape& shape) {
  if (shape.device == c10::kCUDA) torch::cuda::synchronize(shape.device_index);
}

// Times `run(q, k, v, mask)` forward and backward on fresh inputs of `shape`, laid out with its
// strides (normal values from a private generator, a mask with its last key padded in row 0).
template <class Run>
nn::AttentionTiming time_attention(const nn::AttentionShape& shape, int reps, Run run) {
  auto gen = at::detail::createCPUGenerator(0x5eed);
  const auto opts = torch::TensorOptions().dtype(shape.dtype).device(shape.device, shape.device_index);
  auto input = [&](int64_t heads, int64_t len, const std::array<int64_t, 4>& strides) {
    auto x = torch::empty_strided({shape.batch, heads, len, shape.head_dim}, strides, opts);
    return x.copy_(torch::randn(x.sizes(), gen)).requires_grad_(true);
  };
  const auto q = input(shape.heads, shape.q_len, shape.q_strides);
  const auto k = input(shape.kv_heads, shape.kv_len, shape.k_strides);
  const auto v = input(shape.kv_heads, shape.kv_len, shape.v_strides);
  torch::Tensor mask;
  if (shape.padded) {
    mask = torch::ones({shape.batch, shape.kv_len}, torch::kBool);
    mask[0][shape.kv_len - 1] = false;
    mask = mask.to(opts.device());
  }
  torch::Tensor grad_out;
  nn::AttentionTiming t{1e300, 0};
  for (int i = 0; i <= reps; ++i) {  // i = 0: the warm-up
    attention_sync(shape);
    const int64_t before = attention_live_bytes(shape);
    const auto t0 = std::chrono::steady_clock::now();
    auto y = run(q, k, v, mask);  // (B, H, Tq, D)
    attention_sync(shape);
    const int64_t saved = attention_live_bytes(shape) - before;
    if (!grad_out.defined()) grad_out = torch::randn(y.sizes(), gen).to(y.options());
    torch::autograd::grad({y}, {q, k, v}, {grad_out});
    attention_sync(shape);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (i > 0 && ms < t.ms) t = {ms, saved};
  }
  return t;
}

// The choices of this process, one per shape.
struct AttentionChoiceTable {
  std::mutex mutex;
  std::map<nn::AttentionShape, nn::AttentionChoice> choices;
};
inline AttentionChoiceTable& attention_choice_table() {
  static AttentionChoiceTable t;
  return t;
}

}  // namespace memopt::detail

namespace memopt::nn {

/// Times SDPA, the blockwise kernel and (where it runs) attention_flash on `shape` now (forward
/// and backward, under the caller's autocast state; the tracked peaks are left as they were)
/// and picks one.
///   auto c = memopt::nn::measure_attention(memopt::nn::AttentionShape::of(q, k, v, true, false));
inline AttentionChoice measure_attention(const AttentionShape& shape, const AttentionChoiceOptions& options = {}) {
  TORCH_CHECK(options.reps() >= 1 && options.tie() >= 0, "memopt::nn::measure_attention: reps must be >= 1 and tie "
              ">= 0 (got ", options.reps(), " and ", options.tie(), "). HINT: the defaults are 3 and 0.05.");
  memory::ExcludedFromPeaks probe;
  c10::InferenceMode not_inference(false);  // the probe runs backward, even when its caller does not
  torch::AutoGradMode grad(true);
  AttentionChoice c;
  c.sdpa = memopt::detail::time_attention(shape, options.reps(), [&](auto& q, auto& k, auto& v, auto& mask) {
    return attention_sdpa(q, k, v, shape.causal, 0.0, false, mask);
  });
  c.blockwise = memopt::detail::time_attention(shape, options.reps(), [&](auto& q, auto& k, auto& v, auto& mask) {
    return attention_blockwise(q, k, v, shape.blockwise(mask));
  });
  std::vector<std::pair<AttentionKind, AttentionTiming>> candidates{{AttentionKind::kSdpa, c.sdpa},
                                                                    {AttentionKind::kBlockwise, c.blockwise}};
  if (flash_supported(shape.device, shape.autocast, shape.head_dim, false, shape.padded)) {
    c.flash = memopt::detail::time_attention(shape, options.reps(), [&](auto& q, auto& k, auto& v, auto& mask) {
      return attention_flash(q, k, v, shape.causal, 0.0, false, mask);
    });
    candidates.emplace_back(AttentionKind::kFlash, *c.flash);
  }
  c.kind = pick_attention(candidates, options.tie());
  return c;
}

/// The kernel attention_auto runs on `shape`: measured by the first call on that shape in this
/// process, remembered after.
inline AttentionChoice choose_attention(const AttentionShape& shape, const AttentionChoiceOptions& options = {}) {
  auto& t = memopt::detail::attention_choice_table();
  std::lock_guard<std::mutex> lock(t.mutex);
  auto it = t.choices.find(shape);
  if (it == t.choices.end()) it = t.choices.emplace(shape, measure_attention(shape, options)).first;
  return it->second;
}

/// Runs `kind` on `shape` from now on, unmeasured (a resumed run replays the kernels the run
/// that saved it chose: memopt/kernel_choices.hpp); its timings stay zero.
inline void remember_attention(const AttentionShape& shape, AttentionKind kind) {
  auto& t = memopt::detail::attention_choice_table();
  std::lock_guard<std::mutex> lock(t.mutex);
  t.choices[shape] = AttentionChoice{kind, {}, {}, std::nullopt};
}

/// Every shape this process has chosen for, in shape order (benchmarks log them).
inline std::vector<std::pair<AttentionShape, AttentionChoice>> attention_choices() {
  auto& t = memopt::detail::attention_choice_table();
  std::lock_guard<std::mutex> lock(t.mutex);
  return {t.choices.begin(), t.choices.end()};
}

/// attention_sdpa's conventions, on whichever of SDPA, attention_flash and attention_blockwise
/// (with q_block × kv_block blocks) choose_attention measured fastest on this shape. Dropout in
/// training runs SDPA (the blockwise kernel has none), and causal attention with key padding the
/// blockwise kernel (SDPA would need a (T, T) mask), both without measuring.
///   auto y = memopt::nn::attention_auto(q, k, v, /*causal=*/true, 0.0, false);  // (B, H, T, D)
inline torch::Tensor attention_auto(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                    bool causal, double dropout, bool training,
                                    const torch::Tensor& key_padding_mask = {}, int64_t q_block = kAttentionQBlock,
                                    int64_t kv_block = kAttentionKvBlock) {
  const bool padded = key_padding_mask.defined();
  if (training && dropout > 0) return attention_sdpa(q, k, v, causal, dropout, training, key_padding_mask);
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4, "memopt::nn::attention_auto: q must be (B, H, T, D) and k, v (B, KV, T, "
              "D) (got q ", q.sizes(), ", k ", k.sizes(), "). HINT: transpose(1, 2) a (B, T, H, D) projection.");
  const auto shape = AttentionShape::of(q, k, v, causal, padded, q_block, kv_block);
  if (causal && padded) return attention_blockwise(q, k, v, shape.blockwise(key_padding_mask));
  const auto kind = choose_attention(shape).kind;
  if (kind == AttentionKind::kBlockwise) return attention_blockwise(q, k, v, shape.blockwise(key_padding_mask));
  if (kind == AttentionKind::kFlash) return attention_flash(q, k, v, causal, 0.0, false, key_padding_mask);
  return attention_sdpa(q, k, v, causal, 0.0, false, key_padding_mask);
}

}  // namespace memopt::nn
