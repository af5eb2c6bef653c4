// memopt/models/distill.hpp — the LLaMA→LLaDA distillation objective: an autoregressive
// teacher (causal Llama) and a masked-diffusion student (bidirectional Llama whose vocab
// has one more id, the mask token). Per batch: mask the clean sequence (LLaDA's forward
// process), run the teacher on the clean sequence, the student on the masked one, and mix
// the diffusion loss with a KD term on the masked positions:
//   loss_sum = (1 − alpha) · Σ_masked CE / p  +  alpha · Σ_masked,i≥1 KL(teacher[i−1] ‖ student[i]) · T² / p
// The Trainer divides by B·L (every token is a target), as LLaDA's pre-training loss does.
#pragma once

#include <cstdint>
#include <utility>

#include <torch/torch.h>

#include "memopt/batch.hpp"
#include "memopt/concepts.hpp"
#include "memopt/detail/autocast.hpp"
#include "memopt/models/llada.hpp"
#include "memopt/models/llama.hpp"
#include "memopt/policies/recompute.hpp"

namespace memopt::models {

/// How the teacher runs and how the two losses mix.
///   auto opts = memopt::models::DistillOptions(/*mask_id=*/V).alpha(0.5).temperature(2).top_k(32);
struct DistillOptions {
  explicit DistillOptions(int64_t mask_id) : mask_id_(mask_id) {}
  /// The student's mask token (the teacher's vocab size: one past its last id).
  TORCH_ARG(int64_t, mask_id);
  /// Weight of the KD term; 0 trains the student on the diffusion loss alone (no teacher run).
  TORCH_ARG(double, alpha) = 0.5;
  /// Softmax temperature T of both distributions in the KD term (the term is scaled by T²).
  TORCH_ARG(double, temperature) = 2.0;
  /// Keep only the teacher's k largest logits per position (sparse KD); 0 keeps all V.
  TORCH_ARG(int64_t, top_k) = 0;
  /// LLaDA's minimum mask probability: p = (1 − eps)·t + eps.
  TORCH_ARG(double, eps) = 1e-3;
  /// false: the teacher runs under torch::InferenceMode (no graph, no saved activations),
  /// on the device of its parameters (its own GPU in CUDA builds, like the seed scripts).
  /// true: the naive way — its forward records a graph and its parameters receive
  /// gradients that nobody uses (the "no optimizations" baseline of the benchmark).
  TORCH_ARG(bool, teacher_autograd) = false;
  /// Run the teacher's matmuls in bf16 (autocast); its weights may be bf16 too.
  TORCH_ARG(bool, teacher_bf16) = false;


 public:
  void validate(int64_t teacher_vocab, int64_t student_vocab) const {
    TORCH_CHECK(alpha_ >= 0 && alpha_ <= 1, "memopt::models::DistillOptions: alpha must lie in [0, 1] (got ", alpha_,
                "). HINT: 0 is diffusion loss only, 1 is KD only; 0.5 mixes them equally.");
    TORCH_CHECK(temperature_ > 0, "memopt::models::DistillOptions: temperature must be > 0 (got ", temperature_,
                "). HINT: 1 keeps the teacher's distribution, 2 softens it.");
    TORCH_CHECK(top_k_ >= 0 && top_k_ <= teacher_vocab, "memopt::models::DistillOptions: top_k must lie in [0, ",
                teacher_vocab, "] (got ", top_k_, "). HINT: 0 keeps every logit; 32–128 is usual for sparse KD.");
    TORCH_CHECK(eps_ > 0 && eps_ < 1, "memopt::models::DistillOptions: eps must lie in (0, 1) (got ", eps_,
                "). HINT: LLaDA uses 1e-3.");
    TORCH_CHECK(student_vocab == teacher_vocab + 1 && mask_id_ == teacher_vocab,
                "memopt::models::Distiller: the student's vocab must be the teacher's plus one mask token (teacher ",
                teacher_vocab, ", student ", student_vocab, ", mask_id ", mask_id_,
                "). HINT: build the student with vocab_size = teacher vocab_size + 1 and mask_id = teacher vocab_size.");
  }
};

/// A LLaMA → LLaDA distillation step as the memory estimator sees it: the student, plus the
/// frozen teacher's weights (4 or 2 B/param), its targets held through the student's step and,
/// when alpha > 0, the KD term's log-softmax.
inline memory::ModelDesc describe_distill(const LlamaConfig& student, const LlamaConfig& teacher,
                                          const DistillOptions& options, bool teacher_bf16_weights) {
  memory::ModelDesc d = describe(student);
  if (options.alpha() <= 0) return d;
  d.frozen_parameter_bytes = describe(teacher).num_parameters() * (teacher_bf16_weights ? 2 : 4);
  d.kd = true;
  d.teacher_vocab = teacher.vocab_size();
  const int64_t K = options.top_k() > 0 ? options.top_k() : teacher.vocab_size();
  d.kd_classes = K;
  d.teacher_target_bytes = options.top_k() > 0 ? K * (4 + 8) + 4 : K * (teacher_bf16_weights ? 2 : 4);
  return d;
}

/// Running sums of the two loss terms since the last read (tensors: no host sync).
struct DistillTerms {
  torch::Tensor diffusion_sum;  // 0-dim: Σ CE/p over masked positions
  torch::Tensor kd_sum;         // 0-dim: Σ KL·T²/p over masked positions i ≥ 1
  torch::Tensor tokens;         // 0-dim: B·L summed over the batches
};

/// Teacher + student + the mixed objective; `loss_sum` is a memopt::LossFunction.
///   memopt::models::Distiller distill(teacher, student, memopt::models::DistillOptions(V));
///   trainer.fit(loader, [&](const memopt::Batch& b, const auto& ckpt) { return distill.loss_sum(b, ckpt); });
class Distiller {
 public:
  Distiller(Llama teacher, Llama student, DistillOptions options)
      : teacher_(std::move(teacher)), student_(std::move(student)), options_(std::move(options)) {
    TORCH_CHECK(student_, "memopt::models::Distiller: the student is null. HINT: pass a constructed Llama.");
    TORCH_CHECK(!student_->config.causal(), "memopt::models::Distiller: the student must be bidirectional. "
                "HINT: build it with LlamaConfig().causal(false).");
    TORCH_CHECK(teacher_ || options_.alpha() == 0, "memopt::models::Distiller: alpha is ", options_.alpha(),
                " but there is no teacher. HINT: pass a teacher, or alpha 0 for diffusion loss only.");
    const int64_t teacher_vocab = teacher_ ? teacher_->config.vocab_size() : options_.mask_id();
    options_.validate(teacher_vocab, student_->config.vocab_size());
    if (teacher_) {
      TORCH_CHECK(teacher_->config.causal(), "memopt::models::Distiller: the teacher must be autoregressive "
                  "(causal). HINT: a LLaDA teacher is not what this objective distils from.");
      teacher_->eval();
      for (auto& p : teacher_->parameters()) p.set_requires_grad(options_.teacher_autograd());
    }
    reset_terms();
  }

  /// Σ over the batch of the mixed loss (fp32, 0-dim). x0 = batch.inputs (B, L).
  template <RecomputePolicy Recompute>
  torch::Tensor loss_sum(const Batch& batch, const Recompute& ckpt) {
    const torch::Tensor& x0 = batch.inputs;  // (B, L)
    // The teacher first: its (B, L, V) logits are gone (top-k kept) before the student's exist.
    const bool kd = options_.alpha() > 0;
    llada::TeacherTargets targets = kd ? teacher_targets(x0) : llada::TeacherTargets{};      // (B, L, V) or (B, L, K)
    llada::Masked masked = llada::forward_process(x0, options_.mask_id(), options_.eps());  // noisy (B, L)
    torch::Tensor logits = student_->forward(masked.noisy, ckpt);                            // (B, L, V + 1)
    torch::Tensor diffusion = llada::diffusion_loss_sum(logits, x0, masked);                 // 0-dim
    terms_.diffusion_sum += diffusion.detach();
    terms_.tokens += static_cast<double>(x0.numel());
    if (!kd) return diffusion;
    torch::Tensor distill = llada::kd_loss_sum(logits, targets, masked, options_.temperature());  // 0-dim
    terms_.kd_sum += distill.detach();
    return (1.0 - options_.alpha()) * diffusion + options_.alpha() * distill;
  }

  /// The teacher's logits (dense or top-k) on the clean sequence x0 (B, L).
  llada::TeacherTargets teacher_targets(const torch::Tensor& x0) {
    const int64_t k = options_.top_k();
    const double T = options_.temperature();
    if (options_.teacher_autograd()) {
      // The naive way: the targets stay attached to the teacher's graph, so its activations
      // live until the backward, which then computes gradients for the teacher too.
      torch::Tensor logits = teacher_forward(x0).to(x0.device());  // (B, L, V)
      llada::TeacherTargets attached = llada::teacher_targets(logits, k, T);
      attached.logits_or_values = k == 0 ? logits : logits.gather(-1, attached.indices);
      return attached;
    }
    llada::TeacherTargets inference;
    {
      c10::InferenceMode no_graph;
      inference = llada::teacher_targets(teacher_forward(x0), k, T);  // (B, L, K)
    }
    // Inference tensors may not be saved for backward: normal copies of the (small) targets,
    // on the student's device (the teacher may live on a device of its own).
    const c10::Device device = x0.device();
    auto copy = [&](const torch::Tensor& t) {
      return t.defined() ? t.to(t.options().device(device), /*non_blocking=*/false, /*copy=*/true) : t;
    };
    return {copy(inference.logits_or_values), copy(inference.indices), copy(inference.log_normalizer),
            inference.temperature};
  }

  /// Drops the gradients the teacher received (teacher_autograd only); call after each step.
  void clear_teacher_grads() {
    if (!teacher_) return;
    for (auto& p : teacher_->parameters()) p.mutable_grad() = torch::Tensor();
  }

  /// The sums since the last call, then starts new ones.
  DistillTerms take_terms() { return std::exchange(terms_, fresh_terms()); }

  /// The autocast state the teacher runs under (bf16 when teacher_bf16, off otherwise), for
  /// calling the teacher directly.   { auto guard = distill.teacher_autocast(); distill.teacher()->generate(...); }
  memopt::detail::AutocastGuard teacher_autocast() const {
    return memopt::detail::AutocastGuard(
        {teacher_->lm_head->weight.device().type(), options_.teacher_bf16(), c10::kBFloat16});
  }

  Llama& teacher() { return teacher_; }
  Llama& student() { return student_; }
  const DistillOptions& options() const { return options_; }

 private:
  // The teacher's logits on its own device (CUDA builds may give it a GPU of its own).
  torch::Tensor teacher_forward(const torch::Tensor& x0) {
    auto autocast = teacher_autocast();
    return teacher_->forward(x0.to(teacher_->lm_head->weight.device()));  // (B, L, V)
  }

  DistillTerms fresh_terms() const {
    auto opts = torch::TensorOptions().dtype(torch::kFloat).device(student_->lm_head->weight.device());
    return {torch::zeros({}, opts), torch::zeros({}, opts), torch::zeros({}, opts)};
  }
  void reset_terms() { terms_ = fresh_terms(); }

  Llama teacher_{nullptr};
  Llama student_{nullptr};
  DistillOptions options_;
  DistillTerms terms_;
};

}  // namespace memopt::models
