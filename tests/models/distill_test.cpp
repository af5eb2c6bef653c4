// tests/models/distill_test.cpp — memopt::models::Distiller, the LLaMA→LLaDA objective:
// the teacher under InferenceMode leaves nothing behind but its targets (exact tracker
// bytes) and never receives gradients, while the naive teacher_autograd mode keeps its
// graph; the mixed loss is (1 − alpha)·diffusion + alpha·KD with the same masks; alpha 0
// needs no teacher; bad pairs of models are rejected with a HINT.
#include <catch2/catch.hpp>

#include <functional>

#include <torch/torch.h>

#include "support.hpp"

#include <memopt/memory/tracker.hpp>
#include <memopt/models/distill.hpp>
#include <memopt/models/llada.hpp>
#include <memopt/policies/recompute.hpp>

namespace {

using memopt::models::DistillOptions;
using memopt::models::Distiller;
using memopt::models::Llama;
using memopt::models::LlamaConfig;
namespace llada = memopt::models::llada;

constexpr int64_t kVocab = 31;

LlamaConfig tiny(int64_t vocab, bool causal) {
  return LlamaConfig()
      .vocab_size(vocab)
      .hidden_size(32)
      .num_hidden_layers(2)
      .num_attention_heads(4)
      .max_position_embeddings(64)
      .causal(causal);
}

memopt::Batch batch(int64_t B, int64_t L, int64_t seed) {
  torch::manual_seed(seed);
  auto x = torch::randint(kVocab, {B, L}, torch::kLong);
  return {x, x};
}

}  // namespace

TEST_CASE("Distiller: the inference-mode teacher leaves only its targets and gets no gradients", "[distill]") {
  torch::manual_seed(1);
  Llama teacher(tiny(kVocab, true)), student(tiny(kVocab + 1, false));
  Distiller distill(teacher, student, DistillOptions(kVocab).top_k(4));
  const auto b = batch(2, 16, 2);
  auto& tracker = memopt::memory::Tracker::instance();
  REQUIRE(tracker.installed());

  const int64_t before = tracker.live_bytes();
  {
    const llada::TeacherTargets t = distill.teacher_targets(b.inputs);  // (2, 16, 4) + indices + normaliser
    REQUIRE(t.sparse());
    const int64_t targets = t.logits_or_values.nbytes() + t.indices.nbytes() + t.log_normalizer.nbytes();
    CHECK(tracker.live_bytes() - before == targets);  // no activation, no graph left behind
    CHECK(t.logits_or_values.grad_fn() == nullptr);
  }
  CHECK(tracker.live_bytes() == before);

  distill.loss_sum(b, memopt::recompute::None{}).backward();
  for (const auto& p : teacher->parameters()) {
    CHECK_FALSE(p.requires_grad());
    CHECK_FALSE(p.grad().defined());
  }
  int64_t student_grads = 0;
  for (const auto& p : student->parameters()) student_grads += p.grad().defined();
  CHECK(student_grads == static_cast<int64_t>(student->parameters().size()));
}

TEST_CASE("Distiller: teacher_autograd keeps the teacher's graph alive (the naive baseline)", "[distill]") {
  torch::manual_seed(1);
  Llama teacher(tiny(kVocab, true)), student(tiny(kVocab + 1, false));
  Distiller distill(teacher, student, DistillOptions(kVocab).teacher_autograd(true));
  const auto b = batch(2, 16, 2);
  auto& tracker = memopt::memory::Tracker::instance();
  const int64_t before = tracker.live_bytes();
  {
    const llada::TeacherTargets t = distill.teacher_targets(b.inputs);  // dense (2, 16, V)
    CHECK(t.logits_or_values.grad_fn() != nullptr);
    // Saved activations of 2 blocks stay live with the logits: far more than the logits alone.
    CHECK(tracker.live_bytes() - before > 4 * t.logits_or_values.nbytes());
  }
  CHECK(tracker.live_bytes() == before);
  distill.loss_sum(b, memopt::recompute::None{}).backward();
  CHECK(teacher->lm_head->weight.grad().defined());  // wasted work, as in the naive script
  distill.clear_teacher_grads();
  CHECK_FALSE(teacher->lm_head->weight.grad().defined());
}

TEST_CASE("Distiller: loss = (1 - alpha) diffusion + alpha KD on the same masks, alpha 0 needs no teacher",
          "[distill]") {
  torch::manual_seed(3);
  Llama teacher(tiny(kVocab, true)), student(tiny(kVocab + 1, false));
  const auto b = batch(3, 12, 4);
  const double alpha = 0.3, T = 2.0;
  Distiller distill(teacher, student, DistillOptions(kVocab).alpha(alpha).temperature(T));
  torch::NoGradGuard no_grad;

  torch::manual_seed(5);
  const auto loss = distill.loss_sum(b, memopt::recompute::None{});
  const auto terms = distill.take_terms();
  CHECK(terms.tokens.item<double>() == 36);

  // The same computation by hand, with the same draws (the teacher draws nothing).
  const auto targets = llada::teacher_targets(teacher->forward(b.inputs), 0, T);
  torch::manual_seed(5);
  const auto m = llada::forward_process(b.inputs, kVocab);
  const auto logits = student->forward(m.noisy);
  const auto diffusion = llada::diffusion_loss_sum(logits, b.inputs, m);
  const auto kd = llada::kd_loss_sum(logits, targets, m, T);
  CHECK(terms.diffusion_sum.item<double>() == Approx(diffusion.item<double>()).epsilon(1e-6));
  CHECK(terms.kd_sum.item<double>() == Approx(kd.item<double>()).epsilon(1e-6));
  CHECK(loss.item<double>() == Approx(((1 - alpha) * diffusion + alpha * kd).item<double>()).epsilon(1e-6));

  Distiller alone(Llama(nullptr), student, DistillOptions(kVocab).alpha(0));
  torch::manual_seed(5);
  CHECK(alone.loss_sum(b, memopt::recompute::None{}).item<double>() ==
        Approx(diffusion.item<double>()).epsilon(1e-6));
}

TEST_CASE("Distiller rejects mismatched models and options with a HINT", "[distill]") {
  Llama teacher(tiny(kVocab, true));
  auto throws_hint = [](const std::function<void()>& fn, const std::string& part) {
    memopt::test::require_error(fn, "memopt::models::", {part});
  };
  throws_hint([&] { Distiller(teacher, Llama(tiny(kVocab + 1, true)), DistillOptions(kVocab)); }, "bidirectional");
  throws_hint([&] { Distiller(teacher, Llama(tiny(kVocab, false)), DistillOptions(kVocab)); },
              "teacher's plus one mask token");
  throws_hint([&] { Distiller(Llama(tiny(kVocab, false)), Llama(tiny(kVocab + 1, false)), DistillOptions(kVocab)); },
              "autoregressive");
  throws_hint([&] { Distiller(Llama(nullptr), Llama(tiny(kVocab + 1, false)), DistillOptions(kVocab)); },
              "no teacher");
  throws_hint([&] { Distiller(teacher, Llama(tiny(kVocab + 1, false)), DistillOptions(kVocab).alpha(1.5)); },
              "alpha");
  throws_hint([&] { Distiller(teacher, Llama(tiny(kVocab + 1, false)), DistillOptions(kVocab).top_k(99)); },
              "top_k");
}
