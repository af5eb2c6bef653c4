// memopt/models/llada.hpp — the building blocks of LLaDA, a masked diffusion language
// model (ML-GSAI/LLaDA, GUIDELINES.md and generate.py): the forward (masking) process,
// the pre-training and SFT losses, distillation from an autoregressive teacher, and the
// low-confidence-remasking sampler. The network is any bidirectional mask predictor,
// e.g. memopt::models::Llama with LlamaConfig().causal(false) and one extra class for [MASK].
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "memopt/batch.hpp"

namespace memopt::detail::llada {

// "[2, 8] Long" or "undefined", for error messages.
inline std::string describe(const torch::Tensor& t) {
  return t.defined() ? c10::str(t.sizes(), " ", t.scalar_type()) : std::string("undefined");
}

inline void check_tokens(const torch::Tensor& x, const char* who, const char* name) {
  TORCH_CHECK(x.defined() && x.dim() == 2 && x.scalar_type() == torch::kLong, "memopt::models::llada::", who, ": ",
              name, " must be a (B, L) int64 tensor of token ids (got ", describe(x),
              "). HINT: batch token ids as torch::kLong, one row per sequence.");
}

inline void check_generator(const c10::optional<at::Generator>& gen, const torch::Device& device, const char* who) {
  TORCH_CHECK(!gen.has_value() || gen->device().type() == device.type(), "memopt::models::llada::", who,
              ": the generator is on ", (gen.has_value() ? gen->device() : device), " but the tokens are on ", device,
              ". HINT: pass a generator of the tokens' device, e.g. "
              "at::globalContext().defaultGenerator(tokens.device()).clone().");
}

// logits must be (B, L, V) for tokens (B, L).
inline void check_logits(const torch::Tensor& logits, int64_t B, int64_t L, const char* who, const char* name) {
  TORCH_CHECK(logits.defined() && logits.dim() == 3 && logits.size(0) == B && logits.size(1) == L,
              "memopt::models::llada::", who, ": ", name, " must be (B, L, V) with (B, L) = (", B, ", ", L,
              ") (got ", describe(logits), "). HINT: run the network on masked.noisy (and a teacher on x0): "
              "both have x0's shape.");
}

// mask (B, L) bool and p (B, 1), as in a Masked, against tokens (B, L).
inline void check_masked(const torch::Tensor& mask, const torch::Tensor& p, int64_t B, int64_t L, const char* who) {
  TORCH_CHECK(mask.defined() && mask.scalar_type() == torch::kBool && mask.dim() == 2 && mask.size(0) == B &&
                  mask.size(1) == L,
              "memopt::models::llada::", who, ": masked.mask must be a (B, L) = (", B, ", ", L,
              ") bool tensor (got ", describe(mask), "). HINT: pass the Masked that forward_process returned for x0.");
  TORCH_CHECK(p.defined() && p.dim() == 2 && p.size(0) == B && p.size(1) == 1, "memopt::models::llada::", who,
              ": masked.p must be (B, 1) = (", B, ", 1) (got ", describe(p),
              "). HINT: one masking probability per sequence, as forward_process returns it.");
}

// (B, L) float32: 1/p where masked, 0 elsewhere (no gradient; no 0·inf where p is 0 off the mask).
inline torch::Tensor inverse_p_weight(const torch::Tensor& mask, const torch::Tensor& p) {
  auto inv = p.to(torch::kFloat).reciprocal();                          // (B, 1)
  return torch::where(mask, inv, torch::zeros_like(inv)).detach();      // (B, L)
}

// (B, L) bool: each token masked independently with its row's probability p (B, 1).
inline torch::Tensor bernoulli_mask(const torch::Tensor& x0, const torch::Tensor& p,
                                    const c10::optional<at::Generator>& gen) {
  return torch::rand({x0.size(0), x0.size(1)}, gen, p.options()) < p;  // (B, L)
}

// The sampler's generator: the caller's, a fresh one seeded on `device`, or none (global).
inline c10::optional<at::Generator> sampler_generator(const c10::optional<uint64_t>& seed,
                                                      const c10::optional<at::Generator>& generator,
                                                      const torch::Device& device) {
  TORCH_CHECK(!(seed.has_value() && generator.has_value()), "memopt::models::llada::generate: both seed and "
              "generator are set. HINT: set one: seed for a fresh generator per call, generator to share one.");
  if (generator.has_value()) {
    check_generator(generator, device, "generate");
    return generator;
  }
  if (!seed.has_value()) return c10::nullopt;
  at::Generator global = at::globalContext().defaultGenerator(device);
  at::Generator fresh;
  {
    std::lock_guard<std::mutex> lock(global.mutex());
    fresh = global.clone();
  }
  fresh.set_current_seed(*seed);
  return fresh;
}

// The network's logits for x (B, L), with classifier-free guidance when cfg_scale > 0:
// un + (cfg + 1)(cond − un), un from x with the prompt masked; both in one call of 2B rows.
inline torch::Tensor guided_logits(const std::function<torch::Tensor(const torch::Tensor&)>& model,
                                   const torch::Tensor& x, const torch::Tensor& prompt_index, int64_t mask_id,
                                   double cfg_scale) {
  const int64_t B = x.size(0), L = x.size(1);
  const bool cfg = cfg_scale > 0;
  auto input = cfg ? torch::cat({x, x.masked_fill(prompt_index, mask_id)}, 0) : x;  // (B or 2B, L)
  auto logits = model(input);                                                        // (B or 2B, L, V)
  TORCH_CHECK(logits.defined() && logits.dim() == 3 && logits.size(0) == input.size(0) && logits.size(1) == L,
              "memopt::models::llada::generate: the model must map tokens (", input.size(0), ", ", L,
              ") to logits (", input.size(0), ", ", L, ", V) (got ", describe(logits),
              "). HINT: return the logits of every position of a bidirectional model.");
  TORCH_CHECK(mask_id < logits.size(2), "memopt::models::llada::generate: mask_id ", mask_id,
              " is not a class of the model's ", logits.size(2),
              " logits. HINT: the student's vocabulary holds [MASK]; use its index (often V' − 1).");
  if (!cfg) return logits;
  auto cond = logits.slice(0, 0, B), un = logits.slice(0, B);  // (B, L, V) each
  return un + (cfg_scale + 1) * (cond - un);                   // (B, L, V)
}

// generate.py's add_gumbel_noise then argmax: exp(logits) / (−log u)^T in float64, which is
// Gumbel-max sampling from softmax(logits / T); T = 0 is plain argmax (no draws).
inline torch::Tensor sample_tokens(const torch::Tensor& logits, double temperature,
                                   const c10::optional<at::Generator>& gen) {
  if (temperature == 0) return logits.argmax(-1);                          // (B, L)
  auto l64 = logits.to(torch::kDouble);                                    // (B, L, V)
  auto noise = torch::rand(l64.sizes(), gen, l64.options());               // (B, L, V)
  return (l64.exp() / (-torch::log(noise)).pow(temperature)).argmax(-1);  // (B, L)
}

}  // namespace memopt::detail::llada

namespace memopt::models::llada {

namespace dl = memopt::detail::llada;  // the internals above, by a short name

// =====================================================================================
// Forward process
// =====================================================================================

/// A masked (noised) batch: what the forward process hands the network and the loss.
///   auto m = memopt::models::llada::forward_process(x0, mask_id);  // m.noisy feeds the network
struct Masked {
  torch::Tensor noisy;  // (B, L) int64: x0 with mask_id where masked
  torch::Tensor mask;   // (B, L) bool: true where masked
  torch::Tensor p;      // (B, 1) float32: the probability each token of the row was masked with
};

/// LLaDA's forward process (GUIDELINES.md): per sequence t ~ U(0, 1), p = (1 − eps)·t + eps,
/// then every token is masked independently with probability p ≥ eps; the network is not
/// given t. Draws t (B) then the (B, L) uniforms from `gen` (default: torch's global
/// generator of x0's device), in the reference's order: a CPU generator seeded like
/// python's torch.manual_seed gives python's masks.
///   auto m = memopt::models::llada::forward_process(x0, /*mask_id=*/vocab, 1e-3, gen);
inline Masked forward_process(const torch::Tensor& x0, int64_t mask_id, double eps = 1e-3,
                              const c10::optional<at::Generator>& gen = c10::nullopt) {
  dl::check_tokens(x0, "forward_process", "x0");
  dl::check_generator(gen, x0.device(), "forward_process");
  TORCH_CHECK(eps > 0 && eps <= 1, "memopt::models::llada::forward_process: eps must lie in (0, 1] (got ", eps,
              "). HINT: LLaDA uses 1e-3; p >= eps keeps the 1/p loss weight finite.");
  auto t = torch::rand({x0.size(0)}, gen, torch::TensorOptions().dtype(torch::kFloat).device(x0.device()));  // (B)
  auto p = ((1 - eps) * t + eps).unsqueeze(1);  // (B, 1)
  auto mask = dl::bernoulli_mask(x0, p, gen);   // (B, L)
  return {x0.masked_fill(mask, mask_id), mask, p};
}

/// Masks every token with the fixed probability `ratio` (evaluation at 0.15 / 0.5 / 0.85).
///   auto m = memopt::models::llada::mask_at_ratio(x0, mask_id, 0.5);
inline Masked mask_at_ratio(const torch::Tensor& x0, int64_t mask_id, double ratio,
                            const c10::optional<at::Generator>& gen = c10::nullopt) {
  dl::check_tokens(x0, "mask_at_ratio", "x0");
  dl::check_generator(gen, x0.device(), "mask_at_ratio");
  TORCH_CHECK(ratio > 0 && ratio <= 1, "memopt::models::llada::mask_at_ratio: ratio must lie in (0, 1] (got ", ratio,
              "). HINT: the losses weight each masked token by 1/ratio.");
  auto p = torch::full({x0.size(0), 1}, ratio, torch::TensorOptions().dtype(torch::kFloat).device(x0.device()));
  auto mask = dl::bernoulli_mask(x0, p, gen);  // (B, L)
  return {x0.masked_fill(mask, mask_id), mask, p};
}

/// SFT's forward process (GUIDELINES.md): forward_process, then the first prompt_lengths[b]
/// tokens of row b are restored, so the prompt is never masked (same draws as forward_process).
///   auto m = memopt::models::llada::forward_process_sft(x0, prompt_lengths, mask_id);
inline Masked forward_process_sft(const torch::Tensor& x0, const torch::Tensor& prompt_lengths, int64_t mask_id,
                                  double eps = 1e-3, const c10::optional<at::Generator>& gen = c10::nullopt) {
  dl::check_tokens(x0, "forward_process_sft", "x0");
  TORCH_CHECK(prompt_lengths.defined() && prompt_lengths.dim() == 1 && prompt_lengths.size(0) == x0.size(0),
              "memopt::models::llada::forward_process_sft: prompt_lengths must be (B) = (", x0.size(0), ") (got ",
              dl::describe(prompt_lengths), "). HINT: one prompt length per row of x0.");
  auto masked = forward_process(x0, mask_id, eps, gen);
  auto positions = torch::arange(x0.size(1), x0.options()).unsqueeze(0);          // (1, L)
  auto prompt = positions < prompt_lengths.to(x0.device()).unsqueeze(1);          // (B, L)
  masked.mask = masked.mask.logical_and(prompt.logical_not());                    // (B, L)
  masked.noisy = x0.masked_fill(masked.mask, mask_id);                            // (B, L)
  return masked;
}

// =====================================================================================
// Losses: each returns a 0-dim float32 SUM; the caller (memopt's Trainer) normalises.
// =====================================================================================

/// Σ over masked positions of CE(logits, x0) / p, with the cross-entropy in fp32 whatever
/// the logits' dtype; logits (B, L, V') from the network on masked.noisy. LLaDA's
/// pre-training loss is this ÷ (B·L) — ALL tokens, not the masked count — which is what
/// memopt's Trainer does when every target counts:
///   memopt::Loss{llada::diffusion_loss_sum(logits, x0, m), torch::tensor(x0.numel())}
inline torch::Tensor diffusion_loss_sum(const torch::Tensor& logits, const torch::Tensor& x0, const Masked& masked) {
  dl::check_tokens(x0, "diffusion_loss_sum", "x0");
  const int64_t B = x0.size(0), L = x0.size(1);
  dl::check_logits(logits, B, L, "diffusion_loss_sum", "logits");
  dl::check_masked(masked.mask, masked.p, B, L, "diffusion_loss_sum");
  auto targets = x0.masked_fill(masked.mask.logical_not(), kIgnoreIndex);  // (B, L): only masked tokens count
  auto ce = torch::nn::functional::cross_entropy(
      logits.reshape({B * L, logits.size(-1)}).to(torch::kFloat), targets.reshape({-1}),
      torch::nn::functional::CrossEntropyFuncOptions().ignore_index(kIgnoreIndex).reduction(torch::kNone));  // (B·L)
  return (ce.view({B, L}) * dl::inverse_p_weight(masked.mask, masked.p)).sum();  // 0-dim
}

/// B × LLaDA's SFT loss: Σ_b Σ_masked CE/p / answer_length_b with answer_length_b =
/// L − prompt_lengths[b] (EOS padding counts as answer), so ÷ B gives GUIDELINES.md's SFT loss:
///   memopt::Loss{llada::sft_loss_sum(logits, x0, m, prompt_lengths), torch::tensor(x0.size(0))}
inline torch::Tensor sft_loss_sum(const torch::Tensor& logits, const torch::Tensor& x0, const Masked& masked,
                                  const torch::Tensor& prompt_lengths) {
  dl::check_tokens(x0, "sft_loss_sum", "x0");
  const int64_t B = x0.size(0), L = x0.size(1);
  dl::check_masked(masked.mask, masked.p, B, L, "sft_loss_sum");
  TORCH_CHECK(prompt_lengths.defined() && prompt_lengths.dim() == 1 && prompt_lengths.size(0) == B,
              "memopt::models::llada::sft_loss_sum: prompt_lengths must be (B) = (", B, ") (got ",
              dl::describe(prompt_lengths), "). HINT: pass the prompt_lengths given to forward_process_sft.");
  auto answer_lengths = (L - prompt_lengths.to(masked.p.device())).clamp_min(1).to(torch::kFloat).view({B, 1});
  const Masked per_answer{masked.noisy, masked.mask, masked.p.to(torch::kFloat) * answer_lengths};  // p (B, 1)
  return diffusion_loss_sum(logits, x0, per_answer);  // Σ CE / (p · answer_length)
}

// =====================================================================================
// Distillation from an autoregressive teacher
// =====================================================================================

/// What the student learns from: the teacher's logits on the CLEAN sequence, dense (all V)
/// or only its top-k logits and their indices plus one log-normaliser (sparse KD: 2K + 1
/// numbers per position instead of V), kept in the teacher's dtype (e.g. bf16).
/// The normaliser makes the top-k probabilities exact (not renormalised over the k), so the
/// teacher's tail mass 1 − Σ top-k is known and KD compares k + 1 bins: the k classes and
/// "everything else". Renormalising instead would teach the student that every token
/// outside the teacher's top-k is impossible, which ruins its cross-entropy whenever the
/// teacher is unsure (measured: held-out masked CE above ln V with a perplexity-900 teacher).
///   auto targets = memopt::models::llada::teacher_targets(teacher->forward(x0), /*top_k=*/64, /*temperature=*/2);
struct TeacherTargets {
  torch::Tensor logits_or_values;  // (B, L, K): all V logits (dense, K = V) or the top-k logits
  torch::Tensor indices;           // (B, L, K) int64 class ids of the values; undefined when dense
  torch::Tensor log_normalizer;    // (B, L, 1) float32 logsumexp(logits / T) over all V; sparse only
  double temperature = 1.0;        // the T of log_normalizer

  bool sparse() const { return indices.defined(); }
};

/// Keeps all of the teacher's logits (top_k = 0) or only its top-k per position and the
/// log-normaliser at `temperature` (the KD temperature; detached: the teacher is not trained).
///   auto dense = memopt::models::llada::teacher_targets(teacher_logits, 0);
inline TeacherTargets teacher_targets(const torch::Tensor& teacher_logits, int64_t top_k, double temperature = 1.0) {
  TORCH_CHECK(teacher_logits.defined() && teacher_logits.dim() == 3, "memopt::models::llada::teacher_targets: "
              "teacher_logits must be (B, L, V) (got ", dl::describe(teacher_logits),
              "). HINT: pass the teacher's logits on the clean tokens x0.");
  const int64_t V = teacher_logits.size(-1);
  TORCH_CHECK(top_k >= 0 && top_k <= V, "memopt::models::llada::teacher_targets: top_k must lie in [0, ", V,
              "] (got ", top_k, "). HINT: 0 keeps all V logits (dense KD).");
  TORCH_CHECK(temperature > 0, "memopt::models::llada::teacher_targets: temperature must be > 0 (got ", temperature,
              "). HINT: pass the KD temperature.");
  auto logits = teacher_logits.detach();  // (B, L, V)
  if (top_k == 0) return {logits, {}, {}, temperature};
  auto [values, indices] = logits.topk(top_k, -1);                                         // (B, L, K) each
  auto lse = (logits.to(torch::kFloat) / temperature).logsumexp(-1, /*keepdim=*/true);  // (B, L, 1)
  return {values, indices, lse, temperature};
}

/// Σ over masked positions i ≥ 1 of KL(softmax(teacher[i−1]/T) ‖ softmax(student[i]/T))·T²/p.
/// The teacher is autoregressive: on the clean sequence its logits at i−1 predict token i.
/// Position 0 has no teacher prediction, so it gets no KD term, masked or not (its
/// diffusion term still trains it); teacher position L−1 predicts nothing and is unused.
/// E[mask/p] = 1 for every token, so ÷ (B·L) is an unbiased estimate of the mean per-token
/// KL over all positions (the Trainer's "every target counts" normalisation).
/// Dense: the teacher's softmax over its V classes against the student's log_softmax over
/// ALL its V' ≥ V classes (the extra [MASK] class gets zero teacher probability), first V
/// columns. Sparse: k + 1 bins — the teacher's exact top-k probabilities and its tail mass
/// against the student's probabilities of the same k classes and of all the others (with
/// k = V this is the dense KL). All maths in fp32 whatever the dtypes.
///   auto kd = memopt::models::llada::kd_loss_sum(student_logits, targets, m, /*temperature=*/2.0);
inline torch::Tensor kd_loss_sum(const torch::Tensor& student_logits, const TeacherTargets& teacher,
                                 const Masked& masked, double temperature) {
  TORCH_CHECK(student_logits.defined() && student_logits.dim() == 3, "memopt::models::llada::kd_loss_sum: "
              "student_logits must be (B, L, V') (got ", dl::describe(student_logits),
              "). HINT: run the student on masked.noisy.");
  const int64_t B = student_logits.size(0), L = student_logits.size(1), Vs = student_logits.size(2);
  const auto& values = teacher.logits_or_values;  // (B, L, K)
  dl::check_logits(values, B, L, "kd_loss_sum", "teacher.logits_or_values (against the student's logits)");
  const int64_t K = values.size(2);
  TORCH_CHECK(K <= Vs, "memopt::models::llada::kd_loss_sum: the teacher has ", K, " classes but the student only ",
              Vs, ". HINT: the student's vocabulary must contain the teacher's (V' = V + 1 with [MASK]).");
  TORCH_CHECK(!teacher.sparse() || (teacher.indices.sizes() == values.sizes() &&
                                    teacher.indices.scalar_type() == torch::kLong),
              "memopt::models::llada::kd_loss_sum: teacher.indices must be int64 with the values' shape ",
              values.sizes(), " (got ", dl::describe(teacher.indices),
              "). HINT: build TeacherTargets with teacher_targets(logits, top_k).");
  dl::check_masked(masked.mask, masked.p, B, L, "kd_loss_sum");
  TORCH_CHECK(temperature > 0, "memopt::models::llada::kd_loss_sum: temperature must be > 0 (got ", temperature,
              "). HINT: 1 is plain KD; 2 softens both distributions.");

  // Student position i learns from teacher position i − 1, for i = 1 .. L−1.
  auto s_logp = torch::log_softmax(student_logits.slice(1, 1).to(torch::kFloat) / temperature, -1);  // (B, L-1, V')
  auto t_scaled = values.slice(1, 0, L - 1).to(torch::kFloat) / temperature;                        // (B, L-1, K)
  auto kl = [](const torch::Tensor& t_logp, const torch::Tensor& s_logp_at) {  // Σ over the last dim, 0·log 0 = 0
    auto t_p = t_logp.exp();
    return torch::where(t_p > 0, t_p * (t_logp - s_logp_at), torch::zeros_like(t_p)).sum(-1);
  };
  torch::Tensor per_position;  // (B, L-1): KL of position i
  if (teacher.sparse()) {
    TORCH_CHECK(teacher.temperature == temperature && teacher.log_normalizer.defined(),
                "memopt::models::llada::kd_loss_sum: the sparse targets were made at temperature ",
                teacher.temperature, " but the loss uses ", temperature,
                ". HINT: pass the KD temperature to teacher_targets(logits, top_k, temperature).");
    auto index = teacher.indices.slice(1, 0, L - 1);  // (B, L-1, K); gather saves it for backward, which
    if (index.is_inference()) index = index.clone();  // an InferenceMode tensor may not be: a normal copy
    auto s_at = s_logp.gather(-1, index);                                                  // (B, L-1, K)
    auto t_logp = t_scaled - teacher.log_normalizer.slice(1, 0, L - 1).to(torch::kFloat);  // (B, L-1, K) exact
    // The (k+1)-th bin: everything outside the top-k, for both distributions.
    auto t_tail = (1 - t_logp.exp().sum(-1, /*keepdim=*/true)).clamp_min(0);                    // (B, L-1, 1)
    auto s_tail = s_logp.scatter(-1, index, -std::numeric_limits<float>::infinity()).logsumexp(-1, true);
    per_position = kl(t_logp, s_at) + kl(t_tail.log(), s_tail);
  } else {
    per_position = kl(torch::log_softmax(t_scaled, -1), s_logp.slice(-1, 0, K));
  }
  auto weight = dl::inverse_p_weight(masked.mask, masked.p).slice(1, 1);  // (B, L-1)
  return (per_position * weight).sum() * (temperature * temperature);    // 0-dim
}

// =====================================================================================
// Sampler: generate.py, low-confidence remasking
// =====================================================================================

/// Options for generate(); mask_id is required.
///   auto opts = memopt::models::llada::SamplerOptions(/*mask_id=*/vocab).steps(64).gen_length(64).block_length(32);
struct SamplerOptions {
  explicit SamplerOptions(int64_t mask_id) : mask_id_(mask_id) {}
  /// The [MASK] class of the model's vocabulary.
  TORCH_ARG(int64_t, mask_id);
  /// Sampling steps over the whole answer; a multiple of gen_length / block_length.
  TORCH_ARG(int64_t, steps) = 128;
  /// Tokens generated after the prompt.
  TORCH_ARG(int64_t, gen_length) = 128;
  /// Semi-autoregressive block length; gen_length means one block (fixed-length sampling).
  TORCH_ARG(int64_t, block_length) = 128;
  /// 0: argmax, deterministic; > 0: Gumbel-max sampling from softmax(logits / temperature).
  TORCH_ARG(double, temperature) = 0.0;
  /// Unsupervised classifier-free guidance; 0 is off.
  TORCH_ARG(double, cfg_scale) = 0.0;
  /// A fresh generator with this seed on the prompt's device, per call (reproducible runs;
  /// on the CPU the same draws as python's torch.manual_seed(seed)).
  TORCH_ARG(c10::optional<uint64_t>, seed) = c10::nullopt;
  /// Or a generator to draw from (and advance). Neither: torch's global generator.
  TORCH_ARG(c10::optional<at::Generator>, generator) = c10::nullopt;
};

/// How many tokens each of `steps` steps commits when n_mask are masked: n_mask / steps
/// each, one more for the first n_mask % steps steps (generate.py's get_num_transfer_tokens).
///   memopt::models::llada::num_transfer_tokens(10, 4) == std::vector<int64_t>{3, 3, 2, 2}
inline std::vector<int64_t> num_transfer_tokens(int64_t n_mask, int64_t steps) {
  TORCH_CHECK(n_mask >= 0 && steps >= 1, "memopt::models::llada::num_transfer_tokens: need n_mask >= 0 and "
              "steps >= 1 (got ", n_mask, " and ", steps, "). HINT: steps is the number of steps per block.");
  std::vector<int64_t> out(static_cast<size_t>(steps), n_mask / steps);
  for (int64_t i = 0; i < n_mask % steps; ++i) ++out[static_cast<size_t>(i)];
  return out;
}

/// The same per row: mask_index (B, Lb) bool -> (B, steps) int64.
///   auto schedule = memopt::models::llada::num_transfer_tokens(block.eq(mask_id), 8);  // (B, 8)
inline torch::Tensor num_transfer_tokens(const torch::Tensor& mask_index, int64_t steps) {
  TORCH_CHECK(mask_index.defined() && mask_index.dim() == 2 && steps >= 1, "memopt::models::llada::"
              "num_transfer_tokens: need a (B, Lb) mask and steps >= 1 (got ", dl::describe(mask_index), " and ",
              steps, "). HINT: pass x_block.eq(mask_id).");
  auto n = mask_index.sum(1, /*keepdim=*/true, torch::kLong);                 // (B, 1)
  auto step = torch::arange(steps, n.options()).unsqueeze(0);                  // (1, steps)
  return n.div(steps, "floor") + (step < n.remainder(steps)).to(torch::kLong);  // (B, steps)
}

/// LLaDA's sampler (generate.py, low-confidence remasking). x = [prompt, mask × gen_length];
/// block by block (semi-autoregressive when block_length < gen_length), each step predicts
/// every masked token (argmax, or Gumbel-max at temperature > 0) and commits those the model
/// is most confident of (softmax probability of the prediction, float64), as many as
/// num_transfer_tokens says; positions after the current block are never committed and
/// committed tokens are never remasked. Like the reference, nothing stops the model from
/// predicting mask_id itself (a trained student does not: [MASK] is never a target).
/// Runs without autograd; putting the model in eval mode (and back) is the caller's job.
/// on_step(step, x) sees x (B, Lp + gen_length) after each step, step = 0 .. steps − 1.
/// Memory: a step holds the logits in float64 (and the noise at temperature > 0), as the
/// reference does: (B, L, V) × 8 bytes, twice the rows with cfg.
///   auto out = llada::generate([&](const torch::Tensor& x) { return student->forward(x); }, prompt,
///                              llada::SamplerOptions(mask_id).steps(64).gen_length(64).block_length(32));
inline torch::Tensor generate(const std::function<torch::Tensor(const torch::Tensor&)>& model,
                              const torch::Tensor& prompt, const SamplerOptions& options,
                              const std::function<void(int64_t step, const torch::Tensor& x)>& on_step = {}) {
  dl::check_tokens(prompt, "generate", "prompt");
  TORCH_CHECK(prompt.size(0) >= 1, "memopt::models::llada::generate: the prompt batch is empty (got ",
              dl::describe(prompt), "). HINT: prompt is (B, Lp) with B >= 1.");
  TORCH_CHECK(options.gen_length() >= 1 && options.block_length() >= 1 && options.steps() >= 1,
              "memopt::models::llada::generate: steps, gen_length and block_length must be >= 1 (got ",
              options.steps(), ", ", options.gen_length(), ", ", options.block_length(),
              "). HINT: e.g. steps = gen_length = block_length = 128.");
  TORCH_CHECK(options.gen_length() % options.block_length() == 0, "memopt::models::llada::generate: gen_length ",
              options.gen_length(), " is not a multiple of block_length ", options.block_length(),
              ". HINT: pick a block_length dividing gen_length (block_length = gen_length: one block).");
  const int64_t num_blocks = options.gen_length() / options.block_length();
  TORCH_CHECK(options.steps() % num_blocks == 0, "memopt::models::llada::generate: steps ", options.steps(),
              " is not a multiple of the number of blocks ", num_blocks, " (gen_length / block_length = ",
              options.gen_length(), " / ", options.block_length(), "). HINT: each block gets steps / num_blocks "
              "steps; use a multiple of ", num_blocks, ".");
  TORCH_CHECK(options.mask_id() >= 0, "memopt::models::llada::generate: mask_id must be >= 0 (got ",
              options.mask_id(), "). HINT: the id of the [MASK] class of the student's vocabulary.");
  TORCH_CHECK(options.temperature() >= 0 && options.cfg_scale() >= 0, "memopt::models::llada::generate: "
              "temperature and cfg_scale must be >= 0 (got ", options.temperature(), " and ", options.cfg_scale(),
              "). HINT: 0 turns each off.");
  torch::NoGradGuard no_grad;
  const auto gen = dl::sampler_generator(options.seed(), options.generator(), prompt.device());
  const int64_t B = prompt.size(0), Lp = prompt.size(1), mask_id = options.mask_id();
  const int64_t steps_per_block = options.steps() / num_blocks;
  const double neg_inf = -std::numeric_limits<double>::infinity();

  auto x = torch::full({B, Lp + options.gen_length()}, mask_id, prompt.options());  // (B, L)
  x.slice(1, 0, Lp).copy_(prompt);
  const auto prompt_index = x.ne(mask_id);  // (B, L)

  for (int64_t block = 0; block < num_blocks; ++block) {
    const int64_t block_end = Lp + (block + 1) * options.block_length();
    const auto block_mask = x.slice(1, block_end - options.block_length(), block_end).eq(mask_id);  // (B, Lb)
    const auto schedule = num_transfer_tokens(block_mask, steps_per_block).cpu();  // (B, steps_per_block)
    const auto count = schedule.accessor<int64_t, 2>();
    for (int64_t i = 0; i < steps_per_block; ++i) {
      const auto mask_index = x.eq(mask_id);                                                           // (B, L)
      const auto logits = dl::guided_logits(model, x, prompt_index, mask_id, options.cfg_scale());    // (B, L, V)
      auto x0 = dl::sample_tokens(logits, options.temperature(), gen);                                 // (B, L)
      auto x0_p = torch::softmax(logits.to(torch::kDouble), -1).gather(-1, x0.unsqueeze(-1)).squeeze(-1);  // (B, L)
      x0_p.slice(1, block_end).fill_(neg_inf);
      x0 = torch::where(mask_index, x0, x);                                          // (B, L)
      const auto confidence = x0_p.masked_fill(mask_index.logical_not(), neg_inf);   // (B, L) float64
      for (int64_t j = 0; j < B; ++j) {
        const auto chosen = std::get<1>(confidence[j].topk(count[j][i]));  // (k)
        x[j].index_put_({chosen}, x0[j].index({chosen}));
      }
      if (on_step) on_step(block * steps_per_block + i, x);
    }
  }
  return x;  // (B, Lp + gen_length)
}

}  // namespace memopt::models::llada
