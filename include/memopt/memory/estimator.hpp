// memopt/memory/estimator.hpp — know before you run: the peak tensor memory of a training
// step, predicted from the model's shape, the micro-batch and the policy combination, with a
// breakdown — parameters, fp32 master weights, gradients, optimizer state (by offload policy),
// activations saved per block (by checkpoint and precision policy and attention path), the
// logits and loss, and the transient workspace of the step's largest moment. DeepSpeed's
// estimator covers the model states only and HF's the loading; this one covers a whole step.
//
// The model states are counted tensor by tensor, as memopt's optimizers allocate them. The
// activations are counted per tensor-size class — (B, T, C), (B, T, KV·D), (B, T, F),
// (B, H, T, T), (B, T, V) — with bytes per element for each class that follow from what
// autograd saves in models/llama.hpp under each policy (the counts are listed in
// detail::block_saved(); tests/memory/estimator_test.cpp checks them against the
// tracker).
//
//   auto e = memopt::memory::estimate(memopt::models::describe(cfg),
//                                     memopt::memory::RunDesc{8, 256},
//                                     memopt::memory::PolicyDesc::parse("every", "bf16", "none", 2));
//   fmt::print("{}", e.table());   // … peak 412.3 MiB (backward)
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>

#include "memopt/memory/model_desc.hpp"
#include "memopt/memory/report.hpp"
#include "memopt/optim/adamw8bit.hpp"
#include "memopt/optim/disk_adamw.hpp"
#include "memopt/policies/checkpoint.hpp"
#include "memopt/policies/offload.hpp"
#include "memopt/policies/precision.hpp"

namespace memopt::memory {

enum class CheckpointKind { kNone, kEveryBlock, kEveryNth, kSelective };
enum class PrecisionKind { kFp32, kBf16Autocast, kBf16Pure, kFp16Scaled };
enum class OffloadKind { kNone, kInt8, kDisk };

/// A policy combination as data: what the estimator and the planner reason about, and what
/// the command-line flags spell (--checkpoint none|every|every-N|selective, --precision
/// fp32|bf16|bf16-pure|fp16, --offload none|int8|disk, --accum N).
struct PolicyDesc {
  CheckpointKind checkpoint = CheckpointKind::kNone;
  int64_t every = 1;  // kEveryNth: recompute blocks 0, N, 2N, …
  PrecisionKind precision = PrecisionKind::kFp32;
  OffloadKind offload = OffloadKind::kNone;
  int64_t accum = 1;  // micro-batches per optimizer step

  /// The flag spellings: "every-2", "bf16-pure", "int8".
  std::string checkpoint_flag() const {
    switch (checkpoint) {
      case CheckpointKind::kNone: return "none";
      case CheckpointKind::kEveryBlock: return "every";
      case CheckpointKind::kEveryNth: return "every-" + std::to_string(every);
      case CheckpointKind::kSelective: return "selective";
    }
    return "?";
  }
  std::string precision_flag() const {
    constexpr std::string_view names[] = {"fp32", "bf16", "bf16-pure", "fp16"};
    return std::string(names[static_cast<int>(precision)]);
  }
  std::string offload_flag() const {
    constexpr std::string_view names[] = {"none", "int8", "disk"};
    return std::string(names[static_cast<int>(offload)]);
  }
  /// "checkpoint=every precision=bf16 offload=none accum=2"
  std::string name() const {
    return fmt::format("checkpoint={} precision={} offload={} accum={}", checkpoint_flag(), precision_flag(),
                       offload_flag(), accum);
  }
  /// The same policy types (accum is a run-time count, not part of the type).
  bool same_types(const PolicyDesc& o) const {
    return checkpoint == o.checkpoint && (checkpoint != CheckpointKind::kEveryNth || every == o.every) &&
           precision == o.precision && offload == o.offload;
  }
  bool operator==(const PolicyDesc& o) const { return same_types(o) && accum == o.accum; }

  /// From the flags; a bad value throws naming the flag, the value and the choices.
  static PolicyDesc parse(std::string_view checkpoint, std::string_view precision, std::string_view offload,
                          int64_t accum = 1) {
    PolicyDesc d;
    if (checkpoint == "none") d.checkpoint = CheckpointKind::kNone;
    else if (checkpoint == "every") d.checkpoint = CheckpointKind::kEveryBlock;
    else if (checkpoint == "selective") d.checkpoint = CheckpointKind::kSelective;
    else if (checkpoint.starts_with("every-") && checkpoint.size() > 6 &&
             checkpoint.find_first_not_of("0123456789", 6) == std::string_view::npos) {
      d.checkpoint = CheckpointKind::kEveryNth;
      d.every = std::stoll(std::string(checkpoint.substr(6)));
      TORCH_CHECK(d.every >= 1, "memopt: --checkpoint every-N needs N >= 1 (got '", checkpoint,
                  "'). HINT: every-2 recomputes every other block.");
      if (d.every == 1) d.checkpoint = CheckpointKind::kEveryBlock;
    } else {
      TORCH_CHECK(false, "memopt: --checkpoint must be none, every, every-N or selective (got '", checkpoint,
                  "'). HINT: every recomputes each block in backward (least memory); every-2 every other one.");
    }
    if (precision == "fp32") d.precision = PrecisionKind::kFp32;
    else if (precision == "bf16") d.precision = PrecisionKind::kBf16Autocast;
    else if (precision == "bf16-pure") d.precision = PrecisionKind::kBf16Pure;
    else if (precision == "fp16") d.precision = PrecisionKind::kFp16Scaled;
    else
      TORCH_CHECK(false, "memopt: --precision must be fp32, bf16, bf16-pure or fp16 (got '", precision,
                  "'). HINT: bf16 is autocast with fp32 master weights; fp16 needs a CUDA device.");
    if (offload == "none") d.offload = OffloadKind::kNone;
    else if (offload == "int8") d.offload = OffloadKind::kInt8;
    else if (offload == "disk") d.offload = OffloadKind::kDisk;
    else
      TORCH_CHECK(false, "memopt: --offload must be none, int8 or disk (got '", offload,
                  "'). HINT: int8 keeps 8-bit AdamW state (~2 B/param); disk streams the state from a file.");
    TORCH_CHECK(accum >= 1, "memopt: --accum must be >= 1 (got ", accum, "). HINT: 1 takes one micro-batch per step.");
    d.accum = accum;
    return d;
  }
};

namespace detail {
// Each policy type's kind (memopt's policies; another type is a compile error here).
template <CheckpointKind K, int64_t N = 1>
struct CheckpointIs {
  static constexpr CheckpointKind kind = K;
  static constexpr int64_t every = N;
};
template <class T>
struct CheckpointOf;
template <>
struct CheckpointOf<checkpoint::None> : CheckpointIs<CheckpointKind::kNone> {};
template <>
struct CheckpointOf<checkpoint::EveryBlock> : CheckpointIs<CheckpointKind::kEveryBlock> {};
template <int N>
struct CheckpointOf<checkpoint::EveryNth<N>>
    : CheckpointIs<N == 1 ? CheckpointKind::kEveryBlock : CheckpointKind::kEveryNth, N> {};
template <>
struct CheckpointOf<checkpoint::Selective> : CheckpointIs<CheckpointKind::kSelective> {};

template <class T>
struct PrecisionOf;
template <>
struct PrecisionOf<precision::Fp32> : std::integral_constant<PrecisionKind, PrecisionKind::kFp32> {};
template <>
struct PrecisionOf<precision::Bf16Autocast> : std::integral_constant<PrecisionKind, PrecisionKind::kBf16Autocast> {};
template <>
struct PrecisionOf<precision::Bf16Pure> : std::integral_constant<PrecisionKind, PrecisionKind::kBf16Pure> {};
template <>
struct PrecisionOf<precision::Fp16Scaled> : std::integral_constant<PrecisionKind, PrecisionKind::kFp16Scaled> {};

template <class T>
struct OffloadOf;
template <>
struct OffloadOf<offload::None> : std::integral_constant<OffloadKind, OffloadKind::kNone> {};
template <>
struct OffloadOf<offload::Int8State> : std::integral_constant<OffloadKind, OffloadKind::kInt8> {};
template <>
struct OffloadOf<offload::Disk> : std::integral_constant<OffloadKind, OffloadKind::kDisk> {};
}  // namespace detail

/// The PolicyDesc of a Trainer instantiation (its policy types; accum as given).
///   memopt::memory::describe<memopt::Trainer<memopt::checkpoint::EveryBlock>>(4)
template <class TrainerT>
PolicyDesc describe(int64_t accum = 1) {
  using C = detail::CheckpointOf<typename TrainerT::checkpoint_type>;
  PolicyDesc d;
  d.checkpoint = C::kind;
  d.every = C::every;
  d.precision = detail::PrecisionOf<typename TrainerT::precision_type>::value;
  d.offload = detail::OffloadOf<typename TrainerT::offload_type>::value;
  d.accum = accum;
  return d;
}

/// One micro-batch: B sequences of T tokens.
struct RunDesc {
  int64_t micro_batch = 1;
  int64_t seq_len = 1;
  bool lm_head = true;       // false: an embedding pass (mean-pooled hidden states, no logits)
  bool key_padding = false;  // the attention masks padded keys (bidirectional embedding passes)
  bool grads_held = false;   // every gradient exists already (a later chunk or micro-batch)
  double held_bytes = 0;     // other passes' saved activations alive through this one's step
};

/// The prediction, in bytes. peak is the largest of the three moments the estimator models:
/// the end of the forward, the backward (activations and gradients together) and the step.
struct Estimate {
  int64_t parameters = 0;       // the weights the model computes with (bf16 under bf16-pure)
  int64_t master_weights = 0;   // bf16-pure: the optimizer's fp32 copy
  int64_t gradients = 0;        // all gradients at once (at the optimizer step)
  int64_t optimizer_state = 0;  // resident between steps (disk: its chunk buffers)
  int64_t teacher = 0;          // distillation: the frozen teacher's weights and its targets
  int64_t activations = 0;      // saved for backward, all blocks, at the end of the forward
  int64_t saved = 0;            // everything the forward keeps for the backward: activations + the loss's
  int64_t head = 0;             // logits, log-probabilities and their gradients at the loss
  int64_t workspace = 0;        // transient at the peak (recomputed block, backward temporaries, casts)
  int64_t forward_peak = 0, backward_peak = 0, optimizer_peak = 0;
  int64_t peak = 0;
  std::string peak_phase;

  /// A fixed-width table, one row per part, then the peak and where it falls.
  std::string table() const {
    std::string out = "memory estimate (tensor bytes)\n";
    auto row = [&](std::string_view what, int64_t b) { out += fmt::format("  {:<18} {:10.1f} MiB\n", what, mib(b)); };
    row("parameters", parameters);
    if (master_weights > 0) row("fp32 masters", master_weights);
    row("gradients", gradients);
    row("optimizer state", optimizer_state);
    if (teacher > 0) row("teacher + targets", teacher);
    row("activations", activations);
    row("logits + loss", head);
    row("workspace", workspace);
    out += fmt::format("  {:<18} {:10.1f} MiB  (forward {:.1f}, backward {:.1f}, optimizer {:.1f})\n", "peak",
                       mib(peak),
                       mib(forward_peak), mib(backward_peak), mib(optimizer_peak));
    return out;
  }
};

namespace detail {

/// Bytes per element of each size class: (B, T, C), (B, T, F), (B, H, T, T), (B, T, V).
struct PerElement {
  double btc = 0, btf = 0, bhtt = 0;
  double bytes(double B, double T, const ModelDesc& m) const {
    return B * T * (btc * m.hidden_size + btf * m.ffn_size * m.ffn_rows() + bhtt * m.num_heads * T);
  }
};

// What one LLaMA block (models/llama.hpp) keeps for backward, per element, counted from the
// code and checked against the tracker (tests/memory/estimator_test.cpp):
//   fp32: two RMSNorms (x·rsqrt and its weighted output: 2 tensors each), q and k before and
//     after RoPE, the head-major copies the attention matmuls take, v, the attention output
//     before o_proj, the residual h, the block output: 12 (B, T, C); gate, up, silu(gate) and
//     their product: 4 (B, T, F); the fp32 softmax: 1 (B, H, T, T).
//   bf16 autocast: the norms and the residual stream stay fp32, the matmul outputs are bf16
//     and every linear input is saved as its bf16 cast; the softmax is fp32 and its bf16 copy
//     feeds the PV matmul. (The bf16 weight casts are counted separately.)
//   bf16-pure: all bf16 except the norms' fp32 internals and the fp32 softmax.
//   selective: the norms, the attention core and silu(gate)·up are recomputed in backward.
//   dropout: the noise of the two residual dropouts and of the attention probabilities, and
//     the dropped probabilities.
//   mixture of experts (sorted dispatch): the (B, T, F) terms over top_k rows per token, plus
//     the gathered expert inputs, the concatenated expert outputs and the router's logits and
//     probabilities; checkpoint_experts recomputes each expert from its input slice.
inline PerElement block_saved(PrecisionKind p, bool selective, const ModelDesc& m) {
  const bool math = m.attention == nn::AttentionKind::kMath;
  PerElement b;
  switch (p) {
    case PrecisionKind::kFp32: b = {48, 16, 4}; break;
    case PrecisionKind::kBf16Autocast:
    case PrecisionKind::kFp16Scaled: b = {41, 8, 6}; break;
    case PrecisionKind::kBf16Pure: b = {31, 8, 6}; break;
  }
  if (selective) {
    b.btc -= p == PrecisionKind::kBf16Pure ? 20 : 16;  // the norms' outputs
    b.btf -= p == PrecisionKind::kFp32 ? 4 : 2;        // silu(gate)
    b.bhtt = 0;
  }
  if (!math) b.bhtt = 0;  // blockwise: a (B, H, T) log-sum-exp only
  if (m.dropout) {        // each dropout saves its scaled noise; the dropped probabilities feed PV
    const double e = p == PrecisionKind::kFp32 ? 4 : 2;
    b.btc += 2 * e;
    if (math) b.bhtt += 2 * e;
  }
  if (m.num_experts > 0) {  // per token: top_k gathered inputs and expert outputs, the router's fp32 logits/probs
    b.btc += static_cast<double>(m.top_k) * (p == PrecisionKind::kBf16Pure ? 4 : 8) +
             12.0 * static_cast<double>(m.num_experts) / static_cast<double>(m.hidden_size);
    if (m.checkpoint_experts) b.btf = 0;  // each expert keeps its input slice only
  }
  return b;
}

// Outside the blocks, per (B, T, C) element: the embedding output and the final norm.
inline double outside_blocks_btc(PrecisionKind p) {
  switch (p) {
    case PrecisionKind::kFp32: return 16;
    case PrecisionKind::kBf16Pure: return 11;
    default: return 14.5;
  }
}

inline int64_t state_bytes(OffloadKind o, const std::vector<int64_t>& numels) {
  int64_t bytes = 0, largest = 1;
  for (int64_t n : numels) largest = std::max(largest, n);
  for (int64_t n : numels) {
    switch (o) {
      case OffloadKind::kNone: bytes += 8 * n; break;
      case OffloadKind::kInt8:
        bytes += n < optim::AdamW8bitOptions().min_8bit_size() ? 8 * n : 2 * n + 8 * optim::num_quant_blocks(n);
        break;
      case OffloadKind::kDisk: break;
    }
  }
  if (o == OffloadKind::kDisk)  // three (2, chunk) fp32 buffers
    bytes = 3 * 2 * 4 * std::min(optim::DiskAdamWOptions().chunk_elements(), largest);
  return bytes;
}

}  // namespace detail

/// Predicts the steady-state peak of one optimizer step (after the first, which creates the
/// optimizer state) of models::Llama::loss_sum under the Trainer with these policies. It
/// walks the step's largest moments: each block's forward (the attention scores), the loss
/// (logits and log-probabilities), the backward through the loss and through each block from
/// the top (activations freed, gradients allocated, a checkpointed block recomputed), and the
/// optimizer step (every gradient, the state, AdamW's temporaries).
inline Estimate estimate(const ModelDesc& m, const RunDesc& run, const PolicyDesc& pol) {
  TORCH_CHECK(m.num_layers >= 1 && m.hidden_size >= 1 && m.vocab_size >= 1 && m.num_heads >= 1,
              "memopt::memory::estimate: the model description is empty (layers ", m.num_layers, ", hidden ",
              m.hidden_size, "). HINT: build it with models::describe(config).");
  TORCH_CHECK(run.micro_batch >= 1 && run.seq_len >= 1, "memopt::memory::estimate: micro_batch and seq_len must be "
              ">= 1 (got ", run.micro_batch, " and ", run.seq_len, ").");
  const auto numels = m.parameter_numels();
  double P = 0, largest = 0;
  for (int64_t n : numels) P += static_cast<double>(n), largest = std::max(largest, static_cast<double>(n));
  const double B = static_cast<double>(run.micro_batch), T = static_cast<double>(run.seq_len);
  const double C = static_cast<double>(m.hidden_size), V = static_cast<double>(m.vocab_size);
  const double F = static_cast<double>(m.ffn_size);
  const bool pure = pol.precision == PrecisionKind::kBf16Pure;
  const bool autocast = pol.precision == PrecisionKind::kBf16Autocast || pol.precision == PrecisionKind::kFp16Scaled;
  const bool math = m.attention == nn::AttentionKind::kMath;
  const double grad_e = pure ? 2 : 4;  // gradients are the parameters' dtype until the step
  const double experts = static_cast<double>(std::max<int64_t>(m.num_experts, 1));
  const double block_params = 2 * C * C + 2 * C * static_cast<double>(m.kv_dim()) + experts * 3 * C * F +
                              static_cast<double>(m.num_experts) * C + 2 * C;
  const double embed_params = V * C;

  Estimate e;
  e.parameters = static_cast<int64_t>((pure ? 2 : 4) * P);
  e.master_weights = pure ? static_cast<int64_t>(4 * P) : 0;
  e.gradients = static_cast<int64_t>(4 * P);
  e.optimizer_state = detail::state_bytes(pol.offload, numels);
  const double rows = static_cast<double>(run.micro_batch * run.seq_len);
  e.teacher = m.frozen_parameter_bytes + static_cast<int64_t>(rows) * m.teacher_target_bytes;
  const double statics =
      static_cast<double>(e.parameters + e.master_weights + e.optimizer_state + e.teacher) + run.held_bytes;

  // ---- what the forward keeps ----
  const double btc = B * T * C;
  auto per_block = detail::block_saved(pol.precision, pol.checkpoint == CheckpointKind::kSelective, m);
  if (run.key_padding && per_block.bhtt > 0 && pol.precision == PrecisionKind::kFp32)
    per_block.bhtt += 4;  // the probabilities with fully padded rows zeroed feed the PV matmul
  const double full = per_block.bytes(B, T, m);
  const double input = btc * (pure ? 2 : 4);  // a checkpointed block keeps its input only
  std::vector<bool> recomputed(static_cast<size_t>(m.num_layers), false);
  for (int64_t i = 0; i < m.num_layers; ++i)
    recomputed[static_cast<size_t>(i)] = pol.checkpoint == CheckpointKind::kEveryBlock ||
                                         (pol.checkpoint == CheckpointKind::kEveryNth && i % pol.every == 0);
  std::vector<double> kept(recomputed.size());
  double stack = 0;
  for (size_t i = 0; i < kept.size(); ++i) stack += kept[i] = recomputed[i] ? input : full;
  // Autocast's bf16 copies of the linear weights, saved for backward; a recomputed block's
  // copies are made again in its backward instead.
  const double block_cast = autocast ? 2 * block_params : 0;
  double casts = autocast ? 2 * embed_params : 0;  // lm_head
  for (bool r : recomputed) casts += r ? 0 : block_cast;
  const double outside = btc * detail::outside_blocks_btc(pol.precision);
  const bool chunked = m.loss_chunk_size > 0;
  const double chunk_rows = chunked ? std::min<double>(static_cast<double>(m.loss_chunk_size), rows) : rows;
  // Saved by the loss: the fp32 log-probabilities (+ the KD term's, and the fp32 copy it slices).
  const double logprobs =
      chunked || !run.lm_head ? 0 : rows * V * ((autocast ? 5 : 4) + (m.kd ? (autocast ? 7 : 5) : 0));
  e.activations = static_cast<int64_t>(stack + outside);
  e.saved = static_cast<int64_t>(stack + outside + logprobs);
  const double grads_held = pol.accum > 1 || run.grads_held ? grad_e * P : 0;  // earlier micro-batches' gradients

  // ---- forward moments: a block's attention scores, then the logits ----
  const double scores = math ? 2 * B * m.num_heads * T * T * (autocast || pure ? 2 : 4) : 0;
  const double attn_in = 7 * btc * 4;  // normed input, q, k, v, RoPE temporaries
  const double before_last = statics + grads_held + casts + stack - kept.back() + btc * 4;
  const double fwd_block = before_last + attn_in + scores;
  const double logits = run.lm_head ? chunk_rows * V * (autocast || pure ? 6 : 4) : 0;  // (bf16 +) fp32 logits
  const double fwd_end = statics + grads_held + casts + stack + outside + logprobs;
  // A teacher first runs without a graph: its logits exist while its targets are made.
  const double teacher_logits = m.teacher_vocab > 0 ? rows * static_cast<double>(m.teacher_vocab) * 4 * 2 : 0;
  // The KD term's (rows, K) temporaries: the teacher's scaled log-probabilities, probabilities,
  // differences and products, next to the student's logits.
  const double kd_tmp = rows * static_cast<double>(m.kd_classes) * 4 * 7;
  e.forward_peak = static_cast<int64_t>(std::max({fwd_block, fwd_end + logits + kd_tmp, statics + teacher_logits}));

  // ---- backward moments ----
  const double head_bwd = fwd_end + (run.lm_head ? chunk_rows * V * (m.kd ? 12 : 8) : 0);  // 2 (3 with KD) fp32 grads
  double grads = grads_held > 0 ? grads_held : grad_e * (embed_params + C);  // lm_head and final norm first
  double live = statics + casts + stack + btc * 4 * 2;  // + the gradient flowing down, the embedding output
  double bwd_peak = head_bwd;
  // The feed-forward's part of a block's saved tensors, freed before the attention's backward:
  // its (B, T, F) tensors and 30 B per (B, T, C) element of norm and residual tensors (measured).
  ModelDesc plain = m;
  plain.dropout = false;
  const double ffn_btf = detail::block_saved(pol.precision, false, plain).btf;
  const double mlp_saved = B * T * (F * static_cast<double>(m.ffn_rows()) * ffn_btf + C * 30);
  for (int64_t i = m.num_layers - 1; i >= 0; --i) {
    const auto u = static_cast<size_t>(i);
    const double recompute = recomputed[u] ? full + block_cast : 0;
    const double at_top = live + recompute + grads;
    const double mlp_moment =
        at_top + 2 * B * T * F * static_cast<double>(m.ffn_rows()) * (pure || autocast ? 2 : 4) + 2 * btc * 4;
    const double attn_moment = at_top - mlp_saved + (math ? B * m.num_heads * T * T * (autocast || pure ? 6 : 8) : 0) +
                               (grads_held > 0 ? 0 : grad_e * experts * 3 * C * F);
    bwd_peak = std::max({bwd_peak, mlp_moment, attn_moment});
    live -= kept[u];
    if (grads_held == 0) grads += grad_e * block_params;
  }
  e.backward_peak = static_cast<int64_t>(bwd_peak);
  e.head = static_cast<int64_t>(logprobs + (run.lm_head ? chunk_rows * V * 8 : 0));
  e.workspace = static_cast<int64_t>(casts + std::max(scores + attn_in, 0.0));

  // ---- the optimizer step: every gradient in fp32 and AdamW's per-parameter temporaries ----
  // (Other passes' activations and the teacher's targets are gone by then.)
  const double targets = rows * static_cast<double>(m.teacher_target_bytes);
  e.optimizer_peak = static_cast<int64_t>(statics - run.held_bytes - targets + 4 * P + 2 * 4 * largest);
  e.peak = std::max({e.forward_peak, e.backward_peak, e.optimizer_peak});
  e.peak_phase = e.peak == e.backward_peak ? "backward" : e.peak == e.optimizer_peak ? "optimizer" : "forward";
  return e;
}

/// A GritLM step (models/gritlm.hpp over a LLaMA): B queries of Tq tokens and B·G passages
/// of Tp tokens embedded (bidirectional, padded keys, mean-pooled: no logits), and Bg
/// generative sequences of Tg tokens (the causal LM). Lengths are the batcher's maxima, so
/// the estimate bounds batches of shorter texts from above.
struct GritRunDesc {
  int64_t queries = 1, query_len = 1, group_size = 1, passage_len = 1, gen_rows = 0, gen_len = 1;
  int64_t chunk = 0;  // accum::GradCache rows per chunk; 0: the whole batch in one graph
};

/// Without GradCache every part's graph is alive at once (the generative part first, then the
/// queries and passages, one backward); with GradCache (chunk c) each chunk of c rows runs its
/// own forward and backward after the gradients exist, next to the cached embeddings.
inline Estimate estimate_gritlm(const ModelDesc& m, const GritRunDesc& r, const PolicyDesc& pol) {
  TORCH_CHECK(r.queries >= 1 && r.group_size >= 1 && r.gen_rows >= 0 && r.chunk >= 0,
              "memopt::memory::estimate_gritlm: queries and group_size must be >= 1, gen_rows and chunk >= 0 (got ",
              r.queries, ", ", r.group_size, ", ", r.gen_rows, ", ", r.chunk, ").");
  struct Part {
    int64_t rows, len;
    bool lm;
  };
  std::vector<Part> parts{{r.queries, r.query_len, false}, {r.queries * r.group_size, r.passage_len, false}};
  if (r.gen_rows > 0) parts.push_back({r.gen_rows, r.gen_len, true});
  auto pass = [&](const Part& p, int64_t rows, bool grads_held, double held) {
    RunDesc run;
    run.micro_batch = rows;
    run.seq_len = p.len;
    run.lm_head = p.lm;
    run.key_padding = !p.lm;
    run.grads_held = grads_held;
    run.held_bytes = held;
    return estimate(m, run, pol);
  };
  auto saved = [](const Estimate& e) { return static_cast<double>(e.saved); };
  Estimate worst;
  if (r.chunk == 0) {
    double all = 0;
    std::vector<Estimate> alone;
    for (const auto& p : parts) alone.push_back(pass(p, p.rows, false, 0)), all += saved(alone.back());
    for (size_t i = 0; i < parts.size(); ++i) {  // each part's moments with the others' graphs alive
      const auto e = pass(parts[i], parts[i].rows, false, all - saved(alone[i]));
      if (e.peak > worst.peak) worst = e;
    }
  } else {
    const double cached = static_cast<double>((r.queries + r.queries * r.group_size) * m.hidden_size) * 4 * 2;
    for (const auto& p : parts) {
      const auto e = pass(p, std::min(r.chunk, p.rows), true, cached);  // embeddings and their gradients
      if (e.peak > worst.peak) worst = e;
    }
  }
  return worst;
}

}  // namespace memopt::memory
