// memopt/memory/estimator.hpp — know before you run: the peak tensor memory of a training
// step, predicted from the model's shape, the micro-batch and the policy combination, with a
// breakdown — parameters, fp32 master weights, gradients, optimizer state (by optimizer-state policy),
// activations saved per block (by recompute and precision policy and attention path), the
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
// A LoRA fine-tune (ModelDesc::with_lora) holds its frozen base as it is stored (dense, or the
// blocks' Linears in NF4 with their dequantisation transients), and only the adapters have
// gradients and optimizer state; the activations are full fine-tuning's less the inputs only a
// frozen weight's gradient needs (dX still flows through every frozen layer). It errs high, by
// up to 16% on the tests' configurations: the backward's transients are still full fine-tuning's.
//
// Data parallel (RunDesc::ranks, zero): one rank's bytes. ZeRO-1 divides the optimizer state and
// fp32 masters by the ranks; ZeRO-3 (dist::Zero3) the parameters and gradients too, recomputes
// every block, and adds what a step holds whole: the root unit, two blocks (the running one and
// the prefetched next; every block with keep_gathered, in 16 bits with gather_half), and at a
// block's reduce-scatter its gradients with two fp32 buffers (-3% to +9% of the tracker on 2
// ranks of an AMX host; the test, tests/dist/zero3_test.cpp, allows -10% to +15% across CPU
// kinds). In a world of one the shards are whole, and with RunDesc::offload_params (a file) they
// leave the tracked bytes.
//
// The policies come as their descriptions (memory/policy_desc.hpp), so the estimator knows
// no policy by name: a new policy that describes itself is estimated like the built-in ones.
//
//   using T = memopt::Trainer<memopt::recompute::EveryBlock, memopt::precision::Bf16Autocast>;
//   auto e = memopt::memory::estimate(memopt::models::describe(cfg), memopt::memory::RunDesc{8, 256},
//                                     memopt::memory::describe<T>());
//   fmt::print("{}", e.table());   // … peak 412.3 MiB (backward)
#pragma once

#include <algorithm>
#include <initializer_list>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>

#include "memopt/memory/model_desc.hpp"
#include "memopt/memory/policy_desc.hpp"
#include "memopt/memory/report.hpp"
#include "memopt/nn/qlora.hpp"

namespace memopt::memory {

/// One micro-batch: B sequences of T tokens.
struct RunDesc {
  int64_t micro_batch = 1;
  int64_t seq_len = 1;
  bool lm_head = true;       // false: an embedding pass (mean-pooled hidden states, no logits)
  bool key_padding = false;  // the attention masks padded keys (bidirectional embedding passes)
  bool grads_held = false;   // every gradient exists already (a later chunk or micro-batch)
  double held_bytes = 0;     // other passes' saved activations alive through this one's step
  /// Data parallel: this rank's bytes in a job of `ranks` (micro_batch is this rank's rows).
  /// zero 1: the optimizer state and fp32 masters sharded (TrainerOptions::shard_optimizer_state);
  /// zero 3: parameters and gradients too, every block recomputed, the root unit and two blocks
  /// (the one running and the prefetched next) whole in a step (shard_params, dist::Zero3).
  int64_t ranks = 1;
  int zero = 0;
  /// zero 3, TrainerOptions::keep_gathered: every block whole from its first use to the step's
  /// end (not two at a time); gather_half (under autocast): blocks gathered in 16 bits.
  bool keep_gathered = false;
  bool gather_half = false;
  /// zero 3, TrainerOptions::offload_params_dir: the parameter shards live in a file, outside the
  /// tracked bytes. (zero 3 with ranks 1: the shards are whole, beside ZeRO-3's gathered blocks.)
  bool offload_params = false;
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
//     before o_proj, the residual h, the block output: 12 (B, T, C) (counted at width C as
//     when H·D = C, as in Llama 3: a head_dim with H·D ≠ C enters the parameter counts, the
//     gradient moments and the FLOPs, not these); gate, up, silu(gate) and their product:
//     4 (B, T, F); the fp32 softmax: 1 (B, H, T, T).
//   bf16 autocast: the norms and the residual stream stay fp32, the matmul outputs are bf16
//     and every linear input is saved as its bf16 cast; the softmax is fp32 and its bf16 copy
//     feeds the PV matmul. (The bf16 weight casts are counted separately.)
//   bf16-pure: all bf16 except the norms' fp32 internals and the fp32 softmax.
//   selective: the norms, the attention core and silu(gate)·up are recomputed in backward.
//   fused kernels (not selective): each norm keeps its input and a per-row rstd, not x·rsqrt;
//     the SwiGLU product keeps gate and up, not silu(gate); under autocast a block's norms
//     return bf16, one tensor the Linear layers after them share instead of a cast each (3 of
//     the 5 bf16 inputs less); (any recompute) the residual dropouts keep no noise.
//   dropout: the noise of the two residual dropouts and of the attention probabilities, and
//     the dropped probabilities.
//   mixture of experts (sorted dispatch): the (B, T, F) terms over top_k rows per token, plus
//     the gathered expert inputs, the concatenated expert outputs and the router's logits and
//     probabilities; checkpoint_experts recomputes each expert from its input slice.
inline PerElement block_saved(const DtypeDesc& p, bool selective, const ModelDesc& m) {
  const bool math = m.attention == nn::AttentionKind::kMath;
  PerElement b = p.half_weights ? PerElement{31, 8, 6} : p.half_matmuls ? PerElement{41, 8, 6} : PerElement{48, 16, 4};
  if (selective) {
    b.btc -= p.half_weights ? 20 : 16;  // the norms' outputs
    b.btf -= p.half_matmuls ? 2 : 4;    // silu(gate)
    b.bhtt = 0;
  }
  if (m.fused_kernels && !selective) {
    b.btc -= 2 * (p.half_weights ? 2 : 4);  // the two norms' x·rsqrt
    b.btf -= p.half_matmuls ? 2 : 4;        // silu(gate)
    if (p.half_matmuls && !p.half_weights) b.btc -= 6;  // autocast: q, k, v and gate, up share a bf16 norm output
  }
  if (!math) b.bhtt = 0;  // blockwise: a (B, H, T) log-sum-exp only
  if (m.dropout) {        // each dropout saves its scaled noise; the dropped probabilities feed PV
    const double e = p.half_matmuls ? 2 : 4;
    if (!m.fused_kernels) b.btc += 2 * e;  // fused into the residual adds: the masks are regenerated
    if (math) b.bhtt += 2 * e;
  }
  if (m.num_experts > 0) {  // per token: top_k gathered inputs and expert outputs, the router's fp32 logits/probs
    b.btc += static_cast<double>(m.top_k) * (p.half_weights ? 4 : 8) +
             12.0 * static_cast<double>(m.num_experts) / static_cast<double>(m.hidden_size);
    if (m.checkpoint_experts) b.btf = 0;  // each expert keeps its input slice only
  }
  return b;
}

// Outside the blocks, per (B, T, C) element: the embedding output and the final norm.
inline double outside_blocks_btc(const DtypeDesc& p) { return p.half_weights ? 11 : p.half_matmuls ? 14.5 : 16; }

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
  TORCH_CHECK(run.ranks >= 1 && (run.zero == 0 || run.zero == 1 || run.zero == 3), "memopt::memory::estimate: ranks ",
              run.ranks, " and zero ", run.zero, " are not a data-parallel setting. HINT: ranks >= 1, zero 0, 1 or 3");
  const auto numels = m.trainable_numels();  // what the optimizer steps (LoRA: the adapters alone)
  double P = 0, largest = 0;
  for (int64_t n : numels) P += static_cast<double>(n), largest = std::max(largest, static_cast<double>(n));
  const bool z3 = run.zero == 3;
  const double N = static_cast<double>(run.ranks);
  const double state_share = run.zero >= 1 ? 1 / N : 1;  // of the optimizer state and fp32 masters
  const double B = static_cast<double>(run.micro_batch), T = static_cast<double>(run.seq_len);
  const double C = static_cast<double>(m.hidden_size), V = static_cast<double>(m.vocab_size);
  const double F = static_cast<double>(m.ffn_size);
  const bool pure = pol.precision.half_weights;
  const bool autocast = pol.precision.half_matmuls && !pure;
  const bool in_backward = pol.state.steps_in_backward;  // no gradient outlives its parameter's step
  const bool math = m.attention == nn::AttentionKind::kMath;
  const double grad_e = pure ? 2 : 4;  // gradients are the parameters' dtype until the step
  const double experts = static_cast<double>(std::max<int64_t>(m.num_experts, 1));
  const double Q = static_cast<double>(m.q_dim()), KV = static_cast<double>(m.kv_dim());  // H·D, KV·D
  const double block_params = 2 * C * Q + 2 * C * KV + experts * 3 * C * F + static_cast<double>(m.num_experts) * C +
                              2 * C;
  const double embed_params = V * C;
  // What trains: every parameter, or with LoRA a block's adapters and nothing of the head.
  const double block_trainable = m.lora() ? P / static_cast<double>(m.num_layers) : block_params;
  const double head_trainable = m.lora() ? 0 : embed_params + C;
  double mlp_trainable = experts * 3 * C * F;  // the feed-forward's gradients
  // QLoRA: nf4_linear's transients on the CPU, the largest over the Linears: the weight's
  // dequantised tile (the whole weight when it is within nn::kNf4TileBytes; else whole rows
  // forward, whole columns backward, in the compute dtype) and its blocks' fp32 scales with the
  // fp32 copy that double quantisation's dequantising makes (2 × 4 B per 64 weights).
  const double compute_bytes = autocast || pure ? 2 : 4;
  double dequant = 0;
  if (m.lora()) {
    mlp_trainable = 0;
    const auto linears = m.block_linears();
    const auto tile_bytes = static_cast<double>(nn::kNf4TileBytes);
    for (size_t i = 0; i < linears.size(); ++i) {
      const double out = static_cast<double>(linears[i].first), in = static_cast<double>(linears[i].second);
      const double dense = out * in * compute_bytes;
      const double tile = dense <= tile_bytes ? dense
                                              : std::max(std::ceil(tile_bytes / (in * compute_bytes)) * in,
                                                         std::ceil(tile_bytes / (out * compute_bytes)) * out) *
                                                    compute_bytes;
      if (m.nf4_base) dequant = std::max(dequant, tile + out * in / 8);
      if (i >= 4 && (m.lora_targets & (1u << i)))
        mlp_trainable += static_cast<double>(m.lora_rank * m.experts_per_linear(i)) * (out + in);
    }
  }

  // ZeRO-3: the shards (one flat per block, one for the root), and what a step holds whole: the
  // root (embedding, final norm, head) and two blocks, each with its padded fp32 gradient buffers.
  const double param_e = pure ? 2 : 4;
  const double root = P - static_cast<double>(m.num_layers) * block_trainable;
  const double shard = z3 ? 1 / N : 1;
  std::vector<int64_t> state_numels = numels;
  if (run.zero >= 1 && run.ranks > 1) {
    state_numels.assign(static_cast<size_t>(m.num_layers), static_cast<int64_t>(std::ceil(block_trainable / N)));
    state_numels.push_back(static_cast<int64_t>(std::ceil(root / N)));
  }
  const double gather_e = run.gather_half && autocast ? 2 : param_e;  // a block's gathered weights and their gradients
  const double blocks_whole = run.keep_gathered ? static_cast<double>(m.num_layers) : 2;
  const double gathered = z3 ? param_e * root + gather_e * blocks_whole * block_trainable : 0;
  const double reduce_buffers = z3 ? 2 * 4 * block_trainable + gather_e * block_trainable : 0;  // + its full gradients
  if (z3) largest = std::max(block_trainable, root) / N;

  Estimate e;
  e.parameters = m.frozen_bytes(pure ? 2 : 4) + (z3 && run.offload_params ? 0 : static_cast<int64_t>(param_e * P * shard));
  e.master_weights = pure ? static_cast<int64_t>(4 * P * state_share) : 0;
  e.gradients = in_backward ? 0 : static_cast<int64_t>(4 * P * shard);
  e.optimizer_state = pol.state.resident(state_numels);
  const double rows = static_cast<double>(run.micro_batch * run.seq_len);
  e.teacher = m.frozen_parameter_bytes + static_cast<int64_t>(rows) * m.teacher_target_bytes;
  const double statics =
      static_cast<double>(e.parameters + e.master_weights + e.optimizer_state + e.teacher) + run.held_bytes;

  // ---- what the forward keeps ----
  const double btc = B * T * C;
  auto per_block = detail::block_saved(pol.precision, pol.recompute.cheap_parts, m);
  if (run.key_padding && per_block.bhtt > 0 && !pol.precision.half_matmuls)
    per_block.bhtt += 4;  // the probabilities with fully padded rows zeroed feed the PV matmul
  double outside_btc = detail::outside_blocks_btc(pol.precision);
  if (m.lora()) {  // a frozen weight needs no saved input for its gradient (an adapter on it saves the same one)
    const double norm = pure ? 2 : 4;                    // a norm's x·rsqrt: fp32 (bf16 when pure)
    const double input = autocast || pure ? 2 : 4;      // a matmul's saved input: autocast's bf16 cast
    const auto adapted = [&](std::initializer_list<size_t> slots) {
      return std::any_of(slots.begin(), slots.end(), [&](size_t i) { return (m.lora_targets >> i) & 1u; });
    };
    per_block.btc -= 2 * norm;                           // the two norms' x·rsqrt, for their weights
    if (!adapted({0, 1, 2})) per_block.btc -= input;     // the attention norm's output, for q, k, v
    if (!adapted({3})) per_block.btc -= input;           // the attention output, for o_proj
    if (!adapted({4, 5})) per_block.btc -= input;        // the MLP norm's output, for gate and up
    if (!adapted({6})) per_block.btf -= input;           // silu(gate)·up, for down_proj
    outside_btc -= norm + input;                         // the final norm's x·rsqrt and output, for lm_head
  }
  // SwiGLU row tiles (nn::SwiGLUOptions::row_tiles): each tile is checkpointed, so a block keeps no
  // (B, T, F) tensor and its MLP input is the norm's output itself (fp32; bf16 when pure), which the
  // tiles reference, instead of its matmul cast; backward recomputes one tile at a time.
  const double tiles = m.num_experts > 0 ? 1 : static_cast<double>(std::max<int64_t>(m.mlp_row_tiles, 1));
  const double tile_btf = per_block.btf;  // what a tile's recompute keeps, per (B, T, F) element
  if (tiles > 1) {
    const bool mlp_input_saved = !m.lora() || ((m.lora_targets >> 4) & 3u) != 0;  // gate or up adapted
    per_block.btf = 0;
    per_block.btc += (pure ? 2 : 4) - (mlp_input_saved ? (autocast || pure ? 2 : 4) : 0);
  }
  const double full = per_block.bytes(B, T, m);
  const double input = btc * (pure ? 2 : 4);  // a checkpointed block keeps its input only
  std::vector<bool> recomputed(static_cast<size_t>(m.num_layers), false);
  for (int64_t i = 0; i < m.num_layers; ++i)
    recomputed[static_cast<size_t>(i)] = z3 || pol.recompute.whole_block(i, m.num_layers);  // ZeRO-3: always
  std::vector<double> kept(recomputed.size());
  double stack = 0;
  for (size_t i = 0; i < kept.size(); ++i) stack += kept[i] = recomputed[i] ? input : full;
  // Autocast's bf16 copies of the linear weights (and adapters), saved for backward; a recomputed
  // block's copies are made again in its backward instead. nf4_linear saves none: it dequantises again.
  const double block_cast = autocast ? 2 * ((m.nf4_base ? 0 : block_params) + (m.lora() ? block_trainable : 0)) : 0;
  double casts = autocast ? 2 * embed_params : 0;  // lm_head
  for (bool r : recomputed) casts += r ? 0 : block_cast;
  const double outside = btc * outside_btc;
  const bool chunked = m.loss_chunk_size > 0;
  const double chunk_rows = chunked ? std::min<double>(static_cast<double>(m.loss_chunk_size), rows) : rows;
  // Saved by the loss: the fp32 log-probabilities (+ the KD term's, and the fp32 copy it slices).
  const double logprobs =
      chunked || !run.lm_head ? 0 : rows * V * ((autocast ? 5 : 4) + (m.kd ? (autocast ? 7 : 5) : 0));
  e.activations = static_cast<int64_t>(stack + outside);
  e.saved = static_cast<int64_t>(stack + outside + logprobs);
  // earlier micro-batches' gradients (ZeRO-3: the shards', and the root's whole)
  const double grads_held = pol.accum > 1 || run.grads_held ? grad_e * (z3 ? P / N + root : P) : 0;

  // ---- forward moments: a block's attention scores, then the logits ----
  const double scores = math ? 2 * B * m.num_heads * T * T * (autocast || pure ? 2 : 4) : 0;
  const double attn_in = 7 * btc * 4;  // normed input, q, k, v, RoPE temporaries
  const double before_last = statics + gathered + grads_held + casts + stack - kept.back() + btc * 4;
  const double fwd_block = before_last + attn_in + scores + dequant;
  const double logits = run.lm_head ? chunk_rows * V * (autocast || pure ? 6 : 4) : 0;  // (bf16 +) fp32 logits
  const double fwd_end = statics + gathered + grads_held + casts + stack + outside + logprobs;
  // A teacher first runs without a graph: its logits exist while its targets are made.
  const double teacher_logits = m.teacher_vocab > 0 ? rows * static_cast<double>(m.teacher_vocab) * 4 * 2 : 0;
  // The KD term's (rows, K) temporaries: the teacher's scaled log-probabilities, probabilities,
  // differences and products, next to the student's logits.
  const double kd_tmp = rows * static_cast<double>(m.kd_classes) * 4 * 7;
  // The chunked loss forms its gradients in forward: dHidden in the matmul dtype, and dWeight in
  // fp32 (+ a bf16 product) when the head trains; its backward only scales them, in place.
  const double head_grads = chunked && run.lm_head
                                ? rows * C * (autocast || pure ? 2 : 4) + head_trainable * (autocast || pure ? 6 : 4)
                                : 0;
  e.forward_peak = static_cast<int64_t>(
      std::max({fwd_block, fwd_end + logits + kd_tmp + head_grads, statics + teacher_logits}));

  // ---- backward moments ----
  const double head_bwd = fwd_end + (chunked ? head_grads
                                     : run.lm_head ? chunk_rows * V * (m.kd ? 12 : 8)  // 2 (3 with KD) fp32 grads
                                                   : 0);
  // lm_head and final norm first; stepped in backward: one block parameter's gradient and AdamW's
  // temporaries at a time
  const double block_largest = m.lora() ? largest : std::max({C * Q, C * KV, C * F});
  double grads = in_backward ? (grad_e + 2 * 4) * block_largest
                 : grads_held > 0 ? grads_held
                                  : grad_e * head_trainable;
  double live = statics + gathered + casts + stack + btc * 4 * 2;  // + the gradient flowing down, the embedding output
  double bwd_peak = head_bwd;
  // The feed-forward's part of a block's saved tensors, freed before the attention's backward:
  // its (B, T, F) tensors and 30 B per (B, T, C) element of norm and residual tensors (measured).
  ModelDesc plain = m;
  plain.dropout = false;
  const double ffn_btf = tiles > 1 ? 0 : detail::block_saved(pol.precision, false, plain).btf;
  const double mlp_saved = B * T * (F * static_cast<double>(m.ffn_rows()) * ffn_btf + C * 30);
  for (int64_t i = m.num_layers - 1; i >= 0; --i) {
    const auto u = static_cast<size_t>(i);
    const double recompute = recomputed[u] ? full + block_cast : 0;
    const double at_top = live + recompute + grads + dequant;
    const double mlp_moment = at_top +
                              B * T * F * static_cast<double>(m.ffn_rows()) *
                                  ((tiles > 1 ? tile_btf : 0) + 2 * (pure || autocast ? 2 : 4)) / tiles +
                              2 * btc * 4;
    const double attn_moment = at_top - mlp_saved + (math ? B * m.num_heads * T * T * (autocast || pure ? 6 : 8) : 0) +
                               (grads_held > 0 || in_backward ? 0 : grad_e * mlp_trainable);
    // ZeRO-3: the block's gradients whole, with the reduce-scatter's fp32 buffers (activations freed)
    const double reduce_moment = live + grads + reduce_buffers;
    bwd_peak = std::max({bwd_peak, mlp_moment, attn_moment, reduce_moment});
    live -= kept[u];
    if (grads_held == 0 && !in_backward) grads += grad_e * block_trainable * shard;
  }
  e.backward_peak = static_cast<int64_t>(bwd_peak);
  e.head = static_cast<int64_t>(logprobs + (run.lm_head ? chunk_rows * V * 8 : 0));
  e.workspace = static_cast<int64_t>(casts + std::max(scores + attn_in, 0.0));

  // ---- the optimizer step: every gradient in fp32, the state brought in for the step and
  // AdamW's per-parameter temporaries, none in a fused step (other passes' activations and the
  // teacher's targets are gone by then; stepped in backward, nothing is left) ----
  const double targets = rows * static_cast<double>(m.teacher_target_bytes);
  const double brought_in = static_cast<double>(pol.state.step_state_bytes(state_numels) - e.optimizer_state);
  const double step_temporaries = pol.state.fused_step ? 0 : 2 * 4 * largest;
  e.optimizer_peak = static_cast<int64_t>(statics - run.held_bytes - targets +
                                          (in_backward ? 0 : 4 * P * shard + brought_in + step_temporaries));
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
